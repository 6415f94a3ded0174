//! A node's devices: which it opens at start, and adding and removing
//! them while it runs (`shoal device add`, `shoal device remove`;
//! `docs/reconfiguration.md`, Adding and removing devices).
//!
//! - The identity file remembers, besides the node and its cluster, each
//!   device's directory id, the devices added while the node ran (opened
//!   again at every start, with the command line's) and the ones removed
//!   (not opened again even if the command line still names them).
//! - Adding opens the device (formatting it when it is new or all zeros at
//!   its start; anything else that is not a device of this cluster is
//!   refused, so no one's data is formatted by a typo), registers it, and
//!   serves it at once.
//! - Removing is the directory's `RetireDevice`; this node's loop
//!   ([`DeviceSet::spawn_removals`]) then moves the components off each of
//!   its retiring devices (one change of layout per volume, placed like a
//!   rebuild: another device, of the same node only when no other fault
//!   domain is free), and once none is left closes the device, records it
//!   removed, and unregisters it. A crash anywhere in between leaves a
//!   state the loop completes after the restart.
//!
//! Owns the device lists and the opening of a device; a component's data
//! is the replica side's, and placement is `shoal_placement`'s.

pub mod http;

use crate::replica::{Device, Replicas, Store};
use crate::{DeviceSpec, NodeTuning};
use serde::{Deserialize, Serialize};
use shoal_api::{DeviceAdded, DeviceRemoval};
use shoal_directory::{ClusterState, Command, Directory, DirectoryError, Response};
use shoal_model::{ComponentId, DeviceId, NodeId, VolumeId};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Seconds between two passes of the removal loop.
pub const REMOVAL_PASS_S: u64 = 2;

/// Bytes at the start of an existing file or block device that must all
/// be zero before it is formatted: more than any partition table or file
/// system superblock puts before its first megabyte.
const UNUSED_PREFIX_BYTES: usize = 1 << 20;

/// Longest device path taken, in bytes (Linux's `PATH_MAX`).
const MAX_PATH_BYTES: usize = 4096;

/// Mode of a device file: volumes' data is readable by no other user.
const DEVICE_FILE_MODE: u32 = 0o600;

/// Version of the identity file written now. Version 1 had no field of
/// its own and no device lists besides `devices`; version 2 had no
/// `store_uuids`.
const IDENTITY_VERSION: u32 = 3;

const IDENTITY: &str = "identity.json";

/// What a data folder remembers about the node that owns it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Identity {
    #[serde(default = "version_one")]
    pub version: u32,
    pub node_id: NodeId,
    pub cluster_id: String,
    /// Device path → directory id, so the replica side can start serving
    /// before the directory is reachable.
    pub devices: Vec<(String, DeviceId)>,
    /// Devices added while the node ran (`shoal device add`).
    #[serde(default)]
    pub added: Vec<DeviceSpec>,
    /// Paths of devices removed while the node ran: not opened again.
    #[serde(default)]
    pub removed: Vec<String>,
    /// Directory id → the uuid of the store it was registered with: a
    /// path that names another disk by now (disks moved) is not served
    /// under the old id.
    #[serde(default)]
    pub store_uuids: Vec<(DeviceId, u64)>,
}

fn version_one() -> u32 {
    1
}

impl Identity {
    pub fn new(node_id: NodeId, cluster_id: String) -> Identity {
        Identity {
            version: IDENTITY_VERSION,
            node_id,
            cluster_id,
            devices: Vec::new(),
            added: Vec::new(),
            removed: Vec::new(),
            store_uuids: Vec::new(),
        }
    }

    /// The directory id the store `uuid` found at `path` was registered
    /// under: the id recorded with that uuid, wherever the store was; else
    /// the id recorded for `path`, unless that id was recorded with
    /// another store (then `path` names another disk now: None).
    pub fn device_for(&self, path: &str, uuid: u64) -> Option<DeviceId> {
        if let Some((id, _)) = self.store_uuids.iter().find(|(_, u)| *u == uuid) {
            return Some(*id);
        }
        let (_, id) = self.devices.iter().find(|(p, _)| p == path)?;
        match self.store_uuids.iter().find(|(i, _)| i == id) {
            Some(_) => None,
            None => Some(*id),
        }
    }

    /// Records that device `id` is the store `uuid` at `path`.
    pub fn record(&mut self, path: &str, id: DeviceId, uuid: u64) {
        self.devices.retain(|(p, i)| p != path && *i != id);
        self.devices.push((path.to_string(), id));
        self.store_uuids.retain(|(i, u)| *i != id && *u != uuid);
        self.store_uuids.push((id, uuid));
    }

    /// The devices to open at start: the command line's, less the ones
    /// removed, then the ones added (`true`: added while the node ran).
    pub fn to_open(&self, command_line: &[DeviceSpec]) -> Vec<(DeviceSpec, bool)> {
        let removed = |p: &Path| self.removed.iter().any(|r| Path::new(r) == p);
        let mut out: Vec<(DeviceSpec, bool)> = command_line
            .iter()
            .filter(|d| !removed(&d.path))
            .map(|d| (d.clone(), false))
            .collect();
        for a in &self.added {
            if !out.iter().any(|(d, _)| d.path == a.path) {
                out.push((a.clone(), true));
            }
        }
        out
    }
}

