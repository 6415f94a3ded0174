//! # The log-structured component store (format version 4)
//!
//! One store per device, holding many components. Every change is a
//! sequential append to the log: a *batch* is one header block (what
//! follows: data blocks with their CRC-32C, trims, component changes)
//! and its data blocks, written with one write call. Writes land in the
//! open batch in memory; [`LogStore::sync`] (the group commit) writes it
//! and flushes the device. The index ((component, block) → device block)
//! lives in memory; checkpoints of it go to two alternating slots, and
//! opening replays the batches written after the newest checkpoint.
//! A cleaner moves the live blocks of mostly-dead segments so they can be
//! reused. Per component the store also keeps two sets of 1 MiB regions
//! for the cluster, logged and checkpointed like the rest: *marked* regions
//! (writes may be in flight, [`LogStore::mark_regions`]) and *tracked* ones
//! (written while another copy was out of service, `track.rs`). Layout,
//! invariants and crash handling: `docs/store-log-format.md`.
//!
//! A block whose data and checksum disagree is never returned: reads fail
//! with [`StoreError::Checksum`], so the caller repairs it from a copy.

mod batch;
mod checkpoint;
mod cleaner;
pub mod device;
pub mod format;
mod gate;
pub mod index;
mod prepare;
mod replay;
mod scrub;
mod segment;
#[cfg(test)]
mod tests;
mod track;
pub mod uring;

pub use device::{BlockDevice, FaultyDevice, FileDevice, SimRng};
pub use track::Tracked;
pub use uring::{open_file_device, UringDevice};

use crate::direct::AlignedBuf;
use crate::{lock_file, random_u64, ComponentMeta, StoreError, MAX_SIZE, MIN_CAPACITY};
use batch::{data_refs, DataRef, HeaderCache, OpenBatch};
use format::{
    dense_per_segment, BatchHeader, Entry, LogSuper, BLOCK, BLOCK_U64, MAX_CLUSTER_ID, MAX_ENTRIES,
};
use index::BlockIndex;
use segment::{SegState, Segments};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Data refs (24 B each) the header cache holds: 2^20, about 24 MiB, the
/// checksums of 4 GiB of data. A read of a block whose header is not
/// cached reads the header too (in the same submission).
const HEADER_CACHE_REFS: usize = 1 << 20;

/// Most device blocks in one read request.
const MAX_RUN: usize = 256;

/// Format parameters of a new log device.
#[derive(Debug, Clone)]
pub struct LogConfig {
    /// Blocks per segment; 0 chooses by size (64 to 1024, i.e. 256 KiB to
    /// 4 MiB, aiming at ≥ 256 segments).
    pub seg_blocks: u32,
    /// Most components the device holds ([`StoreError::TableFull`] past it).
    pub max_components: u32,
    /// Live data may fill this share (‰) of the segments outside the
    /// cleaner's reserve: the rest bounds the cleaner's write amplification.
    pub fill_permille: u32,
    /// Devices smaller than this are refused.
    pub min_capacity: u64,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            seg_blocks: 0,
            max_components: crate::format::SLOTS,
            fill_permille: 900,
            min_capacity: MIN_CAPACITY,
        }
    }
}

impl LogConfig {
    fn seg_blocks_for(&self, bytes: u64) -> u32 {
        if self.seg_blocks != 0 {
            return self.seg_blocks;
        }
        let per = (bytes / BLOCK_U64 / 256).max(1);
        let p = 1u64 << (63 - per.leading_zeros());
        p.clamp(64, 1024) as u32
    }
}

/// Counters of the log (since open).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Bytes passed to `write`.
    pub client_bytes: u64,
    /// Data blocks written to the device (clients and cleaner).
    pub data_blocks: u64,
    /// Data blocks the cleaner moved.
    pub cleaner_blocks: u64,
    pub header_blocks: u64,
    pub checkpoint_blocks: u64,
    pub batches: u64,
    pub checkpoints: u64,
    /// Segments the cleaner emptied (background and inline).
    pub cleaned_segments: u64,
    /// Of those, segments the background cleaner emptied (the rest were
    /// cleaned inline, by a writer that found too few free segments).
    pub cleaned_segments_background: u64,
    /// Times a client write waited for a step of the background cleaner
    /// (free segments within one step of inline cleaning).
    pub cleaner_waits: u64,
    /// Microseconds spent relocating victims, under the state lock (client
    /// writes wait meanwhile).
    pub relocate_micros: u64,
    /// Microseconds spent writing checkpoints, under the state lock.
    pub checkpoint_micros: u64,
    pub flushes: u64,
    /// Data blocks read from the device (not from memory) by client reads.
    pub read_blocks: u64,
    /// Batch headers those reads had to read too (not in the header
    /// cache): a miss costs a second device read.
    pub header_misses: u64,
    /// Batches and log blocks (headers and data) replayed by the open.
    pub replayed_batches: u64,
    pub replayed_blocks: u64,
    /// Segments written with zeros ahead of the log (unallocated space of
    /// a sparse device file made allocated; `prepare.rs`).
    pub prepared_segments: u64,
}

impl LogStats {
    /// Device bytes written per client byte (data, headers, cleaner,
    /// checkpoints).
    pub fn write_amplification(&self) -> f64 {
        if self.client_bytes == 0 {
            return 0.0;
        }
        let dev = self.data_blocks + self.header_blocks + self.checkpoint_blocks;
        dev as f64 * BLOCK as f64 / self.client_bytes as f64
    }

    /// Data blocks written per data block clients wrote (the cleaner's
    /// share alone).
    pub fn cleaner_amplification(&self) -> f64 {
        let client = self.data_blocks.saturating_sub(self.cleaner_blocks);
        if client == 0 {
            return 1.0;
        }
        self.data_blocks as f64 / client as f64
    }
}

/// A block [`LogStore::read_batch`] reads from the device.
struct ToRead {
    /// The request it belongs to.
    r: usize,
    /// Component and block.
    id: u64,
    block: u64,
    /// The part of the block the request wants: byte offset in the block,
    /// length, and offset in the request's buffer.
    within: usize,
    len: usize,
    at: usize,
    /// Device block, and the header block that describes it.
    d: u32,
    h: Option<u32>,
    /// The header's entry for this block, copied at planning time when the
    /// header was cached (`Some(None)`: no such entry); `None` while the
    /// header is read with the data.
    entry: Option<Option<DataRef>>,
}

/// One read of [`LogStore::read_batch`]: `buf.len()` bytes of component
/// `id` at `offset`.
pub struct ReadReq<'a> {
    pub id: u64,
    pub offset: u64,
    pub buf: &'a mut [u8],
}

/// Where a plan puts what it finds without the device: the callers'
/// buffers ([`ReadReq`]) or one answer the store allocates when a block
/// first needs it ([`ReadAnswer`]).
trait ReadTargets {
    fn count(&self) -> usize;
    /// (component, offset, length) of request `r`.
    fn req(&self, r: usize) -> (u64, u64, usize);
    /// Bytes `at..at + n` of request `r`'s answer.
    fn out(&mut self, r: usize, at: usize, n: usize) -> &mut [u8];
}

impl ReadTargets for [ReadReq<'_>] {
    fn count(&self) -> usize {
        self.len()
    }
    fn req(&self, r: usize) -> (u64, u64, usize) {
        (self[r].id, self[r].offset, self[r].buf.len())
    }
    fn out(&mut self, r: usize, at: usize, n: usize) -> &mut [u8] {
        &mut self[r].buf[at..at + n]
    }
}

/// The answer of one read planned by [`LogStore::plan_read`]. Its buffer
/// is allocated only when some block does not come from the device (an
/// unwritten block, one still in memory); a read served wholly by the
/// device answers with the plan's own device buffer, without a copy.
pub struct ReadAnswer {
    id: u64,
    offset: u64,
    len: usize,
    buf: Option<Vec<u8>>,
}

impl ReadTargets for ReadAnswer {
    fn count(&self) -> usize {
        1
    }
    fn req(&self, _: usize) -> (u64, u64, usize) {
        (self.id, self.offset, self.len)
    }
    fn out(&mut self, _: usize, at: usize, n: usize) -> &mut [u8] {
        let len = self.len;
        &mut self.buf.get_or_insert_with(|| vec![0; len])[at..at + n]
    }
}

/// Reads located by [`LogStore::plan_reads`] whose device part is still to
/// be done; finished by [`LogStore::finish_reads`]. Its buffer does not
/// move when the plan does, so a ring may read into it while the plan
/// travels. Holding it keeps the located blocks from being reused.
pub struct ReadPlan {
    res: Vec<Result<()>>,
    todo: Vec<ToRead>,
    /// Headers not cached, read with the data (after it in `io`), sorted.
    hs: Vec<u32>,
    io: Option<crate::direct::AlignedBuf>,
    /// Device reads: (device byte offset, offset in `io`, length).
    runs: Vec<(u64, usize, usize)>,
    _pass: Option<gate::GatePass>,
}

impl ReadPlan {
    /// How many device reads remain (0: the plan is complete as it is).
    pub fn device_reads(&self) -> usize {
        self.runs.len()
    }

    /// The device reads as (device byte offset, buffer) pairs.
    pub fn parts(&mut self) -> Vec<(u64, &mut [u8])> {
        let Some(io) = self.io.as_mut() else {
            return Vec::new();
        };
        let mut rest = io.as_mut_slice();
        let mut at = 0;
        let mut out = Vec::with_capacity(self.runs.len());
        for &(off, start, len) in &self.runs {
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - at);
            let (part, tail) = tail.split_at_mut(len);
            out.push((off, part));
            rest = tail;
            at = start + len;
        }
        out
    }

    /// The device reads as raw (device byte offset, address, length), for
    /// a ring. The addresses stay valid while the plan lives, wherever it
    /// is moved; the caller must not drop the plan, nor use [`parts`]
    /// (Self::parts), while the kernel may still write to them.
    pub fn raw_parts(&mut self) -> Vec<(u64, *mut u8, usize)> {
        let Some(io) = self.io.as_mut() else {
            return Vec::new();
        };
        let base = io.as_mut_slice();
        self.runs
            .iter()
            .map(|&(off, start, len)| (off, base[start..start + len].as_mut_ptr(), len))
            .collect()
    }
}

