//! The map against a model through destages, cleaning, trims, checkpoints
//! and crashes that lose the last records written, on a circular log;
//! the formats round-trip and refuse damaged blocks.

use super::*;
use proptest::prelude::*;
use std::collections::BTreeMap;

const VOLUME: u64 = 7;
/// Blocks of the test volume.
const BLOCKS: u64 = 300;
/// Data blocks per stripe in the model (a 2+1 stripe of 31-block units).
const STRIPE_BLOCKS: usize = 2 * BLOCKS_PER_UNIT;

/// A stripe record of the test volume, its stripe seq its record seq.
pub(super) fn stripe_record(seq: u64, slot: u64, blocks: Vec<u64>) -> MapRecord {
    MapRecord::Stripe {
        volume: VOLUME,
        seq,
        stripe_seq: seq,
        slot,
        blocks,
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Destage these blocks (deduplicated) into the lowest free slot.
    Destage(Vec<u64>),
    /// Move the live blocks of the emptiest slot into a new stripe.
    Clean,
    Unmap(u64, u64),
    Checkpoint,
    /// The last `n` records written were never made durable (the writer
    /// has one record in flight at a time; a crash tears it).
    Crash(u64),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        4 => prop::collection::vec(0..BLOCKS, 1..STRIPE_BLOCKS).prop_map(Op::Destage),
        2 => Just(Op::Clean),
        1 => (0..BLOCKS, 1u64..40).prop_map(|(a, n)| Op::Unmap(a, n)),
        1 => Just(Op::Checkpoint),
        1 => (0u64..4).prop_map(Op::Crash),
    ];
    prop::collection::vec(op, 1..60)
}

/// A circular map log of `capacity` records; each place keeps what was
/// written there before, so that a crash can take back a write that never
/// became durable.
struct Log {
    capacity: u64,
    places: BTreeMap<u64, Vec<Vec<u8>>>,
}

impl Log {
    fn write(&mut self, rec: &MapRecord) {
        let at = rec.seq() % self.capacity;
        self.places
            .entry(at)
            .or_default()
            .push(rec.encode().unwrap());
    }

    /// What the log holds now, as a reader finds it.
    fn records(&self) -> Vec<MapRecord> {
        self.places
            .values()
            .filter_map(|h| h.last())
            .filter_map(|b| MapRecord::decode(b).ok())
            .collect()
    }

    /// The writes of the records in `lost` were torn: their places hold
    /// neither the record nor what was there before.
    fn lose(&mut self, lost: std::ops::RangeInclusive<u64>) {
        for h in self.places.values_mut() {
            let torn = h
                .last()
                .is_some_and(|b| MapRecord::decode(b).is_ok_and(|r| lost.contains(&r.seq())));
            if torn {
                h.pop();
                h.push(vec![0xA5; RECORD_BYTES]);
            }
        }
    }
}

/// The owner's side: the map it keeps in memory, the log, every record in
/// order (the model), and where its complete checkpoints start and end.
struct Writer {
    map: StripeMap,
    log: Log,
    history: Vec<MapRecord>,
    checkpoints: Vec<(u64, u64)>,
    /// The last record known durable: what a crash kept stays kept (a
    /// later crash loses only what was written since).
    durable: u64,
}

impl Writer {
    fn new(capacity: u64) -> Writer {
        let mut w = Writer {
            map: StripeMap::default(),
            log: Log {
                capacity,
                places: BTreeMap::new(),
            },
            history: Vec::new(),
            checkpoints: Vec::new(),
            durable: 0,
        };
        w.checkpoint();
        w
    }

    fn append(&mut self, rec: MapRecord) {
        self.log.write(&rec);
        self.map.apply(&rec).unwrap();
        self.history.push(rec);
    }

    fn checkpoint(&mut self) {
        let start = self.map.next_record_seq();
        for p in self.map.checkpoint(VOLUME, start) {
            self.append(p);
        }
        self.checkpoints
            .push((start, self.map.next_record_seq() - 1));
    }

    /// The writer's rule: a checkpoint before the log could wrap over the
    /// newest complete one (room for one record and a checkpoint more).
    fn room(&mut self) {
        let parts = self.map.checkpoint(VOLUME, 0).len() as u64;
        let (start, _) = *self.checkpoints.last().unwrap();
        let used = self.map.next_record_seq() - start;
        if used + 2 * parts + 2 >= self.log.capacity {
            self.checkpoint();
        }
    }