pub(crate) fn load_identity(dir: &Path) -> anyhow::Result<Option<Identity>> {
    use anyhow::Context;
    let p = dir.join(IDENTITY);
    match std::fs::read(&p) {
        Ok(b) => {
            let id: Identity = serde_json::from_slice(&b)
                .with_context(|| format!("{} is damaged", p.display()))?;
            if id.version > IDENTITY_VERSION {
                anyhow::bail!(
                    "{} is of version {}, newer than this binary's {IDENTITY_VERSION}",
                    p.display(),
                    id.version
                );
            }
            Ok(Some(id))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

/// Writes the identity file whole (a new file renamed over the old one).
pub(crate) fn save_identity(dir: &Path, id: &Identity) -> std::io::Result<()> {
    let mut id = id.clone();
    id.version = IDENTITY_VERSION;
    let p = dir.join(IDENTITY);
    let tmp = dir.join(format!("{IDENTITY}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&id)?)?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, &p)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Why a device cannot be added.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{path} is already device {device} of node {node}")]
    AlreadyAdded {
        path: String,
        device: DeviceId,
        node: NodeId,
    },
    #[error(
        "{0} holds data that is not a device of this cluster (its first MiB is not all \
         zeros): refusing to format it"
    )]
    NotEmpty(String),
    #[error("device {path}: {error}")]
    Open { path: String, error: String },
    #[error(transparent)]
    Directory(#[from] DirectoryError),
}

/// Makes `path` a file of `size` bytes of zeros, all allocated (mode
/// 0600 from the start): created, or, when it exists without being a
/// device yet (a thick add cut short, an empty sparse file), written over
/// in full. The caller has checked that it holds nothing.
pub(crate) fn create_thick(path: &Path, size: u64) -> std::io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(DEVICE_FILE_MODE)
        .open(path)?;
    let m = f.metadata()?;
    if !m.is_file() || (m.len() >= size && m.blocks().saturating_mul(512) >= m.len()) {
        return Ok(());
    }
    f.seek(SeekFrom::Start(0))?;
    let zeros = vec![0u8; 8 << 20];
    let mut left = size;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        f.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    f.sync_all()
}

/// Opens (or formats) the device of `spec` for `cluster_id` and starts its
/// store's background cleaner.
pub(crate) fn open_store(spec: &DeviceSpec, cluster_id: &str) -> anyhow::Result<Arc<Store>> {
    use anyhow::Context;
    let path = &spec.path;
    // Formatted only when new or empty: never a disk or file holding data
    // that is not a device (a typo on a command line).
    let formatted = match Store::identify(path) {
        Ok(found) => found.is_some(),
        // Not there yet: created below.
        Err(shoal_store::StoreError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => anyhow::bail!(
            "{} starts like a Shoal device but its superblock cannot be read ({e}): refusing \
             to format it",
            path.display()
        ),
    };
    if !formatted && !unused(path).with_context(|| format!("reading {}", path.display()))? {
        anyhow::bail!(
            "{} holds data that is not a device of a Shoal cluster: refusing to format it \
             (wipe it first if it is meant to be one)",
            path.display()
        );
    }
    if spec.thick && spec.size > 0 && !formatted {
        create_thick(path, spec.size).with_context(|| format!("creating {}", path.display()))?;
    }
    let s = Store::open_or_create(path, spec.size, cluster_id)
        .with_context(|| format!("device {}", path.display()))?;
    if std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        // A file system that keeps its own modes (FUSE) may refuse.
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::Permissions::from_mode(DEVICE_FILE_MODE);
        if let Err(e) = std::fs::set_permissions(path, mode) {
            tracing::warn!(error = %e, "device file {} readable by others", path.display());
        }
    }
    let s = Arc::new(s);
    s.start_background()
        .with_context(|| format!("cleaner thread for {}", path.display()))?;
    Ok(s)
}

/// Opens a device added while the node ran, at a later start: only as
/// the device of this cluster it was formatted as. Never creates or
/// formats anything (the path may now name another disk, or a file
/// system that failed to mount).
pub(crate) fn open_added(spec: &DeviceSpec, cluster_id: &str) -> anyhow::Result<Arc<Store>> {
    use anyhow::Context;
    let path = &spec.path;
    let s = Store::open(path).with_context(|| format!("device {}", path.display()))?;
    if s.cluster_id() != cluster_id {
        anyhow::bail!(
            "device {} belongs to cluster {}, not {cluster_id}",
            path.display(),
            s.cluster_id()
        );
    }
    let s = Arc::new(s);
    s.start_background()
        .with_context(|| format!("cleaner thread for {}", path.display()))?;
    Ok(s)
}

/// Bytes read at each place [`unused`] samples beyond the ends.
const UNUSED_SAMPLE_BYTES: u64 = 64 << 10;
/// Places [`unused`] samples beyond the ends: the starts of a file's
/// first data extents, or points spread over a block device.
const UNUSED_SAMPLES: u64 = 64;

/// Whether `path` may be formatted: it does not exist, or it reads as
/// zeros where data would show: its first and last
/// [`UNUSED_PREFIX_BYTES`], [`UNUSED_SAMPLE_BYTES`] at
/// [`UNUSED_SAMPLES`] points spread over it, and, in a file, as much at
/// the start of each of its first [`UNUSED_SAMPLES`] data extents (its
/// holes are zeros). A wiped partition table over a disk still full of
/// data is found so.
fn unused(path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    use std::os::unix::fs::FileTypeExt;
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(e),
    };
    let len = existing_len(path)?;
    let block = f.metadata()?.file_type().is_block_device();
    let prefix = UNUSED_PREFIX_BYTES as u64;
    let mut places = vec![(0, prefix), (len.saturating_sub(prefix), prefix)];
    let step = len / (UNUSED_SAMPLES + 1);
    places.extend((1..=UNUSED_SAMPLES).map(|i| (i * step, UNUSED_SAMPLE_BYTES)));
    if !block {
        let starts = data_starts(&f, len)?;
        places.extend(starts.into_iter().map(|at| (at, UNUSED_SAMPLE_BYTES)));
    }
    let mut buf = vec![0u8; UNUSED_PREFIX_BYTES];
    for (at, n) in places {
        let n = n.min(len.saturating_sub(at)) as usize;
        let got = f.read_at(&mut buf[..n], at)?;
        if buf[..got].iter().any(|&b| b != 0) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Where the first [`UNUSED_SAMPLES`] data extents of a file start.
fn data_starts(f: &std::fs::File, len: u64) -> std::io::Result<Vec<u64>> {
    use std::os::fd::AsRawFd;
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < len && (out.len() as u64) < UNUSED_SAMPLES {
        // SAFETY: lseek on a descriptor we own, with integer arguments;
        // the position it moves is used by nothing (reads are positional).
        let d = unsafe { libc::lseek(f.as_raw_fd(), pos as libc::off_t, libc::SEEK_DATA) };
        if d < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENXIO) => Ok(out),
                _ => Err(e),
            };
        }
        let d = d as u64;
        out.push(d);
        // SAFETY: as above.
        let h = unsafe { libc::lseek(f.as_raw_fd(), d as libc::off_t, libc::SEEK_HOLE) };
        if h < 0 || (h as u64) <= d {
            return Ok(out);
        }
        pos = h as u64;
    }
    Ok(out)
}

