//! The capacity leg's map of a RAID-5/6 volume (`docs/erasure-coding.md`):
//! which stripe slot holds each destaged block, and the two on-disk forms
//! it is kept in, the stripes' summary blocks and the map log.
//!
//! Owns the in-memory map and its records' formats, and rebuilds the map
//! from whatever records survived a crash. Never does I/O: the owner reads
//! and writes the records and stripes, in the order the design note gives.
//!
//! The writer's rules, which replay relies on (and the property test
//! checks with a circular log and torn writes):
//! - one write of the log in flight at a time (one record, or several
//!   parts of a checkpoint): written once the one before it is durable,
//!   its records applied (their blocks trimmed from the performance leg)
//!   only then; a checkpoint taken from the applied map so covers every
//!   record before its seq. Replay stops at the first missing seq all the
//!   same;
//! - a checkpoint is taken from the applied map, part by part, nothing
//!   else recorded meanwhile, and a new one is written before the log
//!   could wrap over the newest complete one;
//! - a new owner starts from [`StripeMap::recover`] and first finishes
//!   the checkpoint the log ends inside, or writes one.

mod blocks;
mod columns;
mod format;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_columns;
#[cfg(test)]
mod tests_tier;
mod tier;

pub use columns::{summary_of, Columns, StripeError, Unit, BLOCK_BYTES, UNIT_BYTES};
pub use tier::{
    classify, log_records_for, Applied, Destage, DirectFailed, Grown, LogPlace, Source, Ticket,
    Tier, TierError, WrittenScan, Zeroing, CLEAN_RESERVE_SLOTS, MAX_DIRECT_STRIPES,
    UNMAP_RECORD_MAPPED_BLOCKS,
};

pub use format::{
    MapRecord, RecordError, Run, StripeEntry, Summary, BLOCKS_PER_UNIT, MAX_SUMMARY_BLOCKS,
    PAD_BLOCK, RECORD_BYTES, STRIPES_PAYLOAD_BYTES,
};

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Where a destaged block is: stripe slot and its place among the
/// stripe's data blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Loc {
    pub slot: u64,
    pub index: u16,
}

/// The map of one volume's capacity leg, with the indexes the owner asks
/// of it on every stripe: the cleaner's emptiest slots and their blocks,
/// and the lowest free slot, each found without a walk over the whole
/// map (a volume of a TiB has 268 million blocks in 4 million slots).
#[derive(Debug, Clone, Default)]
pub struct StripeMap {
    blocks: blocks::BlockMap,
    /// Live (mapped) blocks per slot; a slot absent here is free.
    live: BTreeMap<u64, u32>,
    /// `(live, slot)` of every used slot: the emptiest first.
    by_live: BTreeSet<(u32, u64)>,
    /// The block each index of a used slot was mapped to, by slot
    /// (`PAD_BLOCK` where none was): a block listed here is in the slot
    /// only while `blocks` still says so.
    slot_blocks: HashMap<u64, Vec<u64>>,
    /// Free slots below `high`, the slot after the highest used one.
    holes: BTreeSet<u64>,
    high: u64,
    /// The last stripe seq applied: the next stripe takes one more.
    last_stripe_seq: u64,
    /// The last record seq applied.
    last_record_seq: u64,
    /// Where the log stood when this map was recovered from it (default
    /// for a map built otherwise).
    tail: LogTail,
}

/// Where a recovered map's log stands, for the records a new owner writes
/// next (`docs/erasure-coding.md`, A new owner).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogTail {
    /// The first seq of the newest complete checkpoint (replay's start).
    pub complete_from: u64,
    /// The highest record seq found. Records past the replayed ones, if
    /// any, are parts of a checkpoint torn amid one write (anything else
    /// there makes [`StripeMap::recover`] number above them all).
    pub found_upto: u64,
    /// The checkpoint the replayed records end inside (parts from its
    /// part 0 up to the last record replayed, none marked last): its next
    /// part, and the block that part starts at (where the last one
    /// ended).
    pub resume: Option<(u32, u64)>,
}

/// Blocks counted per slot: those that left each slot in one update.
#[derive(Default)]
struct SlotCounts(HashMap<u64, u32>);

impl SlotCounts {
    fn add(&mut self, slot: u64) {
        *self.0.entry(slot).or_default() += 1;
    }
}

