//! The map's table of volume block -> (slot, index): eight bytes per
//! mapped block. It owns only that table; the slots' live counts and
//! block lists are [`super::StripeMap`]'s.
//!
//! Blocks are grouped in chunks of [`CHUNK_BLOCKS`] neighbours, each a
//! sorted vector of packed entries (the block's place in its chunk, the
//! slot, the index), only for chunks with a mapped block. A tree of one
//! entry per block cost 49 to 59 bytes per block (`bench/RESULTS.md`);
//! a chunk costs its entries plus one tree entry per 256 blocks.

use super::Loc;
use std::collections::BTreeMap;

/// Blocks per chunk: an entry's place in its chunk is one byte.
const CHUNK_BLOCKS: u64 = 256;
/// Bits of an entry for the block's place in its chunk (the top ones,
/// so entries sort by place).
const PLACE_SHIFT: u32 = 56;
/// Bits of an entry for the index among a stripe's data blocks: 4,095
/// at most, where a stripe of the widest geometry holds 124.
const INDEX_BITS: u32 = 12;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
/// Slots an entry can name: 2^44 - 1, each a stripe of at least 62
/// blocks of 4 KiB, far past any volume's.
const SLOT_LIMIT: u64 = (1 << (PLACE_SHIFT - INDEX_BITS)) - 1;

/// Volume block -> where it is destaged, for the mapped blocks only.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct BlockMap {
    /// By chunk (block / 256): the chunk's entries sorted by place, never
    /// empty.
    chunks: BTreeMap<u64, Vec<u64>>,
    len: usize,
}

fn pack(place: u64, l: Loc) -> u64 {
    assert!(
        l.slot < SLOT_LIMIT && u64::from(l.index) <= INDEX_MASK,
        "slot {} index {} past what the map holds",
        l.slot,
        l.index
    );
    (place << PLACE_SHIFT) | ((l.slot + 1) << INDEX_BITS) | u64::from(l.index)
}

fn place_of(e: u64) -> u64 {
    e >> PLACE_SHIFT
}

fn loc_of(e: u64) -> Loc {
    let slot_bits = (e & ((1 << PLACE_SHIFT) - 1)) >> INDEX_BITS;
    Loc {
        slot: slot_bits - 1,
        index: (e & INDEX_MASK) as u16,
    }
}

/// The chunk of block `b` and its place there.
fn split(b: u64) -> (u64, u64) {
    (b / CHUNK_BLOCKS, b % CHUNK_BLOCKS)
}

impl BlockMap {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(super) fn get(&self, b: u64) -> Option<Loc> {
        let (c, place) = split(b);
        let entries = self.chunks.get(&c)?;
        let i = entries
            .binary_search_by_key(&place, |&e| place_of(e))
            .ok()?;
        Some(loc_of(entries[i]))
    }

    /// Maps `b` to `l`: where it was, if mapped.
    pub(super) fn insert(&mut self, b: u64, l: Loc) -> Option<Loc> {
        let (c, place) = split(b);
        let e = pack(place, l);
        let entries = self.chunks.entry(c).or_default();
        match entries.binary_search_by_key(&place, |&e| place_of(e)) {
            Ok(i) => Some(loc_of(std::mem::replace(&mut entries[i], e))),
            Err(i) => {
                // Grown by a quarter, not doubled: a chunk's spare room
                // stays a quarter of its entries at most.
                if entries.len() == entries.capacity() {
                    // A place is free, so there is room for one more.
                    let room = CHUNK_BLOCKS as usize - entries.len();
                    entries.reserve_exact((entries.len() / 4).max(4).min(room));
                }
                entries.insert(i, e);
                self.len += 1;
                None
            }
        }
    }

    /// Forgets `b`: where it was, if mapped.
    pub(super) fn remove(&mut self, b: u64) -> Option<Loc> {
        let (c, place) = split(b);
        let entries = self.chunks.get_mut(&c)?;
        let i = entries
            .binary_search_by_key(&place, |&e| place_of(e))
            .ok()?;
        let old = loc_of(entries.remove(i));
        self.len -= 1;
        if entries.is_empty() {
            self.chunks.remove(&c);
        } else if entries.capacity() > 2 * entries.len() + 8 {
            entries.shrink_to(entries.len() + entries.len() / 4);
        }
        Some(old)
    }

