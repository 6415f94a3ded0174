//! Tests of the log store: the store's API contract on files, a model
//! test, crash-consistency over a fault-injecting device, corruption and
//! I/O errors, space and the cleaner.

use super::*;
use crate::GroupCommit;
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use tempfile::TempDir;

const M: u64 = 1 << 20;
const B: u64 = BLOCK_U64;

fn dev_path(dir: &TempDir) -> PathBuf {
    dir.path().join("dev.img")
}

/// A store that prepares its sparse file: it needs O_DIRECT, which every
/// file system the tests run on here has; a test that cannot check what
/// it is about fails instead of passing unchecked.
fn preparing_store(dir: &TempDir) -> Arc<LogStore> {
    let s = Arc::new(new_store(dir));
    assert!(
        s.direct_io(),
        "no O_DIRECT on {}: the store prepares only O_DIRECT devices, and this \
         test would check nothing",
        dir.path().display()
    );
    s
}

fn new_store(dir: &TempDir) -> LogStore {
    LogStore::create(&dev_path(dir), MIN_CAPACITY, "test").unwrap()
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8 | 1
        })
        .collect()
}

/// Cheap distinct test data: a window of a fixed random pool picked by
/// `seed`, stamped with the seed every 256 bytes.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    static POOL: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let pool = POOL.get_or_init(|| pattern(12345, 1 << 20));
    assert!(len <= 512 * 1024);
    let at = (seed % (512 * 1024)) as usize;
    let mut v = pool[at..at + len].to_vec();
    for c in v.chunks_mut(256) {
        let n = c.len().min(8);
        c[..n].copy_from_slice(&seed.to_le_bytes()[..n]);
    }
    v
}

static ZERO: [u8; BLOCK] = [0u8; BLOCK];

fn read_vec(s: &LogStore, id: u64, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0xAAu8; len];
    s.read(id, off, &mut b).unwrap();
    b
}

/// A read the way the node's ring does it: [`LogStore::plan_read`], the
/// device reads, [`LogStore::finish_read`]. Also says whether the answer
/// is the plan's device buffer (no block came from anywhere else).
fn read_owned(s: &LogStore, id: u64, off: u64, len: usize) -> Result<(bytes::Bytes, bool)> {
    let (mut plan, answer) = s.plan_read(id, off, len);
    let read = {
        let mut parts = plan.parts();
        if parts.is_empty() {
            Ok(())
        } else {
            s.dev.read_many(&mut parts)
        }
    };
    let device_only = answer.buf.is_none() && plan.device_reads() > 0;
    s.finish_read(plan, read, answer).map(|b| (b, device_only))
}

/// A small in-memory device: `nsegs` segments of `seg` blocks.
fn small_cfg(seg: u32) -> LogConfig {
    LogConfig {
        seg_blocks: seg,
        max_components: 8,
        fill_permille: 900,
        min_capacity: 0,
    }
}

fn mem_device(seg: u32, nsegs: u64) -> Arc<FaultyDevice> {
    Arc::new(FaultyDevice::new((nsegs * seg as u64 + 64) * B))
}

fn mem_store(seg: u32, nsegs: u64) -> (Arc<FaultyDevice>, LogStore) {
    let d = mem_device(seg, nsegs);
    let s = LogStore::format_device(d.clone(), "test", &small_cfg(seg)).unwrap();
    (d, s)
}

fn reopen(d: &Arc<FaultyDevice>) -> LogStore {
    LogStore::open_device(d.clone()).unwrap()
}

// ---------------------------------------------------------------------
// The store's contract, on files
// ---------------------------------------------------------------------

#[test]
fn create_is_sparse_and_reopens() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
    assert_eq!(s.cluster_id(), "test");
    let (sb, _) = s.geometry();
    assert_eq!(sb.seg_blocks, 64); // 256 KiB segments on a 64 MiB device
    assert!(s.capacity() > 50 * M, "{}", s.capacity());
    assert_eq!(s.used(), 0);
    let uuid = s.uuid();
    s.create_component(7, 70, 10 * M).unwrap();
    s.write(7, 5 * M - 3, b"hello world").unwrap();
    s.sync().unwrap();
    drop(s);
    let md = std::fs::metadata(dev_path(&dir)).unwrap();
    assert_eq!(md.len(), MIN_CAPACITY);
    use std::os::unix::fs::MetadataExt;
    assert!(
        md.blocks() * 512 < 8 * M,
        "{} bytes allocated",
        md.blocks() * 512
    );

    let s = LogStore::open(&dev_path(&dir)).unwrap();
    assert_eq!(s.uuid(), uuid);
    assert_eq!(
        s.components(),
        vec![ComponentMeta {
            id: 7,
            volume: 70,
            size: 10 * M,
            generation: 0,
            allocated: 2 * B
        }]
    );
    assert_eq!(read_vec(&s, 7, 5 * M - 3, 11), b"hello world");
    assert_eq!(s.allocated_ranges(7), vec![(5 * M - B, 2 * B)]);
    assert_eq!(s.used(), 2 * B);
    assert_eq!(read_vec(&s, 7, 0, 4096), vec![0u8; 4096]);
    s.check().unwrap();
}

/// A file written in full (thick) stays fully allocated: formatting and
/// freeing segments never punch holes in it.
#[test]
fn thick_files_stay_thick() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new().unwrap();
    let p = dev_path(&dir);
    std::fs::write(&p, vec![0u8; MIN_CAPACITY as usize]).unwrap();
    let allocated = || std::fs::metadata(&p).unwrap().blocks() * 512;
    assert!(allocated() >= MIN_CAPACITY);
    let s = LogStore::create(&p, MIN_CAPACITY, "test").unwrap();
    s.create_component(1, 1, 40 * M).unwrap();
    for round in 0..3u64 {
        for i in 0..32 {
            s.write(1, i * M, &pattern(round * 100 + i, M as usize))
                .unwrap();
        }
        s.sync().unwrap();
        s.checkpoint().unwrap();
    }
    s.trim(1, 0, 40 * M).unwrap();
    s.checkpoint().unwrap();
    assert!(s.stats().checkpoints > 0);
    drop(s);
    assert!(
        allocated() >= MIN_CAPACITY,
        "{} bytes allocated",
        allocated()
    );
    // A sparse file is still given back its freed space.
    let q = dir.path().join("sparse.img");
    let s = LogStore::create(&q, MIN_CAPACITY, "test").unwrap();
    s.create_component(1, 1, 40 * M).unwrap();
    for i in 0..32 {
        s.write(1, i * M, &pattern(i, M as usize)).unwrap();
    }
    s.sync().unwrap();
    s.trim(1, 0, 40 * M).unwrap();
    s.checkpoint().unwrap();
    drop(s);
    assert!(std::fs::metadata(&q).unwrap().blocks() * 512 < 16 * M);
}

/// Waits (up to 30 s) until `done`, polling.
fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !done() {
        assert!(t0.elapsed().as_secs() < 30, "timed out waiting for {what}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A sparse file is prepared a few segments ahead of the log; reopened,
/// the store finds from the file's holes where preparation stopped (the
/// prepared watermark). A thick file needs none.
#[test]
fn prepared_watermark_survives_reopening() {
    let dir = TempDir::new().unwrap();
    let p = dev_path(&dir);
    let s = preparing_store(&dir);
    let nsegs = s.geometry().0.nsegs;
    s.create_component(1, 1, 4 * M).unwrap();
    s.write(1, 0, &noise(1, 8 * BLOCK)).unwrap();
    s.sync().unwrap();
    // Eight segments ahead, none when idle.
    s.set_preparation_pace(8, 0);
    s.start_background().unwrap();
    {
        let st = s.lock_state();
        assert_eq!((st.batch.seg, st.next_seg), (0, 1));
        if st.segs.unprepared_count() == 0 {
            eprintln!("this file system reports no holes");
            return;
        }
    }
    wait_for("8 prepared segments", || s.stats().prepared_segments == 8);
    // Nothing more is prepared: the store is idle and idle preparation off.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(s.stats().prepared_segments, 8);
    assert_eq!(s.unprepared_segments(), nsegs as usize - 10);
    s.stop_background();
    drop(s);

    let s = LogStore::open(&p).unwrap();
    assert_eq!(read_vec(&s, 1, 0, 8 * BLOCK), noise(1, 8 * BLOCK));
    s.start_preparation();
    {
        let st = s.lock_state();
        assert_eq!((st.batch.seg, st.next_seg), (0, 1));
        // Segments 2..10 were zeroed: allocated, nothing to do there.
        assert_eq!(st.segs.first_unprepared(), Some(10));
        assert_eq!(st.segs.unprepared_count(), nsegs as usize - 10);
        assert!((2..10).all(|s| !st.segs.is_unprepared(s)));
    }
    drop(s);

    // A thick file has nothing to prepare.
    let q = dir.path().join("thick.img");
    std::fs::write(&q, vec![0u8; MIN_CAPACITY as usize]).unwrap();
    let s = LogStore::create(&q, MIN_CAPACITY, "test").unwrap();
    s.start_preparation();
    assert_eq!(s.unprepared_segments(), 0);
}

/// Left idle, a new sparse device file is written with zeros all over
/// its free segments: the file becomes allocated but for the log's own
/// head and next segments and the checkpoint slots' unwritten ends, and
/// the data stays.
#[test]
fn sparse_file_becomes_allocated_when_idle() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new().unwrap();
    let p = dev_path(&dir);
    let s = preparing_store(&dir);
    let (nsegs, seg_bytes) = {
        let (sb, _) = s.geometry();
        (sb.nsegs as u64, sb.seg_blocks as u64 * B)
    };
    s.create_component(1, 1, 4 * M).unwrap();
    s.write(1, 0, &noise(2, 8 * BLOCK)).unwrap();
    s.sync().unwrap();
    let allocated = || std::fs::metadata(&p).unwrap().blocks() * 512;
    let before = allocated();
    assert!(before < 8 * M, "{before} bytes allocated");
    // Two segments ahead, the rest when idle at 1 GiB/s.
    s.set_preparation_pace(2, 1024);
    s.start_background().unwrap();
    if s.unprepared_segments() == 0 {
        eprintln!("this file system reports no holes");
        return;
    }
    wait_for("the whole device prepared", || s.unprepared_segments() == 0);
    let st = s.stats();
    assert_eq!(st.prepared_segments, nsegs - 2, "{st:?}");
    let after = allocated();
    eprintln!(
        "sparse file: {} KiB allocated before, {} KiB after ({} KiB long)",
        before >> 10,
        after >> 10,
        MIN_CAPACITY >> 10
    );
    assert!(after >= (nsegs - 2) * seg_bytes, "{after} bytes allocated");
    assert_eq!(read_vec(&s, 1, 0, 8 * BLOCK), noise(2, 8 * BLOCK));
    // Segments freed from now on stay allocated (no holes punched).
    s.trim(1, 0, 4 * M).unwrap();
    s.checkpoint().unwrap();
    assert!(allocated() >= after);
    s.stop_background();
    drop(s);
    let s = LogStore::open(&p).unwrap();
    s.check().unwrap();
}

/// An I/O error while writing zeros stops preparation and nothing else:
/// the store goes on writing.
#[test]
fn preparation_stops_at_an_io_error_and_writes_go_on() {
    let (d, s) = mem_store(64, 32);
    s.prepare_all_for_tests(4, 0);
    s.create_component(1, 1, 64 * B).unwrap();
    let mut p = prepare::Preparer::new();
    // The four segments after the head and next, then nothing (idle
    // preparation is off).
    for _ in 0..4 {
        assert_eq!(s.prepare_step(&mut p), prepare::PrepStep::Again);
    }
    assert_eq!(s.prepare_step(&mut p), prepare::PrepStep::Later(None));
    assert_eq!(s.stats().prepared_segments, 4);
    {
        let st = s.lock_state();
        assert_eq!(st.segs.first_unprepared(), Some(6));
        assert!((2..6).all(|x| !st.segs.is_unprepared(x)));
    }
    // The log takes segment 2 (prepared): segment 6 enters the window.
    for b in 0..64 {
        s.write(1, b * B, &noise(b, BLOCK)).unwrap();
    }
    s.sync().unwrap();
    assert_eq!(s.lock_state().next_seg, 2);
    d.fail_next_write();
    assert_eq!(s.prepare_step(&mut p), prepare::PrepStep::Later(None));
    assert!(!s.prep.on());
    assert_eq!(s.unprepared_segments(), 0);
    assert!(s.lock_state().segs.zeroing().is_none());
    for b in 0..64 {
        s.write(1, b * B, &noise(100 + b, BLOCK)).unwrap();
    }
    s.sync().unwrap();
    s.check().unwrap();
    drop(s);
    let s = reopen(&d);
    for b in 0..64 {
        assert_eq!(read_vec(&s, 1, b * B, BLOCK), noise(100 + b, BLOCK));
    }
}

#[test]
fn refuses_small_foreign_and_unformatted_devices() {
    let dir = TempDir::new().unwrap();
    let e = LogStore::create(&dev_path(&dir), 10 << 20, "test").unwrap_err();
    assert!(matches!(e, StoreError::TooSmall { .. }));
    assert!(
        e.to_string()
            .contains("is too small: 10 MiB given, Shoal needs at least 64 MiB"),
        "{e}"
    );

    drop(new_store(&dir));
    let e = LogStore::create(&dev_path(&dir), MIN_CAPACITY, "other").unwrap_err();
    assert!(
        matches!(e, StoreError::ForeignCluster { ref found, .. } if found == "test"),
        "{e}"
    );
    let e = LogStore::open_or_create(&dev_path(&dir), MIN_CAPACITY, "other").unwrap_err();
    assert!(matches!(e, StoreError::ForeignCluster { .. }));
    // Same cluster: create opens the existing device without wiping it;
    // unsynced writes survive a clean close.
    let s = LogStore::open_or_create(&dev_path(&dir), MIN_CAPACITY, "test").unwrap();
    s.create_component(1, 1, M).unwrap();
    s.write(1, 0, b"keep").unwrap();
    drop(s);
    let s = LogStore::create(&dev_path(&dir), MIN_CAPACITY, "test").unwrap();
    assert_eq!(read_vec(&s, 1, 0, 4), b"keep");
    assert!(matches!(
        LogStore::open(&dev_path(&dir)),
        Err(StoreError::Io(_))
    ));
    drop(s);
    // A device of format version 1 (the retired chunk store) is refused,
    // never misread or reformatted.
    let v1 = dir.path().join("v1.img");
    let mut img = vec![0u8; MIN_CAPACITY as usize];
    img[0..8].copy_from_slice(crate::format::MAGIC);
    img[8..12].copy_from_slice(&1u32.to_le_bytes());
    std::fs::write(&v1, &img).unwrap();
    assert!(matches!(LogStore::open(&v1), Err(StoreError::BadFormat(_))));
    assert!(matches!(
        LogStore::create(&v1, MIN_CAPACITY, "test"),
        Err(StoreError::BadFormat(_))
    ));

    // A file of zeros is not a Shoal device; open_or_create formats it.
    let p = dir.path().join("zeros.img");
    std::fs::write(&p, vec![0u8; 8192]).unwrap();
    assert!(matches!(LogStore::open(&p), Err(StoreError::BadFormat(_))));
    let s = LogStore::open_or_create(&p, MIN_CAPACITY, "test").unwrap();
    assert_eq!(s.components(), vec![]);
    drop(s);
    let missing = dir.path().join("missing.img");
    assert!(matches!(LogStore::open(&missing), Err(StoreError::Io(_))));
    drop(LogStore::open_or_create(&missing, MIN_CAPACITY, "test").unwrap());

    // One damaged superblock copy is repaired from the other; both
    // damaged is corruption, never silently reformatted.
    let p = dir.path().join("bad.img");
    let s = LogStore::create(&p, MIN_CAPACITY, "test").unwrap();
    s.create_component(1, 1, M).unwrap();
    s.write(1, 0, b"data").unwrap();
    drop(s);
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&[0xFF], 30).unwrap();
    drop(f);
    let s = LogStore::open(&p).unwrap();
    assert_eq!(read_vec(&s, 1, 0, 4), b"data");
    drop(s);
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 30).unwrap();
    assert_ne!(b[0], 0xFF, "copy 0 was repaired");
    f.write_all_at(&[0xFF], 30).unwrap();
    f.write_all_at(&[0xFF], 4096 + 30).unwrap();
    drop(f);
    assert!(matches!(LogStore::open(&p), Err(StoreError::Corrupt(_))));
    assert!(matches!(
        LogStore::open_or_create(&p, MIN_CAPACITY, "test"),
        Err(StoreError::Corrupt(_))
    ));
    assert!(matches!(
        LogStore::create(&p, MIN_CAPACITY, "test"),
        Err(StoreError::Corrupt(_))
    ));
}

