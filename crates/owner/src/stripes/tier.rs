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
//! - one write of the log at a time: [`Tier::next_records`] (one record,
//!   or consecutive parts of a checkpoint), written durably to the
//!   performance leg at [`Tier::log_offset`] of the first, then
//!   [`Tier::record_durable`]; the trims it answers are sent after that;
//! - a write straight to the capacity leg ([`Tier::begin_direct`]) is
//!   acknowledged only with its ticket: its record is durable and the
//!   trims of the older data it answered are done (until then a new owner
//!   would find that older data on the leg and take it for pending);
//! - a write of zeros over a block the capacity leg holds is acknowledged
//!   only once its unmap is durable and the trims answered with it are
//!   done, and trimmed only then ([`Tier::zero`] answers a ticket);
//!   tickets are acknowledged in their order;
//! - trims are sent as soon as they are answered, before any later write:
//!   a block written again after its trim was sent is written after it.

use super::{Columns, Loc, MapRecord, StripeEntry, StripeMap, BLOCK_BYTES};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Free stripe slots below which the cleaner runs: room for a destage
/// and a clean in flight, and a few to spare. Writes straight to the
/// capacity leg never take these.
pub const CLEAN_RESERVE_SLOTS: u64 = 4;

/// Stripes of client writes straight to the capacity leg in flight at
/// once, per volume: each holds its client data (already in memory, and
/// bounded by the NBD server's bytes in flight) until its record is
/// durable, and its encoded units while they are written (256 stripes of
/// 4+1: 186 MiB at most). Enough for 64 1 MiB writes of 2+1 stripes at
/// once, more than a client's queue holds. Past it, writes are staged.
pub const MAX_DIRECT_STRIPES: usize = 256;

/// Slots looked at, from the lowest free one, for a run of free slots as
/// long as a direct write's stripes: bounds the walk per stripe (a few
/// microseconds) on a volume of millions of slots.
pub const DIRECT_RUN_SCAN_SLOTS: u64 = 4096;

/// Mapped blocks one unmap record forgets at most: applying a record
/// removes its blocks from the map in the owner's loop, about 0.3 µs
/// each, so a zeroing of a whole TiB volume (268 million blocks) in one
/// record would stop its I/O for over a minute. 65,536 blocks (256 MiB
/// of data) take some 20 ms; a wider unmap is recorded in such steps,
/// and acknowledged after the last.
pub const UNMAP_RECORD_MAPPED_BLOCKS: u64 = 65_536;

/// Map entries one look for blocks to read back while lowering
/// ([`Tier::to_rehydrate`]) walks at most: a few milliseconds of the
/// loop however large the map, when most of it is already on the leg
/// (a 100 GiB volume's map has 26 million entries). The owner asks again
/// at once when a look stopped there.
pub const REHYDRATE_WALK_BLOCKS: usize = 16_384;

/// Records the map log keeps beyond two whole checkpoints, so that small
/// volumes write a checkpoint only every few dozen records.
///
/// Part of the log's size, which is not stored but computed from the
/// volume's size each time (`log_records_for`): changing it moves every
/// record of an existing log.
const SPARE_LOG_RECORDS: u64 = 64;
/// Checkpoint parts written to the performance leg at once: 1 MiB, so
/// that the checkpoint of a large map takes few round trips (a 100 GiB
/// volume's map of single blocks is about 141,000 parts: some 550 writes
/// rather than 141,000) while other records wait behind it. Each part is
/// taken from the map as its write is made, one part per map walk step.
pub const CHECKPOINT_PARTS_PER_WRITE: usize = 256;

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
    /// Of a zeroing: the write whose data the leg still holds under it
    /// (trimmed with the unmap), if any. A stripe newer than that write,
    /// recorded before the unmap, has the leg's block trimmed at once: a
    /// new owner would otherwise take that older data for pending.
    under: Option<u64>,
}

/// A stripe being written: its blocks, each with the write whose data
/// it holds, and where it goes. A destage's data is read from the
/// performance leg, a clean's from the capacity leg ([`Destage::from`]),
/// and a write straight to the capacity leg comes with its data
/// ([`Destage::ticket`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destage {
    pub blocks: Vec<(u64, u64)>,
    pub slot: u64,
    pub stripe_seq: u64,
    /// Of a stripe the cleaner makes: where each block is read from in
    /// the capacity leg (empty: from the performance leg).
    pub from: Vec<Loc>,
    /// Of a client's write straight to the capacity leg: the ticket its
    /// acknowledgement waits for.
    pub ticket: Option<Ticket>,
    written: bool,
    /// The bytes its entry takes in a stripes record (computed once, at
    /// its start: asked after every event while it waits).
    record_bytes: usize,
}

/// A write straight to the capacity leg whose stripe could not be
/// written ([`Tier::stripe_failed`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirectFailed {
    /// The write's ticket: answered by the staging below instead.
    pub ticket: Ticket,
    /// Runs of its blocks (first, count): the owner stages them on the
    /// performance leg, with the write's data, at once (before any other
    /// request), and acknowledges the write once they are staged.
    pub restage: Vec<(u64, u64)>,
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
    /// Zero writes whose unmaps are durable, and writes straight to the
    /// capacity leg whose stripes' records are: to acknowledge once
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

/// Where a [`Tier::scan_written`] pass stands: the next pending block to
/// walk, and the sum so far of what pending blocks add to the mapped ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WrittenScan {
    from: u64,
    delta: i64,
}

