//! Stop strings matched in time linear in the generated text: an Aho-Corasick automaton over the
//! bytes of a request's stop strings, stepped once per new byte of text.
//!
//! [`StopStrings`] is built once per request (shared by its completions); each completion keeps
//! a [`StopScan`] (the automaton state). The state also answers the streaming holdback: its
//! depth is the longest tail of the text that is a prefix of some stop string, which is exactly
//! what must be held back until the next token tells whether the stop string completes.
//! Nothing here knows tokens or UTF-8 beyond this: a match starts where its pattern's first byte
//! does, so it always starts on a character boundary of valid text.

const ROOT: u32 = 0;
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    /// Children by byte, sorted.
    next: Vec<(u8, u32)>,
    /// The longest proper suffix of this node's string that is also in the trie.
    fail: u32,
    /// Bytes from the root.
    depth: u32,
    /// The pattern that ends exactly here, if any.
    out: Option<u32>,
    /// The nearest node along the failure chain (this one excluded) that ends a pattern.
    dict: u32,
}

impl Node {
    fn new(depth: u32) -> Self {
        Self {
            next: Vec::new(),
            fail: ROOT,
            depth,
            out: None,
            dict: NONE,
        }
    }

    fn child(&self, b: u8) -> Option<u32> {
        self.next
            .binary_search_by_key(&b, |&(k, _)| k)
            .ok()
            .map(|i| self.next[i].1)
    }
}

/// A request's stop strings as one automaton.
#[derive(Debug, Clone)]
pub struct StopStrings {
    patterns: Vec<String>,
    nodes: Vec<Node>,
}

/// Where one completion's text stands in the automaton.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StopScan {
    state: u32,
}

/// A stop string found in the text: its byte offset and which string it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopMatch {
    pub start: usize,
    pub pattern: usize,
}

impl StopStrings {
    /// The automaton of `patterns`; empty strings are ignored.
    pub fn new(patterns: Vec<String>) -> Self {
        let patterns: Vec<String> = patterns.into_iter().filter(|s| !s.is_empty()).collect();
        let mut nodes = vec![Node::new(0)];
        for (pi, p) in patterns.iter().enumerate() {
            let mut s = ROOT;
            for &b in p.as_bytes() {
                s = match nodes[s as usize].child(b) {
                    Some(c) => c,
                    None => {
                        let c = nodes.len() as u32;
                        let depth = nodes[s as usize].depth + 1;
                        nodes.push(Node::new(depth));
                        let next = &mut nodes[s as usize].next;
                        let at = next.partition_point(|&(k, _)| k < b);
                        next.insert(at, (b, c));
                        c
                    }
                };
            }
            // a repeated pattern keeps its first index
            nodes[s as usize].out.get_or_insert(pi as u32);
        }
        // failure and dictionary links, breadth first
        let mut queue: std::collections::VecDeque<u32> =
            nodes[0].next.iter().map(|&(_, c)| c).collect();
        while let Some(s) = queue.pop_front() {
            let children = nodes[s as usize].next.clone();
            for (b, c) in children {
                let mut f = nodes[s as usize].fail;
                let fail = loop {
                    if let Some(x) = nodes[f as usize].child(b) {
                        break x;
                    }
                    if f == ROOT {
                        break ROOT;
                    }
                    f = nodes[f as usize].fail;
                };
                let fail = if fail == c { ROOT } else { fail };
                let fnode = &nodes[fail as usize];
                let dict = if fnode.out.is_some() {
                    fail
                } else {
                    fnode.dict
                };
                let node = &mut nodes[c as usize];
                node.fail = fail;
                node.dict = dict;
                queue.push_back(c);
            }
        }
        Self { patterns, nodes }
    }

    pub fn is_empty(&self) -> bool {
        self.patterns.is_empty()
    }

    pub fn pattern(&self, i: usize) -> &str {
        &self.patterns[i]
    }

    fn step(&self, mut s: u32, b: u8) -> u32 {
        loop {
            if let Some(c) = self.nodes[s as usize].child(b) {
                return c;
            }
            if s == ROOT {
                return ROOT;
            }
            s = self.nodes[s as usize].fail;
        }
    }

