//! The bookkeeping of an erasure-coded volume's two legs, for its owner
//! (`docs/erasure-coding.md`): which blocks are pending on the performance
//! leg, where each read goes, which blocks the next stripe takes, which
//! map record comes next, and what a durable record lets the owner trim
//! and acknowledge. Pure: the owner does the I/O it asks for, in order.
//!
//! The owner's rules, which this state relies on:
//! - a block's read is routed by [`Tier::source`] when it is sent, and
//!   sent to a column before any stripe write sent after it;
//! - a stripe is written whole before [`Tier::stripe_written`];
//! - one record at a time: [`Tier::next_record`], written durably to the
//!   performance leg at [`Tier::log_offset`], then
//!   [`Tier::record_durable`]; the trims it answers are sent after that;
//! - a write of zeros over a block the capacity leg holds is acknowledged
//!   only once its unmap is durable and the trims answered with it are
//!   done, and trimmed only then ([`Tier::zero`] answers a ticket);
//!   tickets are acknowledged in their order;
//! - trims are sent as soon as they are answered, before any later write:
//!   a block written again after its trim was sent is written after it.

use super::{Columns, Loc, MapRecord, StripeMap, BLOCK_BYTES};
use std::collections::{BTreeMap, VecDeque};

/// Free stripe slots below which the cleaner runs: room for a destage
/// and a clean in flight, and a few to spare.
pub const CLEAN_RESERVE_SLOTS: u64 = 4;

/// Records the map log keeps beyond two whole checkpoints, so that small
/// volumes write a checkpoint only every few dozen records.
const SPARE_LOG_RECORDS: u64 = 64;

/// Where a block's newest data is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// On the performance leg, at the block's own offset.
    Performance,
    /// In a stripe of the capacity leg.
    Stripe(Loc),
    /// Nowhere: never written, or zeroed. Reads as zeros without I/O.
    Zeros,
}

/// A block whose newest data is on the performance leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pending {
    /// The write that put it there (numbered by the tier).
    seq: u64,
    /// A write of zeros over a block the capacity leg holds: the leg's
    /// block is trimmed and the map must forget the block (an unmap
    /// record); never destaged.
    zero: bool,
    /// The write is done on the leg: a destage may read it. (A read sent
    /// before a write is done may find the leg's older data.)
    done: bool,
}

/// The stripe being destaged: its blocks, each with the write whose data
/// was read for it, and where it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destage {
    pub blocks: Vec<(u64, u64)>,
    pub slot: u64,
    pub stripe_seq: u64,
    /// Of a stripe the cleaner makes: where each block is read from in
    /// the capacity leg (empty: from the performance leg).
    pub from: Vec<Loc>,
    written: bool,
}

/// A new stripe's blocks, each with its write number, and for a clean
/// where each is read from.
type StripeBlocks = (Vec<(u64, u64)>, Vec<Loc>);

/// The write number a cleaned block carries: none a client write takes,
/// so that a block written since is never taken for the cleaned one.
const CLEANED: u64 = u64::MAX;

/// A write of zeros waiting for its unmap record to be durable.
pub type Ticket = u64;

/// What a zeroing asks of the owner ([`Tier::zero`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Zeroing {
    /// Runs of blocks, (first, count), to trim from the performance leg
    /// now.
    pub trim_now: Vec<(u64, u64)>,
    /// The unmap to wait for before acknowledging (None: acknowledged
    /// once the trims are done).
    pub ticket: Option<Ticket>,
}

/// What a durable record lets the owner do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Runs of blocks, (first, count), to trim from the performance leg:
    /// their data is in a durable stripe and no newer write came since.
    pub trims: Vec<(u64, u64)>,
    /// Zero writes whose unmaps are durable: to acknowledge once
    /// `trims` are done (until then a new owner would find the blocks'
    /// old data on the leg, unmapped, and take it for pending), and in
    /// ticket order: a later zeroing of a block may find its trim already
    /// answered to an earlier one.
    pub acknowledged: Vec<Ticket>,
}

