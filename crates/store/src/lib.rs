//! # shoal-store: the component store of one device
//!
//! Stores the components (of many volumes) that live on one device: a file
//! (created sparse) or a block device. Owns the device's bytes and its
//! on-disk format: the log-structured [`LogStore`] (module [`log`],
//! `docs/store-log-format.md`): every change is an append to a log of
//! checksummed 4 KiB blocks, an in-memory index maps (component, block) to
//! the log, checkpoints and replay make it crash-safe, a cleaner compacts.
//! Knows nothing of the network, replication or the directory.
//!
//! The API is synchronous and thread-safe (`&self`, positional I/O); callers
//! on an async runtime run it on blocking threads. [`GroupCommit`] turns many
//! concurrent durability requests into few device flushes.

mod direct;
mod format;
mod group;
pub mod log;

pub use direct::AlignedBuf;
pub use format::MIN_CAPACITY;
pub use group::{Durable, GroupCommit, SyncFailure};
pub use log::{LogConfig, LogStats, LogStore, ReadAnswer, ReadPlan, ReadReq, Tracked};

use shoal_model::human_size;
use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

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
    /// Data handed to [`LogStore::write_checked`] does not match the CRC
    /// its sender computed: it was damaged on the way; nothing was written.
    #[error("component {component}: the block at byte {offset} does not match the checksum it was sent with")]
    DamagedInTransit { component: u64, offset: u64 },
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
    /// Bytes of mapped (written) blocks.
    pub allocated: u64,
}

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

/// Opens a device read-write (a missing file is created when `create`).
/// A block device is opened exclusively (`O_EXCL`): the kernel refuses it
/// while it is mounted or held by md, LVM or another exclusive opener,
/// which the advisory lock of [`lock_file`] cannot see.
pub(crate) fn open_device_file(path: &Path, create: bool) -> Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let block = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
    let mut o = std::fs::OpenOptions::new();
    o.read(true).write(true);
    if block {
        o.custom_flags(libc::O_EXCL);
    } else if create {
        o.create(true).truncate(false);
    }
    match o.open(path) {
        Ok(f) => Ok(f),
        Err(e) if block && e.raw_os_error() == Some(libc::EBUSY) => {
            Err(StoreError::Io(io::Error::new(
                e.kind(),
                format!(
                    "block device {} is in use by the system (mounted, or held by md, LVM or \
                     another program): {e}",
                    path.display()
                ),
            )))
        }
        Err(e) => Err(e.into()),
    }
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

/// Whether every byte of a regular file is allocated on its file system
/// (a "thick" file, written in full when it was made). Shoal never punches
/// holes in one: writing into holes costs a journal commit per flush and an
/// exclusive inode lock per `O_DIRECT` write on ext4, which a thick file
/// avoids.
pub(crate) fn fully_allocated(file: &File) -> bool {
    use std::os::unix::fs::MetadataExt;
    file.metadata()
        .map(|m| m.blocks().saturating_mul(512) >= m.len() && m.len() > 0)
        .unwrap_or(false)
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

/// Largest component in bytes: the largest volume (just under 4 PiB), far
/// past any device, and small enough that block numbers and byte offsets
/// never overflow.
pub(crate) const MAX_SIZE: u64 = shoal_model::MAX_VOLUME_SIZE;