/// Checks an [`shoal_api::AddDevice`]'s own fields.
pub fn check_request(req: &shoal_api::AddDevice) -> Result<DeviceSpec, AddError> {
    let bad = |m: String| Err(AddError::BadRequest(m));
    if req.path.len() > MAX_PATH_BYTES || req.path.chars().any(char::is_control) {
        return bad(format!(
            "a device path is at most {MAX_PATH_BYTES} bytes, without control characters \
             (NUL, newline, ...)"
        ));
    }
    let path = PathBuf::from(&req.path);
    if !path.is_absolute() || path.components().any(|c| c.as_os_str() == "..") {
        return bad(format!(
            "the device path {:?} must be absolute, without \"..\"",
            req.path
        ));
    }
    if let Some(size) = req.size_bytes {
        if size < shoal_store::MIN_CAPACITY {
            return bad(format!(
                "a device of {size} bytes is too small: at least {} bytes",
                shoal_store::MIN_CAPACITY
            ));
        }
    }
    if req.thick && req.size_bytes.is_none() {
        return bad("a thick device file needs its size".into());
    }
    Ok(DeviceSpec {
        path,
        size: req.size_bytes.unwrap_or(0),
        thick: req.thick,
    })
}

/// Where the removal of each of this node's retiring devices stands, as
/// its last pass found it.
type Blocked = BTreeMap<DeviceId, String>;

/// This node's devices while it runs.
pub struct DeviceSet {
    node: NodeId,
    cluster_id: String,
    data_dir: PathBuf,
    tuning: NodeTuning,
    /// The devices of the command line (the identity records a removed
    /// one so it is not opened again).
    command_line: Vec<DeviceSpec>,
    dir: Directory,
    replicas: Arc<Replicas>,
    /// The identity file as last written; one change at a time.
    identity: tokio::sync::Mutex<Identity>,
    blocked: Mutex<Blocked>,
    /// Why each recorded add this node does not serve is not, as the
    /// last pass found it (logged when it changes).
    incomplete: Mutex<BTreeMap<String, String>>,
}