/// Why the tier cannot start from what it found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TierError {
    #[error("the map log holds records but no complete checkpoint: refusing to serve a map that cannot be rebuilt")]
    NoCheckpoint,
    #[error(transparent)]
    Map(#[from] super::MapError),
}

/// The tier's state for one owned volume.
#[derive(Debug, Clone)]
pub struct Tier {
    volume: u64,
    volume_bytes: u64,
    columns: Columns,
    map: StripeMap,
    pending: BTreeMap<u64, Pending>,
    last_write: u64,
    destage: Option<Destage>,
    /// Where the next destage starts looking, so that every pending block
    /// gets its turn (an elevator over block numbers).
    cursor: u64,
    /// Unmaps waiting for a record, in order: (first, count, ticket).
    unmaps: VecDeque<(u64, u64, Ticket)>,
    last_ticket: Ticket,
    /// The record being written.
    in_flight: Option<MapRecord>,
    /// Parts of the checkpoint being written, after the one in flight.
    checkpoint_left: VecDeque<MapRecord>,
    /// Records written since the newest complete checkpoint.
    since_checkpoint: u64,
    log_records: u64,
    /// Stripe slots each column has.
    slots: u64,
    /// Lowering to RAID-1: no stripe is begun, and the owner reads every
    /// mapped block back to the performance leg ([`Tier::lower`]).
    lowering: Option<Lowering>,
}

/// Where the lowering of the volume to RAID-1 is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lowering {
    /// Mapped blocks are read back to the leg; `cursor`: where the next
    /// batch starts looking.
    Rehydrating { cursor: u64 },
    /// Every mapped block is pending on the leg: the empty checkpoint
    /// that forgets the map is the next record (or in flight).
    Forgetting,
    /// The empty checkpoint (record `seq`) is durable: the map is empty,
    /// every block the volume holds is on the leg.
    Forgotten { seq: u64 },
}

/// Records of a map log sized for a volume of `volume_bytes` under
/// `columns`: twice the largest checkpoint the volume can need (every
/// block a run of its own), and spares, so that a checkpoint is always
/// complete before the log wraps over the one before it.
pub fn log_records_for(volume_bytes: u64) -> u64 {
    let blocks = volume_bytes.div_ceil(BLOCK_BYTES as u64);
    let parts = blocks.div_ceil(super::format::RUNS_PER_CHECKPOINT_PART as u64);
    2 * parts.max(1) + SPARE_LOG_RECORDS
}

impl Tier {
    /// The state of a new owner: `map` as recovered from the log (or
    /// empty), and `pending`, the blocks the performance leg holds newer
    /// data of ([`classify`]). Its first record is a checkpoint.
    pub fn new(
        volume: u64,
        volume_bytes: u64,
        columns: Columns,
        map: StripeMap,
        pending: impl IntoIterator<Item = u64>,
        (log_records, slots): (u64, u64),
    ) -> Tier {
        assert!(log_records >= 4, "a map log of {log_records} records");
        let pending = pending
            .into_iter()
            .map(|b| {
                (
                    b,
                    Pending {
                        seq: 0,
                        zero: false,
                        done: true,
                    },
                )
            })
            .collect();
        Tier {
            volume,
            volume_bytes,
            columns,
            map,
            pending,
            last_write: 0,
            destage: None,
            cursor: 0,
            unmaps: VecDeque::new(),
            last_ticket: 0,
            in_flight: None,
            checkpoint_left: VecDeque::new(),
            // A new owner writes a checkpoint before any other record.
            since_checkpoint: log_records,
            log_records,
            slots,
            lowering: None,
        }
    }

