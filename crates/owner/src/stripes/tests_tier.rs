//! A simulation of an erasure-coded volume's two legs under the tier's
//! bookkeeping: writes and zeroings, destages taken apart into their
//! steps (read, stripe write, record, trims) and interleaved with the
//! clients, crashes at any point (the record in flight torn, part of the
//! trims sent), resyncs that fill holes of the performance leg with
//! zeros, and new owners recovering from the circular map log. After
//! every step each block reads back (through [`Tier::source`]) what the
//! clients last wrote; a zeroing not yet acknowledged at a crash may read
//! either way.

use super::*;
use proptest::prelude::*;
use shoal_erasure::Geometry;
use std::collections::{BTreeMap, BTreeSet};

const VOLUME: u64 = 3;
const BLOCKS: u64 = 160;
/// Runs per checkpoint part in the sim: a checkpoint of a map of many
/// runs takes several parts, and several writes of [`PARTS_PER_WRITE`].
const RUNS_PER_PART: usize = 8;
/// A small log, sized as [`log_records_for`] sizes one (twice the most
/// parts a checkpoint can take, every block a run) but with 4 spare
/// records, not 64: checkpoints are written often and the log wraps.
const LOG_RECORDS: u64 = 2 * BLOCKS.div_ceil(RUNS_PER_PART as u64) + 4;
const PARTS_PER_WRITE: usize = 2;
/// Few stripe slots: 160 blocks fill three stripes of 62, and overwrites
/// soon leave the cleaner to make room.
const SLOTS: u64 = 10;

type Data = u8;

#[derive(Debug, Clone)]
enum Step {
    /// Write block `b` with data byte `v` (0: a block of zeros).
    Write(u64, Data),
    Zero(u64, u64),
    /// A client's write of a whole stripe of blocks from `.0` with data
    /// byte `.1`, straight to the capacity leg (staged if the tier says
    /// no).
    Direct(u64, Data),
    BeginDestage,
    /// The stripe in flight at this index (modulo their count) is
    /// written whole.
    WriteStripe(usize),
    /// The stripe in flight at this index, if not written, fails.
    FailStripe(usize),
    Record,
    Trim,
    /// Crash: the record in flight is lost (`torn`) or made durable, and
    /// the first `sent` trims waiting were applied; then a resync fills
    /// the holes of region `fill` (16 blocks) with zeros, if some.
    Crash {
        torn: bool,
        sent: usize,
        fill: Option<u64>,
    },
    /// The volume begins its lowering to RAID-1 (kept across crashes,
    /// as the directory keeps the change).
    Lower,
    /// Reads of up to `n` mapped blocks from the stripes, to stage.
    RehydrateRead(usize),
    /// The blocks read come back: each still mapped there is staged.
    RehydrateWrite,
    /// The reads of blocks back from the stripes fail.
    RehydrateFail,
    /// The empty checkpoint is asked for.
    Forget,
    /// The map log is trimmed, once the map is forgotten.
    TrimLog,
}

/// Blocks of a stripe of [`columns`].
const PER: u64 = 62;

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        8 => (0..BLOCKS, 0u8..4).prop_map(|(b, v)| Step::Write(b, v)),
        1 => (0..BLOCKS, 1u64..40).prop_map(|(b, n)| Step::Zero(b, n.min(BLOCKS - b))),
        2 => (0..=BLOCKS - PER, 1u8..4).prop_map(|(b, v)| Step::Direct(b, v)),
        3 => Just(Step::BeginDestage),
        4 => (0usize..4).prop_map(Step::WriteStripe),
        1 => (0usize..4).prop_map(Step::FailStripe),
        4 => Just(Step::Record),
        3 => Just(Step::Trim),
        1 => (any::<bool>(), 0usize..4, prop::option::of(0..BLOCKS / 16))
            .prop_map(|(torn, sent, fill)| Step::Crash { torn, sent, fill }),
        1 => Just(Step::Lower),
        2 => (1usize..40).prop_map(Step::RehydrateRead),
        2 => Just(Step::RehydrateWrite),
        1 => Just(Step::RehydrateFail),
        1 => Just(Step::Forget),
        1 => Just(Step::TrimLog),
    ];
    prop::collection::vec(step, 1..300)
}

/// The simulated devices and the owner's state over them.
struct Sim {
    tier: Tier,
    /// The performance leg: allocated blocks (a hole reads as zeros).
    perf: BTreeMap<u64, Data>,
    /// The capacity leg: what each stripe slot holds, by block index.
    stripes: BTreeMap<u64, BTreeMap<u16, Data>>,
    /// The map log, a circle of records.
    log: Vec<Option<MapRecord>>,
    /// The data of each stripe in flight, by slot: a destage's read from
    /// the leg when it began, a clean's from the columns, a direct
    /// write's from the client.
    in_flight: BTreeMap<u64, Vec<Data>>,
    /// Stripes the cleaner began.
    cleans: u64,
    /// Stripes of direct writes begun.
    directs: u64,
    /// The record being written.
    /// The records of the log write in flight.
    records: Vec<MapRecord>,
    /// Trims sent and not yet done, in order. A later write to the same
    /// blocks is done after them (the leg's copies keep the order
    /// requests are sent in): [`Sim::ordered_after_trims`].
    /// Each with the tickets acknowledged once it is done.
    trims: Vec<(u64, u64, Vec<Ticket>)>,
    /// Zeroings and direct writes waiting for their tickets: each
    /// block's entry in `history`.
    waiting: BTreeMap<Ticket, Vec<(u64, usize)>>,
    /// Direct writes in flight: their first block and data byte.
    direct: BTreeMap<Ticket, (u64, Data)>,
    /// Every client write of each block, in the order asked, with
    /// whether it is acknowledged. A read may answer the last
    /// acknowledged one or any after it; a crash too, and then that is
    /// the block's whole history.
    history: BTreeMap<u64, Vec<(Data, bool)>>,
    /// Tickets whose trims are done, waiting for the earlier ones.
    ready: BTreeSet<Ticket>,
    /// The last ticket acknowledged: they are, in order.
    acked_upto: Ticket,
    /// The volume is being lowered to RAID-1.
    lowering: bool,
    /// Blocks read back from the stripes, with where from and the data.
    rehydrating: Vec<(u64, Loc, Data)>,
}

fn columns() -> Columns {
    Columns::new(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap())
}

/// A log of `records` at the end of a volume of `blocks`.
fn at_end(blocks: u64, records: u64) -> LogPlace {
    LogPlace {
        at: blocks * 4096,
        records,
    }
}

