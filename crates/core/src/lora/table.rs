//! Which adapter sits in which device slot. Pure: adapter ids in, slot numbers and the writes to
//! make out. A step's adapters (at most as many as there are slots, which the scheduler
//! guarantees) keep the slots they hold; each missing one takes an empty slot, else the slot used
//! least recently by an adapter this step does not need.

use super::AdapterId;
use std::collections::HashMap;

/// The slots and their adapters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTable {
    resident: Vec<Option<AdapterId>>,
    last_used: Vec<u64>,
    tick: u64,
}

/// A step's placement: each adapter's slot, and the slots to (re)write with their new adapter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    pub slot_of: HashMap<AdapterId, u32>,
    pub writes: Vec<(usize, AdapterId)>,
}

impl SlotTable {
    pub fn new(num_slots: usize) -> Self {
        Self {
            resident: vec![None; num_slots],
            last_used: vec![0; num_slots],
            tick: 0,
        }
    }

    pub fn slot_of(&self, id: AdapterId) -> Option<usize> {
        self.resident.iter().position(|&r| r == Some(id))
    }

    /// The adapters resident now, by slot.
    pub fn resident(&self) -> &[Option<AdapterId>] {
        &self.resident
    }

    /// Places the adapters of one step (duplicates allowed); an error when they are more than the
    /// slots.
    pub fn assign(&mut self, ids: &[AdapterId]) -> Result<Placement, String> {
        self.tick += 1;
        let mut wanted: Vec<AdapterId> = ids.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        if wanted.len() > self.resident.len() {
            return Err(format!(
                "{} adapters in one step but {} slots",
                wanted.len(),
                self.resident.len()
            ));
        }
        let mut out = Placement::default();
        let mut missing = Vec::new();
        for &id in &wanted {
            match self.slot_of(id) {
                Some(s) => {
                    self.last_used[s] = self.tick;
                    out.slot_of.insert(id, s as u32);
                }
                None => missing.push(id),
            }
        }
        for id in missing {
            let free = self.resident.iter().position(Option::is_none);
            let slot = match free {
                Some(s) => s,
                None => (0..self.resident.len())
                    .filter(|&s| self.last_used[s] < self.tick)
                    .min_by_key(|&s| self.last_used[s])
                    .ok_or("no slot to evict")?,
            };
            self.resident[slot] = Some(id);
            self.last_used[slot] = self.tick;
            out.slot_of.insert(id, slot as u32);
            out.writes.push((slot, id));
        }
        Ok(out)
    }

    /// Frees the slot of an adapter that is gone; returns it.
    pub fn evict(&mut self, id: AdapterId) -> Option<usize> {
        let s = self.slot_of(id)?;
        self.resident[s] = None;
        self.last_used[s] = 0;
        Some(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<AdapterId> {
        v.iter().map(|&i| AdapterId(i)).collect()
    }

    #[test]
    fn adapters_keep_their_slots_and_the_least_recent_one_is_evicted() {
        let mut t = SlotTable::new(2);
        let p = t.assign(&ids(&[7, 7, 3])).unwrap();
        assert_eq!(p.slot_of[&AdapterId(3)], 0);
        assert_eq!(p.slot_of[&AdapterId(7)], 1);
        assert_eq!(p.writes, vec![(0, AdapterId(3)), (1, AdapterId(7))]);
        // resident ones are not rewritten
        let p = t.assign(&ids(&[7])).unwrap();
        assert!(p.writes.is_empty());
        assert_eq!(p.slot_of[&AdapterId(7)], 1);
        // 3 (slot 0) was used least recently: 9 takes its slot
        let p = t.assign(&ids(&[9, 7])).unwrap();
        assert_eq!(p.writes, vec![(0, AdapterId(9))]);
        assert_eq!(t.resident(), &[Some(AdapterId(9)), Some(AdapterId(7))]);
        // a step never evicts an adapter it needs itself
        let p = t.assign(&ids(&[9, 4])).unwrap();
        assert_eq!(p.writes, vec![(1, AdapterId(4))]);
        assert_eq!(p.slot_of[&AdapterId(9)], 0);
    }

    #[test]
    fn more_adapters_than_slots_is_an_error_and_eviction_frees_a_slot() {
        let mut t = SlotTable::new(1);
        assert!(t.assign(&ids(&[1, 2])).is_err());
        t.assign(&ids(&[1])).unwrap();
        assert_eq!(t.evict(AdapterId(1)), Some(0));
        assert_eq!(t.evict(AdapterId(1)), None);
        let p = t.assign(&ids(&[2])).unwrap();
        assert_eq!(p.writes, vec![(0, AdapterId(2))]);
        assert!(t.assign(&[]).unwrap().slot_of.is_empty());
    }
}