/// Two maps are equal when they map the same blocks to the same places
/// and have applied the same records; the indexes follow from that.
impl PartialEq for StripeMap {
    fn eq(&self, other: &StripeMap) -> bool {
        self.blocks == other.blocks
            && self.last_stripe_seq == other.last_stripe_seq
            && self.last_record_seq == other.last_record_seq
    }
}

impl Eq for StripeMap {}

/// Why records cannot be replayed into a map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MapError {
    #[error("map record {got} applied after record {last}: records apply in order")]
    OutOfOrder { last: u64, got: u64 },
    #[error("stripe {seq} in slot {slot}, which still holds {live} live blocks")]
    SlotInUse { seq: u64, slot: u64, live: u32 },
    #[error("no complete checkpoint among the map records")]
    NoCheckpoint,
    #[error("map record {seq} names a {what} outside the volume's capacity leg")]
    Outside { seq: u64, what: &'static str },
}

/// What a volume's map records may name: its blocks, its capacity leg's
/// slots, and a stripe's data blocks. A replayed record past them (a
/// log that is not this volume's, or a writer's bug) is refused before
/// anything is built from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapBounds {
    pub blocks: u64,
    pub slots: u64,
    pub blocks_per_stripe: u64,
}

impl MapBounds {
    /// Loose bounds, for tests of the log alone (a replay under them
    /// may still allocate for up to 2^32 slots).
    pub const ANY: MapBounds = MapBounds {
        blocks: u64::MAX - 1,
        slots: 1 << 32,
        blocks_per_stripe: format::MAX_SUMMARY_BLOCKS as u64,
    };

    /// The bounds of a volume of `volume_bytes` on columns `c`.
    pub fn of(c: &Columns, volume_bytes: u64) -> MapBounds {
        MapBounds {
            blocks: volume_bytes.div_ceil(BLOCK_BYTES as u64),
            slots: c.column_bytes(volume_bytes) / UNIT_BYTES,
            blocks_per_stripe: c.blocks_per_stripe() as u64,
        }
    }

    /// What `rec` names past these bounds, if anything.
    fn outside(&self, rec: &MapRecord) -> Option<&'static str> {
        let stripe = |slot: u64, blocks: &[u64]| {
            let past = |&b: &u64| b != PAD_BLOCK && b >= self.blocks;
            match () {
                _ if slot >= self.slots => Some("slot"),
                _ if blocks.len() as u64 > self.blocks_per_stripe => Some("stripe of more blocks"),
                _ if blocks.iter().any(past) => Some("block"),
                _ => None,
            }
        };
        match rec {
            MapRecord::Stripe { slot, blocks, .. } => stripe(*slot, blocks),
            MapRecord::Stripes { stripes, .. } => {
                stripes.iter().find_map(|s| stripe(s.slot, &s.blocks))
            }
            MapRecord::Unmap { .. } => None,
            MapRecord::Checkpoint { runs, .. } => runs.iter().find_map(|r| {
                let len = u64::from(r.len);
                match () {
                    _ if r.slot >= self.slots => Some("slot"),
                    _ if u64::from(r.index) + len > self.blocks_per_stripe => Some("stripe index"),
                    _ if r.block.saturating_add(len) > self.blocks => Some("block"),
                    _ => None,
                }
            }),
        }
    }
}

impl StripeMap {
    /// Where block `block` is, if destaged.
    pub fn get(&self, block: u64) -> Option<Loc> {
        self.blocks.get(block)
    }

    /// Blocks destaged and mapped.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Slots holding live blocks.
    pub fn used_slots(&self) -> usize {
        self.live.len()
    }

    /// The slots holding live blocks, in order.
    pub fn live_slots(&self) -> Vec<u64> {
        self.live.keys().copied().collect()
    }

    /// The mapped blocks of `slots`, with where each is, slot by slot.
    pub fn blocks_in(&self, slots: &[u64]) -> Vec<(u64, Loc)> {
        let mut out = Vec::new();
        for &slot in slots {
            let Some(listed) = self.slot_blocks.get(&slot) else {
                continue;
            };
            for (i, &b) in listed.iter().enumerate() {
                let loc = Loc {
                    slot,
                    index: i as u16,
                };
                if b != PAD_BLOCK && self.blocks.get(b) == Some(loc) {
                    out.push((b, loc));
                }
            }
        }
        out
    }