/// The sim's tier: an unmap is recorded in steps of a few mapped blocks,
/// so that crashes fall between them.
fn tier(map: StripeMap, pending: Vec<u64>) -> Tier {
    let mut t = Tier::new(
        VOLUME,
        BLOCKS * 4096,
        columns(),
        map,
        pending,
        (at_end(BLOCKS, LOG_RECORDS), SLOTS),
    );
    t.unmap_record_blocks = UNMAP_STEP_BLOCKS;
    t.rehydrate_walk_blocks = REHYDRATE_WALK_BLOCKS;
    t.runs_per_part = RUNS_PER_PART;
    t.parts_per_write = PARTS_PER_WRITE;
    t
}

/// [`Tier::rehydrate_walk_blocks`] in the sim: a walk of the map takes
/// several looks, and blocks mapped behind it are looked at again.
const REHYDRATE_WALK_BLOCKS: usize = 9;

/// [`Tier::unmap_record_blocks`] in the sim.
const UNMAP_STEP_BLOCKS: u64 = 5;

impl Sim {
    fn new() -> Sim {
        assert_eq!(columns().blocks_per_stripe() as u64, PER);
        Sim {
            tier: tier(StripeMap::default(), Vec::new()),
            perf: BTreeMap::new(),
            stripes: BTreeMap::new(),
            log: vec![None; LOG_RECORDS as usize],
            in_flight: BTreeMap::new(),
            cleans: 0,
            directs: 0,
            records: Vec::new(),
            trims: Vec::new(),
            waiting: BTreeMap::new(),
            direct: BTreeMap::new(),
            history: BTreeMap::new(),
            ready: BTreeSet::new(),
            acked_upto: 0,
            lowering: false,
            rehydrating: Vec::new(),
        }
    }

    fn lower(&mut self) {
        self.lowering = true;
        self.tier.lower();
    }

    fn rehydrate_read(&mut self, n: usize) {
        let skip: BTreeSet<u64> = self.rehydrating.iter().map(|r| r.0).collect();
        let look = self.tier.to_rehydrate(n, &skip).blocks;
        let distinct: BTreeSet<u64> = look.iter().map(|&(b, _)| b).collect();
        assert_eq!(
            distinct.len(),
            look.len(),
            "a block found twice in one look"
        );
        assert!(
            distinct.is_disjoint(&skip),
            "a block found while its read is in flight"
        );
        assert!(look.len() <= n, "a look past its batch");
        for (b, loc) in look {
            let data = self.stripes[&loc.slot][&loc.index];
            self.rehydrating.push((b, loc, data));
        }
    }

    /// As the owner does: a block still mapped where it was read from is
    /// staged with that data (a block of zeros is zeroed).
    fn rehydrate_write(&mut self) {
        for (b, loc, data) in std::mem::take(&mut self.rehydrating) {
            if !self.tier.rehydrated(b, loc) {
                continue;
            }
            if data == 0 {
                let z = self.tier.zero(b, 1);
                self.zeroed(&z, None);
                continue;
            }
            self.stage(b, 1, data);
        }
    }

    /// The reads back in flight fail: the owner hands them back.
    fn rehydrate_fail(&mut self) {
        for (b, _, _) in std::mem::take(&mut self.rehydrating) {
            self.tier.rehydrate_failed(b);
        }
    }

    fn forget(&mut self) {
        let asked = self.tier.forget_map(self.rehydrating.len());
        assert!(!asked || self.lowering);
    }

    /// The owner trims the map log once the map is forgotten: what a new
    /// owner then finds is an empty log.
    fn trim_log(&mut self) {
        if self.tier.map_forgotten() {
            assert!(self.records.is_empty());
            self.log.iter_mut().for_each(|r| *r = None);
        }
    }

    fn read(&self, b: u64) -> Data {
        match self.tier.source(b) {
            Source::Performance => self.perf.get(&b).copied().unwrap_or(0),
            Source::Stripe(loc) => self.stripes[&loc.slot][&loc.index],
            Source::Zeros => 0,
        }
    }

    /// What block `b` may read now: its last acknowledged write and every
    /// one after it.
    fn may_read(&self, b: u64) -> Vec<Data> {
        let Some(h) = self.history.get(&b) else {
            return vec![0];
        };
        let from = h.iter().rposition(|&(_, acked)| acked);
        let mut out: Vec<Data> = h[from.unwrap_or(0)..].iter().map(|&(v, _)| v).collect();
        if from.is_none() {
            out.push(0);
        }
        out
    }

    /// Client write `v` of block `b`: its place in the block's history.
    fn asked(&mut self, b: u64, v: Data, acked: bool) -> usize {
        let h = self.history.entry(b).or_default();
        h.push((v, acked));
        h.len() - 1
    }

    /// A request to block `b` is done after every trim sent before it
    /// that covers `b` (and those before that one).
    fn ordered_after_trims(&mut self, b: u64) {
        let last = self
            .trims
            .iter()
            .rposition(|&(f, n, _)| (f..f + n).contains(&b));
        if let Some(i) = last {
            for _ in 0..=i {
                self.trim();
            }
        }
    }

    /// Stages data byte `v` over blocks `first..first + count` on the
    /// performance leg, done at once.
    fn stage(&mut self, first: u64, count: u64, v: Data) {
        for b in first..first + count {
            self.ordered_after_trims(b);
        }
        let seq = self.tier.stage(first, count);
        for b in first..first + count {
            self.perf.insert(b, v);
        }
        self.tier.staged(first, count, seq);
    }

    /// A write of data is acknowledged once on the performance leg.
    fn write(&mut self, b: u64, v: Data) {
        if v == 0 {
            self.zero(b, 1);
            return;
        }
        self.stage(b, 1, v);
        self.asked(b, v, true);
    }

    /// A zeroing is acknowledged once trimmed, or once its ticket is.
    fn zero(&mut self, first: u64, count: u64) {
        for b in first..first + count {
            self.ordered_after_trims(b);
        }
        let z = self.tier.zero(first, count);
        let places: Vec<(u64, usize)> = (first..first + count)
            .map(|b| (b, self.asked(b, 0, z.ticket.is_none())))
            .collect();
        self.zeroed(&z, Some(places));
    }

    /// The trims a zeroing asks for now, and its ticket's wait.
    fn zeroed(&mut self, z: &Zeroing, places: Option<Vec<(u64, usize)>>) {
        for &(f, n) in &z.trim_now {
            for b in f..f + n {
                self.perf.remove(&b);
            }
        }
        if let Some(t) = z.ticket {
            self.waiting.insert(t, places.unwrap_or_default());
        }
    }

