//! # shoal-store: the component store of one device
//!
//! Stores the components (of many volumes) that live on one device: a file
//! (created sparse) or a block device. Owns the device's bytes and its
//! on-disk format (`docs/store-format.md`): a superblock, a fixed table of
//! component slots, a chunk map and 1 MiB data chunks allocated on first
//! write (thin). Knows nothing of the network, replication or the directory.
//!
//! The API is synchronous and thread-safe (`&self`, positional I/O); callers
//! on an async runtime run it on blocking threads. [`GroupCommit`] turns many
//! concurrent durability requests into few `fdatasync` calls.
//!
//! This is the first, simple version; a log-structured store with per-block
//! checksums will replace the internals behind the same small API: that is
//! [`LogStore`] (module [`log`], `docs/store-log-format.md`), built and
//! tested but not yet used by the node.

mod direct;
mod format;
mod group;
pub mod log;

pub use format::{CHUNK_SIZE, MIN_CAPACITY};
pub use group::{Durable, GroupCommit};
pub use log::{LogConfig, LogStats, LogStore};

use format::{decode_entry, encode_entry, Slot, Superblock, ENTRY_SIZE, SLOT_SIZE, SUPER_SIZE};
use shoal_model::human_size;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Errors of the component store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("device I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("no free space left on the device")]
    NoSpace,
    #[error("component {id}: range {offset}+{len} is outside its size {size}")]
    OutOfRange {
        id: u64,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("no component {0} on this device")]
    NoSuchComponent(u64),
    #[error("component table is full: no free slot for another component")]
    TableFull,
    #[error("stale generation {got}: the component is fenced at generation {have}")]
    StaleGeneration { have: u64, got: u64 },
    #[error("device {} is too small: {} given, Shoal needs at least {}", path.display(), human_size(*capacity), human_size(*min))]
    TooSmall {
        path: PathBuf,
        capacity: u64,
        min: u64,
    },
    #[error("device {} belongs to cluster {found:?}, not {expected:?}; wipe its first 4 KiB to reuse it", path.display())]
    ForeignCluster {
        path: PathBuf,
        found: String,
        expected: String,
    },
    #[error("component {id} exists for volume {have}, not volume {got}")]
    VolumeMismatch { id: u64, have: u64, got: u64 },
    #[error("component id 0 is reserved")]
    ReservedId,
    #[error("device is corrupt: {0}")]
    Corrupt(String),
    #[error("{0}")]
    BadFormat(String),
    /// A block's data does not match its checksum (or its header is
    /// damaged): the owner should read it from another copy.
    #[error("component {component}: checksum mismatch in the block at byte {offset}")]
    Checksum { component: u64, offset: u64 },
}

type Result<T, E = StoreError> = std::result::Result<T, E>;

/// What the store knows of one component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentMeta {
    pub id: u64,
    pub volume: u64,
    /// Logical size in bytes.
    pub size: u64,
    /// Highest owner generation seen (fence).
    pub generation: u64,
    /// Bytes of allocated chunks.
    pub allocated: u64,
}

struct Meta {
    size: u64,
    generation: u64,
}

struct Comp {
    id: u64,
    volume: u64,
    slot: u32,
    /// Held shared by reads and writes, exclusively by operations that free
    /// chunks or change the size. `true` once deleted.
    gate: RwLock<bool>,
    meta: Mutex<Meta>,
    /// Chunk index in the component -> chunk number on the device.
    chunks: Mutex<BTreeMap<u32, u32>>,
}

#[derive(Clone, Copy)]
struct Pending {
    chunk: u32,
    owner: u64,
    index: u32,
    clean: bool,
}

struct Alloc {
    /// Chunks that may be allocated, lowest first.
    free: BTreeSet<u32>,
    /// Per chunk: known to read as zeros on disk (durably).
    clean: Vec<bool>,
    /// Freed chunks that become allocatable after the next sync, so that
    /// their map entry and hole are durable before anyone reuses them.
    pending: Vec<Pending>,
    pending_keys: HashSet<(u64, u32)>,
    allocated: u64,
}