    /// The lowest and highest mapped blocks among `first..end`, if any.
    pub fn mapped_bounds(&self, first: u64, end: u64) -> Option<(u64, u64)> {
        if first >= end {
            return None;
        }
        let mut r = self.blocks.range(first, end);
        let lo = r.next()?.0;
        let hi = r.next_back().map_or(lo, |(b, _)| b);
        Some((lo, hi))
    }

    /// The mapped blocks among `first..end`, in order.
    pub fn mapped_in(&self, first: u64, end: u64) -> Vec<u64> {
        if first >= end {
            return Vec::new();
        }
        self.blocks.range(first, end).map(|(b, _)| b).collect()
    }

    /// The mapped blocks from block `first` on, in order, with where each
    /// is.
    pub fn from_block(&self, first: u64) -> impl Iterator<Item = (u64, Loc)> + '_ {
        self.blocks.range(first, u64::MAX)
    }

    /// The same numbering with no block mapped: what an empty checkpoint
    /// leaves (a volume lowered to RAID-1 forgets its stripes).
    pub fn emptied(&self) -> StripeMap {
        StripeMap {
            last_stripe_seq: self.last_stripe_seq,
            last_record_seq: self.last_record_seq,
            ..StripeMap::default()
        }
    }

    /// Live blocks of slot `slot`.
    pub fn live(&self, slot: u64) -> u32 {
        self.live.get(&slot).copied().unwrap_or(0)
    }

    /// The lowest slot holding no live block: where the next stripe goes.
    pub fn free_slot(&self) -> u64 {
        self.holes.first().copied().unwrap_or(self.high)
    }

    /// The lowest slot holding no live block and not in `busy` (slots
    /// that reads sent earlier may still be reading).
    pub fn free_slot_avoiding(&self, busy: &BTreeSet<u64>) -> u64 {
        if let Some(&s) = self.holes.iter().find(|s| !busy.contains(s)) {
            return s;
        }
        (self.high..)
            .find(|s| !busy.contains(s))
            .unwrap_or(u64::MAX)
    }

    /// The first of `run` free slots in a row, none in `avoid`, among the
    /// `window` slots from the lowest free one not in `avoid`: walks the
    /// free slots there, never the used ones (a direct write's stripes in
    /// consecutive slots go as one write to each column).
    pub fn free_run_avoiding(&self, avoid: &BTreeSet<u64>, run: u64, window: u64) -> Option<u64> {
        assert!(run > 0, "a run of no slots");
        let lowest = self.free_slot_avoiding(avoid);
        let end = lowest.saturating_add(window);
        let free = self.holes.range(lowest..).copied();
        let above = self.high.max(lowest)..end;
        let (mut start, mut len) = (lowest, 0u64);
        for s in free.chain(above).take_while(|&s| s < end) {
            if avoid.contains(&s) {
                len = 0;
                continue;
            }
            if len == 0 || start + len != s {
                (start, len) = (s, 0);
            }
            len += 1;
            if len == run {
                return Some(start);
            }
        }
        None
    }

    /// The stripe seq the next stripe takes.
    pub fn next_stripe_seq(&self) -> u64 {
        self.last_stripe_seq + 1
    }

    /// The record seq the next record takes.
    pub fn next_record_seq(&self) -> u64 {
        self.last_record_seq + 1
    }

    /// Where the log stood when this map was recovered from it.
    pub fn log_tail(&self) -> LogTail {
        self.tail
    }

    /// Numbers the next record above `seq`: records found up to it that
    /// no replay reaches are never followed by one of this writer's.
    pub fn number_above(&mut self, seq: u64) {
        self.last_record_seq = self.last_record_seq.max(seq);
    }

    /// Used slots with their live blocks, fewest first (lowest slot
    /// first among equals): what the cleaner empties.
    pub fn emptiest(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.by_live.iter().map(|&(l, s)| (s, l))
    }

    /// `rec`'s seq, if it comes after every record applied.
    fn in_order(&self, rec: &MapRecord) -> Result<u64, MapError> {
        match rec.seq() {
            seq if seq > self.last_record_seq => Ok(seq),
            got => Err(MapError::OutOfOrder {
                last: self.last_record_seq,
                got,
            }),
        }
    }

    /// Applies one durable record. A stripe record maps its blocks to its
    /// slot (a block mapped elsewhere moves), an unmap record forgets
    /// blocks; a checkpoint part adds its entries. Records apply in seq
    /// order, each once.
    pub fn apply(&mut self, rec: &MapRecord) -> Result<(), MapError> {
        let seq = self.in_order(rec)?;
        match rec {
            MapRecord::Stripe {
                stripe_seq,
                slot,
                blocks,
                ..
            } => self.apply_stripe(*stripe_seq, *slot, blocks)?,
            MapRecord::Stripes { stripes, .. } => {
                for s in stripes {
                    self.apply_stripe(s.stripe_seq, s.slot, &s.blocks)?;
                }
            }
            MapRecord::Unmap { first, count, .. } => {
                // Only the mapped blocks of the range: a whole-volume trim
                // is one record, not a walk over every block number.
                let end = first.saturating_add(*count);
                let mapped: Vec<u64> = self.blocks.range(*first, end).map(|(b, _)| b).collect();
                let mut left = SlotCounts::default();
                for b in mapped {
                    if let Some(old) = self.blocks.remove(b) {
                        left.add(old.slot);
                    }
                }
                self.drop_live(left);
            }
            MapRecord::Checkpoint {
                last_stripe_seq,
                runs,
                ..
            } => {
                for r in runs {
                    let blocks = (0..r.len).map(|i| (r.block + u64::from(i), r.index + i as u16));
                    self.map_into(r.slot, blocks);
                }
                self.last_stripe_seq = self.last_stripe_seq.max(*last_stripe_seq);
            }
        }
        self.last_record_seq = seq;
        self.check();
        Ok(())
    }

    fn apply_stripe(&mut self, stripe_seq: u64, slot: u64, blocks: &[u64]) -> Result<(), MapError> {
        let live = self.live(slot);
        if live > 0 {
            return Err(MapError::SlotInUse {
                seq: stripe_seq,
                slot,
                live,
            });
        }
        let placed = blocks.iter().enumerate().filter(|&(_, &b)| b != PAD_BLOCK);
        self.map_into(slot, placed.map(|(i, &b)| (b, i as u16)));
        self.last_stripe_seq = self.last_stripe_seq.max(stripe_seq);
        Ok(())
    }

    /// Maps `(block, index)` pairs into slot `slot`, the indexes updated
    /// once per slot rather than once per block: a stripe's 62 to 124
    /// blocks cost one tree update of the slot and one of each slot they
    /// left, not four per block (the map was 4 µs of a raid5 4 KiB
    /// write's CPU when updated block by block).
    fn map_into(&mut self, slot: u64, blocks: impl Iterator<Item = (u64, u16)>) {
        let mut left = SlotCounts::default();
        let mut added = 0u32;
        let listed = self.slot_blocks.entry(slot).or_default();
        for (block, index) in blocks {
            match self.blocks.insert(block, Loc { slot, index }) {
                // Moved within the slot: counted there already.
                Some(old) if old.slot == slot => {}
                Some(old) => {
                    left.add(old.slot);
                    added += 1;
                }
                None => added += 1,
            }
            let i = usize::from(index);
            if listed.len() <= i {
                listed.resize(i + 1, PAD_BLOCK);
            }
            listed[i] = block;
        }
        let was = self.live(slot);
        if was + added == 0 {
            self.slot_blocks.remove(&slot);
        } else if added > 0 {
            self.set_live(slot, was, was + added);
        }
        self.drop_live(left);
    }

    /// Slots lose the counted blocks (moved elsewhere or unmapped).
    fn drop_live(&mut self, left: SlotCounts) {
        for (slot, n) in left.0 {
            let was = self.live(slot);
            assert!(was >= n, "{n} blocks left slot {slot}, which had {was}");
            self.set_live(slot, was, was - n);
        }
    }

    /// Slot `slot`'s live count goes from `was` to `now`, and the indexes
    /// with it: a slot that empties is free, one that fills is not.
    fn set_live(&mut self, slot: u64, was: u32, now: u32) {
        if was > 0 {
            self.by_live.remove(&(was, slot));
        }
        if now == 0 {
            self.live.remove(&slot);
            self.slot_blocks.remove(&slot);
            self.holes.insert(slot);
            if slot + 1 == self.high {
                // The highest used slot emptied: the mark drops to the
                // next used one, the free slots between leave the holes
                // at once (a whole-volume unmap frees millions).
                self.high = self.live.keys().next_back().map_or(0, |&s| s + 1);
                drop(self.holes.split_off(&self.high));
            }
            return;
        }
        self.live.insert(slot, now);
        self.by_live.insert((now, slot));
        if was == 0 {
            if slot >= self.high {
                self.holes.extend(self.high..slot);
                self.high = slot + 1;
            } else {
                self.holes.remove(&slot);
            }
        }
    }

    /// The map of volume `volume` as checkpoint records starting at
    /// record seq `seq`, in parts that each fit a record; runs of blocks
    /// that sit in order in one stripe take one entry. The whole map at
    /// once: a writer takes the parts one by one
    /// ([`StripeMap::checkpoint_part`]).
    pub fn checkpoint(&self, volume: u64, seq: u64) -> Vec<MapRecord> {
        self.checkpoint_in_parts_of(volume, seq, format::RUNS_PER_CHECKPOINT_PART)
    }

    /// [`StripeMap::checkpoint`] in parts of `runs_per_part` runs.
    pub(super) fn checkpoint_in_parts_of(
        &self,
        volume: u64,
        seq: u64,
        runs_per_part: usize,
    ) -> Vec<MapRecord> {
        let mut parts = Vec::new();
        let mut after = Some(0);
        while let Some(a) = after {
            let part = parts.len() as u32;
            let at = (volume, seq + u64::from(part), part);
            let (rec, next) = self.checkpoint_part(at, a, runs_per_part);
            parts.push(rec);
            after = next;
        }
        parts
    }

    /// Part `part` (record seq `seq`) of the checkpoint of volume
    /// `volume`: the next `runs_per_part` runs from block `after` (where
    /// the part before ended; at most `RUNS_PER_CHECKPOINT_PART`), and
    /// where this part ends, for the next part, `None` for the last part.
    /// Walks only the blocks it takes, and one more: a checkpoint of a
    /// large map costs each loop event one part. The map must not change between the parts of one
    /// checkpoint (the writer records nothing else meanwhile).
    pub fn checkpoint_part(
        &self,
        (volume, seq, part): (u64, u64, u32),
        after: u64,
        runs_per_part: usize,
    ) -> (MapRecord, Option<u64>) {
        assert!(
            (1..=format::RUNS_PER_CHECKPOINT_PART).contains(&runs_per_part),
            "{runs_per_part} runs per checkpoint part"
        );
        let mut runs: Vec<Run> = Vec::with_capacity(runs_per_part);
        let mut next = None;
        for (b, l) in self.blocks.range(after, u64::MAX) {
            if let Some(r) = runs.last_mut() {
                if format::run_goes_on(r, b, &l) {
                    r.len += 1;
                    continue;
                }
            }
            if runs.len() == runs_per_part {
                next = runs.last().map(format::run_end);
                break;
            }
            runs.push(Run {
                block: b,
                len: 1,
                slot: l.slot,
                index: l.index,
            });
        }
        let rec = MapRecord::Checkpoint {
            volume,
            seq,
            part,
            last: next.is_none(),
            last_stripe_seq: self.last_stripe_seq,
            after: Some(after),
            runs,
        };
        (rec, next)
    }

    /// A part of a checkpoint taken from this map is durable: it says
    /// what the map holds already, so only its seq is taken (a part of a
    /// large map is not mapped again block by block).
    pub fn checkpoint_part_durable(&mut self, rec: &MapRecord) -> Result<(), MapError> {
        let seq = self.in_order(rec)?;
        let MapRecord::Checkpoint { runs, .. } = rec else {
            unreachable!("a checkpoint part that is not one: {rec:?}");
        };
        if cfg!(debug_assertions) {
            for r in runs {
                for i in 0..r.len {
                    let at = self.blocks.get(r.block + u64::from(i));
                    assert_eq!(
                        at.map(|l| (l.slot, u32::from(l.index))),
                        Some((r.slot, u32::from(r.index) + i)),
                        "a checkpoint part that is not this map's"
                    );
                }
            }
        }
        self.last_record_seq = seq;
        Ok(())
    }

    /// The map that `records` (every valid record found in the log, in any
    /// order) leave: the newest complete checkpoint, then every record
    /// after it in seq order up to the first missing seq (a record never
    /// made durable; nothing after it was acknowledged to the map).
    pub fn replay(records: &[MapRecord]) -> Result<StripeMap, MapError> {
        StripeMap::replay_within(records, MapBounds::ANY)
    }

    /// [`StripeMap::replay`] of a volume's records, each replayed one
    /// checked against `bounds` first.
    pub fn replay_within(records: &[MapRecord], bounds: MapBounds) -> Result<StripeMap, MapError> {
        let by_seq = by_seq(records);
        let start = newest_checkpoint(&by_seq).ok_or(MapError::NoCheckpoint)?;
        let mut map = StripeMap {
            last_record_seq: start - 1,
            ..StripeMap::default()
        };
        for (want, (&seq, r)) in (start..).zip(by_seq.range(start..)) {
            if seq != want {
                break;
            }
            if let Some(what) = bounds.outside(r) {
                return Err(MapError::Outside { seq, what });
            }
            map.apply(r)?;
        }
        map.tail = LogTail {
            complete_from: start,
            found_upto: by_seq.keys().next_back().copied().unwrap_or(0),
            resume: interrupted(&by_seq, start, map.last_record_seq),
        };
        Ok(map)
    }

    /// What a new owner starts from: the map [`replay`](Self::replay)
    /// gives, numbered to go on after the last record replayed, with its
    /// [`LogTail`]. The caller's first records finish the checkpoint the
    /// replayed records end inside, or write a new one: parts that a torn
    /// write left past the last record replayed are parts of that same
    /// checkpoint, taken from the same map (nothing but parts is recorded
    /// while one is written), so they agree with what the caller writes
    /// over them. Should records still lie past the end of the caller's
    /// checkpoint (written by another binary), its next checkpoint goes
    /// above every record found ([`crate::stripes::Tier`]).
    pub fn recover(records: &[MapRecord]) -> Result<StripeMap, MapError> {
        StripeMap::recover_within(records, MapBounds::ANY)
    }

    /// [`StripeMap::recover`] of a volume's records, checked against
    /// `bounds` ([`StripeMap::replay_within`]).
    pub fn recover_within(records: &[MapRecord], bounds: MapBounds) -> Result<StripeMap, MapError> {
        let mut map = StripeMap::replay_within(records, bounds)?;
        let mut past = records
            .iter()
            .filter(|r| (map.last_record_seq + 1..u64::MAX).contains(&r.seq()));
        if past.any(|r| !matches!(r, MapRecord::Checkpoint { .. })) {
            // Not a torn write of parts (no writer of this format leaves
            // that): the old rule, numbering above every record found,
            // and a new checkpoint first.
            map.number_above(map.tail.found_upto);
            map.tail.resume = None;
        }
        // Stripe seqs too: a stripe written past a missing record must not
        // share its seq with a new one (a rebuild from the summaries
        // takes the later seq).
        let stripes = records.iter().filter_map(|r| match r {
            MapRecord::Stripe { stripe_seq, .. } => Some(*stripe_seq),
            MapRecord::Stripes { stripes, .. } => stripes.iter().map(|s| s.stripe_seq).max(),
            MapRecord::Checkpoint {
                last_stripe_seq, ..
            } => Some(*last_stripe_seq),
            MapRecord::Unmap { .. } => None,
        });
        map.last_stripe_seq = map.last_stripe_seq.max(stripes.max().unwrap_or(0));
        Ok(map)
    }

    /// Invariants: every mapped block counts once in its slot's live
    /// count, and a counted slot has live blocks.
    fn check(&self) {
        if cfg!(debug_assertions) {
            let mut live: BTreeMap<u64, u32> = BTreeMap::new();
            for (_, l) in self.blocks.iter() {
                *live.entry(l.slot).or_default() += 1;
            }
            assert_eq!(live, self.live, "live counts out of step with the map");
            let by_live: BTreeSet<(u32, u64)> = live.iter().map(|(&s, &l)| (l, s)).collect();
            assert_eq!(by_live, self.by_live, "the emptiest-slot index out of step");
            let high = live.keys().next_back().map_or(0, |&s| s + 1);
            assert_eq!(high, self.high, "the free-slot mark out of step");
            let holes: BTreeSet<u64> = (0..high).filter(|s| !live.contains_key(s)).collect();
            assert_eq!(holes, self.holes, "the free slots out of step");
            let listed: BTreeSet<u64> = self.slot_blocks.keys().copied().collect();
            let used: BTreeSet<u64> = live.keys().copied().collect();
            assert_eq!(listed, used, "slot block lists out of step");
            let slots: Vec<u64> = used.into_iter().collect();
            let mut found = self.blocks_in(&slots);
            found.sort_unstable();
            let all: Vec<(u64, Loc)> = self.blocks.iter().collect();
            assert_eq!(found, all, "the blocks of the used slots are not the map's");
        }
    }
}