/// Derived constants of a device's geometry.
#[derive(Debug, Clone)]
struct Geo {
    seg_blocks: u32,
    nsegs: u32,
    /// Data blocks per segment at worst in space estimates.
    usable: u64,
    /// Data blocks of a segment written in full batches.
    dense: u64,
    clean_low: usize,
    clean_high: usize,
    /// Background cleaner (in segments; see `Geo::new`): woken when fewer
    /// than `bg_high` are free, it cleans one segment per step until free
    /// and emptied segments reach `bg_high`. A client write waits for its
    /// steps while fewer than `bg_throttle` are free (back-pressure before
    /// inline cleaning), and it checkpoints then.
    bg_high: usize,
    bg_throttle: usize,
    /// Most live blocks (the capacity).
    max_live: u64,
    /// Most data blocks one step of an operation appends.
    piece: u64,
    /// Log blocks between checkpoints, at least.
    ckpt_min: u64,
}

impl Geo {
    fn new(sb: &LogSuper) -> Geo {
        let seg = sb.seg_blocks as u64;
        let usable = (seg - 2 - seg.div_ceil(MAX_ENTRIES as u64)).max(1);
        let clean_low = (sb.nsegs as usize / 64).max(4);
        let piece = usable.min(256);
        let mut g = Geo {
            seg_blocks: sb.seg_blocks,
            nsegs: sb.nsegs,
            usable,
            dense: dense_per_segment(sb.seg_blocks),
            clean_low,
            clean_high: clean_low + (sb.nsegs as usize / 64).max(2),
            bg_high: 0,
            bg_throttle: 0,
            max_live: 0,
            piece,
            ckpt_min: (16384u64).min(sb.nsegs as u64 * seg / 4),
        };
        let step = g.rotations(piece, 0);
        let reserve = (clean_low + 2 + step) as u64;
        // Writers clean inline when fewer than `clean_low + rotations(n)`
        // segments are free (`small` for a one-block write). Writers wait
        // for the background cleaner below `small + 1`, and it checkpoints
        // there (emptied segments become free only then). It cleans until
        // free plus emptied segments reach the inline cleaner's goal plus
        // one, so it holds about one segment more than inline cleaning
        // would: every segment held free raises the utilisation of the
        // others, hence the write amplification (holding 5 more on a
        // 64-segment device cost +37% at 95% fill).
        g.bg_throttle = clean_low + g.rotations(1, 0);
        g.bg_high = g.clean_high.max(g.bg_throttle) + 1;
        g.max_live =
            (sb.nsegs as u64).saturating_sub(reserve) * g.dense * sb.fill_permille as u64 / 1000;
        g
    }

    /// Segments the log may move into while appending `data` blocks and
    /// `slots` other entries (an upper bound).
    fn rotations(&self, data: u64, slots: u64) -> usize {
        ((data + slots.div_ceil(MAX_ENTRIES as u64) + 1).div_ceil(self.usable) + 1) as usize
    }
}

/// What the store keeps of one component.
struct Comp {
    volume: u64,
    size: u64,
    generation: u64,
    index: BlockIndex,
    /// Regions marked by the cluster (see [`LogStore::mark_regions`]).
    marks: BTreeSet<u32>,
    /// Regions tracked for delta resync (see [`LogStore::track_regions`]).
    tracked: track::TrackSet,
}

impl Comp {
    fn blocks(&self) -> u64 {
        self.size.div_ceil(BLOCK_U64)
    }
}

/// Everything behind the store's lock.
struct State {
    comps: BTreeMap<u64, Comp>,
    segs: Segments,
    batch: OpenBatch,
    /// The head segment's successor.
    next_seg: u32,
    /// Seq of the open batch.
    seq: u64,
    epoch: u64,
    /// Seq of the newest durable checkpoint, and its slot.
    ckpt_seq: u64,
    active_slot: usize,
    /// Mapped blocks of all components.
    live: u64,
    /// Log blocks written since the last checkpoint.
    log_since_ckpt: u64,
    last_ckpt_blocks: u64,
    ckpt_due: bool,
    /// A checkpoint whose device writes are under way, outside the lock.
    ckpt_io: Option<checkpoint::CkptInFlight>,
    stats: LogStats,
    /// Blocks promised to reserved components (by the cluster; not
    /// persisted: the node sets them again after every open). A write may
    /// not take the blocks the *other* components still lack.
    reserved: HashMap<u64, u64>,
    /// The segment the background cleaner is reading outside the state
    /// lock. A checkpoint that frees it (every block of it was moved or
    /// overwritten meanwhile) clears this, and the cleaner then drops what
    /// it read: the segment may have been reused, and moving blocks from
    /// the old copy would bring stale data back.
    cleaning: Option<u32>,
}

/// Who wants space: clients keep the cleaner's reserve.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    Client,
    Freeing,
}

/// A sealed batch: its place and seq are taken, its bytes are written
/// outside the state lock by whoever claims it.
struct Sealed {
    seq: u64,
    /// Device block of its header, and blocks (header + data).
    base: u32,
    blocks: u32,
    buf: Arc<AlignedBuf>,
    claimed: bool,
    done: bool,
}

/// Sealed batches not yet known written, in seq order, and spare batch
/// buffers.
#[derive(Default)]
struct Flight {
    batches: VecDeque<Sealed>,
    spare: Vec<AlignedBuf>,
    /// Threads waiting on `landed`: only then is it signalled (a
    /// `notify_all` is a system call even with nobody waiting, and every
    /// group commit would pay it).
    waiting: usize,
}

impl Flight {
    /// The buffer and block index of device block `d` if it belongs to a
    /// batch still in flight (its bytes may not be on the device yet).
    fn find(&self, d: u32) -> Option<(&AlignedBuf, usize)> {
        self.batches
            .iter()
            .find(|b| !b.done && d > b.base && d < b.base + b.blocks)
            .map(|b| (&*b.buf, (d - b.base) as usize))
    }
}

/// Spare batch buffers kept.
const SPARE_BUFS: usize = 16;

