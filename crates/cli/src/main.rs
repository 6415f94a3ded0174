//! # shoal: the command line
//!
//! `shoal node` runs one node; `shoal up` / `shoal down` run a local cluster
//! of node processes on loopback; `shoal status` and `shoal volume ...`
//! manage a cluster through any node's REST API; `shoal bench` measures it
//! (`shoal-bench`). Owns argument parsing and presentation only.

mod daemon;
mod device;
mod local;
mod maintenance;
mod policy;
mod show;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use shoal_model::parse_size;
use shoal_node::{DeviceSpec, NodeConfig};
use std::path::PathBuf;

/// mimalloc instead of glibc's malloc: every request allocates and frees a
/// few small objects (futures, frames, buffers), often on different
/// threads, and glibc's took a measurable share of the busiest node thread
/// (bench/RESULTS.md, 2026-11-30, wake-ups, the allocator, and request
/// futures).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "shoal", version, about = "Shoal: hyperconverged block storage")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

/// How commands find the cluster.
#[derive(Args, Clone)]
pub struct Target {
    /// Data folder of a local cluster started with `shoal up`.
    #[arg(
        long,
        global = true,
        default_value = "./shoal-data",
        env = "SHOAL_DATA"
    )]
    data: PathBuf,
    /// API address of any node (`http://ip:port`); overrides --data.
    #[arg(long, global = true, env = "SHOAL_API")]
    api: Option<String>,
    /// API token (`shoal token create`); default: the local cluster's
    /// admin token, DATA/admin.token.
    #[arg(long, global = true, env = "SHOAL_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon of one node. (`shoal node maintenance ...` and
    /// `shoal node remove N` are `shoal maintenance ...` and `shoal
    /// cluster remove-node N`.)
    Node(NodeArgs),
    /// Start (or complete) a local cluster of node processes on loopback.
    Up(local::UpArgs),
    /// Stop the local cluster.
    Down(#[command(flatten)] Target),
    /// Nodes, devices and volumes with their health.
    Status {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Create, list, show, resize and delete volumes.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Make, list and revoke API tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Cluster-wide actions and settings.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// A node's maintenance mode: enter (ensure-accessibility,
    /// full-data-migration, no-data-migration), exit, status.
    #[command(subcommand)]
    Maintenance(maintenance::MaintenanceCmd),
    /// A running node's devices: add one, remove one (its components
    /// move off it first), show one.
    #[command(subcommand)]
    Device(device::DeviceCmd),
    /// Certificates for NBD clients.
    #[command(subcommand)]
    Cert(CertCmd),
    /// Benchmark the cluster: workload profiles over NBD, latency
    /// percentiles, CPU per I/O, and baselines (raw file, nbdkit).
    Bench {
        #[command(flatten)]
        target: Target,
        #[command(flatten)]
        args: shoal_bench::BenchArgs,
    },
}

#[derive(Subcommand)]
enum CertCmd {
    /// Make a key and a certificate of the cluster for an NBD client and
    /// write them to DIR (`ca-cert.pem`, `client-cert.pem`,
    /// `client-key.pem`), as libnbd (`nbds://...?tls-certificates=DIR`)
    /// and qemu (`tls-creds-x509,dir=DIR`) read them. The key is made
    /// here and never sent.
    Client {
        /// The client's name (in its certificate).
        name: String,
        /// Folder to write (made 0700 if missing).
        #[arg(long)]
        out: PathBuf,
        #[command(flatten)]
        target: Target,
    },
    /// Revoke every certificate made for an NBD client: nodes refuse its
    /// TLS handshakes from then on (connections it holds stay until they
    /// close).
    RevokeClient {
        /// The client's name, as given to `shoal cert client`.
        name: String,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Revoke every certificate of a node: members refuse its connections
    /// from then on (those it holds close within a second). It comes back
    /// only by joining anew, with a new data folder and a join token.
    RevokeNode {
        id: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Remove a node for good: refused while it holds any component
    /// (`shoal maintenance enter ID --mode full-data-migration` moves them
    /// off). It leaves the directory and its voters, and its certificates
    /// are revoked.
    RemoveNode {
        id: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Change a cluster-wide setting, e.g. `shoal cluster set
    /// repair-delay 30m`; it is kept in the directory, for every node.
    Set {
        /// The setting to change.
        setting: Setting,
        /// Its new value (repair-delay: a duration, 90s, 30m, 24h or 7d;
        /// resync-mib-per-s: a whole number of MiB/s, 0 for the adaptive pace).
        #[arg(allow_negative_numbers = true)]
        value: String,
        #[command(flatten)]
        target: Target,
    },
    /// The cluster-wide settings.
    Settings {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
}

/// The cluster-wide settings `shoal cluster set` changes.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Setting {
    /// How long a copy whose host is unreachable is waited for before its
    /// data is rebuilt elsewhere: 1s to 7d (default 60m).
    RepairDelay,
    /// Static limit of each owner's resync and rebuild copies, in MiB/s:
    /// 0 (adaptive: yields to client I/O, the default) to 102400.
    ResyncMibPerS,
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Make a token; its text is printed once.
    Create {
        /// admin (everything), read-only (status, volumes, metrics) or
        /// join (a new node's certificate, nothing else).
        #[arg(long, required_unless_present = "join", conflicts_with = "join")]
        role: Option<String>,
        /// A join token: what `shoal node --join ADDR --join-token TOKEN`
        /// needs; it names this cluster's CA and expires (--ttl, default
        /// 24h).
        #[arg(long)]
        join: bool,
        /// Lifetime: 90s, 30m, 24h, 7d (join tokens: default 24h; others:
        /// until revoked).
        #[arg(long, value_parser = parse_duration_s)]
        ttl: Option<u64>,
        /// What it is for.
        #[arg(long, default_value = "")]
        note: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Tokens by id and role (never their secrets).
    List {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token by id: it opens nothing from then on.
    Revoke {
        id: String,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a volume: its size and policy (copies, witnesses or
    /// stripes placed on distinct fault domains, the space checked first).
    Create {
        name: String,
        /// Size: bytes or K, M, G, T.
        #[arg(long)]
        size: String,
        /// Storage policy, e.g. "raid1 ftt=1", "ftt=0".
        #[arg(long, default_value = "raid1 ftt=1")]
        policy: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// The volumes: size, policy, owner and health.
    List {
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// A volume: its layout, where every component is, its capacity and
    /// any change in progress.
    Show {
        name: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Grow a volume (an erasure-coded one once its owner has moved its map
    /// log past the new end: the command waits for that).
    Resize {
        name: String,
        #[arg(long)]
        size: String,
        /// How long to wait for an erasure-coded volume's growth (its
        /// owner moves the map log, then commits the size): 90s, 30m.
        #[arg(long, value_parser = parse_duration_s, default_value = "10m")]
        timeout: u64,
        #[command(flatten)]
        target: Target,
    },
    /// Change a volume's settings, in force at once for its clients.
    Set {
        name: String,
        /// IOPS limit (32 KiB units, reads and writes together); 0: none.
        #[arg(long)]
        iops: Option<u32>,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Change a volume's policy in place, under I/O: copies and witnesses
    /// added on fault domains it does not use (the space checked first),
    /// or the surplus dropped; e.g. --policy "raid1 ftt=2".
    SetPolicy {
        name: String,
        /// The new policy, whole, as `volume create --policy` takes it
        /// (words left out take their defaults); ftt=N must be given.
        #[arg(long)]
        policy: String,
        /// Wait until the change is committed, printing its progress.
        #[arg(long)]
        wait: bool,
        /// How long --wait waits: 90s, 30m, 2h.
        #[arg(long, value_parser = parse_duration_s, default_value = "1h", requires = "wait")]
        timeout: u64,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Compare the data copies of a volume (CRC-32C of each); fails if they differ.
    Verify {
        name: String,
        #[command(flatten)]
        target: Target,
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume and its data on every device; refused while
    /// clients are connected, unless --force.
    Delete {
        name: String,
        /// Delete even with clients connected.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        target: Target,
    },
}

#[derive(Args)]
struct NodeArgs {
    /// TOML file with the keys of the flags (id, data, device =
    /// ["PATH:SIZE"], peer, nbd, nbd_socket, api, join, fault_domain,
    /// scrub_mib_per_s, scrub_interval_h) and a `[tuning]` table; see
    /// docs/config.md. An unknown key is refused.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Node id (also its Raft id), unique in the cluster.
    #[arg(long)]
    id: Option<u64>,
    /// Data folder of this node.
    #[arg(long)]
    data: Option<PathBuf>,
    /// A device: PATH:SIZE creates a sparse file of SIZE if missing,
    /// PATH:SIZE:thick a file written in full (faster writes, uses the
    /// space at once); PATH alone uses an existing file or block device.
    /// Repeatable.
    #[arg(long = "device")]
    devices: Vec<String>,
    /// Peer RPC address.
    #[arg(long)]
    peer: Option<String>,
    /// NBD address.
    #[arg(long)]
    nbd: Option<String>,
    /// NBD also on this Unix socket, for clients on this host
    /// (`nbd+unix:///VOLUME?socket=PATH`): no TCP stack on either side.
    /// Default DATA/nbd.sock; "none" serves NBD over TCP only.
    #[arg(long)]
    nbd_socket: Option<String>,
    /// HTTP API address.
    #[arg(long)]
    api: Option<String>,
    /// API address of a member, to join its cluster.
    #[arg(long)]
    join: Option<String>,
    /// The join token (`shoal token create --join` on a member) a new node
    /// shows with --join for its certificate; a restart needs none.
    #[arg(long, env = "SHOAL_JOIN_TOKEN", hide_env_values = true)]
    join_token: Option<String>,
    /// Keep the connections between nodes encrypted for their whole life
    /// (TLS); without it they are proven by mutual TLS and then carry the
    /// data in the clear (docs/security.md).
    #[arg(long)]
    encrypt_in_transit: bool,
    /// NBD over TCP: require, allow or off TLS (x509, a client
    /// certificate of the cluster: `shoal cert client`; or TLS-PSK with
    /// --nbd-tls-psk). Default: require on a non-loopback address, allow
    /// on loopback.
    #[arg(long)]
    nbd_tls: Option<String>,
    /// NBD over TCP proves clients by pre-shared keys (TLS-PSK, as qemu's
    /// tls-creds-psk and libnbd's tls-psk-file) instead of certificates:
    /// the key file, `identity:hexkey` lines as GnuTLS's psktool writes,
    /// mode 0600.
    #[arg(long, value_name = "FILE")]
    nbd_tls_psk: Option<PathBuf>,
    /// Group of the NBD Unix socket (mode 0660): its members may use NBD
    /// on this host.
    #[arg(long)]
    nbd_socket_group: Option<String>,
    /// The cluster key file (64 hex digits, mode 0600; the same file on
    /// every node): it wraps the data keys of `encrypt=on` volumes.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// Fault domain (default: the node is its own).
    #[arg(long)]
    fault_domain: Option<String>,
    /// How long a client request may wait for its volume (owner failover,
    /// no quorum) before it fails with an I/O error: 10s, 2m (default 30s).
    #[arg(long, value_parser = parse_io_wait_s)]
    io_wait: Option<u64>,
    /// Scrubber read rate in MiB/s (0: no periodic scrub; default 8).
    #[arg(long)]
    scrub_mib_per_s: Option<u32>,
    /// Hours between scrub passes (default 168, a week).
    #[arg(long)]
    scrub_interval_h: Option<u64>,
    /// Threads of the node's async runtime (default: one per core). Nodes
    /// that share a machine should share its cores: `shoal up` gives each
    /// of its N nodes cores/N (at least 1), because every wake-up of an
    /// idle worker on another core costs tens of microseconds per I/O.
    #[arg(long)]
    workers: Option<usize>,
}

/// `--config node.toml`: the flags' keys; an unknown key is refused, not
/// ignored.
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct NodeFile {
    id: Option<u64>,
    data: Option<PathBuf>,
    #[serde(default)]
    device: Vec<String>,
    peer: Option<String>,
    nbd: Option<String>,
    nbd_socket: Option<String>,
    api: Option<String>,
    join: Option<String>,
    #[serde(default)]
    encrypt_in_transit: bool,
    nbd_tls: Option<String>,
    nbd_tls_psk: Option<PathBuf>,
    nbd_socket_group: Option<String>,
    key_file: Option<PathBuf>,
    fault_domain: Option<String>,
    #[serde(default, deserialize_with = "io_wait_from_file")]
    io_wait: Option<u64>,
    scrub_mib_per_s: Option<u32>,
    scrub_interval_h: Option<u64>,
    /// `[tuning]`: threads and batching of the data path.
    #[serde(default)]
    tuning: Option<shoal_node::NodeTuning>,
}

/// The longest I/O wait bound accepted, in seconds: beyond an hour a
/// client is better told.
const MAX_IO_WAIT_S: u64 = 3600;
/// Interval of `volume resize`'s looks at an erasure-coded volume's
/// growth, in milliseconds: a growth takes from a fraction of a second
/// (a small map) to seconds.
const GROW_POLL_MS: u64 = 200;

/// `--io-wait`: a duration of 1 s to an hour.
fn parse_io_wait_s(s: &str) -> Result<u64, String> {
    let v = parse_duration_s(s)?;
    if v > MAX_IO_WAIT_S {
        return Err(format!("{s:?}: at most {MAX_IO_WAIT_S}s"));
    }
    Ok(v)
}

/// `io_wait = "30s"` in a node's config file, checked as the flag is.
fn io_wait_from_file<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let s: Option<String> = serde::Deserialize::deserialize(d)?;
    s.map(|s| parse_io_wait_s(&s).map_err(serde::de::Error::custom))
        .transpose()
}

/// A repair delay (`shoal cluster set repair-delay`, `shoal up
/// --repair-delay`): a duration of `MIN_REPAIR_DELAY_S` to
/// `MAX_REPAIR_DELAY_S`.
fn parse_repair_delay_s(s: &str) -> Result<u64, String> {
    let v = parse_duration_s(s)?;
    let range = shoal_model::MIN_REPAIR_DELAY_S..=shoal_model::MAX_REPAIR_DELAY_S;
    if !range.contains(&v) {
        return Err(format!(
            "{s:?}: out of range: {} to {}",
            human_duration_s(*range.start()),
            human_duration_s(*range.end())
        ));
    }
    Ok(v)
}

/// Seconds in the largest unit of `parse_duration_s` that divides them:
/// `30s`, `90s`, `45m`, `1h`, `7d` (read back as they are written).
fn human_duration_s(s: u64) -> String {
    let units = [(86400, 'd'), (3600, 'h'), (60, 'm')];
    match units.iter().find(|(n, _)| s > 0 && s.is_multiple_of(*n)) {
        Some((n, unit)) => format!("{}{unit}", s / n),
        None => format!("{s}s"),
    }
}

/// A duration as `90s`, `30m`, `24h` or `7d`, in seconds (at least 1).
fn parse_duration_s(s: &str) -> Result<u64, String> {
    let (n, unit) = s.split_at(s.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len());
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected a number and s, m, h or d (e.g. 24h)"))?;
    let mul = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return Err(format!("{s:?}: the unit is s, m, h or d")),
    };
    match n.checked_mul(mul) {
        Some(v) if v > 0 => Ok(v),
        _ => Err(format!("{s:?}: out of range (at least 1s)")),
    }
}

fn parse_device(s: &str) -> Result<DeviceSpec> {
    let (s, thick) = match s.strip_suffix(":thick") {
        Some(rest) => (rest, true),
        None => (s, false),
    };
    match s.rsplit_once(':') {
        Some((p, size)) if !p.is_empty() && parse_size(size).is_ok() => Ok(DeviceSpec {
            path: PathBuf::from(p),
            size: parse_size(size)?,
            thick,
        }),
        _ if thick => bail!("--device {s}:thick needs a size (PATH:SIZE:thick)"),
        _ => Ok(DeviceSpec {
            path: PathBuf::from(s),
            size: 0,
            thick,
        }),
    }
}

/// The node's configuration from its flags and `--config` file (flags
/// win).
fn node_config(a: NodeArgs) -> Result<NodeConfig> {
    let f: NodeFile = match &a.config {
        Some(p) => toml::from_str(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("parsing {}", p.display()))?,
        None => NodeFile::default(),
    };
    let mut tuning = f.tuning.clone().unwrap_or_default();
    if let Some(w) = a.workers {
        tuning.workers = Some(w);
    }
    tuning.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let id = a.id.or(f.id).unwrap_or(1);
    if id == 0 {
        bail!("node ids start at 1");
    }
    let data = a
        .data
        .or(f.data)
        .unwrap_or_else(|| PathBuf::from(format!("./shoal-node-{id}")));
    let mut devs: Vec<String> = if a.devices.is_empty() {
        f.device
    } else {
        a.devices
    };
    if devs.is_empty() {
        devs.push(format!("{}:8G", data.join("dev0.img").display()));
    }
    let devices = devs
        .iter()
        .map(|d| parse_device(d))
        .collect::<Result<Vec<_>>>()?;
    let cfg = NodeConfig {
        id,
        devices,
        peer_addr: a.peer.or(f.peer).unwrap_or_else(|| "127.0.0.1:9500".into()),
        nbd_addr: a.nbd.or(f.nbd).unwrap_or_else(|| "127.0.0.1:10809".into()),
        nbd_socket: match a.nbd_socket.or(f.nbd_socket).as_deref() {
            None => shoal_node::NbdSocket::Default(data.join("nbd.sock")),
            Some("none") => shoal_node::NbdSocket::None,
            Some(p) => shoal_node::NbdSocket::Path(PathBuf::from(p)),
        },
        api_addr: a.api.or(f.api).unwrap_or_else(|| "127.0.0.1:9400".into()),
        join: a.join.or(f.join),
        join_token: a.join_token,
        encrypt_in_transit: a.encrypt_in_transit || f.encrypt_in_transit,
        nbd_tls: a.nbd_tls.or(f.nbd_tls).map(|m| m.parse()).transpose()?,
        nbd_tls_psk: a.nbd_tls_psk.or(f.nbd_tls_psk),
        nbd_socket_group: a.nbd_socket_group.or(f.nbd_socket_group),
        key_file: a.key_file.or(f.key_file),
        fault_domain: a.fault_domain.or(f.fault_domain),
        io_wait_s: a
            .io_wait
            .or(f.io_wait)
            .unwrap_or(shoal_node::default_io_wait_s()),
        data_dir: data,
        scrub: {
            let d = shoal_node::scrub::ScrubConfig::default();
            shoal_node::scrub::ScrubConfig {
                mib_per_s: a
                    .scrub_mib_per_s
                    .or(f.scrub_mib_per_s)
                    .unwrap_or(d.mib_per_s),
                interval_h: a
                    .scrub_interval_h
                    .or(f.scrub_interval_h)
                    .unwrap_or(d.interval_h),
            }
        },
        tuning,
    };
    if let Some(psk) = &cfg.nbd_tls_psk {
        // A bad key file is said now, not once the node has started.
        shoal_node::NbdTlsMode::psk(cfg.nbd_tls, psk)?;
    }
    Ok(cfg)
}

/// `shoal node maintenance ARGS` and `shoal node remove N` (vSAN's and
/// the self-healing issue's spelling) are `shoal maintenance ARGS` and
/// `shoal cluster remove-node N`: `shoal node` itself runs the daemon and
/// takes flags only, so the words after it are read here.
fn node_verbs(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let word = |i: usize| args.get(i).and_then(|a| a.to_str()).map(str::to_owned);
    if word(1).as_deref() == Some("node") {
        match word(2).as_deref() {
            Some("maintenance") => {
                args.remove(1);
            }
            Some("remove") => {
                args.splice(1..3, ["cluster".into(), "remove-node".into()]);
            }
            _ => {}
        }
    }
    args
}

fn main() {
    let cli = Cli::parse_from(node_verbs(std::env::args_os().collect()));
    match cli.cmd {
        Cmd::Node(a) => node_main(a),
        cmd => {
            // Behave like other tools when the reader of our output goes away.
            // SAFETY: restoring the default disposition of a signal at start-up.
            unsafe {
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
            }
            let rt = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the runtime: {e}");
                    std::process::exit(1);
                }
            };
            if let Err(e) = rt.block_on(run(cmd)) {
                eprintln!("error: {e:#}");
                std::process::exit(1);
            }
        }
    }
}

/// Seconds a node asked to stop while still starting gets to finish its
/// start and stop in order before the process ends anyway.
const STOP_DURING_START_S: u64 = 5;

/// `shoal node`: the daemon. Every way it ends is logged, recorded in
/// `DATA/node.exit` and told by its exit code (see `daemon`).
fn node_main(a: NodeArgs) -> ! {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,openraft=warn".into()),
        )
        .init();
    daemon::ignore_sigpipe();
    let cfg = match node_config(a) {
        Ok(c) => c,
        Err(e) => daemon::exit(daemon::EXIT_FAILED, &format!("{e:#}")),
    };
    if let Err(e) = daemon::start(&cfg.data_dir) {
        daemon::exit(
            daemon::EXIT_FAILED,
            &format!("preparing {}: {e}", cfg.data_dir.display()),
        );
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cfg.tuning.workers {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => daemon::exit(
            daemon::EXIT_FAILED,
            &format!("cannot start the runtime: {e}"),
        ),
    };
    let r = rt.block_on(async {
        let (asked, stop) = tokio::sync::watch::channel(None::<&'static str>);
        tokio::spawn(async move {
            match daemon::stop_requested().await {
                Ok(sig) => {
                    tracing::info!("received {sig}: stopping");
                    let _ = asked.send(Some(sig));
                }
                Err(e) => tracing::error!("cannot handle stop signals: {e}"),
            }
            // Keep the sender: a dropped one would read as a stop.
            std::future::pending::<()>().await;
        });
        let asked = |mut rx: tokio::sync::watch::Receiver<Option<&'static str>>| async move {
            let sig = rx.wait_for(|s| s.is_some()).await.ok().and_then(|s| *s);
            sig.unwrap_or("a stop request")
        };
        let node = shoal_node::run(cfg, async {
            asked(stop.clone()).await;
        });
        tokio::select! {
            r = node => r.map(|()| stop.borrow().unwrap_or("a stop request")),
            sig = async {
                let sig = asked(stop.clone()).await;
                tokio::time::sleep(std::time::Duration::from_secs(STOP_DURING_START_S)).await;
                sig
            } => Ok(sig),
        }
    });
    match r {
        Ok(sig) => daemon::exit(daemon::EXIT_STOPPED, &format!("stopped on {sig}")),
        Err(e) => daemon::exit(daemon::EXIT_FAILED, &format!("{e:#}")),
    }
}

async fn run(cmd: Cmd) -> Result<()> {
    match cmd {
        Cmd::Node(_) => bail!("shoal node runs in node_main"),
        Cmd::Up(a) => local::up(a).await,
        Cmd::Down(t) => local::down(&t.data),
        Cmd::Status { target, json } => status(&target, json).await,
        Cmd::Volume(v) => volume(v).await,
        Cmd::Token(t) => token(t).await,
        Cmd::Cert(CertCmd::Client { name, out, target }) => {
            local::client_credentials(&local::client(&target)?, &name, &out).await?;
            println!(
                "wrote {}: ca-cert.pem, client-cert.pem, client-key.pem",
                out.display()
            );
            Ok(())
        }
        Cmd::Cert(CertCmd::RevokeClient { name, target }) => {
            local::client(&target)?.revoke_client(&name).await?;
            println!("client {name}: certificates revoked");
            Ok(())
        }
        Cmd::Maintenance(m) => maintenance::run(m).await,
        Cmd::Device(d) => device::run(d).await,
        Cmd::Cluster(ClusterCmd::RemoveNode { id, target }) => {
            maintenance::remove_node(id, &target).await
        }
        Cmd::Cluster(ClusterCmd::RevokeNode { id, target }) => {
            local::client(&target)?.revoke_node(id).await?;
            println!("node {id}: certificates revoked");
            Ok(())
        }
        Cmd::Cluster(ClusterCmd::Set {
            setting,
            value,
            target,
        }) => {
            let update = settings_update(setting, &value)?;
            let s = local::client(&target)?
                .set_cluster_settings(&update)
                .await
                .context("changing the cluster's settings")?;
            show_settings(&s);
            Ok(())
        }
        Cmd::Cluster(ClusterCmd::Settings { target, json }) => {
            let s = local::client(&target)?
                .cluster_settings()
                .await
                .context("reading the cluster's settings")?;
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                show_settings(&s);
            }
            Ok(())
        }
        Cmd::Bench { target, args } => {
            let c = local::client(&target)?;
            // Node pids (for CPU time) are known for a local cluster only.
            let data = target.api.is_none().then(|| target.data.clone());
            shoal_bench::run(args, c, data).await
        }
    }
}

/// The change `shoal cluster set SETTING VALUE` asks for.
fn settings_update(setting: Setting, value: &str) -> Result<shoal_api::ClusterSettingsUpdate> {
    let mut u = shoal_api::ClusterSettingsUpdate::default();
    match setting {
        Setting::RepairDelay => {
            let v = parse_repair_delay_s(value).map_err(|e| anyhow::anyhow!("repair-delay {e}"))?;
            u.repair_delay_s = Some(v);
        }
        Setting::ResyncMibPerS => {
            let v = parse_resync_mib_per_s(value)
                .map_err(|e| anyhow::anyhow!("resync-mib-per-s {e}"))?;
            u.resync_mib_per_s = Some(v);
        }
    }
    Ok(u)
}

/// A static resync limit (`shoal cluster set resync-mib-per-s`): a whole
/// number of MiB/s, 0 (adaptive) to `MAX_RESYNC_MIB_PER_S`.
fn parse_resync_mib_per_s(s: &str) -> Result<u64, String> {
    let max = shoal_model::MAX_RESYNC_MIB_PER_S;
    let range = || format!("0 (adaptive) to {max}");
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "{s:?}: expected a whole number of MiB/s, {}",
            range()
        ));
    }
    match s.parse::<u64>() {
        Ok(v) if v <= max => Ok(v),
        _ => Err(format!("{s:?}: out of range: {}", range())),
    }
}

/// The cluster-wide settings for people, one `name: value` a line.
fn show_settings(s: &shoal_model::ClusterSettings) {
    println!("repair-delay: {}", human_duration_s(s.repair_delay_s));
    match s.resync_mib_per_s {
        0 => println!("resync-mib-per-s: 0 (adaptive)"),
        n => println!("resync-mib-per-s: {n}"),
    }
}

async fn token(t: TokenCmd) -> Result<()> {
    match t {
        TokenCmd::Create {
            role,
            join,
            ttl,
            note,
            target,
            json,
        } => {
            let role: shoal_model::Role = match (join, role) {
                (true, _) => shoal_model::Role::Join,
                (false, Some(r)) => r.parse()?,
                (false, None) => bail!("--role or --join"),
            };
            let c = local::client(&target)?;
            let r = c
                .create_token(&shoal_api::CreateToken {
                    role,
                    note,
                    ttl_s: ttl,
                })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("{}", r.token);
                eprintln!(
                    "token {} ({}): keep its text; it is not shown again",
                    r.id, r.role
                );
            }
        }
        TokenCmd::List { target, json } => {
            let r = local::client(&target)?.tokens().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("{:<18} {:<10} NOTE", "ID", "ROLE");
                for t in r {
                    println!("{:<18} {:<10} {}", t.id, t.role.to_string(), t.note);
                }
            }
        }
        TokenCmd::Revoke { id, target } => {
            local::client(&target)?.revoke_token(&id).await?;
            println!("revoked token {id}");
        }
    }
    Ok(())
}

/// `shoal status`: the cluster as a node sees it and, for a local cluster,
/// every node whose process is not running, with why it ended and the last
/// lines of its log (also when no node answers at all).
async fn status(target: &Target, json: bool) -> Result<()> {
    let stopped = match (&target.api, local::load(&target.data)?) {
        (None, Some(c)) => local::stopped_nodes(&c),
        _ => Vec::new(),
    };
    let c = local::client(target)?;
    let s = c.status().await;
    if json {
        let mut v = match &s {
            Ok(s) => serde_json::to_value(s)?,
            Err(e) => serde_json::json!({ "error": format!("{e:#}") }),
        };
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "stopped_local_nodes".into(),
                serde_json::to_value(&stopped)?,
            );
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if let Ok(s) = &s {
        show::status(s);
    }
    if !json {
        for n in &stopped {
            local::print_stopped(n, "is not running");
        }
    }
    s.map(|_| ()).context("no node of the cluster answered")
}

async fn volume(v: VolumeCmd) -> Result<()> {
    match v {
        VolumeCmd::Create {
            name,
            size,
            policy,
            target,
            json,
        } => {
            let size = parse_size(&size)?;
            let c = local::client(&target)?;
            let r = c
                .create_volume(&shoal_api::CreateVolume { name, size, policy })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                show::volume(&r);
            }
        }
        VolumeCmd::List { target, json } => {
            let c = local::client(&target)?;
            let r = c.volumes().await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                show::volumes(&r);
            }
        }
        VolumeCmd::Show { name, target, json } => {
            let c = local::client(&target)?;
            let r = c.volume(&name).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                show::volume(&r);
            }
        }
        VolumeCmd::Resize {
            name,
            size,
            timeout,
            target,
        } => {
            let size = parse_size(&size)?;
            let c = local::client(&target)?;
            let mut r = c.resize_volume(&name, size).await?;
            let bound = std::time::Duration::from_secs(timeout);
            let start = std::time::Instant::now();
            while r.volume.grow_to.is_some() {
                if start.elapsed() > bound {
                    bail!(
                        "volume {name} is still growing to {size} bytes after {timeout} s \
                         (`shoal volume show {name}` says when it is done)"
                    );
                }
                tokio::time::sleep(std::time::Duration::from_millis(GROW_POLL_MS)).await;
                r = c.volume(&name).await?;
            }
            show::volume(&r);
        }
        VolumeCmd::Set {
            name,
            iops,
            target,
            json,
        } => {
            if iops.is_none() {
                bail!("nothing to set: give --iops N (0: no limit)");
            }
            let c = local::client(&target)?;
            let r = c
                .set_volume(&name, &shoal_api::VolumeSettings { iops_limit: iops })
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                show::volume(&r);
            }
        }
        VolumeCmd::SetPolicy {
            name,
            policy,
            wait,
            timeout,
            target,
            json,
        } => {
            let c = local::client(&target)?;
            let wait = wait.then(|| std::time::Duration::from_secs(timeout));
            policy::set_policy(&c, &name, &policy, wait, json).await?;
        }
        VolumeCmd::Verify { name, target, json } => {
            let c = local::client(&target)?;
            let r = c.digests(&name).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                for d in &r.copies {
                    match (d.crc32c, &d.error) {
                        (Some(crc), _) => println!(
                            "component {} on node {}: crc32c {crc:08x}",
                            d.component, d.node
                        ),
                        (None, e) => println!(
                            "component {} on node {}: {}",
                            d.component,
                            d.node,
                            e.clone().unwrap_or_default()
                        ),
                    }
                }
            }
            if !r.identical {
                bail!("the copies of volume {name} differ or could not all be read");
            }
            if !json {
                println!("all {} copies identical", r.copies.len());
            }
        }
        VolumeCmd::Delete {
            name,
            force,
            target,
        } => {
            let c = local::client(&target)?;
            c.delete_volume(&name, force).await?;
            println!("deleted volume {name}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// Every command says what it does: none shows the text of the
    /// arguments it shares (clap gives a command without a doc comment of
    /// its own the doc comment of a struct it flattens).
    #[test]
    fn every_command_has_its_own_help() {
        use clap::CommandFactory;
        fn walk(c: &clap::Command, path: &str, bad: &mut Vec<String>) {
            for sub in c.get_subcommands().filter(|s| s.get_name() != "help") {
                let path = format!("{path} {}", sub.get_name());
                let about = sub.get_about().map(|a| a.to_string()).unwrap_or_default();
                if about.is_empty() || about.starts_with("How commands find the cluster") {
                    bad.push(format!("{path}: {about:?}"));
                }
                walk(sub, &path, bad);
            }
        }
        let mut bad = Vec::new();
        walk(&super::Cli::command(), "shoal", &mut bad);
        assert!(bad.is_empty(), "commands without their own help: {bad:#?}");
    }

    #[test]
    fn node_maintenance_and_node_remove_are_the_maintenance_commands() {
        let v = |a: &[&str]| -> Vec<std::ffi::OsString> { a.iter().map(Into::into).collect() };
        assert_eq!(
            node_verbs(v(&[
                "shoal",
                "node",
                "maintenance",
                "enter",
                "3",
                "--mode",
                "x"
            ])),
            v(&["shoal", "maintenance", "enter", "3", "--mode", "x"])
        );
        assert_eq!(
            node_verbs(v(&["shoal", "node", "remove", "3"])),
            v(&["shoal", "cluster", "remove-node", "3"])
        );
        // The daemon's flags are left alone.
        let daemon = v(&["shoal", "node", "--id", "1", "--data", "d"]);
        assert_eq!(node_verbs(daemon.clone()), daemon);
        assert_eq!(node_verbs(v(&["shoal"])), v(&["shoal"]));
    }

    use super::*;

    fn args(config: &std::path::Path, extra: &[&str]) -> NodeArgs {
        let mut argv = vec!["shoal", "node", "--config", config.to_str().unwrap()];
        argv.extend_from_slice(extra);
        match Cli::parse_from(argv).cmd {
            Cmd::Node(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn repair_delays_parse_in_range_and_print_back() {
        for (text, s) in [("30s", 30), ("90s", 90), ("45m", 2700), ("24h", 86400)] {
            assert_eq!(parse_repair_delay_s(text), Ok(s), "{text}");
            assert_eq!(parse_repair_delay_s(&human_duration_s(s)), Ok(s));
        }
        assert_eq!(human_duration_s(3600), "1h");
        assert_eq!(human_duration_s(7 * 86400), "7d");
        for (text, want) in [
            ("0s", "out of range"),
            ("8d", "out of range: 1s to 7d"),
            ("1y", "the unit is s, m, h or d"),
            ("abc", "expected a number"),
        ] {
            let e = parse_repair_delay_s(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
        let e = settings_update(Setting::RepairDelay, "0s").unwrap_err();
        assert!(format!("{e:#}").starts_with("repair-delay \"0s\""), "{e:#}");
    }

    #[test]
    fn resync_limits_parse_up_to_the_maximum() {
        let max = shoal_model::MAX_RESYNC_MIB_PER_S;
        for (text, v) in [("0", 0), ("50", 50), (&*max.to_string(), max)] {
            assert_eq!(parse_resync_mib_per_s(text), Ok(v), "{text}");
        }
        for (text, want) in [
            ("-5", "expected a whole number of MiB/s"),
            ("1.5", "expected a whole number"),
            ("fast", "expected a whole number"),
            ("", "expected a whole number"),
            (
                &*(max + 1).to_string(),
                "out of range: 0 (adaptive) to 102400",
            ),
            ("99999999999999999999999", "out of range"),
        ] {
            let e = parse_resync_mib_per_s(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
        let u = settings_update(Setting::ResyncMibPerS, "50").unwrap();
        assert_eq!((u.repair_delay_s, u.resync_mib_per_s), (None, Some(50)));
        let e = settings_update(Setting::ResyncMibPerS, "-1").unwrap_err();
        assert!(
            format!("{e:#}").starts_with("resync-mib-per-s \"-1\""),
            "{e:#}"
        );
    }

    /// The config file's keys reach the node's typed config, flags win,
    /// and an unknown key or a value out of range is refused.
    #[test]
    fn node_config_from_file_and_flags() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("node.toml");
        std::fs::write(
            &f,
            "id = 3\napi = \"127.0.0.9:9400\"\n[tuning]\nsync_threads = 2\nread_batch = 16\n",
        )
        .unwrap();
        let c = node_config(args(&f, &["--workers", "3"])).unwrap();
        assert_eq!(c.id, 3);
        assert_eq!(c.api_addr, "127.0.0.9:9400");
        assert_eq!(c.tuning.sync_threads, 2);
        assert_eq!(c.tuning.read_batch, 16);
        assert_eq!(c.tuning.read_threads, 2, "a default");
        assert_eq!(c.tuning.workers, Some(3), "the flag");
        let c = node_config(args(&f, &["--id", "5"])).unwrap();
        assert_eq!(c.id, 5, "the flag wins");

        for (text, want) in [
            ("id = 1\nworkerz = 2\n", "unknown field"),
            ("[tuning]\nsync_thread = 2\n", "unknown field"),
            ("[tuning]\nread_threads = 0\n", "out of range"),
            ("[tuning]\ngather_us = 1000000\n", "out of range"),
        ] {
            std::fs::write(&f, text).unwrap();
            let e = format!("{:#}", node_config(args(&f, &[])).unwrap_err());
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }
}