    /// A whole stripe of blocks from `first` with data byte `v`: straight
    /// to the capacity leg if the tier begins it, else staged.
    fn direct(&mut self, first: u64, v: Data) {
        let Some(d) = self
            .tier
            .begin_direct(first, &BTreeSet::new(), (None, 2))
            .cloned()
        else {
            for b in first..first + PER {
                self.write(b, v);
            }
            return;
        };
        self.directs += 1;
        let Some(t) = d.ticket else {
            panic!("a direct stripe without a ticket");
        };
        assert_eq!(d.blocks.len() as u64, PER);
        assert!(d
            .blocks
            .iter()
            .zip(first..)
            .all(|(&(b, _), want)| b == want));
        let places = (first..first + PER).map(|b| (b, self.asked(b, v, false)));
        let places = places.collect();
        self.waiting.insert(t, places);
        self.direct.insert(t, (first, v));
        self.in_flight.insert(d.slot, vec![v; PER as usize]);
    }

    /// Ticket `t`'s unmap or stripe, and trims (and every earlier
    /// record's), are done: a direct write is acknowledged now, as the
    /// owner does, a zeroing once every earlier ticket is.
    fn acknowledge(&mut self, t: Ticket) {
        if self.direct.remove(&t).is_some() {
            self.acknowledge_now(t);
        }
        self.ready.insert(t);
        while self.ready.remove(&(self.acked_upto + 1)) {
            self.acked_upto += 1;
            self.acknowledge_now(self.acked_upto);
        }
    }

    fn acknowledge_now(&mut self, t: Ticket) {
        for (b, i) in self.waiting.remove(&t).unwrap_or_default() {
            if let Some(h) = self.history.get_mut(&b) {
                h[i].1 = true;
            }
        }
    }

    fn begin_destage(&mut self) {
        if let Some(d) = self.tier.begin_stripe(&BTreeSet::new()).cloned() {
            if !d.from.is_empty() {
                self.cleans += 1;
                let data = d.from.iter().map(|l| self.stripes[&l.slot][&l.index]);
                self.in_flight.insert(d.slot, data.collect());
                return;
            }
            for &(b, _) in &d.blocks {
                self.ordered_after_trims(b);
            }
            let data = d
                .blocks
                .iter()
                .map(|(b, _)| self.perf.get(b).copied().unwrap_or(0));
            self.in_flight.insert(d.slot, data.collect());
        }
    }

    /// The slot of the `i`th stripe in flight (modulo their count).
    fn nth_in_flight(&self, i: usize) -> Option<u64> {
        let n = self.in_flight.len();
        (n > 0).then(|| *self.in_flight.keys().nth(i % n).unwrap())
    }

    fn write_stripe(&mut self, i: usize) {
        let Some(slot) = self.nth_in_flight(i) else {
            return;
        };
        let data = self.in_flight.remove(&slot).unwrap();
        let units = (0..).zip(data).collect();
        self.stripes.insert(slot, units);
        self.tier.stripe_written(slot);
    }

    /// A stripe in flight fails before it is written: a direct write's
    /// blocks are staged, and it is acknowledged.
    fn fail_stripe(&mut self, i: usize) {
        let Some(slot) = self.nth_in_flight(i) else {
            return;
        };
        if self.tier.stripe(slot).is_some_and(|d| {
            // The record in flight names it: written, never failing.
            self.records.iter().any(|r| names(r, d.slot))
        }) {
            return;
        }
        self.in_flight.remove(&slot);
        let Some(f) = self.tier.stripe_failed(slot) else {
            return;
        };
        let (_, v) = self.direct.remove(&f.ticket).unwrap();
        let places = self.waiting.remove(&f.ticket).unwrap_or_default();
        for (b, i) in places {
            self.history.get_mut(&b).unwrap()[i].1 = true;
        }
        for (first, count) in f.restage {
            self.stage(first, count, v);
            // Staged now, after whatever clients asked of these blocks
            // since: the write takes its place last.
            for b in first..first + count {
                self.asked(b, v, true);
            }
        }
        self.acknowledge(f.ticket);
    }

    fn record(&mut self) {
        if self.records.is_empty() {
            self.records = self.tier.next_records();
            return;
        }
        self.make_durable();
    }

    fn make_durable(&mut self) {
        if self.records.is_empty() {
            return;
        }
        for rec in std::mem::take(&mut self.records) {
            self.log_write(rec);
        }
        let applied = self.tier.record_durable().unwrap();
        let trims = applied.trims.iter().map(|&(f, n)| (f, n, Vec::new()));
        self.trims.extend(trims);
        // Acknowledged once every trim sent so far is done (those of
        // earlier records too: an older copy they remove may be what a
        // new owner would otherwise find).
        if !applied.acknowledged.is_empty() {
            self.trims.push((0, 0, applied.acknowledged));
        }
    }

    fn trim(&mut self) {
        if self.trims.is_empty() {
            return;
        }
        let (first, count, tickets) = self.trims.remove(0);
        for b in first..first + count {
            self.perf.remove(&b);
        }
        for t in tickets {
            self.acknowledge(t);
        }
    }

    fn log_write(&mut self, rec: MapRecord) {
        let at = (rec.seq() % LOG_RECORDS) as usize;
        self.log[at] = Some(rec);
    }