    /// Feeds `bytes`, the text from byte offset `offset` on, and returns the match that starts
    /// earliest among those ending inside `bytes`. Amortized O(bytes + matches).
    pub fn feed(&self, scan: &mut StopScan, bytes: &[u8], offset: usize) -> Option<StopMatch> {
        if self.is_empty() {
            return None;
        }
        let mut best: Option<StopMatch> = None;
        for (i, &b) in bytes.iter().enumerate() {
            scan.state = self.step(scan.state, b);
            let end = offset + i + 1;
            let m = if self.nodes[scan.state as usize].out.is_some() {
                scan.state
            } else {
                self.nodes[scan.state as usize].dict
            };
            // the first node on the chain is the longest pattern ending here: the earliest start
            // for this end (of two starting together, the one that ends first wins)
            if m != NONE {
                let node = &self.nodes[m as usize];
                let start = end - node.depth as usize;
                if best.is_none_or(|x| start < x.start) {
                    best = Some(StopMatch {
                        start,
                        pattern: node.out.unwrap_or(0) as usize,
                    });
                }
            }
        }
        best
    }

    /// Bytes at the end of the text fed so far that could begin a stop string.
    pub fn holdback(&self, scan: StopScan) -> usize {
        self.nodes[scan.state as usize].depth as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_first(text: &str, from: usize, stops: &[&str]) -> Option<(usize, String)> {
        let back = stops.iter().map(|s| s.len()).max().unwrap_or(1) - 1;
        let mut lo = from.saturating_sub(back);
        while !text.is_char_boundary(lo) {
            lo -= 1;
        }
        stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text[lo..].find(s).map(|p| (lo + p, s.to_string())))
            .filter(|(p, s)| p + s.len() > from)
            .min_by_key(|(p, s)| (*p, s.len()))
    }

    fn naive_holdback(text: &str, stops: &[&str]) -> usize {
        stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(|k| &s[..k])
            })
            .filter(|p| text.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn matches_the_naive_search_piece_by_piece() {
        let stops = ["STOP", "bc", "abcd", "aab", "中文!", "ab", "b"];
        let texts = ["xxaabcdSTOP", "zzzz", "aaab", "中文中文!", "STSTOP", "xab"];
        for subset in 1..(1u32 << stops.len()) {
            let chosen: Vec<&str> = (0..stops.len())
                .filter(|i| subset >> i & 1 == 1)
                .map(|i| stops[i])
                .collect();
            let ac = StopStrings::new(chosen.iter().map(|s| s.to_string()).collect());
            for text in texts {
                for piece in [1, 2, 3] {
                    let mut scan = StopScan::default();
                    let mut fed = 0;
                    let chars: Vec<(usize, char)> = text.char_indices().collect();
                    for group in chars.chunks(piece) {
                        let end = group.last().map_or(fed, |&(i, c)| i + c.len_utf8());
                        let got = ac.feed(&mut scan, &text.as_bytes()[fed..end], fed);
                        let want = naive_first(&text[..end], fed, &chosen);
                        assert_eq!(
                            got.map(|m| (m.start, ac.pattern(m.pattern).to_string())),
                            want,
                            "{chosen:?} {text:?} up to {end}"
                        );
                        fed = end;
                        if got.is_some() {
                            break;
                        }
                        assert_eq!(
                            ac.holdback(scan),
                            naive_holdback(&text[..end], &chosen),
                            "{chosen:?} {text:?} up to {end}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn long_texts_and_many_strings_cost_linear_time() {
        let stops: Vec<String> = (0..256)
            .map(|i| format!("{}{i}", "x".repeat(500)))
            .collect();
        let ac = StopStrings::new(stops);
        let mut scan = StopScan::default();
        let text = "x".repeat(200_000);
        let t = std::time::Instant::now();
        for (i, chunk) in text.as_bytes().chunks(3).enumerate() {
            assert!(ac.feed(&mut scan, chunk, i * 3).is_none());
            assert!(ac.holdback(scan) <= 500);
        }
        // generous: a quadratic scan of this input takes minutes
        assert!(t.elapsed().as_secs() < 5);
    }
}
