use super::*;
use proptest::prelude::*;
use std::collections::HashMap;
use tempfile::TempDir;

const M: u64 = CHUNK_SIZE;

fn dev(dir: &TempDir) -> PathBuf {
    dir.path().join("dev.img")
}

fn new_store(dir: &TempDir) -> DeviceStore {
    DeviceStore::create(&dev(dir), MIN_CAPACITY, "test").unwrap()
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

fn read_vec(s: &DeviceStore, id: u64, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0xAAu8; len];
    s.read(id, off, &mut b).unwrap();
    b
}

#[test]
fn create_is_sparse_and_reopens() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
    assert_eq!(s.cluster_id(), "test");
    assert_eq!(s.capacity(), 63 * M);
    assert_eq!(s.used(), 0);
    let uuid = s.uuid();
    s.create_component(7, 70, 10 * M).unwrap();
    s.write(7, 5 * M - 3, b"hello world").unwrap();
    s.sync().unwrap();
    drop(s);
    // Sparse: only metadata and two chunks are backed by blocks.
    let md = std::fs::metadata(dev(&dir)).unwrap();
    assert_eq!(md.len(), MIN_CAPACITY);
    use std::os::unix::fs::MetadataExt;
    assert!(
        md.blocks() * 512 < 8 * M,
        "{} bytes allocated",
        md.blocks() * 512
    );

    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert_eq!(s.uuid(), uuid);
    assert_eq!(
        s.components(),
        vec![ComponentMeta {
            id: 7,
            volume: 70,
            size: 10 * M,
            generation: 0,
            allocated: 2 * M
        }]
    );
    assert_eq!(read_vec(&s, 7, 5 * M - 3, 11), b"hello world");
    assert_eq!(s.allocated_ranges(7), vec![(4 * M, 2 * M)]);
    assert_eq!(s.used(), 2 * M);
    assert_eq!(read_vec(&s, 7, 0, 4096), vec![0u8; 4096]);
}

#[test]
fn refuses_small_foreign_and_unformatted_devices() {
    let dir = TempDir::new().unwrap();
    let e = DeviceStore::create(&dev(&dir), 10 << 20, "test").unwrap_err();
    assert!(matches!(e, StoreError::TooSmall { .. }));
    assert!(
        e.to_string()
            .contains("is too small: 10 MiB given, Shoal needs at least 64 MiB"),
        "{e}"
    );

    drop(new_store(&dir));
    let e = DeviceStore::create(&dev(&dir), MIN_CAPACITY, "other").unwrap_err();
    assert!(
        matches!(e, StoreError::ForeignCluster { ref found, .. } if found == "test"),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("belongs to cluster \"test\", not \"other\""),
        "{e}"
    );
    let e = DeviceStore::open_or_create(&dev(&dir), MIN_CAPACITY, "other").unwrap_err();
    assert!(matches!(e, StoreError::ForeignCluster { .. }));
    // Same cluster: create opens the existing device without wiping it.
    let s = DeviceStore::open_or_create(&dev(&dir), MIN_CAPACITY, "test").unwrap();
    s.create_component(1, 1, M).unwrap();
    s.write(1, 0, b"keep").unwrap();
    drop(s);
    let s = DeviceStore::create(&dev(&dir), MIN_CAPACITY, "test").unwrap();
    assert_eq!(read_vec(&s, 1, 0, 4), b"keep");
    // Only one store per device at a time.
    assert!(matches!(
        DeviceStore::open(&dev(&dir)),
        Err(StoreError::Io(_))
    ));
    drop(s);

    // A file of zeros is not a Shoal device; open_or_create formats it.
    let p = dir.path().join("zeros.img");
    std::fs::write(&p, vec![0u8; 8192]).unwrap();
    assert!(matches!(
        DeviceStore::open(&p),
        Err(StoreError::BadFormat(_))
    ));
    let s = DeviceStore::open_or_create(&p, MIN_CAPACITY, "test").unwrap();
    assert_eq!(s.components(), vec![]);
    let missing = dir.path().join("missing.img");
    assert!(matches!(
        DeviceStore::open(&missing),
        Err(StoreError::Io(_))
    ));
    DeviceStore::open_or_create(&missing, MIN_CAPACITY, "test").unwrap();

    // A damaged superblock is corruption, never silently reformatted.
    let p = dir.path().join("bad.img");
    drop(DeviceStore::create(&p, MIN_CAPACITY, "test").unwrap());
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.write_all_at(&[0xFF], 30).unwrap();
    drop(f);
    assert!(matches!(DeviceStore::open(&p), Err(StoreError::Corrupt(_))));
    assert!(matches!(
        DeviceStore::open_or_create(&p, MIN_CAPACITY, "test"),
        Err(StoreError::Corrupt(_))
    ));
    assert!(matches!(
        DeviceStore::create(&p, MIN_CAPACITY, "test"),
        Err(StoreError::Corrupt(_))
    ));
}