    fn stripe(&mut self, blocks: Vec<u64>) {
        // In the order given (scattered: runs of one, checkpoints of
        // several parts), each block once.
        let mut seen = std::collections::BTreeSet::new();
        let mut blocks: Vec<u64> = blocks.into_iter().filter(|b| seen.insert(*b)).collect();
        blocks.resize(STRIPE_BLOCKS.max(blocks.len()), PAD_BLOCK);
        self.room();
        let rec = MapRecord::Stripe {
            volume: VOLUME,
            seq: self.map.next_record_seq(),
            stripe_seq: self.map.next_stripe_seq(),
            slot: self.map.free_slot(),
            blocks,
        };
        self.append(rec);
    }

    fn clean(&mut self) {
        let Some(&(slot, _)) = self.map.emptiest().next().as_ref() else {
            return;
        };
        let live: Vec<u64> = (0..BLOCKS)
            .filter(|&b| self.map.get(b).is_some_and(|l| l.slot == slot))
            .collect();
        self.stripe(live);
        assert_eq!(self.map.live(slot), 0, "a cleaned slot still holds blocks");
    }

    /// The last `n` records were never durable: the log loses them
    /// (torn), and a new owner starts from what it finds, with a
    /// checkpoint first.
    fn crash(&mut self, n: u64) -> Result<(), TestCaseError> {
        let last = self.map.next_record_seq() - 1;
        // The first checkpoint is written when the leg is made, before the
        // volume serves: durable before anything else.
        let made = self.checkpoints[0].1;
        let kept = last.saturating_sub(n).max(made).max(self.durable);
        self.durable = kept;
        if kept < last {
            self.log.lose(kept + 1..=last);
        }
        self.history.retain(|r| r.seq() <= kept);
        self.checkpoints.retain(|&(_, end)| end <= kept);
        prop_assert!(
            !self.checkpoints.is_empty(),
            "the writer's rule lost every checkpoint"
        );
        let found = self.log.records();
        let Ok(replayed) = StripeMap::replay(&found) else {
            let mut seen: Vec<String> = found
                .iter()
                .map(|r| match r {
                    MapRecord::Checkpoint {
                        seq, part, last, ..
                    } => format!("{seq}c{part}{}", if *last { "." } else { "" }),
                    MapRecord::Stripe { seq, .. } => format!("{seq}s"),
                    MapRecord::Stripes { seq, .. } => format!("{seq}S"),
                    MapRecord::Unmap { seq, .. } => format!("{seq}u"),
                })
                .collect();
            seen.sort();
            panic!(
                "no complete checkpoint: log {seen:?}, kept {kept}, last {last}, checkpoints {:?}",
                self.checkpoints
            );
        };
        prop_assert_eq!(blocks_of(&replayed), blocks_of(&self.model()));
        // Replay stops where the chain of records does (a torn checkpoint
        // of an earlier recovery): never past
        // the last durable record.
        let durable = self.history.last().map_or(0, MapRecord::seq);
        prop_assert!(replayed.next_record_seq() <= durable + 1);
        self.map = StripeMap::recover(&found).unwrap();
        prop_assert!(
            self.map.next_record_seq() > found.iter().map(MapRecord::seq).max().unwrap_or(0)
        );
        self.checkpoint();
        Ok(())
    }

    /// The map every record written so far leaves, applied in order from
    /// nothing.
    fn model(&self) -> StripeMap {
        let mut m = StripeMap::default();
        for r in &self.history {
            m.apply(r).unwrap();
        }
        m
    }
}