/// The buffered fallback (file systems that refuse `O_DIRECT`).
#[test]
fn buffered_file_device() {
    let dir = TempDir::new().unwrap();
    let p = dev_path(&dir);
    let open = || {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .unwrap();
        f.set_len(4 * M).unwrap();
        Arc::new(FileDevice::buffered(f, &p, 4 * M, false))
    };
    let s = LogStore::format_device(open(), "test", &small_cfg(64)).unwrap();
    assert!(!s.direct_io());
    s.create_component(1, 1, M).unwrap();
    s.write(1, 1000, &pattern(1, 20_000)).unwrap();
    s.sync().unwrap();
    drop(s);
    let s = LogStore::open_device(open()).unwrap();
    assert_eq!(read_vec(&s, 1, 1000, 20_000), pattern(1, 20_000));
    s.check().unwrap();
}

#[test]
fn ranges_components_and_fences() {
    let (d, s) = mem_store(16, 40);
    assert!(matches!(
        s.create_component(0, 1, M),
        Err(StoreError::ReservedId)
    ));
    s.create_component(3, 30, 4096).unwrap();
    let e = s.write(3, 4000, &[1u8; 97]).unwrap_err();
    assert!(matches!(
        e,
        StoreError::OutOfRange {
            id: 3,
            offset: 4000,
            len: 97,
            size: 4096
        }
    ));
    assert!(s.read(3, u64::MAX, &mut [0u8; 2]).is_err());
    assert!(matches!(
        s.write(3, u64::MAX, &[0u8; 2]),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(s.write_zeroes(3, u64::MAX, 2).is_err());
    assert!(matches!(
        s.write(4, 0, b"x"),
        Err(StoreError::NoSuchComponent(4))
    ));
    s.create_component(3, 30, 8192).unwrap();
    s.create_component(3, 30, 4096).unwrap();
    assert_eq!(s.component(3).unwrap().size, 8192);
    assert!(matches!(
        s.create_component(3, 31, 4096),
        Err(StoreError::VolumeMismatch {
            id: 3,
            have: 30,
            got: 31
        })
    ));
    assert!(matches!(
        s.resize_component(3, crate::MAX_SIZE + 1),
        Err(StoreError::OutOfRange { .. })
    ));
    assert_eq!(s.generation(3), Some(0));
    s.fence(3, 5).unwrap();
    s.fence(3, 5).unwrap();
    let e = s.fence(3, 4).unwrap_err();
    assert!(matches!(e, StoreError::StaleGeneration { have: 5, got: 4 }));
    // Fences are durable on return, even through a power cut.
    let img = d.power_cut(&mut SimRng::new(1));
    drop(s);
    let s = LogStore::open_device(Arc::new(FaultyDevice::from_image(img))).unwrap();
    assert_eq!(s.generation(3), Some(5));
    assert_eq!(s.generation(9), None);
    assert_eq!(s.component(3).unwrap().size, 8192);
}

#[test]
fn trim_zeroes_delete_and_shrink_free_space() {
    let (d, s) = mem_store(16, 60);
    s.create_component(1, 1, M).unwrap();
    let data = pattern(1, 40 * B as usize);
    s.write(1, 4 * B, &data).unwrap();
    assert_eq!(s.used(), 40 * B);
    // Partial zeroing keeps the block.
    s.write_zeroes(1, 4 * B + 10, 20).unwrap();
    assert_eq!(s.used(), 40 * B);
    assert_eq!(read_vec(&s, 1, 4 * B + 5, 30)[5..25], [0u8; 20]);
    // Trim of whole blocks frees them; partial edges are zeroed.
    s.trim(1, 10 * B - 100, 3 * B + 200).unwrap();
    assert_eq!(s.used(), 37 * B);
    assert_eq!(
        s.allocated_ranges(1),
        vec![(4 * B, 6 * B), (13 * B, 31 * B)]
    );
    assert_eq!(
        read_vec(&s, 1, 10 * B - 100, (3 * B + 200) as usize),
        vec![0u8; (3 * B + 200) as usize]
    );
    assert_eq!(
        read_vec(&s, 1, 13 * B + 100, 50),
        data[(9 * B + 100) as usize..(9 * B + 150) as usize]
    );
    // Zeroing a whole block's worth of a partly written block unmaps it.
    s.write(1, 50 * B + 7, b"again").unwrap();
    assert_eq!(read_vec(&s, 1, 50 * B, 12), b"\0\0\0\0\0\0\0again");
    s.write_zeroes(1, 50 * B + 7, 5).unwrap();
    assert!(!s.allocated_ranges(1).iter().any(|&(o, _)| o == 50 * B));
    // Shrink to mid-block, grow again: the old tail reads zeros.
    s.resize_component(1, 5 * B + 100).unwrap();
    assert_eq!(s.used(), 2 * B);
    s.resize_component(1, 20 * B).unwrap();
    assert_eq!(
        read_vec(&s, 1, 5 * B + 90, 20)[..10],
        data[(B + 90) as usize..(B + 100) as usize]
    );
    assert_eq!(read_vec(&s, 1, 5 * B + 100, 4096), vec![0u8; 4096]);
    assert!(s.read(1, 20 * B, &mut [0u8; 1]).is_err());
    // A growth never shrinks: smaller or equal leaves the size and data.
    s.grow_component(1, 10 * B).unwrap();
    assert_eq!(s.component(1).unwrap().size, 20 * B);
    s.grow_component(1, 24 * B).unwrap();
    assert_eq!(s.component(1).unwrap().size, 24 * B);
    assert_eq!(read_vec(&s, 1, 23 * B, 4096), vec![0u8; 4096]);
    assert!(matches!(
        s.grow_component(9, B),
        Err(StoreError::NoSuchComponent(9))
    ));
    // Zeroing to the end of the component frees the partial last block.
    s.resize_component(1, 5 * B + 100).unwrap();
    s.write_zeroes(1, 5 * B, 100).unwrap();
    assert_eq!(s.allocated_ranges(1), vec![(4 * B, B)]);
    s.check().unwrap();

    s.delete_component(1).unwrap();
    assert_eq!(s.used(), 0);
    assert!(s.component(1).is_none());
    assert!(matches!(
        s.delete_component(1),
        Err(StoreError::NoSuchComponent(1))
    ));
    let img = d.power_cut(&mut SimRng::new(3));
    drop(s);
    let s = LogStore::open_device(Arc::new(FaultyDevice::from_image(img))).unwrap();
    assert_eq!(s.used(), 0);
    assert!(s.components().is_empty());
    s.check().unwrap();
}

#[test]
fn marks_survive_power_cuts_checkpoints_and_reopens() {
    let (d, s) = mem_store(16, 64);
    let mib = 1u64 << 20;
    s.create_component(1, 1, 3 * mib).unwrap();
    s.create_component(2, 1, mib).unwrap();
    // Bytes across the first region's end mark regions 0 and 1.
    s.mark_regions(1, mib - 10, 20).unwrap();
    s.mark_regions(1, 0, 0).unwrap();
    s.write(1, 0, &pattern(1, BLOCK)).unwrap();
    s.mark_regions(2, 0, B).unwrap();
    assert!(matches!(
        s.mark_regions(9, 0, B),
        Err(StoreError::NoSuchComponent(9))
    ));
    s.sync().unwrap();
    let both = vec![(1, vec![0, 1]), (2, vec![0])];
    assert_eq!(s.marked_regions(), both);
    // A power cut: the marks come back from the log tail.
    let img = d.power_cut(&mut SimRng::new(1));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    assert_eq!(s.marked_regions(), both);
    // From a checkpoint, and an unmark made durable by a sync.
    s.checkpoint().unwrap();
    s.unmark_regions(1, &[1, 2]).unwrap();
    s.sync().unwrap();
    let img = d.power_cut(&mut SimRng::new(2));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    let after = vec![(1, vec![0]), (2, vec![0])];
    assert_eq!(s.marked_regions(), after);
    // An unmark that was never synced may be lost: the region is marked
    // again, never the other way round.
    s.unmark_regions(2, &[0]).unwrap();
    let img = d.power_cut_with(|_, _, _| 0);
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    assert_eq!(s.marked_regions(), after);
    s.check().unwrap();
    // Deleting a component drops its marks; a clean close keeps the rest.
    s.delete_component(2).unwrap();
    s.close().unwrap();
    let s = reopen(&d);
    assert_eq!(s.marked_regions(), vec![(1, vec![0])]);
    // The device marks at most `max_marks` regions at once.
    let sb = &s.sb;
    let max = format::max_marks(sb.nsegs, sb.seg_blocks, sb.max_components);
    s.create_component(3, 1, (max + 4) * mib).unwrap();
    let r = s.mark_regions(3, 0, (max + 4) * mib);
    assert!(matches!(r, Err(StoreError::NoSpace)), "{r:?}");
    s.mark_regions(3, 0, (max - 1) * mib).unwrap();
    assert!(matches!(
        s.mark_regions(3, max * mib, 1),
        Err(StoreError::NoSpace)
    ));
    s.unmark_regions(3, &[0]).unwrap();
    s.mark_regions(3, max * mib, 1).unwrap();
    s.close().unwrap();
    let s = reopen(&d);
    let marked: usize = s.marked_regions().iter().map(|(_, r)| r.len()).sum();
    assert_eq!(marked as u64, max);
}

/// Power cut that keeps none of the writes not yet flushed.
fn cut_unflushed(d: &Arc<FaultyDevice>, s: LogStore) -> (Arc<FaultyDevice>, LogStore) {
    let img = d.power_cut_with(|_, _, _| 0);
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    (d, s)
}

/// Entries in the open batch (what the last calls logged since a sync).
fn open_entries(s: &LogStore) -> Vec<Entry> {
    s.lock_state().batch.entries.clone()
}

fn regions(r: std::ops::Range<u32>) -> Tracked {
    Tracked::Regions(r.collect())
}

#[test]
fn tracked_regions_survive_power_cuts_checkpoints_and_reopens() {
    let (d, s) = mem_store(16, 64);
    s.create_component(1, 1, 8 * M).unwrap();
    s.create_component(2, 1, M).unwrap();
    assert_eq!(s.tracked_regions(1), Some(regions(0..0)));
    assert_eq!(s.tracked_regions(9), None);
    assert!(matches!(
        s.track_regions(9, &[0]),
        Err(StoreError::NoSuchComponent(9))
    ));
    assert!(matches!(
        s.track_all(9),
        Err(StoreError::NoSuchComponent(9))
    ));
    s.untrack_all(9).unwrap();
    s.sync().unwrap();
    // Empty sets and absent components log nothing.
    s.untrack_all(1).unwrap();
    s.track_regions(1, &[]).unwrap();
    assert_eq!(open_entries(&s), vec![]);
    // One entry per region newly tracked, ascending, whatever the order.
    s.track_regions(1, &[5, 1, 5, 3]).unwrap();
    let track = |comp, region| Entry::Track { comp, region };
    assert_eq!(
        open_entries(&s),
        vec![track(1, 1), track(1, 3), track(1, 5)]
    );
    s.track_regions(2, &[0]).unwrap();
    s.sync().unwrap();
    // Already tracked regions cost nothing; marks are another set.
    s.track_regions(1, &[3, 1]).unwrap();
    assert_eq!(open_entries(&s), vec![]);
    assert!(s.marked_regions().is_empty());
    let one = Tracked::Regions(vec![1, 3, 5]);
    // A power cut: the sets come back from the log tail.
    let img = d.power_cut(&mut SimRng::new(1));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    assert_eq!(s.tracked_regions(1), Some(one.clone()));
    assert_eq!(s.tracked_regions(2), Some(regions(0..1)));
    // All: one entry; then tracking that component costs nothing.
    s.track_all(2).unwrap();
    assert_eq!(open_entries(&s), vec![Entry::TrackAll { comp: 2 }]);
    s.sync().unwrap();
    s.track_all(2).unwrap();
    s.track_regions(2, &[7]).unwrap();
    assert_eq!(open_entries(&s), vec![]);
    // From a checkpoint (nothing after it).
    s.checkpoint().unwrap();
    let (d, s) = cut_unflushed(&d, s);
    assert_eq!(s.tracked_regions(1), Some(one.clone()));
    assert_eq!(s.tracked_regions(2), Some(Tracked::All));
    // Untrack-all: one entry whatever the size, durable with a sync.
    s.untrack_all(1).unwrap();
    assert_eq!(open_entries(&s), vec![Entry::UntrackAll { comp: 1 }]);
    s.sync().unwrap();
    let (d, s) = cut_unflushed(&d, s);
    assert_eq!(s.tracked_regions(1), Some(regions(0..0)));
    // One never synced may be lost: the set stays, never the other way.
    s.untrack_all(2).unwrap();
    assert_eq!(s.tracked_regions(2), Some(regions(0..0)));
    let (d, s) = cut_unflushed(&d, s);
    assert_eq!(s.tracked_regions(2), Some(Tracked::All));
    s.check().unwrap();
    // Deleting a component drops its set (a new one starts empty); a
    // clean close keeps the others.
    s.track_regions(1, &[7]).unwrap();
    s.delete_component(2).unwrap();
    assert_eq!(s.tracked_regions(2), None);
    s.create_component(2, 1, M).unwrap();
    assert_eq!(s.tracked_regions(2), Some(regions(0..0)));
    s.close().unwrap();
    let s = reopen(&d);
    assert_eq!(s.tracked_regions(1), Some(regions(7..8)));
    assert_eq!(s.tracked_regions(2), Some(regions(0..0)));
}

/// Tracked regions live in log entries of segments the cleaner frees, so
/// a segment is freed only by a checkpoint, which records every set.
#[test]
fn tracked_regions_survive_segment_cleaning() {
    let (d, s) = mem_store(16, 64);
    let per = s.capacity() * 4 / 5 / B;
    s.create_component(1, 1, 64 * M).unwrap();
    s.create_component(2, 1, per * B).unwrap();
    // The track entries share a batch with data that the cleaner moves.
    s.track_regions(1, &[0, 9, 63]).unwrap();
    let first = pattern(1, BLOCK);
    s.write(1, 0, &first).unwrap();
    s.sync().unwrap();
    let d0 = s.locate(1, 0).unwrap();
    let h0 = s.lock_state().segs.header_of(d0).unwrap();
    let header_at = |dev: &FaultyDevice| {
        let mut b = vec![0u8; BLOCK];
        dev.read_at(&mut b, h0 as u64 * B).unwrap();
        BatchHeader::decode(&b)
    };
    let old = header_at(&d).expect("the batch of the track entries");
    assert!(old.entries.contains(&Entry::Track {
        comp: 1,
        region: 63
    }));
    // Moved away, and its segment freed by the checkpoint that follows.
    s.relocate_segment_of(1, 0).unwrap();
    assert_ne!(s.locate(1, 0), Some(d0));
    // Scattered overwrites (the cleaner moves what they leave live) and
    // more regions tracked, until the log has gone round the device.
    let mut rng = SimRng::new(2);
    let mut want = vec![0, 9, 63];
    for round in 0..8u32 {
        for k in 0..per {
            let b = rng.below(per);
            s.write(2, b * B, &noise(round as u64 * per + k, BLOCK))
                .unwrap();
        }
        // Within the bound: six regions tracked one by one here.
        s.track_regions(1, &[20 + round % 3]).unwrap();
        want.push(20 + round % 3);
        s.sync().unwrap();
    }
    want.sort_unstable();
    want.dedup();
    assert!(
        header_at(&d).is_none_or(|h| h.seq != old.seq),
        "the segment was never reused"
    );
    assert!(s.stats().cleaned_segments > 8, "{:?}", s.stats());
    let want = Tracked::Regions(want);
    assert_eq!(s.tracked_regions(1), Some(want.clone()));
    let img = d.power_cut(&mut SimRng::new(3));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    s.check().unwrap();
    assert_eq!(s.tracked_regions(1), Some(want));
    assert_eq!(read_vec(&s, 1, 0, BLOCK), first);
}

/// Regions tracked one by one, device-wide.
fn listed(s: &LogStore) -> u64 {
    s.components()
        .iter()
        .map(|c| match s.tracked_regions(c.id) {
            Some(Tracked::Regions(r)) => r.len() as u64,
            _ => 0,
        })
        .sum()
}

#[test]
fn tracked_regions_collapse_past_the_bound_and_marks_keep_their_room() {
    let (d, s) = mem_store(16, 64);
    let sb = &s.sb;
    let max = format::max_marks(sb.nsegs, sb.seg_blocks, sb.max_components);
    let half = format::max_tracked(sb.nsegs, sb.seg_blocks, sb.max_components);
    assert_eq!(half, max / 2);
    let half32 = half as u32;
    for id in 1..=4 {
        s.create_component(id, 1, (max + 8) * M).unwrap();
    }
    // Up to the bound, region by region.
    s.track_regions(1, &(0..half32 - 1).collect::<Vec<_>>())
        .unwrap();
    s.track_regions(2, &[0]).unwrap();
    assert_eq!(listed(&s), half);
    // Past it, the component tracking more collapses to All (one entry)
    // and gives its regions back.
    s.sync().unwrap();
    s.track_regions(2, &[1]).unwrap();
    assert_eq!(open_entries(&s), vec![Entry::TrackAll { comp: 2 }]);
    assert_eq!(s.tracked_regions(2), Some(Tracked::All));
    assert_eq!(listed(&s), half - 1);
    // So does a set past the bound on its own.
    s.track_regions(3, &(0..half32 + 1).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(s.tracked_regions(3), Some(Tracked::All));
    s.track_regions(4, &[0]).unwrap();
    assert_eq!(listed(&s), half);
    // Marks keep all of `max_marks`, whatever is tracked.
    s.mark_regions(1, 0, max * M).unwrap();
    let r = s.mark_regions(2, 0, 1);
    assert!(matches!(r, Err(StoreError::NoSpace)), "{r:?}");
    s.unmark_regions(1, &[(max - 1) as u32]).unwrap();
    s.untrack_all(1).unwrap();
    assert_eq!(listed(&s), 1);
    // Tracking is never refused for room: with the marks at their bound
    // it goes up to its own, and both survive a reopen (the checkpoint
    // slot holds both at once).
    s.track_regions(1, &(0..half32 - 1).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(listed(&s), half);
    let marked =
        |s: &LogStore| -> u64 { s.marked_regions().iter().map(|(_, r)| r.len() as u64).sum() };
    assert_eq!(marked(&s), max - 1);
    let before: Vec<_> = (1..=4).map(|id| s.tracked_regions(id)).collect();
    s.close().unwrap();
    let s = reopen(&d);
    assert_eq!(
        (1..=4).map(|id| s.tracked_regions(id)).collect::<Vec<_>>(),
        before
    );
    assert_eq!((marked(&s), listed(&s)), (max - 1, half));
    // From the log tail too.
    s.untrack_all(4).unwrap();
    s.track_regions(2, &[5]).unwrap();
    s.sync().unwrap();
    let (_, s) = cut_unflushed(&d, s);
    assert_eq!(s.tracked_regions(4), Some(regions(0..0)));
    assert_eq!(s.tracked_regions(2), Some(Tracked::All));
    assert_eq!(listed(&s), half - 1);
}

/// A device of format version 3 (marks, no tracked regions) is refused
/// with `BadFormat`, never misread or reformatted.
#[test]
fn refuses_devices_of_format_version_3() {
    let dir = TempDir::new().unwrap();
    let p = dev_path(&dir);
    let s = new_store(&dir);
    s.create_component(1, 1, M).unwrap();
    s.write(1, 0, b"data").unwrap();
    drop(s);
    // Both superblock copies say version 3, with valid checksums.
    let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
    for copy in 0..2u64 {
        let mut b = vec![0u8; BLOCK];
        f.read_exact_at(&mut b, copy * B).unwrap();
        b[8..12].copy_from_slice(&3u32.to_le_bytes());
        let crc = crc32c::crc32c(&b[..BLOCK - 4]);
        b[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
        f.write_all_at(&b, copy * B).unwrap();
    }
    drop(f);
    for r in [
        LogStore::open(&p),
        LogStore::open_or_create(&p, MIN_CAPACITY, "test"),
        LogStore::create(&p, MIN_CAPACITY, "test"),
    ] {
        let e = r.unwrap_err();
        assert!(matches!(e, StoreError::BadFormat(_)), "{e}");
        assert!(
            e.to_string().contains(
                "format version 3 is not supported by the log store (it reads version 4)"
            ),
            "{e}"
        );
    }
    let mut v = [0u8; 4];
    std::fs::File::open(&p)
        .unwrap()
        .read_exact_at(&mut v, 8)
        .unwrap();
    assert_eq!(u32::from_le_bytes(v), 3, "left as it was");
}

#[test]
fn no_space_changes_nothing_and_freeing_helps() {
    let (d, s) = mem_store(16, 40);
    let cap = s.capacity() / B;
    s.create_component(1, 1, 1 << 40).unwrap();
    for i in 0..cap {
        s.write(1, i * 8 * B, &pattern(i, 100)).unwrap();
    }
    assert_eq!(s.used(), cap * B);
    // A write needing two new blocks when none is left fails whole.
    let e = s.write(1, 100_000 * B - 10, &[9u8; 20]).unwrap_err();
    assert!(matches!(e, StoreError::NoSpace), "{e}");
    assert_eq!(read_vec(&s, 1, 100_000 * B - 10, 20), vec![0u8; 20]);
    // Overwrites keep working, however often (the cleaner makes room).
    for k in 0..(4 * cap) {
        let i = (k * 7) % cap;
        s.write(1, i * 8 * B + 1, &pattern(1000 + k, 50)).unwrap();
        if k % 5 == 0 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    let st = s.stats();
    assert!(st.cleaned_segments > 0, "{st:?}");
    s.check().unwrap();
    // Freeing makes room again.
    s.trim(1, 0, 16 * B).unwrap();
    s.write(1, 300_000 * B, b"a").unwrap();
    s.write(1, 300_001 * B, b"b").unwrap();
    assert!(matches!(
        s.write(1, 300_002 * B, b"c"),
        Err(StoreError::NoSpace)
    ));
    s.sync().unwrap();
    let mut want: HashMap<u64, Vec<u8>> = HashMap::new();
    for i in 2..cap {
        want.insert(i, pattern(i, 100));
    }
    for k in 0..(4 * cap) {
        let i = (k * 7) % cap;
        if let Some(w) = want.get_mut(&i) {
            w[1..51].copy_from_slice(&pattern(1000 + k, 50));
        }
    }
    let img = d.power_cut(&mut SimRng::new(9));
    drop(s);
    let s = LogStore::open_device(Arc::new(FaultyDevice::from_image(img))).unwrap();
    s.check().unwrap();
    for (i, w) in &want {
        assert_eq!(&read_vec(&s, 1, i * 8 * B, 100), w, "block {i}");
    }
    assert_eq!(read_vec(&s, 1, 300_000 * B, 2), b"a\0");
    assert_eq!(s.used(), cap * B);
}

#[test]
fn thin_writes_leave_reserved_space_free() {
    let (_d, s) = mem_store(16, 64);
    let cap = s.capacity() / B;
    let (thin, thick) = (10u64, 20u64);
    let promised = cap / 4;
    s.create_component(thin, 1, 1 << 40).unwrap();
    // The promise counts before the reserved component exists here.
    s.set_reservations(&HashMap::from([(thick, promised * B)]));
    assert_eq!(s.lacking(None), promised * B);
    assert_eq!(s.lacking(Some(thick)), 0);
    let mut at = 0;
    let refused = loop {
        match s.write(thin, at * B, &pattern(at, BLOCK)) {
            Ok(()) => at += 1,
            Err(e) => break e,
        }
        assert!(at <= cap, "never refused");
    };
    assert!(matches!(refused, StoreError::NoSpace), "{refused:?}");
    assert_eq!(at, cap - promised, "the thin one stops at the promise");
    // Overwrites proceed.
    s.write(thin, 0, &pattern(7, BLOCK)).unwrap();
    // The reserved component gets all it was promised, and no more.
    s.create_component(thick, 2, promised * B).unwrap();
    for i in 0..promised {
        s.write(thick, i * B, &pattern(1000 + i, BLOCK)).unwrap();
    }
    assert_eq!(s.lacking(None), 0);
    assert!(matches!(
        s.write(thin, at * B, &[1u8; 10]),
        Err(StoreError::NoSpace)
    ));
    // Dropping the promise gives nothing back (it is all used) but
    // freeing the reserved one's blocks does.
    s.set_reservations(&HashMap::new());
    s.trim(thick, 0, 2 * B).unwrap();
    s.write(thin, at * B, &[1u8; 10]).unwrap();
    s.check().unwrap();
}

#[test]
fn racing_writers_never_take_promised_space() {
    let dir = TempDir::new().unwrap();
    let s = Arc::new(new_store(&dir));
    let cap = s.capacity() / B;
    let promised = cap / 3;
    s.set_reservations(&HashMap::from([(99, promised * B)]));
    for id in 1..=4u64 {
        s.create_component(id, id, cap * B).unwrap();
    }
    // Four threads write fresh 64 KiB pieces until refused: together they
    // must stop at the promise, never past it.
    let threads: Vec<_> = (1..=4u64)
        .map(|id| {
            let s = s.clone();
            std::thread::spawn(move || {
                let data = pattern(id, 16 * BLOCK);
                let mut k = 0u64;
                while s.write(id, k * 16 * B, &data).is_ok() {
                    k += 1;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let used = s.used() / B;
    assert!(
        used <= cap - promised,
        "used {used} of {cap}, {promised} promised"
    );
    assert!(used + 4 * 16 > cap - promised, "stopped early: {used}");
    s.create_component(99, 9, promised * B).unwrap();
    for i in 0..promised {
        s.write(99, i * B, &pattern(i, BLOCK)).unwrap();
    }
    s.sync().unwrap();
    s.check().unwrap();
}

#[test]
fn concurrent_writers() {
    let dir = TempDir::new().unwrap();
    let s = Arc::new(new_store(&dir));
    for id in 1..=4u64 {
        s.create_component(id, id, 16 * M).unwrap();
    }
    let threads: Vec<_> = (1..=4u64)
        .map(|id| {
            let s = s.clone();
            std::thread::spawn(move || {
                for k in 0..40u64 {
                    let off = (k * 397 * 1024 + id * 13) % (15 * M);
                    s.write(id, off, &pattern(id * 1000 + k, 5000)).unwrap();
                    if k % 7 == 0 {
                        s.sync().unwrap();
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    s.sync().unwrap();
    let expect = |id: u64| {
        let mut m = vec![0u8; 16 * M as usize];
        for k in 0..40u64 {
            let off = ((k * 397 * 1024 + id * 13) % (15 * M)) as usize;
            m[off..off + 5000].copy_from_slice(&pattern(id * 1000 + k, 5000));
        }
        m
    };
    let used = s.used();
    drop(s);
    let s = LogStore::open(&dev_path(&dir)).unwrap();
    assert_eq!(s.used(), used);
    for id in 1..=4u64 {
        assert!(
            read_vec(&s, id, 0, 16 * M as usize) == expect(id),
            "component {id}"
        );
    }
    s.check().unwrap();
}

/// A device whose writes take a while (so batches overlap in flight).
struct Slow(Arc<FaultyDevice>, AtomicU64);

impl BlockDevice for Slow {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.0.read_at(buf, off)
    }
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let n = self.1.fetch_add(0x9E37_79B9, Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_micros((n >> 8) % 400));
        self.0.write_at(buf, off)
    }
    fn flush(&self) -> io::Result<()> {
        self.0.flush()
    }
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn name(&self) -> &Path {
        self.0.name()
    }
}

/// Batches are written outside the state lock by whichever thread sealed
/// them, so several can be in flight at once and land in any order. Many
/// writers with group commit, readers checking every block they can see,
/// a power cut at a random I/O: every acknowledged write must survive,
/// every block must hold a value once written to it, and reads during the
/// run (served from batches in flight too) see the latest value.
#[test]
fn concurrent_writers_with_power_cuts_keep_acknowledged_writes() {
    for seed in 0..30u64 {
        let mut rng = SimRng::new(seed);
        let dev = mem_device(64, 48);
        let slow = Arc::new(Slow(dev.clone(), AtomicU64::new(seed)));
        let s = Arc::new(LogStore::format_device(slow, "t", &small_cfg(64)).unwrap());
        let per = 24u64; // blocks per thread
        for id in 1..=4u64 {
            s.create_component(id, id, per * B).unwrap();
        }
        let gc = GroupCommit::new(s.clone());
        dev.die_after(40 + rng.below(400));
        // Per block: (last acknowledged value, values written since).
        type Log = Vec<(Option<u64>, Vec<u64>)>;
        let threads: Vec<_> = (1..=4u64)
            .map(|id| {
                let (s, gc) = (s.clone(), gc.clone());
                std::thread::spawn(move || -> Log {
                    let mut log: Log = vec![(None, Vec::new()); per as usize];
                    let mut rng = SimRng::new(seed * 100 + id);
                    for k in 0..400u64 {
                        let b = rng.below(per);
                        let v = id << 32 | k;
                        // Several blocks per write now and then: full batches.
                        let n = if rng.chance(1, 8) {
                            (per - b).min(6)
                        } else {
                            1
                        };
                        let mut data = Vec::new();
                        for _ in 0..n {
                            data.extend_from_slice(&noise(v, BLOCK));
                        }
                        for j in 0..n {
                            log[(b + j) as usize].1.push(v);
                        }
                        if s.write(id, b * B, &data).is_err() {
                            break;
                        }
                        let mut got = vec![0u8; BLOCK];
                        if s.read(id, b * B, &mut got).is_err() {
                            break;
                        }
                        assert!(got == noise(v, BLOCK), "seed {seed}: read of {id}/{b}");
                        if rng.chance(1, 2) {
                            if gc.commit_blocking().is_err() {
                                break;
                            }
                            for e in log.iter_mut() {
                                if let Some(&last) = e.1.last() {
                                    *e = (Some(last), Vec::new());
                                }
                            }
                        }
                    }
                    log
                })
            })
            .collect();
        let logs: Vec<Log> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        drop(gc);
        let img = dev.power_cut(&mut rng);
        drop(s);
        let dev = Arc::new(FaultyDevice::from_image(img));
        let s = LogStore::open_device(dev).unwrap();
        s.check().unwrap();
        for (i, log) in logs.iter().enumerate() {
            let id = i as u64 + 1;
            for (b, (acked, since)) in log.iter().enumerate() {
                let got = read_vec(&s, id, b as u64 * B, BLOCK);
                let ok = acked
                    .iter()
                    .chain(since.iter())
                    .any(|&v| got == noise(v, BLOCK))
                    || (acked.is_none() && got == ZERO);
                assert!(
                    ok,
                    "seed {seed}: block {id}/{b} lost its acknowledged value {acked:?}"
                );
            }
        }
    }
}

#[test]
fn table_full() {
    let (_d, s) = mem_store(16, 40);
    for id in 1..=8u64 {
        s.create_component(id, 1, 4096).unwrap();
    }
    assert!(matches!(
        s.create_component(5000, 1, 4096),
        Err(StoreError::TableFull)
    ));
    s.delete_component(7).unwrap();
    s.create_component(5000, 1, 4096).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn group_commit_batches_syncs() {
    let dir = TempDir::new().unwrap();
    let s = Arc::new(new_store(&dir));
    s.create_component(1, 1, 32 * M).unwrap();
    let gc = Arc::new(GroupCommit::new(s.clone()));
    let rounds = 10u64;
    let tasks: Vec<_> = (0..32u64)
        .map(|t| {
            let (s, gc) = (s.clone(), gc.clone());
            tokio::spawn(async move {
                for r in 0..rounds {
                    let s2 = s.clone();
                    tokio::task::spawn_blocking(move || {
                        s2.write(1, t * M + r * 4096, &[t as u8 + 1; 4096])
                    })
                    .await
                    .unwrap()
                    .unwrap();
                    gc.commit().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let commits = 32 * rounds;
    let syncs = gc.syncs();
    let st = s.stats();
    assert!(
        syncs >= 1 && syncs < commits,
        "{syncs} syncs for {commits} commits"
    );
    assert!(st.batches < commits, "{st:?}");
    drop(gc);
    drop(s);
    let s = LogStore::open(&dev_path(&dir)).unwrap();
    assert_eq!(read_vec(&s, 1, 31 * M + 9 * 4096, 4096), vec![32u8; 4096]);
}

/// The node's use of `GroupCommit` (no type argument) is the log store's.
#[test]
fn group_commit_defaults_to_the_log_store() {
    struct Device {
        commit: GroupCommit,
    }
    let dir = TempDir::new().unwrap();
    let s = Arc::new(LogStore::create(&dev_path(&dir), MIN_CAPACITY, "t").unwrap());
    let d = Device {
        commit: GroupCommit::new(s.clone()),
    };
    d.commit.commit_blocking().unwrap();
    assert_eq!(d.commit.syncs(), 1);
}

// ---------------------------------------------------------------------
// Model test (files, close and reopen)
// ---------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Write {
        c: usize,
        off: u64,
        len: usize,
        seed: u64,
    },
    Read {
        c: usize,
        off: u64,
        len: usize,
    },
    Trim {
        c: usize,
        off: u64,
        len: u64,
    },
    Zeroes {
        c: usize,
        off: u64,
        len: u64,
    },
    Resize {
        c: usize,
        size: u64,
    },
    Track {
        c: usize,
        regions: Vec<u32>,
    },
    TrackAll {
        c: usize,
    },
    UntrackAll {
        c: usize,
    },
    Sync,
    Reopen,
}

const SIZES: [u64; 3] = [5 * M + 12345, 3 * M, 64 * 1024];

fn arb_off() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..6 * M,
        (0u64..6 * 256, -5000i64..5000).prop_map(|(k, d)| (k * B).saturating_add_signed(d)),
    ]
}

fn arb_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0usize..3, arb_off(), 1usize..300_000, any::<u64>())
            .prop_map(|(c, off, len, seed)| Op::Write { c, off, len, seed }),
        3 => (0usize..3, arb_off(), 1usize..2_500_000).prop_map(|(c, off, len)| Op::Read { c, off, len }),
        2 => (0usize..3, arb_off(), 1u64..3 * M).prop_map(|(c, off, len)| Op::Trim { c, off, len }),
        2 => (0usize..3, arb_off(), 1u64..3 * M).prop_map(|(c, off, len)| Op::Zeroes { c, off, len }),
        1 => (0usize..3, 0u64..6 * M).prop_map(|(c, size)| Op::Resize { c, size }),
        2 => (0usize..3, prop::collection::vec(0u32..8, 0..4))
            .prop_map(|(c, regions)| Op::Track { c, regions }),
        1 => (0usize..6).prop_map(|c| if c < 3 { Op::UntrackAll { c } } else { Op::TrackAll { c: c - 3 } }),
        1 => Just(Op::Sync),
        1 => Just(Op::Reopen),
    ]
}

fn clip(off: u64, len: u64, size: u64) -> (u64, u64) {
    if size == 0 {
        return (0, 0);
    }
    let off = off % size;
    (off, len.min(size - off))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_a_model(ops in prop::collection::vec(arb_op(), 1..40)) {
        let dir = TempDir::new().unwrap();
        let mut s = new_store(&dir);
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        let mut tracked: BTreeMap<u64, Tracked> = BTreeMap::new();
        for (i, size) in SIZES.iter().enumerate() {
            s.create_component(i as u64 + 1, 9, *size).unwrap();
            model.insert(i as u64 + 1, vec![0u8; *size as usize]);
            tracked.insert(i as u64 + 1, Tracked::Regions(vec![]));
        }
        let tracked_now = |s: &LogStore| -> BTreeMap<u64, Tracked> {
            (1..=SIZES.len() as u64).map(|id| (id, s.tracked_regions(id).unwrap())).collect()
        };
        for op in ops {
            match op {
                Op::Write { c, off, len, seed } => {
                    let id = c as u64 + 1;
                    let m = model.get_mut(&id).unwrap();
                    let (off, len) = clip(off, len as u64, m.len() as u64);
                    let data = pattern(seed, len as usize);
                    s.write(id, off, &data).unwrap();
                    m[off as usize..(off + len) as usize].copy_from_slice(&data);
                }
                Op::Read { c, off, len } => {
                    let id = c as u64 + 1;
                    let m = &model[&id];
                    let (off, len) = clip(off, len as u64, m.len() as u64);
                    let got = read_vec(&s, id, off, len as usize);
                    prop_assert!(got[..] == m[off as usize..(off + len) as usize], "read {} {}+{}", id, off, len);
                    let (owned, _) = read_owned(&s, id, off, len as usize).unwrap();
                    prop_assert!(owned[..] == m[off as usize..(off + len) as usize], "owned read {} {}+{}", id, off, len);
                }
                Op::Trim { c, off, len } | Op::Zeroes { c, off, len } => {
                    let id = c as u64 + 1;
                    let m = model.get_mut(&id).unwrap();
                    let (off, len) = clip(off, len, m.len() as u64);
                    if matches!(op, Op::Trim { .. }) {
                        s.trim(id, off, len).unwrap();
                    } else {
                        s.write_zeroes(id, off, len).unwrap();
                    }
                    m[off as usize..(off + len) as usize].fill(0);
                }
                Op::Resize { c, size } => {
                    let id = c as u64 + 1;
                    s.resize_component(id, size).unwrap();
                    model.get_mut(&id).unwrap().resize(size as usize, 0);
                }
                Op::Track { c, ref regions } => {
                    let id = c as u64 + 1;
                    s.track_regions(id, regions).unwrap();
                    if let Some(Tracked::Regions(t)) = tracked.get_mut(&id) {
                        t.extend(regions);
                        t.sort_unstable();
                        t.dedup();
                    }
                }
                Op::TrackAll { c } => {
                    s.track_all(c as u64 + 1).unwrap();
                    tracked.insert(c as u64 + 1, Tracked::All);
                }
                Op::UntrackAll { c } => {
                    s.untrack_all(c as u64 + 1).unwrap();
                    tracked.insert(c as u64 + 1, Tracked::Regions(vec![]));
                }
                Op::Sync => s.sync().unwrap(),
                Op::Reopen => {
                    drop(s);
                    s = LogStore::open(&dev_path(&dir)).unwrap();
                    prop_assert_eq!(&tracked_now(&s), &tracked);
                }
            }
        }
        prop_assert_eq!(&tracked_now(&s), &tracked);
        s.sync().unwrap();
        prop_assert_eq!(s.check(), Ok(()));
        drop(s);
        let s = LogStore::open(&dev_path(&dir)).unwrap();
        prop_assert_eq!(s.check(), Ok(()));
        prop_assert_eq!(&tracked_now(&s), &tracked);
        let mut blocks = 0;
        for (id, m) in &model {
            let meta = s.component(*id).unwrap();
            prop_assert_eq!(meta.size, m.len() as u64);
            prop_assert!(read_vec(&s, *id, 0, m.len())[..] == m[..], "component {}", id);
            let ranges = s.allocated_ranges(*id);
            let inside = |p: usize| ranges.iter().any(|&(o, l)| (p as u64) >= o && (p as u64) < o + l);
            prop_assert!(m.iter().enumerate().all(|(p, &b)| b == 0 || inside(p)));
            blocks += meta.allocated / B;
        }
        prop_assert_eq!(s.used(), blocks * B);
    }
}

// ---------------------------------------------------------------------
// Crash consistency over the fault-injecting device
// ---------------------------------------------------------------------

/// The regions (1 MiB) that bytes `off .. off+len` touch.
fn regions_of(off: u64, len: u64) -> Vec<u32> {
    let region = format::REGION_BLOCKS * B;
    if len == 0 {
        return vec![];
    }
    (off / region..=(off + len - 1) / region)
        .map(|r| r as u32)
        .collect()
}

/// What a component may look like after a power cut.
#[derive(Debug, Clone)]
struct MComp {
    /// Possible sizes and generations (the current one last).
    sizes: Vec<u64>,
    gens: Vec<u64>,
    /// Per block: the contents it may have (current last). Absent: zeros.
    blocks: BTreeMap<u64, Vec<Vec<u8>>>,
    /// May be absent (a delete that may or may not have happened).
    maybe_absent: bool,
    /// May be a fresh empty component of this size (a recreate in flight).
    maybe_fresh: Option<u64>,
}

impl MComp {
    fn new(size: u64) -> MComp {
        MComp {
            sizes: vec![size],
            gens: vec![0],
            blocks: BTreeMap::new(),
            maybe_absent: false,
            maybe_fresh: None,
        }
    }

    fn size(&self) -> u64 {
        *self.sizes.last().unwrap()
    }

    fn cur(&self, b: u64) -> Vec<u8> {
        self.blocks
            .get(&b)
            .map(|v| v.last().unwrap().clone())
            .unwrap_or_else(|| vec![0u8; BLOCK])
    }

    fn push(&mut self, b: u64, content: Vec<u8>) {
        self.blocks
            .entry(b)
            .or_insert_with(|| vec![vec![0u8; BLOCK]])
            .push(content);
    }

    /// Applies bytes `data` (or zeros) at `off`.
    fn write(&mut self, off: u64, len: u64, data: Option<&[u8]>) {
        for (b, within, n, at) in blocks_of(off, len) {
            let mut c = self.cur(b);
            match data {
                Some(d) => c[within..within + n].copy_from_slice(&d[at..at + n]),
                None => c[within..within + n].fill(0),
            }
            self.push(b, c);
        }
    }

    fn resize(&mut self, size: u64) {
        let old = self.size();
        if size < old {
            let keep = size.div_ceil(B);
            let doomed: Vec<u64> = self.blocks.range(keep..).map(|(&b, _)| b).collect();
            for b in doomed {
                self.push(b, vec![0u8; BLOCK]);
            }
            if !size.is_multiple_of(B) {
                let b = size / B;
                let mut c = self.cur(b);
                c[(size % B) as usize..].fill(0);
                self.push(b, c);
            }
        }
        self.sizes.push(size);
    }

    /// Everything so far is durable.
    fn synced(&mut self) {
        self.sizes = vec![self.size()];
        self.gens = vec![*self.gens.last().unwrap()];
        for v in self.blocks.values_mut() {
            let last = v.pop().unwrap();
            *v = vec![last];
        }
        self.maybe_absent = false;
        self.maybe_fresh = None;
    }
}

/// A store under test and what it may contain.
struct Crash {
    rng: SimRng,
    dev: Arc<FaultyDevice>,
    store: Option<LogStore>,
    model: BTreeMap<u64, MComp>,
    /// Sizes a component alternates between on recreate.
    small: [u64; 2],
    /// Segments cleaned, checkpoints, unflushed writes at the cuts.
    seen: (u64, u64, u64),
    /// Only scattered overwrites and syncs.
    scatter: bool,
}

impl Crash {
    fn s(&self) -> &LogStore {
        self.store.as_ref().unwrap()
    }

    fn synced_all(&mut self) {
        for m in self.model.values_mut() {
            m.synced();
        }
    }

    /// One random operation. `Err` when the device lost power.
    fn step(&mut self) -> std::result::Result<(), ()> {
        let ids: Vec<u64> = self.model.keys().copied().collect();
        let id = ids[self.rng.below(ids.len() as u64) as usize];
        let size = self.model[&id].size();
        let roll = if self.scatter {
            // Scattered one-block overwrites and syncs: the cleaner's work.
            if self.rng.chance(1, 8) {
                70
            } else {
                let b = self.rng.below(size / B);
                let data = noise(self.rng.next_u64(), BLOCK);
                let r = self
                    .s()
                    .mark_regions(id, b * B, B)
                    .and_then(|()| self.s().track_regions(id, &regions_of(b * B, B)))
                    .and_then(|()| self.s().write(id, b * B, &data));
                if r.is_ok() || Self::power_lost(&r) {
                    self.model
                        .get_mut(&id)
                        .unwrap()
                        .write(b * B, B, Some(&data));
                }
                return self.outcome(r);
            }
        } else {
            self.rng.below(100)
        };
        let r = match roll {
            0..=49 => {
                let len = if self.rng.chance(1, 5) {
                    1 + self.rng.below(16 * B)
                } else {
                    1 + self.rng.below(9000)
                }
                .min(size);
                let off = self.rng.below(size - len + 1);
                let data = noise(self.rng.next_u64(), len as usize);
                // Marked first, as the cluster does (`mark_regions`), and
                // tracked, as it does while a copy is out of service.
                let r = self
                    .s()
                    .mark_regions(id, off, len)
                    .and_then(|()| self.s().track_regions(id, &regions_of(off, len)))
                    .and_then(|()| self.s().write(id, off, &data));
                if r.is_ok() || Self::power_lost(&r) {
                    self.model
                        .get_mut(&id)
                        .unwrap()
                        .write(off, len, Some(&data));
                }
                r
            }
            50..=61 => {
                let len = (1 + self.rng.below(24 * B)).min(size);
                let off = self.rng.below(size - len + 1);
                let r = if self.rng.chance(1, 2) {
                    self.s().trim(id, off, len)
                } else {
                    self.s().write_zeroes(id, off, len)
                };
                if r.is_ok() || Self::power_lost(&r) {
                    self.model.get_mut(&id).unwrap().write(off, len, None);
                }
                r
            }
            62..=79 => {
                let r = self.s().sync();
                if r.is_ok() {
                    self.synced_all();
                }
                r
            }
            80..=84 => {
                let new = self.rng.below(self.small[1] + 1);
                let r = self.s().resize_component(id, new);
                if r.is_ok() || Self::power_lost(&r) {
                    self.model.get_mut(&id).unwrap().resize(new);
                }
                if r.is_ok() {
                    self.synced_all();
                }
                r
            }
            85..=87 => {
                let g = *self.model[&id].gens.last().unwrap() + 1 + self.rng.below(3);
                let r = self.s().fence(id, g);
                if r.is_ok() || Self::power_lost(&r) {
                    self.model.get_mut(&id).unwrap().gens.push(g);
                }
                if r.is_ok() {
                    self.synced_all();
                }
                r
            }
            88..=90 => {
                // Recreate with the other size.
                let new = if size == self.small[0] {
                    self.small[1]
                } else {
                    self.small[0]
                };
                let r = self
                    .s()
                    .delete_component(id)
                    .and_then(|_| self.s().create_component(id, id, new));
                match &r {
                    Ok(()) => {
                        self.model.insert(id, MComp::new(new));
                        self.synced_all();
                    }
                    Err(_) if Self::power_lost(&r) => {
                        let m = self.model.get_mut(&id).unwrap();
                        m.maybe_absent = true;
                        m.maybe_fresh = Some(new);
                    }
                    Err(_) => {}
                }
                r
            }
            91..=93 => {
                let r = self.s().checkpoint();
                if r.is_ok() {
                    self.synced_all();
                }
                r
            }
            94..=96 => {
                let r = self.s().clean().map(|_| ());
                r
            }
            _ => {
                // Clean close and reopen.
                let r = self.store.take().unwrap().close();
                match LogStore::open_device(self.dev.clone()) {
                    Ok(s) => {
                        self.store = Some(s);
                        if r.is_ok() {
                            self.synced_all();
                        }
                        r
                    }
                    Err(e) => {
                        assert!(self.dev.is_dead(), "reopen failed: {e}");
                        Err(e)
                    }
                }
            }
        };
        self.outcome(r)
    }

    fn outcome(&self, r: Result<()>) -> std::result::Result<(), ()> {
        match r {
            Ok(()) => Ok(()),
            Err(_) if self.dev.is_dead() => Err(()),
            Err(e) => panic!("unexpected error: {e}"),
        }
    }

    fn power_lost(r: &Result<()>) -> bool {
        matches!(r, Err(StoreError::Io(_)))
    }

    /// Cuts the power, restarts on what survived and checks it against the
    /// model; then takes what it found as the new model.
    fn cut_and_check(&mut self, seed: u64) {
        if let Some(s) = &self.store {
            let st = s.stats();
            self.seen.0 += st.cleaned_segments;
            self.seen.1 += st.checkpoints;
            self.seen.2 += self.dev.unflushed() as u64;
        }
        let img = self.dev.power_cut(&mut self.rng);
        drop(self.store.take());
        self.dev = Arc::new(FaultyDevice::from_image(img));
        let s = match LogStore::open_device(self.dev.clone()) {
            Ok(s) => s,
            Err(e) => panic!("seed {seed}: open after power cut failed: {e}"),
        };
        if let Err(e) = s.check() {
            panic!("seed {seed}: index invalid after power cut: {e}");
        }
        let mut total = 0;
        for (&id, m) in self.model.iter_mut() {
            let Some(meta) = s.component(id) else {
                assert!(m.maybe_absent, "seed {seed}: component {id} lost");
                *m = MComp::new(0);
                m.maybe_absent = true; // stays absent: recreate below
                continue;
            };
            total += meta.allocated;
            let fresh = m.maybe_fresh == Some(meta.size) && !m.sizes.contains(&meta.size);
            let mut buf = vec![0u8; meta.size as usize];
            match s.read(id, 0, &mut buf) {
                Ok(()) => {}
                Err(e) => panic!("seed {seed}: reading component {id}: {e}"),
            }
            if fresh {
                assert!(
                    buf.chunks(BLOCK).all(|c| *c == ZERO[..c.len()]),
                    "seed {seed}: fresh {id} not zero"
                );
                assert_eq!(meta.generation, 0);
            } else {
                assert!(
                    m.sizes.contains(&meta.size),
                    "seed {seed}: component {id} size {} not in {:?}",
                    meta.size,
                    m.sizes
                );
                assert!(
                    m.gens.contains(&meta.generation),
                    "seed {seed}: component {id} generation {} not in {:?}",
                    meta.generation,
                    m.gens
                );
                for (b, chunk) in buf.chunks(BLOCK).enumerate() {
                    let b = b as u64;
                    let ok = match m.blocks.get(&b) {
                        None => *chunk == ZERO[..chunk.len()],
                        Some(v) => v.iter().any(|c| c[..chunk.len()] == *chunk),
                    };
                    assert!(
                        ok,
                        "seed {seed}: component {id} block {b}: unexpected contents"
                    );
                }
            }
            // Every block holding data was written after its region was
            // marked, and nothing unmarks here: its region is marked.
            let marks = s
                .marked_regions()
                .into_iter()
                .find(|(c, _)| *c == id)
                .map(|(_, r)| r)
                .unwrap_or_default();
            for (b, chunk) in buf.chunks(BLOCK).enumerate() {
                if *chunk != ZERO[..chunk.len()] {
                    let r = (b as u64 / format::REGION_BLOCKS) as u32;
                    assert!(
                        marks.contains(&r),
                        "seed {seed}: block {b} of {id} holds data, region {r} unmarked"
                    );
                }
            }
            // It was tracked before it was written too, and nothing
            // untracks here: its region is tracked.
            let tracked = s.tracked_regions(id);
            for (b, chunk) in buf.chunks(BLOCK).enumerate() {
                let r = (b as u64 / format::REGION_BLOCKS) as u32;
                let ok = match &tracked {
                    Some(Tracked::All) => true,
                    Some(Tracked::Regions(t)) => t.contains(&r),
                    None => false,
                };
                assert!(
                    ok || *chunk == ZERO[..chunk.len()],
                    "seed {seed}: block {b} of {id} holds data, region {r} untracked"
                );
            }
            // Allocated ranges cover every block holding data.
            let ranges = s.allocated_ranges(id);
            for (b, chunk) in buf.chunks(BLOCK).enumerate() {
                if *chunk != ZERO[..chunk.len()] {
                    let p = b as u64 * B;
                    assert!(
                        ranges.iter().any(|&(o, l)| p >= o && p < o + l),
                        "seed {seed}: block {b} of {id} outside the allocated ranges"
                    );
                }
            }
            // The new truth.
            let mut n = MComp::new(meta.size);
            n.gens = vec![meta.generation];
            for (b, chunk) in buf.chunks(BLOCK).enumerate() {
                if *chunk != ZERO[..chunk.len()] {
                    let mut c = vec![0u8; BLOCK];
                    c[..chunk.len()].copy_from_slice(chunk);
                    n.blocks.insert(b as u64, vec![c]);
                }
            }
            *m = n;
        }
        assert_eq!(s.used(), total, "seed {seed}: used");
        // Bring lost components back so later rounds have them.
        for (&id, m) in self.model.iter_mut() {
            if m.maybe_absent && s.component(id).is_none() {
                s.create_component(id, id, self.small[0]).unwrap();
                *m = MComp::new(self.small[0]);
            }
        }
        self.store = Some(s);
    }
}

/// Runs one crash case: a few rounds of random operations, each ended by
/// a power cut at a random I/O, a restart and a check.
fn crash_case(seed: u64, scatter: bool) -> (u64, u64, u64) {
    let mut rng = SimRng::new(seed);
    let seg = [8u32, 16, 32][rng.below(3) as usize];
    // Devices of 1 to 1.9 MiB: 30, 16 or 14 segments.
    let blocks = match seg {
        8 => 256,
        16 => 288,
        _ => 480,
    };
    let dev = Arc::new(FaultyDevice::new(blocks * B));
    let store = LogStore::format_device(dev.clone(), "crash", &small_cfg(seg)).unwrap();
    let cap = store.capacity() / B;
    // Three components that fill 90% of the capacity, written in full in
    // half the cases: then overwrites need the cleaner.
    let per = cap * 3 / 10;
    let small = [per * B - 1000, per * B];
    let mut model = BTreeMap::new();
    let prefill = scatter || rng.chance(1, 2);
    for id in 1..=3u64 {
        store.create_component(id, id, small[1]).unwrap();
        let mut m = MComp::new(small[1]);
        if prefill {
            let data = noise(rng.next_u64(), (per * B) as usize);
            store.mark_regions(id, 0, per * B).unwrap();
            store.track_regions(id, &regions_of(0, per * B)).unwrap();
            store.write(id, 0, &data).unwrap();
            m.write(0, per * B, Some(&data));
        }
        model.insert(id, m);
    }
    store.sync().unwrap();
    for m in model.values_mut() {
        m.synced();
    }
    let mut c = Crash {
        rng,
        dev,
        store: Some(store),
        model,
        small,
        seen: (0, 0, 0),
        scatter,
    };
    for _round in 0..3 {
        let ops = if scatter {
            40 + c.rng.below(120)
        } else {
            10 + c.rng.below(40)
        };
        if c.rng.chance(3, 4) {
            let n = c.rng.below(ops * 6);
            c.dev.die_after(n);
        }
        for _ in 0..ops {
            if c.step().is_err() {
                break;
            }
        }
        c.cut_and_check(seed);
    }
    c.seen
}

/// Crash cases run by the four `crash_cases` tests; a failing seed is
/// printed, and `crash_case(seed, scatter)` replays it alone.
const CRASH_CASES: u64 = 2000;
/// First seed of the crash cases (raise it to explore other seeds).
const CRASH_SEED_FIRST: u64 = 0;

/// Runs part `part` of 4 of the crash cases: [`CRASH_CASES`] seeds in all,
/// a fifth of them of scattered overwrites that keep the cleaner busy.
fn crash_cases(part: u64) {
    let (cases, start) = (CRASH_CASES, CRASH_SEED_FIRST);
    let (lo, hi) = (start + cases * part / 4, start + cases * (part + 1) / 4);
    let t = std::time::Instant::now();
    let mut seen = (0, 0, 0);
    for seed in lo..hi {
        let scatter = (seed - lo) < (hi - lo) / 5;
        let s = crash_case(seed, scatter);
        seen = (seen.0 + s.0, seen.1 + s.1, seen.2 + s.2);
    }
    eprintln!(
        "crash seeds {lo}..{hi} in {:?}: {} segments cleaned, {} checkpoints, {} unflushed writes at the cuts",
        t.elapsed(),
        seen.0,
        seen.1,
        seen.2
    );
    assert!(seen.0 > 0 && seen.1 > 0 && seen.2 > 0, "{seen:?}");
}

#[test]
fn crash_consistency_seeds_part_0() {
    crash_cases(0);
}

#[test]
fn crash_consistency_seeds_part_1() {
    crash_cases(1);
}

#[test]
fn crash_consistency_seeds_part_2() {
    crash_cases(2);
}

#[test]
fn crash_consistency_seeds_part_3() {
    crash_cases(3);
}

/// After a crash that tore batch S but kept batch S+1 (written before S
/// was flushed), the restarted log writes a new batch S of the same length:
/// the old S+1, still valid and exactly where the new chain continues, must
/// not be replayed (the epoch changes at every open).
#[test]
fn stale_batches_from_before_a_crash_are_never_replayed() {
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 256 * B).unwrap();
    let room = {
        let st = s.lock_state();
        assert!(st.batch.is_empty());
        st.batch.cap_data
    } as u64;
    assert!(room >= 2);
    for i in 0..room {
        s.write(1, (100 + i) * B, &pattern(i, BLOCK)).unwrap(); // batch S
    }
    s.write(1, 0, &pattern(1, BLOCK)).unwrap(); // S+1 (next segment): block 0 = stale
    for i in 0..15 {
        s.write(1, (200 + i) * B, &pattern(50 + i, BLOCK)).unwrap();
    }
    assert_eq!(d.unflushed(), 2, "S and S+1 written, not flushed");
    // S keeps only its header (torn), S+1 survives whole.
    let img = d.power_cut_with(|i, _, len| if i == 0 { BLOCK } else { len });
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = reopen(&d);
    assert_eq!(read_vec(&s, 1, 0, BLOCK), vec![0u8; BLOCK]);
    // A new batch S of the same length, block 0 = new, acknowledged.
    for i in 0..room - 1 {
        s.write(1, (100 + i) * B, &pattern(9, BLOCK)).unwrap();
    }
    s.write(1, 0, &pattern(2, BLOCK)).unwrap();
    s.sync().unwrap();
    assert_eq!(s.lock_state().batch.off, 0, "the new S filled the segment");
    let img = d.power_cut_with(|_, _, _| 0);
    drop(s);
    let s = reopen(&Arc::new(FaultyDevice::from_image(img)));
    assert!(
        read_vec(&s, 1, 0, BLOCK) == pattern(2, BLOCK),
        "acknowledged write lost"
    );
    assert!(read_vec(&s, 1, 200 * B, BLOCK) == vec![0u8; BLOCK]);
    s.check().unwrap();
}

/// A power cut at every I/O of a checkpoint in turn loses nothing synced.
#[test]
fn power_cut_at_each_step_of_a_checkpoint() {
    let mut k = 0;
    loop {
        let (d, s) = mem_store(16, 40);
        s.create_component(1, 1, 64 * B).unwrap();
        for i in 0..20u64 {
            s.write(1, i * B, &pattern(i, BLOCK)).unwrap();
        }
        s.sync().unwrap();
        s.write(1, 30 * B, b"unsynced").unwrap();
        let before = d.io_counts();
        d.die_after(k);
        let r = s.checkpoint();
        let done = r.is_ok();
        let img = d.power_cut(&mut SimRng::new(k));
        drop(s);
        let s = LogStore::open_device(Arc::new(FaultyDevice::from_image(img))).unwrap();
        s.check().unwrap();
        for i in 0..20u64 {
            assert_eq!(read_vec(&s, 1, i * B, BLOCK), pattern(i, BLOCK), "cut {k}");
        }
        if done {
            assert_eq!(read_vec(&s, 1, 30 * B, 8), b"unsynced");
            let after = d.io_counts();
            assert!(after.0 + after.1 - before.0 - before.1 >= 5);
            break;
        }
        k += 1;
    }
    assert!(k >= 5, "a checkpoint takes several I/Os ({k})");
}

// ---------------------------------------------------------------------
// Corruption and I/O errors
// ---------------------------------------------------------------------

#[test]
fn bit_flips_are_detected() {
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    for i in 0..8u64 {
        s.write(1, i * B, &pattern(i, BLOCK)).unwrap();
    }
    s.sync().unwrap();
    // A flipped bit in a data block: that block fails, others read.
    let db = s.locate(1, 3).unwrap() as u64;
    d.flip_bit(db * B * 8 + 1234 * 8 + 5);
    match s.read(1, 0, &mut vec![0u8; 8 * BLOCK]) {
        Err(StoreError::Checksum {
            component: 1,
            offset,
        }) => assert_eq!(offset, 3 * B),
        other => panic!("{other:?}"),
    }
    assert_eq!(read_vec(&s, 1, 2 * B, BLOCK), pattern(2, BLOCK));
    assert!(matches!(
        s.read(1, 3 * B + 10, &mut [0u8; 10]),
        Err(StoreError::Checksum { .. })
    ));
    // The same through a read whose answer the store allocates.
    assert!(matches!(
        read_owned(&s, 1, 2 * B + 100, 2 * BLOCK),
        Err(StoreError::Checksum { offset, .. }) if offset == 3 * B
    ));
    let (got, device_only) = read_owned(&s, 1, 0, 3 * BLOCK).unwrap();
    assert!(device_only);
    assert_eq!(
        got[..],
        [pattern(0, BLOCK), pattern(1, BLOCK), pattern(2, BLOCK)].concat()
    );
    // A partial write into it cannot merge: it fails too.
    assert!(matches!(
        s.write(1, 3 * B + 10, b"x"),
        Err(StoreError::Checksum { .. })
    ));
    // A whole-block rewrite repairs it.
    s.write(1, 3 * B, &pattern(33, BLOCK)).unwrap();
    assert_eq!(read_vec(&s, 1, 3 * B, BLOCK), pattern(33, BLOCK));
    s.sync().unwrap();
    // A flipped bit in a batch header: every block of that batch fails.
    let db = s.locate(1, 5).unwrap() as u64;
    let h = {
        let st = s.lock_state();
        st.segs.header_of(db as u32).unwrap() as u64
    };
    lock(&s.cache).remove(h as u32);
    d.flip_bit(h * B * 8 + 200 * 8);
    assert!(matches!(
        s.read(1, 5 * B, &mut [0u8; 1]),
        Err(StoreError::Checksum { .. })
    ));
    assert!(matches!(
        read_owned(&s, 1, 5 * B, BLOCK),
        Err(StoreError::Checksum { .. })
    ));
    // Still detected after a restart (the batch is in the checkpoint).
    s.checkpoint().unwrap();
    let img = d.power_cut(&mut SimRng::new(0));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = LogStore::open_device(d.clone()).unwrap();
    assert!(matches!(
        s.read(1, 5 * B, &mut [0u8; 1]),
        Err(StoreError::Checksum { .. })
    ));
    assert_eq!(read_vec(&s, 1, 3 * B, BLOCK), pattern(33, BLOCK));
    // The cleaner moves a bad block as bad: never laundered.
    s.relocate_segment_of(1, 5).unwrap();
    assert_eq!(s.stats().cleaned_segments, 1);
    assert_ne!(s.locate(1, 5).unwrap() as u64, db);
    assert!(matches!(
        s.read(1, 5 * B, &mut [0u8; 1]),
        Err(StoreError::Checksum { .. })
    ));
    assert_eq!(read_vec(&s, 1, 3 * B, BLOCK), pattern(33, BLOCK));
    s.check().unwrap();
}

#[test]
fn bit_flips_in_the_log_tail() {
    // A flipped data bit in a replayed batch that a later batch proves
    // durable: replay keeps it, reads report it.
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    s.write(1, 0, &pattern(1, BLOCK)).unwrap();
    s.sync().unwrap();
    let db = s.locate(1, 0).unwrap() as u64;
    s.write(1, B, &pattern(2, BLOCK)).unwrap();
    s.sync().unwrap();
    d.flip_bit(db * B * 8 + 77);
    let img = d.power_cut(&mut SimRng::new(0));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    let s = LogStore::open_device(d.clone()).unwrap();
    assert!(matches!(
        s.read(1, 0, &mut [0u8; 1]),
        Err(StoreError::Checksum { .. })
    ));
    assert_eq!(read_vec(&s, 1, B, BLOCK), pattern(2, BLOCK));
    drop(s);

    // A damaged header in the tail with a later batch proving it durable:
    // opening refuses (Corrupt) instead of silently dropping writes.
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    s.write(1, 0, &pattern(1, BLOCK)).unwrap();
    s.sync().unwrap();
    let d0 = s.locate(1, 0).unwrap();
    let h = s.lock_state().segs.header_of(d0).unwrap() as u64;
    s.write(1, B, &pattern(2, BLOCK)).unwrap();
    s.sync().unwrap();
    d.flip_bit(h * B * 8 + 999);
    let img = d.power_cut(&mut SimRng::new(0));
    drop(s);
    let e = LogStore::open_device(Arc::new(FaultyDevice::from_image(img))).unwrap_err();
    assert!(matches!(e, StoreError::Corrupt(_)), "{e}");

    // Known limit: a flip in the very last batch before a crash looks like
    // a torn write: that batch is dropped (its block reads the older value).
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    s.write(1, 0, &pattern(1, BLOCK)).unwrap();
    s.sync().unwrap();
    s.write(1, 0, &pattern(2, BLOCK)).unwrap();
    s.sync().unwrap();
    let db = s.locate(1, 0).unwrap() as u64;
    d.flip_bit(db * B * 8 + 5);
    let img = d.power_cut(&mut SimRng::new(0));
    drop(s);
    let s = LogStore::open_device(Arc::new(FaultyDevice::from_image(img))).unwrap();
    assert_eq!(read_vec(&s, 1, 0, BLOCK), pattern(1, BLOCK));
}

#[test]
fn checkpoint_damage() {
    // One header copy damaged: the other one is used.
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    s.write(1, 0, b"abc").unwrap();
    s.checkpoint().unwrap();
    let (sb, _) = s.geometry();
    let slot = s.lock_state().active_slot;
    let hdr0 = sb.slot_block(slot);
    drop(s);
    d.flip_bit(hdr0 * B * 8 + 100);
    let s = reopen(&d);
    assert_eq!(read_vec(&s, 1, 0, 3), b"abc");
    drop(s);
    // The newest checkpoint's body damaged: refuse (an older one may
    // need segments that were reused since).
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    s.write(1, 0, b"abc").unwrap();
    s.checkpoint().unwrap();
    drop(s); // closing writes a newer checkpoint only if something changed
    let s = reopen(&d); // opening writes one (new epoch) into the other slot
    let slot = s.lock_state().active_slot;
    let body2 = s.geometry().0.slot_block(slot) + 2;
    let img = d.power_cut(&mut SimRng::new(0));
    drop(s);
    let d = Arc::new(FaultyDevice::from_image(img));
    d.flip_bit(body2 * B * 8 + 3);
    let e = LogStore::open_device(d.clone()).unwrap_err();
    assert!(matches!(e, StoreError::Corrupt(_)), "{e}");
}

#[test]
fn io_errors_stop_the_store_and_reopen_recovers() {
    for fault in 0..3 {
        let (d, s) = mem_store(16, 40);
        s.create_component(1, 1, 64 * B).unwrap();
        s.write(1, 0, &pattern(1, BLOCK)).unwrap();
        s.sync().unwrap();
        s.write(1, B, &pattern(2, BLOCK)).unwrap();
        match fault {
            0 => d.fail_next_write(),
            1 => d.fail_next_flush(),
            _ => d.fail_next_io(),
        }
        assert!(matches!(s.sync(), Err(StoreError::Io(_))));
        // Failed: everything is refused until reopened.
        assert!(matches!(s.write(1, 0, b"x"), Err(StoreError::Io(_))));
        assert!(matches!(
            s.read(1, 0, &mut [0u8; 1]),
            Err(StoreError::Io(_))
        ));
        assert!(matches!(s.sync(), Err(StoreError::Io(_))));
        drop(s);
        let s = reopen(&d);
        s.check().unwrap();
        assert_eq!(read_vec(&s, 1, 0, BLOCK), pattern(1, BLOCK));
        let b1 = read_vec(&s, 1, B, BLOCK);
        assert!(b1 == pattern(2, BLOCK) || b1 == vec![0u8; BLOCK]);
        s.write(1, 2 * B, b"after").unwrap();
        s.sync().unwrap();
        drop(s);
        let s = reopen(&d);
        assert_eq!(read_vec(&s, 1, 2 * B, 5), b"after");
    }
    // A failed read is reported and changes nothing.
    let (d, s) = mem_store(16, 40);
    s.create_component(1, 1, 64 * B).unwrap();
    s.write(1, 0, &pattern(1, BLOCK)).unwrap();
    s.sync().unwrap();
    let d0 = s.locate(1, 0).unwrap();
    let h = s.lock_state().segs.header_of(d0).unwrap();
    lock(&s.cache).remove(h);
    d.fail_next_read();
    assert!(matches!(
        s.read(1, 0, &mut [0u8; 1]),
        Err(StoreError::Io(_))
    ));
    assert_eq!(read_vec(&s, 1, 0, BLOCK), pattern(1, BLOCK));
    s.write(1, 0, b"ok").unwrap();
    s.sync().unwrap();
}

// ---------------------------------------------------------------------
// Space, the cleaner, memory
// ---------------------------------------------------------------------

/// Random 4 KiB overwrites over live data filling `fill` of the capacity:
/// returns the stats after `rounds` × capacity writes.
fn overwrite_workload(seg: u32, nsegs: u64, fill: f64, rounds: u64) -> LogStats {
    overwrite_workload_with(seg, nsegs, fill, rounds, false)
}

/// [`overwrite_workload`], with the background cleaner running if `bg`.
fn overwrite_workload_with(seg: u32, nsegs: u64, fill: f64, rounds: u64, bg: bool) -> LogStats {
    let (d, s) = mem_store(seg, nsegs);
    let s = Arc::new(s);
    if bg {
        s.start_background().unwrap();
    }
    let cap = s.capacity() / B;
    let n = (cap as f64 * fill) as u64;
    s.create_component(1, 1, n * B).unwrap();
    let mut model = vec![0u64; n as usize];
    for b in 0..n {
        s.write(1, b * B, &pattern(b, BLOCK)).unwrap();
        model[b as usize] = b;
    }
    s.sync().unwrap();
    let base = s.stats();
    let mut rng = SimRng::new(42);
    for k in 0..rounds * cap {
        let b = rng.below(n);
        let v = 1_000_000 + k;
        s.write(1, b * B, &pattern(v, BLOCK)).unwrap();
        model[b as usize] = v;
        if k % 32 == 31 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    s.check().unwrap();
    let mut st = s.stats();
    st.client_bytes -= base.client_bytes;
    st.data_blocks -= base.data_blocks;
    st.header_blocks -= base.header_blocks;
    st.checkpoint_blocks -= base.checkpoint_blocks;
    st.cleaner_blocks -= base.cleaner_blocks;
    st.cleaned_segments -= base.cleaned_segments;
    st.cleaned_segments_background -= base.cleaned_segments_background;
    st.cleaner_waits -= base.cleaner_waits;
    // The cleaner's step may hold the store: stop it so this drop closes.
    s.stop_background();
    drop(s);
    let s = reopen(&d);
    for b in (0..n).step_by(7) {
        assert_eq!(
            read_vec(&s, 1, b * B, BLOCK),
            pattern(model[b as usize], BLOCK)
        );
    }
    st
}

#[test]
fn cleaner_write_amplification_is_bounded() {
    for (fill, bound) in [(0.5, 2.5), (0.95, 8.0)] {
        let st = overwrite_workload(64, 64, fill, 3);
        eprintln!(
            "random 4K overwrites at {:.0}% of capacity: write amplification {:.2} (cleaner {:.2}), {:?}",
            fill * 100.0,
            st.write_amplification(),
            st.cleaner_amplification(),
            st
        );
        assert!(st.cleaned_segments > 0);
        assert!(
            st.write_amplification() < bound,
            "{fill}: {}",
            st.write_amplification()
        );
    }
}

/// The background cleaner keeps free segments ahead of a steady overwrite
/// workload: the data reads back, `check` passes, write amplification
/// stays within the inline cleaner's bounds, and writers rarely clean.
#[test]
fn background_cleaner_keeps_ahead_of_writers() {
    for (fill, bound) in [(0.5, 2.5), (0.95, 8.0)] {
        let st = overwrite_workload_with(64, 64, fill, 3, true);
        let inline = st.cleaned_segments - st.cleaned_segments_background;
        eprintln!(
            "background cleaner, random 4K overwrites at {:.0}% of capacity: write amplification {:.2} (cleaner {:.2}), segments cleaned {} in the background, {inline} inline; {} writes waited; {:?}",
            fill * 100.0,
            st.write_amplification(),
            st.cleaner_amplification(),
            st.cleaned_segments_background,
            st.cleaner_waits,
            st
        );
        assert!(st.cleaned_segments_background > 0);
        assert!(
            inline * 10 <= st.cleaned_segments,
            "{fill}: {inline} of {} segments cleaned inline",
            st.cleaned_segments
        );
        assert!(
            st.write_amplification() < bound,
            "{fill}: {}",
            st.write_amplification()
        );
    }
}

/// The background cleaner reads its victims outside the state lock while
/// writers overwrite and trim the blocks it is about to move: every block
/// still reads what was last written to it (or zeroes after a trim),
/// during the run, after it, and after reopening.
#[test]
fn background_cleaner_races_overwrites_and_trims() {
    cleaner_races_overwrites_and_trims(false);
}

/// The same with preparation writing zeros over free segments all along
/// (every segment a checkpoint frees counts as unallocated again, as if
/// punched, and each zero write lasts 200 µs more): it never touches a
/// segment with live data, and the log never writes one being zeroed.
#[test]
fn preparation_races_writers_and_the_cleaner() {
    cleaner_races_overwrites_and_trims(true);
}

fn cleaner_races_overwrites_and_trims(prepare: bool) {
    // Writers get a millisecond between the cleaner's read of its victim
    // and its moves: enough to overwrite, clean inline, free and reuse it.
    let (d, s) = mem_store(64, 64);
    s.cleaner_pause_us
        .store(1000, std::sync::atomic::Ordering::Relaxed);
    if prepare {
        s.prepare_all_for_tests(4, 0);
        s.prep
            .reprepare_freed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        s.prep
            .pause_us
            .store(200, std::sync::atomic::Ordering::Relaxed);
    }
    let s = Arc::new(s);
    s.start_background().unwrap();
    let cap = s.capacity() / B;
    // Two components filling 90% of the capacity: the cleaner works all
    // the time. With preparation, 60%: it needs more free segments than
    // the cleaner's mark to start.
    let per = if prepare {
        cap * 30 / 100
    } else {
        cap * 45 / 100
    };
    for id in 1..=2u64 {
        s.create_component(id, id, per * B).unwrap();
    }
    let threads: Vec<_> = (1..=2u64)
        .map(|id| {
            let s = s.clone();
            std::thread::spawn(move || -> Vec<Option<u64>> {
                let mut model: Vec<Option<u64>> = vec![None; per as usize];
                let mut rng = SimRng::new(id * 7919);
                for k in 0..(8 * cap) {
                    let b = if k < per { k } else { rng.below(per) };
                    match rng.below(20) {
                        // Trim a few blocks.
                        0 => {
                            let n = 1 + rng.below(4).min(per - b - 1);
                            s.trim(id, b * B, n * B).unwrap();
                            for m in &mut model[b as usize..(b + n) as usize] {
                                *m = None;
                            }
                        }
                        // Read one back.
                        1 | 2 => {
                            let want =
                                model[b as usize].map_or(vec![0; BLOCK], |v| noise(v, BLOCK));
                            assert!(read_vec(&s, id, b * B, BLOCK) == want, "block {b} of {id}");
                        }
                        _ => {
                            let v = id << 32 | k;
                            s.write(id, b * B, &noise(v, BLOCK)).unwrap();
                            model[b as usize] = Some(v);
                        }
                    }
                    if k % 16 == 15 {
                        s.sync().unwrap();
                    }
                }
                s.sync().unwrap();
                model
            })
        })
        .collect();
    let models: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let st = s.stats();
    assert!(st.cleaned_segments_background > 0, "{st:?}");
    if prepare {
        eprintln!(
            "{} segments prepared amid writers, {} cleaned in the background",
            st.prepared_segments, st.cleaned_segments_background
        );
        // It kept preparing amid the writers: more than twice the 4
        // segments kept ahead. (How many more depends on the CPU time
        // the preparer gets beside two writers and the cleaner: 17 on a
        // loaded 2-core CI run, above 20 alone.)
        assert!(st.prepared_segments > 8, "{st:?}");
    }
    s.check().unwrap();
    let verify = |s: &LogStore| {
        for (i, model) in models.iter().enumerate() {
            for (b, v) in model.iter().enumerate() {
                let want = v.map_or(vec![0; BLOCK], |v| noise(v, BLOCK));
                assert!(
                    read_vec(s, i as u64 + 1, b as u64 * B, BLOCK) == want,
                    "block {b} of {}",
                    i + 1
                );
            }
        }
    };
    verify(&s);
    s.stop_background();
    drop(s);
    let s = reopen(&d);
    s.check().unwrap();
    verify(&s);
}

/// A power cut while the background cleaner moves blocks under writers:
/// every acknowledged (synced) write survives reopening, every block holds
/// a value once written to it.
#[test]
fn power_cut_while_the_background_cleaner_runs() {
    let mut moved = 0;
    for seed in 0..40u64 {
        let mut rng = SimRng::new(seed);
        let dev = mem_device(64, 48);
        let s = Arc::new(LogStore::format_device(dev.clone(), "t", &small_cfg(64)).unwrap());
        s.start_background().unwrap();
        let cap = s.capacity() / B;
        // Two components filling 80% of the capacity, overwritten at random
        // by one thread each: the cleaner has to run.
        let per = cap * 4 / 10;
        for id in 1..=2u64 {
            s.create_component(id, id, per * B).unwrap();
        }
        dev.die_after(500 + rng.below(3_000));
        // Per block: (last acknowledged value, values written since).
        type Log = Vec<(Option<u64>, Vec<u64>)>;
        let threads: Vec<_> = (1..=2u64)
            .map(|id| {
                let s = s.clone();
                std::thread::spawn(move || -> Log {
                    let mut log: Log = vec![(None, Vec::new()); per as usize];
                    let mut rng = SimRng::new(seed * 100 + id);
                    for k in 0.. {
                        // The first pass fills, then random overwrites.
                        let b = if k < per { k } else { rng.below(per) };
                        let v = id << 32 | k;
                        log[b as usize].1.push(v);
                        if s.write(id, b * B, &noise(v, BLOCK)).is_err() {
                            break;
                        }
                        if rng.chance(1, 16) {
                            if s.sync().is_err() {
                                break;
                            }
                            for e in log.iter_mut() {
                                if let Some(&last) = e.1.last() {
                                    *e = (Some(last), Vec::new());
                                }
                            }
                        }
                    }
                    log
                })
            })
            .collect();
        let logs: Vec<Log> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let bg = s.stats().cleaned_segments_background;
        moved += bg;
        let img = dev.power_cut(&mut rng);
        drop(s);
        let dev = Arc::new(FaultyDevice::from_image(img));
        let s = LogStore::open_device(dev).unwrap();
        s.check().unwrap();
        for (i, log) in logs.iter().enumerate() {
            let id = i as u64 + 1;
            for (b, (acked, since)) in log.iter().enumerate() {
                let got = read_vec(&s, id, b as u64 * B, BLOCK);
                let ok = acked
                    .iter()
                    .chain(since.iter())
                    .any(|&v| got == noise(v, BLOCK))
                    || (acked.is_none() && got == ZERO);
                assert!(
                    ok,
                    "seed {seed}: block {id}/{b} lost its acknowledged value {acked:?} (background cleaner moved {bg} segments)"
                );
            }
        }
    }
    eprintln!("the background cleaner moved {moved} segments over 40 power cuts");
    assert!(moved > 0);
}

#[test]
fn sequential_data_has_a_small_index() {
    let (_d, s) = mem_store(64, 200);
    s.create_component(1, 1, 32 * M).unwrap();
    let data = pattern(5, M as usize);
    for i in 0..(s.capacity() / M).min(32) {
        s.write(1, i * M, &data).unwrap();
    }
    s.sync().unwrap();
    let (ix, _) = s.index_memory();
    let blocks = s.used() / B;
    let per = ix as f64 / blocks as f64;
    eprintln!("sequential: {per:.3} index bytes per block ({blocks} blocks)");
    assert!(per < 0.5, "{per}");
}

/// A read whose answer the store allocates answers with the plan's device
/// buffer when every block comes from the device (whole or in part), and
/// with a buffer of its own when some block is unwritten or still in
/// memory; both give the data written.
#[test]
fn owned_reads_from_the_device_memory_and_holes() {
    let (_d, s) = mem_store(64, 16);
    s.create_component(1, 1, 16 * B).unwrap();
    s.write(1, 0, &noise(0, 2 * BLOCK)).unwrap();
    s.sync().unwrap();
    s.write(1, 3 * B, &noise(3, BLOCK)).unwrap();
    let (got, device_only) = read_owned(&s, 1, 0, 2 * BLOCK).unwrap();
    assert!(device_only && got[..] == noise(0, 2 * BLOCK)[..]);
    let (got, device_only) = read_owned(&s, 1, 100, BLOCK).unwrap();
    assert!(device_only && got[..] == noise(0, 2 * BLOCK)[100..100 + BLOCK]);
    // Block 2 unwritten, block 3 in the open batch, block 4 unwritten.
    let (got, device_only) = read_owned(&s, 1, B + 7, 3 * BLOCK).unwrap();
    assert!(!device_only);
    let want = [
        &noise(0, 2 * BLOCK)[BLOCK + 7..],
        &ZERO[..],
        &noise(3, BLOCK)[..],
        &ZERO[..7],
    ]
    .concat();
    assert!(got[..] == want[..]);
    let (got, _) = read_owned(&s, 1, 8 * B, BLOCK).unwrap();
    assert!(got[..] == ZERO[..]);
    assert!(matches!(
        read_owned(&s, 1, 15 * B, 2 * BLOCK),
        Err(StoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        read_owned(&s, 2, 0, BLOCK),
        Err(StoreError::NoSuchComponent(2))
    ));
}

/// A read whose blocks were located before their segment was freed, and
/// read from the device only afterwards, still gets its data: its segment
/// drains instead of being reused. Nothing waits for the read meanwhile
/// (its caller may be the very thread that writes, as on a node's runtime
/// with one worker), and the segment is free space again once it is done.
#[test]
fn planned_read_keeps_its_blocks_from_reuse_without_blocking_writers() {
    let (_d, s) = mem_store(64, 64);
    let cap = s.capacity() / B;
    let per = cap / 2;
    s.create_component(1, 1, per * B).unwrap();
    for b in 0..per {
        s.write(1, b * B, &noise(b, BLOCK)).unwrap();
    }
    s.sync().unwrap();
    s.checkpoint().unwrap();
    let d0 = s.locate(1, 0).unwrap();
    let seg = s.lock_state().segs.locate(d0).unwrap().0;
    let mut buf = vec![0u8; BLOCK];
    let mut plan = s.plan_reads(&mut [ReadReq {
        id: 1,
        offset: 0,
        buf: &mut buf,
    }]);
    assert_eq!(plan.device_reads(), 1);
    // On this thread, with the read out: overwrite everything four times
    // over the device's size. Block 0's segment is cleaned and freed, and
    // would be written again but for the pass.
    for k in 0..4 * cap {
        s.write(1, (k % per) * B, &noise(1_000_000 + k, BLOCK))
            .unwrap();
        if k % 64 == 0 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    s.checkpoint().unwrap();
    {
        let st = s.lock_state();
        assert_eq!(st.segs.draining(), &[seg], "the read's segment drains");
        assert_eq!(st.segs.state(seg), SegState::Draining);
    }
    let read = {
        let mut parts = plan.parts();
        s.dev.read_many(&mut parts)
    };
    let res = s.finish_reads(
        plan,
        read,
        &mut [ReadReq {
            id: 1,
            offset: 0,
            buf: &mut buf,
        }],
    );
    assert!(res[0].is_ok(), "{:?}", res[0]);
    assert!(buf == noise(0, BLOCK), "the planned read got other data");
    // The next sync frees it; the block now reads its last value.
    s.sync().unwrap();
    {
        let st = s.lock_state();
        assert!(st.segs.draining().is_empty());
        assert_eq!(st.segs.state(seg), SegState::Free);
    }
    let last = (0..4 * cap).filter(|k| k % per == 0).max().unwrap();
    assert!(read_vec(&s, 1, 0, BLOCK) == noise(1_000_000 + last, BLOCK));
    s.check().unwrap();
}

/// Checkpoints written outside the state lock (by `sync` and by the
/// background cleaner) while two writers overwrite, trim and sync: power
/// cuts at random moments (some surely during a checkpoint's writes) leave
/// an image that opens, with every write synced before the cut, and for
/// each block either its value at the last sync or a later one.
#[test]
fn checkpoints_outside_the_lock_survive_power_cuts_amid_writers() {
    power_cuts_amid_writers_and_checkpoints(false);
}

/// The same with every checkpoint streamed under the lock (the path of
/// bodies too large to copy).
#[test]
fn streamed_checkpoints_survive_power_cuts_amid_writers() {
    power_cuts_amid_writers_and_checkpoints(true);
}

/// Power cuts amid writers, the cleaner and checkpoints while zeros are
/// written over free segments all along (freed segments count as
/// unallocated again): the zeros, torn or lost like any unflushed write,
/// never cost a synced block.
#[test]
fn preparation_survives_power_cuts_amid_writers() {
    power_cuts_amid(false, true);
}

fn power_cuts_amid_writers_and_checkpoints(streamed: bool) {
    power_cuts_amid(streamed, false);
}

fn power_cuts_amid(streamed: bool, prepare: bool) {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    let (d, s) = mem_store(64, 64);
    s.stream_checkpoints.store(streamed, SeqCst);
    if prepare {
        s.prepare_all_for_tests(4, 0);
        s.prep.reprepare_freed.store(true, SeqCst);
        s.prep.pause_us.store(100, SeqCst);
    }
    let s = Arc::new(s);
    // A checkpoint every 96 blocks of log: many of them, under way at
    // most moments.
    s.set_checkpoint_interval(96);
    s.start_background().unwrap();
    let cap = s.capacity() / B;
    let per = if prepare {
        cap * 30 / 100
    } else {
        cap * 40 / 100
    };
    for id in 1..=2u64 {
        s.create_component(id, id, per * B).unwrap();
    }
    s.sync().unwrap();
    // Per writer: the value of each block (a seed growing with time; 0:
    // zeros) as of its last completed sync.
    let synced: Vec<Arc<Mutex<Vec<u64>>>> = (0..2)
        .map(|_| Arc::new(Mutex::new(vec![0; per as usize])))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (1..=2u64)
        .map(|id| {
            let (s, stop, synced) = (s.clone(), stop.clone(), synced[id as usize - 1].clone());
            std::thread::spawn(move || {
                let mut model = vec![0u64; per as usize];
                let mut rng = SimRng::new(id * 31);
                let mut k = 0u64;
                while !stop.load(SeqCst) {
                    k += 1;
                    let b = rng.below(per);
                    if rng.below(16) == 0 {
                        s.trim(id, b * B, B).unwrap();
                        model[b as usize] = 0;
                    } else {
                        let seed = id << 40 | k;
                        s.write(id, b * B, &noise(seed, BLOCK)).unwrap();
                        model[b as usize] = seed;
                    }
                    if k.is_multiple_of(8) {
                        s.sync().unwrap();
                        synced.lock().unwrap().clone_from(&model);
                    }
                }
            })
        })
        .collect();
    let mut rng = SimRng::new(77);
    let mut cuts = Vec::new();
    for _ in 0..24 {
        std::thread::sleep(std::time::Duration::from_millis(5 + rng.below(25)));
        // What was synced before the cut, then the cut.
        let before: Vec<Vec<u64>> = synced.iter().map(|m| m.lock().unwrap().clone()).collect();
        cuts.push((before, d.surviving_image(&mut rng)));
    }
    if prepare {
        // On a loaded machine the preparer may lag the cuts: one more cut
        // once it has done enough to mean something.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while s.stats().prepared_segments <= 24 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let before: Vec<Vec<u64>> = synced.iter().map(|m| m.lock().unwrap().clone()).collect();
        cuts.push((before, d.surviving_image(&mut rng)));
    }
    stop.store(true, SeqCst);
    for w in writers {
        w.join().unwrap();
    }
    assert!(
        s.stats().checkpoints > 24,
        "too few checkpoints to mean anything"
    );
    if prepare {
        let n = s.stats().prepared_segments;
        eprintln!("{n} segments prepared amid the power cuts");
        assert!(n > 24, "too few segments prepared to mean anything");
    }
    for (n, (before, img)) in cuts.into_iter().enumerate() {
        let dev = Arc::new(FaultyDevice::from_image(img));
        let r = LogStore::open_device(dev).unwrap_or_else(|e| panic!("cut {n}: {e}"));
        for id in 1..=2u64 {
            for b in 0..per {
                let got = read_vec(&r, id, b * B, BLOCK);
                let want = before[id as usize - 1][b as usize];
                if got == noise(want, BLOCK) || (want == 0 && got == vec![0; BLOCK]) {
                    continue;
                }
                // Else a later write of this writer (a whole one), or a
                // later trim.
                let seed = u64::from_le_bytes(got[..8].try_into().unwrap());
                let later = got == vec![0; BLOCK]
                    || (seed >> 40 == id && seed > want && got == noise(seed, BLOCK));
                assert!(later, "cut {n}: block {b} of {id} lost its synced value");
            }
        }
    }
}

#[test]
fn a_device_whose_first_sector_was_overwritten_opens_by_superblock_copy_1() {
    let dir = TempDir::new().unwrap();
    let p = dev_path(&dir);
    assert!(matches!(LogStore::identify(&p), Err(StoreError::Io(_))));
    let uuid = {
        let s = LogStore::create(&p, 64 << 20, "c1").unwrap();
        s.uuid()
    };
    assert_eq!(LogStore::identify(&p).unwrap(), Some(("c1".into(), uuid)));
    // Copy 0 without its magic (a disk label written over the first
    // sector; a format whose last write never landed): known by copy 1,
    // opened with its data and copy 0 repaired, never formatted again.
    let s = LogStore::open(&p).unwrap();
    s.create_component(1, 1, 1 << 20).unwrap();
    s.write(1, 0, &[9u8; 4096]).unwrap();
    s.sync().unwrap();
    drop(s);
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&[0u8; 512], 0).unwrap();
    drop(f);
    assert_eq!(LogStore::identify(&p).unwrap(), Some(("c1".into(), uuid)));
    let s = LogStore::open_or_create(&p, 64 << 20, "c1").unwrap();
    assert_eq!(s.uuid(), uuid, "formatted over");
    let mut buf = vec![0u8; 4096];
    s.read(1, 0, &mut buf).unwrap();
    assert_eq!(buf, vec![9u8; 4096]);
    drop(s);
    assert_eq!(LogStore::cluster_of(&p).unwrap(), Some("c1".into()));
    let s = LogStore::create(&p, 64 << 20, "c1").unwrap();
    assert_eq!(s.uuid(), uuid, "create formatted over a device");
    // Not a device at all: none.
    let q = dir.path().join("zeros");
    std::fs::File::create(&q).unwrap().set_len(1 << 20).unwrap();
    assert_eq!(LogStore::identify(&q).unwrap(), None);
}