    /// The map `records` (every valid record read from the log) leave for
    /// a new owner: empty when there are none (a new volume).
    pub fn recover_map(records: &[MapRecord]) -> Result<StripeMap, TierError> {
        if records.is_empty() {
            return Ok(StripeMap::default());
        }
        match StripeMap::recover(records) {
            Err(super::MapError::NoCheckpoint) => Err(TierError::NoCheckpoint),
            r => Ok(r?),
        }
    }

    pub fn volume(&self) -> u64 {
        self.volume
    }

    pub fn map(&self) -> &StripeMap {
        &self.map
    }

    /// Blocks whose newest data is on the performance leg.
    pub fn pending_blocks(&self) -> usize {
        self.pending.len()
    }

    /// Whether a write of block `block` is on its way to the leg and not
    /// done yet.
    pub fn write_in_flight(&self, block: u64) -> bool {
        self.pending.get(&block).is_some_and(|p| !p.zero && !p.done)
    }

    /// Blocks of the volume holding data: mapped and not being zeroed,
    /// or written and not mapped yet (for capacity reports; walks the
    /// pending set).
    pub fn written_blocks(&self) -> u64 {
        let mut n = self.map.len() as u64;
        for (&b, p) in &self.pending {
            match (p.zero, self.map.get(b).is_some()) {
                (true, true) => n -= 1,
                (false, false) => n += 1,
                _ => {}
            }
        }
        n
    }

    /// Pending blocks a destage may take now.
    pub fn destageable_blocks(&self) -> usize {
        self.pending.values().filter(|p| !p.zero && p.done).count()
    }

    /// Where block `block` is to be read from now.
    pub fn source(&self, block: u64) -> Source {
        if self.pending.get(&block).is_some_and(|p| !p.zero) {
            return Source::Performance;
        }
        if self.pending.contains_key(&block) {
            // Zeroed, its unmap not yet durable.
            return Source::Zeros;
        }
        match self.map.get(block) {
            Some(loc) => Source::Stripe(loc),
            None => Source::Zeros,
        }
    }

    /// Blocks `first..first + count` are being written with data (not all
    /// zeros) to the performance leg: reads go there from now on. Answers
    /// the write's number, for [`Tier::staged`].
    pub fn stage(&mut self, first: u64, count: u64) -> u64 {
        self.last_write += 1;
        for b in first..first.saturating_add(count) {
            let p = Pending {
                seq: self.last_write,
                zero: false,
                done: false,
            };
            self.pending.insert(b, p);
        }
        self.check();
        self.last_write
    }

    /// Write `seq` of blocks `first..first + count` is done on the leg:
    /// those it still holds may be destaged.
    pub fn staged(&mut self, first: u64, count: u64, seq: u64) {
        for (_, p) in self.pending.range_mut(first..first.saturating_add(count)) {
            if p.seq == seq {
                p.done = true;
            }
        }
    }

    /// Blocks `first..first + count` are being zeroed. Those the capacity
    /// leg holds (or the stripe being destaged takes) keep their data on
    /// the performance leg until an unmap record is durable (the leg's
    /// copy may be the only one newer than the stripe's), and read as
    /// zeros meanwhile: the ticket to wait for before the zeroing is
    /// acknowledged, their trims coming with it ([`Applied::trims`]). The
    /// others are trimmed now: [`Zeroing::trim_now`].
    pub fn zero(&mut self, first: u64, count: u64) -> Zeroing {
        let end = first.saturating_add(count);
        let pending: Vec<u64> = self.pending.range(first..end).map(|(&b, _)| b).collect();
        for b in pending {
            self.pending.remove(&b);
        }
        let mut held = self.map.mapped_in(first, end);
        if let Some(d) = &self.destage {
            held.extend(
                d.blocks
                    .iter()
                    .map(|&(b, _)| b)
                    .filter(|b| (first..end).contains(b)),
            );
        }
        held.sort_unstable();
        held.dedup();
        let trim_now = runs_outside(first, end, &held);
        if held.is_empty() {
            self.check();
            return Zeroing {
                trim_now,
                ticket: None,
            };
        }
        for &b in &held {
            self.last_write += 1;
            let p = Pending {
                seq: self.last_write,
                zero: true,
                done: true,
            };
            self.pending.insert(b, p);
        }
        self.last_ticket += 1;
        let (lo, hi) = (held[0], held[held.len() - 1]);
        self.unmaps.push_back((lo, hi - lo + 1, self.last_ticket));
        self.check();
        Zeroing {
            trim_now,
            ticket: Some(self.last_ticket),
        }
    }