#[test]
fn ranges_components_and_fences() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
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
        s.write(4, 0, b"x"),
        Err(StoreError::NoSuchComponent(4))
    ));
    // Idempotent create grows, never shrinks; another volume is refused.
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

    assert_eq!(s.generation(3), Some(0));
    s.fence(3, 5).unwrap();
    s.fence(3, 5).unwrap();
    let e = s.fence(3, 4).unwrap_err();
    assert!(matches!(e, StoreError::StaleGeneration { have: 5, got: 4 }));
    assert_eq!(
        e.to_string(),
        "stale generation 4: the component is fenced at generation 5"
    );
    drop(s);
    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert_eq!(s.generation(3), Some(5));
    assert_eq!(s.generation(9), None);
}

#[test]
fn trim_zeroes_delete_and_shrink_free_space() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
    s.create_component(1, 1, 8 * M).unwrap();
    let data = pattern(1, 3 * M as usize);
    s.write(1, M, &data).unwrap();
    assert_eq!(s.used(), 3 * M);
    // Partial zeroing keeps the chunk.
    s.write_zeroes(1, M + 10, 20).unwrap();
    assert_eq!(s.used(), 3 * M);
    assert_eq!(read_vec(&s, 1, M + 5, 30)[5..25], [0u8; 20]);
    // Trim of a whole chunk frees it.
    s.trim(1, 2 * M - 100, M + 200).unwrap();
    assert_eq!(s.used(), 2 * M);
    assert_eq!(s.allocated_ranges(1), vec![(M, M), (3 * M, M)]);
    assert_eq!(
        read_vec(&s, 1, 2 * M - 100, (M + 200) as usize),
        vec![0u8; (M + 200) as usize]
    );
    assert_eq!(
        read_vec(&s, 1, 3 * M + 100, 50),
        data[(2 * M + 100) as usize..(2 * M + 150) as usize]
    );
    // Rewriting a trimmed chunk before any sync works (and reads zeros around).
    s.write(1, 2 * M + 7, b"again").unwrap();
    assert_eq!(read_vec(&s, 1, 2 * M, 12), b"\0\0\0\0\0\0\0again");

    // Shrink to mid-chunk, grow again: the old tail reads zeros.
    s.resize_component(1, M + 100).unwrap();
    assert_eq!(s.used(), M);
    s.resize_component(1, 4 * M).unwrap();
    assert_eq!(read_vec(&s, 1, M + 90, 20)[..10], data[90..100]);
    assert_eq!(read_vec(&s, 1, M + 100, 4096), vec![0u8; 4096]);
    assert!(s.read(1, 4 * M, &mut [0u8; 1]).is_err());

    s.delete_component(1).unwrap();
    assert_eq!(s.used(), 0);
    assert!(s.component(1).is_none());
    assert!(matches!(
        s.delete_component(1),
        Err(StoreError::NoSuchComponent(1))
    ));
    drop(s);
    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert_eq!(s.used(), 0);
    assert!(s.components().is_empty());
}

#[test]
fn no_space_changes_nothing_and_freeing_helps() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
    // Thin: a component far larger than the device is fine.
    s.create_component(1, 1, 1 << 40).unwrap();
    for i in 0..62u64 {
        s.write(1, i * M, &pattern(i, 100)).unwrap();
    }
    assert_eq!(s.used(), 62 * M);
    // A write needing two chunks when one is free fails whole.
    let e = s.write(1, 100 * M - 10, &[9u8; 20]).unwrap_err();
    assert!(matches!(e, StoreError::NoSpace), "{e}");
    assert_eq!(s.used(), 62 * M);
    assert_eq!(read_vec(&s, 1, 100 * M - 10, 20), vec![0u8; 20]);
    s.write(1, 200 * M, b"last").unwrap();
    assert!(matches!(
        s.write(1, 201 * M, b"x"),
        Err(StoreError::NoSpace)
    ));
    // Existing data is intact and still writable.
    s.write(1, 5 * M + 1, b"over").unwrap();
    for i in 0..62u64 {
        let want = pattern(i, 100);
        let got = read_vec(&s, 1, i * M, 100);
        if i == 5 {
            assert_eq!(got[1..5], *b"over");
        } else {
            assert_eq!(got, want, "chunk {i}");
        }
    }
    // Freeing makes room again (no explicit sync needed).
    s.trim(1, 3 * M, 2 * M).unwrap();
    s.write(1, 300 * M, b"a").unwrap();
    s.write(1, 301 * M, b"b").unwrap();
    assert!(matches!(
        s.write(1, 302 * M, b"c"),
        Err(StoreError::NoSpace)
    ));
    assert_eq!(read_vec(&s, 1, 300 * M, 2), b"a\0");
    assert_eq!(read_vec(&s, 1, 301 * M, 2), b"b\0");
}

