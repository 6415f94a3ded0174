//! # shoal-node: the daemon of one host
//!
//! Wires the layers together for one node: opens its devices (component
//! stores), joins or starts the directory, serves peers over RPC (replica
//! side of the data path and forwarded volume I/O), clients over NBD, and
//! people and tools over HTTP (REST, metrics, Raft). Owns the process's
//! lifecycle and identity; must never hold cluster state of its own beyond
//! what the directory says.

pub mod api_server;
pub mod auth;
pub mod capacity;
pub mod caretaker;
pub mod clock;
pub mod devices;
pub mod encryption;
pub mod exports;
pub mod flusher;
pub mod http;
pub mod liveness;
pub mod maintenance;
pub mod membership;
pub mod policy_change;
pub mod reader;
pub mod rebuild;
pub mod replica;
pub mod ring;
pub mod router;
pub mod scrub;
pub mod space;
#[cfg(test)]
mod testing;
pub mod tuning;
pub mod voters;

pub use tuning::NodeTuning;

/// Marks the calling thread as a batch thread (`SCHED_BATCH`) for the
/// device threads (flusher, reader): a runtime worker that wakes one then
/// keeps its CPU instead of being preempted by it on the spot; the woken
/// thread takes an idle CPU, or the CPU once the worker sleeps. It measured
/// faster at QD32 and no slower at QD1 (bench/RESULTS.md, 2026-11-30,
/// wake-ups, the allocator, and request futures).
pub(crate) fn as_batch_thread() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain system call on the calling thread with a valid param.
    let r = unsafe { libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) };
    if r != 0 {
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "could not make a device thread SCHED_BATCH"
        );
    }
}

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use shoal_directory::{Command, Directory, DirectoryConfig, Response};
use shoal_model::{DeviceId, NodeId, NodeInfo, NodeState};
use shoal_owner::OwnerConfig;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// One device of a node: a file (created sparse at `size` if missing) or a
/// block device (`size` 0: use what is there).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceSpec {
    pub path: PathBuf,
    pub size: u64,
    /// Create the file written in full (zeros) rather than sparse: no
    /// block allocation on the data path, so flushes and parallel writes
    /// cost what they cost on a block device. Only applies to a new file.
    #[serde(default)]
    pub thick: bool,
}

/// The I/O wait bound when none is configured, in seconds.
pub fn default_io_wait_s() -> u64 {
    OwnerConfig::default().io_wait.as_secs()
}

/// Everything a node needs to start.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeConfig {
    pub id: NodeId,
    pub data_dir: PathBuf,
    pub devices: Vec<DeviceSpec>,
    /// `ip:port` of the peer RPC.
    pub peer_addr: String,
    /// `ip:port` of the NBD server.
    pub nbd_addr: String,
    /// The NBD server's Unix socket, for clients on this host.
    #[serde(default)]
    pub nbd_socket: NbdSocket,
    /// `ip:port` of the HTTP API.
    pub api_addr: String,
    /// API address of any member, to join an existing cluster.
    pub join: Option<String>,
    /// The join token a new node shows for its certificate (only the first
    /// start of a joining node needs it).
    #[serde(default, skip_serializing)]
    pub join_token: Option<String>,
    /// The cluster key file (`encrypt=on` volumes' data keys are wrapped by
    /// it): the same file on every node, mode 0600. None: this node
    /// creates and serves no encrypted volume.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// NBD over TCP: TLS required, allowed, or off; `None`: required on a
    /// non-loopback address, allowed on loopback (so local commands keep
    /// working with plain `nbd://`).
    #[serde(default)]
    pub nbd_tls: Option<NbdTlsMode>,
    /// NBD over TCP proves clients by pre-shared keys (TLS-PSK) instead
    /// of certificates: the key file, GnuTLS psktool's `identity:hexkey`
    /// lines, mode 0600. Read once, at start.
    #[serde(default)]
    pub nbd_tls_psk: Option<PathBuf>,
    /// Group given the NBD Unix socket (mode 0660): its members may use
    /// NBD on this host. None: the node's own group.
    #[serde(default)]
    pub nbd_socket_group: Option<String>,
    /// Keep connections between nodes encrypted (TLS) for their whole
    /// life; otherwise they are authenticated by mutual TLS and then carry
    /// the data path in the clear (docs/security.md says why).
    #[serde(default)]
    pub encrypt_in_transit: bool,
    /// Fault domain; defaults to `node-<id>`.
    pub fault_domain: Option<String>,
    /// How long a client request may wait for its volume (owner failover,
    /// no quorum, no read lease) before it fails with an I/O error, in
    /// seconds (`OwnerConfig::io_wait`).
    #[serde(default = "default_io_wait_s")]
    pub io_wait_s: u64,
    /// Background scrubbing of the devices.
    #[serde(default)]
    pub scrub: scrub::ScrubConfig,
    /// Threads and batching of the data path.
    #[serde(default)]
    pub tuning: NodeTuning,
}