    /// Begins the next stripe, if none is in flight and no unmap waits
    /// (an unmap and a stripe naming the same block are recorded in the
    /// order they were asked for): a clean when free slots run short
    /// ([`CLEAN_RESERVE_SLOTS`]), else a destage of up to a whole stripe
    /// of pending blocks whose writes are done, in block order from where
    /// the last one stopped. The owner reads the blocks (from the
    /// performance leg, each read after the writes staged so far, or for
    /// a clean from the capacity leg at [`Destage::from`]).
    ///
    /// The stripe goes to the lowest free slot not in `busy`: a slot freed
    /// while reads routed to it may still be in flight is not written.
    pub fn begin_stripe(&mut self, busy: &std::collections::BTreeSet<u64>) -> Option<&Destage> {
        if self.destage.is_some() || !self.unmaps.is_empty() || self.lowering.is_some() {
            return None;
        }
        let slot = self.map.free_slot_avoiding(busy);
        if slot >= self.slots {
            return None;
        }
        // A clean that cannot free a slot leaves the free slots to
        // destages.
        let stripe = if self.cleaning_due() {
            self.clean().or_else(|| self.destage_pending())
        } else {
            self.destage_pending()
        };
        let (blocks, from) = stripe?;
        self.destage = Some(Destage {
            blocks,
            slot,
            stripe_seq: self.map.next_stripe_seq(),
            from,
            written: false,
        });
        self.check();
        self.destage.as_ref()
    }

    /// Whether so few slots are free that the cleaner must make room.
    pub fn cleaning_due(&self) -> bool {
        self.map.used_slots() as u64 + CLEAN_RESERVE_SLOTS >= self.slots
    }

    /// The pending blocks of the next destage.
    fn destage_pending(&mut self) -> Option<StripeBlocks> {
        let per = self.columns.blocks_per_stripe();
        let wanted = |(_, p): &(&u64, &Pending)| !p.zero && p.done;
        let mut blocks: Vec<(u64, u64)> = self
            .pending
            .range(self.cursor..)
            .filter(wanted)
            .chain(self.pending.range(..self.cursor).filter(wanted))
            .take(per)
            .map(|(&b, p)| (b, p.seq))
            .collect();
        if blocks.is_empty() {
            return None;
        }
        self.cursor = blocks.last().map_or(0, |&(b, _)| b + 1);
        blocks.sort_unstable();
        Some((blocks, Vec::new()))
    }

    /// The live blocks of the emptiest slots, as many whole slots as one
    /// stripe holds: moved into a new stripe they free their slots. None
    /// when that frees nothing (fewer than two slots fit).
    fn clean(&self) -> Option<StripeBlocks> {
        let per = self.columns.blocks_per_stripe();
        let mut taken: Vec<u64> = Vec::new();
        let mut live = 0usize;
        for (slot, n) in self.map.emptiest(self.slots as usize) {
            if live + n as usize > per {
                break;
            }
            live += n as usize;
            taken.push(slot);
        }
        if taken.len() < 2 {
            return None;
        }
        let mut moved: Vec<(u64, Loc)> = self.map.blocks_in(&taken);
        moved.sort_unstable_by_key(|&(b, _)| b);
        let blocks = moved.iter().map(|&(b, _)| (b, CLEANED)).collect();
        let from = moved.into_iter().map(|(_, l)| l).collect();
        Some((blocks, from))
    }