/// The records by seq. Seqs start at 1: a record numbered 0 is no
/// record of a writer, nor one numbered `u64::MAX` (no seq follows it).
fn by_seq(records: &[MapRecord]) -> BTreeMap<u64, &MapRecord> {
    records
        .iter()
        .filter(|r| r.seq() > 0 && r.seq() < u64::MAX)
        .map(|r| (r.seq(), r))
        .collect()
}

/// Whether checkpoint part `next` follows part `prev` of the same
/// checkpoint: the next part number, `prev` not the last, and (version 3
/// on) starting where `prev` ended.
fn follows(prev: &MapRecord, next: &MapRecord) -> bool {
    let (
        MapRecord::Checkpoint {
            part: p,
            last: false,
            runs,
            ..
        },
        MapRecord::Checkpoint { part: n, after, .. },
    ) = (prev, next)
    else {
        return false;
    };
    let ends = runs.last().map(format::run_end);
    p.checked_add(1) == Some(*n) && after.is_none_or(|a| Some(a) == ends)
}

/// Whether `r` is the first part of a checkpoint.
fn first_part(r: &MapRecord) -> bool {
    matches!(r, MapRecord::Checkpoint { part: 0, after, .. } if after.is_none_or(|a| a == 0))
}

/// The parts of the checkpoint that starts at seq `first`, at consecutive
/// seqs, each following the one before, as far as they go.
fn parts_from<'a, 'm>(
    by_seq: &'m BTreeMap<u64, &'a MapRecord>,
    first: u64,
) -> impl Iterator<Item = &'a MapRecord> + use<'a, 'm> {
    let mut prev: Option<&'a MapRecord> = None;
    by_seq
        .range(first..)
        .zip(first..)
        .map_while(move |((&seq, &r), want)| {
            let ok = seq == want
                && match prev {
                    None => first_part(r),
                    Some(p) => follows(p, r),
                };
            prev = Some(r);
            ok.then_some(r)
        })
}

