//! Aligned memory for `O_DIRECT` I/O.
//!
//! Buffered writes of random 4 KiB blocks cost more CPU in the page cache
//! and its writeback (at each `fdatasync`) than the copy to the device, so
//! the log goes around the page cache where the file system allows it.
//! `O_DIRECT` needs the offset, length and memory address aligned to
//! [`ALIGN`]; [`AlignedBuf`] gives such memory.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;
use std::sync::Mutex;

/// Single-block buffers kept for [`AlignedBuf::for_reading`] (most reads
/// of 4 KiB need exactly one): an aligned, zeroed allocation is a slow
/// path of the allocator and a 4 KiB `memset` on every read otherwise
/// (about 2% of a node's runtime thread at 45k reads/s).
static SPARE_BLOCKS: Mutex<Vec<SpareBlock>> = Mutex::new(Vec::new());

/// Most buffers [`SPARE_BLOCKS`] keeps, in buffers (16 MiB at most: the
/// reads a few clients keep in flight need far fewer).
const MAX_SPARE_BLOCKS: usize = 4096;

/// A single-block allocation of [`AlignedBuf`]'s layout, not in use.
struct SpareBlock(NonNull<u8>);

// SAFETY: plain owned memory nobody else refers to.
unsafe impl Send for SpareBlock {}

/// Alignment `O_DIRECT` asks of offsets, lengths and buffers, in bytes.
pub const ALIGN: u64 = 4096;

/// A heap buffer aligned to [`ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: the buffer is plain owned memory, like a Vec<u8>: shared
// references only read it, mutation needs `&mut`.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above.
unsafe impl Sync for AlignedBuf {}

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

    /// A buffer of `len` bytes for the device to fill: its contents are
    /// unspecified (initialised, but possibly an earlier read's bytes), so
    /// the caller must read only what the device wrote. One block
    /// (the usual 4 KiB read) is reused from earlier reads when one is
    /// spare; anything else is [`zeroed`](Self::zeroed).
    pub fn for_reading(len: usize) -> AlignedBuf {
        if len > 0 && len <= ALIGN as usize {
            let spare = SPARE_BLOCKS.lock().ok().and_then(|mut v| v.pop());
            if let Some(SpareBlock(ptr)) = spare {
                let layout =
                    Layout::from_size_align(ALIGN as usize, ALIGN as usize).expect("valid layout");
                return AlignedBuf { ptr, len, layout };
            }
        }
        AlignedBuf::zeroed(len)
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

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.layout.size() == ALIGN as usize {
            if let Ok(mut spare) = SPARE_BLOCKS.lock() {
                if spare.len() < MAX_SPARE_BLOCKS {
                    // Its bytes stay initialised: `for_reading` hands it out.
                    spare.push(SpareBlock(self.ptr));
                    return;
                }
            }
        }
        // SAFETY: allocated with this layout in `zeroed`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Single-block buffers come back for reading; `zeroed` never hands
    /// out a used one; other sizes are never kept.
    #[test]
    fn spare_blocks_are_reused_for_reading_only() {
        for _ in 0..100 {
            let mut a = AlignedBuf::for_reading(4096);
            assert_eq!(a.as_slice().len(), 4096);
            assert_eq!(a.as_slice().as_ptr() as usize % ALIGN as usize, 0);
            a.as_mut_slice().fill(0xEE);
            drop(a);
            // Tests run in parallel threads: another may take the spare
            // meanwhile, but a zeroed buffer is zeroed whatever the pool
            // holds.
            let z = AlignedBuf::zeroed(4096);
            assert!(z.as_slice().iter().all(|&b| b == 0));
            let small = AlignedBuf::for_reading(512);
            assert_eq!(small.as_slice().len(), 512);
            let big = AlignedBuf::for_reading(3 * 4096);
            assert_eq!(big.as_slice().len(), 3 * 4096);
            assert_eq!(big.layout.size(), 3 * 4096);
        }
        // A dropped single-block buffer becomes a spare (another test's
        // read may take it at once: try a few times).
        let kept = (0..100).any(|_| {
            let a = AlignedBuf::for_reading(4096);
            let p = a.ptr.as_ptr() as usize;
            drop(a);
            SPARE_BLOCKS
                .lock()
                .unwrap()
                .iter()
                .any(|s| s.0.as_ptr() as usize == p)
        });
        assert!(kept, "a single-block buffer was not kept");
        assert!(SPARE_BLOCKS.lock().unwrap().len() <= MAX_SPARE_BLOCKS);
    }
}