fn blocks_of(map: &StripeMap) -> BTreeMap<u64, Loc> {
    (0..BLOCKS)
        .filter_map(|b| map.get(b).map(|l| (b, l)))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn replay_gives_back_the_map_of_the_durable_records(ops in ops(), capacity in 12u64..40) {
        let mut w = Writer::new(capacity);
        for op in ops {
            match op {
                Op::Destage(blocks) => w.stripe(blocks),
                Op::Clean => w.clean(),
                Op::Unmap(first, count) => {
                    w.room();
                    let seq = w.map.next_record_seq();
                    w.append(MapRecord::Unmap { volume: VOLUME, seq, first, count });
                }
                Op::Checkpoint => w.checkpoint(),
                Op::Crash(n) => w.crash(n)?,
            }
            // A stripe never lands in a slot still holding live blocks.
            let used: u64 = (0..=w.map.free_slot()).map(|s| u64::from(w.map.live(s))).sum();
            prop_assert!(used <= BLOCKS);
        }
        let replayed = StripeMap::replay(&w.log.records()).unwrap();
        prop_assert_eq!(blocks_of(&replayed), blocks_of(&w.map));
        prop_assert_eq!(blocks_of(&replayed), blocks_of(&w.model()));
        prop_assert_eq!(replayed.next_stripe_seq(), w.map.next_stripe_seq());
    }

    /// Any damage to an encoded record or summary is refused, never a
    /// panic or a different record.
    #[test]
    fn damaged_blocks_are_refused(at in 0usize..RECORD_BYTES, bit in 0u8..8, n in 0usize..MAX_SUMMARY_BLOCKS) {
        let rec = MapRecord::Stripe {
            volume: VOLUME,
            seq: 9,
            stripe_seq: 4,
            slot: 2,
            blocks: (0..n as u64).collect(),
        };
        let mut b = rec.encode().unwrap();
        prop_assert_eq!(MapRecord::decode(&b), Ok(rec.clone()));
        b[at] ^= 1 << bit;
        if let Ok(other) = MapRecord::decode(&b) {
            // Only the padding past the checksum may change unnoticed.
            prop_assert_eq!(other, rec);
        }
        let s = Summary {
            data_shards: 2,
            parity_shards: 1,
            volume: VOLUME,
            stripe_seq: 4,
            slot: 2,
            blocks: (0..n as u64).collect(),
        };
        let mut b = s.encode().unwrap();
        prop_assert_eq!(Summary::decode(&b), Ok(s.clone()));
        b[at] ^= 1 << bit;
        if let Ok(other) = Summary::decode(&b) {
            prop_assert_eq!(other, s);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(b in prop::collection::vec(any::<u8>(), RECORD_BYTES)) {
        let _ = MapRecord::decode(&b);
        let _ = Summary::decode(&b);
    }
}

#[test]
fn records_of_every_kind_round_trip_and_checkpoints_split_into_parts() {
    let mut m = StripeMap::default();
    // Many scattered blocks: runs of one, more than one part holds.
    let blocks: Vec<u64> = (0..MAX_SUMMARY_BLOCKS as u64).map(|i| i * 2).collect();
    m.apply(&MapRecord::Stripe {
        volume: VOLUME,
        seq: 1,
        stripe_seq: 1,
        slot: 0,
        blocks,
    })
    .unwrap();
    let parts = m.checkpoint(VOLUME, 2);
    assert!(parts.len() > 1, "{} parts", parts.len());
    for p in &parts {
        assert_eq!(MapRecord::decode(&p.encode().unwrap()).as_ref(), Ok(p));
    }
    let back = StripeMap::replay(&parts).unwrap();
    assert_eq!(blocks_of(&back), blocks_of(&m));
    let unmap = MapRecord::Unmap {
        volume: VOLUME,
        seq: 3,
        first: 10,
        count: 5,
    };
    assert_eq!(MapRecord::decode(&unmap.encode().unwrap()), Ok(unmap));
    // A checkpoint missing a part is no checkpoint.
    assert_eq!(StripeMap::replay(&parts[1..]), Err(MapError::NoCheckpoint));
    // Too many blocks for one block: refused, not truncated.
    let big = MapRecord::Stripe {
        volume: VOLUME,
        seq: 1,
        stripe_seq: 1,
        slot: 0,
        blocks: vec![1; MAX_SUMMARY_BLOCKS + 1],
    };
    assert!(matches!(big.encode(), Err(RecordError::TooLarge(_))));
}

#[test]
fn a_stripe_into_a_slot_with_live_blocks_or_an_old_record_is_refused() {
    let mut m = StripeMap::default();
    let stripe = |seq, slot| MapRecord::Stripe {
        volume: VOLUME,
        seq,
        stripe_seq: seq,
        slot,
        blocks: vec![1, 2, PAD_BLOCK],
    };
    m.apply(&stripe(1, 0)).unwrap();
    assert_eq!(m.free_slot(), 1);
    assert_eq!(
        m.apply(&stripe(2, 0)),
        Err(MapError::SlotInUse {
            seq: 2,
            slot: 0,
            live: 2
        })
    );
    assert_eq!(
        m.apply(&stripe(1, 1)),
        Err(MapError::OutOfOrder { last: 1, got: 1 })
    );
    // Moved elsewhere, slot 0 is free again.
    m.apply(&stripe(2, 1)).unwrap();
    assert_eq!((m.live(0), m.live(1), m.free_slot()), (0, 2, 0));
}

#[test]
fn replay_stops_at_a_missing_record_and_recover_numbers_past_what_it_found() {
    let stripe = |seq: u64, slot: u64, block: u64| MapRecord::Stripe {
        volume: VOLUME,
        seq,
        stripe_seq: seq,
        slot,
        blocks: vec![block],
    };
    let mut records = StripeMap::default().checkpoint(VOLUME, 1);
    records.push(stripe(2, 0, 10));
    // Record 3 never became durable; 4 was written past it (never
    // applied by its writer, whose blocks stayed pending).
    records.push(stripe(4, 1, 20));
    let m = StripeMap::replay(&records).unwrap();
    assert_eq!(m.get(10), Some(Loc { slot: 0, index: 0 }));
    assert_eq!(m.get(20), None, "a record past a missing one was applied");
    assert_eq!(m.next_record_seq(), 3);
    let r = StripeMap::recover(&records).unwrap();
    assert_eq!(r.next_record_seq(), 5, "a new owner reuses a seq found");
    assert_eq!(r.get(20), None);
}

#[test]
fn a_record_numbered_zero_is_ignored_and_a_wide_unmap_walks_only_what_is_mapped() {
    let mut bogus = StripeMap::default().checkpoint(VOLUME, 0);
    assert_eq!(StripeMap::replay(&bogus), Err(MapError::NoCheckpoint));
    bogus.extend(StripeMap::default().checkpoint(VOLUME, 1));
    assert!(StripeMap::replay(&bogus).is_ok());
    let mut m = StripeMap::default();
    m.apply(&stripe_record(1, 0, vec![5, 6])).unwrap();
    // The whole address space at once: done in no time.
    m.apply(&MapRecord::Unmap {
        volume: VOLUME,
        seq: 2,
        first: 0,
        count: u64::MAX,
    })
    .unwrap();
    assert!(m.is_empty());
    assert_eq!(m.free_slot(), 0);
}

/// A record naming one block twice (no writer makes one, but a record is
/// read from a disk) leaves the block at its last place and every index
/// in step (checked after each record in debug builds); the slots a
/// stripe's blocks left lose them in one update each.
#[test]
fn a_stripe_naming_a_block_twice_and_blocks_leaving_many_slots_keep_the_indexes() {
    let mut m = StripeMap::default();
    m.apply(&stripe_record(1, 0, vec![1, 2, 3])).unwrap();
    m.apply(&stripe_record(2, 1, vec![4, 5, 6])).unwrap();
    m.apply(&stripe_record(3, 2, vec![2, 7, 2, 5])).unwrap();
    assert_eq!(m.get(2), Some(Loc { slot: 2, index: 2 }));
    assert_eq!((m.live(0), m.live(1), m.live(2)), (2, 2, 3));
    assert_eq!(m.blocks_in(&[2]).len(), 3);
    // Every block of slots 0 and 1 leaves at once: both are free again.
    m.apply(&stripe_record(4, 3, vec![1, 3, 4, 6])).unwrap();
    assert_eq!((m.live(0), m.live(1), m.live(3)), (0, 0, 4));
    assert_eq!(m.free_slot(), 0);
    assert_eq!(m.emptiest().next(), Some((2, 3)));
}

/// A stripes record as a writer packs it: entries while they fit.
fn stripes_record(seq: u64, stripes: Vec<(u64, Vec<u64>)>) -> MapRecord {
    MapRecord::Stripes {
        volume: VOLUME,
        seq,
        stripes: stripes
            .into_iter()
            .enumerate()
            .map(|(i, (slot, blocks))| StripeEntry {
                stripe_seq: seq * 100 + i as u64,
                slot,
                blocks,
            })
            .collect(),
    }
}

proptest! {
    /// Several stripes in one record: runs of consecutive blocks, padding
    /// and scattered blocks all come back as they were, and a record that
    /// does not fit is refused, never cut.
    #[test]
    fn stripes_records_round_trip(
        stripes in prop::collection::vec(
            (0u64..1000, prop::collection::vec(
                prop_oneof![
                    3 => (0u64..1 << 40, 1u64..200).prop_map(|(f, n)| (f..f + n).collect::<Vec<_>>()),
                    1 => (1usize..40).prop_map(|n| vec![PAD_BLOCK; n]),
                    1 => prop::collection::vec(any::<u64>(), 1..20),
                ],
                1..4,
            )),
            1..8,
        )
    ) {
        let stripes: Vec<(u64, Vec<u64>)> = stripes
            .into_iter()
            .map(|(slot, parts)| {
                let mut blocks: Vec<u64> = parts.concat();
                blocks.truncate(MAX_SUMMARY_BLOCKS);
                (slot, blocks)
            })
            .collect();
        let rec = stripes_record(7, stripes);
        let MapRecord::Stripes { stripes: entries, .. } = &rec else { unreachable!() };
        let need: usize = entries.iter().map(|e| StripeEntry::encoded_bytes(&e.blocks)).sum();
        match rec.encode() {
            Ok(b) => {
                prop_assert!(need <= STRIPES_PAYLOAD_BYTES);
                prop_assert_eq!(MapRecord::decode(&b), Ok(rec));
            }
            Err(e) => {
                prop_assert!(need > STRIPES_PAYLOAD_BYTES, "{e}");
                prop_assert!(matches!(e, RecordError::TooLarge(_)));
            }
        }
    }
}

#[test]
fn a_stripes_record_applies_each_stripe_and_a_bad_one_is_refused() {
    let mut m = StripeMap::default();
    let rec = stripes_record(1, vec![(0, (10..72).collect()), (1, (72..134).collect())]);
    let bytes = rec.encode().unwrap();
    m.apply(&MapRecord::decode(&bytes).unwrap()).unwrap();
    assert_eq!(m.get(10), Some(Loc { slot: 0, index: 0 }));
    assert_eq!(m.get(133), Some(Loc { slot: 1, index: 61 }));
    assert_eq!(m.used_slots(), 2);
    // Recovery numbers stripes past the highest a stripes record names.
    let recovered = StripeMap::recover(std::slice::from_ref(&rec));
    assert!(recovered.is_err(), "no checkpoint: refused");
    let mut parts = m.checkpoint(VOLUME, 2);
    parts.push(rec);
    assert_eq!(StripeMap::recover(&parts).unwrap().next_stripe_seq(), 102);

    // Hostile forms: a run past its stripe's block count, a zero-length
    // run, a count no record holds, and the kind in a version 1 record.
    let mut hostile = bytes.clone();
    let at = 8 + 2 + 1 + 1 + 8 + 8 + 4 + 2 + 8 + 8; // the first stripe's count
    hostile[at..at + 4].copy_from_slice(&61u32.to_le_bytes());
    assert!(MapRecord::decode(&reseal(hostile)).is_err());
    let mut zero_run = bytes.clone();
    let run_len = at + 4 + 2 + 8;
    zero_run[run_len..run_len + 2].copy_from_slice(&0u16.to_le_bytes());
    assert!(MapRecord::decode(&reseal(zero_run)).is_err());
    let mut count = bytes.clone();
    let count_at = 8 + 2 + 1 + 1 + 8 + 8 + 4;
    count[count_at..count_at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
    assert!(MapRecord::decode(&reseal(count)).is_err());
    let mut v1 = bytes;
    v1[8..10].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(
        MapRecord::decode(&reseal(v1)),
        Err(RecordError::Malformed("record kind"))
    );
}

/// A record written by a version 1 binary still reads.
#[test]
fn version_1_records_still_read() {
    let rec = stripe_record(3, 2, vec![5, 6, PAD_BLOCK]);
    let mut b = rec.encode().unwrap();
    assert_eq!(u16::from_le_bytes([b[8], b[9]]), 3);
    b[8..10].copy_from_slice(&1u16.to_le_bytes());
    assert_eq!(MapRecord::decode(&reseal(b)), Ok(rec));
    let mut future = stripe_record(3, 2, vec![5]).encode().unwrap();
    future[8..10].copy_from_slice(&4u16.to_le_bytes());
    assert!(matches!(
        MapRecord::decode(&reseal(future)),
        Err(RecordError::Version { version: 4, .. })
    ));
}

/// The block with its CRC-32C made good again for what it now holds (a
/// record's payload ends where its length says; the CRC follows it).
fn reseal(mut b: Vec<u8>) -> Vec<u8> {
    let header = 8 + 2 + 1 + 1 + 8 + 8;
    let len = u32::from_le_bytes([b[header], b[header + 1], b[header + 2], b[header + 3]]) as usize;
    let end = header + 4 + len;
    let crc = crc32c::crc32c(&b[..end]);
    b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
    b
}

/// A map of `stripes` stripes of scattered blocks (each stripe the blocks
/// `b` with `b % stripes == s`, a few left out): runs of one and of
/// several.
pub(super) fn scattered_map(stripes: u64, holes: u64) -> StripeMap {
    let mut m = StripeMap::default();
    for s in 0..stripes {
        let blocks: Vec<u64> = (0..BLOCKS)
            .filter(|b| b % stripes == s && (holes == 0 || b % holes != 1))
            .take(STRIPE_BLOCKS)
            .collect();
        m.apply(&stripe_record(s + 1, s, blocks)).unwrap();
    }
    m
}

/// The parts of a checkpoint walked one by one, `runs_per_part` runs each.
fn walked(m: &StripeMap, first_seq: u64, runs_per_part: usize) -> Vec<MapRecord> {
    m.checkpoint_in_parts_of(VOLUME, first_seq, runs_per_part)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A checkpoint walked part by part holds every mapped block once, in
    /// whole runs: every part but the last is full and unmarked, no run
    /// continues the one before it (across parts too), and only the whole
    /// chain of parts, the last one marked, is a checkpoint.
    #[test]
    fn a_checkpoint_walked_part_by_part_is_the_map_in_whole_runs(
        stripes in 1u64..5,
        holes in 0u64..7,
        runs_per_part in 1usize..6,
        drop_pick in any::<usize>(),
    ) {
        let m = scattered_map(stripes, holes);
        let parts = walked(&m, 100, runs_per_part);
        let mut all: Vec<Run> = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let MapRecord::Checkpoint { part, last, runs, seq, .. } = p else {
                panic!("not a checkpoint part: {p:?}");
            };
            prop_assert_eq!((*part as usize, *seq), (i, 100 + i as u64));
            prop_assert_eq!(*last, i + 1 == parts.len());
            if !*last {
                prop_assert_eq!(runs.len(), runs_per_part);
            }
            let back = MapRecord::decode(&p.encode().unwrap());
            prop_assert_eq!(back.as_ref(), Ok(p));
            all.extend(runs.iter().copied());
        }
        for w in all.windows(2) {
            let next = Loc { slot: w[1].slot, index: w[1].index };
            prop_assert!(!format::run_goes_on(&w[0], w[1].block, &next), "{:?} split", w);
        }
        let back = StripeMap::replay(&parts).unwrap();
        prop_assert_eq!(blocks_of(&back), blocks_of(&m));
        // Any part missing, the last one included: no checkpoint.
        if parts.len() > 1 {
            let mut short = parts.clone();
            short.remove(drop_pick % parts.len());
            prop_assert_eq!(StripeMap::replay(&short).err(), Some(MapError::NoCheckpoint));
        }
    }
}

/// A version 2 checkpoint part: each part says how many there are.
fn v2_checkpoint_part(seq: u64, part: u32, parts: u32, runs: &[Run]) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&part.to_le_bytes());
    p.extend_from_slice(&parts.to_le_bytes());
    p.extend_from_slice(&9u64.to_le_bytes());
    p.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for r in runs {
        p.extend_from_slice(&r.block.to_le_bytes());
        p.extend_from_slice(&r.len.to_le_bytes());
        p.extend_from_slice(&r.slot.to_le_bytes());
        p.extend_from_slice(&r.index.to_le_bytes());
    }
    let mut b = Vec::new();
    b.extend_from_slice(b"SHOALMAP");
    b.extend_from_slice(&2u16.to_le_bytes());
    b.push(3);
    b.push(0);
    b.extend_from_slice(&VOLUME.to_le_bytes());
    b.extend_from_slice(&seq.to_le_bytes());
    b.extend_from_slice(&(p.len() as u32).to_le_bytes());
    b.extend_from_slice(&p);
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b.resize(RECORD_BYTES, 0);
    b
}