impl DeviceSet {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        node: NodeId,
        cluster_id: String,
        data_dir: PathBuf,
        tuning: NodeTuning,
        command_line: Vec<DeviceSpec>,
        dir: Directory,
        replicas: Arc<Replicas>,
        identity: Identity,
    ) -> Arc<DeviceSet> {
        Arc::new(DeviceSet {
            node,
            cluster_id,
            data_dir,
            tuning,
            command_line,
            dir,
            replicas,
            identity: tokio::sync::Mutex::new(identity),
            blocked: Mutex::new(Blocked::new()),
            incomplete: Mutex::new(BTreeMap::new()),
        })
    }

    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Opens (or formats) the device `spec` on this node, registers it
    /// and serves it, on a task of its own: a caller that goes away (a
    /// client timing out while a thick file is written) does not cut it
    /// short between its steps.
    pub async fn add(self: &Arc<Self>, spec: DeviceSpec) -> Result<DeviceAdded, AddError> {
        let me = self.clone();
        let path = spec.path.display().to_string();
        tokio::spawn(async move { me.add_now(spec).await })
            .await
            .map_err(|e| AddError::Open {
                path,
                error: e.to_string(),
            })?
    }

    /// The steps of [`add`](Self::add). The device is recorded in the
    /// identity file (as added) before it is registered, so a crash after
    /// the registration leaves a device the next start opens; a path the
    /// directory has for this node but the node does not serve (such an
    /// add cut short) is opened and served under its id. A path served
    /// already is refused, naming the device it is.
    async fn add_now(&self, spec: DeviceSpec) -> Result<DeviceAdded, AddError> {
        let mut ident = self.identity.lock().await;
        let path = spec.path.display().to_string();
        let registered = self
            .dir
            .state()
            .devices
            .values()
            .find(|d| d.node == self.node && d.path == path)
            .map(|d| (d.id, d.retiring));
        let served = self.replicas.devices().iter().any(|d| d.path == path);
        match registered {
            Some((device, false)) if served => {
                return Err(AddError::AlreadyAdded {
                    path,
                    device,
                    node: self.node,
                })
            }
            Some((_, true)) => {
                return Err(AddError::BadRequest(format!(
                    "{path} is being removed from this node"
                )))
            }
            _ if served => {
                return Err(AddError::BadRequest(format!(
                    "{path} is still being removed from this node"
                )))
            }
            _ => {}
        }
        self.check_not_elsewhere(&spec.path, &path)?;
        let (s2, cluster, data) = (spec.clone(), self.cluster_id.clone(), self.data_dir.clone());
        let opened = tokio::task::spawn_blocking(move || open_new(&s2, &cluster, &data))
            .await
            .map_err(|e| AddError::Open {
                path: path.clone(),
                error: e.to_string(),
            })??;
        self.check_components(&path, &opened, registered.map(|(id, _)| id))?;
        let mut next = ident.clone();
        next.removed.retain(|p| *p != path);
        if !self.command_line.iter().any(|d| d.path == spec.path) {
            next.added.retain(|d| d.path != spec.path);
            next.added.push(spec);
        }
        self.save(&next)?;
        *ident = next;
        self.register_and_serve(&mut ident, path, opened).await
    }

    /// Registers the store `opened` at `path` (the same id again when it
    /// is registered already), serves it, and records it in the identity
    /// file.
    async fn register_and_serve(
        &self,
        ident: &mut Identity,
        path: String,
        opened: Arc<Store>,
    ) -> Result<DeviceAdded, AddError> {
        let (capacity, uuid) = (opened.capacity(), opened.uuid());
        let r = self
            .dir
            .propose(Command::RegisterDevice {
                node: self.node,
                path: path.clone(),
                capacity,
                store_uuid: uuid,
            })
            .await?;
        let Response::Id(id) = r else {
            return Err(AddError::Open {
                path,
                error: format!("unexpected answer to its registration: {r:?}"),
            });
        };
        let dev =
            Device::new(id, path.clone(), opened, &self.tuning).map_err(|e| AddError::Open {
                path: path.clone(),
                error: format!("starting its threads: {e}"),
            })?;
        self.replicas.add_device(dev);
        let mut next = ident.clone();
        next.record(&path, id, uuid);
        self.save(&next)?;
        *ident = next;
        tracing::info!(device = id, %path, capacity, "device added");
        Ok(DeviceAdded {
            device: id,
            node: self.node,
            path,
            capacity,
        })
    }

    /// Carries through the adds the identity file records and this node
    /// does not serve: one cut short after it was recorded (its
    /// registration failed, say for want of a quorum), or one that could
    /// not be opened at the node's start. Each is only opened, as the
    /// device of this cluster it was formatted as (never created or
    /// formatted), then registered (the same id again if it is) and
    /// served. Answers why each that cannot be, by path.
    async fn complete_adds(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let due: Vec<DeviceSpec> = {
            let ident = self.identity.lock().await;
            ident
                .added
                .iter()
                .filter(|d| !self.serves(&d.path))
                .cloned()
                .collect()
        };
        for spec in due {
            let path = spec.path.display().to_string();
            if let Err(e) = self.check_not_elsewhere(&spec.path, &path) {
                out.insert(path, e.to_string());
                continue;
            }
            // Opened without the identity lock: a device that hangs in
            // its open (a dead disk) holds up only this task.
            let (s2, cluster) = (spec.clone(), self.cluster_id.clone());
            let opened = match tokio::task::spawn_blocking(move || open_added(&s2, &cluster)).await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    out.insert(path, format!("{e:#}"));
                    continue;
                }
                Err(e) => {
                    out.insert(path, e.to_string());
                    continue;
                }
            };
            let mut ident = self.identity.lock().await;
            // Removed, or served by an add, meanwhile.
            if !ident.added.iter().any(|d| d.path == spec.path) || self.serves(&spec.path) {
                continue;
            }
            if let Err(e) = self
                .register_and_serve(&mut ident, path.clone(), opened)
                .await
            {
                out.insert(path, e.to_string());
            }
        }
        out
    }

    /// Whether this node serves a device at `path`.
    fn serves(&self, path: &Path) -> bool {
        self.replicas
            .devices()
            .iter()
            .any(|d| Path::new(&d.path) == path)
    }

    /// Refuses, before anything opens it, a store the directory has
    /// registered anywhere but as this node's device at `path` (another
    /// node's disk, down or not; a copy of a disk in service): told from
    /// its superblock's uuid alone, so nothing of it is written.
    fn check_not_elsewhere(&self, file: &Path, path: &str) -> Result<(), AddError> {
        let Ok(Some((cluster, uuid))) = Store::identify(file) else {
            return Ok(());
        };
        if cluster != self.cluster_id || uuid == 0 {
            return Ok(());
        }
        let state = self.dir.state();
        // This node's own device at another path (disks traded while it
        // was down) is that device, if nothing serves it now: its
        // registration moves the path.
        let served = self.replicas.devices();
        let elsewhere = state.devices.values().find(|d| {
            let mine = d.node == self.node && !served.iter().any(|s| s.id == d.id);
            d.store_uuid == uuid && !(d.node == self.node && d.path == path) && !mine
        });
        match elsewhere {
            Some(d) => Err(AddError::BadRequest(format!(
                "{path} holds the store of device {} of node {} (registered at {}): a disk is a \
                 device in one place only (remove that device first)",
                d.id, d.node, d.path
            ))),
            None => Ok(()),
        }
    }

    /// Refuses a device holding components the directory places anywhere
    /// (a copy of a device in service, or another node's device): serving
    /// them here would split their writes between two places. A removed
    /// device holds only components the directory has forgotten.
    fn check_components(
        &self,
        path: &str,
        store: &Store,
        mine: Option<DeviceId>,
    ) -> Result<(), AddError> {
        let state = self.dir.state();
        let live = store.components().into_iter().find(|c| {
            state.volumes.values().any(|v| {
                v.components
                    .iter()
                    .any(|x| x.id == c.id && Some(x.device) != mine)
            })
        });
        match live {
            Some(c) => Err(AddError::BadRequest(format!(
                "{path} holds component {} of volume {}, placed elsewhere: a copy of a device \
                 in service is not taken",
                c.id, c.volume
            ))),
            None => Ok(()),
        }
    }

    fn save(&self, ident: &Identity) -> Result<(), AddError> {
        save_identity(&self.data_dir, ident).map_err(|e| AddError::Open {
            path: self.data_dir.join(IDENTITY).display().to_string(),
            error: e.to_string(),
        })
    }

    /// Why the removal of `device` (of this node) cannot go on now, as the
    /// last pass found it.
    pub fn blocked(&self, device: DeviceId) -> Option<String> {
        self.blocked.lock().ok()?.get(&device).cloned()
    }

    /// Runs the removal pass and, on a task of its own (an open that
    /// hangs holds up no removal), the completion of recorded adds, each
    /// every [`REMOVAL_PASS_S`], until the process ends.
    pub fn spawn_removals(self: &Arc<Self>) {
        Self::every_pass(self.clone(), |me| async move { me.removal_pass().await });
        Self::every_pass(self.clone(), |me| async move { me.completion_pass().await });
    }

    /// Runs `pass` every [`REMOVAL_PASS_S`] on a task of its own.
    fn every_pass<F, Fut>(me: Arc<Self>, pass: F)
    where
        F: Fn(Arc<Self>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        tokio::spawn(async move {
            let mut t = tokio::time::interval(Duration::from_secs(REMOVAL_PASS_S));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                t.tick().await;
                pass(me.clone()).await;
            }
        });
    }

    /// Carries recorded adds through ([`Self::complete_adds`]), logging
    /// what keeps one from being served when that changes.
    async fn completion_pass(&self) {
        let incomplete = self.complete_adds().await;
        if let Ok(mut was) = self.incomplete.lock() {
            for (path, why) in &incomplete {
                if was.get(path) != Some(why) {
                    tracing::warn!(%path, "an added device is not served: {why}");
                }
            }
            *was = incomplete;
        }
    }

    /// One pass over this node's retiring devices: moves begun, empty
    /// devices closed and unregistered.
    async fn removal_pass(&self) {
        let state = self.dir.state();
        let mine: Vec<DeviceId> = state
            .devices
            .values()
            .filter(|d| d.node == self.node && d.retiring)
            .map(|d| d.id)
            .collect();
        let mut blocked = Blocked::new();
        for id in mine {
            let moves = to_move_off(&state, id);
            if moves.is_empty() {
                if let Err(e) = self.close_and_unregister(id).await {
                    tracing::warn!(device = id, "removing the emptied device: {e}");
                    blocked.insert(id, e.to_string());
                }
                continue;
            }
            if let Some(why) = self.begin_moves(&state, id, &moves).await {
                blocked.insert(id, why);
            }
        }
        if let Ok(mut b) = self.blocked.lock() {
            for (id, why) in &blocked {
                if b.get(id) != Some(why) {
                    tracing::info!(device = id, "device removal waits: {why}");
                }
            }
            *b = blocked;
        }
    }

    /// Begins the moves of the volumes without a change in progress;
    /// answers why one cannot begin, if one cannot.
    async fn begin_moves(
        &self,
        state: &ClusterState,
        device: DeviceId,
        moves: &BTreeMap<VolumeId, Vec<ComponentId>>,
    ) -> Option<String> {
        let mut why = None;
        for (vid, comps) in moves {
            let Some(v) = state.volumes.get(vid) else {
                continue;
            };
            if v.reconfig.is_some() {
                continue;
            }
            let cmd = match begin_for(state, v, comps, device) {
                Ok(c) => c,
                Err(e) => {
                    why = Some(format!("volume {}: {e}", v.name));
                    continue;
                }
            };
            match self.dir.propose(cmd).await {
                Ok(_) => tracing::info!(device, volume = %v.name, "device removal: move begun"),
                Err(e) => why = Some(format!("volume {}: {e}", v.name)),
            }
        }
        why
    }

    /// The device holds nothing any more: stop serving it, record it
    /// removed, unregister it. Each step is done again by the next pass
    /// (or after a restart) if a later one fails.
    async fn close_and_unregister(&self, id: DeviceId) -> Result<(), AddError> {
        let mut ident = self.identity.lock().await;
        let path = match self.replicas.remove_device(id) {
            Some(d) => {
                let path = d.path.clone();
                close(d).await;
                Some(path)
            }
            None => ident
                .devices
                .iter()
                .find(|(_, d)| *d == id)
                .map(|(p, _)| p.clone()),
        };
        if let Some(path) = &path {
            let mut next = ident.clone();
            next.devices.retain(|(p, _)| p != path);
            next.added.retain(|d| d.path != Path::new(path));
            if self.command_line.iter().any(|d| d.path == Path::new(path))
                && !next.removed.contains(path)
            {
                next.removed.push(path.clone());
            }
            self.save(&next)?;
            *ident = next;
        }
        match self
            .dir
            .propose(Command::UnregisterDevice { device: id })
            .await
        {
            Ok(_) => {}
            // Unregistered by an earlier pass whose answer was lost.
            Err(DirectoryError::State(shoal_directory::StateError::NoSuchDevice(_))) => {}
            Err(e) => return Err(e.into()),
        }
        tracing::info!(device = id, path = ?path, "device removed");
        Ok(())
    }
}