/// Whether NBD over TCP needs TLS (STARTTLS; x509, a client certificate
/// of the cluster's CA, as `shoal cert client` makes, or TLS-PSK with
/// `--nbd-tls-psk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NbdTlsMode {
    /// Only TLS clients (with a certificate of the cluster, or a key).
    Require,
    /// Plain clients, and TLS clients (with a certificate of the cluster,
    /// or a key).
    Allow,
    /// Plain only.
    Off,
}

impl std::str::FromStr for NbdTlsMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "require" => Ok(NbdTlsMode::Require),
            "allow" => Ok(NbdTlsMode::Allow),
            "off" => Ok(NbdTlsMode::Off),
            _ => bail!("--nbd-tls {s:?}: expected require, allow or off"),
        }
    }
}

impl NbdTlsMode {
    /// The mode for `addr` when none is set: required off loopback.
    pub fn default_for(addr: &str) -> NbdTlsMode {
        let loopback = addr
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if loopback {
            NbdTlsMode::Allow
        } else {
            NbdTlsMode::Require
        }
    }

    /// Reads and checks the TLS-PSK key file `psk` for this mode (`None`:
    /// the default, which offers TLS): the TLS-PSK settings, and the
    /// identities. `off` with a key file is refused: it would be ignored.
    pub fn psk(
        mode: Option<NbdTlsMode>,
        psk: &Path,
    ) -> Result<(shoal_nbd::PskConfig, Vec<String>)> {
        if mode == Some(NbdTlsMode::Off) {
            bail!("--nbd-tls-psk needs TLS: --nbd-tls off serves no TLS to use the keys with");
        }
        let keys = shoal_nbd::PskKeys::load(psk)?;
        let identities = keys.identities();
        Ok((shoal_nbd::PskConfig::new(keys)?, identities))
    }

    /// The listener's TLS: TLS-PSK with the keys of `psk` when given,
    /// else x509 with the node's credentials, refusing the client
    /// certificates `revoked` names.
    fn server(
        self,
        creds: &shoal_tls::NodeCredentials,
        psk: Option<&Path>,
        revoked: shoal_tls::Revoked,
    ) -> Result<shoal_nbd::NbdTls> {
        let tls_creds: shoal_nbd::TlsCreds = match psk {
            Some(path) => {
                let (config, identities) = NbdTlsMode::psk(Some(self), path)?;
                let identities = identities.len();
                tracing::info!(file = %path.display(), identities, "NBD over TCP: TLS-PSK");
                config.into()
            }
            None if self == NbdTlsMode::Off => return Ok(shoal_nbd::NbdTls::Off),
            None => creds.client_server_config(revoked)?.into(),
        };
        Ok(match self {
            NbdTlsMode::Require => shoal_nbd::NbdTls::Require(tls_creds),
            NbdTlsMode::Allow => shoal_nbd::NbdTls::Allow(tls_creds),
            // `psk` refused a key file with `off`.
            NbdTlsMode::Off => shoal_nbd::NbdTls::Off,
        })
    }
}

/// Where the node serves NBD to clients on its own host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum NbdSocket {
    /// TCP only.
    #[default]
    None,
    /// The default path: a socket that cannot be made there (a path too
    /// long for a socket address, a read-only folder) is logged, and the
    /// node serves TCP only.
    Default(PathBuf),
    /// A path asked for: failing to listen there fails the start.
    Path(PathBuf),
}

