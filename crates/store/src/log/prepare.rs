//! Preparing space ahead of the log: zeros written over free segments that
//! the file system has not allocated yet, so that the log never writes into
//! a hole.
//!
//! On a sparse device file (the default of `shoal up`), the first write
//! into an unallocated block makes ext4 allocate it, and the `fdatasync`
//! that follows then commits the journal: a 4 KiB durable write at queue
//! depth 1 through the cluster measured about 40% slower than on a file
//! written in full. Unwritten extents (`fallocate`) are no better, their
//! conversion journals too; only written blocks are. So the background
//! thread of the store (the cleaner's, `cleaner.rs`) writes zeros over the
//! free segments the log takes next (the lowest first, as `pop_free` does)
//! and keeps [`PREPARED_AHEAD_MIB`] of them prepared; when the store is
//! idle it goes on over the rest of the device at
//! [`PREPARE_IDLE_MIB_PER_SEC`], until the whole file is allocated.
//!
//! Safety: a segment is claimed under the state lock (`Zeroing`: out of
//! the free set, so the log cannot take it, and never a segment with data,
//! since only free segments are claimed), written without the lock, and
//! given back to the free set under the lock. A free segment holds nothing
//! that replay from the newest durable checkpoint reads (invariant 3), so
//! zeros there change nothing a crash can leave; see
//! `docs/store-log-format.md`, "Thick and sparse files".

use super::format::BLOCK_U64;
use super::{lock, LogStore};
use crate::direct::AlignedBuf;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Space kept prepared ahead of the log head, in MiB: several seconds of
/// the log at QD1 (about 15 MiB/s here), and the first writes of a new
/// device land in prepared space.
pub(super) const PREPARED_AHEAD_MIB: u64 = 64;

/// How fast the rest of the device is prepared while the store is idle, in
/// MiB/s: a 4 GiB device in about 17 idle minutes. Every byte of zeros
/// lengthens some flush of the disk, this store's or another's (the idle
/// nodes of a loopback cluster share the busy ones' disk), so a new
/// cluster's first minutes must not pay for much of it.
pub(super) const PREPARE_IDLE_MIB_PER_SEC: u64 = 4;

/// Idle preparation stops while the file system holding the device file
/// has less than this free, in MiB: a sparse device file larger than its
/// file system (a thin file on a small disk) must not fill it with zeros
/// no one wrote. Preparation ahead of the log goes on: the log writes
/// there next in any case.
const PREPARE_FS_FLOOR_MIB: u64 = 1024;

/// How long idle preparation waits, in seconds, before it looks at the
/// file system's free space again.
const PREPARE_FS_RETRY_S: u64 = 10;

/// Free bytes of the file system holding `path` (for unprivileged use),
/// if it can be told.
fn fs_free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs fills the zeroed struct it is given from a valid
    // NUL-terminated path; nothing is kept.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// The store is idle when nothing was appended to the log for this long,
/// in milliseconds (a QD1 client seals a batch every millisecond or so).
const IDLE_QUIET_MS: u64 = 250;

/// Bytes of zeros per device write, in KiB (at most a segment): each
/// allocating write costs a journal commit in the file's next `fdatasync`,
/// so one per segment; meanwhile ext4 holds the file's inode lock and the
/// store's other I/O waits (about 3 ms for 4 MiB here).
const ZERO_WRITE_KIB: usize = 4096;

/// Preparation state shared by the store and its background thread.
pub(super) struct Prep {
    /// The device is a sparse file being prepared. Segments freed by
    /// checkpoints are then not punched (that would undo the work).
    on: AtomicBool,
    /// Segments kept prepared ahead of the log head.
    ahead_segs: AtomicU64,
    /// Idle preparation rate, bytes per second.
    idle_bytes_per_sec: AtomicU64,
    /// The zeroing under way: `None` while it runs, then (segment, whether
    /// the zeros were written). A rotation that finds no other free
    /// segment waits for it (lock order: state, then this).
    done: Mutex<Option<(u32, bool)>>,
    landed: Condvar,
    /// Tests: microseconds to wait before each zero write (0: none), to
    /// widen the window in which writers race a zeroing.
    #[cfg(test)]
    pub(super) pause_us: AtomicU64,
    /// Tests: segments freed by checkpoints count as unprepared again (as
    /// if punched), so zeroing goes on amid reuse all the time.
    #[cfg(test)]
    pub(super) reprepare_freed: AtomicBool,
}