/// Largest device taken, in bytes (1 PiB): a size past it is a typo, and
/// a sparse file that large would make placement overcommit.
const MAX_DEVICE_BYTES: u64 = 1 << 50;

/// Refuses a path that is not an existing regular file or block device
/// (a symlink, a FIFO, a folder, a socket) or a new file in an existing
/// folder, or that lies in the node's data folder; a new thick file must
/// fit in the free space of its file system.
fn check_path(spec: &DeviceSpec, data_dir: &Path) -> Result<(), AddError> {
    use std::os::unix::fs::FileTypeExt;
    let path = spec.path.display().to_string();
    let bad = |m: String| Err(AddError::BadRequest(m));
    if spec.size > MAX_DEVICE_BYTES {
        return bad(format!(
            "a device of {} bytes is past the largest taken (1 PiB)",
            spec.size
        ));
    }
    let parent = spec.path.parent().unwrap_or(Path::new("/"));
    let folder = match std::fs::canonicalize(parent) {
        Ok(f) => f,
        Err(e) => return bad(format!("{path}: its folder: {e}")),
    };
    if let Ok(data) = std::fs::canonicalize(data_dir) {
        if folder.starts_with(&data) {
            return bad(format!("{path} is in the node's data folder"));
        }
    }
    match std::fs::symlink_metadata(&spec.path) {
        Ok(m) if m.file_type().is_file() || m.file_type().is_block_device() => Ok(()),
        Ok(_) => bad(format!("{path} is not a regular file or a block device")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // Sparse or not: a device file its file system cannot hold
            // fails writes once it fills, after placement counted on it.
            let free = free_bytes(&folder).unwrap_or(u64::MAX);
            if spec.size > free {
                return bad(format!(
                    "{path}: {} bytes do not fit in its file system's free space ({free} bytes): \
                     give a smaller --size",
                    spec.size
                ));
            }
            Ok(())
        }
        Err(e) => bad(format!("{path}: {e}")),
    }
}