/// The log-structured component store of one device.
pub struct LogStore {
    dev: Arc<dyn BlockDevice>,
    sb: LogSuper,
    geo: Geo,
    state: Mutex<State>,
    /// Passed by reads between the index lookup and the device read;
    /// cleared while segments are made reusable.
    reuse: Arc<gate::ReuseGate>,
    flush_lock: Mutex<()>,
    /// Outcome of the checkpoint writes in flight (`State::ckpt_io`), set
    /// by their writer; `ckpt_landed` signals it.
    ckpt_done: Mutex<checkpoint::CkptDone>,
    ckpt_landed: Condvar,
    /// Tests: how long the background cleaner waits between reading its
    /// victim and moving its blocks, in microseconds (0: not at all).
    #[cfg(test)]
    cleaner_pause_us: AtomicU64,
    /// Tests: every checkpoint is encoded and streamed under the lock (as
    /// for bodies too large to copy).
    #[cfg(test)]
    stream_checkpoints: std::sync::atomic::AtomicBool,
    /// Highest batch seq written, and flushed.
    written: AtomicU64,
    flushed: AtomicU64,
    flushes: AtomicU64,
    /// [`LogStats::read_blocks`] and [`LogStats::header_misses`].
    read_blocks: AtomicU64,
    header_misses: AtomicU64,
    /// Set after a failed device write or flush: the store refuses
    /// everything until reopened.
    failed: Mutex<Option<String>>,
    cache: Mutex<HeaderCache>,
    /// Log blocks between checkpoints, at least (0: the geometry's).
    ckpt_every: AtomicU64,
    /// Sealed batches being written outside the state lock (lock order:
    /// state, then flight); `landed` is signalled when one completes.
    flight: Mutex<Flight>,
    landed: Condvar,
    /// The background cleaner's flags (lock order: state, then this).
    bg: Arc<cleaner::Bg>,
    /// Preparation of unallocated space ahead of the log, done by the
    /// background thread (lock order: state, then its lock).
    prep: prepare::Prep,
    bg_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Free segments as of the last rotation or checkpoint (read without
    /// the state lock by writers deciding whether to wait for the cleaner).
    free_hint: std::sync::atomic::AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn byte_off(block: u32) -> u64 {
    block as u64 * BLOCK_U64
}

/// Blocks the reserved components (but `except`) still lack.
fn lacking_locked(st: &State, except: Option<u64>) -> u64 {
    st.reserved
        .iter()
        .filter(|(&c, _)| Some(c) != except)
        .map(|(c, &r)| {
            let have = st.comps.get(c).map(|x| x.index.mapped()).unwrap_or(0);
            r.saturating_sub(have)
        })
        .fold(0u64, u64::saturating_add)
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

/// The blocks a component range touches: (block, byte offset in the
/// block, length, offset in the caller's buffer).
fn blocks_of(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize, usize)> {
    let end = offset + len;
    let mut pos = offset;
    std::iter::from_fn(move || {
        if pos >= end {
            return None;
        }
        let b = pos / BLOCK_U64;
        let within = (pos % BLOCK_U64) as usize;
        let n = (BLOCK - within).min((end - pos) as usize);
        let r = (b, within, n, (pos - offset) as usize);
        pos += n as u64;
        Some(r)
    })
}

impl LogStore {
    // ---------------------------------------------------------------
    // Opening and formatting
    // ---------------------------------------------------------------

    /// Formats `path` as a log device of `capacity` bytes for `cluster_id`
    /// (an existing device of the same cluster is opened, never wiped; of
    /// another cluster, or damaged, or of another format version, it is
    /// refused).
    pub fn create(path: &Path, capacity: u64, cluster_id: &str) -> Result<LogStore> {
        Self::create_with(path, capacity, cluster_id, &LogConfig::default())
    }

    pub fn create_with(
        path: &Path,
        capacity: u64,
        cluster_id: &str,
        cfg: &LogConfig,
    ) -> Result<LogStore> {
        if cluster_id.len() > MAX_CLUSTER_ID {
            return Err(StoreError::BadFormat(format!(
                "cluster id {cluster_id:?} is longer than {MAX_CLUSTER_ID} bytes"
            )));
        }
        let mut file = crate::open_device_file(path, true)?;
        lock_file(&file, path)?;
        let (len, block) = crate::device_len(&mut file)?;
        let capacity = if block && (capacity == 0 || capacity > len) {
            len
        } else {
            capacity
        };
        if capacity < cfg.min_capacity {
            return Err(StoreError::TooSmall {
                path: path.to_path_buf(),
                capacity,
                min: cfg.min_capacity,
            });
        }
        if len >= BLOCK_U64 {
            let mut b = vec![
                0u8;
                if len >= 2 * BLOCK_U64 {
                    2 * BLOCK
                } else {
                    BLOCK
                }
            ];
            use std::os::unix::fs::FileExt;
            file.read_exact_at(&mut b, 0)?;
            let copy1 = b.len() >= 2 * BLOCK && LogSuper::has_magic(&b[BLOCK..]);
            if LogSuper::has_magic(&b) || copy1 {
                let sb = Self::decode_super(&b)?;
                if sb.cluster_id != cluster_id {
                    return Err(StoreError::ForeignCluster {
                        path: path.to_path_buf(),
                        found: sb.cluster_id,
                        expected: cluster_id.to_string(),
                    });
                }
                tracing::info!(path = %path.display(), "device already formatted for this cluster; opening it");
                let dev = uring::open_file_device(file, path, len, block)?;
                return Self::open_device(dev);
            }
        }
        if !block && len < capacity {
            file.set_len(capacity)?;
        }
        if len > 0 && !block && !crate::fully_allocated(&file) {
            // Old contents are ignored (new uuid), but give the space back
            // (a thick file stays thick).
            let _ = crate::punch_hole(&file, 0, capacity);
        }
        let dev = uring::open_file_device(file, path, capacity, block)?;
        let s = Self::format_device(dev, cluster_id, cfg)?;
        if let Some(dir) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(s)
    }

    /// Opens a formatted log device: validates the superblock, loads the
    /// newest checkpoint and replays the log after it.
    pub fn open(path: &Path) -> Result<LogStore> {
        let mut file = crate::open_device_file(path, false)?;
        lock_file(&file, path)?;
        let (len, block) = crate::device_len(&mut file)?;
        let dev = uring::open_file_device(file, path, len, block)?;
        Self::open_device(dev)
    }

    /// The cluster a formatted device belongs to, from its superblock alone
    /// (no lock taken, no log replayed, nothing written); None when it does
    /// not start with a superblock.
    pub fn cluster_of(path: &Path) -> Result<Option<String>> {
        Ok(Self::identify(path)?.map(|(cluster, _)| cluster))
    }

    /// The cluster and the store uuid of a formatted device, from its
    /// superblock alone (no lock taken, no log replayed, nothing
    /// written); None when it has no superblock. A device whose copy 0
    /// lost its magic (a label written over its first sector, a format
    /// cut short before its last write) is known by copy 1, as `open`
    /// knows it.
    pub fn identify(path: &Path) -> Result<Option<(String, u64)>> {
        use std::os::unix::fs::FileExt;
        let file = File::open(path)?;
        let mut b = vec![0u8; 2 * BLOCK];
        let n = file.read_at(&mut b, 0)?;
        if n < BLOCK {
            return Ok(None);
        }
        let copy1 = n >= 2 * BLOCK && LogSuper::has_magic(&b[BLOCK..]);
        if !LogSuper::has_magic(&b[..BLOCK]) && !copy1 {
            return Ok(None);
        }
        let len = if n >= 2 * BLOCK { 2 * BLOCK } else { BLOCK };
        let sb = Self::decode_super(&b[..len])?;
        Ok(Some((sb.cluster_id, sb.uuid)))
    }

    /// Opens the device if it is formatted (and belongs to `cluster_id`),
    /// formats it otherwise.
    pub fn open_or_create(path: &Path, capacity: u64, cluster_id: &str) -> Result<LogStore> {
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

    /// Superblock from blocks 0 and 1: copy 0 unless it is damaged.
    fn decode_super(b: &[u8]) -> Result<LogSuper> {
        match LogSuper::decode(&b[..BLOCK]) {
            Ok(sb) => Ok(sb),
            Err(StoreError::Corrupt(m)) if b.len() < 2 * BLOCK => Err(StoreError::Corrupt(m)),
            // Copy 0 without its magic (a label written over the first
            // sector, a format cut short before its last write) while
            // copy 1 has it: copy 1 tells, never a reformat.
            Err(StoreError::BadFormat(m))
                if b.len() >= 2 * BLOCK && LogSuper::has_magic(&b[BLOCK..]) =>
            {
                let sb = LogSuper::decode(&b[BLOCK..2 * BLOCK])?;
                tracing::warn!("superblock copy 0 is missing ({m}); using copy 1");
                Ok(sb)
            }
            Err(StoreError::Corrupt(m)) => match LogSuper::decode(&b[BLOCK..2 * BLOCK]) {
                Ok(sb) => {
                    tracing::warn!("superblock copy 0 is damaged ({m}); using copy 1");
                    Ok(sb)
                }
                Err(_) => Err(StoreError::Corrupt(m)),
            },
            Err(e) => Err(e),
        }
    }

    /// Formats `dev` (its whole length) as an empty log device.
    pub fn format_device(
        dev: Arc<dyn BlockDevice>,
        cluster_id: &str,
        cfg: &LogConfig,
    ) -> Result<LogStore> {
        let size = dev.len();
        let too_small = || StoreError::TooSmall {
            path: dev.name().to_path_buf(),
            capacity: size,
            min: cfg.min_capacity,
        };
        if size < cfg.min_capacity {
            return Err(too_small());
        }
        let sb = LogSuper::new(
            size,
            random_u64(),
            cluster_id,
            cfg.seg_blocks_for(size),
            cfg.max_components,
            cfg.fill_permille,
        )
        .ok_or_else(too_small)?;
        let mut segs = Segments::new(sb.nsegs, sb.seg_blocks, sb.seg_off as u32);
        let head = segs.pop_free().expect("segments");
        segs.set_state(head, SegState::Head);
        let next = segs.pop_free().expect("segments");
        let batch = OpenBatch::new(head, 0, segs.block(head, 0), sb.seg_blocks);
        let st = State {
            comps: BTreeMap::new(),
            segs,
            batch,
            next_seg: next,
            seq: 1,
            epoch: 1,
            ckpt_seq: 0,
            active_slot: 1,
            live: 0,
            log_since_ckpt: 0,
            last_ckpt_blocks: 0,
            ckpt_due: false,
            ckpt_io: None,
            stats: LogStats::default(),
            reserved: HashMap::new(),
            cleaning: None,
        };
        let s = Self::assemble(dev, sb, st, 0);
        {
            let mut st = s.lock_state();
            s.checkpoint_locked(&mut st)?;
        }
        let io = |e| s.poison(e);
        s.dev.write_at(&s.sb.encode(1), BLOCK_U64).map_err(io)?;
        s.dev.flush().map_err(io)?;
        s.dev.write_at(&s.sb.encode(0), 0).map_err(io)?;
        s.dev.flush().map_err(io)?;
        tracing::info!(
            device = %s.dev.name().display(),
            segments = s.sb.nsegs,
            segment_kib = s.sb.seg_blocks * 4,
            capacity = s.geo.max_live * BLOCK_U64,
            cluster = cluster_id,
            "formatted log device"
        );
        Ok(s)
    }

    /// Opens a formatted log device.
    pub fn open_device(dev: Arc<dyn BlockDevice>) -> Result<LogStore> {
        if dev.len() < 2 * BLOCK_U64 {
            return Err(StoreError::BadFormat(format!(
                "{} is not a Shoal device: shorter than a superblock",
                dev.name().display()
            )));
        }
        let mut b = vec![0u8; 2 * BLOCK];
        dev.read_at(&mut b, 0)?;
        if !LogSuper::has_magic(&b) && !LogSuper::has_magic(&b[BLOCK..]) {
            return Err(StoreError::BadFormat(format!(
                "{} is not a Shoal device: no SHOALDEV superblock at offset 0",
                dev.name().display()
            )));
        }
        let sb = Self::decode_super(&b)?;
        if sb.device_size > dev.len() {
            return Err(StoreError::Corrupt(format!(
                "device is {} bytes but its superblock needs {}",
                dev.len(),
                sb.device_size
            )));
        }
        if LogSuper::decode(&b[..BLOCK]).is_err() {
            // Repair copy 0 from copy 1.
            dev.write_at(&sb.encode(0), 0)?;
            dev.flush()?;
        }
        let (st, flushed) = replay::recover(&*dev, &sb)?;
        let s = Self::assemble(dev, sb, st, flushed);
        {
            let mut st = s.lock_state();
            st.epoch += 1;
            s.checkpoint_locked(&mut st)?;
        }
        Ok(s)
    }

    fn assemble(dev: Arc<dyn BlockDevice>, sb: LogSuper, st: State, flushed: u64) -> LogStore {
        let nsegs = sb.nsegs;
        LogStore {
            geo: Geo::new(&sb),
            dev,
            sb,
            state: Mutex::new(st),
            reuse: Arc::new(gate::ReuseGate::new(nsegs)),
            flush_lock: Mutex::new(()),
            ckpt_done: Mutex::default(),
            ckpt_landed: Condvar::new(),
            #[cfg(test)]
            cleaner_pause_us: AtomicU64::new(0),
            #[cfg(test)]
            stream_checkpoints: std::sync::atomic::AtomicBool::new(false),
            written: AtomicU64::new(flushed),
            flushed: AtomicU64::new(flushed),
            flushes: AtomicU64::new(0),
            read_blocks: AtomicU64::new(0),
            header_misses: AtomicU64::new(0),
            failed: Mutex::new(None),
            cache: Mutex::new(HeaderCache::new(HEADER_CACHE_REFS)),
            ckpt_every: AtomicU64::new(0),
            flight: Mutex::new(Flight::default()),
            landed: Condvar::new(),
            bg: Arc::new(cleaner::Bg::default()),
            prep: prepare::Prep::default(),
            bg_thread: Mutex::new(None),
            free_hint: std::sync::atomic::AtomicUsize::new(usize::MAX),
        }
    }

    // ---------------------------------------------------------------
    // Small accessors
    // ---------------------------------------------------------------

    /// The cluster this device belongs to.
    pub fn cluster_id(&self) -> String {
        self.sb.cluster_id.clone()
    }

    /// Random id given to the device when it was formatted.
    pub fn uuid(&self) -> u64 {
        self.sb.uuid
    }

    /// True when data goes around the page cache (`O_DIRECT`).
    pub fn direct_io(&self) -> bool {
        self.dev.is_direct()
    }

    /// Bytes of live data the device may hold.
    pub fn capacity(&self) -> u64 {
        self.geo.max_live * BLOCK_U64
    }

    /// Sets the space promised to reserved components, in bytes per
    /// component (rounded up to blocks); components not in `m` have none.
    /// A component may be listed before it exists on this device: its
    /// promise counts from the moment it is set. Not persisted.
    pub fn set_reservations(&self, m: &HashMap<u64, u64>) {
        let blocks: HashMap<u64, u64> = m
            .iter()
            .filter(|(_, &b)| b > 0)
            .map(|(&c, &b)| (c, b.div_ceil(BLOCK_U64)))
            .collect();
        let mut st = self.lock_state();
        if st.reserved != blocks {
            st.reserved = blocks;
        }
    }

    /// Bytes the reserved components (but `except`) were promised and have
    /// not allocated yet: space no other component's write may take.
    pub fn lacking(&self, except: Option<u64>) -> u64 {
        lacking_locked(&self.lock_state(), except) * BLOCK_U64
    }

    /// [`LogStats::read_blocks`] and [`LogStats::header_misses`], without
    /// the state lock (for metrics scraped often).
    pub fn read_counters(&self) -> (u64, u64) {
        (
            self.read_blocks.load(Ordering::Relaxed),
            self.header_misses.load(Ordering::Relaxed),
        )
    }

    /// Bytes of live (mapped) blocks.
    pub fn used(&self) -> u64 {
        self.lock_state().live * BLOCK_U64
    }

    /// Counters since open.
    pub fn stats(&self) -> LogStats {
        let mut s = self.lock_state().stats.clone();
        s.flushes = self.flushes.load(Ordering::Relaxed);
        (s.read_blocks, s.header_misses) = self.read_counters();
        s
    }

    /// Device bytes written per client byte since open.
    pub fn write_amplification(&self) -> f64 {
        self.stats().write_amplification()
    }

    /// Heap bytes of the index of all components (an estimate) and of the
    /// segment table.
    pub fn index_memory(&self) -> (usize, usize) {
        let st = self.lock_state();
        let ix = st.comps.values().map(|c| c.index.heap_estimate()).sum();
        (ix, st.segs.heap_bytes())
    }

    /// Log blocks written since the last checkpoint that make the next one
    /// due: max(64 MiB, 8 × the last checkpoint), or what
    /// [`set_checkpoint_interval`](Self::set_checkpoint_interval) set.
    fn ckpt_interval(&self, st: &State) -> u64 {
        match self.ckpt_every.load(Ordering::Relaxed) {
            0 => self.geo.ckpt_min.max(8 * st.last_ckpt_blocks),
            n => n,
        }
    }

    /// Sets how many log blocks (4 KiB) are written between automatic
    /// checkpoints, at least (0: the default, max(64 MiB, 8 × the size of
    /// the last checkpoint)). A longer interval means more log to replay
    /// after a crash; benchmarks use `u64::MAX` to measure replay speed.
    /// Checkpoints the cleaner needs are still taken.
    pub fn set_checkpoint_interval(&self, blocks: u64) {
        self.ckpt_every.store(blocks, Ordering::Relaxed);
    }

    fn lock_state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn fail_check(&self) -> Result<()> {
        match &*lock(&self.failed) {
            None => Ok(()),
            Some(m) => Err(StoreError::Io(io::Error::other(format!(
                "the store failed after an I/O error ({m}); reopen it"
            )))),
        }
    }

    /// Records a failed device write or flush: from now on the store
    /// refuses everything (what is durable is unknown until reopened).
    fn poison(&self, e: io::Error) -> StoreError {
        let mut f = lock(&self.failed);
        if f.is_none() {
            tracing::error!(device = %self.dev.name().display(), error = %e, "device write failed; the store stops until reopened");
            *f = Some(e.to_string());
        }
        StoreError::Io(e)
    }

    // ---------------------------------------------------------------
    // The log: appending, sealing, moving between segments
    // ---------------------------------------------------------------

    /// Seals the open batch: its header is encoded, its buffer handed to
    /// the flight list (written by [`write_sealed`](Self::write_sealed)
    /// outside the state lock, or by [`drain`](Self::drain)) and a new
    /// batch opened after it. No-op when empty. No I/O.
    fn seal(&self, st: &mut State) -> Result<()> {
        if st.batch.is_empty() {
            return Ok(());
        }
        let h = BatchHeader {
            uuid: self.sb.uuid,
            seq: st.seq,
            epoch: st.epoch,
            durable_seq: self.flushed.load(Ordering::Acquire),
            ckpt_seq: st.ckpt_seq,
            seg: st.batch.seg,
            off: st.batch.off,
            next_seg: st.next_seg,
            entries: std::mem::take(&mut st.batch.entries),
        };
        let base = st.batch.base;
        let n = (st.batch.seal(&h).len() / BLOCK) as u32;
        st.batch.entries = h.entries;
        let refs = data_refs(&st.batch.entries);
        {
            let mut f = lock(&self.flight);
            let size = st.batch.buf.as_slice().len();
            let spare = f
                .spare
                .pop()
                .filter(|b| b.as_slice().len() == size)
                .unwrap_or_else(|| AlignedBuf::zeroed(size));
            let buf = std::mem::replace(&mut st.batch.buf, spare);
            f.batches.push_back(Sealed {
                seq: st.seq,
                base,
                blocks: n,
                buf: Arc::new(buf),
                claimed: false,
                done: false,
            });
        }
        st.segs.set_header(st.batch.seg, st.batch.off);
        lock(&self.cache).insert(base, refs);
        st.seq += 1;
        st.stats.batches += 1;
        st.stats.header_blocks += 1;
        st.stats.data_blocks += n as u64 - 1;
        st.log_since_ckpt += n as u64;
        let next_off = st.batch.off + n;
        if self.geo.seg_blocks - next_off < 2 {
            self.rotate(st)?;
        } else {
            let (seg, sb) = (st.batch.seg, self.geo.seg_blocks);
            let base = st.segs.block(seg, next_off);
            st.batch.reset(seg, next_off, base, sb);
        }
        Ok(())
    }

    /// Writes every sealed batch nobody has claimed yet (one
    /// `write_many`), then, if `flush` and no other thread's batch is still
    /// being written, flushes in the same submission. Call without the
    /// state lock (or through [`drain`](Self::drain)). Returns whether it
    /// flushed.
    fn write_sealed(&self, flush: bool) -> Result<bool> {
        let (mine, others) = {
            let mut f = lock(&self.flight);
            let others = f.batches.iter().any(|b| b.claimed && !b.done);
            let mine: Vec<(u64, u32, u32, Arc<AlignedBuf>)> = f
                .batches
                .iter_mut()
                .filter(|b| !b.claimed)
                .map(|b| {
                    b.claimed = true;
                    (b.seq, b.base, b.blocks, b.buf.clone())
                })
                .collect();
            (mine, others)
        };
        if mine.is_empty() {
            return Ok(false);
        }
        let flush = flush && !others;
        let r = {
            let reqs: Vec<(u64, &[u8])> = mine
                .iter()
                .map(|(_, base, n, buf)| (byte_off(*base), &buf.as_slice()[..*n as usize * BLOCK]))
                .collect();
            self.dev.write_many(&reqs, flush)
        };
        let last = mine.last().map(|m| m.0).unwrap_or(0);
        let seqs: Vec<u64> = mine.iter().map(|m| m.0).collect();
        drop(mine);
        if let Err(e) = r {
            let e = self.poison(e);
            let f = lock(&self.flight);
            if f.waiting > 0 {
                self.landed.notify_all();
            }
            return Err(e);
        }
        let mut f = lock(&self.flight);
        for b in f.batches.iter_mut() {
            if seqs.binary_search(&b.seq).is_ok() {
                b.done = true;
            }
        }
        while f.batches.front().is_some_and(|b| b.done) {
            let Some(b) = f.batches.pop_front() else {
                break;
            };
            self.written.fetch_max(b.seq, Ordering::AcqRel);
            if let Ok(buf) = Arc::try_unwrap(b.buf) {
                if f.spare.len() < SPARE_BUFS {
                    f.spare.push(buf);
                }
            }
        }
        if flush {
            // Every batch up to `last` was written before the flush.
            self.flushes.fetch_add(1, Ordering::Relaxed);
            self.flushed.fetch_max(last, Ordering::AcqRel);
        }
        if f.waiting > 0 {
            self.landed.notify_all();
        }
        Ok(flush)
    }

    /// Waits until every batch up to `seq` is written (writing unclaimed
    /// ones itself).
    fn wait_written(&self, seq: u64) -> Result<()> {
        loop {
            if self.written.load(Ordering::Acquire) >= seq {
                return Ok(());
            }
            self.fail_check()?;
            let f = lock(&self.flight);
            if f.batches.iter().any(|b| !b.claimed) {
                drop(f);
                self.write_sealed(false)?;
                continue;
            }
            if f.batches.is_empty() {
                // Nothing sealed is outstanding.
                return Ok(());
            }
            if self.written.load(Ordering::Acquire) >= seq {
                continue;
            }
            let mut f = f;
            f.waiting += 1;
            let mut f = self.landed.wait(f).unwrap_or_else(|e| e.into_inner());
            f.waiting -= 1;
        }
    }

    /// Makes everything sealed so far land on the device (not flushed),
    /// with the state lock held: for code that reads log blocks from the
    /// device or flushes under the lock.
    fn drain(&self, st: &State) -> Result<()> {
        self.write_sealed(false)?;
        self.wait_written(st.seq - 1)
    }

    /// Moves the log into the next segment.
    fn rotate(&self, st: &mut State) -> Result<()> {
        let old = st.batch.seg;
        st.segs.set_state(old, SegState::Used);
        let head = st.next_seg;
        st.segs.set_state(head, SegState::Head);
        let next = match st.segs.pop_free() {
            Some(n) => n,
            // Only the segment being zeroed is free (the space checks count
            // it): wait for its zeros (one write), then take it.
            None => match st.segs.zeroing() {
                Some(z) => {
                    let ok = self.prep.wait_done(z);
                    st.segs.end_zeroing(z, ok);
                    st.segs.pop_free().expect("the segment just zeroed is free")
                }
                None => {
                    // The space checks make this unreachable; refuse rather
                    // than overwrite anything.
                    return Err(self.poison(io::Error::other(
                        "log out of free segments (space accounting error)",
                    )));
                }
            },
        };
        st.next_seg = next;
        self.free_hint
            .store(st.segs.free_count(), Ordering::Relaxed);
        if st.segs.free_count() < self.geo.bg_high {
            self.bg.wake();
        }
        if st.segs.unprepared_count() > 0 && self.prep.on() {
            // The log took a segment: keep the ones after it prepared.
            self.bg.wake_prep();
        }
        let base = st.segs.block(head, 0);
        st.batch.reset(head, 0, base, self.geo.seg_blocks);
        if st.log_since_ckpt >= self.ckpt_interval(st) {
            st.ckpt_due = true;
        }
        Ok(())
    }

    /// Appends an entry (and its data block), sealing the open batch first
    /// if it is full. Returns the device block of the data.
    fn append(&self, st: &mut State, e: Entry, data: Option<&[u8]>) -> Result<Option<u32>> {
        let nd = data.is_some() as u32;
        if !st.batch.fits(e.slots(), nd) {
            self.seal(st)?;
            if !st.batch.fits(e.slots(), nd) {
                // An empty batch at the end of a segment with no room left.
                self.rotate(st)?;
            }
        }
        let i = st.batch.push(e, data);
        Ok(i.map(|i| st.batch.base + 1 + i as u32))
    }

    /// Maps block `block` of `id` to new contents `data` (whose CRC is
    /// `crc`; `bad`: it is known corrupt).
    fn put_block(
        &self,
        st: &mut State,
        id: u64,
        block: u64,
        data: &[u8],
        crc: u32,
        bad: bool,
    ) -> Result<()> {
        let cur = st.comps.get(&id).and_then(|c| c.index.get(block));
        if let Some(i) = cur.and_then(|d| st.batch.slot_of(d)) {
            if !bad {
                st.batch.overwrite(i, data, crc);
                return Ok(());
            }
        }
        let entry = Entry::Data {
            comp: id,
            block,
            crc,
            bad,
        };
        let d = self.append(st, entry, Some(data))?.expect("data block");
        let State {
            comps, segs, live, ..
        } = st;
        let c = comps.get_mut(&id).expect("component");
        match c.index.set(block, d) {
            Some(old) => segs.dec(old),
            None => *live += 1,
        }
        segs.inc(d);
        Ok(())
    }

    /// Unmaps blocks `first..end` of `id` in memory (the caller logs it).
    fn unmap(st: &mut State, id: u64, first: u64, end: u64) {
        let State {
            comps, segs, live, ..
        } = st;
        if let Some(c) = comps.get_mut(&id) {
            c.index.remove_range(first, end, |_, d| {
                segs.dec(d);
                *live -= 1;
            });
        }
    }

    /// Logs and applies a trim of the mapped blocks of `id` in
    /// `first..end`.
    fn trim_blocks(&self, st: &mut State, id: u64, first: u64, end: u64) -> Result<()> {
        let Some(c) = st.comps.get(&id) else {
            return Ok(());
        };
        let (mut lo, mut hi) = (u64::MAX, 0);
        c.index.for_each_in(first, end, |b, _| {
            lo = lo.min(b);
            hi = hi.max(b + 1);
        });
        if lo >= hi {
            return Ok(());
        }
        let mut at = lo;
        while at < hi {
            let n = (hi - at).min(u32::MAX as u64);
            self.append(
                st,
                Entry::Trim {
                    comp: id,
                    first: at,
                    count: n as u32,
                },
                None,
            )?;
            at += n;
        }
        Self::unmap(st, id, lo, hi);
        Ok(())
    }

    /// Runs a checkpoint at the end of an operation if one is long
    /// overdue. A due checkpoint is taken by the next `sync` (with its
    /// device writes outside the lock): a writer thread (the node's
    /// runtime) must not block on one. Only a store that is never synced
    /// reaches twice the interval.
    fn after_op(&self, st: &mut State) -> Result<()> {
        if st.ckpt_due && st.ckpt_io.is_none() && st.log_since_ckpt >= 2 * self.ckpt_interval(st) {
            self.checkpoint_locked(st)?;
        }
        Ok(())
    }

    // ---------------------------------------------------------------
    // Reading blocks
    // ---------------------------------------------------------------

    /// The decoded header at device block `h` (cached), if it is valid.
    fn header_refs(&self, h: u32) -> Result<Option<Arc<[DataRef]>>> {
        if let Some(r) = lock(&self.cache).get(h) {
            return Ok(Some(r));
        }
        let mut b = crate::direct::AlignedBuf::zeroed(BLOCK);
        self.dev.read_at(b.as_mut_slice(), byte_off(h))?;
        Ok(self.parse_header(h, b.as_slice()))
    }

    /// Decodes the header read from device block `h` and caches it, if it
    /// is valid and belongs there.
    fn parse_header(&self, h: u32, b: &[u8]) -> Option<Arc<[DataRef]>> {
        let hdr = BatchHeader::decode(b)?;
        let (seg, off) = self_locate(&self.sb, h)?;
        if hdr.uuid != self.sb.uuid || hdr.seg != seg || hdr.off != off {
            return None;
        }
        let refs = data_refs(&hdr.entries);
        lock(&self.cache).insert(h, refs.clone());
        Some(refs)
    }

    /// Checks `data`, read from device block `d` (header at `h`), is block
    /// `block` of `id` with a matching checksum.
    fn verify(&self, id: u64, block: u64, d: u32, h: Option<u32>, data: &[u8]) -> Result<()> {
        let refs = match h.filter(|&h| h < d) {
            Some(h) => self.header_refs(h)?,
            None => None,
        };
        Self::check_block(id, block, d, h, refs.as_deref(), data)
    }

    /// Checks `data` of device block `d` against `refs`, the decoded
    /// header at `h` (`None`: damaged or missing).
    fn check_block(
        id: u64,
        block: u64,
        d: u32,
        h: Option<u32>,
        refs: Option<&[DataRef]>,
        data: &[u8],
    ) -> Result<()> {
        let entry = match h.filter(|&h| h < d) {
            Some(h) => refs.map(|r| r.get((d - h - 1) as usize).copied()),
            None => None,
        };
        Self::check_entry(id, block, d, entry, data)
    }

    /// Checks `data` of device block `d` against its header's `entry`
    /// (`None`: no usable header; `Some(None)`: the header has no entry
    /// for this block).
    fn check_entry(
        id: u64,
        block: u64,
        d: u32,
        entry: Option<Option<DataRef>>,
        data: &[u8],
    ) -> Result<()> {
        let bad = || StoreError::Checksum {
            component: id,
            offset: block * BLOCK_U64,
        };
        let Some(entry) = entry else {
            tracing::warn!(
                component = id,
                block,
                device_block = d,
                "batch header missing or damaged"
            );
            return Err(bad());
        };
        match entry {
            Some(r) if r.comp == id && r.block == block && !r.bad => {
                if crc32c::crc32c(data) == r.crc {
                    Ok(())
                } else {
                    tracing::warn!(component = id, block, device_block = d, "checksum mismatch");
                    Err(bad())
                }
            }
            _ => {
                tracing::warn!(
                    component = id,
                    block,
                    device_block = d,
                    "block identity mismatch"
                );
                Err(bad())
            }
        }
    }

    /// Current contents of one block (for read-modify-write), with the
    /// lock held.
    fn read_block_locked(&self, st: &State, id: u64, block: u64, out: &mut [u8]) -> Result<()> {
        let d = st.comps.get(&id).and_then(|c| c.index.get(block));
        match d {
            None => out.fill(0),
            Some(d) => match st.batch.slot_of(d) {
                Some(i) => out.copy_from_slice(st.batch.data(i)),
                None => {
                    {
                        let f = lock(&self.flight);
                        if let Some((buf, k)) = f.find(d) {
                            out.copy_from_slice(&buf.as_slice()[k * BLOCK..(k + 1) * BLOCK]);
                            return Ok(());
                        }
                    }
                    let mut b = crate::direct::AlignedBuf::zeroed(BLOCK);
                    self.dev.read_at(b.as_mut_slice(), byte_off(d))?;
                    self.verify(id, block, d, st.segs.header_of(d), b.as_slice())?;
                    out.copy_from_slice(b.as_slice());
                }
            },
        }
        Ok(())
    }

    // ---------------------------------------------------------------
    // Components
    // ---------------------------------------------------------------

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
        self.fail_check()?;
        {
            let mut st = self.lock_state();
            if let Some(c) = st.comps.get(&id) {
                if c.volume != volume {
                    return Err(StoreError::VolumeMismatch {
                        id,
                        have: c.volume,
                        got: volume,
                    });
                }
                drop(st);
                return self.grow_component(id, size);
            }
            if st.comps.len() >= self.sb.max_components as usize {
                return Err(StoreError::TableFull);
            }
            self.ensure_space(&mut st, 0, 2, Need::Freeing)?;
            self.append(
                &mut st,
                Entry::Put {
                    comp: id,
                    volume,
                    size,
                    generation: 0,
                },
                None,
            )?;
            st.comps.insert(
                id,
                Comp {
                    volume,
                    size,
                    generation: 0,
                    index: BlockIndex::new(),
                    marks: BTreeSet::new(),
                    tracked: Default::default(),
                },
            );
        }
        self.sync()
    }

    /// Grows the logical size to `size`, leaving a component as large or
    /// larger as it is: the size is compared and changed under one lock,
    /// so two growths at once never shrink it.
    pub fn grow_component(&self, id: u64, size: u64) -> Result<()> {
        self.resize(id, size, false)
    }

    /// Changes the logical size. Shrinking frees the blocks past the new
    /// end and zeroes the tail of the last one, so growing again reads
    /// zeros.
    pub fn resize_component(&self, id: u64, size: u64) -> Result<()> {
        self.resize(id, size, true)
    }

    /// [`Store::resize_component`], or with `shrink` false
    /// [`Store::grow_component`].
    fn resize(&self, id: u64, size: u64, shrink: bool) -> Result<()> {
        if size > MAX_SIZE {
            return Err(StoreError::OutOfRange {
                id,
                offset: 0,
                len: size,
                size: MAX_SIZE,
            });
        }
        self.fail_check()?;
        {
            let mut st = self.lock_state();
            let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
            let (old, volume, generation) = (c.size, c.volume, c.generation);
            if !shrink && size <= old {
                return Ok(());
            }
            self.ensure_space(&mut st, 1, 3, Need::Freeing)?;
            if size < old {
                let keep = size.div_ceil(BLOCK_U64);
                let tail = (size % BLOCK_U64) as usize;
                if tail != 0 {
                    let b = size / BLOCK_U64;
                    self.zero_part(&mut st, id, b, tail, BLOCK)?;
                }
                self.trim_blocks(&mut st, id, keep, old.div_ceil(BLOCK_U64))?;
            }
            self.log_put(&mut st, id, volume, size, generation)?;
        }
        self.sync()
    }

    /// Logs a component's metadata (a put entry) and applies its size and
    /// generation in memory.
    fn log_put(
        &self,
        st: &mut State,
        id: u64,
        volume: u64,
        size: u64,
        generation: u64,
    ) -> Result<()> {
        self.append(
            st,
            Entry::Put {
                comp: id,
                volume,
                size,
                generation,
            },
            None,
        )?;
        if let Some(c) = st.comps.get_mut(&id) {
            c.size = size;
            c.generation = generation;
        }
        Ok(())
    }

    /// Zeroes bytes `from..to` of block `b` (if mapped): rewrites it, or
    /// unmaps it when it becomes all zeros.
    fn zero_part(&self, st: &mut State, id: u64, b: u64, from: usize, to: usize) -> Result<()> {
        if st.comps.get(&id).and_then(|c| c.index.get(b)).is_none() {
            return Ok(());
        }
        let mut buf = vec![0u8; BLOCK];
        self.read_block_locked(st, id, b, &mut buf)?;
        buf[from..to].fill(0);
        if buf.iter().all(|&x| x == 0) {
            self.trim_blocks(st, id, b, b + 1)
        } else {
            let crc = crc32c::crc32c(&buf);
            self.put_block(st, id, b, &buf, crc, false)
        }
    }

    /// Deletes a component and frees its blocks; its marked and tracked
    /// regions go with it.
    pub fn delete_component(&self, id: u64) -> Result<()> {
        self.fail_check()?;
        {
            let mut st = self.lock_state();
            if !st.comps.contains_key(&id) {
                return Err(StoreError::NoSuchComponent(id));
            }
            self.ensure_space(&mut st, 0, 1, Need::Freeing)?;
            self.append(&mut st, Entry::Delete { comp: id }, None)?;
            Self::unmap(&mut st, id, 0, u64::MAX);
            st.comps.remove(&id);
        }
        self.sync()
    }

    /// Marks the regions (1 MiB, `REGION_BLOCKS` blocks) of component
    /// `id` that bytes `offset .. offset+len` touch, and logs each region
    /// newly marked. A mark is logged before whatever is written after
    /// this call, so it is durable no later than those writes: after a
    /// crash, every region whose data may differ from another copy's (a
    /// write in flight in the cluster) is marked on at least the copy that
    /// has the write. The cluster marks before it writes and unmarks
    /// ([`unmark_regions`](Self::unmark_regions)) once the writes there
    /// are on every copy. `NoSpace` if the regions marked on the device
    /// would pass [`max_marks`](format::max_marks). Tracked regions
    /// ([`track_regions`](Self::track_regions)) have a bound of their own
    /// and take none of that room: a checkpoint slot holds both at their
    /// bounds.
    pub fn mark_regions(&self, id: u64, offset: u64, len: u64) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
        if len == 0 {
            return Ok(());
        }
        let region = BLOCK_U64 * format::REGION_BLOCKS;
        let first = offset / region;
        let last = offset.saturating_add(len - 1).min(MAX_SIZE - 1) / region;
        let new: Vec<u32> = (first..=last)
            .filter_map(|r| u32::try_from(r).ok())
            .filter(|r| !c.marks.contains(r))
            .collect();
        if new.is_empty() {
            return Ok(());
        }
        let marked: u64 = st.comps.values().map(|c| c.marks.len() as u64).sum();
        let max = format::max_marks(self.sb.nsegs, self.sb.seg_blocks, self.sb.max_components);
        if marked + new.len() as u64 > max {
            return Err(StoreError::NoSpace);
        }
        self.log_marks(&mut st, id, new, true)
    }

    /// Unmarks regions of component `id` (those of `regions` that are
    /// marked). The unmarks are durable with the next sync; until then a
    /// crash leaves them marked, which costs the cluster a needless copy
    /// of those regions, nothing else.
    pub fn unmark_regions(&self, id: u64, regions: &[u32]) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let Some(c) = st.comps.get(&id) else {
            return Ok(());
        };
        let gone: Vec<u32> = regions
            .iter()
            .copied()
            .filter(|r| c.marks.contains(r))
            .collect();
        if gone.is_empty() {
            return Ok(());
        }
        self.log_marks(&mut st, id, gone, false)
    }

    /// Logs and applies marks (`on`) or unmarks of `regions` of `id`.
    fn log_marks(&self, st: &mut State, id: u64, regions: Vec<u32>, on: bool) -> Result<()> {
        // Entries only (no data): they may use the cleaner's reserve, as
        // trims do, so a mark never cleans inline on the writer's thread.
        self.ensure_space(st, 0, regions.len() as u64, Need::Freeing)?;
        for r in regions {
            let region = r as u64;
            self.append(
                st,
                Entry::Mark {
                    comp: id,
                    region,
                    on,
                },
                None,
            )?;
            if let Some(c) = st.comps.get_mut(&id) {
                if on {
                    c.marks.insert(r);
                } else {
                    c.marks.remove(&r);
                }
            }
        }
        Ok(())
    }

    /// The marked regions of every component that has any, ascending.
    pub fn marked_regions(&self) -> Vec<(u64, Vec<u32>)> {
        let st = self.lock_state();
        st.comps
            .iter()
            .filter(|(_, c)| !c.marks.is_empty())
            .map(|(&id, c)| (id, c.marks.iter().copied().collect()))
            .collect()
    }

    fn meta_of(id: u64, c: &Comp) -> ComponentMeta {
        ComponentMeta {
            id,
            volume: c.volume,
            size: c.size,
            generation: c.generation,
            allocated: c.index.mapped() * BLOCK_U64,
        }
    }

    /// All components, by id.
    pub fn components(&self) -> Vec<ComponentMeta> {
        let st = self.lock_state();
        st.comps
            .iter()
            .map(|(&id, c)| Self::meta_of(id, c))
            .collect()
    }

    pub fn component(&self, id: u64) -> Option<ComponentMeta> {
        let st = self.lock_state();
        st.comps.get(&id).map(|c| Self::meta_of(id, c))
    }

    /// Raises the component's fence to `generation` (durable on return).
    /// A generation below the stored one is refused.
    pub fn fence(&self, id: u64, generation: u64) -> Result<()> {
        {
            let mut st = self.lock_state();
            let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
            if generation < c.generation {
                return Err(StoreError::StaleGeneration {
                    have: c.generation,
                    got: generation,
                });
            }
            if generation == c.generation {
                return Ok(());
            }
            self.fail_check()?;
            let (volume, size) = (c.volume, c.size);
            self.ensure_space(&mut st, 0, 2, Need::Freeing)?;
            self.log_put(&mut st, id, volume, size, generation)?;
        }
        self.sync()
    }

    /// The component's fence generation.
    pub fn generation(&self, id: u64) -> Option<u64> {
        self.lock_state().comps.get(&id).map(|c| c.generation)
    }

    // ---------------------------------------------------------------
    // Data
    // ---------------------------------------------------------------

    /// Writes `data` at `offset` of component `id` (any offset and length;
    /// partial blocks are read, merged and rewritten). Durable after the
    /// next [`sync`](Self::sync). A write that needs more space than is
    /// left fails whole with [`StoreError::NoSpace`].
    pub fn write(&self, id: u64, offset: u64, data: &[u8]) -> Result<()> {
        let len = data.len() as u64;
        // Checksums of whole blocks, outside the lock (a range that
        // overflows is refused below).
        let crcs: Vec<Option<u32>> = match offset.checked_add(len) {
            Some(_) => blocks_of(offset, len)
                .map(|(_, _, n, at)| (n == BLOCK).then(|| crc32c::crc32c(&data[at..at + n])))
                .collect(),
            None => Vec::new(),
        };
        self.write_with_crcs(id, offset, data, crcs)
    }

    /// [`write`](Self::write) with the CRC of each whole block already
    /// known (`crcs[i]` for the `i`-th piece of the range, `None` for a
    /// partial block).
    fn write_with_crcs(
        &self,
        id: u64,
        offset: u64,
        data: &[u8],
        crcs: Vec<Option<u32>>,
    ) -> Result<()> {
        self.fail_check()?;
        // Back-pressure: while the background cleaner is behind, wait for
        // its steps rather than clean inline (unless it is stuck).
        let mut waited = false;
        while self.free_hint.load(Ordering::Relaxed) < self.geo.bg_throttle && self.bg.wait_step() {
            waited = true;
        }
        let len = data.len() as u64;
        let mut st = self.lock_state();
        st.stats.cleaner_waits += waited as u64;
        let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
        check_range(id, offset, len, c.size)?;
        if len == 0 {
            return Ok(());
        }
        let (first, last) = (offset / BLOCK_U64, (offset + len - 1) / BLOCK_U64);
        let mut fresh = 0;
        for b in first..=last {
            if c.index.get(b).is_none() {
                fresh += 1;
            }
        }
        // Under the state lock, so writes racing each other can never
        // take together more than is left beside the reservations.
        let lacking = lacking_locked(&st, Some(id));
        if st.live + fresh + lacking > self.geo.max_live {
            return Err(StoreError::NoSpace);
        }
        // Partial edge blocks: read them before changing anything.
        let mut edges: Vec<(u64, Vec<u8>)> = Vec::new();
        for (b, _, n, _) in [blocks_of(offset, len).next(), blocks_of(offset, len).last()]
            .into_iter()
            .flatten()
        {
            if n < BLOCK && !edges.iter().any(|(e, _)| *e == b) {
                let mut buf = vec![0u8; BLOCK];
                self.read_block_locked(&st, id, b, &mut buf)?;
                edges.push((b, buf));
            }
        }
        let pieces: Vec<_> = blocks_of(offset, len).zip(crcs).collect();
        for chunk in pieces.chunks(self.geo.piece as usize) {
            self.ensure_space(&mut st, chunk.len() as u64, 0, Need::Client)?;
            for &((b, within, n, at), crc) in chunk {
                let part = &data[at..at + n];
                match crc {
                    Some(crc) => self.put_block(&mut st, id, b, part, crc, false)?,
                    None => {
                        let e = edges
                            .iter_mut()
                            .find(|(e, _)| *e == b)
                            .map(|(_, buf)| buf)
                            .expect("edge block read");
                        e[within..within + n].copy_from_slice(part);
                        let crc = crc32c::crc32c(e);
                        let e = e.clone();
                        self.put_block(&mut st, id, b, &e, crc, false)?;
                    }
                }
            }
        }
        st.stats.client_bytes += len;
        self.after_op(&mut st)?;
        drop(st);
        // Batches this write filled go to the device outside the lock.
        self.write_sealed(false).map(|_| ())
    }

    /// Reads `buf.len()` bytes at `offset`; unwritten blocks read as zeros.
    /// Every block read from the device is checked against its checksum.
    pub fn read(&self, id: u64, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut one = [ReadReq { id, offset, buf }];
        self.read_batch(&mut one)
            .pop()
            .unwrap_or_else(|| Err(StoreError::Io(io::Error::other("no read result"))))
    }

    /// Several reads at once: every block that must come from the device,
    /// of all of them, goes out in one `read_many` submission. Results are
    /// per request, in order (a bad block or a bad range fails only its
    /// own request; a device error fails every request that needed the
    /// device).
    pub fn read_batch(&self, reqs: &mut [ReadReq<'_>]) -> Vec<Result<()>> {
        let mut plan = self.plan_reads(reqs);
        if plan.device_reads() == 0 {
            return plan.res;
        }
        let read = {
            let mut parts = plan.parts();
            self.dev.read_many(&mut parts)
        };
        self.finish_reads(plan, read, reqs)
    }

    /// The first half of [`read_batch`](Self::read_batch), for callers that
    /// do the device reads themselves (on a ring of their own): fills what
    /// needs no device read (unwritten blocks, blocks still in memory) and
    /// says what remains. The blocks it locates are not reused until the
    /// plan is finished or dropped.
    pub fn plan_reads(&self, reqs: &mut [ReadReq<'_>]) -> ReadPlan {
        self.plan_into(reqs)
    }

    /// [`plan_reads`](Self::plan_reads) for one read whose answer the
    /// store allocates: finished by [`finish_read`](Self::finish_read).
    pub fn plan_read(&self, id: u64, offset: u64, len: usize) -> (ReadPlan, ReadAnswer) {
        let mut answer = ReadAnswer {
            id,
            offset,
            len,
            buf: None,
        };
        (self.plan_into(&mut answer), answer)
    }

    fn plan_into<T: ReadTargets + ?Sized>(&self, reqs: &mut T) -> ReadPlan {
        let mut res: Vec<Result<()>> = (0..reqs.count()).map(|_| Ok(())).collect();
        let mut plan = ReadPlan {
            res: Vec::new(),
            todo: Vec::new(),
            hs: Vec::new(),
            io: None,
            runs: Vec::new(),
            _pass: None,
        };
        if let Err(e) = self.fail_check() {
            let msg = e.to_string();
            plan.res = (0..reqs.count())
                .map(|_| Err(StoreError::Io(io::Error::other(msg.clone()))))
                .collect();
            return plan;
        }
        let mut todo: Vec<ToRead> = Vec::new();
        let st = self.lock_state();
        {
            let flight = lock(&self.flight);
            for (r, res_r) in res.iter_mut().enumerate() {
                let (id, offset, len) = reqs.req(r);
                let len = len as u64;
                let c = match st.comps.get(&id) {
                    Some(c) => c,
                    None => {
                        *res_r = Err(StoreError::NoSuchComponent(id));
                        continue;
                    }
                };
                if let Err(e) = check_range(id, offset, len, c.size) {
                    *res_r = Err(e);
                    continue;
                }
                for (b, within, n, at) in blocks_of(offset, len) {
                    match c.index.get(b) {
                        None => reqs.out(r, at, n).fill(0),
                        Some(d) => match st.batch.slot_of(d) {
                            Some(i) => reqs
                                .out(r, at, n)
                                .copy_from_slice(&st.batch.data(i)[within..within + n]),
                            None => match flight.find(d) {
                                Some((fb, k)) => reqs.out(r, at, n).copy_from_slice(
                                    &fb.as_slice()[k * BLOCK + within..k * BLOCK + within + n],
                                ),
                                None => todo.push(ToRead {
                                    r,
                                    id,
                                    block: b,
                                    within,
                                    len: n,
                                    at,
                                    d,
                                    h: st.segs.header_of(d),
                                    entry: None,
                                }),
                            },
                        },
                    }
                }
            }
        }
        plan.res = res;
        if todo.is_empty() {
            return plan;
        }
        // Keep the located blocks' segments from being reused until they
        // are read.
        let segs = todo
            .iter()
            .filter_map(|t| st.segs.locate(t.d).map(|(s, _)| s))
            .collect();
        plan._pass = Some(self.reuse.pass(segs));
        drop(st);
        // The headers to check against: the entries of cached ones are
        // copied now; the others are read with the data.
        let mut hs: Vec<u32> = Vec::new();
        {
            let cache = lock(&self.cache);
            for t in todo.iter_mut() {
                let Some(h) = t.h.filter(|&h| h < t.d) else {
                    continue;
                };
                match cache.entry(h, (t.d - h - 1) as usize) {
                    Some(e) => t.entry = Some(e),
                    None => hs.push(h),
                }
            }
        }
        hs.sort_unstable();
        hs.dedup();
        self.read_blocks
            .fetch_add(todo.len() as u64, Ordering::Relaxed);
        self.header_misses
            .fetch_add(hs.len() as u64, Ordering::Relaxed);
        // One buffer: the data blocks in `todo` order, then the headers;
        // one device read per run of consecutive device blocks.
        let mut runs = Vec::new();
        let mut k = 0;
        while k < todo.len() {
            let mut e = k + 1;
            while e < todo.len() && e - k < MAX_RUN && todo[e].d == todo[e - 1].d + 1 {
                e += 1;
            }
            runs.push((byte_off(todo[k].d), k * BLOCK, (e - k) * BLOCK));
            k = e;
        }
        let hdr_at = todo.len() * BLOCK;
        for (j, &h) in hs.iter().enumerate() {
            runs.push((byte_off(h), hdr_at + j * BLOCK, BLOCK));
        }
        // Every byte of it is a device read's (the runs cover it, each
        // byte once): it need not start zeroed.
        let io_len = (todo.len() + hs.len()) * BLOCK;
        assert_eq!(
            runs.iter().map(|r| r.2).sum::<usize>(),
            io_len,
            "plan: device reads do not cover the buffer"
        );
        plan.io = Some(crate::direct::AlignedBuf::for_reading(io_len));
        plan.todo = todo;
        plan.hs = hs;
        plan.runs = runs;
        plan
    }

    /// The second half of [`read_batch`](Self::read_batch): given the
    /// outcome of the plan's device reads, checks every block against its
    /// checksum and copies it into `reqs` (the same requests, in the same
    /// order, as planned). Returns the result of each request.
    pub fn finish_reads(
        &self,
        mut plan: ReadPlan,
        read: io::Result<()>,
        reqs: &mut [ReadReq<'_>],
    ) -> Vec<Result<()>> {
        assert_eq!(
            plan.res.len(),
            reqs.len(),
            "finish_reads: not the planned requests"
        );
        self.check_plan(&mut plan, read, |r, at, data| {
            reqs[r].buf[at..at + data.len()].copy_from_slice(data)
        });
        plan.res
    }

    /// The second half of [`plan_read`](Self::plan_read): checks the
    /// blocks read from the device and answers the read. A read served
    /// wholly by the device answers with the plan's device buffer.
    pub fn finish_read(
        &self,
        mut plan: ReadPlan,
        read: io::Result<()>,
        mut answer: ReadAnswer,
    ) -> Result<bytes::Bytes> {
        assert_eq!(plan.res.len(), 1, "finish_read: not a plan of one read");
        let buf = &mut answer.buf;
        self.check_plan(&mut plan, read, |_, at, data| {
            if let Some(buf) = buf.as_mut() {
                buf[at..at + data.len()].copy_from_slice(data)
            }
        });
        plan.res.pop().unwrap_or(Ok(()))?;
        if let Some(buf) = answer.buf {
            return Ok(bytes::Bytes::from(buf));
        }
        match plan.io.take() {
            // Every block came from the device, into `io` in block order.
            Some(io) => {
                let start = (answer.offset % BLOCK_U64) as usize;
                assert_eq!(
                    plan.todo.len(),
                    (start + answer.len).div_ceil(BLOCK),
                    "finish_read: a block neither read nor filled"
                );
                Ok(bytes::Bytes::from_owner(io).slice(start..start + answer.len))
            }
            None => {
                assert_eq!(
                    answer.len, 0,
                    "finish_read: a block neither read nor filled"
                );
                Ok(bytes::Bytes::new())
            }
        }
    }

    /// Checks every block `plan` read from the device, given the outcome
    /// of its device reads: a block that passes is handed to `put` as
    /// (request, offset in the request, bytes); a failure goes to the
    /// request's result.
    fn check_plan(
        &self,
        plan: &mut ReadPlan,
        read: io::Result<()>,
        mut put: impl FnMut(usize, usize, &[u8]),
    ) {
        let ReadPlan {
            res, todo, hs, io, ..
        } = plan;
        let Some(io) = io else { return };
        if let Err(e) = read {
            let msg = e.to_string();
            for t in todo.iter() {
                if res[t.r].is_ok() {
                    res[t.r] = Err(StoreError::Io(io::Error::new(e.kind(), msg.clone())));
                }
            }
            return;
        }
        let hdr_at = todo.len() * BLOCK;
        let refs: Vec<Option<Arc<[DataRef]>>> = hs
            .iter()
            .enumerate()
            .map(|(j, &h)| {
                self.parse_header(
                    h,
                    &io.as_slice()[hdr_at + j * BLOCK..hdr_at + (j + 1) * BLOCK],
                )
            })
            .collect();
        for (k, t) in todo.iter().enumerate() {
            if res[t.r].is_err() {
                continue;
            }
            let data = &io.as_slice()[k * BLOCK..(k + 1) * BLOCK];
            let entry = match (t.entry, t.h) {
                (Some(e), _) => Some(e),
                (None, Some(h)) if h < t.d => hs
                    .binary_search(&h)
                    .ok()
                    .and_then(|i| refs[i].as_deref())
                    .map(|r| r.get((t.d - h - 1) as usize).copied()),
                (None, _) => None,
            };
            match Self::check_entry(t.id, t.block, t.d, entry, data) {
                Ok(()) => put(t.r, t.at, &data[t.within..t.within + t.len]),
                Err(e) => res[t.r] = Err(e),
            }
        }
    }

    /// The file descriptor of the device, for callers that read it on a
    /// ring of their own, and whether it is opened `O_DIRECT`. `None` when
    /// the device is not a plain file or block device with io_uring
    /// allowed (fault-injecting devices in tests, `SHOAL_IO_URING=0`).
    pub fn ring_fd(&self) -> Option<(std::os::fd::RawFd, bool)> {
        self.dev.ring_fd()
    }

    /// Zeroes a range: whole blocks are unmapped (free space), partial ones
    /// rewritten.
    pub fn write_zeroes(&self, id: u64, offset: u64, len: u64) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
        let size = c.size;
        check_range(id, offset, len, size)?;
        if len == 0 {
            return Ok(());
        }
        let end = offset + len;
        self.ensure_space(&mut st, 2, 4, Need::Freeing)?;
        let (mut wf, mut we) = (u64::MAX, 0);
        for (b, within, n, _) in blocks_of(offset, len) {
            // Bytes past the size are always zero, so a piece reaching the
            // end of the component covers the block.
            let whole = within == 0 && (n == BLOCK || end == size);
            if whole {
                wf = wf.min(b);
                we = we.max(b + 1);
            } else {
                self.zero_part(&mut st, id, b, within, within + n)?;
            }
        }
        if wf < we {
            self.trim_blocks(&mut st, id, wf, we)?;
        }
        self.after_op(&mut st)?;
        drop(st);
        self.write_sealed(false).map(|_| ())
    }

    /// Discards a range; it then reads as zeros (same as `write_zeroes`).
    pub fn trim(&self, id: u64, offset: u64, len: u64) -> Result<()> {
        self.write_zeroes(id, offset, len)
    }

    /// `(offset, len)` of the allocated parts of a component, in order and
    /// coalesced, clipped to its size. Empty for an unknown component.
    pub fn allocated_ranges(&self, id: u64) -> Vec<(u64, u64)> {
        let st = self.lock_state();
        let Some(c) = st.comps.get(&id) else {
            return Vec::new();
        };
        c.index
            .ranges()
            .into_iter()
            .filter_map(|(f, n)| {
                let start = f * BLOCK_U64;
                let end = ((f + n) * BLOCK_U64).min(c.size);
                (start < end).then(|| (start, end - start))
            })
            .collect()
    }

    /// Makes every completed write and metadata change durable: writes the
    /// open batch and flushes the device (one flush for everything written
    /// before it: callers share it through [`GroupCommit`](crate::GroupCommit)).
    pub fn sync(&self) -> Result<()> {
        self.fail_check()?;
        let target = {
            let mut st = self.lock_state();
            self.release_drained(&mut st);
            if st.ckpt_due && st.ckpt_io.is_none() {
                // The checkpoint makes everything written so far durable.
                return self.checkpoint_unlocked(st);
            }
            self.seal(&mut st)?;
            st.seq - 1
        };
        // The device write happens here, outside the state lock: writers
        // go on filling the next batch meanwhile.
        if self.write_sealed(true)? && self.flushed.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        self.wait_written(target)?;
        self.flush_written()
    }

    /// Flushes the device if batches were written since the last flush.
    fn flush_written(&self) -> Result<()> {
        let target = self.written.load(Ordering::Acquire);
        if self.flushed.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let _g = lock(&self.flush_lock);
        if self.flushed.load(Ordering::Acquire) >= target {
            return Ok(());
        }
        let w = self.written.load(Ordering::Acquire);
        self.dev.flush().map_err(|e| self.poison(e))?;
        self.flushes.fetch_add(1, Ordering::Relaxed);
        self.flushed.fetch_max(w, Ordering::AcqRel);
        Ok(())
    }

    /// Writes a checkpoint now (and frees the segments without live data).
    pub fn checkpoint(&self) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        self.checkpoint_locked(&mut st)
    }

    /// Syncs and checkpoints, so the next open replays nothing.
    pub fn close(self) -> Result<()> {
        self.close_inner()
    }

    fn close_inner(&self) -> Result<()> {
        self.fail_check()?;
        let mut st = self.lock_state();
        if !st.batch.is_empty() || st.log_since_ckpt > 0 {
            self.checkpoint_locked(&mut st)?;
        }
        Ok(())
    }

    /// Checks the in-memory state against its invariants and the batch
    /// headers on the device: every mapped block lies in a written (or
    /// open) part of a used segment, no two blocks share a device block,
    /// no block is a header, live counts add up, every header names the
    /// block the index says it holds. `Err` describes the first problem.
    pub fn check(&self) -> std::result::Result<(), String> {
        let st = self.lock_state();
        self.drain(&st)
            .map_err(|e| format!("writing sealed batches: {e}"))?;
        let n = st.segs.count();
        let mut seen = vec![0u64; (n as usize * self.geo.seg_blocks as usize).div_ceil(64)];
        let mut live = vec![0u32; n as usize];
        let mut total = 0u64;
        let mut err: Option<String> = None;
        for (&id, c) in &st.comps {
            let blocks = c.blocks();
            let mut count = 0;
            c.index.for_each(|b, d| {
                count += 1;
                if err.is_some() {
                    return;
                }
                let Some((s, off)) = st.segs.locate(d) else {
                    err = Some(format!("{id}/{b}: device block {d} outside the segments"));
                    return;
                };
                let rel = (s * self.geo.seg_blocks + off) as usize;
                if seen[rel / 64] & (1 << (rel % 64)) != 0 {
                    err = Some(format!("{id}/{b}: device block {d} mapped twice"));
                    return;
                }
                seen[rel / 64] |= 1 << (rel % 64);
                live[s as usize] += 1;
                if b >= blocks {
                    err = Some(format!("{id}/{b}: past the size {}", c.size));
                    return;
                }
                match st.segs.state(s) {
                    SegState::Used | SegState::Head => {}
                    other => {
                        err = Some(format!("{id}/{b}: in a {other:?} segment"));
                        return;
                    }
                }
                if st.batch.slot_of(d).is_some() {
                    return;
                }
                if s == st.batch.seg && off >= st.batch.off {
                    err = Some(format!("{id}/{b}: past the head of the log"));
                    return;
                }
                if st.segs.is_header(d) {
                    err = Some(format!("{id}/{b}: device block {d} is a batch header"));
                    return;
                }
                let h = st.segs.header_of(d);
                match h.map(|h| (h, self.header_refs(h))) {
                    Some((h, Ok(Some(refs)))) => match refs.get((d - h - 1) as usize) {
                        Some(r) if r.comp == id && r.block == b => {}
                        other => err = Some(format!("{id}/{b}: header at {h} says {other:?}")),
                    },
                    Some((_, Ok(None))) => {} // damaged header: reads report it
                    Some((h, Err(e))) => err = Some(format!("reading header {h}: {e}")),
                    None => err = Some(format!("{id}/{b}: no header before {d}")),
                }
            });
            if count != c.index.mapped() {
                err.get_or_insert(format!("{id}: mapped count {}", c.index.mapped()));
            }
            total += count;
        }
        if let Some(e) = err {
            return Err(e);
        }
        if total != st.live {
            return Err(format!("live {} but {total} blocks mapped", st.live));
        }
        for s in 0..n {
            if live[s as usize] != st.segs.live(s) {
                return Err(format!(
                    "segment {s}: live {} but {} blocks",
                    st.segs.live(s),
                    live[s as usize]
                ));
            }
        }
        if st.segs.state(st.batch.seg) != SegState::Head
            || st.segs.state(st.next_seg) != SegState::Next
        {
            return Err("head or next segment in the wrong state".into());
        }
        if st.live > self.geo.max_live {
            return Err(format!("live {} > capacity {}", st.live, self.geo.max_live));
        }
        Ok(())
    }
}

/// (segment, offset) of device block `d` from the superblock alone.
#[cfg(test)]
impl LogStore {
    /// Device block holding block `block` of `id` (tests).
    fn locate(&self, id: u64, block: u64) -> Option<u32> {
        self.lock_state().comps.get(&id)?.index.get(block)
    }

    fn geometry(&self) -> (&LogSuper, &Geo) {
        (&self.sb, &self.geo)
    }

    /// Runs the cleaner on the segment holding block `block` of `id`.
    fn relocate_segment_of(&self, id: u64, block: u64) -> Result<()> {
        let mut st = self.lock_state();
        let d = st.comps[&id].index.get(block).expect("mapped");
        let (seg, _) = st.segs.locate(d).expect("in a segment");
        self.seal(&mut st)?;
        if st.batch.seg == seg {
            // Leave the segment (the checkpoint below records where the
            // log goes on).
            self.rotate(&mut st)?;
        }
        self.relocate(&mut st, seg)?;
        self.checkpoint_locked(&mut st)
    }
}

fn self_locate(sb: &LogSuper, d: u32) -> Option<(u32, u32)> {
    let rel = (d as u64).checked_sub(sb.seg_off)?;
    let s = rel / sb.seg_blocks as u64;
    (s < sb.nsegs as u64).then_some((s as u32, (rel % sb.seg_blocks as u64) as u32))
}

impl Drop for LogStore {
    fn drop(&mut self) {
        // The background cleaner holds only a `Weak` between steps, so it
        // is never inside one here; it may be the thread running this drop
        // (it held the last reference), which must not join itself.
        self.stop_background();
        if lock(&self.failed).is_some() {
            return;
        }
        if let Err(e) = self.close_inner() {
            tracing::warn!(device = %self.dev.name().display(), error = %e, "closing the log store failed");
        }
    }
}

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("device", &self.dev.name())
            .field("cluster_id", &self.sb.cluster_id)
            .field("segments", &self.sb.nsegs)
            .finish_non_exhaustive()
    }
}
