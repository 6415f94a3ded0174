//! Data-region I/O with `O_DIRECT` where the file system allows it.
//!
//! Buffered writes of random 4 KiB blocks cost more CPU in the page cache
//! and its writeback (at each `fdatasync`) than the copy to the device, so
//! data goes around the page cache. `O_DIRECT` needs the offset, length and
//! memory address aligned to [`ALIGN`]: data is bounced through an aligned
//! buffer, and writes not aligned to it are read-modify-write under a lock
//! that keeps them atomic against other writes of the same store. Where
//! `O_DIRECT` is refused (tmpfs), everything is buffered, as before.
//! Metadata (superblock, tables) always stays buffered: it lives in its own
//! region, and `fdatasync` of the file covers both.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::RwLock;

/// Alignment `O_DIRECT` asks of offsets, lengths and buffers, in bytes.
pub const ALIGN: u64 = 4096;

/// A heap buffer aligned to [`ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is plain owned memory, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to [`ALIGN`]).
    pub fn zeroed(len: usize) -> AlignedBuf {
        let cap = len.max(1).div_ceil(ALIGN as usize) * ALIGN as usize;
        let layout = Layout::from_size_align(cap, ALIGN as usize).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len, layout }
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `zeroed`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The data region's I/O paths.
pub struct DataFile {
    direct: Option<File>,
    buffered: File,
    /// Unaligned writes (read-modify-write) hold it exclusively; aligned
    /// writes share it.
    rmw: RwLock<()>,
}

fn aligned(off: u64, len: usize) -> bool {
    off.is_multiple_of(ALIGN) && (len as u64).is_multiple_of(ALIGN)
}

impl DataFile {
    /// Opens a second descriptor with `O_DIRECT` on `path`; falls back to
    /// buffered I/O through `file` when the file system refuses it.
    pub fn open(path: &Path, file: &File) -> io::Result<DataFile> {
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
        Ok(DataFile {
            direct,
            buffered: file.try_clone()?,
            rmw: RwLock::new(()),
        })
    }

    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    pub fn write_at(&self, data: &[u8], off: u64) -> io::Result<()> {
        let Some(d) = &self.direct else {
            return self.buffered.write_all_at(data, off);
        };
        if data.is_empty() {
            return Ok(());
        }
        if aligned(off, data.len()) {
            let _g = self.rmw.read().unwrap_or_else(|e| e.into_inner());
            let mut b = AlignedBuf::zeroed(data.len());
            b.as_mut_slice().copy_from_slice(data);
            return d.write_all_at(b.as_slice(), off);
        }
        let _g = self.rmw.write().unwrap_or_else(|e| e.into_inner());
        let start = off / ALIGN * ALIGN;
        let end = (off + data.len() as u64).div_ceil(ALIGN) * ALIGN;
        let mut b = AlignedBuf::zeroed((end - start) as usize);
        d.read_exact_at(b.as_mut_slice(), start)?;
        let at = (off - start) as usize;
        b.as_mut_slice()[at..at + data.len()].copy_from_slice(data);
        d.write_all_at(b.as_slice(), start)
    }

    pub fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let Some(d) = &self.direct else {
            return self.buffered.read_exact_at(buf, off);
        };
        if buf.is_empty() {
            return Ok(());
        }
        let start = off / ALIGN * ALIGN;
        let end = (off + buf.len() as u64).div_ceil(ALIGN) * ALIGN;
        let mut b = AlignedBuf::zeroed((end - start) as usize);
        d.read_exact_at(b.as_mut_slice(), start)?;
        let at = (off - start) as usize;
        buf.copy_from_slice(&b.as_slice()[at..at + buf.len()]);
        Ok(())
    }

    /// Writes `len` zero bytes at `off`.
    pub fn zero_at(&self, mut off: u64, mut len: u64) -> io::Result<()> {
        const STEP: u64 = 1 << 20;
        let zeros = AlignedBuf::zeroed(STEP as usize);
        while len > 0 {
            let n = len.min(STEP);
            self.write_at(&zeros.as_slice()[..n as usize], off)?;
            off += n;
            len -= n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn unaligned_io_matches_a_model(ops in proptest::collection::vec((0u64..60_000, 1usize..9000, any::<u8>()), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("f");
            let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&p).unwrap();
            f.set_len(80_000).unwrap();
            let d = DataFile::open(&p, &f).unwrap();
            let mut model = vec![0u8; 80_000];
            for (off, len, v) in ops {
                let data = vec![v; len];
                d.write_at(&data, off).unwrap();
                model[off as usize..off as usize + len].copy_from_slice(&data);
            }
            let mut back = vec![0u8; 70_000];
            d.read_at(&mut back, 3).unwrap();
            prop_assert_eq!(&back[..], &model[3..70_003]);
        }
    }
}