/// The component store of one device.
pub struct DeviceStore {
    file: File,
    /// Data-region I/O (O_DIRECT where possible).
    data: direct::DataFile,
    path: PathBuf,
    sb: Superblock,
    /// Regular file whose holes can be punched.
    punch: AtomicBool,
    comps: RwLock<HashMap<u64, Arc<Comp>>>,
    /// Slot -> component id (0 = free).
    slots: Mutex<Vec<u64>>,
    alloc: Mutex<Alloc>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

static ZEROS: [u8; CHUNK_SIZE as usize] = [0u8; CHUNK_SIZE as usize];

pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.finish()
}

/// Takes an exclusive advisory lock so two stores never share a device.
pub(crate) fn lock_file(file: &File, path: &Path) -> Result<()> {
    // SAFETY: flock on a valid, owned descriptor.
    let r = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return Err(StoreError::Io(io::Error::new(
            e.kind(),
            format!("device {} is in use by another store: {e}", path.display()),
        )));
    }
    Ok(())
}

/// Punches a hole (the range then reads as zeros). `Ok(false)` when the
/// file system cannot.
pub(crate) fn punch_hole(file: &File, off: u64, len: u64) -> io::Result<bool> {
    // SAFETY: fallocate on a valid descriptor with plain integer arguments.
    let r = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => Ok(false),
        _ => Err(e),
    }
}

fn write_zeros(file: &File, mut off: u64, mut len: u64) -> io::Result<()> {
    while len > 0 {
        let n = len.min(CHUNK_SIZE);
        file.write_all_at(&ZEROS[..n as usize], off)?;
        off += n;
        len -= n;
    }
    Ok(())
}

/// Size of the file or block device.
pub(crate) fn device_len(file: &mut File) -> io::Result<(u64, bool)> {
    let md = file.metadata()?;
    if md.file_type().is_block_device() {
        let n = file.seek(SeekFrom::End(0))?;
        Ok((n, true))
    } else {
        Ok((md.len(), false))
    }
}

/// Splits `[offset, offset+len)` into per-chunk pieces:
/// (chunk index, offset in chunk, length, offset in the request).
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u32, u64, u64, u64)> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let idx = pos / CHUNK_SIZE;
        let within = pos % CHUNK_SIZE;
        let n = (CHUNK_SIZE - within).min(end - pos);
        let r = (idx as u32, within, n, pos - offset);
        pos += n;
        Some(r)
    })
}

/// Largest component size (chunk indexes are u32).
pub(crate) const MAX_SIZE: u64 = (u32::MAX as u64) * CHUNK_SIZE;