    /// The stripe being destaged, if any.
    pub fn destaging(&self) -> Option<&Destage> {
        self.destage.as_ref()
    }

    /// The stripe being destaged is durable on every column.
    pub fn stripe_written(&mut self) {
        if let Some(d) = self.destage.as_mut() {
            d.written = true;
        }
    }

    /// The stripe could not be written: its blocks stay pending, to be
    /// destaged again.
    pub fn destage_failed(&mut self) {
        if self.destage.as_ref().is_some_and(|d| !d.written) {
            self.destage = None;
        }
    }

    /// The next record to write, if none is in flight: a checkpoint's
    /// next part, a checkpoint when the log has filled half since the
    /// last, the written stripe's record, or the oldest unmap once no
    /// stripe is being destaged.
    pub fn next_record(&mut self) -> Option<MapRecord> {
        if self.in_flight.is_some() {
            return None;
        }
        let seq = self.map.next_record_seq();
        let rec = if let Some(part) = self.checkpoint_left.pop_front() {
            part
        } else if self.lowering == Some(Lowering::Forgetting) {
            let mut parts = self.map.emptied().checkpoint(self.volume, seq);
            assert_eq!(parts.len(), 1, "an empty map's checkpoint is one record");
            parts.pop()?
        } else if matches!(self.lowering, Some(Lowering::Forgotten { .. }))
            && self.unmaps.is_empty()
        {
            // Nothing is recorded once the map is forgotten: the owner
            // trims the log.
            return None;
        } else if self.since_checkpoint >= self.log_records / 2 {
            let mut parts: VecDeque<MapRecord> = self.map.checkpoint(self.volume, seq).into();
            assert!(
                (parts.len() as u64) < self.log_records / 2,
                "a checkpoint of {} parts in a log of {} records",
                parts.len(),
                self.log_records
            );
            let first = parts.pop_front()?;
            self.checkpoint_left = parts;
            first
        } else if let Some(d) = self.destage.as_ref().filter(|d| d.written) {
            MapRecord::Stripe {
                volume: self.volume,
                seq,
                stripe_seq: d.stripe_seq,
                slot: d.slot,
                blocks: d.blocks.iter().map(|&(b, _)| b).collect(),
            }
        } else if let Some(&(first, count, _)) =
            self.unmaps.front().filter(|_| self.destage.is_none())
        {
            // (Behind a stripe being destaged: it may name the blocks
            // this unmap zeroes, and must be recorded first.)
            MapRecord::Unmap {
                volume: self.volume,
                seq,
                first,
                count,
            }
        } else {
            return None;
        };
        self.in_flight = Some(rec.clone());
        Some(rec)
    }

    /// Where record `seq` goes on the performance leg: past the volume's
    /// end, in a circle of `log_records` blocks.
    pub fn log_offset(&self, seq: u64) -> u64 {
        self.volume_bytes + (seq % self.log_records) * BLOCK_BYTES as u64
    }

    /// The record in flight is durable: applies it.
    pub fn record_durable(&mut self) -> Result<Applied, TierError> {
        let Some(rec) = self.in_flight.take() else {
            return Ok(Applied::default());
        };
        if self.lowering == Some(Lowering::Forgetting) {
            // The empty checkpoint: the map forgets every stripe. Each
            // block it held is pending on the leg (checked before).
            self.map = self.map.emptied();
            self.lowering = Some(Lowering::Forgotten { seq: rec.seq() });
        }
        self.map.apply(&rec)?;
        let mut applied = Applied::default();
        match &rec {
            MapRecord::Checkpoint { part, parts, .. } => {
                if part + 1 == *parts {
                    self.since_checkpoint = 0;
                }
                self.check();
                return Ok(applied);
            }
            MapRecord::Stripe { .. } => applied.trims = self.destaged(),
            MapRecord::Unmap { .. } => {
                if let Some((first, count, ticket)) = self.unmaps.pop_front() {
                    applied.trims = self.unmapped(first, count);
                    applied.acknowledged.push(ticket);
                }
            }
        }
        self.since_checkpoint += 1;
        self.check();
        Ok(applied)
    }

