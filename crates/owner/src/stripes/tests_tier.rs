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
/// A small log: checkpoints are written often and the log wraps.
const LOG_RECORDS: u64 = 12;
/// Few stripe slots: 160 blocks fill three stripes of 62, and overwrites
/// soon leave the cleaner to make room.
const SLOTS: u64 = 10;

type Data = u8;

#[derive(Debug, Clone)]
enum Step {
    /// Write block `b` with data byte `v` (0: a block of zeros).
    Write(u64, Data),
    Zero(u64, u64),
    BeginDestage,
    WriteStripe,
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
    /// The empty checkpoint is asked for.
    Forget,
    /// The map log is trimmed, once the map is forgotten.
    TrimLog,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        8 => (0..BLOCKS, 0u8..4).prop_map(|(b, v)| Step::Write(b, v)),
        1 => (0..BLOCKS, 1u64..40).prop_map(|(b, n)| Step::Zero(b, n.min(BLOCKS - b))),
        3 => Just(Step::BeginDestage),
        3 => Just(Step::WriteStripe),
        4 => Just(Step::Record),
        3 => Just(Step::Trim),
        1 => (any::<bool>(), 0usize..4, prop::option::of(0..BLOCKS / 16))
            .prop_map(|(torn, sent, fill)| Step::Crash { torn, sent, fill }),
        1 => Just(Step::Lower),
        2 => (1usize..40).prop_map(Step::RehydrateRead),
        2 => Just(Step::RehydrateWrite),
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
    /// The data read for the stripe being destaged.
    staged: Option<Vec<Data>>,
    /// Stripes the cleaner began.
    cleans: u64,
    /// The record being written.
    record: Option<MapRecord>,
    /// Trims sent and not yet done, in order. A later write to the same
    /// blocks is done after them (the leg's copies keep the order
    /// requests are sent in): [`Sim::ordered_after_trims`].
    /// Each with the zeroings acknowledged once it is done.
    trims: Vec<(u64, u64, Vec<Ticket>)>,
    /// Zeroings waiting for their tickets: the blocks each zeroes, with
    /// the count of data writes of the block when it did.
    waiting: BTreeMap<Ticket, Vec<(u64, u64)>>,
    /// Data writes per block so far.
    writes: BTreeMap<u64, u64>,
    /// What the clients last wrote (acknowledged or not).
    model: BTreeMap<u64, Data>,
    /// What was last acknowledged of each block.
    acked: BTreeMap<u64, Data>,
    /// Blocks whose last zeroing is not acknowledged yet, and its ticket.
    unacked: BTreeMap<u64, Ticket>,
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

impl Sim {
    fn new() -> Sim {
        Sim {
            tier: Tier::new(
                VOLUME,
                BLOCKS * 4096,
                columns(),
                StripeMap::default(),
                [],
                (LOG_RECORDS, SLOTS),
            ),
            perf: BTreeMap::new(),
            stripes: BTreeMap::new(),
            log: vec![None; LOG_RECORDS as usize],
            staged: None,
            cleans: 0,
            record: None,
            trims: Vec::new(),
            waiting: BTreeMap::new(),
            writes: BTreeMap::new(),
            model: BTreeMap::new(),
            acked: BTreeMap::new(),
            unacked: BTreeMap::new(),
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
        for (b, loc) in self.tier.to_rehydrate(n, &skip) {
            let data = self.stripes[&loc.slot][&loc.index];
            self.rehydrating.push((b, loc, data));
        }
    }

    /// As the owner does: a block still mapped where it was read from is
    /// staged with that data (a block of zeros is zeroed).
    fn rehydrate_write(&mut self) {
        for (b, loc, data) in std::mem::take(&mut self.rehydrating) {
            if self.tier.source(b) != Source::Stripe(loc) {
                continue;
            }
            if data == 0 {
                self.zero(b, 1);
                continue;
            }
            self.ordered_after_trims(b);
            let seq = self.tier.stage(b, 1);
            self.perf.insert(b, data);
            self.tier.staged(b, 1, seq);
        }
    }

    fn forget(&mut self) {
        let asked = self.tier.forget_map();
        assert!(!asked || self.lowering);
    }

    /// The owner trims the map log once the map is forgotten: what a new
    /// owner then finds is an empty log.
    fn trim_log(&mut self) {
        if self.tier.map_forgotten() {
            assert!(self.record.is_none());
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

    /// A write of data is acknowledged once on the performance leg.
    fn write(&mut self, b: u64, v: Data) {
        if v == 0 {
            self.zero(b, 1);
            return;
        }
        self.ordered_after_trims(b);
        let seq = self.tier.stage(b, 1);
        self.perf.insert(b, v);
        self.tier.staged(b, 1, seq);
        self.model.insert(b, v);
        self.acked.insert(b, v);
        self.unacked.remove(&b);
        *self.writes.entry(b).or_default() += 1;
    }

    /// A zeroing is acknowledged once trimmed, or once its ticket is.
    fn zero(&mut self, first: u64, count: u64) {
        for b in first..first + count {
            self.ordered_after_trims(b);
            self.model.insert(b, 0);
        }
        let z = self.tier.zero(first, count);
        for (f, n) in z.trim_now {
            for b in f..f + n {
                self.perf.remove(&b);
            }
        }
        match z.ticket {
            Some(t) => {
                for b in first..first + count {
                    self.unacked.insert(b, t);
                }
                let blocks = (first..first + count).map(|b| (b, self.writes_of(b)));
                self.waiting.insert(t, blocks.collect());
            }
            None => {
                for b in first..first + count {
                    self.acked.insert(b, 0);
                    self.unacked.remove(&b);
                }
            }
        }
    }

    /// Ticket `t`'s unmap and trims are done: it is acknowledged once
    /// every earlier one is.
    fn acknowledge(&mut self, t: Ticket) {
        self.ready.insert(t);
        while self.ready.remove(&(self.acked_upto + 1)) {
            self.acked_upto += 1;
            self.acknowledge_now(self.acked_upto);
        }
    }

    fn writes_of(&self, b: u64) -> u64 {
        self.writes.get(&b).copied().unwrap_or(0)
    }

    fn acknowledge_now(&mut self, t: Ticket) {
        for (b, writes) in self.waiting.remove(&t).unwrap_or_default() {
            // Unless data was written since: that is what is acknowledged.
            if self.writes_of(b) == writes {
                self.acked.insert(b, 0);
            }
            if self.unacked.get(&b) == Some(&t) {
                self.unacked.remove(&b);
            }
        }
    }

    fn begin_destage(&mut self) {
        if let Some(d) = self.tier.begin_stripe(&BTreeSet::new()).cloned() {
            if !d.from.is_empty() {
                self.cleans += 1;
                let data = d.from.iter().map(|l| self.stripes[&l.slot][&l.index]);
                self.staged = Some(data.collect());
                return;
            }
            for &(b, _) in &d.blocks {
                self.ordered_after_trims(b);
            }
            let data = d
                .blocks
                .iter()
                .map(|(b, _)| self.perf.get(b).copied().unwrap_or(0));
            self.staged = Some(data.collect());
        }
    }

    fn write_stripe(&mut self) {
        let (Some(d), Some(data)) = (self.tier.destaging().cloned(), self.staged.take()) else {
            return;
        };
        let units = (0..).zip(data).collect();
        self.stripes.insert(d.slot, units);
        self.tier.stripe_written();
    }

    fn record(&mut self) {
        if self.record.is_none() {
            self.record = self.tier.next_record();
            return;
        }
        self.make_durable();
    }

    fn make_durable(&mut self) {
        let Some(rec) = self.record.take() else {
            return;
        };
        let at = (rec.seq() % LOG_RECORDS) as usize;
        self.log[at] = Some(rec);
        let applied = self.tier.record_durable().unwrap();
        let mut trims: Vec<(u64, u64, Vec<Ticket>)> = applied
            .trims
            .iter()
            .map(|&(f, n)| (f, n, Vec::new()))
            .collect();
        match trims.last_mut() {
            Some(last) => last.2 = applied.acknowledged,
            None => {
                for t in applied.acknowledged {
                    self.acknowledge(t);
                }
            }
        }
        self.trims.extend(trims);
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

    fn crash(&mut self, torn: bool, sent: usize, fill: Option<u64>) {
        if !torn {
            self.make_durable();
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
        let map = Tier::recover_map(&records).unwrap();
        let pending = classify(&map, self.perf.keys().copied(), |b| self.perf[&b] == 0);
        self.tier = Tier::new(
            VOLUME,
            BLOCKS * 4096,
            columns(),
            map,
            pending,
            (LOG_RECORDS, SLOTS),
        );
        if self.lowering {
            self.tier.lower();
        }
        self.rehydrating.clear();
        self.staged = None;
        self.record = None;
        self.trims.clear();
        self.waiting.clear();
        self.ready.clear();
        self.acked_upto = 0;
        // A zeroing never acknowledged may have happened or not: the
        // blocks read either way, and from now on as they read.
        for b in std::mem::take(&mut self.unacked).into_keys() {
            let now = self.read(b);
            let before = self.acked.get(&b).copied().unwrap_or(0);
            assert!(
                now == 0 || now == before,
                "block {b}: {now}, neither 0 nor {before}"
            );
            self.model.insert(b, now);
            self.acked.insert(b, now);
        }
    }

    fn check(&self) -> Result<(), TestCaseError> {
        // The capacity reports' count: every block a read does not answer
        // with zeros without I/O.
        let holding = (0..BLOCKS)
            .filter(|&b| self.tier.source(b) != Source::Zeros)
            .count() as u64;
        prop_assert_eq!(self.tier.written_blocks(), holding);
        for b in 0..BLOCKS {
            let want = self.model.get(&b).copied().unwrap_or(0);
            prop_assert_eq!(
                self.read(b),
                want,
                "block {} ({:?})",
                b,
                self.tier.source(b)
            );
        }
        Ok(())
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
                Step::BeginDestage => sim.begin_destage(),
                Step::WriteStripe => sim.write_stripe(),
                Step::Record => sim.record(),
                Step::Trim => sim.trim(),
                Step::Crash { torn, sent, fill } => sim.crash(torn, sent, fill),
                Step::Lower => sim.lower(),
                Step::RehydrateRead(n) => sim.rehydrate_read(n),
                Step::RehydrateWrite => sim.rehydrate_write(),
                Step::Forget => sim.forget(),
                Step::TrimLog => sim.trim_log(),
            }
            sim.check()?;
        }
        if sim.lowering {
            // Carried through: every block on the performance leg alone.
            for _ in 0..(BLOCKS as usize * 8) {
                sim.write_stripe();
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
            sim.check()?;
            prop_assert!(sim.tier.map().is_empty());
            for b in 0..BLOCKS {
                let want = sim.model.get(&b).copied().unwrap_or(0);
                prop_assert_eq!(sim.perf.get(&b).copied().unwrap_or(0), want, "block {}", b);
            }
            // What a new owner (or the RAID-1 owner) finds: no map at all.
            sim.crash(true, 0, None);
            sim.check()?;
            return Ok(());
        }
        // Drained, every block written is in the capacity leg.
        for _ in 0..(BLOCKS as usize * 8) {
            sim.begin_destage();
            sim.write_stripe();
            sim.record();
            sim.record();
            sim.trim();
        }
        sim.check()?;
        prop_assert_eq!(sim.tier.pending_blocks(), 0);
        let in_stripes = (0..BLOCKS).filter(|&b| matches!(sim.tier.source(b), Source::Stripe(_)));
        let nonzero = sim.model.values().filter(|&&v| v != 0).count();
        prop_assert!(in_stripes.count() >= nonzero);
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
            sim.begin_destage();
            sim.write_stripe();
            sim.record();
            sim.record();
            sim.trim();
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
        Tier::recover_map(&[rec]).unwrap_err(),
        TierError::NoCheckpoint
    );
    assert!(Tier::recover_map(&[]).unwrap().is_empty());
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