/// Listens on `path`, replacing a socket file left by a node that died
/// (nothing answers on it), never one a live process serves.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            bail!("{} exists and is not a socket", path.display());
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("{} is served by another process", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing the stale socket {}", path.display()))?;
    }
    tokio::net::UnixListener::bind(path).with_context(|| format!("listening on {}", path.display()))
}

/// Mode of the NBD socket: the node's user and its group (see
/// `nbd_socket_group`) may connect; nobody else.
const NBD_SOCKET_MODE: u32 = 0o660;

/// Gives the NBD socket at `path` its mode and, if named, its group.
fn socket_access(path: &Path, group: Option<&str>) -> Result<()> {
    owner_only(path, NBD_SOCKET_MODE)?;
    let Some(name) = group else {
        return Ok(());
    };
    let gid = group_id(name)?;
    std::os::unix::fs::chown(path, None, Some(gid))
        .with_context(|| format!("giving {} to group {name}", path.display()))
}

/// The id of the group `name`.
fn group_id(name: &str) -> Result<u32> {
    let c = std::ffi::CString::new(name).context("a group name without NUL bytes")?;
    // SAFETY: getgrnam reads a valid C string; the result is read at once,
    // before another call could overwrite its static storage.
    let g = unsafe { libc::getgrnam(c.as_ptr()) };
    if g.is_null() {
        bail!("no group named {name:?} (--nbd-socket-group)");
    }
    // SAFETY: non-null pointer to a group record, as checked.
    Ok(unsafe { (*g).gr_gid })
}

/// Mode of a node's data folder: its identity, directory database and
/// sockets are the node's alone.
const DATA_DIR_MODE: u32 = 0o700;

/// Gives `path` the permission bits `mode` (no access for group and
/// others), whatever the umask made it.
fn owner_only(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {} to {mode:o}", path.display()))
}

/// Seconds between two passes that unmark, on the devices, the regions
/// whose writes a barrier has settled (`Replicas::settle_marks`). A region
/// written again within this time keeps its mark, so a busy region costs
/// no log entry per barrier; a crash then copies at most the regions
/// written in the last few seconds between the copies.
const SETTLE_MARKS_S: u64 = 5;

/// Asks a member for the cluster id, `tries` times half a second apart.
async fn remote_cluster_id(join: &str, tries: u32) -> Result<String> {
    let c = shoal_api::Client::new(join);
    let mut last = String::new();
    for _ in 0..tries {
        match c.livez().await {
            Ok(s) if !s.cluster_id.is_empty() => return Ok(s.cluster_id),
            Ok(_) => last = "cluster has no id yet".into(),
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    bail!("cannot learn the cluster id from {join}: {last}")
}

/// A new API token of `role`: its text (to hand out once) and the record
/// the directory keeps.
pub fn new_token(
    role: shoal_model::Role,
    note: &str,
) -> (shoal_model::TokenText, shoal_model::ApiToken) {
    let text = shoal_model::TokenText::new(rand::random(), rand::random());
    let token = shoal_model::ApiToken {
        id: text.id.clone(),
        role,
        secret_sha256: text.secret_sha256(),
        note: note.to_string(),
        expires_unix_s: None,
    };
    (text, token)
}

/// The founding node's admin token, in its data folder (mode 0600);
/// `shoal up` hands it to the command line.
pub const ADMIN_TOKEN_FILE: &str = "admin.token";

/// Makes the cluster's first admin token and writes it to
/// `DATA/admin.token`, readable by the node's user only.
async fn first_admin_token(dir: &Directory, data_dir: &Path) -> Result<()> {
    let (text, token) = new_token(shoal_model::Role::Admin, "made at cluster creation");
    let path = data_dir.join(ADMIN_TOKEN_FILE);
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("writing {}", path.display()))?;
        writeln!(f, "{}", text.reveal())?;
        f.sync_all()?;
    }
    dir.propose(Command::CreateToken { token })
        .await
        .context("recording the first admin token")?;
    Ok(())
}