impl DeviceStore {
    /// Formats `path` as a device of `capacity` bytes for `cluster_id`.
    /// A missing file is created sparse. A block device uses `capacity`
    /// bytes, or all of it if `capacity` is 0 or larger. If the device
    /// already holds a Shoal superblock of the same cluster it is opened
    /// as is (never reformatted); of another cluster it is refused.
    pub fn create(path: &Path, capacity: u64, cluster_id: &str) -> Result<DeviceStore> {
        if cluster_id.len() > format::MAX_CLUSTER_ID {
            return Err(StoreError::BadFormat(format!(
                "cluster id {cluster_id:?} is longer than {} bytes",
                format::MAX_CLUSTER_ID
            )));
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        lock_file(&file, path)?;
        let (len, block) = device_len(&mut file)?;
        let capacity = if block && (capacity == 0 || capacity > len) {
            len
        } else {
            capacity
        };
        if capacity < MIN_CAPACITY {
            return Err(StoreError::TooSmall {
                path: path.to_path_buf(),
                capacity,
                min: MIN_CAPACITY,
            });
        }
        if len >= SUPER_SIZE as u64 {
            let mut b = vec![0u8; SUPER_SIZE];
            file.read_exact_at(&mut b, 0)?;
            if Superblock::has_magic(&b) {
                let sb = Superblock::decode(&b)?;
                if sb.cluster_id != cluster_id {
                    return Err(StoreError::ForeignCluster {
                        path: path.to_path_buf(),
                        found: sb.cluster_id,
                        expected: cluster_id.to_string(),
                    });
                }
                tracing::info!(path = %path.display(), "device already formatted for this cluster; opening it");
                return Self::load(file, path, block);
            }
        }
        let sb = Superblock::new(capacity, random_u64(), cluster_id).ok_or_else(|| {
            StoreError::TooSmall {
                path: path.to_path_buf(),
                capacity,
                min: MIN_CAPACITY,
            }
        })?;
        if !block && len < capacity {
            file.set_len(capacity)?;
        }
        if len > 0 {
            // Old contents: clear the metadata, and the data if we can.
            let cleared =
                !block && punch_hole(&file, format::TABLE_OFF, capacity - format::TABLE_OFF)?;
            if !cleared {
                write_zeros(&file, format::TABLE_OFF, sb.data_off - format::TABLE_OFF)?;
            }
        }
        file.write_all_at(&sb.encode(), 0)?;
        file.sync_all()?;
        if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        tracing::info!(path = %path.display(), chunks = sb.chunks, cluster = cluster_id, "formatted device");
        Self::load(file, path, block)
    }

    /// Opens a formatted device: validates the superblock and loads the
    /// component table and chunk map (entries with a bad checksum or no
    /// live owner are logged and freed).
    pub fn open(path: &Path) -> Result<DeviceStore> {
        let mut file = OpenOptions::new().read(true).write(true).open(path)?;
        lock_file(&file, path)?;
        let (_, block) = device_len(&mut file)?;
        Self::load(file, path, block)
    }

    /// Opens the device if it is formatted (and belongs to `cluster_id`),
    /// formats it otherwise.
    pub fn open_or_create(path: &Path, capacity: u64, cluster_id: &str) -> Result<DeviceStore> {
        match Self::open(path) {
            Ok(s) if s.sb.cluster_id == cluster_id => Ok(s),
            Ok(s) => Err(StoreError::ForeignCluster {
                path: path.to_path_buf(),
                found: s.sb.cluster_id.clone(),
                expected: cluster_id.to_string(),
            }),
            Err(StoreError::BadFormat(_)) => Self::create(path, capacity, cluster_id),
            Err(StoreError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
                Self::create(path, capacity, cluster_id)
            }
            Err(StoreError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                Self::create(path, capacity, cluster_id)
            }
            Err(e) => Err(e),
        }
    }

    fn load(mut file: File, path: &Path, block: bool) -> Result<DeviceStore> {
        let (len, _) = device_len(&mut file)?;
        if len < SUPER_SIZE as u64 {
            return Err(StoreError::BadFormat(format!(
                "{} is not a Shoal device: shorter than a superblock",
                path.display()
            )));
        }
        let mut b = vec![0u8; SUPER_SIZE];
        file.read_exact_at(&mut b, 0)?;
        let sb = Superblock::decode(&b)?;
        if len < sb.data_off + sb.chunks * CHUNK_SIZE {
            return Err(StoreError::Corrupt(format!(
                "device is {len} bytes but its superblock needs {}",
                sb.data_off + sb.chunks * CHUNK_SIZE
            )));
        }
        // Component table.
        let mut table = vec![0u8; sb.slots as usize * SLOT_SIZE];
        file.read_exact_at(&mut table, sb.table_off)?;
        let mut slots = vec![0u64; sb.slots as usize];
        let mut metas: HashMap<u64, (u32, Slot)> = HashMap::new();
        for (i, raw) in table.chunks(SLOT_SIZE).enumerate() {
            match Slot::decode(raw) {
                Ok(None) => {}
                Ok(Some(s)) if metas.contains_key(&s.id) => {
                    tracing::warn!(slot = i, id = s.id, "duplicate component slot ignored");
                }
                Ok(Some(s)) if s.size > MAX_SIZE => {
                    tracing::warn!(
                        slot = i,
                        id = s.id,
                        size = s.size,
                        "component slot with impossible size ignored"
                    );
                }
                Ok(Some(s)) => {
                    slots[i] = s.id;
                    metas.insert(s.id, (i as u32, s));
                }
                Err(()) => {
                    tracing::warn!(slot = i, "component slot with bad checksum treated as free")
                }
            }
        }
        // Chunk map.
        let n = sb.chunks as u32;
        let mut owned: HashMap<u64, BTreeMap<u32, u32>> = HashMap::new();
        let mut free = BTreeSet::new();
        let mut orphans = Vec::new();
        let batch = 65536u32;
        let mut buf = vec![0u8; batch as usize * ENTRY_SIZE];
        let mut start = 0u32;
        while start < n {
            let cnt = batch.min(n - start);
            let bytes = &mut buf[..cnt as usize * ENTRY_SIZE];
            file.read_exact_at(bytes, sb.entry_off(start))?;
            for (k, raw) in bytes.chunks(ENTRY_SIZE).enumerate() {
                let chunk = start + k as u32;
                match decode_entry(raw) {
                    Ok(None) => {
                        free.insert(chunk);
                    }
                    Ok(Some((owner, index))) => {
                        let live = metas
                            .get(&owner)
                            .is_some_and(|(_, s)| (index as u64) * CHUNK_SIZE < s.size);
                        let map = owned.entry(owner).or_default();
                        if live && !map.contains_key(&index) {
                            map.insert(index, chunk);
                        } else {
                            tracing::warn!(chunk, owner, index, "orphan chunk freed");
                            orphans.push(chunk);
                        }
                    }
                    Err(()) => {
                        tracing::warn!(chunk, "chunk map entry with bad checksum freed");
                        orphans.push(chunk);
                    }
                }
            }
            start += cnt;
        }
        let mut dirty_meta = false;
        for &c in &orphans {
            file.write_all_at(&encode_entry(0, 0), sb.entry_off(c))?;
            free.insert(c);
            dirty_meta = true;
        }
        // Make every free chunk read as zeros, if the file system can.
        let mut clean = vec![false; n as usize];
        let mut punch = !block;
        if punch {
            let mut it = free.iter().copied().peekable();
            while let Some(first) = it.next() {
                let mut last = first;
                while it.peek() == Some(&(last + 1)) {
                    last += 1;
                    it.next();
                }
                let len = (last - first + 1) as u64 * CHUNK_SIZE;
                if !punch_hole(&file, sb.chunk_off(first), len)? {
                    punch = false;
                    break;
                }
                dirty_meta = true;
                for c in first..=last {
                    clean[c as usize] = true;
                }
            }
        }
        if dirty_meta {
            file.sync_data()?;
        }
        let allocated = n as u64 - free.len() as u64;
        let mut comps = HashMap::new();
        for (id, (slot, s)) in metas {
            comps.insert(
                id,
                Arc::new(Comp {
                    id,
                    volume: s.volume,
                    slot,
                    gate: RwLock::new(false),
                    meta: Mutex::new(Meta {
                        size: s.size,
                        generation: s.generation,
                    }),
                    chunks: Mutex::new(owned.remove(&id).unwrap_or_default()),
                }),
            );
        }
        let data = direct::DataFile::open(path, &file)?;
        Ok(DeviceStore {
            file,
            data,
            path: path.to_path_buf(),
            sb,
            punch: AtomicBool::new(punch),
            comps: RwLock::new(comps),
            slots: Mutex::new(slots),
            alloc: Mutex::new(Alloc {
                free,
                clean,
                pending: Vec::new(),
                pending_keys: HashSet::new(),
                allocated,
            }),
        })
    }

    /// The cluster this device belongs to.
    pub fn cluster_id(&self) -> String {
        self.sb.cluster_id.clone()
    }

    /// Random id given to the device when it was formatted.
    pub fn uuid(&self) -> u64 {
        self.sb.uuid
    }

    /// Bytes of data chunks.
    /// True when data goes around the page cache (`O_DIRECT`).
    pub fn direct_io(&self) -> bool {
        self.data.is_direct()
    }

    pub fn capacity(&self) -> u64 {
        self.sb.chunks * CHUNK_SIZE
    }

    /// Bytes of allocated data chunks.
    pub fn used(&self) -> u64 {
        lock(&self.alloc).allocated * CHUNK_SIZE
    }

    fn get(&self, id: u64) -> Result<Arc<Comp>> {
        read(&self.comps)
            .get(&id)
            .cloned()
            .ok_or(StoreError::NoSuchComponent(id))
    }

    fn write_slot(&self, c: &Comp, m: &Meta) -> Result<()> {
        let s = Slot {
            id: c.id,
            volume: c.volume,
            size: m.size,
            generation: m.generation,
            flags: 0,
        };
        self.file
            .write_all_at(&s.encode(), self.sb.slot_off(c.slot))?;
        Ok(())
    }

    /// Creates an empty (thin) component of `size` bytes. If it exists
    /// already (same volume), it is grown to `size` if smaller.
    pub fn create_component(&self, id: u64, volume: u64, size: u64) -> Result<()> {
        if id == 0 {
            return Err(StoreError::ReservedId);
        }
        if size > MAX_SIZE {
            return Err(StoreError::OutOfRange {
                id,
                offset: 0,
                len: size,
                size: MAX_SIZE,
            });
        }
        let mut comps = write(&self.comps);
        if let Some(c) = comps.get(&id).cloned() {
            drop(comps);
            if c.volume != volume {
                return Err(StoreError::VolumeMismatch {
                    id,
                    have: c.volume,
                    got: volume,
                });
            }
            let cur = lock(&c.meta).size;
            if size > cur {
                return self.resize_component(id, size);
            }
            return Ok(());
        }
        let mut slots = lock(&self.slots);
        let slot = slots
            .iter()
            .position(|&s| s == 0)
            .ok_or(StoreError::TableFull)? as u32;
        let c = Arc::new(Comp {
            id,
            volume,
            slot,
            gate: RwLock::new(false),
            meta: Mutex::new(Meta {
                size,
                generation: 0,
            }),
            chunks: Mutex::new(BTreeMap::new()),
        });
        self.write_slot(&c, &lock(&c.meta))?;
        slots[slot as usize] = id;
        comps.insert(id, c);
        drop(slots);
        drop(comps);
        self.sync()
    }

    /// Changes the logical size. Shrinking frees the chunks past the new
    /// end and zeroes the tail of the last one, so growing again reads zeros.
    pub fn resize_component(&self, id: u64, size: u64) -> Result<()> {
        if size > MAX_SIZE {
            return Err(StoreError::OutOfRange {
                id,
                offset: 0,
                len: size,
                size: MAX_SIZE,
            });
        }
        let c = self.get(id)?;
        let gate = write(&c.gate);
        if *gate {
            return Err(StoreError::NoSuchComponent(id));
        }
        let old = lock(&c.meta).size;
        if size < old {
            let tail = size % CHUNK_SIZE;
            if tail != 0 {
                let phys = lock(&c.chunks).get(&((size / CHUNK_SIZE) as u32)).copied();
                if let Some(p) = phys {
                    write_zeros(&self.file, self.sb.chunk_off(p) + tail, CHUNK_SIZE - tail)?;
                }
            }
        }
        {
            let mut m = lock(&c.meta);
            let prev = m.size;
            m.size = size;
            if let Err(e) = self.write_slot(&c, &m) {
                m.size = prev;
                return Err(e);
            }
        }
        if size < old {
            let first = size.div_ceil(CHUNK_SIZE) as u32;
            let doomed: Vec<(u32, u32)> = lock(&c.chunks)
                .range(first..)
                .map(|(&i, &p)| (i, p))
                .collect();
            for (i, p) in doomed {
                self.free_chunk(&c, i, p)?;
            }
        }
        drop(gate);
        self.sync()
    }

    /// Deletes a component: frees its chunks and its slot.
    pub fn delete_component(&self, id: u64) -> Result<()> {
        let c = self.get(id)?;
        let mut gate = write(&c.gate);
        if *gate {
            return Err(StoreError::NoSuchComponent(id));
        }
        let all: Vec<(u32, u32)> = lock(&c.chunks).iter().map(|(&i, &p)| (i, p)).collect();
        for (i, p) in all {
            self.free_chunk(&c, i, p)?;
        }
        {
            let mut slots = lock(&self.slots);
            self.file
                .write_all_at(&[0u8; SLOT_SIZE], self.sb.slot_off(c.slot))?;
            slots[c.slot as usize] = 0;
        }
        *gate = true;
        write(&self.comps).remove(&id);
        drop(gate);
        self.sync()
    }

    fn meta_of(&self, c: &Comp) -> ComponentMeta {
        let m = lock(&c.meta);
        ComponentMeta {
            id: c.id,
            volume: c.volume,
            size: m.size,
            generation: m.generation,
            allocated: lock(&c.chunks).len() as u64 * CHUNK_SIZE,
        }
    }

    /// All components, by id.
    pub fn components(&self) -> Vec<ComponentMeta> {
        let comps: Vec<Arc<Comp>> = read(&self.comps).values().cloned().collect();
        let mut v: Vec<ComponentMeta> = comps.iter().map(|c| self.meta_of(c)).collect();
        v.sort_by_key(|m| m.id);
        v
    }

    pub fn component(&self, id: u64) -> Option<ComponentMeta> {
        self.get(id).ok().map(|c| self.meta_of(&c))
    }

    /// Raises the component's fence to `generation` (durable on return).
    /// A generation below the stored one is refused.
    pub fn fence(&self, id: u64, generation: u64) -> Result<()> {
        let c = self.get(id)?;
        {
            let mut m = lock(&c.meta);
            if generation < m.generation {
                return Err(StoreError::StaleGeneration {
                    have: m.generation,
                    got: generation,
                });
            }
            if generation == m.generation {
                return Ok(());
            }
            let prev = m.generation;
            m.generation = generation;
            if let Err(e) = self.write_slot(&c, &m) {
                m.generation = prev;
                return Err(e);
            }
        }
        self.sync()
    }

    /// The component's fence generation.
    pub fn generation(&self, id: u64) -> Option<u64> {
        self.get(id).ok().map(|c| lock(&c.meta).generation)
    }

    fn check_range(id: u64, offset: u64, len: u64, size: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(StoreError::OutOfRange {
                id,
                offset,
                len,
                size,
            }),
        }
    }