    fn crash(&mut self, torn: bool, sent: usize, fill: Option<u64>) -> Result<(), TestCaseError> {
        if !torn {
            self.make_durable();
        }
        // A torn write of several records (checkpoint parts) may leave
        // any of them: here every other one.
        let records = std::mem::take(&mut self.records);
        if records.len() > 1 {
            for rec in records.into_iter().step_by(2) {
                self.log_write(rec);
            }
        }
        for _ in 0..sent {
            self.trim();
        }
        if let Some(r) = fill {
            let region = r * 16..(r + 1) * 16;
            let written = region.clone().any(|b| self.perf.contains_key(&b));
            if written {
                for b in region {
                    self.perf.entry(b).or_insert(0);
                }
            }
        }
        let records: Vec<MapRecord> = self.log.iter().flatten().cloned().collect();
        // The volume's own bounds: every record the tier wrote is within them.
        let bounds = MapBounds {
            blocks: BLOCKS,
            slots: SLOTS,
            blocks_per_stripe: PER,
        };
        let map = Tier::recover_map(&records, bounds).unwrap();
        let pending = classify(&map, self.perf.keys().copied(), |b| self.perf[&b] == 0);
        self.tier = tier(map, pending);
        if self.lowering {
            self.tier.lower();
        }
        self.rehydrating.clear();
        self.in_flight.clear();
        self.records.clear();
        self.trims.clear();
        self.waiting.clear();
        self.direct.clear();
        self.ready.clear();
        self.acked_upto = 0;
        // A write never acknowledged may have happened or not: each block
        // reads its last acknowledged write or one after, and from now on
        // as it reads.
        for b in 0..BLOCKS {
            let now = self.read(b);
            let may = self.may_read(b);
            prop_assert!(
                may.contains(&now),
                "block {}: {} after a crash, not one of {:?}",
                b,
                now,
                may
            );
            self.history.insert(b, vec![(now, true)]);
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        // The capacity reports' count: every block a read does not answer
        // with zeros without I/O.
        let holding = (0..BLOCKS)
            .filter(|&b| self.tier.source(b) != Source::Zeros)
            .count() as u64;
        prop_assert_eq!(self.tier.written_blocks(), holding);
        // The same a few pending blocks at a time, as the loop's ticks
        // count it: one pass over the pending set, then the count.
        let mut scan = WrittenScan::default();
        let steps = self.tier.pending_blocks().div_ceil(3).max(1);
        for _ in 1..steps {
            prop_assert_eq!(self.tier.scan_written(&mut scan, 3), None);
        }
        prop_assert_eq!(self.tier.scan_written(&mut scan, 3), Some(holding));
        prop_assert_eq!(scan, WrittenScan::default());
        for b in 0..BLOCKS {
            let may = self.may_read(b);
            prop_assert!(
                may.contains(&self.read(b)),
                "block {} reads {} ({:?}), not one of {:?}",
                b,
                self.read(b),
                self.tier.source(b),
                may
            );
        }
        Ok(())
    }

    /// Every write acknowledged, each block reads its last one.
    fn check_settled(&self) -> Result<(), TestCaseError> {
        prop_assert!(
            self.waiting.is_empty(),
            "writes never acknowledged: {:?}",
            self.waiting.keys()
        );
        for b in 0..BLOCKS {
            let last = self
                .history
                .get(&b)
                .and_then(|h| h.last())
                .map_or(0, |e| e.0);
            prop_assert_eq!(self.read(b), last, "block {}", b);
        }
        Ok(())
    }

    /// One round of everything the owner does on its own.
    fn drain_round(&mut self) {
        self.begin_destage();
        for _ in 0..self.in_flight.len() {
            self.write_stripe(0);
        }
        self.record();
        self.record();
        self.trim();
    }
}

/// Whether record `r` names a stripe in slot `slot`.
fn names(r: &MapRecord, slot: u64) -> bool {
    match r {
        MapRecord::Stripe { slot: s, .. } => *s == slot,
        MapRecord::Stripes { stripes, .. } => stripes.iter().any(|e| e.slot == slot),
        _ => false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn every_block_reads_what_was_last_written_through_destages_and_crashes(steps in steps()) {
        let mut sim = Sim::new();
        for step in steps {
            match step {
                Step::Write(b, v) => sim.write(b, v),
                Step::Zero(b, n) => sim.zero(b, n),
                Step::Direct(b, v) => sim.direct(b, v),
                Step::BeginDestage => sim.begin_destage(),
                Step::WriteStripe(i) => sim.write_stripe(i),
                Step::FailStripe(i) => sim.fail_stripe(i),
                Step::Record => sim.record(),
                Step::Trim => sim.trim(),
                Step::Crash { torn, sent, fill } => sim.crash(torn, sent, fill)?,
                Step::Lower => sim.lower(),
                Step::RehydrateRead(n) => sim.rehydrate_read(n),
                Step::RehydrateWrite => sim.rehydrate_write(),
                Step::RehydrateFail => sim.rehydrate_fail(),
                Step::Forget => sim.forget(),
                Step::TrimLog => sim.trim_log(),
            }
            sim.check()?;
        }
        if sim.lowering {
            // Carried through: every block on the performance leg alone.
            for _ in 0..(BLOCKS as usize * 8) {
                for _ in 0..sim.in_flight.len() {
                    sim.write_stripe(0);
                }
                sim.rehydrate_read(40);
                sim.rehydrate_write();
                sim.forget();
                sim.record();
                sim.record();
                sim.trim();
            }
            prop_assert!(sim.tier.map_forgotten());
            sim.trim_log();
            while !sim.trims.is_empty() {
                sim.trim();
            }
            sim.check_settled()?;
            prop_assert!(sim.tier.map().is_empty());
            for b in 0..BLOCKS {
                let last = sim.history.get(&b).and_then(|h| h.last()).map_or(0, |e| e.0);
                prop_assert_eq!(sim.perf.get(&b).copied().unwrap_or(0), last, "block {}", b);
            }
            // What a new owner (or the RAID-1 owner) finds: no map at all.
            sim.crash(true, 0, None)?;
            sim.check_settled()?;
            return Ok(());
        }
        // Drained, every block written is in the capacity leg.
        for _ in 0..(BLOCKS as usize * 8) {
            sim.drain_round();
        }
        sim.check_settled()?;
        prop_assert_eq!(sim.tier.pending_blocks(), 0);
        let in_stripes = (0..BLOCKS).filter(|&b| matches!(sim.tier.source(b), Source::Stripe(_)));
        let nonzero = (0..BLOCKS).filter(|&b| sim.read(b) != 0).count();
        prop_assert!(in_stripes.count() >= nonzero);
    }
}

proptest! {
    /// Two stripes' blocks share none exactly when the merge says so.
    #[test]
    fn disjoint_stripes_are_those_sharing_no_block(
        a in proptest::collection::btree_set(0u64..300, 0..70),
        b in proptest::collection::btree_set(0u64..300, 0..70),
    ) {
        let pairs = |s: &BTreeSet<u64>| s.iter().map(|&x| (x, 7)).collect::<Vec<_>>();
        let expected = a.intersection(&b).next().is_none();
        prop_assert_eq!(super::tier::disjoint(&pairs(&a), &pairs(&b)), expected);
        prop_assert_eq!(super::tier::disjoint(&pairs(&b), &pairs(&a)), expected);
    }
}

/// Overwrite the whole volume again and again: the cleaner makes room in
/// the few slots, every block stays readable, and the columns never hold
/// more slots than they have.
#[test]
fn the_cleaner_makes_room_for_overwrites() {
    let mut sim = Sim::new();
    for b in 0..BLOCKS {
        sim.write(b, 1);
    }
    for round in 2..=14u8 {
        // About a third of the blocks, scattered anew each round: every
        // stripe keeps live blocks beside dead ones.
        let hit = |b: u64| (b * 2654435761 + u64::from(round) * 40503) % 97 < 32;
        for b in (0..BLOCKS).filter(|&b| hit(b)) {
            sim.write(b, round);
        }
        for _ in 0..200 {
            sim.drain_round();
        }
        sim.check().unwrap();
        assert_eq!(sim.tier.pending_blocks(), 0, "round {round}");
        assert!(sim.tier.map().used_slots() as u64 <= SLOTS);
        assert!(sim.stripes.keys().all(|&s| s < SLOTS));
    }
    assert!(sim.cleans > 0, "the cleaner never ran");
}

/// The log's size keeps two of the largest checkpoints a volume can need.
#[test]
fn the_log_holds_two_worst_checkpoints() {
    let parts =
        |bytes: u64| (bytes / 4096).div_ceil(super::format::RUNS_PER_CHECKPOINT_PART as u64);
    for bytes in [4096, 1 << 20, 1 << 30, 1 << 40] {
        assert!(log_records_for(bytes) >= 2 * parts(bytes) + 4, "{bytes}");
    }
    // A 2 GiB volume: about 23 MiB of log past its end, on a thin leg.
    assert!(log_records_for(2 << 30) * 4096 < 24 << 20);
}

/// A log with records and no whole checkpoint is refused, not served as
/// an empty map.
#[test]
fn a_log_without_a_checkpoint_is_refused() {
    let rec = MapRecord::Unmap {
        volume: VOLUME,
        seq: 5,
        first: 0,
        count: 1,
    };
    assert_eq!(
        Tier::recover_map(&[rec], MapBounds::ANY).unwrap_err(),
        TierError::NoCheckpoint
    );
    assert!(Tier::recover_map(&[], MapBounds::ANY).unwrap().is_empty());
}

/// A replayed record naming a slot past the capacity leg's, a block past
/// the volume's end or an index past a stripe's blocks (a log that is
/// not this volume's) is refused with what it names, before any of it
/// is mapped; within the bounds the same log replays.
#[test]
fn a_record_outside_the_volume_is_refused_before_it_is_mapped() {
    let c = Columns::new(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap());
    let bounds = MapBounds::of(&c, 64 << 20);
    assert_eq!(bounds.blocks, 16_384);
    let checkpoint = StripeMap::default().checkpoint(VOLUME, 1);
    let stripe = |slot: u64, blocks: Vec<u64>| MapRecord::Stripe {
        volume: VOLUME,
        seq: 2,
        stripe_seq: 1,
        slot,
        blocks,
    };
    let run = |block: u64, slot: u64, index: u16| MapRecord::Checkpoint {
        volume: VOLUME,
        seq: 1,
        part: 0,
        last: true,
        last_stripe_seq: 0,
        after: Some(0),
        runs: vec![Run {
            block,
            len: 2,
            slot,
            index,
        }],
    };
    let cases = [
        (stripe(bounds.slots, vec![0]), "slot"),
        (stripe(0, vec![0, bounds.blocks]), "block"),
        (stripe(0, vec![0; 63]), "stripe of more blocks"),
    ];
    for (rec, what) in cases {
        let log = [checkpoint[0].clone(), rec];
        let e = Tier::recover_map(&log, bounds).unwrap_err();
        assert_eq!(e, TierError::Map(MapError::Outside { seq: 2, what }));
    }
    // A slot no map holds is refused even without a volume's bounds.
    let log = [checkpoint[0].clone(), stripe(u64::MAX - 1, vec![0])];
    let e = Tier::recover_map(&log, MapBounds::ANY).unwrap_err();
    assert_eq!(
        e,
        TierError::Map(MapError::Outside {
            seq: 2,
            what: "slot"
        })
    );
    for (rec, what) in [
        (run(bounds.blocks - 1, 0, 0), "block"),
        (run(0, bounds.slots, 0), "slot"),
        (run(0, 0, 61), "stripe index"),
    ] {
        let e = Tier::recover_map(&[rec], bounds).unwrap_err();
        assert_eq!(e, TierError::Map(MapError::Outside { seq: 1, what }));
    }
    let fine = [
        checkpoint[0].clone(),
        stripe(bounds.slots - 1, vec![bounds.blocks - 1]),
    ];
    let map = Tier::recover_map(&fine, bounds).unwrap();
    assert_eq!(
        map.get(bounds.blocks - 1).map(|l| l.slot),
        Some(bounds.slots - 1)
    );
}

/// The blocks a new owner takes as pending: unmapped ones, and mapped
/// ones whose copy on the leg is not a resync's zeros.
#[test]
fn classify_keeps_newer_data_and_drops_resync_zeros() {
    let mut map = StripeMap::default();
    map.apply(&super::tests::stripe_record(1, 0, vec![10, 11]))
        .unwrap();
    let zeros: BTreeSet<u64> = [11, 12].into();
    let pending = classify(&map, [10, 11, 12, 13], |b| zeros.contains(&b));
    assert_eq!(pending, vec![10, 12, 13]);
}

/// A zeroing of the whole volume holds on the performance leg only the
/// blocks with data there; the blocks only the stripes hold read their
/// data until the unmap record applies, and zeros from then on.
#[test]
fn a_whole_volume_zeroing_holds_only_the_blocks_on_the_leg_and_unmaps_in_steps() {
    let mut sim = Sim::new();
    for b in 0..BLOCKS {
        sim.write(b, 1);
    }
    for _ in 0..200 {
        sim.drain_round();
    }
    assert_eq!(sim.tier.pending_blocks(), 0);
    sim.write(5, 2);
    sim.write(6, 2);
    sim.zero(0, BLOCKS);
    assert_eq!(
        sim.tier.pending_blocks(),
        2,
        "only the leg's blocks are held"
    );
    assert_eq!(sim.read(7), 1, "older data until the unmap applies");
    assert_eq!(sim.read(5), 0);
    // Recorded in steps of a few mapped blocks each (checkpoints between),
    // the zeroing acknowledged after the last.
    let mut mapped = vec![sim.tier.map().len()];
    for _ in 0..200 {
        sim.drain_round();
        mapped.push(sim.tier.map().len());
    }
    sim.check().unwrap();
    assert!(sim.tier.map().is_empty());
    let steps = mapped.windows(2).filter(|w| w[1] < w[0]).count();
    assert!(steps as u64 >= BLOCKS / UNMAP_STEP_BLOCKS, "{steps} steps");
    assert!(mapped
        .windows(2)
        .all(|w| w[0] - w[1] <= UNMAP_STEP_BLOCKS as usize));
    assert!((0..BLOCKS).all(|b| sim.read(b) == 0));
}

/// A checkpoint of many parts goes out in writes of at most
/// `parts_per_write` consecutive records that never run past the log's
/// end, one part taken from the map per step; nothing else is recorded
/// meanwhile. A crash amid it leaves the checkpoint before it, from which
/// the records replay to the same map.
#[test]
fn a_checkpoint_of_many_parts_goes_out_in_bounded_writes_within_the_log() {
    const LOG: u64 = 300;
    let mut before = StripeMap::default().checkpoint(VOLUME, 290);
    for s in 0..4u64 {
        // Blocks b with b % 4 == s: each block a run of its own.
        let blocks: Vec<u64> = (0..248).filter(|b| b % 4 == s).collect();
        before.push(MapRecord::Stripe {
            volume: VOLUME,
            seq: 291 + s,
            stripe_seq: 1 + s,
            slot: s,
            blocks,
        });
    }
    let map = StripeMap::replay(&before).unwrap();
    let mut t = parted_tier(map, LOG);
    let mut writes: Vec<Vec<MapRecord>> = Vec::new();
    let mut direct = None;
    let after = loop {
        let recs = t.next_records();
        if !matches!(recs.first(), Some(MapRecord::Checkpoint { .. })) {
            break recs;
        }
        assert!(
            t.next_records().is_empty(),
            "a second write while one is in flight"
        );
        if writes.len() == 2 {
            // A client's whole stripe, written amid the checkpoint: its
            // record waits for the checkpoint's last part.
            let d = t.begin_direct(0, &BTreeSet::new(), (None, 1)).cloned();
            let slot = d.expect("a free slot for a direct stripe").slot;
            t.stripe_written(slot);
            direct = Some(slot);
        }
        assert!(recs.len() <= 16);
        let first = recs[0].seq();
        assert!(recs.iter().zip(first..).all(|(r, s)| r.seq() == s));
        let end = t.log_offset(first) + recs.len() as u64 * 4096;
        assert!(
            end <= (CYCLE_BLOCKS + LOG) * 4096,
            "a write past the log's end"
        );
        t.record_durable().unwrap();
        writes.push(recs);
    };
    let slot = direct.expect("the direct stripe began");
    assert!(matches!(&after[..], [r] if names(r, slot)), "{after:?}");
    // 248 runs of one block, two per part: 124 parts, the first write cut
    // at the log's end (seqs 295 to 299).
    let parts: Vec<MapRecord> = writes.iter().flatten().cloned().collect();
    assert_eq!(parts.len(), 124);
    assert_eq!(writes[0].len(), 5);
    assert_eq!(writes.len(), 1 + 119usize.div_ceil(16));
    for (i, p) in parts.iter().enumerate() {
        let MapRecord::Checkpoint { part, last, .. } = p else {
            panic!("not a checkpoint part: {p:?}");
        };
        assert_eq!((*part as usize, *last), (i, i == 123));
    }
    let mut log = before.clone();
    log.extend(parts.iter().cloned());
    let whole = StripeMap::replay(&log).unwrap();
    assert_eq!(whole.next_record_seq(), 295 + 124);
    let blocks = |m: &StripeMap| m.from_block(0).collect::<Vec<_>>();
    assert_eq!(blocks(&whole), blocks(t.map()));
    // Torn amid the checkpoint: its first writes, and every other part of
    // the third. The checkpoint before it still holds.
    let mut torn = before;
    torn.extend(writes[..2].iter().flatten().cloned());
    torn.extend(writes[2].iter().step_by(2).cloned());
    let replayed = StripeMap::replay(&torn).unwrap();
    assert_eq!(blocks(&replayed), blocks(t.map()));
}

/// A log of `n` places, each holding the last record written there.
struct Ring(Vec<Option<MapRecord>>);

impl Ring {
    fn write(&mut self, recs: &[MapRecord]) {
        let n = self.0.len() as u64;
        for r in recs {
            self.0[(r.seq() % n) as usize] = Some(r.clone());
        }
    }

    fn records(&self) -> Vec<MapRecord> {
        self.0.iter().flatten().cloned().collect()
    }
}

/// The tier of the checkpoint-cycle test: 248 blocks, each a run of its
/// own, and the client's stripe of 62 more (one run): 125 parts of two
/// runs, every checkpoint as large as the log allows, in a log of twice
/// that and the spare records ([`log_records_for`]'s rule with this
/// test's part sizes).
const CYCLE_LOG: u64 = 2 * 125 + 64;
/// Blocks of the cycle test's volume.
const CYCLE_BLOCKS: u64 = 400;

/// The cycle test's map as stripe records at seqs 2 to 6: 248 blocks in
/// four stripes, each block a run of its own, and a stripe of 62 more.
fn cycle_stripes() -> Vec<MapRecord> {
    let stripe = |s: u64| {
        let blocks: Vec<u64> = match s {
            4 => (248..310).collect(),
            _ => (0..248).filter(|b| b % 4 == s).collect(),
        };
        MapRecord::Stripe {
            volume: VOLUME,
            seq: 2 + s,
            stripe_seq: 1 + s,
            slot: s,
            blocks,
        }
    };
    (0..5).map(stripe).collect()
}

fn cycle_tier(map: StripeMap) -> Tier {
    parted_tier(map, CYCLE_LOG)
}

/// A tier of [`CYCLE_BLOCKS`] whose checkpoints take two runs per part
/// and 16 parts per write, in a log of `log_records`.
fn parted_tier(map: StripeMap, log_records: u64) -> Tier {
    placed_tier(map, at_end(CYCLE_BLOCKS, log_records))
}

/// [`parted_tier`] with its log at `log`.
fn placed_tier(map: StripeMap, log: LogPlace) -> Tier {
    let bytes = CYCLE_BLOCKS * 4096;
    let mut t = Tier::new(VOLUME, bytes, columns(), map, Vec::new(), (log, SLOTS));
    t.runs_per_part = 2;
    t.parts_per_write = 16;
    t
}

/// Writes `t`'s next records to `ring` and makes them durable (a client's
/// whole stripe of blocks 248 to 309 when nothing else is due); after
/// each write the log replays to a map with the tier's blocks.
fn cycle_step(t: &mut Tier, ring: &mut Ring) -> Vec<MapRecord> {
    let mut recs = t.next_records();
    if recs.is_empty() {
        let d = t.begin_direct(248, &BTreeSet::new(), (None, 1)).cloned();
        t.stripe_written(d.expect("a free slot").slot);
        recs = t.next_records();
    }
    ring.write(&recs);
    t.record_durable().unwrap();
    let replayed = StripeMap::replay(&ring.records()).expect("a complete checkpoint in the log");
    let blocks = |m: &StripeMap| m.from_block(0).collect::<Vec<_>>();
    assert_eq!(blocks(&replayed), blocks(t.map()));
    recs
}

/// Checkpoints of a map as large as the log allows, cycle after cycle,
/// never overwrite the newest complete one (a checkpoint begins when half
/// the log has been written since the last one began, its own parts
/// counted); and a new owner that finds the log ending amid a checkpoint,
/// torn in its last write, finishes that checkpoint where it would have
/// ended instead of writing another, through crash after crash.
#[test]
fn checkpoint_cycles_and_crashes_amid_them_never_overwrite_the_complete_one() {
    let mut ring = Ring(vec![None; CYCLE_LOG as usize]);
    let mut before = StripeMap::default().checkpoint(VOLUME, 1);
    before.extend(cycle_stripes());
    ring.write(&before);
    let mut t = cycle_tier(StripeMap::recover(&ring.records()).unwrap());
    // Three cycles: every write replays (`cycle_step`).
    let mut firsts = Vec::new();
    while firsts.len() < 4 {
        let recs = cycle_step(&mut t, &mut ring);
        if let Some(MapRecord::Checkpoint { part: 0, seq, .. }) = recs.first() {
            firsts.push(*seq);
        }
    }
    // A checkpoint begins half the log after the last began.
    let gaps: Vec<u64> = firsts.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(gaps.iter().all(|&g| g == CYCLE_LOG / 2), "{firsts:?}");
    // Every one as large as the log allows.
    let runs = |p: &MapRecord| match p {
        MapRecord::Checkpoint { runs, .. } => runs.len(),
        _ => 0,
    };
    let parts = t.map().checkpoint(VOLUME, 1);
    assert_eq!(
        parts.iter().map(runs).sum::<usize>(),
        249,
        "125 parts of two"
    );
    // Crash amid the checkpoint in flight, its write torn (every other
    // part durable), three times over.
    for crash in 0..3 {
        let recs = loop {
            let recs = t.next_records();
            if matches!(recs.first(), Some(MapRecord::Checkpoint { part, .. }) if *part > 20 + crash * 16)
            {
                break recs;
            }
            ring.write(&recs);
            t.record_durable().unwrap();
        };
        // Every other part durable: the write's first one too, or not.
        let skip = (crash % 2) as usize;
        let torn: Vec<MapRecord> = recs.iter().skip(skip).step_by(2).cloned().collect();
        ring.write(&torn);
        let map = StripeMap::recover(&ring.records()).unwrap();
        let tail = map.log_tail();
        let (part, _) = tail.resume.expect("the log ends amid a checkpoint");
        let MapRecord::Checkpoint {
            part: torn_first, ..
        } = &recs[0]
        else {
            unreachable!()
        };
        let replayed = *torn_first + 1 - skip as u32;
        assert_eq!(part, replayed, "resumed after the last part replayed");
        t = cycle_tier(map);
    }
    // The resumed checkpoint ends where the interrupted one would have,
    // then cycles go on.
    let resumed_first = *firsts.last().unwrap();
    let mut more = Vec::new();
    while more.len() < 2 {
        let recs = cycle_step(&mut t, &mut ring);
        if let Some(MapRecord::Checkpoint { part: 0, seq, .. }) = recs.first() {
            more.push(*seq);
        }
    }
    assert_eq!(
        more[0],
        resumed_first + CYCLE_LOG / 2,
        "{firsts:?} {more:?}"
    );
}

/// A log whose last write of checkpoint parts was torn, written by a
/// writer that split the map in smaller parts: the new owner finishes
/// that checkpoint with its own parts, then, the older parts still lying
/// past its end, writes its next checkpoint above every record found. A
/// crash in between replays the older parts as records of the same map.
#[test]
fn parts_left_past_a_resumed_checkpoint_are_never_followed() {
    let mut before = StripeMap::default().checkpoint(VOLUME, 1);
    before.extend([MapRecord::Stripe {
        volume: VOLUME,
        seq: 2,
        stripe_seq: 1,
        slot: 0,
        blocks: (0..62).map(|b| b * 2).collect(),
    }]);
    let map = StripeMap::replay(&before).unwrap();
    // The old writer: one run per part from seq 3; parts 0 to 9 durable,
    // part 10 torn, 11 to 30 durable.
    let old = map.checkpoint_in_parts_of(VOLUME, 3, 1);
    let mut log = before.clone();
    log.extend(old[..10].iter().cloned());
    log.extend(old[11..31].iter().cloned());
    let recovered = StripeMap::recover(&log).unwrap();
    assert_eq!(recovered.log_tail().resume.map(|(p, _)| p), Some(10));
    assert_eq!(recovered.next_record_seq(), 13);
    let mut t = Tier::new(
        VOLUME,
        BLOCKS * 4096,
        columns(),
        recovered,
        Vec::new(),
        (at_end(BLOCKS, 64), SLOTS),
    );
    t.runs_per_part = 40;
    // The rest (52 runs) in two parts: seqs 13 and 14, the last marked.
    let first = t.next_records();
    assert_eq!(
        first.iter().map(MapRecord::seq).collect::<Vec<_>>(),
        vec![13, 14]
    );
    let mut written = log.clone();
    written.retain(|r| r.seq() < 13 || r.seq() > 14);
    written.extend(first.iter().cloned());
    t.record_durable().unwrap();
    // Complete (from seq 3), and replayed with the older parts after it.
    let replayed = StripeMap::replay(&written).unwrap();
    let blocks = |m: &StripeMap| m.from_block(0).collect::<Vec<_>>();
    assert_eq!(replayed.log_tail().complete_from, 3);
    assert_eq!(blocks(&replayed), blocks(&map));
    // A crash before that one is durable: the older parts replay as
    // records of the same map, and the next owner begins a checkpoint
    // after them.
    let again = StripeMap::recover(&written).unwrap();
    assert_eq!(blocks(&again), blocks(&map));
    assert_eq!(
        (again.next_record_seq(), again.log_tail().resume),
        (34, None)
    );
    // The next record is a checkpoint above every record found (33).
    let next = t.next_records();
    assert!(
        matches!(
            next.first(),
            Some(MapRecord::Checkpoint {
                part: 0,
                seq: 34,
                ..
            })
        ),
        "{next:?}"
    );
}

/// A log left by version 2's rule (a checkpoint began half a log after the
/// last one *ended*), ending amid a checkpoint that, resumed, runs past
/// the newest complete one's place: the new owner goes on as version 2
/// did, without the bound's assertion, until its own first checkpoint
/// is complete; the log then replays to the map.
#[test]
fn a_log_of_version_2_rules_is_carried_on_without_the_bound() {
    let mut ring = Ring(vec![None; CYCLE_LOG as usize]);
    let mut map = StripeMap::default();
    let mut log = StripeMap::default().checkpoint(VOLUME, 1);
    log.extend(cycle_stripes());
    for r in &log {
        map.apply(r).unwrap();
    }
    // The complete checkpoint at 7 (125 parts, to 131), then records to
    // 288, a checkpoint begun at 289 (half a log after 131), 21 parts
    // of it durable.
    log.extend(map.checkpoint_in_parts_of(VOLUME, 7, 2));
    for seq in 132..289u64 {
        let r = MapRecord::Stripe {
            volume: VOLUME,
            seq,
            stripe_seq: seq,
            slot: 5 - (seq % 2),
            blocks: (248..310).collect(),
        };
        map.apply(&r).unwrap();
        log.push(r);
    }
    log.extend(
        map.checkpoint_in_parts_of(VOLUME, 289, 2)
            .into_iter()
            .take(21),
    );
    ring.write(&log);
    let recovered = StripeMap::recover(&ring.records()).unwrap();
    assert_eq!(recovered.log_tail().resume.map(|(p, _)| p), Some(21));
    let mut t = cycle_tier(recovered);
    // Its parts run to 413, past 7 + 314: no assertion yet.
    loop {
        let recs = t.next_records();
        let Some(MapRecord::Checkpoint { last, .. }) = recs.last().cloned() else {
            panic!("not a checkpoint part: {recs:?}");
        };
        ring.write(&recs);
        t.record_durable().unwrap();
        if last {
            break;
        }
    }
    let blocks = |m: &StripeMap| m.from_block(0).collect::<Vec<_>>();
    let replayed = StripeMap::replay(&ring.records()).unwrap();
    assert_eq!(replayed.log_tail().complete_from, 289);
    assert_eq!(blocks(&replayed), blocks(&map));
}

/// A growth moves the map log: its next records are a whole checkpoint
/// at the new place, numbered above what a torn move left there; a crash
/// after any write of it (the last one torn: every other part durable)
/// leaves the map at the old place until that checkpoint is complete,
/// and at the new one from then on; a move made again after a torn one
/// completes over what that left. Only then does the tier give the old
/// place to trim, and only after the growth's commit the new slots.
#[test]
fn a_moved_log_is_the_map_once_its_checkpoint_is_complete() {
    let old = at_end(CYCLE_BLOCKS, CYCLE_LOG);
    let mut here = Ring(vec![None; CYCLE_LOG as usize]);
    let mut before = StripeMap::default().checkpoint(VOLUME, 1);
    before.extend(cycle_stripes());
    here.write(&before);
    let mut t = placed_tier(StripeMap::recover(&here.records()).unwrap(), old);
    for _ in 0..40 {
        cycle_step(&mut t, &mut here);
    }
    let blocks = |m: &StripeMap| m.from_block(0).collect::<Vec<_>>();
    let want = blocks(t.map());
    // At the new end, past the old log, as `LogPlace::grown` places it.
    let new = LogPlace {
        at: 2 * CYCLE_BLOCKS * 4096,
        records: CYCLE_LOG + 40,
    };
    assert!(new.at >= old.end());
    let recover = |here: &Ring, moved: &Ring| {
        Tier::recover_growing(&here.records(), &moved.records(), MapBounds::ANY).unwrap()
    };
    // A first move, torn after its second write.
    let mut moved = Ring(vec![None; new.records as usize]);
    let mut first = cycle_tier(StripeMap::recover(&here.records()).unwrap());
    first.move_log(new, 0);
    for w in 0..2 {
        let recs = first.next_records();
        assert!(recs
            .iter()
            .all(|r| matches!(r, MapRecord::Checkpoint { .. })));
        let torn: Vec<MapRecord> = match w {
            1 => recs.iter().step_by(2).cloned().collect(),
            _ => recs,
        };
        moved.write(&torn);
        first.record_durable().unwrap();
        assert_eq!(first.log_moved(), None);
    }
    let g = recover(&here, &moved);
    assert!(!g.moved);
    assert_eq!(blocks(&g.map), want);
    let torn_upto = g.torn_move_upto;
    assert!(torn_upto > here.records().iter().map(MapRecord::seq).max().unwrap());
    // The next owner moves it again, above what the torn move left; a
    // crash after each write finds the map where the rule says.
    let mut t = placed_tier(g.map, old);
    t.move_log(new, torn_upto);
    assert_eq!(t.log_place(), new);
    let mut writes = 0;
    while t.log_moved().is_none() {
        let recs = t.next_records();
        assert!(!recs.is_empty(), "the checkpoint stalled");
        assert!(recs[0].seq() > torn_upto, "numbered above the torn move");
        assert!(recs
            .iter()
            .all(|r| matches!(r, MapRecord::Checkpoint { .. })));
        let last = matches!(recs.last(), Some(MapRecord::Checkpoint { last: true, .. }));
        let mut torn = Ring(moved.0.clone());
        torn.write(&recs.iter().step_by(2).cloned().collect::<Vec<_>>());
        let g = recover(&here, &torn);
        assert!(
            !g.moved || recs.len() == 1,
            "a torn last write completes nothing"
        );
        assert_eq!(blocks(&g.map), want);
        moved.write(&recs);
        t.record_durable().unwrap();
        let g = recover(&here, &moved);
        assert_eq!(g.moved, last, "moved once its last part is durable");
        assert_eq!(blocks(&g.map), want);
        writes += 1;
    }
    assert!(writes > 2, "a checkpoint of several writes ({writes})");
    assert_eq!(t.log_moved(), Some(old));
    // Records go on at the new place; the old one is no longer read.
    let none = Ring(vec![None; CYCLE_LOG as usize]);
    for _ in 0..10 {
        cycle_step(&mut t, &mut moved);
    }
    let g = recover(&none, &moved);
    assert!(g.moved);
    assert_eq!(blocks(&g.map), blocks(t.map()));
    // The commit: a volume twice as large, with more slots.
    t.grown(2 * CYCLE_BLOCKS * 4096, 2 * SLOTS);
    assert_eq!(t.log_moved(), None);
    assert_eq!(t.volume_bytes(), 2 * CYCLE_BLOCKS * 4096);
    for _ in 0..10 {
        cycle_step(&mut t, &mut moved);
    }
}
