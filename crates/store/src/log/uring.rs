//! A [`BlockDevice`] that submits batches of I/O through io_uring.
//!
//! Single reads gain nothing from a ring (the caller blocks either way and
//! a `pread` is one system call), so they stay positional I/O on the
//! wrapped [`FileDevice`]. The ring carries
//! [`read_many`](BlockDevice::read_many) (a read of scattered blocks and
//! their batch headers: one submission instead of a `pread` per run). The
//! log's writes stay positional on the calling thread, the last one
//! carrying its flush (`RWF_DSYNC`, see `FileDevice::write_durable`):
//! io_uring runs every fsync on a kernel worker thread, and an O_DIRECT
//! write submitted to a ring and waited for cost more than a `pwrite`, so
//! both measured slower through the cluster (bench/RESULTS.md, 2026-11-30,
//! the log's writes: io_uring against positional).
//!
//! Rings are pooled: a call takes one (or creates one), submits, reaps all
//! its completions and puts it back, so threads never share a ring's
//! completions. If ring setup is refused (`EPERM` under seccomp, `ENOSYS`,
//! `ENOMEM` under a small `RLIMIT_MEMLOCK`), [`open_file_device`] falls
//! back to the plain [`FileDevice`] and says so once.

use super::device::{BlockDevice, FileDevice};
use crate::direct::ALIGN;
use io_uring::{opcode, squeue, types, IoUring};
use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex, Once};

/// Entries per ring (and requests per submission).
const DEPTH: u32 = 128;
/// Rings kept for reuse.
const POOL: usize = 64;

static CHOICE: Once = Once::new();

/// Opens the data path of a file or block device: io_uring for batched
/// reads when the kernel allows it, positional I/O otherwise. The choice is
/// logged once per process.
pub fn open_file_device(
    file: File,
    path: &Path,
    len: u64,
    block: bool,
) -> io::Result<Arc<dyn BlockDevice>> {
    let dev = FileDevice::new(file, path, len, block)?;
    match UringDevice::new(dev) {
        Ok(u) => {
            CHOICE.call_once(|| tracing::info!("device I/O: io_uring for batched reads"));
            Ok(Arc::new(u))
        }
        Err((dev, e)) => {
            CHOICE.call_once(
                || tracing::warn!(error = %e, "io_uring refused; device I/O falls back to positional reads and writes"),
            );
            Ok(Arc::new(dev))
        }
    }
}

/// A file device whose batched I/O goes through io_uring.
pub struct UringDevice {
    file: FileDevice,
    rings: Mutex<Vec<IoUring>>,
}

fn lock(m: &Mutex<Vec<IoUring>>) -> std::sync::MutexGuard<'_, Vec<IoUring>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl UringDevice {
    /// Wraps `file`; gives it back with the error if no ring can be set up.
    pub fn new(file: FileDevice) -> Result<UringDevice, (FileDevice, io::Error)> {
        match IoUring::new(DEPTH) {
            Ok(r) => Ok(UringDevice {
                file,
                rings: Mutex::new(vec![r]),
            }),
            Err(e) => Err((file, e)),
        }
    }

    fn take_ring(&self) -> io::Result<IoUring> {
        match lock(&self.rings).pop() {
            Some(r) => Ok(r),
            None => IoUring::new(DEPTH),
        }
    }

    fn put_ring(&self, r: IoUring) {
        let mut p = lock(&self.rings);
        if p.len() < POOL {
            p.push(r);
        }
    }

    /// Submits `entries` (user data = index) and waits for every one of
    /// them; returns their results. Never returns while the kernel may
    /// still touch a buffer of the caller.
    fn run(&self, entries: &[squeue::Entry]) -> io::Result<Vec<i32>> {
        let mut res = vec![0i32; entries.len()];
        let mut ring = self.take_ring()?;
        for (c, chunk) in entries.chunks(DEPTH as usize).enumerate() {
            let base = c * DEPTH as usize;
            // SAFETY: every entry points at memory the caller keeps alive
            // and does not touch until this function returns, which is only
            // after all completions of this chunk are reaped below.
            unsafe {
                if ring.submission().push_multiple(chunk).is_err() {
                    // Cannot happen: the queue is empty and a chunk fits.
                    return Err(io::Error::other("io_uring submission queue full"));
                }
            }
            let mut left = chunk.len();
            let mut submitted = false;
            while left > 0 {
                match ring.submit_and_wait(1) {
                    Ok(_) => submitted = true,
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                        ) =>
                    {
                        continue
                    }
                    Err(e) if !submitted => {
                        // Nothing reached the kernel; the ring is dropped
                        // (its queue holds our entries).
                        return Err(e);
                    }
                    Err(e) => {
                        // Requests may be in flight into the caller's
                        // buffers: returning would be unsound.
                        eprintln!("shoal-store: io_uring wait failed with I/O in flight: {e}");
                        std::process::abort();
                    }
                }
                for cqe in ring.completion() {
                    let i = base + cqe.user_data() as usize;
                    if let Some(r) = res.get_mut(i) {
                        *r = cqe.result();
                    }
                    left -= 1;
                }
            }
        }
        self.put_ring(ring);
        Ok(res)
    }

    fn direct_ok(&self, off: u64, buf: *const u8, len: usize) -> bool {
        !self.file.is_direct()
            || (off.is_multiple_of(ALIGN)
                && (len as u64).is_multiple_of(ALIGN)
                && (buf as usize).is_multiple_of(ALIGN as usize))
    }
}