impl Default for Prep {
    fn default() -> Self {
        Prep {
            on: AtomicBool::new(false),
            ahead_segs: AtomicU64::new(0),
            idle_bytes_per_sec: AtomicU64::new(PREPARE_IDLE_MIB_PER_SEC << 20),
            done: Mutex::new(None),
            landed: Condvar::new(),
            #[cfg(test)]
            pause_us: AtomicU64::new(0),
            #[cfg(test)]
            reprepare_freed: AtomicBool::new(false),
        }
    }
}

impl Prep {
    pub(super) fn on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Waits until the zeroing of segment `s` ends; whether it wrote its
    /// zeros.
    pub(super) fn wait_done(&self, s: u32) -> bool {
        let mut d = lock(&self.done);
        loop {
            match *d {
                Some((z, ok)) if z == s => return ok,
                _ => d = self.landed.wait(d).unwrap_or_else(|e| e.into_inner()),
            }
        }
    }
}

/// Says the zeroing of a segment ended (its outcome, or failed if the
/// thread unwinds first), so a rotation waiting for it goes on.
struct Landed<'a> {
    prep: &'a Prep,
    seg: u32,
    ok: bool,
}

impl Drop for Landed<'_> {
    fn drop(&mut self) {
        *lock(&self.prep.done) = Some((self.seg, self.ok));
        self.prep.landed.notify_all();
    }
}

/// What the background thread does after a step of preparation.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PrepStep {
    /// Prepared a segment ahead of the log: call again.
    Again,
    /// Nothing to do now: call again at this time (idle pacing), or when
    /// woken (`None`).
    Later(Option<Instant>),
}

/// The background thread's own preparation state.
pub(super) struct Preparer {
    buf: Option<AlignedBuf>,
    /// Log activity last seen (next batch seq, client bytes) and when it
    /// changed.
    seen: (u64, u64),
    seen_at: Instant,
    /// Earliest time of the next idle zeroing (the rate bound).
    next_idle: Instant,
    /// Whether the file system was short of free space, and when that was
    /// last looked at (every [`PREPARE_FS_RETRY_S`] at most).
    fs_low: Option<(bool, Instant)>,
}

impl Preparer {
    pub(super) fn new() -> Preparer {
        let now = Instant::now();
        Preparer {
            buf: None,
            seen: (0, 0),
            seen_at: now,
            next_idle: now,
            fs_low: None,
        }
    }
}

/// The holes (unallocated ranges, unwritten extents included) of `file`
/// within `start..end`, in bytes, from `lseek(SEEK_HOLE/SEEK_DATA)`. A file
/// system without hole support reports none.
pub(super) fn holes(file: &File, start: u64, end: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let seek = |pos: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        // SAFETY: lseek on a descriptor we own, with integer arguments. The
        // file position it moves is used by nothing (all I/O is positional).
        let r = unsafe { libc::lseek(fd, pos as libc::off_t, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = io::Error::last_os_error();
        // ENXIO: no hole / no data at or after `pos` (past the end).
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    };
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let Some(h) = seek(pos, libc::SEEK_HOLE)? else {
            break;
        };
        if h >= end {
            break;
        }
        let d = seek(h, libc::SEEK_DATA)?.unwrap_or(end).min(end);
        if d <= h {
            break;
        }
        out.push((h, d));
        pos = d;
    }
    Ok(out)
}

