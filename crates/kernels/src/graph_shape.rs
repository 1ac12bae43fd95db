//! What stream capture makes of a step: its kernels, its memory nodes and how the programmatic
//! dependents hang on the nodes before them.
//!
//! Every tensor allocated or dropped between two launches on the capturing stream becomes a memory
//! node between them (`cuMemAllocAsync` / `cuMemFreeAsync`), so a kernel launched as a
//! programmatic dependent right after an allocation depends on that node by a full edge: it starts
//! only once the kernel before has ended, as a plain launch would. [`shape`] counts the dependents
//! that capture could hang on the kernel before them (a programmatic edge) and those it could not.
//! The graph API cannot move the memory nodes afterwards (a graph holding them can be neither
//! cloned nor have edges removed), so the capture itself must place them: a capture with detached
//! allocations (`graph::CaptureOptions`) hangs each kernel's allocations on the graph's root and
//! each dependent on what the frees before it hang on ([`past_frees`]), so the dependent keeps its
//! programmatic edge to the kernel before it.

/// What a node of a captured graph is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A kernel; `dependent`: launched as a programmatic dependent of the launch before it.
    Kernel {
        dependent: bool,
    },
    Alloc,
    Free,
    /// Anything else (copies, memsets, events).
    Other,
}

/// An edge's kind: a full dependency, or a programmatic one (the node after may start once the
/// kernel before has triggered its dependents).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    Full,
    Programmatic,
}

/// The counts [`shape`] finds in a captured graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphShape {
    pub kernels: usize,
    pub memory_nodes: usize,
    /// kernels launched as programmatic dependents
    pub dependents: usize,
    /// dependents on a programmatic edge from the kernel before them
    pub overlapping: usize,
    /// dependents whose only predecessor is a memory node (they start once the kernel before ends)
    pub behind_memory: usize,
}

/// Counts `kinds` (one per node) and how each dependent kernel hangs on its predecessors in
/// `edges` (from, to, kind; node indices).
pub fn shape(kinds: &[Kind], edges: &[(usize, usize, Edge)]) -> GraphShape {
    let mut s = GraphShape::default();
    for k in kinds {
        match k {
            Kind::Kernel { dependent } => {
                s.kernels += 1;
                s.dependents += usize::from(*dependent);
            }
            Kind::Alloc | Kind::Free => s.memory_nodes += 1,
            Kind::Other => {}
        }
    }
    // each node's incoming edges: (from, kind)
    let mut ins = vec![Vec::new(); kinds.len()];
    for &(from, to, e) in edges {
        if let Some(v) = ins.get_mut(to) {
            v.push((from, e));
        }
    }
    for (k, ins) in kinds.iter().zip(&ins) {
        if *k != (Kind::Kernel { dependent: true }) {
            continue;
        }
        if ins.iter().any(|&(_, e)| e == Edge::Programmatic) {
            s.overlapping += 1;
        } else if let [(from, _)] = ins.as_slice() {
            if matches!(kinds.get(*from), Some(Kind::Alloc | Kind::Free)) {
                s.behind_memory += 1;
            }
        }
    }
    s
}

/// The dependencies a node should take in place of `deps` so that no free node stands between it
/// and the work before: each free (per `is_free`) is replaced by its own dependencies (`parents`),
/// repeatedly; every other node stays, once, in the order first met, with its edge data. A free
/// left out this way becomes a leaf of the graph, still after everything that used its memory.
pub fn past_frees<N, E, X>(
    deps: &[(N, E)],
    mut is_free: impl FnMut(N) -> std::result::Result<bool, X>,
    mut parents: impl FnMut(N) -> std::result::Result<Vec<(N, E)>, X>,
) -> std::result::Result<Vec<(N, E)>, X>
where
    N: Copy + Eq + std::hash::Hash,
    E: Copy,
{
    let mut kept = Vec::with_capacity(deps.len());
    let mut seen = std::collections::HashSet::new();
    // depth first, so kept nodes keep the order of the edges they came from
    let mut todo: Vec<(N, E)> = deps.iter().rev().copied().collect();
    while let Some((n, e)) = todo.pop() {
        if !seen.insert(n) {
            continue;
        }
        if is_free(n)? {
            todo.extend(parents(n)?.into_iter().rev());
        } else {
            kept.push((n, e));
        }
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEP: Kind = Kind::Kernel { dependent: true };
    const PLAIN: Kind = Kind::Kernel { dependent: false };

    #[test]
    fn dependents_are_counted_by_what_they_hang_on() {
        // 0 K -P-> 1 dep; 1 -> 2 alloc -> 3 dep; 3 -> 4 free -> 5 dep; 5 -> 6 memset -> 7 dep;
        // 7 -> 8 plain
        let kinds = [
            PLAIN,
            DEP,
            Kind::Alloc,
            DEP,
            Kind::Free,
            DEP,
            Kind::Other,
            DEP,
            PLAIN,
        ];
        let mut edges: Vec<_> = (1..kinds.len()).map(|i| (i - 1, i, Edge::Full)).collect();
        edges[0].2 = Edge::Programmatic;
        let s = shape(&kinds, &edges);
        assert_eq!(
            s,
            GraphShape {
                kernels: 6,
                memory_nodes: 2,
                dependents: 4,
                overlapping: 1,
                behind_memory: 2,
            }
        );
    }

    #[test]
    fn a_dependent_with_a_programmatic_edge_and_an_allocation_overlaps() {
        // what a capture that kept the kernel edge would give: 0 -P-> 2, 1 alloc -> 2
        let kinds = [PLAIN, Kind::Alloc, DEP];
        let edges = [(0, 2, Edge::Programmatic), (1, 2, Edge::Full)];
        let s = shape(&kinds, &edges);
        assert_eq!((s.overlapping, s.behind_memory), (1, 0));
        assert_eq!(shape(&[], &[]), GraphShape::default());
    }

    #[test]
    fn frees_give_way_to_what_they_hang_on() {
        // 1 kernel, 2 alloc (a root), 3 free after 1, 4 free after 3 and 2, 5 free after 1
        let free = |n: u32| Ok::<_, ()>(matches!(n, 3..=5));
        let parents = |n: u32| {
            Ok(match n {
                3 | 5 => vec![(1, 'p')],
                4 => vec![(3, 'f'), (2, 'a')],
                _ => vec![],
            })
        };
        let lifted = past_frees(&[(4, 'x'), (5, 'y')], free, parents);
        assert_eq!(lifted, Ok(vec![(1, 'p'), (2, 'a')]));
        // nothing to lift: kept as is, duplicates once
        let plain = past_frees(&[(1, 'k'), (2, 'a'), (1, 'k')], free, parents);
        assert_eq!(plain, Ok(vec![(1, 'k'), (2, 'a')]));
        assert_eq!(past_frees(&[], free, parents), Ok(vec![]));
        // a failing lookup is passed on
        let failing = past_frees(&[(3, 'x')], free, |_| Err(()));
        assert_eq!(failing, Err(()));
    }
}