    /// The mapped blocks among `first..end`, in order, with where each
    /// is.
    pub(super) fn range(
        &self,
        first: u64,
        end: u64,
    ) -> impl DoubleEndedIterator<Item = (u64, Loc)> + '_ {
        use std::ops::Bound::{Excluded, Included};
        let chunks = match first < end {
            true => (
                Included(first / CHUNK_BLOCKS),
                Included((end - 1) / CHUNK_BLOCKS),
            ),
            false => (Included(0), Excluded(0)),
        };
        let chunks = self.chunks.range(chunks);
        chunks.flat_map(move |(&c, entries)| {
            let base = c * CHUNK_BLOCKS;
            let from = entries.partition_point(|&e| base + place_of(e) < first);
            let to = entries
                .partition_point(|&e| base + place_of(e) < end)
                .max(from);
            entries[from..to]
                .iter()
                .map(move |&e| (base + place_of(e), loc_of(e)))
        })
    }

    /// Every mapped block, in order.
    pub(super) fn iter(&self) -> impl DoubleEndedIterator<Item = (u64, Loc)> + '_ {
        self.range(0, u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Insert(u64, Loc),
        Remove(u64),
        Range(u64, u64),
    }

    /// Blocks near each other (one chunk and its neighbours) and far
    /// apart; slots and indexes up to the widest the map holds.
    fn block() -> impl Strategy<Value = u64> {
        prop_oneof![
            0..700u64,
            (1u64 << 40)..(1u64 << 40) + 300,
            Just(u64::MAX - 1)
        ]
    }

    fn step() -> impl Strategy<Value = Step> {
        let loc = (
            prop_oneof![0..100u64, Just(SLOT_LIMIT - 1)],
            0..=INDEX_MASK as u16,
        )
            .prop_map(|(slot, index)| Loc { slot, index });
        prop_oneof![
            4 => (block(), loc).prop_map(|(b, l)| Step::Insert(b, l)),
            2 => block().prop_map(Step::Remove),
            1 => (block(), block()).prop_map(|(a, b)| Step::Range(a, b)),
        ]
    }

    proptest! {
        /// The chunked table answers as a tree of one entry per block
        /// does, after any inserts and removes.
        #[test]
        fn the_table_is_a_map_of_blocks(steps in proptest::collection::vec(step(), 1..400)) {
            let mut t = BlockMap::default();
            let mut model: BTreeMap<u64, Loc> = BTreeMap::new();
            for s in steps {
                match s {
                    Step::Insert(b, l) => prop_assert_eq!(t.insert(b, l), model.insert(b, l)),
                    Step::Remove(b) => prop_assert_eq!(t.remove(b), model.remove(&b)),
                    Step::Range(a, b) => {
                        let got: Vec<_> = t.range(a, b).collect();
                        let want: Vec<_> = match a < b {
                            true => model.range(a..b).map(|(&b, &l)| (b, l)).collect(),
                            false => Vec::new(),
                        };
                        prop_assert_eq!(&got, &want);
                        let back: Vec<_> = t.range(a, b).rev().collect();
                        prop_assert_eq!(back, want.into_iter().rev().collect::<Vec<_>>());
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                prop_assert_eq!(t.is_empty(), model.is_empty());
                for (&b, &l) in &model {
                    prop_assert_eq!(t.get(b), Some(l));
                }
                let all: Vec<_> = t.iter().collect();
                prop_assert_eq!(all, model.iter().map(|(&b, &l)| (b, l)).collect::<Vec<_>>());
                for entries in t.chunks.values() {
                    prop_assert!(!entries.is_empty());
                    prop_assert!(entries.capacity() <= CHUNK_BLOCKS as usize + 8);
                }
            }
        }
    }

    /// A chunk whose vector is full at 253 entries still takes the
    /// last three (found in review: the growth was clamped between 4 and
    /// the room left, which panics with less than 4 left).
    #[test]
    fn a_chunk_fills_to_its_last_place_from_any_capacity() {
        let mut t = BlockMap::default();
        let l = Loc { slot: 1, index: 0 };
        let mut mapped = 0u64;
        for (add, drop) in [(13, 10), (125, 54), (70, 60), (169, 0)] {
            for _ in 0..add {
                t.insert(mapped, l);
                mapped += 1;
            }
            for b in mapped - drop..mapped {
                t.remove(b);
            }
            mapped -= drop;
        }
        assert_eq!(t.len(), 253);
        for b in 253..256 {
            assert_eq!(t.insert(b, l), None);
        }
        let full = &t.chunks[&0];
        assert_eq!((full.len(), full.capacity()), (256, 256));
        // And a copy, whose capacity is its length, too.
        let mut c = t.clone();
        for b in 0..256 {
            c.remove(b);
            assert_eq!(c.insert(b, l), None);
        }
        for len in 0..=256u64 {
            let mut t = BlockMap::default();
            for b in 0..len {
                t.insert(b, l);
            }
            let mut c = t.clone();
            for b in len..256 {
                assert_eq!(c.insert(b, l), None);
            }
        }
    }

    #[test]
    #[should_panic(expected = "past what the map holds")]
    fn a_slot_past_the_limit_is_refused() {
        BlockMap::default().insert(
            0,
            Loc {
                slot: SLOT_LIMIT,
                index: 0,
            },
        );
    }
}