fn new_cluster_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The parts of a node that must run as long as it does (its servers,
/// the loop that follows the directory): the first one that ends, with an
/// error or without, stops the node with that reason, so that no node goes
/// on half alive with a port that no longer answers.
#[derive(Clone)]
struct Essentials {
    ended: tokio::sync::mpsc::Sender<String>,
}

/// Reasons queued before the node acts on the first: one is enough.
const ESSENTIAL_REASONS_QUEUED: usize = 4;

impl Essentials {
    fn new() -> (Essentials, tokio::sync::mpsc::Receiver<String>) {
        let (ended, rx) = tokio::sync::mpsc::channel(ESSENTIAL_REASONS_QUEUED);
        (Essentials { ended }, rx)
    }

    fn spawn<F>(&self, what: &'static str, part: F)
    where
        F: std::future::Future<Output = Result<()>> + Send + 'static,
    {
        let ended = self.ended.clone();
        tokio::spawn(async move {
            let why = match part.await {
                Ok(()) => format!("{what} ended"),
                Err(e) => format!("{what} failed: {e:#}"),
            };
            let _ = ended.try_send(why);
        });
    }
}

/// Runs the node until `shutdown` resolves (the binary resolves it on
/// SIGTERM or SIGINT), or until an essential part of it ends: then it
/// returns the reason as an error.
pub async fn run(cfg: NodeConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
    let (essentials, mut ended) = Essentials::new();
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("creating data folder {}", cfg.data_dir.display()))?;
    owner_only(&cfg.data_dir, DATA_DIR_MODE)?;
    let identity = devices::load_identity(&cfg.data_dir)?;
    if let Some(id) = &identity {
        if id.node_id != cfg.id {
            bail!(
                "data folder {} belongs to node {}, not node {}",
                cfg.data_dir.display(),
                id.node_id,
                cfg.id
            );
        }
    }
    // Which cluster are we part of?
    let (cluster_id, fresh) = match (&identity, &cfg.join) {
        (Some(id), Some(join)) => {
            // A restart: the member we joined through may be down itself.
            let theirs = match remote_cluster_id(join, 4).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!("{e}; starting with the cluster id this folder remembers");
                    id.cluster_id.clone()
                }
            };
            if theirs != id.cluster_id {
                bail!(
                    "data folder {} belongs to cluster {}, but {join} is cluster {theirs}: \
                     use an empty data folder to join another cluster",
                    cfg.data_dir.display(),
                    id.cluster_id
                );
            }
            (id.cluster_id.clone(), false)
        }
        (Some(id), None) => (id.cluster_id.clone(), false),
        (None, Some(join)) => (remote_cluster_id(join, 60).await?, true),
        (None, None) => (new_cluster_id(), true),
    };

    // Devices: refuse foreign or too-small ones before anything else.
    if cfg.devices.is_empty() {
        bail!("a node needs at least one device (--device PATH:SIZE)");
    }
    let to_open = match &identity {
        Some(id) => id.to_open(&cfg.devices),
        None => cfg.devices.iter().map(|d| (d.clone(), false)).collect(),
    };
    let mut stores = Vec::new();
    for (d, added) in &to_open {
        if !added {
            let s = devices::open_store(d, &cluster_id)?;
            stores.push((d.path.display().to_string(), s));
            continue;
        }
        // A device added while the node ran is opened as it was formatted,
        // or skipped (its copies are rebuilt elsewhere; `shoal device
        // remove` takes it out): never formatted again, never a reason
        // not to start.
        match devices::open_added(d, &cluster_id) {
            Ok(s) => stores.push((d.path.display().to_string(), s)),
            Err(e) => tracing::error!(
                error = %format!("{e:#}"),
                "an added device cannot be opened; starting without it"
            ),
        }
    }
    if stores.is_empty() {
        bail!("no device left to open (every one was removed or cannot be opened): add one");
    }

    // Bind every port now so that a port in use fails the start clearly.
    let api_l = tokio::net::TcpListener::bind(&cfg.api_addr)
        .await
        .with_context(|| format!("API address {}", cfg.api_addr))?;
    let peer_l = tokio::net::TcpListener::bind(&cfg.peer_addr)
        .await
        .with_context(|| format!("peer address {}", cfg.peer_addr))?;
    let nbd_l = tokio::net::TcpListener::bind(&cfg.nbd_addr)
        .await
        .with_context(|| format!("NBD address {}", cfg.nbd_addr))?;
    let nbd_unix = match &cfg.nbd_socket {
        NbdSocket::None => None,
        NbdSocket::Path(p) => Some((bind_unix(p).context("NBD socket")?, p.clone())),
        NbdSocket::Default(p) => match bind_unix(p) {
            Ok(l) => Some((l, p.clone())),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "NBD over TCP only");
                None
            }
        },
    };
    if let Some((_, path)) = &nbd_unix {
        socket_access(path, cfg.nbd_socket_group.as_deref())?;
    }

    let creds = membership::obtain(&cfg, &cluster_id, fresh)
        .await
        .context("the node's certificate")?;
    let transport = member_transport(&creds)?;
    let dir = Directory::open(DirectoryConfig {
        node_id: cfg.id,
        data_dir: cfg.data_dir.join("directory"),
        api_addr: cfg.api_addr.clone(),
        transport: transport.clone(),
    })
    .await
    .context("opening the directory")?;
    let admit = admit_unrevoked(&dir);
    let peer_auth = shoal_rpc::PeerAuth::Members(shoal_tls::PeerSecurity {
        server: creds.server_config(shoal_tls::ClientAuth::Required)?,
        client: creds.client_config()?,
        encrypt: cfg.encrypt_in_transit,
        admit: admit.clone(),
    });

    // Replica side first: it needs only the device ids we remember, each
    // for the store it was registered with.
    let known: Vec<Option<DeviceId>> = stores
        .iter()
        .map(|(p, s)| identity.as_ref().and_then(|i| i.device_for(p, s.uuid())))
        .collect();
    let owner_cfg = OwnerConfig {
        node: cfg.id,
        peer_auth: peer_auth.clone(),
        io_wait: Duration::from_secs(cfg.io_wait_s),
        ..OwnerConfig::default()
    };
    let cluster_key = match &cfg.key_file {
        Some(p) => Some(Arc::new(
            shoal_crypt::ClusterKey::load(p)
                .with_context(|| format!("the cluster key {}", p.display()))?,
        )),
        None => None,
    };
    let router = Arc::new(router::Router::new(
        cfg.id,
        dir.clone(),
        owner_cfg,
        cluster_key,
    ));
    let liveness = Arc::new(liveness::Liveness::new(cfg.id, dir.clone(), transport));

    // The HTTP API (with Raft) must run before bootstrap/join.
    let mut device_ids: Vec<(String, DeviceId)> = Vec::new();
    let replicas_cell: Arc<std::sync::OnceLock<Arc<replica::Replicas>>> = Default::default();
    // Device ids are final only after registration; start with what we know.
    let initial = stores
        .iter()
        .zip(&known)
        .filter_map(|((p, s), id)| {
            id.map(|id| replica::Device::new(id, p.clone(), s.clone(), &cfg.tuning))
        })
        .collect::<std::io::Result<Vec<_>>>()
        .context("starting the device flusher threads")?;
    let have_all = initial.len() == stores.len();
    let mut peer_l = Some(peer_l);
    if have_all {
        let r = Arc::new(replica::Replicas::new(initial));
        let _ = r.router.set(router.clone());
        shoal_rpc::register_local(&cfg.peer_addr, r.clone());
        let _ = replicas_cell.set(r.clone());
        if let Some(l) = peer_l.take() {
            let auth = peer_auth.clone();
            essentials.spawn("the peer RPC server", async move {
                Ok(shoal_rpc::serve(l, r, auth).await?)
            });
        }
    }
    let scrubber_cell = Arc::new(std::sync::OnceLock::new());
    let devices_cell = Arc::new(std::sync::OnceLock::new());
    let h = http::Http {
        devices: devices_cell.clone(),
        router: router.clone(),
        liveness: liveness.clone(),
        replicas: replicas_cell.clone(),
        scrubber: scrubber_cell.clone(),
    };
    let routers = api_server::ApiRouters {
        plain: http::routes(h.clone()),
        members: http::member_routes(h.clone()),
        joining: http::join_routes(h),
    };
    let api_tls = api_server::ApiTls {
        server: creds.server_config(shoal_tls::ClientAuth::Optional)?,
        admit,
    };
    essentials.spawn("the HTTP API server", async move {
        Ok(api_server::serve(api_l, routers, api_tls).await?)
    });

    if fresh && cfg.join.is_none() {
        dir.bootstrap().await.context("starting a new directory")?;
        dir.propose(Command::SetClusterId {
            cluster_id: cluster_id.clone(),
        })
        .await
        .context("naming the cluster")?;
        first_admin_token(&dir, &cfg.data_dir).await?;
    } else if let Some(join) = &cfg.join {
        dir.join(join)
            .await
            .with_context(|| format!("joining the cluster via {join}"))?;
    }

    membership::record(&dir, &creds, &cfg.data_dir).await?;

    // Register the node and its devices.
    let me = NodeInfo {
        id: cfg.id,
        fault_domain: cfg
            .fault_domain
            .clone()
            .unwrap_or_else(|| format!("node-{}", cfg.id)),
        peer_addr: cfg.peer_addr.clone(),
        api_addr: cfg.api_addr.clone(),
        nbd_addr: cfg.nbd_addr.clone(),
        state: NodeState::Up,
    };
    retry("registering the node", || {
        dir.propose(Command::RegisterNode { node: me.clone() })
    })
    .await?;
    // A new incarnation: owners this node ran before it started are gone,
    // and their read leases with them (`docs/lease.md`).
    let incarnation = rand::random::<u64>().max(1);
    retry("recording the node's start", || {
        dir.propose(Command::NodeStarted {
            node: cfg.id,
            incarnation,
        })
    })
    .await?;
    for (path, s) in &stores {
        let r = retry("registering a device", || {
            dir.propose(Command::RegisterDevice {
                node: cfg.id,
                path: path.clone(),
                capacity: s.capacity(),
                store_uuid: s.uuid(),
            })
        })
        .await?;
        let Response::Id(id) = r else {
            bail!("unexpected answer to device registration: {r:?}");
        };
        device_ids.push((path.clone(), id));
    }
    // Served from the start under the ids remembered: the directory must
    // know each store by the same id, or this node would answer for
    // components under the wrong device.
    if have_all {
        for ((path, id), remembered) in device_ids.iter().zip(&known) {
            if Some(*id) != *remembered {
                bail!(
                    "device {path} was served as device {remembered:?} but the directory knows \
                     its store as device {id}: refusing to go on (were the disks moved?)"
                );
            }
        }
    }
    let mut ident = identity
        .clone()
        .unwrap_or_else(|| devices::Identity::new(cfg.id, cluster_id.clone()));
    // Paths name the devices opened now; the uuids of devices not opened
    // (a disk missing at this start) are kept, so that they are known
    // again wherever they turn up.
    ident.devices.clear();
    for ((path, id), (_, s)) in device_ids.iter().zip(&stores) {
        ident.record(path, *id, s.uuid());
    }
    devices::save_identity(&cfg.data_dir, &ident)
        .with_context(|| format!("saving the identity in {}", cfg.data_dir.display()))?;
    if !have_all {
        let devs = stores
            .iter()
            .zip(&device_ids)
            .map(|((p, s), (_, id))| replica::Device::new(*id, p.clone(), s.clone(), &cfg.tuning))
            .collect::<std::io::Result<Vec<_>>>()
            .context("starting the device flusher threads")?;
        let r = Arc::new(replica::Replicas::new(devs));
        let _ = r.router.set(router.clone());
        shoal_rpc::register_local(&cfg.peer_addr, r.clone());
        let _ = replicas_cell.set(r.clone());
    }
    // The replica side holds the stores from here on: a device removed
    // later closes when it lets go of it.
    drop(stores);
    let replicas = replicas_cell
        .get()
        .cloned()
        .context("replicas not started")?;
    if let Some(l) = peer_l.take() {
        let r = replicas.clone();
        essentials.spawn("the peer RPC server", async move {
            Ok(shoal_rpc::serve(l, r, peer_auth).await?)
        });
    }

    let device_set = devices::DeviceSet::new(
        cfg.id,
        cluster_id.clone(),
        cfg.data_dir.clone(),
        cfg.tuning.clone(),
        cfg.devices.clone(),
        dir.clone(),
        replicas.clone(),
        ident,
    );
    device_set.spawn_removals();
    let _ = devices_cell.set(device_set);

    let _ = scrubber_cell.set(scrub::Scrubber::start(
        cfg.scrub.clone(),
        replicas.clone(),
        router.clone(),
    ));

    // Unmark what the barriers settled.
    {
        let replicas = replicas.clone();
        tokio::spawn(async move {
            let mut t = tokio::time::interval(Duration::from_secs(SETTLE_MARKS_S));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                t.tick().await;
                let r = replicas.clone();
                let _ = tokio::task::spawn_blocking(move || r.settle_marks()).await;
            }
        });
    }

    // Liveness.
    let r2 = replicas.clone();
    liveness.spawn(move || {
        r2.devices()
            .iter()
            .map(|d| liveness::device_usage(d))
            .collect()
    });

    // Owners for volumes that need healing, without client I/O.
    tokio::spawn(caretaker::run(router.clone()));
    // On the leader: dead directory voters replaced by learners.
    tokio::spawn(voters::run(dir.clone()));

    // Follow the directory: owners get new views; components of deleted
    // volumes are removed.
    {
        let router = router.clone();
        let replicas = replicas.clone();
        let mut w = dir.watch();
        essentials.spawn("following the directory", async move {
            loop {
                let state = w.borrow_and_update().clone();
                router.directory_changed(&state);
                garbage_collect(&state, &replicas);
                space::update(&state, &replicas);
                if w.changed().await.is_err() {
                    bail!("the directory's state is no longer published");
                }
            }
        });
    }

    // NBD.
    let exports = Arc::new(exports::VolumeExports {
        router: router.clone(),
    });
    tracing::info!(
        node = cfg.id,
        nbd = %cfg.nbd_addr,
        api = %cfg.api_addr,
        peer = %cfg.peer_addr,
        cluster = %cluster_id,
        "node ready"
    );
    println!(
        "shoal node {} ready: nbd://{} api http://{}",
        cfg.id, cfg.nbd_addr, cfg.api_addr
    );
    let nbd_tls_mode = cfg
        .nbd_tls
        .unwrap_or_else(|| NbdTlsMode::default_for(&cfg.nbd_addr));
    let revoked: shoal_tls::Revoked = {
        let dir = dir.clone();
        Arc::new(move |sha256: &str| dir.state().revoked_certs.contains(sha256))
    };
    let nbd_tls = nbd_tls_mode.server(&creds, cfg.nbd_tls_psk.as_deref(), revoked)?;
    tracing::info!(mode = ?nbd_tls_mode, "NBD over TCP: TLS");
    let (stop_nbd, nbd_stopped) = tokio::sync::watch::channel(());
    if let Some((l, path)) = nbd_unix {
        println!(
            "shoal node {} serves nbd+unix:///VOLUME?socket={}",
            cfg.id,
            path.display()
        );
        let (exports, stopped) = (exports.clone(), nbd_stopped.clone());
        essentials.spawn("the NBD socket server", async move {
            // Local clients are authorised by the socket's permissions.
            let r =
                shoal_nbd::serve(l, exports, stopped_signal(stopped), shoal_nbd::NbdTls::Off).await;
            let _ = std::fs::remove_file(&path);
            Ok(r?)
        });
    }
    essentials.spawn("the NBD server", async move {
        Ok(shoal_nbd::serve(nbd_l, exports, stopped_signal(nbd_stopped), nbd_tls).await?)
    });
    let failure = tokio::select! {
        () = shutdown => None,
        why = ended.recv() => Some(why.unwrap_or_else(|| "every essential part ended".into())),
        why = dir.stopped() => Some(why),
    };
    // The servers stop accepting; what they accepted ends with the process.
    let _ = stop_nbd.send(());
    match &failure {
        None => tracing::info!("shutting down"),
        Some(why) => tracing::error!(reason = %why, "node stops: an essential part ended"),
    }
    dir.shutdown().await;
    match failure {
        None => Ok(()),
        Some(why) => bail!("{why}"),
    }
}