    /// The destaged stripe's record is durable: its blocks not written
    /// since leave the pending set, to be trimmed.
    fn destaged(&mut self) -> Vec<(u64, u64)> {
        let Some(d) = self.destage.take() else {
            return Vec::new();
        };
        let mut trims: Vec<(u64, u64)> = Vec::new();
        for (b, seq) in d.blocks {
            if self.pending.get(&b).is_some_and(|p| p.seq == seq) {
                self.pending.remove(&b);
                push_run(&mut trims, b);
            }
        }
        trims
    }

    /// An unmap is durable: its zeroed blocks are nowhere now, and are
    /// trimmed from the performance leg (the runs answered). A block
    /// written since is pending with data, and neither.
    fn unmapped(&mut self, first: u64, count: u64) -> Vec<(u64, u64)> {
        let zeroed: Vec<u64> = self
            .pending
            .range(first..first.saturating_add(count))
            .filter(|(_, p)| p.zero)
            .map(|(&b, _)| b)
            .collect();
        let mut trims: Vec<(u64, u64)> = Vec::new();
        for b in zeroed {
            self.pending.remove(&b);
            push_run(&mut trims, b);
        }
        trims
    }

    /// Begins the lowering of the volume to RAID-1 (`docs/erasure-coding.md`,
    /// Lowering to RAID-1): no stripe is begun from now on (one in flight
    /// ends as usual); the owner reads the mapped blocks back to the
    /// performance leg ([`Tier::to_rehydrate`]), then has the map
    /// forgotten ([`Tier::forget_map`]).
    pub fn lower(&mut self) {
        if self.lowering.is_none() {
            self.lowering = Some(Lowering::Rehydrating { cursor: 0 });
        }
    }

    /// Whether the volume is being lowered to RAID-1.
    pub fn lowering(&self) -> bool {
        self.lowering.is_some()
    }

    /// Whether the map is forgotten and nothing is left to record: every
    /// block is on the leg alone, and the owner may trim the map log.
    pub fn map_forgotten(&self) -> bool {
        self.forgotten_at().is_some()
    }

    /// Once the map is forgotten and nothing is left to record: where the
    /// empty checkpoint is on the performance leg, the one record of the
    /// log still needed. The owner trims the rest of the log first, then
    /// it: a crash in between leaves that checkpoint, the newest record.
    pub fn forgotten_at(&self) -> Option<u64> {
        match self.lowering {
            Some(Lowering::Forgotten { seq })
                if self.unmaps.is_empty() && self.in_flight.is_none() =>
            {
                Some(self.log_offset(seq))
            }
            _ => None,
        }
    }

    /// The map log's place on the performance leg: (offset, bytes).
    pub fn log_range(&self) -> (u64, u64) {
        (self.volume_bytes, self.log_records * BLOCK_BYTES as u64)
    }

    /// Up to `max` mapped blocks whose newest data is in a stripe only
    /// (not pending, not in `skip`: reads in flight), with where each is,
    /// in block order from where the last batch stopped, wrapping once.
    /// The owner reads each and stages it on the leg as a write, if the
    /// block still maps there when the data comes back
    /// (`Tier::source` unchanged).
    pub fn to_rehydrate(
        &mut self,
        max: usize,
        skip: &std::collections::BTreeSet<u64>,
    ) -> Vec<(u64, Loc)> {
        let Some(Lowering::Rehydrating { cursor }) = self.lowering else {
            return Vec::new();
        };
        let wanted = |&(b, _): &(u64, Loc)| !self.pending.contains_key(&b) && !skip.contains(&b);
        let found: Vec<(u64, Loc)> = self
            .map
            .from_block(cursor)
            .filter(wanted)
            .chain(
                self.map
                    .from_block(0)
                    .take_while(|&(b, _)| b < cursor)
                    .filter(wanted),
            )
            .take(max)
            .collect();
        let next = found.last().map_or(0, |&(b, _)| b + 1);
        self.lowering = Some(Lowering::Rehydrating { cursor: next });
        found
    }