fn err_of(r: i32) -> io::Error {
    io::Error::from_raw_os_error(-r)
}

impl BlockDevice for UringDevice {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        self.file.read_at(buf, off)
    }

    fn write_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.file.write_at(buf, off)
    }

    fn flush(&self) -> io::Result<()> {
        self.file.flush()
    }

    fn read_many(&self, reqs: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        if reqs.len() < 2 {
            for (off, buf) in reqs.iter_mut() {
                self.file.read_at(buf, *off)?;
            }
            return Ok(());
        }
        let fd = types::Fd(self.file.io_fd());
        let mut entries = Vec::with_capacity(reqs.len());
        let mut ring_idx = Vec::with_capacity(reqs.len());
        for (i, (off, buf)) in reqs.iter_mut().enumerate() {
            if buf.is_empty() || !self.direct_ok(*off, buf.as_ptr(), buf.len()) {
                continue;
            }
            let n = entries.len() % DEPTH as usize;
            entries.push(
                opcode::Read::new(fd, buf.as_mut_ptr(), buf.len() as u32)
                    .offset(*off)
                    .build()
                    .user_data(n as u64),
            );
            ring_idx.push(i);
        }
        let res = self.run(&entries)?;
        let mut done = vec![false; reqs.len()];
        for (k, &i) in ring_idx.iter().enumerate() {
            let r = res[k];
            if r < 0 {
                return Err(err_of(r));
            }
            // A short read (end of file, or the kernel cut it): finish it
            // with a plain read of the whole range.
            done[i] = r as usize == reqs[i].1.len();
        }
        for (i, (off, buf)) in reqs.iter_mut().enumerate() {
            if !done[i] && !buf.is_empty() {
                self.file.read_at(buf, *off)?;
            }
        }
        Ok(())
    }

    fn write_many(&self, reqs: &[(u64, &[u8])], flush: bool) -> io::Result<()> {
        // Positional writes, the last one durable if `flush` (see the
        // module doc for why not on the ring).
        self.file.write_many(reqs, flush)
    }

    fn len(&self) -> u64 {
        self.file.len()
    }

    fn discard(&self, off: u64, len: u64) -> io::Result<()> {
        self.file.discard(off, len)
    }

    fn ring_fd(&self) -> Option<(std::os::fd::RawFd, bool)> {
        Some((self.file.io_fd(), self.file.is_direct()))
    }

    fn is_direct(&self) -> bool {
        self.file.is_direct()
    }

    fn name(&self) -> &Path {
        self.file.name()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::direct::AlignedBuf;

    #[test]
    fn uring_device_reads_and_writes_many() {
        let dir = tempfile::tempdir().unwrap();
        let (_, file) = super::super::device::tests::temp_device(dir.path());
        // Where rings are refused the same checks run on the positional
        // fallback (and say so).
        let dev: Box<dyn BlockDevice> = match UringDevice::new(file) {
            Ok(u) => Box::new(u),
            Err((file, e)) => {
                eprintln!("io_uring refused ({e}); checking the positional fallback");
                Box::new(file)
            }
        };
        // Several writes and a flush in one call, then scattered reads
        // (more than a ring holds) in one call.
        let mut bufs: Vec<AlignedBuf> = (0..200u8)
            .map(|i| {
                let mut b = AlignedBuf::zeroed(4096);
                b.as_mut_slice().fill(i);
                b
            })
            .collect();
        let reqs: Vec<(u64, &[u8])> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| (((i * 7) % 256) as u64 * 4096, b.as_slice()))
            .collect();
        // 7 is coprime to 256: the offsets are distinct.
        dev.write_many(&reqs, true).unwrap();
        for b in bufs.iter_mut() {
            b.as_mut_slice().fill(0xee);
        }
        let mut reqs: Vec<(u64, &mut [u8])> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| (((i * 7) % 256) as u64 * 4096, b.as_mut_slice()))
            .collect();
        dev.read_many(&mut reqs).unwrap();
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.as_slice().iter().all(|&x| x == i as u8), "block {i}");
        }
        // A read past the end fails rather than returning garbage.
        let mut a = AlignedBuf::zeroed(4096);
        let mut c = AlignedBuf::zeroed(4096);
        let mut reqs: Vec<(u64, &mut [u8])> =
            vec![(0, a.as_mut_slice()), (1 << 20, c.as_mut_slice())];
        assert!(dev.read_many(&mut reqs).is_err());
    }
}