/// The client this node reaches other members' routes with: mutual TLS
/// with its certificate.
fn member_transport(creds: &shoal_tls::NodeCredentials) -> Result<shoal_directory::Transport> {
    let client = reqwest::Client::builder()
        .use_preconfigured_tls((*creds.client_config()?).clone())
        .connect_timeout(shoal_directory::CONNECT_TIMEOUT)
        .build()
        .context("building the members' HTTPS client")?;
    Ok(shoal_directory::Transport {
        client,
        scheme: "https",
    })
}

/// Admits a proven member unless the directory revoked its certificate.
fn admit_unrevoked(dir: &Directory) -> shoal_tls::Admit {
    let state = dir.watch();
    Arc::new(move |m: &shoal_tls::Member| !state.borrow().revoked_certs.contains(&m.cert_sha256))
}

/// Resolves when the sender of `rx` sends or is dropped: the stop signal
/// of the NBD servers (they end when the node stops).
async fn stopped_signal(mut rx: tokio::sync::watch::Receiver<()>) {
    let _ = rx.changed().await;
}

/// Removes local components whose volume (or component) the directory no
/// longer has. Ids are never reused, so an id below `next_id` that is
/// missing was deleted (and not merely unknown to a lagging copy).
fn garbage_collect(state: &shoal_directory::ClusterState, replicas: &replica::Replicas) {
    if state.cluster_id.is_empty() {
        return;
    }
    for (comp, vol, _dev) in replicas.components() {
        if comp >= state.next_id || vol >= state.next_id {
            continue;
        }
        let live = state
            .volumes
            .get(&vol)
            .is_some_and(|v| v.components.iter().any(|c| c.id == comp));
        if !live {
            tracing::info!(
                component = comp,
                volume = vol,
                "removing a component the directory no longer lists (its volume deleted, or \
                 the component replaced)"
            );
            use shoal_rpc::Handler;
            // The deletion happens now; the returned future syncs it.
            tokio::spawn(replicas.handle(
                shoal_rpc::Request::DeleteComponent { component: comp },
                bytes::Bytes::new(),
            ));
        }
    }
}

