//! In-memory exports, for tests, examples and interop checks.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};

use bytes::Bytes;

use crate::{Export, Exports, IoError};

/// A RAM-backed disk image.
#[derive(Debug)]
pub struct MemDisk {
    data: RwLock<Vec<u8>>,
}

impl MemDisk {
    pub fn new(size: usize) -> Self {
        Self {
            data: RwLock::new(vec![0u8; size]),
        }
    }

    /// Copy of the current contents.
    pub fn snapshot(&self) -> Vec<u8> {
        self.data.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn range(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, IoError> {
        let size = self.data.read().unwrap_or_else(|e| e.into_inner()).len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(offset as usize..end as usize),
            _ => Err(IoError::Invalid),
        }
    }

    fn fill(&self, offset: u64, len: u32, byte: u8) -> Result<(), IoError> {
        let r = self.range(offset, len as u64)?;
        self.data.write().unwrap_or_else(|e| e.into_inner())[r].fill(byte);
        Ok(())
    }
}

/// A set of named [`MemDisk`]s; counts open connections.
#[derive(Debug, Default)]
pub struct MemExports {
    disks: BTreeMap<String, Arc<MemDisk>>,
    open: Arc<AtomicUsize>,
}

impl MemExports {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add (or replace) an export of `size` zero bytes; returns its disk.
    pub fn add(&mut self, name: &str, size: usize) -> Arc<MemDisk> {
        let disk = Arc::new(MemDisk::new(size));
        self.disks.insert(name.to_string(), disk.clone());
        disk
    }

    pub fn disk(&self, name: &str) -> Option<Arc<MemDisk>> {
        self.disks.get(name).cloned()
    }

    /// Number of currently open [`MemHandle`]s (i.e. live connections + in-progress INFO).
    pub fn open_handles(&self) -> usize {
        self.open.load(Ordering::SeqCst)
    }
}

/// An opened [`MemDisk`]; decrements the open counter on drop.
#[derive(Debug)]
pub struct MemHandle {
    disk: Arc<MemDisk>,
    open: Arc<AtomicUsize>,
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Exports for MemExports {
    type Export = MemHandle;

    fn list(&self) -> impl Future<Output = Vec<String>> + Send {
        let names = self.disks.keys().cloned().collect();
        async move { names }
    }

    fn open(&self, name: &str) -> impl Future<Output = Result<MemHandle, String>> + Send {
        let r = match self.disks.get(name) {
            Some(disk) => {
                self.open.fetch_add(1, Ordering::SeqCst);
                Ok(MemHandle {
                    disk: disk.clone(),
                    open: self.open.clone(),
                })
            }
            None => Err(format!("no export named {name:?}")),
        };
        async move { r }
    }
}

impl Export for MemHandle {
    fn size(&self) -> u64 {
        self.disk
            .data
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len() as u64
    }

    fn multi_conn(&self) -> bool {
        true
    }

    fn read(
        &self,
        offset: u64,
        len: u32,
    ) -> impl Future<Output = Result<Bytes, IoError>> + Send + 'static {
        let r = self.disk.range(offset, len as u64).map(|r| {
            Bytes::copy_from_slice(&self.disk.data.read().unwrap_or_else(|e| e.into_inner())[r])
        });
        async move { r }
    }

    fn write(
        &self,
        offset: u64,
        data: Bytes,
        _fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        let r = self
            .disk
            .range(offset, data.len() as u64)
            .map_err(|_| IoError::NoSpace)
            .map(|r| {
                self.disk.data.write().unwrap_or_else(|e| e.into_inner())[r].copy_from_slice(&data);
            });
        async move { r }
    }

    fn flush(&self) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        // Nothing to flush; not an `async fn`, whose future would borrow
        // `self` (the trait wants futures that own what they need).
        std::future::ready(Ok(()))
    }

    fn trim(
        &self,
        offset: u64,
        len: u32,
        _fua: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        // Discarded blocks read back as zeroes.
        let r = self.disk.fill(offset, len, 0);
        async move { r }
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        _fua: bool,
        _may_trim: bool,
    ) -> impl Future<Output = Result<(), IoError>> + Send + 'static {
        let r = self.disk.fill(offset, len, 0).map_err(|_| IoError::NoSpace);
        async move { r }
    }
    fn request_started(&self) {}
    fn request_ended(&self) {}
}