    /// Queues the empty checkpoint that forgets the map, if every mapped
    /// block is pending with data on the leg (read back, or written
    /// since), no unmap waits and no stripe or record is in flight:
    /// from that record on, the map log says what an empty one says.
    /// Answers whether it is queued (or already done).
    pub fn forget_map(&mut self) -> bool {
        match self.lowering {
            Some(Lowering::Rehydrating { .. }) => {}
            Some(_) => return true,
            None => return false,
        }
        let on_leg = |b: &u64| self.pending.get(b).is_some_and(|p| !p.zero);
        let quiet = self.destage.is_none()
            && self.unmaps.is_empty()
            && self.in_flight.is_none()
            && self.checkpoint_left.is_empty();
        if !quiet || !self.map.from_block(0).all(|(b, _)| on_leg(&b)) {
            return false;
        }
        self.lowering = Some(Lowering::Forgetting);
        true
    }

    /// Invariants: a block zeroed over the capacity leg waits for an
    /// unmap that covers it; the stripe being destaged takes blocks that
    /// were pending when it began, in order, at most a stripe of them, in
    /// a slot free in the map.
    fn check(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (&b, p) in &self.pending {
            if p.zero {
                let covered = self.unmaps.iter().any(|&(f, n, _)| (f..f + n).contains(&b));
                assert!(covered, "block {b} zeroed with no unmap to come");
            }
        }
        if let Some(d) = &self.destage {
            assert!(d.blocks.len() <= self.columns.blocks_per_stripe());
            assert!(d.blocks.windows(2).all(|w| w[0].0 < w[1].0));
            assert_eq!(self.map.live(d.slot), 0, "destaging into a used slot");
        }
        assert!(self.since_checkpoint <= self.log_records, "the log wrapped");
        if matches!(self.lowering, Some(Lowering::Forgotten { .. })) {
            assert!(self.map.is_empty(), "a map kept after it was forgotten");
        }
    }
}

/// Adds block `b` (above every block in `runs`) to `runs`.
fn push_run(runs: &mut Vec<(u64, u64)>, b: u64) {
    match runs.last_mut() {
        Some((first, count)) if *first + *count == b => *count += 1,
        _ => runs.push((b, 1)),
    }
}

/// The runs of `first..end` outside `held` (sorted).
fn runs_outside(first: u64, end: u64, held: &[u64]) -> Vec<(u64, u64)> {
    let mut runs = Vec::new();
    let mut at = first;
    for &h in held.iter().chain(std::iter::once(&end)) {
        if h > at {
            runs.push((at, h - at));
        }
        at = at.max(h.saturating_add(1));
    }
    runs
}

/// Which of the blocks a new owner finds allocated on the performance
/// leg are pending: those the map does not hold, and those it holds whose
/// data there is not zeros (written again after their destage, or
/// destaged and not yet trimmed: the leg's copy is the same or newer). A
/// mapped block that reads as zeros there is a resync's filling of a hole
/// (a copy brought up to date gets whole regions), never data: a zero
/// write over a mapped block is acknowledged only with its unmap.
/// `is_zeros` reads a mapped block from the leg.
pub fn classify(
    map: &StripeMap,
    allocated: impl IntoIterator<Item = u64>,
    mut is_zeros: impl FnMut(u64) -> bool,
) -> Vec<u64> {
    allocated
        .into_iter()
        .filter(|&b| map.get(b).is_none() || !is_zeros(b))
        .collect()
}