async fn retry<F, Fut>(what: &str, f: F) -> Result<Response>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Response, shoal_directory::DirectoryError>>,
{
    let mut last = None;
    for _ in 0..120 {
        match f().await {
            Ok(r) => return Ok(r),
            Err(shoal_directory::DirectoryError::State(e)) => bail!("{what}: {e}"),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    bail!(
        "{what}: {}",
        last.map(|e| e.to_string()).unwrap_or_default()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_nbd_socket_is_for_its_user_and_its_group_only() {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        let _l = bind_unix(&path).unwrap();
        // The group of gid 0 by its name, whatever the system calls it.
        // SAFETY: getgrgid with a valid id; the record is read at once.
        let name = unsafe {
            let g = libc::getgrgid(0);
            assert!(!g.is_null(), "no group 0 on this system");
            std::ffi::CStr::from_ptr((*g).gr_name)
                .to_string_lossy()
                .into_owned()
        };
        socket_access(&path, Some(&name)).unwrap();
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, NBD_SOCKET_MODE);
        assert_eq!(m.gid(), 0);
        let err = format!(
            "{:#}",
            socket_access(&path, Some("no-such-group-here")).unwrap_err()
        );
        assert!(err.contains("no group named"), "{err}");
    }

    #[tokio::test]
    async fn nbd_socket_replaces_a_stale_file_and_never_a_live_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");

        // A socket file nobody answers on (its node was killed): replaced.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let live = bind_unix(&path).expect("a stale socket is replaced");

        // One a live listener answers on: refused, and left in place.
        let err = format!("{:#}", bind_unix(&path).unwrap_err());
        assert!(err.contains("served by another process"), "{err}");
        assert!(path.exists());
        let client = tokio::net::UnixStream::connect(&path).await;
        assert!(client.is_ok(), "the live listener still answers");
        drop(live);

        // Not a socket: refused, and the file is untouched.
        let file = dir.path().join("data");
        std::fs::write(&file, b"keep").unwrap();
        let err = format!("{:#}", bind_unix(&file).unwrap_err());
        assert!(err.contains("not a socket"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), b"keep");

        // A path too long for a socket address: a clear error.
        let long = dir.path().join("x".repeat(120));
        assert!(bind_unix(&long).is_err());
    }
}