#[test]
fn a_version_2_checkpoint_still_reads_and_a_streamed_mark_is_checked() {
    let run = |block, slot| Run {
        block,
        len: 3,
        slot,
        index: 0,
    };
    let old = [
        v2_checkpoint_part(5, 0, 2, &[run(0, 0)]),
        v2_checkpoint_part(6, 1, 2, &[run(10, 1)]),
    ];
    let recs: Vec<MapRecord> = old.iter().map(|b| MapRecord::decode(b).unwrap()).collect();
    assert!(matches!(recs[0], MapRecord::Checkpoint { last: false, .. }));
    assert!(matches!(recs[1], MapRecord::Checkpoint { last: true, .. }));
    let m = StripeMap::replay(&recs).unwrap();
    assert_eq!(m.get(11), Some(Loc { slot: 1, index: 1 }));
    assert_eq!(m.next_record_seq(), 7);
    // A version 2 part numbered past its count, and a version 3 part
    // whose mark is neither 0 nor 1, are refused.
    let bad = v2_checkpoint_part(5, 2, 2, &[]);
    assert!(matches!(
        MapRecord::decode(&bad),
        Err(RecordError::Malformed(_))
    ));
    let streamed = MapRecord::Checkpoint {
        volume: VOLUME,
        seq: 6,
        part: 1,
        last: true,
        last_stripe_seq: 9,
        after: Some(3),
        runs: vec![run(10, 1)],
    };
    assert_eq!(
        MapRecord::decode(&streamed.encode().unwrap()),
        Ok(streamed.clone())
    );
    let streamed = streamed.encode().unwrap();
    let mut marked = streamed.clone();
    marked[8 + 2 + 1 + 1 + 8 + 8 + 4 + 4] = 2;
    assert!(matches!(
        MapRecord::decode(&reseal(marked)),
        Err(RecordError::Malformed(_))
    ));
    // The streamed kind in a version 2 record is no kind that version has.
    let mut early = streamed;
    early[8..10].copy_from_slice(&2u16.to_le_bytes());
    assert_eq!(
        MapRecord::decode(&reseal(early)),
        Err(RecordError::Malformed("record kind"))
    );
}

