//! Aligned memory for `O_DIRECT` I/O.
//!
//! Buffered writes of random 4 KiB blocks cost more CPU in the page cache
//! and its writeback (at each `fdatasync`) than the copy to the device, so
//! the log goes around the page cache where the file system allows it.
//! `O_DIRECT` needs the offset, length and memory address aligned to
//! [`ALIGN`]; [`AlignedBuf`] gives such memory.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

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
        // SAFETY: allocated with this layout in `zeroed`.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
