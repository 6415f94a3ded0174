//! The device under the log: a trait with positional I/O and a flush, a
//! file/block-device implementation (`O_DIRECT` where allowed, buffered
//! otherwise), and an in-memory fault-injecting one for tests.
//!
//! The trait is the seam for an io_uring implementation (step 2): the log
//! only ever issues block-aligned reads and writes and a flush.

use crate::direct::{AlignedBuf, ALIGN};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// A device the log store runs on. Offsets and lengths the store passes
/// are multiples of 4096; implementations may rely on it.
pub trait BlockDevice: Send + Sync {
    /// Reads exactly `buf.len()` bytes at `off`.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()>;
    /// Writes all of `buf` at `off`. Not durable until [`flush`](Self::flush).
    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Makes every write completed before the call durable.
    fn flush(&self) -> io::Result<()>;
    /// Reads many ranges (`(offset, buffer)`, each filled exactly): one
    /// submission on io_uring, so the device works on them in parallel.
    /// The default reads them one after the other.
    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (off, buf) in reqs.iter_mut() {
            self.read_at(buf, *off)?;
        }
        Ok(())
    }
    /// Writes many ranges, then flushes if `flush`: on io_uring one
    /// submission (the flush ordered after the writes). The default writes
    /// them one after the other. On error nothing is known of which writes
    /// happened.
    fn write_many(&self, reqs: &[(u64, &[u8])], flush: bool) -> io::Result<()> {
        for (off, buf) in reqs {
            self.write_at(buf, *off)?;
        }
        if flush {
            self.flush()?;
        }
        Ok(())
    }
    /// Bytes of the device the store may use.
    fn len(&self) -> u64;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The range's contents are no longer needed (best effort; it may read
    /// back as anything afterwards).
    fn discard(&self, _off: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
    /// Whether data bypasses the page cache.
    fn is_direct(&self) -> bool {
        false
    }
    /// The descriptor to read this device through on a caller's own
    /// io_uring, and whether it is `O_DIRECT`; `None` (the default) if
    /// reads must go through [`read_many`](Self::read_many).
    fn ring_fd(&self) -> Option<(std::os::fd::RawFd, bool)> {
        None
    }
    /// Name for messages (the path of a file).
    fn name(&self) -> &Path;
}

fn aligned(off: u64, len: usize) -> bool {
    off.is_multiple_of(ALIGN) && (len as u64).is_multiple_of(ALIGN)
}

fn ptr_aligned(p: *const u8) -> bool {
    (p as usize).is_multiple_of(ALIGN as usize)
}

/// A regular file or block device, with positional I/O: `O_DIRECT` when
/// the file system allows it (aligned buffers, bounced when the caller's
/// memory is not aligned), buffered I/O plus `fdatasync` otherwise (tmpfs).
pub struct FileDevice {
    file: File,
    direct: Option<File>,
    len: u64,
    path: PathBuf,
    /// Regular file whose holes can be punched.
    punch: AtomicBool,
    /// The last write before a flush carries `RWF_DSYNC` (see
    /// [`FileDevice::write_durable`]); cleared if the kernel refuses it.
    dsync: AtomicBool,
}

/// A durable write is one `pwritev2(RWF_DSYNC)` instead of `pwrite` then
/// `fdatasync` wherever the kernel takes the flag: the same device
/// commands (a write, then a cache flush: the virtual disks measured have
/// no FUA), one system call and one return to user space less, which
/// measured faster at QD1 and QD32 (bench/RESULTS.md, 2026-12-01,
/// thirteenth session).
const WRITE_DSYNC: bool = true;

impl FileDevice {
    /// Like [`new`](Self::new) but always buffered (no `O_DIRECT`).
    pub fn buffered(file: File, path: &Path, len: u64, block: bool) -> FileDevice {
        let thick = crate::fully_allocated(&file);
        FileDevice {
            file,
            direct: None,
            len,
            path: path.to_path_buf(),
            punch: AtomicBool::new(!block && !thick),
            dsync: AtomicBool::new(false),
        }
    }