/// The tier's state for one owned volume.
#[derive(Debug, Clone)]
pub struct Tier {
    volume: u64,
    volume_bytes: u64,
    columns: Columns,
    map: StripeMap,
    pending: BTreeMap<u64, Pending>,
    /// Of those, the blocks with data whose write is done: what a stripe
    /// may take (kept with every change of `pending`, so that asking
    /// after every event never walks it).
    ready: usize,
    last_write: u64,
    /// The stripes begun and not yet recorded, in the order they began: a
    /// stripe is recorded after every one begun before it that names a
    /// block it names ([`Tier::recordable`]). At most one destage or
    /// clean among them, and [`MAX_DIRECT_STRIPES`] of client writes.
    stripes: VecDeque<Destage>,
    /// The slots of the stripes the record in flight names.
    recording: Vec<u64>,
    /// Blocks of writes straight to the capacity leg in flight, with the
    /// newest such write's number: a destage never takes an older write
    /// of them (the direct stripe's record may come first), and a
    /// read-modify-write of them waits.
    direct: BTreeMap<u64, u64>,
    /// The stripe seq the last stripe begun took.
    last_stripe_seq: u64,
    /// Where the next destage starts looking, so that every pending block
    /// gets its turn (an elevator over block numbers).
    cursor: u64,
    /// Unmaps waiting for a record, in order: (first, count, ticket).
    /// The front one shrinks as its steps are recorded.
    unmaps: VecDeque<(u64, u64, Ticket)>,
    /// [`UNMAP_RECORD_MAPPED_BLOCKS`] (smaller in tests).
    pub(super) unmap_record_blocks: u64,
    last_ticket: Ticket,
    /// The records being written (one write of the log: several only
    /// for checkpoint parts), in seq order; empty when none.
    in_flight: Vec<MapRecord>,
    /// The checkpoint being written: its next part to take from the map.
    checkpointing: Option<NextPart>,
    /// Runs per checkpoint part ([`super::format::RUNS_PER_CHECKPOINT_PART`];
    /// fewer in tests, for checkpoints of many parts).
    pub(super) runs_per_part: usize,
    /// [`CHECKPOINT_PARTS_PER_WRITE`] (fewer in tests).
    pub(super) parts_per_write: usize,
    /// Records written since the newest complete checkpoint began, its
    /// own parts included.
    since_checkpoint: u64,
    /// The first seq of the newest complete checkpoint: no record is
    /// written over it (`seq < complete_from + log_records`).
    complete_from: u64,
    /// The highest record seq found by recovery: should the first
    /// checkpoint end below it, the next one goes above it.
    found_upto: u64,
    /// No checkpoint of this writer's rules is complete yet: the log was
    /// inherited, perhaps from an older binary whose rules did not keep
    /// [`Tier::assert_room`]'s bound (version 2 began a checkpoint half a
    /// log after the last one ended), so the bound is not asserted until
    /// then.
    inherited: bool,
    log_records: u64,
    /// Where the map log begins on the performance leg, in bytes.
    log_at: u64,
    /// The map log being moved to a place past a growth's new end
    /// ([`Tier::move_log`]).
    log_move: Option<LogMove>,
    /// Stripe slots each column has.
    slots: u64,
    /// Lowering to RAID-1: no stripe is begun, and the owner reads every
    /// mapped block back to the performance leg ([`Tier::lower`]).
    lowering: Option<Lowering>,
    /// While lowering: blocks to look at again, wherever the walk of the
    /// map is: those a stripe recorded since mapped (perhaps behind the
    /// walk, their pending data trimmed), and those whose read back
    /// failed.
    recheck: BTreeSet<u64>,
    /// [`REHYDRATE_WALK_BLOCKS`] (fewer in tests).
    pub(super) rehydrate_walk_blocks: usize,
}

/// What one look for blocks to read back found ([`Tier::to_rehydrate`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rehydrate {
    /// Blocks to read back, each from where the map has it.
    pub blocks: Vec<(u64, Loc)>,
    /// The walk of the map stopped at its bound, not at the batch's: ask
    /// again now.
    pub more: bool,
}

/// Where an erasure-coded volume's map log lies on its performance leg
/// (`docs/erasure-coding.md`, The map log's size, and Growing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPlace {
    /// Its first byte on the leg.
    pub at: u64,
    /// Its length in records ([`log_records_for`] the volume's size).
    pub records: u64,
}

impl LogPlace {
    /// The byte past its end.
    pub fn end(&self) -> u64 {
        self.at + self.records * BLOCK_BYTES as u64
    }

    /// The log of volume `v` as the directory records it: at its end
    /// unless a growth moved it further.
    pub fn of(v: &shoal_model::Volume) -> LogPlace {
        LogPlace {
            at: v.map_log_at.unwrap_or(v.size),
            records: log_records_for(v.size),
        }
    }

    /// Where a growth of `v` to `to` bytes moves its log: past the new end
    /// and past the log it has, which stays whole (the map's only
    /// complete copy) until the new one holds a checkpoint.
    pub fn grown(v: &shoal_model::Volume, to: u64) -> LogPlace {
        LogPlace {
            at: to.max(LogPlace::of(v).end()),
            records: log_records_for(to),
        }
    }
}

/// What the two logs of a volume being grown give a new owner
/// ([`Tier::recover_growing`]).
#[derive(Debug)]
pub struct Grown {
    pub map: StripeMap,
    /// The map came from the new place: the log has moved.
    pub moved: bool,
    /// Otherwise, the highest seq a torn move left at the new place: the
    /// move made again numbers its records above it.
    pub torn_move_upto: u64,
}

/// A move of the map log ([`Tier::move_log`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LogMove {
    /// The first checkpoint at the new place is being written; `from`:
    /// the old place, the map's until then.
    Writing { from: LogPlace },
    /// A checkpoint at the new place is complete: the old one may be
    /// trimmed.
    Done { from: LogPlace },
}

/// The next part of a checkpoint being written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NextPart {
    part: u32,
    /// The block it starts at: where the part before ended.
    after: u64,
}