/// The first seq of the newest checkpoint whose parts are all present:
/// part 0 at that seq, each next part at the next seq (starting where the
/// part before it ended), up to one marked last.
fn newest_checkpoint(by_seq: &BTreeMap<u64, &MapRecord>) -> Option<u64> {
    let whole = |first: u64| {
        parts_from(by_seq, first).any(|r| matches!(r, MapRecord::Checkpoint { last: true, .. }))
    };
    by_seq
        .iter()
        .rev()
        .find_map(|(&seq, r)| match first_part(r) {
            true => whole(seq).then_some(seq),
            false => None,
        })
}

/// The checkpoint that the records replayed from `start` up to `end` end
/// inside, if any: one begun after `start` whose parts run from its part
/// 0 to `end`, none marked last. Its next part and where that starts.
fn interrupted(by_seq: &BTreeMap<u64, &MapRecord>, start: u64, end: u64) -> Option<(u32, u64)> {
    let Some(MapRecord::Checkpoint { part, runs, .. }) = by_seq.get(&end) else {
        return None;
    };
    let first = end.checked_sub(u64::from(*part))?;
    if first <= start {
        return None;
    }
    let parts = parts_from(by_seq, first)
        .take_while(|r| r.seq() <= end)
        .count() as u64;
    let after = runs.last().map(format::run_end)?;
    (parts == end - first + 1).then_some((part + 1, after))
}