    /// Wraps `file` (opened read-write and locked by the caller), using its
    /// first `len` bytes. `block`: it is a block device.
    pub fn new(file: File, path: &Path, len: u64, block: bool) -> io::Result<FileDevice> {
        let direct = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(f) => Some(f),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                tracing::info!(path = %path.display(), "O_DIRECT refused; using buffered I/O");
                None
            }
            Err(e) => return Err(e),
        };
        let thick = crate::fully_allocated(&file);
        Ok(FileDevice {
            file,
            direct,
            len,
            path: path.to_path_buf(),
            punch: AtomicBool::new(!block && !thick),
            dsync: AtomicBool::new(WRITE_DSYNC),
        })
    }
}

impl FileDevice {
    /// The descriptor data I/O goes through (the `O_DIRECT` one if any).
    pub(super) fn io_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.direct.as_ref().unwrap_or(&self.file).as_raw_fd()
    }

    /// Writes `buf` at `off` and makes it and every write completed before
    /// durable: one `pwritev2(RWF_DSYNC)` on the `O_DIRECT` descriptor.
    /// With no page cache in the way, the kernel's sync after such a write
    /// is the same as `fdatasync`'s (file metadata the data needs, then a
    /// device cache flush, which covers every completed write). Falls back
    /// to [`write_at`](BlockDevice::write_at) plus
    /// [`flush`](BlockDevice::flush) when buffered, unaligned, or refused.
    pub(super) fn write_durable(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let write_then_flush = || {
            self.write_at(buf, off)?;
            self.flush()
        };
        let usable = self.dsync.load(Ordering::Relaxed)
            && !buf.is_empty()
            && aligned(off, buf.len())
            && ptr_aligned(buf.as_ptr());
        let Some(d) = self.direct.as_ref().filter(|_| usable) else {
            return write_then_flush();
        };
        use std::os::fd::AsRawFd;
        let iov = libc::iovec {
            iov_base: buf.as_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: one iovec over `buf`, which outlives the call.
        let r =
            unsafe { libc::pwritev2(d.as_raw_fd(), &iov, 1, off as libc::off_t, libc::RWF_DSYNC) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if !matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL)
            ) {
                return Err(e);
            }
            tracing::info!(path = %self.path.display(), "pwritev2(RWF_DSYNC) refused ({e}); writing then flushing");
            self.dsync.store(false, Ordering::Relaxed);
            return write_then_flush();
        }
        if r as usize != buf.len() {
            // Short: the rest was not synced. Write it all again, then flush.
            return write_then_flush();
        }
        Ok(())
    }
}

impl BlockDevice for FileDevice {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let Some(d) = &self.direct else {
            return self.file.read_exact_at(buf, off);
        };
        if buf.is_empty() {
            return Ok(());
        }
        if aligned(off, buf.len()) && ptr_aligned(buf.as_ptr()) {
            return d.read_exact_at(buf, off);
        }
        let start = off / ALIGN * ALIGN;
        let end = (off + buf.len() as u64).div_ceil(ALIGN) * ALIGN;
        let mut b = AlignedBuf::zeroed((end - start) as usize);
        d.read_exact_at(b.as_mut_slice(), start)?;
        let at = (off - start) as usize;
        buf.copy_from_slice(&b.as_slice()[at..at + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let Some(d) = &self.direct else {
            return self.file.write_all_at(buf, off);
        };
        if !aligned(off, buf.len()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("unaligned device write {off}+{}", buf.len()),
            ));
        }
        if ptr_aligned(buf.as_ptr()) {
            return d.write_all_at(buf, off);
        }
        let mut b = AlignedBuf::zeroed(buf.len());
        b.as_mut_slice().copy_from_slice(buf);
        d.write_all_at(b.as_slice(), off)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn write_many(&self, reqs: &[(u64, &[u8])], flush: bool) -> io::Result<()> {
        let Some(((off, buf), rest)) = reqs.split_last().filter(|_| flush) else {
            for (off, buf) in reqs {
                self.write_at(buf, *off)?;
            }
            return if flush { self.flush() } else { Ok(()) };
        };
        for (o, b) in rest {
            self.write_at(b, *o)?;
        }
        self.write_durable(buf, *off)
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        if !self.punch.load(Ordering::Relaxed) {
            return Ok(());
        }
        if !crate::punch_hole(&self.file, off, len)? {
            self.punch.store(false, Ordering::Relaxed);
        }
        Ok(())
    }

    fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    fn name(&self) -> &Path {
        &self.path
    }
}

/// A small deterministic random generator (splitmix64) for fault
/// injection and tests.
#[derive(Debug, Clone)]
pub struct SimRng(u64);

impl SimRng {
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }
}

/// Sector size a torn write is cut at.
pub const SECTOR: usize = 512;

#[derive(Default)]
struct Faults {
    read: bool,
    write: bool,
    flush: bool,
    /// The next I/O of any kind.
    any: bool,
}

struct Faulty {
    /// What survives a power cut for sure.
    durable: Vec<u8>,
    /// What reads see.
    current: Vec<u8>,
    /// Writes since the last flush, in issue order.
    pending: Vec<(u64, Vec<u8>)>,
    /// Power lost: every I/O fails.
    dead: bool,
    fail: Faults,
    /// Writes and flushes left before the power goes.
    die_after: Option<u64>,
    writes: u64,
    flushes: u64,
}

/// An in-memory device for tests. It keeps a durable image and the list of
/// writes not yet flushed; [`power_cut`](Self::power_cut) keeps a random
/// subset of those (in issue order), tearing some at 512-byte sectors.
/// Faults: fail the next read/write/flush, lose power after N more writes
/// or flushes, flip a bit of the media.
pub struct FaultyDevice {
    inner: Mutex<Faulty>,
    name: PathBuf,
}

fn eio(what: &str) -> io::Error {
    io::Error::other(format!("injected fault: {what}"))
}

impl FaultyDevice {
    /// A zeroed device of `len` bytes.
    pub fn new(len: u64) -> FaultyDevice {
        Self::from_image(vec![0u8; len as usize])
    }