/// The segments (`nsegs` of `seg_bytes` from byte `start`) that `holes`
/// touch, ascending. A hole in the last block of a segment only does not
/// count: the log may never write that block (a batch needs two).
pub(super) fn segments_with_holes(
    holes: &[(u64, u64)],
    start: u64,
    seg_bytes: u64,
    nsegs: u32,
) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &(h, e) in holes {
        let (h, e) = (h.max(start), e);
        if e <= h {
            continue;
        }
        let first = (h - start) / seg_bytes;
        let last = (e - 1 - start) / seg_bytes;
        for s in first..=last.min(nsegs as u64 - 1) {
            let used_end = start + (s + 1) * seg_bytes - BLOCK_U64;
            let seg_start = start + s * seg_bytes;
            if h < used_end && e > seg_start && out.last() != Some(&(s as u32)) {
                out.push(s as u32);
            }
        }
    }
    out
}

impl LogStore {
    fn seg_bytes(&self) -> u64 {
        self.geo.seg_blocks as u64 * BLOCK_U64
    }

    /// Turns preparation on if the device is a sparse regular file written
    /// with `O_DIRECT`: finds the free segments with holes under them. A
    /// block device, a buffered device or a file without holes needs none
    /// (a thick file, or one the log has gone all over once).
    pub(super) fn start_preparation(&self) {
        if !self.dev.is_direct() {
            return;
        }
        let Ok(file) = File::open(self.dev.name()) else {
            return;
        };
        if !file.metadata().is_ok_and(|m| m.file_type().is_file()) {
            return;
        }
        let start = self.sb.seg_off * BLOCK_U64;
        let end = start + self.geo.nsegs as u64 * self.seg_bytes();
        let found = match holes(&file, start, end) {
            Ok(h) => h,
            Err(e) => {
                tracing::info!(device = %self.dev.name().display(), error = %e, "cannot find the holes of the device file; not preparing it");
                return;
            }
        };
        let segs = segments_with_holes(&found, start, self.seg_bytes(), self.geo.nsegs);
        self.enable_preparation(segs);
    }