    /// Moves pending frees to the free list after a sync. Called with the
    /// allocation lock held.
    fn promote(a: &mut Alloc, batch: Vec<Pending>) {
        for p in batch {
            a.pending_keys.remove(&(p.owner, p.index));
            a.clean[p.chunk as usize] = p.clean;
            a.free.insert(p.chunk);
        }
    }

    /// Allocates chunks for `indexes` of component `owner`, all or none,
    /// and writes their map entries. Returns (index, chunk, clean).
    fn allocate(&self, owner: u64, indexes: &[u32]) -> Result<Vec<(u32, u32, bool)>> {
        let mut a = lock(&self.alloc);
        let reused = indexes
            .iter()
            .any(|&i| a.pending_keys.contains(&(owner, i)));
        if !a.pending.is_empty() && (reused || a.free.len() < indexes.len()) {
            // Make pending frees durable (and their keys unambiguous) first.
            let batch = std::mem::take(&mut a.pending);
            if let Err(e) = self.file.sync_data() {
                a.pending = batch;
                return Err(e.into());
            }
            Self::promote(&mut a, batch);
        }
        if a.free.len() < indexes.len() {
            return Err(StoreError::NoSpace);
        }
        let mut out = Vec::with_capacity(indexes.len());
        for &i in indexes {
            let Some(c) = a.free.pop_first() else {
                break;
            };
            out.push((i, c, a.clean[c as usize]));
        }
        for (k, &(i, c, _)) in out.iter().enumerate() {
            if let Err(e) = self
                .file
                .write_all_at(&encode_entry(owner, i), self.sb.entry_off(c))
            {
                // Undo: clear what was written, give all chunks back.
                for &(_, c2, _) in &out[..k] {
                    let _ = self
                        .file
                        .write_all_at(&encode_entry(0, 0), self.sb.entry_off(c2));
                }
                for &(_, c2, _) in &out {
                    a.free.insert(c2);
                }
                return Err(e.into());
            }
        }
        a.allocated += out.len() as u64;
        Ok(out)
    }