    /// A device whose durable contents are `image` (e.g. what survived a
    /// power cut).
    pub fn from_image(image: Vec<u8>) -> FaultyDevice {
        FaultyDevice {
            inner: Mutex::new(Faulty {
                current: image.clone(),
                durable: image,
                pending: Vec::new(),
                dead: false,
                fail: Faults::default(),
                die_after: None,
                writes: 0,
                flushes: 0,
            }),
            name: PathBuf::from("<faulty-device>"),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Faulty> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next read fails with an I/O error.
    pub fn fail_next_read(&self) {
        self.lock().fail.read = true;
    }

    /// The next write fails with an I/O error (and writes nothing).
    pub fn fail_next_write(&self) {
        self.lock().fail.write = true;
    }

    /// The next flush fails with an I/O error (and makes nothing durable).
    pub fn fail_next_flush(&self) {
        self.lock().fail.flush = true;
    }

    /// The next I/O of any kind fails.
    pub fn fail_next_io(&self) {
        self.lock().fail.any = true;
    }

    /// The power goes at the `n`-th write or flush from now (that one fails,
    /// as does every I/O after it).
    pub fn die_after(&self, n: u64) {
        self.lock().die_after = Some(n);
    }

    /// True once the power is gone.
    pub fn is_dead(&self) -> bool {
        self.lock().dead
    }

    /// Cuts the power: the device fails every I/O from now on. Returns the
    /// image a restart finds: the durable image plus a random subset of the
    /// unflushed writes, applied in issue order, some of them torn (a
    /// random prefix, or a random subset, of their 512-byte sectors).
    pub fn power_cut(&self, rng: &mut SimRng) -> Vec<u8> {
        let mut f = self.lock();
        f.dead = true;
        let mut img = std::mem::take(&mut f.durable);
        f.current = Vec::new();
        let pending = std::mem::take(&mut f.pending);
        Self::survivors(&mut img, &pending, rng);
        img
    }

    /// Cuts the power keeping, of the `i`-th unflushed write (at `off`,
    /// `len` bytes), the first `keep(i, off, len)` bytes (whole sectors).
    pub fn power_cut_with(&self, mut keep: impl FnMut(usize, u64, usize) -> usize) -> Vec<u8> {
        let mut f = self.lock();
        f.dead = true;
        let mut img = std::mem::take(&mut f.durable);
        f.current = Vec::new();
        for (i, (off, data)) in std::mem::take(&mut f.pending).iter().enumerate() {
            let n = (keep(i, *off, data.len()).min(data.len()) / SECTOR) * SECTOR;
            let o = *off as usize;
            img[o..o + n].copy_from_slice(&data[..n]);
        }
        img
    }

    /// What a power cut now could leave (the device keeps running).
    pub fn surviving_image(&self, rng: &mut SimRng) -> Vec<u8> {
        let f = self.lock();
        let mut img = f.durable.clone();
        Self::survivors(&mut img, &f.pending, rng);
        img
    }

    fn survivors(img: &mut [u8], pending: &[(u64, Vec<u8>)], rng: &mut SimRng) {
        let keep = rng.below(5); // keep probability in quarters
        for (off, data) in pending {
            if !rng.chance(keep, 4) {
                continue;
            }
            let off = *off as usize;
            let sectors = data.len().div_ceil(SECTOR);
            if sectors > 1 && rng.chance(1, 4) {
                let prefix = rng.chance(1, 2);
                let cut = 1 + rng.below(sectors as u64 - 1) as usize;
                for s in 0..sectors {
                    let keep_s = if prefix { s < cut } else { rng.chance(1, 2) };
                    if keep_s {
                        let a = s * SECTOR;
                        let b = (a + SECTOR).min(data.len());
                        img[off + a..off + b].copy_from_slice(&data[a..b]);
                    }
                }
            } else {
                img[off..off + data.len()].copy_from_slice(data);
            }
        }
    }

    /// Flips one bit of the media (durable and current contents); not
    /// after a power cut.
    pub fn flip_bit(&self, bit: u64) {
        let mut f = self.lock();
        let (byte, mask) = ((bit / 8) as usize, 1u8 << (bit % 8));
        f.current[byte] ^= mask;
        f.durable[byte] ^= mask;
    }

    /// The current contents (what reads see).
    pub fn image(&self) -> Vec<u8> {
        self.lock().current.clone()
    }

    /// Writes and flushes issued so far.
    pub fn io_counts(&self) -> (u64, u64) {
        let f = self.lock();
        (f.writes, f.flushes)
    }

    /// Writes not yet flushed.
    pub fn unflushed(&self) -> usize {
        self.lock().pending.len()
    }

    /// Counts down to a power cut; `Err` when it happens now.
    fn tick(f: &mut Faulty) -> io::Result<()> {
        if f.dead {
            return Err(eio("power lost"));
        }
        if let Some(n) = f.die_after.as_mut() {
            if *n == 0 {
                f.dead = true;
                return Err(eio("power lost"));
            }
            *n -= 1;
        }
        Ok(())
    }

    fn check_range(f: &Faulty, off: u64, len: usize) -> io::Result<()> {
        if off + len as u64 > f.current.len() as u64 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("I/O {off}+{len} past the end of the device"),
            ));
        }
        Ok(())
    }
}