/// Bytes free for an unprivileged user in the file system of `folder`.
fn free_bytes(folder: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(folder.as_os_str().as_bytes()).ok()?;
    // SAFETY: a NUL-terminated path and a zeroed struct the call fills.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Longest wait for the requests still at a removed device to finish
/// before it is closed, in seconds: a request's I/O timeout and more.
const CLOSE_WAIT_S: u64 = 30;

/// Drops the last hold on a device no longer served, once the requests
/// still at it are done (at most [`CLOSE_WAIT_S`]): its threads stop and
/// its file is closed (and its lock released) with it.
async fn close(d: Arc<Device>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(CLOSE_WAIT_S);
    while Arc::strong_count(&d) > 1 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if Arc::strong_count(&d) > 1 {
        tracing::warn!(
            device = d.id,
            "requests still hold the removed device; it closes when they end"
        );
    }
    // Joins the cleaner thread: off the runtime's worker.
    let store = d.store.clone();
    drop(d);
    let _ = tokio::task::spawn_blocking(move || store.stop_background()).await;
}

/// Opens the device of `spec` for a `shoal device add`: formats it only
/// when it is new or unused, opens it when it is a device of this cluster.
fn open_new(spec: &DeviceSpec, cluster_id: &str, data_dir: &Path) -> Result<Arc<Store>, AddError> {
    check_path(spec, data_dir)?;
    let path = spec.path.display().to_string();
    let err = |e: String| AddError::Open {
        path: path.clone(),
        error: e,
    };
    let exists = spec.path.exists();
    if !exists && spec.size == 0 {
        return Err(AddError::BadRequest(format!(
            "{path} does not exist: give its size to create it"
        )));
    }
    let mut spec = spec.clone();
    if exists && spec.size == 0 {
        // An existing file or block device keeps its own size.
        spec.size = existing_len(&spec.path).map_err(|e| err(e.to_string()))?;
    }
    if exists && !unused(&spec.path).map_err(|e| err(e.to_string()))? {
        // Only a device of this cluster is taken as it is: told from its
        // superblock alone, before anything opens it (opening replays
        // and writes).
        match Store::cluster_of(&spec.path) {
            Ok(Some(c)) if c == cluster_id => {}
            Ok(Some(c)) => {
                return Err(AddError::BadRequest(format!(
                    "{path} is a device of another cluster ({c}): refusing to format it"
                )))
            }
            Ok(None) | Err(_) => return Err(AddError::NotEmpty(path)),
        }
    }
    let created = !exists;
    open_store(&spec, cluster_id).map_err(|e| {
        if created {
            // Nothing of it is anyone's: a partial (thick) file goes.
            let _ = std::fs::remove_file(&spec.path);
        }
        // The context names the device, as `AddError::Open` does, and the
        // store's error quotes its cause: that one error alone.
        err(e
            .chain()
            .nth(1)
            .map_or_else(|| e.to_string(), ToString::to_string))
    })
}

/// Length in bytes of an existing file or block device.
fn existing_len(path: &Path) -> std::io::Result<u64> {
    use std::io::{Seek, SeekFrom};
    std::fs::File::open(path)?.seek(SeekFrom::End(0))
}

/// The components on `device`, by volume.
pub fn to_move_off(state: &ClusterState, device: DeviceId) -> BTreeMap<VolumeId, Vec<ComponentId>> {
    let mut out: BTreeMap<VolumeId, Vec<ComponentId>> = BTreeMap::new();
    for v in state.volumes.values() {
        for c in v.components.iter().filter(|c| c.device == device) {
            out.entry(v.id).or_default().push(c.id);
        }
    }
    out
}

/// The change that moves `comps` (on `device`) of `v` elsewhere.
fn begin_for(
    state: &ClusterState,
    v: &shoal_model::Volume,
    comps: &[ComponentId],
    device: DeviceId,
) -> Result<Command, String> {
    crate::rebuild::move_off(state, v, comps, format!("removal of device {device}"))
}

/// `device` and its removal as `state` has it (None: no such device).
pub fn report(state: &ClusterState, device: DeviceId) -> Option<DeviceRemoval> {
    let d = state.devices.get(&device)?;
    let moves = to_move_off(state, device);
    let name = |v: &VolumeId| state.volumes[v].name.clone();
    Some(DeviceRemoval {
        device,
        node: d.node,
        path: d.path.clone(),
        retiring: d.retiring,
        components: moves.values().map(Vec::len).sum(),
        volumes: moves.keys().map(name).collect(),
        changing: moves
            .keys()
            .filter(|v| state.volumes[v].reconfig.is_some())
            .map(name)
            .collect(),
        blocked: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(p: &str) -> DeviceSpec {
        DeviceSpec {
            path: p.into(),
            size: 1 << 30,
            thick: false,
        }
    }

    #[test]
    fn the_devices_to_open_are_the_command_lines_less_removed_plus_added() {
        let mut id = Identity::new(1, "c".into());
        id.added.push(spec("/x"));
        id.added.push(spec("/a"));
        id.removed.push("/b".into());
        let open: Vec<(PathBuf, bool)> = id
            .to_open(&[spec("/a"), spec("/b")])
            .into_iter()
            .map(|(d, added)| (d.path, added))
            .collect();
        assert_eq!(
            open,
            vec![(PathBuf::from("/a"), false), (PathBuf::from("/x"), true)]
        );
    }

    #[test]
    fn a_store_is_served_under_the_id_it_was_registered_with_wherever_it_is() {
        let mut id = Identity::new(1, "c".into());
        id.record("/a", 10, 0xa);
        id.record("/b", 11, 0xb);
        // In place; traded places; a disk never seen at a known path.
        assert_eq!(id.device_for("/a", 0xa), Some(10));
        assert_eq!(id.device_for("/a", 0xb), Some(11));
        assert_eq!(id.device_for("/b", 0xa), Some(10));
        assert_eq!(id.device_for("/a", 0xc), None);
        assert_eq!(id.device_for("/c", 0xc), None);
        // An identity of version 2 knows paths only: taken by path.
        let mut old = Identity::new(1, "c".into());
        old.devices.push(("/a".into(), 10));
        assert_eq!(old.device_for("/a", 0xc), Some(10));
        // Recording again replaces what the path or the id had (device 10
        // keeps its store's uuid: found again by it, wherever it is).
        id.record("/a", 11, 0xb);
        assert_eq!(id.devices, vec![("/a".to_string(), 11)]);
        assert_eq!(id.store_uuids, vec![(10, 0xa), (11, 0xb)]);
    }

    #[test]
    fn an_identity_of_version_one_loads_with_empty_lists() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join(IDENTITY),
            r#"{"node_id":3,"cluster_id":"c","devices":[["/a",7]]}"#,
        )
        .unwrap();
        let id = load_identity(d.path()).unwrap().unwrap();
        assert_eq!((id.version, id.node_id, id.devices.len()), (1, 3, 1));
        assert!(id.added.is_empty() && id.removed.is_empty());
        save_identity(d.path(), &id).unwrap();
        let again = load_identity(d.path()).unwrap().unwrap();
        assert_eq!(again.version, IDENTITY_VERSION);
        // A newer version is refused, not misread.
        std::fs::write(
            d.path().join(IDENTITY),
            r#"{"version":99,"node_id":3,"cluster_id":"c","devices":[]}"#,
        )
        .unwrap();
        let e = load_identity(d.path()).unwrap_err().to_string();
        assert!(e.contains("version 99"), "{e}");
    }

    #[test]
    fn requests_with_bad_paths_or_sizes_are_refused() {
        let req = |path: &str, size: Option<u64>, thick: bool| shoal_api::AddDevice {
            node: 1,
            path: path.into(),
            size_bytes: size,
            thick,
        };
        for (r, want) in [
            (req("relative/dev", Some(1 << 30), false), "absolute"),
            (req("/a/../etc/dev", Some(1 << 30), false), "absolute"),
            (req("/a\0b", Some(1 << 30), false), "control characters"),
            (req("/a\nb", Some(1 << 30), false), "control characters"),
            (req("/dev/x", Some(4096), false), "too small"),
            (req("/dev/x", None, true), "needs its size"),
            (
                req(&format!("/{}", "a".repeat(5000)), None, false),
                "at most",
            ),
        ] {
            let e = check_request(&r).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert!(check_request(&req("/srv/d", None, false)).is_ok());
    }

    #[test]
    fn fifos_symlinks_folders_the_data_folder_and_huge_sizes_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let data = d.path().join("data");
        std::fs::create_dir(&data).unwrap();
        let at = |p: PathBuf, size: u64, thick: bool| DeviceSpec {
            path: p,
            size,
            thick,
        };
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let target = d.path().join("target.dev");
        std::os::unix::fs::symlink(&target, d.path().join("link")).unwrap();
        for (spec, want) in [
            (at(fifo, 1 << 30, false), "not a regular file"),
            (
                at(d.path().join("link"), 1 << 30, false),
                "not a regular file",
            ),
            (at(data.clone(), 1 << 30, false), "not a regular file"),
            (at(data.join("x.dev"), 1 << 30, false), "data folder"),
            (at(d.path().join("big"), 1 << 51, false), "1 PiB"),
            (at(d.path().join("thick"), 1 << 49, true), "free space"),
            (at(d.path().join("sparse"), 1 << 49, false), "free space"),
            (
                at(d.path().join("no/such/dir.dev"), 1 << 30, false),
                "its folder",
            ),
        ] {
            let e = check_path(&spec, &data).unwrap_err().to_string();
            assert!(e.contains(want), "{}: {e}", spec.path.display());
        }
        // The dangling link's target was not created.
        assert!(!target.exists());
        assert!(check_path(&at(d.path().join("ok.dev"), 1 << 30, false), &data).is_ok());
    }

    #[test]
    fn a_thick_file_is_written_in_full_even_when_an_add_left_part_of_it() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("thick.dev");
        // What an add killed while writing leaves: shorter, and sparse.
        std::fs::File::create(&p).unwrap().set_len(8 << 20).unwrap();
        create_thick(&p, 16 << 20).unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert_eq!(m.len(), 16 << 20);
        assert!(m.blocks() * 512 >= m.len(), "not fully allocated");
        let fresh = d.path().join("fresh.dev");
        create_thick(&fresh, 4 << 20).unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, DEVICE_FILE_MODE);
    }

    #[test]
    fn only_a_new_or_zeroed_file_or_a_device_of_this_cluster_is_opened() {
        let d = tempfile::tempdir().unwrap();
        let at = |n: &str| DeviceSpec {
            path: d.path().join(n),
            size: 64 << 20,
            thick: false,
        };
        // New: created.
        let s = open_new(&at("new"), "c", Path::new("/nonexistent-data")).unwrap();
        assert_eq!(s.cluster_id(), "c");
        drop(s);
        // A device of this cluster: opened as it is.
        let s = open_new(&at("new"), "c", Path::new("/nonexistent-data")).unwrap();
        drop(s);
        // Of another cluster, or foreign data: refused, the bytes unchanged.
        let before = std::fs::read(d.path().join("new")).unwrap();
        let e = open_new(&at("new"), "other", Path::new("/nonexistent-data")).unwrap_err();
        assert!(e.to_string().contains("another cluster (c)"), "{e}");
        assert!(std::fs::read(d.path().join("new")).unwrap() == before);
        std::fs::write(d.path().join("data"), b"precious").unwrap();
        let e = open_new(&at("data"), "c", Path::new("/nonexistent-data")).unwrap_err();
        assert!(e.to_string().contains("refusing to format"), "{e}");
        assert_eq!(std::fs::read(d.path().join("data")).unwrap(), b"precious");
        // A wiped first MiB over data further on (at 2 MiB, and near the
        // end): refused, unchanged.
        use std::os::unix::fs::FileExt;
        for at_byte in [2u64 << 20, (64 << 20) - 4096] {
            let p = d.path().join(format!("wiped-{at_byte}"));
            let f = std::fs::File::create(&p).unwrap();
            f.set_len(64 << 20).unwrap();
            f.write_all_at(b"PRECIOUS", at_byte).unwrap();
            let mut w = at(&format!("wiped-{at_byte}"));
            w.size = 0;
            let e = open_new(&w, "c", Path::new("/nonexistent-data")).unwrap_err();
            assert!(e.to_string().contains("refusing to format"), "{e}");
            let back = std::fs::read(&p).unwrap();
            let at_byte = at_byte as usize;
            assert_eq!(&back[at_byte..at_byte + 8], b"PRECIOUS");
        }
        // A file written in full (one extent: a raw image), zeros at both
        // ends, data in the middle: found by the spread samples.
        let full = d.path().join("full");
        let mut bytes = vec![0u8; 64 << 20];
        bytes[(26 << 20)..(30 << 20)].fill(0x5a);
        std::fs::write(&full, &bytes).unwrap();
        let mut w = at("full");
        w.size = 0;
        let e = open_new(&w, "c", Path::new("/nonexistent-data")).unwrap_err();
        assert!(e.to_string().contains("refusing to format"), "{e}");
        assert!(std::fs::read(&full).unwrap() == bytes);
        // All zeros (a new sparse file, a wiped disk): formatted.
        let f = std::fs::File::create(d.path().join("zeros")).unwrap();
        f.set_len(64 << 20).unwrap();
        let mut z = at("zeros");
        z.size = 0;
        assert!(open_new(&z, "c", Path::new("/nonexistent-data")).is_ok());
        // Missing without a size: refused.
        let mut m = at("missing");
        m.size = 0;
        assert!(matches!(
            open_new(&m, "c", Path::new("/nonexistent-data")),
            Err(AddError::BadRequest(_))
        ));
    }
}