/// Where the lowering of the volume to RAID-1 is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lowering {
    /// Mapped blocks are read back to the leg; `cursor`: where the one
    /// walk of the map goes on (None: it has walked the whole map). Blocks
    /// it passed that need a read since are in [`Tier::recheck`].
    Rehydrating { cursor: Option<u64> },
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
        (log, slots): (LogPlace, u64),
    ) -> Tier {
        let log_records = log.records;
        assert!(log_records >= 4, "a map log of {log_records} records");
        assert!(log.at >= volume_bytes, "a map log inside the volume");
        let tail = map.log_tail();
        let pending = pending
            .into_iter()
            .map(|b| {
                (
                    b,
                    Pending {
                        seq: 0,
                        zero: false,
                        done: true,
                        under: None,
                    },
                )
            })
            .collect::<BTreeMap<u64, Pending>>();
        let ready = pending.len();
        Tier {
            volume,
            volume_bytes,
            columns,
            ready,
            map,
            pending,
            last_write: 0,
            stripes: VecDeque::new(),
            recording: Vec::new(),
            direct: BTreeMap::new(),
            last_stripe_seq: 0,
            cursor: 0,
            unmaps: VecDeque::new(),
            unmap_record_blocks: UNMAP_RECORD_MAPPED_BLOCKS,
            last_ticket: 0,
            in_flight: Vec::new(),
            // A new owner's first records finish the checkpoint the log
            // ends inside, or write one.
            checkpointing: Some(match tail.resume {
                Some((part, after)) => NextPart { part, after },
                None => NextPart { part: 0, after: 0 },
            }),
            runs_per_part: super::format::RUNS_PER_CHECKPOINT_PART,
            parts_per_write: CHECKPOINT_PARTS_PER_WRITE,
            since_checkpoint: 0,
            complete_from: tail.complete_from,
            found_upto: tail.found_upto,
            inherited: true,
            log_records,
            log_at: log.at,
            log_move: None,
            slots,
            lowering: None,
            recheck: BTreeSet::new(),
            rehydrate_walk_blocks: REHYDRATE_WALK_BLOCKS,
        }
    }

    /// The map `records` (every valid record read from the log) leave for
    /// a new owner: empty when there are none (a new volume).
    pub fn recover_map(
        records: &[MapRecord],
        bounds: super::MapBounds,
    ) -> Result<StripeMap, TierError> {
        if records.is_empty() {
            return Ok(StripeMap::default());
        }
        match StripeMap::recover_within(records, bounds) {
            Err(super::MapError::NoCheckpoint) => Err(TierError::NoCheckpoint),
            r => Ok(r?),
        }
    }

    /// The map of a volume being grown, from the records of its log's
    /// place (`here`) and of the place the growth moves it to (`moved`):
    /// every record at the new place is newer than every one at the old
    /// (nothing is written there once the move begins), so a complete
    /// checkpoint there is the map; else the old place's is, and the move
    /// is made again above what it left.
    pub fn recover_growing(
        here: &[MapRecord],
        moved: &[MapRecord],
        bounds: super::MapBounds,
    ) -> Result<Grown, TierError> {
        match Tier::recover_map(moved, bounds) {
            Ok(map) if !moved.is_empty() => {
                return Ok(Grown {
                    map,
                    moved: true,
                    torn_move_upto: 0,
                })
            }
            Ok(_) | Err(TierError::NoCheckpoint) => {}
            Err(e) => return Err(e),
        }
        Ok(Grown {
            map: Tier::recover_map(here, bounds)?,
            moved: false,
            torn_move_upto: moved.iter().map(MapRecord::seq).max().unwrap_or(0),
        })
    }

    pub fn volume(&self) -> u64 {
        self.volume
    }

    /// The volume's size in bytes.
    pub fn volume_bytes(&self) -> u64 {
        self.volume_bytes
    }

    pub fn map(&self) -> &StripeMap {
        &self.map
    }

    /// Blocks whose newest data is on the performance leg.
    pub fn pending_blocks(&self) -> usize {
        self.pending.len()
    }

    /// Whether a write of block `block` is on its way (to the leg, or
    /// straight to the capacity leg) and not done yet.
    pub fn write_in_flight(&self, block: u64) -> bool {
        self.pending.get(&block).is_some_and(|p| !p.zero && !p.done)
            || self.direct.contains_key(&block)
    }

    /// Blocks of the volume holding data: mapped and not being zeroed,
    /// or written and not mapped yet (for capacity reports; walks the
    /// pending set).
    pub fn written_blocks(&self) -> u64 {
        let whole = self.scan_written(&mut WrittenScan::default(), usize::MAX);
        whole.expect("a scan without a limit walks the whole pending set")
    }

    /// [`Tier::written_blocks`] a part at a time: walks at most
    /// `max_blocks` pending blocks from where `scan` stopped, and answers
    /// once a pass over the whole pending set is done. A loop event never
    /// walks more than that, however many blocks a column out of service
    /// keeps on the performance leg. A block destaged during a pass of
    /// several calls may count twice (walked while pending, then among
    /// the mapped), one unmapped not at all: the answer is that far from
    /// exact (up to the blocks destaged during the pass, never past the
    /// volume's blocks), and a pass over a quiet tier is exact.
    pub fn scan_written(&self, scan: &mut WrittenScan, max_blocks: usize) -> Option<u64> {
        assert!(max_blocks > 0, "a scan of no blocks never ends");
        for (walked, (&b, p)) in self.pending.range(scan.from..).enumerate() {
            if walked == max_blocks {
                scan.from = b;
                return None;
            }
            match (p.zero, self.map.get(b).is_some()) {
                (true, true) => scan.delta -= 1,
                (false, false) => scan.delta += 1,
                _ => {}
            }
        }
        // Blocks destaged or unmapped during a pass of several calls are
        // counted on both sides or on neither: never past the volume.
        let blocks = self.volume_bytes.div_ceil(BLOCK_BYTES as u64);
        let n = ((self.map.len() as i64 + scan.delta).max(0) as u64).min(blocks);
        *scan = WrittenScan::default();
        Some(n)
    }

    /// Whether a whole stripe of pending blocks may be destaged now: asked
    /// after every event, so a count kept with the pending set, never a
    /// walk of it (a zeroing can leave millions of zeroed blocks pending
    /// ahead of the ready ones).
    pub fn stripe_destageable(&self) -> bool {
        self.ready >= self.columns.blocks_per_stripe()
    }

    /// Whether pending block `p` may go into a stripe.
    fn is_ready(p: &Pending) -> bool {
        !p.zero && p.done
    }

    /// `pending.insert`, with the count of ready blocks.
    fn pending_insert(&mut self, b: u64, p: Pending) {
        self.ready += usize::from(Self::is_ready(&p));
        if let Some(old) = self.pending.insert(b, p) {
            self.ready -= usize::from(Self::is_ready(&old));
        }
    }

    /// `pending.remove`, with the count of ready blocks.
    fn pending_remove(&mut self, b: u64) -> Option<Pending> {
        let old = self.pending.remove(&b)?;
        self.ready -= usize::from(Self::is_ready(&old));
        Some(old)
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
                under: None,
            };
            self.pending_insert(b, p);
        }
        self.check();
        self.last_write
    }

    /// Write `seq` of blocks `first..first + count` is done on the leg:
    /// those it still holds may be destaged.
    pub fn staged(&mut self, first: u64, count: u64, seq: u64) {
        for (_, p) in self.pending.range_mut(first..first.saturating_add(count)) {
            if p.seq == seq {
                if !p.zero && !p.done {
                    self.ready += 1;
                }
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
        // What the leg holds under each block: a write's data, or what
        // an earlier zeroing left there.
        let mut under: BTreeMap<u64, u64> = BTreeMap::new();
        for b in pending {
            if let Some(p) = self.pending_remove(b) {
                match p.zero {
                    false => under.insert(b, p.seq),
                    true => p.under.and_then(|u| under.insert(b, u)),
                };
            }
        }
        // Held on the leg until the unmap is durable: the blocks with
        // data there newer than the capacity leg's, and those a stripe in
        // flight takes. A block only the capacity leg holds needs nothing
        // held: it reads its older data until the unmap applies, as a
        // zeroing not yet acknowledged may, and then zeros. So a zeroing
        // of a whole volume costs the blocks on the leg, not every block
        // mapped.
        let mut held: Vec<u64> = under
            .keys()
            .copied()
            .filter(|&b| self.map.get(b).is_some())
            .collect();
        for d in &self.stripes {
            // A stripe's blocks are in order: those in the range are one
            // slice of them, found by halving.
            let from = d.blocks.partition_point(|&(b, _)| b < first);
            let to = d.blocks.partition_point(|&(b, _)| b < end);
            held.extend(d.blocks[from..to].iter().map(|&(b, _)| b));
        }
        held.sort_unstable();
        held.dedup();
        let trim_now = runs_outside(first, end, &held);
        let mapped = self.map.mapped_bounds(first, end);
        let span = match (held.first(), held.last(), mapped) {
            (Some(&lo), Some(&hi), Some((mlo, mhi))) => Some((lo.min(mlo), hi.max(mhi))),
            (Some(&lo), Some(&hi), None) => Some((lo, hi)),
            (_, _, m) => m,
        };
        let Some((lo, hi)) = span else {
            self.check();
            return Zeroing {
                trim_now,
                ticket: None,
            };
        };
        for &b in &held {
            self.last_write += 1;
            let p = Pending {
                seq: self.last_write,
                zero: true,
                done: true,
                under: under.get(&b).copied(),
            };
            self.pending_insert(b, p);
        }
        self.last_ticket += 1;
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
    pub fn begin_stripe(&mut self, busy: &BTreeSet<u64>) -> Option<&Destage> {
        let background = self.stripes.iter().any(|d| d.ticket.is_none());
        if background || !self.unmaps.is_empty() || self.lowering.is_some() {
            return None;
        }
        let slot = self.free_slot(busy)?;
        // A clean that cannot free a slot leaves the free slots to
        // destages. It begins only with no other stripe in flight: one
        // begun before may name a block it moves, and be recorded
        // first, and the clean would then map the block back to the
        // older copy it read.
        let stripe = if self.cleaning_due() && self.stripes.is_empty() {
            self.clean().or_else(|| self.destage_pending())
        } else {
            self.destage_pending()
        };
        let (blocks, from) = stripe?;
        self.push_stripe(blocks, slot, from, None)
    }

    /// Begins a stripe of a client's write straight to the capacity leg:
    /// blocks `first..` as many as a stripe holds, all taking one write
    /// number. None (the owner stages the write instead) while the volume
    /// is being lowered, an unmap waits, [`MAX_DIRECT_STRIPES`] are in
    /// flight, or no slot is free beyond the cleaner's reserve. The
    /// owner writes the stripe with the client's data and acknowledges
    /// the write once the ticket is ([`Applied::acknowledged`]).
    pub fn begin_direct(
        &mut self,
        first: u64,
        busy: &BTreeSet<u64>,
        (after, run): (Option<u64>, u64),
    ) -> Option<&Destage> {
        let per = self.columns.blocks_per_stripe() as u64;
        let directs = self.stripes.iter().filter(|d| d.ticket.is_some()).count();
        let room = self.map.used_slots() as u64 + self.stripes.len() as u64 + CLEAN_RESERVE_SLOTS
            < self.slots;
        let fits = first
            .checked_add(per)
            .is_some_and(|e| e <= self.volume_bytes / BLOCK_BYTES as u64);
        if !self.unmaps.is_empty()
            || self.lowering.is_some()
            || directs >= MAX_DIRECT_STRIPES
            || !room
            || !fits
        {
            return None;
        }
        let slot = self.direct_slot(busy, (after, run))?;
        self.last_write += 1;
        self.last_ticket += 1;
        let seq = self.last_write;
        for b in first..first + per {
            self.direct.insert(b, seq);
        }
        let blocks = (first..first + per).map(|b| (b, seq)).collect();
        self.push_stripe(blocks, slot, Vec::new(), Some(self.last_ticket))
    }

    /// A free slot for a stripe of a direct write of `run` stripes: the
    /// one after `after` (the write's stripe before) if free, else the
    /// first that begins `run` free slots in a row among the
    /// [`DIRECT_RUN_SCAN_SLOTS`] from the lowest free one, else the lowest
    /// free one. A write's stripes in consecutive slots go as one write to
    /// each column.
    fn direct_slot(&self, busy: &BTreeSet<u64>, (after, run): (Option<u64>, u64)) -> Option<u64> {
        let mut avoid = busy.clone();
        avoid.extend(self.stripes.iter().map(|d| d.slot));
        let taken = |s: u64| self.map.live(s) > 0 || avoid.contains(&s);
        let next = after.and_then(|s| s.checked_add(1));
        if let Some(s) = next.filter(|&s| s < self.slots && !taken(s)) {
            return Some(s);
        }
        let lowest = self.map.free_slot_avoiding(&avoid);
        if lowest >= self.slots {
            return None;
        }
        let run_start = (run > 1)
            .then(|| {
                self.map
                    .free_run_avoiding(&avoid, run, DIRECT_RUN_SCAN_SLOTS)
            })
            .flatten()
            .filter(|&s| s.saturating_add(run) <= self.slots);
        Some(run_start.unwrap_or(lowest))
    }

    /// The lowest slot free in the map, not in `busy` (reads in flight)
    /// and not taken by a stripe in flight, if the columns have it.
    fn free_slot(&self, busy: &BTreeSet<u64>) -> Option<u64> {
        let mut avoid = busy.clone();
        avoid.extend(self.stripes.iter().map(|d| d.slot));
        let slot = self.map.free_slot_avoiding(&avoid);
        (slot < self.slots).then_some(slot)
    }

    fn push_stripe(
        &mut self,
        blocks: Vec<(u64, u64)>,
        slot: u64,
        from: Vec<Loc>,
        ticket: Option<Ticket>,
    ) -> Option<&Destage> {
        self.last_stripe_seq = self.last_stripe_seq.max(self.map.next_stripe_seq() - 1) + 1;
        assert!(
            blocks.windows(2).all(|w| w[0].0 < w[1].0),
            "a stripe's blocks in ascending order, each once"
        );
        let numbers: Vec<u64> = blocks.iter().map(|&(b, _)| b).collect();
        let record_bytes = StripeEntry::encoded_bytes(&numbers);
        self.stripes.push_back(Destage {
            record_bytes,
            blocks,
            slot,
            stripe_seq: self.last_stripe_seq,
            from,
            ticket,
            written: false,
        });
        self.check();
        self.stripes.back()
    }

    /// Whether so few slots are free that the cleaner must make room.
    pub fn cleaning_due(&self) -> bool {
        self.map.used_slots() as u64 + CLEAN_RESERVE_SLOTS >= self.slots
    }

    /// The pending blocks of the next destage.
    fn destage_pending(&mut self) -> Option<StripeBlocks> {
        let per = self.columns.blocks_per_stripe();
        // Not a block a newer write straight to the capacity leg is in
        // flight for: its stripe may be recorded first.
        let direct = &self.direct;
        let wanted = |(b, p): &(&u64, &Pending)| {
            !p.zero && p.done && direct.get(b).is_none_or(|&d| d < p.seq)
        };
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
        for (slot, n) in self.map.emptiest() {
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

    /// The stripe being written into slot `slot`, if any.
    pub fn stripe(&self, slot: u64) -> Option<&Destage> {
        self.stripes.iter().find(|d| d.slot == slot)
    }

    /// Whether a destage or clean is in flight (begun, not recorded).
    pub fn background_in_flight(&self) -> bool {
        self.stripes.iter().any(|d| d.ticket.is_none())
    }

    /// Stripes begun and not yet recorded.
    pub fn stripes_in_flight(&self) -> usize {
        self.stripes.len()
    }

    /// The slots a rebuilt column must hold: every slot with live blocks,
    /// and those of stripes written whole and not yet recorded (their
    /// records come, and map blocks there, while the column is filled).
    pub fn slots_to_rebuild(&self) -> Vec<u64> {
        let mut slots = self.map.live_slots();
        slots.extend(self.stripes.iter().filter(|d| d.written).map(|d| d.slot));
        slots.sort_unstable();
        slots.dedup();
        slots
    }

    /// The stripe in slot `slot` is durable on every column.
    pub fn stripe_written(&mut self, slot: u64) {
        if let Some(d) = self.stripes.iter_mut().find(|d| d.slot == slot) {
            d.written = true;
        }
    }

    /// The stripe in slot `slot` could not be written (or its blocks not
    /// read): a destage's blocks stay pending, to be destaged again; a
    /// write straight to the capacity leg is staged instead
    /// ([`DirectFailed`]).
    pub fn stripe_failed(&mut self, slot: u64) -> Option<DirectFailed> {
        let i = self
            .stripes
            .iter()
            .position(|d| d.slot == slot && !d.written)?;
        assert!(
            !self.recording.contains(&slot),
            "a stripe in the record in flight failed"
        );
        let d = self.stripes.remove(i)?;
        let ticket = d.ticket?;
        // Every block, also those a client wrote or zeroed since: the
        // write is not acknowledged yet, so it may take effect now,
        // after them (its staging does); leaving a block out would
        // acknowledge the write with its data nowhere.
        let mut restage = Vec::new();
        for (b, seq) in d.blocks {
            push_run(&mut restage, b);
            if self.direct.get(&b) == Some(&seq) {
                self.direct.remove(&b);
            }
        }
        self.check();
        Some(DirectFailed { ticket, restage })
    }

    /// The next records to write, if none is in flight, in one write of
    /// the log: the next parts of the checkpoint being written, a
    /// checkpoint's first parts when the log has filled half since the
    /// last, the written stripes' record, or the oldest unmap once no
    /// stripe is being destaged. Empty when there is nothing to write.
    pub fn next_records(&mut self) -> Vec<MapRecord> {
        if !self.in_flight.is_empty() {
            return Vec::new();
        }
        let seq = self.map.next_record_seq();
        let rec = if self.checkpointing.is_some() {
            return self.checkpoint_parts(seq);
        } else if self.lowering == Some(Lowering::Forgetting) {
            let mut parts = self.map.emptied().checkpoint(self.volume, seq);
            assert_eq!(parts.len(), 1, "an empty map's checkpoint is one record");
            match parts.pop() {
                Some(p) => p,
                None => return Vec::new(),
            }
        } else if matches!(self.lowering, Some(Lowering::Forgotten { .. }))
            && self.unmaps.is_empty()
        {
            // Nothing is recorded once the map is forgotten: the owner
            // trims the log.
            return Vec::new();
        } else if self.since_checkpoint >= self.log_records / 2 {
            self.checkpointing = Some(NextPart { part: 0, after: 0 });
            return self.checkpoint_parts(seq);
        } else if let Some(slots) = self.recordable() {
            self.stripes_record(seq, slots)
        } else if let Some(&(first, count, _)) =
            self.unmaps.front().filter(|_| self.stripes.is_empty())
        {
            // (Behind the stripes in flight: they may name the blocks
            // this unmap zeroes, and must be recorded first.)
            MapRecord::Unmap {
                volume: self.volume,
                seq,
                first,
                count: self.unmap_step(first, count),
            }
        } else {
            return Vec::new();
        };
        self.assert_room(rec.seq());
        self.in_flight = vec![rec.clone()];
        vec![rec]
    }

    /// The log's invariant: no record is written over the newest complete
    /// checkpoint. A checkpoint begins when half the log has been written
    /// since the last one began, and takes at most half the log less the
    /// spare records ([`log_records_for`]); a new owner's first one ends
    /// no later than the one its log ends inside would have.
    fn assert_room(&self, seq: u64) {
        assert!(
            self.inherited || seq < self.complete_from.saturating_add(self.log_records),
            "record {seq} would overwrite the checkpoint at {} in a log of {} records",
            self.complete_from,
            self.log_records
        );
    }

    /// The next parts of the checkpoint being written, from record `seq`
    /// on: as many as one write takes, short of the log's end (a write
    /// of the log is one run of its blocks).
    fn checkpoint_parts(&mut self, seq: u64) -> Vec<MapRecord> {
        let room = self.log_records - seq % self.log_records;
        let most = (self.parts_per_write as u64).min(room);
        let mut parts = Vec::new();
        while let Some(next) = self.checkpointing {
            if parts.len() as u64 == most {
                break;
            }
            let at = (self.volume, seq + parts.len() as u64, next.part);
            self.assert_room(at.1);
            let (rec, after) = self.map.checkpoint_part(at, next.after, self.runs_per_part);
            self.checkpointing = after.map(|after| NextPart {
                part: next.part + 1,
                after,
            });
            parts.push(rec);
        }
        self.in_flight = parts.clone();
        parts
    }

    /// The written stripes that may be recorded now, in the order they
    /// began, as many as one record holds: each written stripe no stripe
    /// begun before it and still unrecorded (written or not, but not in
    /// this record) names a block of. Stripes of distinct blocks commit in
    /// any order, so one slow column write holds back only the stripes of
    /// the same blocks begun after it; a stripe of the same blocks begun
    /// later must map them later.
    ///
    /// Asked after every event while no record is in flight, so it costs
    /// nothing while no stripe is written, looks no further than the last
    /// written one, and compares two stripes' blocks only when their
    /// bounds overlap (a direct write's stripes are disjoint runs).
    fn recordable(&self) -> Option<Vec<u64>> {
        let last = self.stripes.iter().rposition(|d| d.written)?;
        let mut held: Vec<&Destage> = Vec::new();
        let mut slots = Vec::new();
        let mut bytes = 0;
        for d in self.stripes.iter().take(last + 1) {
            let fits = slots.is_empty() || bytes + d.record_bytes <= super::STRIPES_PAYLOAD_BYTES;
            if d.written && fits && held.iter().all(|h| disjoint(&h.blocks, &d.blocks)) {
                bytes += d.record_bytes;
                slots.push(d.slot);
            } else {
                held.push(d);
            }
        }
        let slots = (!slots.is_empty()).then_some(slots);
        #[cfg(debug_assertions)]
        assert_eq!(slots, self.recordable_by_set(), "the recordable stripes");
        slots
    }

    /// [`Tier::recordable`] the plain way, every block of every stripe
    /// held back in one set: what debug builds check it against.
    #[cfg(debug_assertions)]
    fn recordable_by_set(&self) -> Option<Vec<u64>> {
        let mut held = std::collections::HashSet::new();
        let mut slots = Vec::new();
        let mut bytes = 0;
        for d in &self.stripes {
            let free = d.blocks.iter().all(|(b, _)| !held.contains(b));
            let need = StripeEntry::encoded_bytes(&block_numbers(d));
            let fits = slots.is_empty() || bytes + need <= super::STRIPES_PAYLOAD_BYTES;
            if d.written && free && fits {
                bytes += need;
                slots.push(d.slot);
            } else {
                held.extend(d.blocks.iter().map(|&(b, _)| b));
            }
        }
        (!slots.is_empty()).then_some(slots)
    }

    /// The record of the stripes in `slots` (written, in the order they
    /// began).
    fn stripes_record(&mut self, seq: u64, slots: Vec<u64>) -> MapRecord {
        let mut entries: Vec<StripeEntry> = Vec::new();
        for d in self.stripes.iter().filter(|d| slots.contains(&d.slot)) {
            entries.push(StripeEntry {
                stripe_seq: d.stripe_seq,
                slot: d.slot,
                blocks: block_numbers(d),
            });
        }
        assert!(!entries.is_empty(), "a stripes record of no stripe");
        self.recording = slots;
        match entries.len() {
            1 => {
                let e = entries.remove(0);
                MapRecord::Stripe {
                    volume: self.volume,
                    seq,
                    stripe_seq: e.stripe_seq,
                    slot: e.slot,
                    blocks: e.blocks,
                }
            }
            _ => MapRecord::Stripes {
                volume: self.volume,
                seq,
                stripes: entries,
            },
        }
    }

    /// Where record `seq` goes on the performance leg: past the volume's
    /// end, in a circle of `log_records` blocks.
    pub fn log_offset(&self, seq: u64) -> u64 {
        self.log_at + (seq % self.log_records) * BLOCK_BYTES as u64
    }

    /// The records in flight are durable: applies them, in order.
    pub fn record_durable(&mut self) -> Result<Applied, TierError> {
        let mut applied = Applied::default();
        for rec in std::mem::take(&mut self.in_flight) {
            let a = self.apply_durable(rec)?;
            applied.trims.extend(a.trims);
            applied.acknowledged.extend(a.acknowledged);
        }
        Ok(applied)
    }

    fn apply_durable(&mut self, rec: MapRecord) -> Result<Applied, TierError> {
        if self.lowering == Some(Lowering::Forgetting) {
            // The empty checkpoint: the map forgets every stripe. Each
            // block it held is pending on the leg (checked before).
            self.map = self.map.emptied();
            self.lowering = Some(Lowering::Forgotten { seq: rec.seq() });
        }
        if let MapRecord::Checkpoint { last, part, .. } = &rec {
            // Taken from this map, which nothing changed since.
            self.map.checkpoint_part_durable(&rec)?;
            if *last {
                self.checkpoint_complete(rec.seq(), *part);
            }
            self.check();
            return Ok(Applied::default());
        }
        self.map.apply(&rec)?;
        let applied = match &rec {
            MapRecord::Checkpoint { .. } => unreachable!("a checkpoint part applied above"),
            MapRecord::Stripe { .. } | MapRecord::Stripes { .. } => self.destaged(),
            MapRecord::Unmap { first, count, .. } => self.unmap_stepped(*first, *count),
        };
        self.since_checkpoint += 1;
        self.check();
        Ok(applied)
    }

    /// The last part (`part`, record `seq`) of a checkpoint is durable: it
    /// is the newest complete one. Should records found by recovery lie
    /// past it (parts of a torn write by a binary that split the map
    /// otherwise), the next checkpoint goes above them at once: replay from
    /// this one stops at the first of them that does not follow, and no
    /// record of this writer ever comes after them.
    fn checkpoint_complete(&mut self, seq: u64, part: u32) {
        self.complete_from = seq - u64::from(part);
        self.since_checkpoint = u64::from(part) + 1;
        if let Some(LogMove::Writing { from }) = self.log_move {
            self.log_move = Some(LogMove::Done { from });
        }
        if seq < self.found_upto {
            self.map.number_above(self.found_upto);
            self.checkpointing = Some(NextPart { part: 0, after: 0 });
            return;
        }
        self.inherited = false;
    }

    /// The record of the first stripes is durable: their blocks not
    /// written since leave the pending set, to be trimmed (for a write
    /// straight to the capacity leg, the older writes it replaced), and
    /// their writes straight to the capacity leg are acknowledged with
    /// those trims.
    fn destaged(&mut self) -> Applied {
        let mut trimmed: BTreeSet<u64> = BTreeSet::new();
        let mut acknowledged = Vec::new();
        for slot in std::mem::take(&mut self.recording) {
            let Some(i) = self.stripes.iter().position(|d| d.slot == slot) else {
                continue;
            };
            let Some(d) = self.stripes.remove(i) else {
                continue;
            };
            for (b, seq) in d.blocks {
                // A clean's blocks replace no write; a destage's, the one
                // it read; a direct write's, every older one.
                let replaced = |p: &Pending| seq != CLEANED && !p.zero && p.seq <= seq;
                if self.pending.get(&b).is_some_and(replaced) {
                    self.pending_remove(b);
                    trimmed.insert(b);
                }
                // Zeroed since, over data older than this stripe's: that
                // data goes now (the unmap trims nothing more).
                if let Some(p) = self.pending.get_mut(&b) {
                    let older = p.under.is_some_and(|u| u <= seq);
                    if seq != CLEANED && p.zero && older {
                        p.under = None;
                        trimmed.insert(b);
                    }
                }
                if self.direct.get(&b) == Some(&seq) {
                    self.direct.remove(&b);
                }
                if self.lowering.is_some() {
                    // Mapped here now, perhaps behind the walk.
                    self.recheck.insert(b);
                }
            }
            acknowledged.extend(d.ticket);
        }
        let mut trims: Vec<(u64, u64)> = Vec::new();
        for b in trimmed {
            push_run(&mut trims, b);
        }
        Applied {
            trims,
            acknowledged,
        }
    }

    /// The blocks of the next step of the unmap of `first..first +
    /// count`: up to the block before its
    /// ([`UNMAP_RECORD_MAPPED_BLOCKS`] + 1)th mapped block, else all.
    fn unmap_step(&self, first: u64, count: u64) -> u64 {
        let end = first.saturating_add(count);
        let limit = usize::try_from(self.unmap_record_blocks).unwrap_or(usize::MAX);
        match self.map.from_block(first).nth(limit) {
            Some((b, _)) if b < end => b - first,
            _ => count,
        }
    }

    /// A step of the front unmap is durable: its blocks' trims, and the
    /// zeroing's ticket once it was the last.
    fn unmap_stepped(&mut self, first: u64, count: u64) -> Applied {
        let Some(&(f, n, ticket)) = self.unmaps.front() else {
            return Applied::default();
        };
        assert!(
            first == f && count <= n && count > 0,
            "unmap step {first}+{count} of the unmap {f}+{n}"
        );
        let trims = self.unmapped(first, count);
        let mut acknowledged = Vec::new();
        if count == n {
            self.unmaps.pop_front();
            acknowledged.push(ticket);
        } else if let Some(front) = self.unmaps.front_mut() {
            *front = (first + count, n - count, ticket);
        }
        Applied {
            trims,
            acknowledged,
        }
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
            self.pending_remove(b);
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
            self.lowering = Some(Lowering::Rehydrating { cursor: Some(0) });
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
                if self.unmaps.is_empty() && self.in_flight.is_empty() =>
            {
                Some(self.log_offset(seq))
            }
            _ => None,
        }
    }

    /// The map log's place on the performance leg: (offset, bytes).
    pub fn log_range(&self) -> (u64, u64) {
        (self.log_at, self.log_records * BLOCK_BYTES as u64)
    }

    /// Where the map log lies now.
    pub fn log_place(&self) -> LogPlace {
        LogPlace {
            at: self.log_at,
            records: self.log_records,
        }
    }

    /// Moves the map log to `to` (a growth's, past the new end and the
    /// old log): its next records are a whole checkpoint there, numbered
    /// above `above` (records a torn move may have left there) and every
    /// record so far. Until that checkpoint is complete the old place
    /// holds the map's only complete checkpoint and is left alone; then
    /// [`Tier::log_moved`] gives it, to be trimmed. Called with no record
    /// in flight, not while lowering.
    pub fn move_log(&mut self, to: LogPlace, above: u64) {
        assert!(self.in_flight.is_empty(), "the log moved under a record");
        assert!(self.lowering.is_none(), "the log moved while lowering");
        assert!(to.records >= 4, "a map log of {} records", to.records);
        let from = self.log_place();
        assert!(
            to.at >= from.end() && to.at >= self.volume_bytes,
            "a new log over the old one or the volume"
        );
        self.map.number_above(above.max(self.found_upto));
        self.found_upto = self.found_upto.max(above);
        self.log_at = to.at;
        self.log_records = to.records;
        // A checkpoint under way at the old place is abandoned: the new
        // place's is whole, and a torn one there is what replay of the
        // old place already handles.
        self.checkpointing = Some(NextPart { part: 0, after: 0 });
        self.since_checkpoint = 0;
        self.complete_from = self.map.next_record_seq();
        self.inherited = true;
        self.log_move = Some(LogMove::Writing { from });
        self.check();
    }

    /// The old place of a moved log, once a checkpoint at the new place
    /// is complete (the old one is then to be trimmed).
    pub fn log_moved(&self) -> Option<LogPlace> {
        match self.log_move {
            Some(LogMove::Done { from }) => Some(from),
            _ => None,
        }
    }

    /// The growth is committed: the volume is `volume_bytes` long with
    /// `slots` stripe slots per column, its log where it was moved.
    pub fn grown(&mut self, volume_bytes: u64, slots: u64) {
        assert!(
            volume_bytes >= self.volume_bytes && slots >= self.slots,
            "a volume shrunk"
        );
        assert!(
            self.log_at >= volume_bytes,
            "the log at {} inside a volume of {volume_bytes} bytes",
            self.log_at
        );
        assert!(
            !matches!(self.log_move, Some(LogMove::Writing { .. })),
            "grown before the log moved"
        );
        self.volume_bytes = volume_bytes;
        self.slots = slots;
        self.log_move = None;
        self.check();
    }

    /// Up to `max` mapped blocks whose newest data is in a stripe only,
    /// with where each is: first those to look at again, then the next of
    /// the one walk of the map, which goes on from where the last look
    /// stopped, at most [`Tier::rehydrate_walk_blocks`] entries a look.
    /// The owner reads each and stages it on the leg as a write, if the
    /// block still maps there when the data comes back
    /// ([`Tier::rehydrated`]); a read that fails it hands back
    /// ([`Tier::rehydrate_failed`]).
    ///
    /// Skipped: blocks pending on the leg, being zeroed (an unmap waits:
    /// the zeroing is newer), with a write straight to the capacity leg in
    /// flight (its stripe's record may come after the read back, which
    /// would then stage the older data over it; the record has the block
    /// looked at again), and those in `skip` (reads in flight; looked at
    /// again when they were to be, else their outcome says).
    pub fn to_rehydrate(&mut self, max: usize, skip: &BTreeSet<u64>) -> Rehydrate {
        let Some(Lowering::Rehydrating { cursor }) = self.lowering else {
            return Rehydrate::default();
        };
        let mut found = Vec::new();
        let mut walked = 0;
        let mut again = Vec::new();
        while found.len() < max && walked < self.rehydrate_walk_blocks {
            let Some(b) = self.recheck.pop_first() else {
                break;
            };
            walked += 1;
            match (skip.contains(&b), self.map.get(b)) {
                (true, _) => again.push(b),
                (false, Some(loc)) if self.to_read_back(b) => found.push((b, loc)),
                _ => {}
            }
        }
        self.recheck.extend(again);
        // A block looked at again may lie ahead of the walk: found once.
        let rechecked: BTreeSet<u64> = found.iter().map(|&(b, _)| b).collect();
        let mut next = None;
        if let Some(from) = cursor {
            for (b, loc) in self.map.from_block(from) {
                if found.len() == max || walked == self.rehydrate_walk_blocks {
                    next = Some(b);
                    break;
                }
                walked += 1;
                if !skip.contains(&b) && !rechecked.contains(&b) && self.to_read_back(b) {
                    found.push((b, loc));
                }
            }
        }
        self.lowering = Some(Lowering::Rehydrating { cursor: next });
        let more = found.len() < max && (next.is_some() || walked == self.rehydrate_walk_blocks);
        Rehydrate {
            blocks: found,
            more,
        }
    }

    /// Whether mapped block `b` is to be read back: its newest data is in
    /// its stripe only, and no write straight to the capacity leg of it is
    /// in flight.
    fn to_read_back(&self, b: u64) -> bool {
        !self.pending.contains_key(&b) && !self.direct.contains_key(&b) && !self.unmap_waits(b)
    }

    /// Block `b`'s read back failed: it is looked at again.
    pub fn rehydrate_failed(&mut self, b: u64) {
        if matches!(self.lowering, Some(Lowering::Rehydrating { .. })) {
            self.recheck.insert(b);
        }
    }

    /// Whether the walk of the map is done and nothing waits to be looked
    /// at again: every mapped block has been read back (or its read is in
    /// flight), or is pending, or is being zeroed.
    pub fn rehydrate_done(&self) -> bool {
        matches!(self.lowering, Some(Lowering::Rehydrating { cursor: None }))
            && self.recheck.is_empty()
    }

    /// Whether block `b`, read back from `loc` for the lowering, is to be
    /// staged: it is still there, and no zeroing of it waits for its
    /// unmap (the zeroing is newer than the data read back).
    pub fn rehydrated(&self, b: u64, loc: Loc) -> bool {
        self.source(b) == Source::Stripe(loc) && !self.unmap_waits(b)
    }

    /// Whether an unmap waiting for its record covers block `b`.
    fn unmap_waits(&self, b: u64) -> bool {
        self.unmaps.iter().any(|&(f, n, _)| (f..f + n).contains(&b))
    }

    /// Queues the empty checkpoint that forgets the map, if every mapped
    /// block is pending with data on the leg (read back, or written
    /// since), no unmap waits and no stripe or record is in flight:
    /// from that record on, the map log says what an empty one says.
    /// Answers whether it is queued (or already done).
    ///
    /// `reading_back`: the owner's blocks read back not yet staged (reads
    /// in flight, stagings not done); none may be. Every other block is
    /// known on the leg without a walk: the walk of the map is done, and
    /// every block mapped or handed back since was looked at again
    /// ([`Tier::rehydrate_done`]).
    pub fn forget_map(&mut self, reading_back: usize) -> bool {
        match self.lowering {
            Some(Lowering::Rehydrating { .. }) => {}
            Some(_) => return true,
            None => return false,
        }
        let quiet = self.stripes.is_empty()
            && self.unmaps.is_empty()
            && self.in_flight.is_empty()
            && self.checkpointing.is_none();
        if !quiet || reading_back > 0 || !self.rehydrate_done() {
            return false;
        }
        // What the walk and the blocks looked at again make sure of,
        // checked whole in debug builds (the tier simulation).
        if cfg!(debug_assertions) {
            let on_leg = |b: &u64| self.pending.get(b).is_some_and(|p| !p.zero);
            let missed = self.map.from_block(0).find(|(b, _)| !on_leg(b));
            assert_eq!(
                missed, None,
                "a mapped block not on the leg at the map's forgetting"
            );
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
        let ready = self.pending.values().filter(|p| Self::is_ready(p)).count();
        assert_eq!(ready, self.ready, "the count of ready pending blocks");
        for (&b, p) in &self.pending {
            if p.zero {
                let covered = self.unmaps.iter().any(|&(f, n, _)| (f..f + n).contains(&b));
                assert!(covered, "block {b} zeroed with no unmap to come");
            }
        }
        let mut slots = BTreeSet::new();
        for d in &self.stripes {
            assert!(d.blocks.len() <= self.columns.blocks_per_stripe());
            assert!(d.blocks.windows(2).all(|w| w[0].0 < w[1].0));
            assert_eq!(self.map.live(d.slot), 0, "destaging into a used slot");
            assert!(
                slots.insert(d.slot),
                "two stripes in flight in slot {}",
                d.slot
            );
        }
        assert!(self.stripes.iter().filter(|d| d.ticket.is_none()).count() <= 1);
        assert!(self
            .recording
            .iter()
            .all(|s| self.stripes.iter().any(|d| d.slot == *s && d.written)));
        let named: std::collections::HashSet<(u64, u64)> = self
            .stripes
            .iter()
            .filter(|d| d.ticket.is_some())
            .flat_map(|d| d.blocks.iter().copied())
            .collect();
        for (&b, &seq) in &self.direct {
            assert!(
                named.contains(&(b, seq)),
                "block {b}: direct write {seq} in no stripe in flight"
            );
        }
        assert!(self.since_checkpoint <= self.log_records, "the log wrapped");
        assert!(
            self.log_at >= self.volume_bytes,
            "the log inside the volume"
        );
        if matches!(self.lowering, Some(Lowering::Forgotten { .. })) {
            assert!(self.map.is_empty(), "a map kept after it was forgotten");
        }
    }
}

/// The block numbers of a stripe, in its order.
fn block_numbers(d: &Destage) -> Vec<u64> {
    d.blocks.iter().map(|&(b, _)| b).collect()
}

/// Whether two stripes' blocks (each in ascending order) name no block
/// in common: their bounds first, then a merge of the two.
pub(super) fn disjoint(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
    let (Some(af), Some(al), Some(bf), Some(bl)) = (a.first(), a.last(), b.first(), b.last())
    else {
        return true;
    };
    if al.0 < bf.0 || bl.0 < af.0 {
        return true;
    }
    let (mut i, mut j) = (0, 0);
    while let (Some(x), Some(y)) = (a.get(i), b.get(j)) {
        match x.0.cmp(&y.0) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return false,
        }
    }
    true
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