impl BlockDevice for FaultyDevice {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let mut f = self.lock();
        if f.dead {
            return Err(eio("power lost"));
        }
        if std::mem::take(&mut f.fail.read) || std::mem::take(&mut f.fail.any) {
            return Err(eio("read"));
        }
        Self::check_range(&f, off, buf.len())?;
        let off = off as usize;
        buf.copy_from_slice(&f.current[off..off + buf.len()]);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        let mut f = self.lock();
        Self::tick(&mut f)?;
        if std::mem::take(&mut f.fail.write) || std::mem::take(&mut f.fail.any) {
            return Err(eio("write"));
        }
        Self::check_range(&f, off, buf.len())?;
        f.writes += 1;
        let o = off as usize;
        f.current[o..o + buf.len()].copy_from_slice(buf);
        f.pending.push((off, buf.to_vec()));
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        let mut f = self.lock();
        Self::tick(&mut f)?;
        if std::mem::take(&mut f.fail.flush) || std::mem::take(&mut f.fail.any) {
            return Err(eio("flush"));
        }
        f.flushes += 1;
        let pending = std::mem::take(&mut f.pending);
        for (off, data) in pending {
            let o = off as usize;
            f.durable[o..o + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }

    fn len(&self) -> u64 {
        self.lock().current.len() as u64
    }

    /// Discarded ranges read as zeros (an unflushed write of zeros).
    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.write_at(&vec![0u8; len as usize], off)
    }

    fn name(&self) -> &Path {
        &self.name
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A fresh 1 MiB file `d` in `dir`, opened as a [`FileDevice`].
    pub(in crate::log) fn temp_device(dir: &Path) -> (PathBuf, FileDevice) {
        let p = dir.join("d");
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.set_len(1 << 20).unwrap();
        let d = FileDevice::new(f, &p, 1 << 20, false).unwrap();
        (p, d)
    }

    #[test]
    fn faulty_device_keeps_flushed_writes_and_some_others() {
        let d = FaultyDevice::new(64 * 1024);
        d.write_at(&[1u8; 4096], 0).unwrap();
        d.flush().unwrap();
        d.write_at(&[2u8; 4096], 4096).unwrap();
        d.write_at(&[3u8; 4096], 0).unwrap();
        let mut b = [0u8; 4096];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [3u8; 4096]);
        assert_eq!(d.unflushed(), 2);
        let mut seen_torn = false;
        let mut seen = std::collections::HashSet::new();
        for seed in 0..200 {
            let img = d.surviving_image(&mut SimRng::new(seed));
            // Block 0: the flushed 1s, the unflushed 3s, or a mix at sector bounds.
            for s in img[..4096].chunks(SECTOR) {
                assert!(s.iter().all(|&x| x == s[0]) && (s[0] == 1 || s[0] == 3));
            }
            let b1 = &img[4096..8192];
            for s in b1.chunks(SECTOR) {
                assert!(s.iter().all(|&x| x == s[0]) && (s[0] == 0 || s[0] == 2));
            }
            let mixed = |b: &[u8]| b.iter().any(|&x| x != b[0]);
            seen_torn |= mixed(&img[..4096]) || mixed(b1);
            seen.insert((img[0], img[4096]));
        }
        assert!(seen_torn);
        assert_eq!(seen.len(), 4, "{seen:?}");
        assert!(!d.is_dead());
        let img = d.power_cut(&mut SimRng::new(0));
        assert_eq!(img.len(), 64 * 1024);
        assert!(d.is_dead());
        assert!(d.read_at(&mut b, 0).is_err());
        assert!(d.write_at(&b, 0).is_err());
    }