    /// Prepares the free segments among `segs` from now on.
    pub(super) fn enable_preparation(&self, segs: Vec<u32>) {
        let seg_bytes = self.seg_bytes();
        // (Unless a test set its own pace.)
        let _ = self.prep.ahead_segs.compare_exchange(
            0,
            (PREPARED_AHEAD_MIB << 20).div_ceil(seg_bytes).max(2),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        let n = {
            let mut st = self.lock_state();
            st.segs.set_unprepared(segs);
            self.prep.on.store(true, Ordering::Relaxed);
            st.segs.unprepared_count()
        };
        if n > 0 {
            tracing::info!(
                device = %self.dev.name().display(),
                unallocated_mib = (n as u64 * seg_bytes) >> 20,
                "writing zeros over the device file's unallocated free space ahead of the log"
            );
        }
    }

    /// Free segments still to be prepared (0 when preparation is off or
    /// done).
    pub fn unprepared_segments(&self) -> usize {
        self.lock_state().segs.unprepared_count()
    }

    /// Whether the file system holding the device file is short of free
    /// space, looked at again once [`PREPARE_FS_RETRY_S`] have passed.
    fn fs_low(&self, p: &mut Preparer, now: Instant) -> bool {
        let retry = Duration::from_secs(PREPARE_FS_RETRY_S);
        match p.fs_low {
            Some((low, at)) if now.duration_since(at) < retry => low,
            _ => {
                let low =
                    fs_free_bytes(self.dev.name()).is_some_and(|f| f < PREPARE_FS_FLOOR_MIB << 20);
                p.fs_low = Some((low, now));
                low
            }
        }
    }

    /// One step of preparation: zeros over one segment, the lowest
    /// unprepared one among the next [`PREPARED_AHEAD_MIB`] the log takes,
    /// else (if the store is idle, at the idle rate) the lowest of all.
    /// Never while the cleaner needs the free segments.
    pub(super) fn prepare_step(&self, p: &mut Preparer) -> PrepStep {
        if !self.prep.on() || self.fail_check().is_err() {
            return PrepStep::Later(None);
        }
        let now = Instant::now();
        let fs_low = self.fs_low(p, now);
        let (seg, idle) = {
            let mut st = self.lock_state();
            if st.segs.unprepared_count() == 0 || st.segs.zeroing().is_some() {
                return PrepStep::Later(None);
            }
            // Free segments short: cleaning first (a rotation wakes us).
            // At `bg_high` exactly the cleaner is done and stays asleep
            // until a rotation takes one: refusing there too left a store
            // that writes steadily (the cleaner holding `bg_high` free)
            // never preparing again. The claimed segment still counts in
            // `free_count`; the `bg_high - 1` others the log can take
            // are still above the writers' thresholds, and a rotation
            // that needs the claimed one waits for its zeros.
            if st.segs.free_count() < self.geo.bg_high {
                return PrepStep::Later(None);
            }
            let ahead = self.prep.ahead_segs.load(Ordering::Relaxed) as usize;
            let soon = st
                .segs
                .free_in_order()
                .take(ahead)
                .find(|&s| st.segs.is_unprepared(s));
            let (seg, idle) = match soon {
                Some(s) => (s, false),
                None => {
                    let Some(s) = st.segs.first_unprepared() else {
                        return PrepStep::Later(None);
                    };
                    if self.prep.idle_bytes_per_sec.load(Ordering::Relaxed) == 0 {
                        // (Tests: no idle preparation.)
                        return PrepStep::Later(None);
                    }
                    if fs_low {
                        let retry = now + Duration::from_secs(PREPARE_FS_RETRY_S);
                        return PrepStep::Later(Some(retry));
                    }
                    let activity = (st.seq, st.stats.client_bytes);
                    if activity != p.seen {
                        p.seen = activity;
                        p.seen_at = now;
                    }
                    let at = (p.seen_at + Duration::from_millis(IDLE_QUIET_MS)).max(p.next_idle);
                    if now < at {
                        return PrepStep::Later(Some(at));
                    }
                    (s, true)
                }
            };
            st.segs.claim_zeroing(seg);
            *lock(&self.prep.done) = None;
            (seg, idle)
        };
        let mut landed = Landed {
            prep: &self.prep,
            seg,
            ok: false,
        };
        landed.ok = self.write_zeros(seg, p);
        let ok = landed.ok;
        drop(landed);
        {
            let mut st = self.lock_state();
            // A rotation that needed it may have given it back already.
            if st.segs.zeroing() == Some(seg) {
                st.segs.end_zeroing(seg, ok);
            }
            if ok {
                st.stats.prepared_segments += 1;
            } else {
                // Stop: the log writes into unprepared space as before.
                self.prep.on.store(false, Ordering::Relaxed);
                st.segs.clear_unprepared();
            }
        }
        if !ok {
            return PrepStep::Later(None);
        }
        if idle {
            let rate = self.prep.idle_bytes_per_sec.load(Ordering::Relaxed).max(1);
            p.next_idle = now + Duration::from_secs_f64(self.seg_bytes() as f64 / rate as f64);
            return PrepStep::Later(Some(p.next_idle));
        }
        PrepStep::Again
    }

    /// Writes zeros over segment `s` (claimed), in pieces. An I/O error is
    /// logged and ends preparation; it never fails the store.
    fn write_zeros(&self, s: u32, p: &mut Preparer) -> bool {
        let seg_bytes = self.seg_bytes();
        let piece = ((ZERO_WRITE_KIB as u64) << 10).min(seg_bytes);
        let buf = p
            .buf
            .get_or_insert_with(|| AlignedBuf::zeroed(piece as usize));
        let first = self.sb.seg_off + s as u64 * self.geo.seg_blocks as u64;
        let base = first * BLOCK_U64;
        let mut at = 0;
        while at < seg_bytes {
            let n = piece.min(seg_bytes - at);
            #[cfg(test)]
            {
                let us = self.prep.pause_us.load(Ordering::Relaxed);
                if us > 0 {
                    std::thread::sleep(Duration::from_micros(us));
                }
            }
            if let Err(e) = self.dev.write_at(&buf.as_slice()[..n as usize], base + at) {
                tracing::warn!(device = %self.dev.name().display(), segment = s, error = %e, "writing zeros ahead of the log failed; preparation stops (the log writes into unallocated space)");
                return false;
            }
            at += n;
        }
        true
    }

    /// Tests: prepares every free segment (as if the device were a sparse
    /// file), keeping `ahead` of them ahead of the log and going on at
    /// `idle_mib_s` when idle (0: not).
    #[cfg(test)]
    pub(super) fn prepare_all_for_tests(&self, ahead: u64, idle_mib_s: u64) {
        self.set_preparation_pace(ahead, idle_mib_s);
        self.enable_preparation((0..self.geo.nsegs).collect());
    }

    /// Tests: sets the segments kept prepared ahead and the idle rate (in
    /// MiB/s, 0: no idle preparation); before preparation starts.
    #[cfg(test)]
    pub(super) fn set_preparation_pace(&self, ahead: u64, idle_mib_s: u64) {
        self.prep.ahead_segs.store(ahead, Ordering::Relaxed);
        self.prep
            .idle_bytes_per_sec
            .store(idle_mib_s << 20, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{FaultyDevice, LogConfig};
    use super::*;
    use std::sync::Arc;

    /// When the only free segment is the one being zeroed, the log waits
    /// for its zeros before taking it; it never writes a segment that is
    /// still being zeroed.
    #[test]
    fn a_rotation_waits_for_the_zeroing_of_the_last_free_segment() {
        let cfg = LogConfig {
            seg_blocks: 64,
            max_components: 8,
            fill_permille: 900,
            min_capacity: 0,
        };
        let dev = Arc::new(FaultyDevice::new((16 * 64 + 64) * BLOCK_U64));
        let s = Arc::new(LogStore::format_device(dev, "t", &cfg).unwrap());
        let z = {
            let mut st = s.lock_state();
            // Every free segment but the last is taken (used, empty).
            let free: Vec<u32> = st.segs.free_in_order().collect();
            let (&z, rest) = free.split_last().unwrap();
            for &f in rest {
                st.segs.set_state(f, super::super::segment::SegState::Used);
            }
            st.segs.claim_zeroing(z);
            *lock(&s.prep.done) = None;
            z
        };
        let t0 = Instant::now();
        let zeroer = {
            let s = s.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                drop(Landed {
                    prep: &s.prep,
                    seg: z,
                    ok: true,
                });
            })
        };
        {
            let mut st = s.lock_state();
            s.rotate(&mut st).unwrap();
            assert!(t0.elapsed() >= Duration::from_millis(100));
            assert_eq!(st.next_seg, z);
            assert!(st.segs.zeroing().is_none() && !st.segs.is_unprepared(z));
        }
        zeroer.join().unwrap();
    }

    #[test]
    fn segments_touched_by_holes() {
        let seg = 64 * BLOCK_U64;
        let start = 8 * BLOCK_U64;
        // A hole over segment 0 only in its last block, one from the middle
        // of 1 to the start of 3, one to the end.
        let h = [
            (start + seg - BLOCK_U64, start + seg),
            (start + seg + 5 * BLOCK_U64, start + 3 * seg + BLOCK_U64),
            (start + 5 * seg, start + 10 * seg),
        ];
        assert_eq!(
            segments_with_holes(&h, start, seg, 8),
            vec![1, 2, 3, 5, 6, 7]
        );
        assert_eq!(segments_with_holes(&[], start, seg, 8), Vec::<u32>::new());
        // A hole before the segments (the checkpoint slots) is ignored.
        assert_eq!(
            segments_with_holes(&[(0, start + BLOCK_U64)], start, seg, 8),
            vec![0]
        );
    }

    #[test]
    fn holes_of_a_sparse_file() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        let m = 1u64 << 20;
        f.set_len(8 * m).unwrap();
        f.write_all_at(&vec![1u8; m as usize], 2 * m).unwrap();
        f.write_all_at(&vec![1u8; m as usize], 7 * m).unwrap();
        f.sync_all().unwrap();
        let h = holes(&f, 0, 8 * m).unwrap();
        if h.is_empty() {
            eprintln!("this file system reports no holes");
            return;
        }
        assert_eq!(h, vec![(0, 2 * m), (3 * m, 7 * m)]);
        assert_eq!(holes(&f, 2 * m, 3 * m).unwrap(), vec![]);
        assert_eq!(holes(&f, 4 * m, 5 * m).unwrap(), vec![(4 * m, 5 * m)]);
    }
}