    /// Returns a just-allocated chunk that never got published.
    fn unallocate(&self, chunk: u32) {
        let mut a = lock(&self.alloc);
        let _ = self
            .file
            .write_all_at(&encode_entry(0, 0), self.sb.entry_off(chunk));
        a.clean[chunk as usize] = false;
        a.free.insert(chunk);
        a.allocated -= 1;
    }

    /// Frees chunk `phys` (index `idx` of `c`): clears its map entry, then
    /// punches (or zeroes) its data. Caller holds `c.gate` exclusively.
    fn free_chunk(&self, c: &Comp, idx: u32, phys: u32) -> Result<()> {
        {
            let mut a = lock(&self.alloc);
            self.file
                .write_all_at(&encode_entry(0, 0), self.sb.entry_off(phys))?;
            a.allocated -= 1;
        }
        lock(&c.chunks).remove(&idx);
        let off = self.sb.chunk_off(phys);
        let mut clean = false;
        if self.punch.load(Ordering::Relaxed) {
            match punch_hole(&self.file, off, CHUNK_SIZE) {
                Ok(true) => clean = true,
                Ok(false) => self.punch.store(false, Ordering::Relaxed),
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "punching a freed chunk failed")
                }
            }
        }
        if !clean {
            match self.data.zero_at(off, CHUNK_SIZE) {
                Ok(()) => clean = true,
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), error = %e, "zeroing a freed chunk failed")
                }
            }
        }
        let mut a = lock(&self.alloc);
        a.pending.push(Pending {
            chunk: phys,
            owner: c.id,
            index: idx,
            clean,
        });
        a.pending_keys.insert((c.id, idx));
        Ok(())
    }

    /// Writes `data` at `offset` of component `id`, allocating chunks on
    /// first write. Durable after the next [`sync`](Self::sync).
    pub fn write(&self, id: u64, offset: u64, data: &[u8]) -> Result<()> {
        let c = self.get(id)?;
        let gate = read(&c.gate);
        if *gate {
            return Err(StoreError::NoSuchComponent(id));
        }
        let size = lock(&c.meta).size;
        Self::check_range(id, offset, data.len() as u64, size)?;
        let mut todo: Vec<(u64, &[u8])> = Vec::new();
        {
            let mut map = lock(&c.chunks);
            let missing: Vec<u32> = pieces(offset, data.len() as u64)
                .map(|p| p.0)
                .filter(|i| !map.contains_key(i))
                .collect();
            let fresh: HashMap<u32, (u32, bool)> = if missing.is_empty() {
                HashMap::new()
            } else {
                self.allocate(id, &missing)?
                    .into_iter()
                    .map(|(i, ch, clean)| (i, (ch, clean)))
                    .collect()
            };
            let mut failed: Option<io::Error> = None;
            for (idx, within, n, at) in pieces(offset, data.len() as u64) {
                let part = &data[at as usize..(at + n) as usize];
                if let Some(&(ch, clean)) = fresh.get(&idx) {
                    if failed.is_some() {
                        self.unallocate(ch);
                        continue;
                    }
                    if !clean && n != CHUNK_SIZE {
                        // Stale bytes on disk: write the whole chunk, zeros
                        // around the data, before publishing it.
                        let mut buf = vec![0u8; CHUNK_SIZE as usize];
                        buf[within as usize..(within + n) as usize].copy_from_slice(part);
                        if let Err(e) = self.data.write_at(&buf, self.sb.chunk_off(ch)) {
                            self.unallocate(ch);
                            failed = Some(e);
                            continue;
                        }
                        map.insert(idx, ch);
                        continue;
                    }
                    map.insert(idx, ch);
                    todo.push((self.sb.chunk_off(ch) + within, part));
                } else if let Some(&ch) = map.get(&idx) {
                    todo.push((self.sb.chunk_off(ch) + within, part));
                }
            }
            if let Some(e) = failed {
                return Err(e.into());
            }
        }
        for (off, part) in todo {
            self.data.write_at(part, off)?;
        }
        drop(gate);
        Ok(())
    }

    /// Reads `buf.len()` bytes at `offset`; unallocated chunks read as zeros.
    pub fn read(&self, id: u64, offset: u64, buf: &mut [u8]) -> Result<()> {
        let c = self.get(id)?;
        let gate = read(&c.gate);
        if *gate {
            return Err(StoreError::NoSuchComponent(id));
        }
        let size = lock(&c.meta).size;
        Self::check_range(id, offset, buf.len() as u64, size)?;
        for (idx, within, n, at) in pieces(offset, buf.len() as u64) {
            let phys = lock(&c.chunks).get(&idx).copied();
            let part = &mut buf[at as usize..(at + n) as usize];
            match phys {
                Some(ch) => self.data.read_at(part, self.sb.chunk_off(ch) + within)?,
                None => part.fill(0),
            }
        }
        drop(gate);
        Ok(())
    }

    /// Zeroes a range: whole chunks are freed, partial ones overwritten.
    pub fn write_zeroes(&self, id: u64, offset: u64, len: u64) -> Result<()> {
        let c = self.get(id)?;
        let gate = write(&c.gate);
        if *gate {
            return Err(StoreError::NoSuchComponent(id));
        }
        let size = lock(&c.meta).size;
        Self::check_range(id, offset, len, size)?;
        for (idx, within, n, _) in pieces(offset, len) {
            let Some(ch) = lock(&c.chunks).get(&idx).copied() else {
                continue;
            };
            let chunk_start = idx as u64 * CHUNK_SIZE;
            // Bytes past the size are always zero, so a piece reaching the
            // end of the component covers the chunk.
            let whole = within == 0 && (n == CHUNK_SIZE || chunk_start + n >= size);
            if whole {
                self.free_chunk(&c, idx, ch)?;
            } else {
                self.data.zero_at(self.sb.chunk_off(ch) + within, n)?;
            }
        }
        drop(gate);
        Ok(())
    }

    /// Discards a range; it then reads as zeros (same as `write_zeroes`).
    pub fn trim(&self, id: u64, offset: u64, len: u64) -> Result<()> {
        self.write_zeroes(id, offset, len)
    }

    /// `(offset, len)` of the allocated parts of a component, in order and
    /// coalesced, clipped to its size. Empty for an unknown component.
    pub fn allocated_ranges(&self, id: u64) -> Vec<(u64, u64)> {
        let Ok(c) = self.get(id) else {
            return Vec::new();
        };
        let size = lock(&c.meta).size;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for &idx in lock(&c.chunks).keys() {
            let start = idx as u64 * CHUNK_SIZE;
            if start >= size {
                continue;
            }
            let len = CHUNK_SIZE.min(size - start);
            match out.last_mut() {
                Some((o, l)) if *o + *l == start => *l += len,
                _ => out.push((start, len)),
            }
        }
        out
    }

    /// Makes every completed write and metadata change durable
    /// (`fdatasync`), then lets chunks freed before it be reused.
    pub fn sync(&self) -> Result<()> {
        let batch = std::mem::take(&mut lock(&self.alloc).pending);
        let r = self.file.sync_data();
        let mut a = lock(&self.alloc);
        match r {
            Ok(()) => {
                Self::promote(&mut a, batch);
                Ok(())
            }
            Err(e) => {
                a.pending.extend(batch);
                Err(e.into())
            }
        }
    }
}

impl std::fmt::Debug for DeviceStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceStore")
            .field("path", &self.path)
            .field("cluster_id", &self.sb.cluster_id)
            .field("chunks", &self.sb.chunks)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