/// Parts of one checkpoint split two ways (as two binaries might) do not
/// make a complete checkpoint when mixed: each part says where the one
/// before it ended.
#[test]
fn parts_split_two_ways_do_not_mix_into_a_checkpoint() {
    let m = scattered_map(4, 0);
    let by_two = walked(&m, 10, 2);
    let by_three = walked(&m, 10, 3);
    assert!(StripeMap::replay(&by_two).is_ok() && StripeMap::replay(&by_three).is_ok());
    for p in 1..by_three.len().min(by_two.len()) - 1 {
        let mut mixed = by_two.clone();
        mixed[p] = by_three[p].clone();
        assert_eq!(
            StripeMap::replay(&mixed).err(),
            Some(MapError::NoCheckpoint),
            "part {p}"
        );
    }
}

proptest! {
    /// A run of free slots is the first the plain walk over every slot
    /// finds, from the lowest free one not avoided, within the window;
    /// and the free-slot mark drops past every free slot at once when the
    /// highest used slots empty.
    #[test]
    fn a_run_of_free_slots_is_the_first_a_walk_of_every_slot_finds(
        used in prop::collection::btree_set(0u64..40, 0..30),
        emptied in prop::collection::btree_set(0u64..40, 0..30),
        avoid in prop::collection::btree_set(0u64..50, 0..6),
        run in 1u64..5,
        window in 1u64..60,
    ) {
        let mut m = StripeMap::default();
        let mut seq = 0;
        for &slot in &used {
            seq += 1;
            m.apply(&stripe_record(seq, slot, vec![slot])).unwrap();
        }
        for &slot in emptied.intersection(&used) {
            seq += 1;
            m.apply(&MapRecord::Unmap { volume: VOLUME, seq, first: slot, count: 1 }).unwrap();
        }
        m.check();
        let free = |s: u64| m.live(s) == 0 && !avoid.contains(&s);
        let lowest = (0..).find(|&s| free(s)).unwrap();
        prop_assert_eq!(m.free_slot_avoiding(&avoid), lowest);
        let end = lowest + window;
        let expected = (lowest..end)
            .find(|&s| s + run <= end && (s..s + run).all(free));
        prop_assert_eq!(m.free_run_avoiding(&avoid, run, window), expected);
    }
}