    #[test]
    fn faulty_device_injects_errors_and_bit_flips() {
        let d = FaultyDevice::new(8192);
        d.fail_next_write();
        assert!(d.write_at(&[1u8; 4096], 0).is_err());
        d.write_at(&[1u8; 4096], 0).unwrap();
        d.fail_next_flush();
        assert!(d.flush().is_err());
        assert_eq!(d.unflushed(), 1);
        d.flush().unwrap();
        d.fail_next_read();
        let mut b = [0u8; 4096];
        assert!(d.read_at(&mut b, 0).is_err());
        d.flip_bit(8 * 10 + 3);
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b[10], 1 ^ 8);
        d.die_after(1);
        d.write_at(&[5u8; 4096], 4096).unwrap();
        assert!(d.flush().is_err());
        assert!(d.is_dead());
        let img = d.surviving_image(&mut SimRng::new(1));
        assert_eq!(img[10], 1 ^ 8);
        assert!(d.write_at(&[0u8; 4096], 0).is_err());
    }

    #[test]
    fn file_device_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let (_, d) = temp_device(dir.path());
        assert_eq!(d.len(), 1 << 20);
        // Unaligned memory is bounced; aligned goes straight through.
        let mut v = vec![0u8; 8192 + 1];
        v[1..].fill(7);
        d.write_at(&v[1..], 4096).unwrap();
        let mut a = AlignedBuf::zeroed(8192);
        a.as_mut_slice().fill(9);
        d.write_at(a.as_slice(), 3 * 4096).unwrap();
        d.flush().unwrap();
        let mut r = vec![0u8; 3 * 4096 + 1];
        d.read_at(&mut r[1..], 4096).unwrap();
        assert!(r[1..8193].iter().all(|&x| x == 7));
        assert!(r[8193..].iter().all(|&x| x == 9));
        d.discard(4096, 4096).unwrap();
        let mut z = vec![1u8; 4096];
        d.read_at(&mut z, 4096).unwrap();
        assert!(z.iter().all(|&x| x == 0) || z.iter().all(|&x| x == 7));
        if d.is_direct() {
            assert!(d.write_at(&[0u8; 100], 0).is_err());
        }
    }

    #[test]
    fn durable_writes_are_one_dsync_write_on_direct_files() {
        let dir = tempfile::tempdir().unwrap();
        let (p, d) = temp_device(dir.path());
        let mut a = AlignedBuf::zeroed(8192);
        a.as_mut_slice().fill(4);
        let mut b = AlignedBuf::zeroed(4096);
        b.as_mut_slice().fill(5);
        // Unaligned memory last: bounced, then written and flushed.
        let mut u = vec![0u8; 4096 + 1];
        u[1..].fill(6);
        d.write_many(&[(0, a.as_slice()), (8192, b.as_slice())], true)
            .unwrap();
        d.write_many(&[(16384, &u[1..])], true).unwrap();
        d.write_many(&[(20480, b.as_slice())], false).unwrap();
        let mut r = AlignedBuf::zeroed(6 * 4096);
        d.read_at(r.as_mut_slice(), 0).unwrap();
        let r = r.as_slice();
        assert!(r[..8192].iter().all(|&x| x == 4));
        assert!(r[8192..12288].iter().all(|&x| x == 5));
        assert!(r[12288..16384].iter().all(|&x| x == 0));
        assert!(r[16384..20480].iter().all(|&x| x == 6));
        assert!(r[20480..].iter().all(|&x| x == 5));
        if d.is_direct() {
            // The kernel took RWF_DSYNC (5.x and later do on ext4, xfs and
            // block devices): the fallback was not needed.
            assert!(d.dsync.load(Ordering::Relaxed));
        }
        // A buffered device never uses it, and still writes and flushes.
        let f = OpenOptions::new().read(true).write(true).open(&p).unwrap();
        let bd = FileDevice::buffered(f, &p, 1 << 20, false);
        assert!(!bd.dsync.load(Ordering::Relaxed));
        bd.write_many(&[(0, b.as_slice())], true).unwrap();
        let mut r = vec![0u8; 4096];
        bd.read_at(&mut r, 0).unwrap();
        assert!(r.iter().all(|&x| x == 5));
    }
}