#[test]
fn damaged_entries_are_freed_on_open() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
    s.create_component(1, 1, 8 * M).unwrap();
    s.create_component(2, 2, 8 * M).unwrap();
    s.write(1, 0, &[1u8; 10]).unwrap();
    s.write(1, M, &[2u8; 10]).unwrap();
    s.write(2, 0, &[3u8; 10]).unwrap();
    let sb = s.sb.clone();
    let slot2 = s.get(2).unwrap().slot;
    let chunk1 = *lock(&s.get(1).unwrap().chunks).get(&1).unwrap();
    s.sync().unwrap();
    drop(s);
    let f = OpenOptions::new().write(true).open(dev(&dir)).unwrap();
    f.write_all_at(&[0xEE], sb.slot_off(slot2) + 20).unwrap(); // component 2's slot
    f.write_all_at(&[0xEE], sb.entry_off(chunk1) + 9).unwrap(); // chunk 1 of component 1
    drop(f);
    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert!(s.component(2).is_none());
    assert_eq!(s.allocated_ranges(1), vec![(0, M)]);
    assert_eq!(s.used(), M);
    assert_eq!(read_vec(&s, 1, M, 10), vec![0u8; 10]);
    assert_eq!(read_vec(&s, 1, 0, 10), vec![1u8; 10]);
    // The freed slot and chunks are usable again.
    s.create_component(5, 5, M).unwrap();
    s.write(5, 0, b"new").unwrap();
    drop(s);
    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert_eq!(read_vec(&s, 5, 0, 3), b"new");
    assert_eq!(s.used(), 2 * M);
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
    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert_eq!(s.used(), used);
    for id in 1..=4u64 {
        assert!(
            read_vec(&s, id, 0, 16 * M as usize) == expect(id),
            "component {id}"
        );
    }
}

#[test]
fn table_full() {
    let dir = TempDir::new().unwrap();
    let s = new_store(&dir);
    for id in 1..=format::SLOTS as u64 {
        s.create_component(id, 1, 4096).unwrap();
    }
    assert!(matches!(
        s.create_component(5000, 1, 4096),
        Err(StoreError::TableFull)
    ));
    s.delete_component(17).unwrap();
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
    assert!(
        syncs >= 1 && syncs < commits,
        "{syncs} syncs for {commits} commits"
    );
    drop(gc);
    drop(s);
    let s = DeviceStore::open(&dev(&dir)).unwrap();
    assert_eq!(read_vec(&s, 1, 31 * M + 9 * 4096, 4096), vec![32u8; 4096]);
}

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
    Sync,
    Reopen,
}

const SIZES: [u64; 3] = [5 * M + 12345, 3 * M, 64 * 1024];

/// Offsets near chunk boundaries are the interesting ones.
fn arb_off() -> impl Strategy<Value = u64> {
    prop_oneof![
        0u64..6 * M,
        (0u64..6, -5000i64..5000).prop_map(|(k, d)| (k * M).saturating_add_signed(d)),
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
        1 => Just(Op::Sync),
        1 => Just(Op::Reopen),
    ]
}

/// Clips a random range into a component of `size` bytes.
fn clip(off: u64, len: u64, size: u64) -> (u64, u64) {
    if size == 0 {
        return (0, 0);
    }
    let off = off % size;
    (off, len.min(size - off))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn store_matches_a_model(ops in prop::collection::vec(arb_op(), 1..40)) {
        let dir = TempDir::new().unwrap();
        let mut s = new_store(&dir);
        let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
        for (i, size) in SIZES.iter().enumerate() {
            s.create_component(i as u64 + 1, 9, *size).unwrap();
            model.insert(i as u64 + 1, vec![0u8; *size as usize]);
        }
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
                Op::Sync => s.sync().unwrap(),
                Op::Reopen => {
                    s.sync().unwrap();
                    drop(s);
                    s = DeviceStore::open(&dev(&dir)).unwrap();
                }
            }
        }
        s.sync().unwrap();
        drop(s);
        let s = DeviceStore::open(&dev(&dir)).unwrap();
        let mut chunks = 0;
        for (id, m) in &model {
            let meta = s.component(*id).unwrap();
            prop_assert_eq!(meta.size, m.len() as u64);
            prop_assert!(read_vec(&s, *id, 0, m.len())[..] == m[..], "component {}", id);
            // Every non-zero byte lies in an allocated range.
            let ranges = s.allocated_ranges(*id);
            let inside = |p: usize| ranges.iter().any(|&(o, l)| (p as u64) >= o && (p as u64) < o + l);
            if let Some(p) = m.iter().position(|&b| b != 0) {
                prop_assert!(inside(p));
            }
            prop_assert!(m.iter().enumerate().all(|(p, &b)| b == 0 || inside(p)));
            chunks += meta.allocated / M;
        }
        prop_assert_eq!(s.used(), chunks * M);
    }
}
