//! `shoal up` / `shoal down`: a local cluster of node processes on loopback,
//! described by `<data>/cluster.json`. Node i listens on `<net>.i` with the
//! same ports on every node, so node 1 serves NBD on 127.0.0.1:10809.

use crate::Target;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde::{Deserialize, Serialize};
use shoal_api::{Client, CreateVolume};
use shoal_model::{parse_size, NodeState};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct UpArgs {
    #[command(flatten)]
    target: Target,
    /// Number of nodes of a new cluster [default: 4].
    #[arg(long)]
    nodes: Option<u32>,
    /// Size of each node's device file of a new cluster [default: 8G].
    #[arg(long)]
    device_size: Option<String>,
    /// Device files each node of a new cluster starts with (devN.img in
    /// its folder, each of --device-size), 1 to 16 [default: 1]: to
    /// compare, say, 4 and 8 devices per host.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16))]
    devices_per_node: Option<u32>,
    /// First three octets of a new cluster's loopback addresses: node i is
    /// NET.i [default: 127.0.0].
    #[arg(long)]
    net: Option<String>,
    /// NBD port of a new cluster's nodes [default: 10809].
    #[arg(long)]
    nbd_port: Option<u16>,
    /// API port of a new cluster's nodes [default: 9400].
    #[arg(long)]
    api_port: Option<u16>,
    /// Peer port of a new cluster's nodes [default: 9500].
    #[arg(long)]
    peer_port: Option<u16>,
    /// Size of the demo volume created on a new cluster [default: 1G].
    #[arg(long)]
    demo_size: Option<String>,
    /// Do not create the demo volume.
    #[arg(long)]
    no_demo: bool,
    /// Seconds to wait for the cluster to become healthy.
    #[arg(long, default_value_t = 90)]
    timeout: u64,
    /// `ID=PATH`: node ID of a new cluster uses the existing file PATH (of
    /// at least --device-size bytes) as its device instead of a sparse
    /// file in its folder, e.g. a FUSE file for fault injection.
    /// Repeatable.
    #[arg(long = "node-device", value_name = "ID=PATH")]
    node_devices: Vec<String>,
    /// Runtime threads of each node started now [default: the machine's
    /// cores shared among the nodes, at least one each].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=256))]
    workers: Option<u16>,
    /// Create the device files of a new cluster written in full instead
    /// of sparse: they take their whole size on disk at once (and a while
    /// to write), and writes are faster (no block allocation on the data
    /// path).
    #[arg(long)]
    thick: bool,
    /// Keep a new cluster's connections between nodes encrypted (TLS) for
    /// their whole life; without it they are proven by mutual TLS and
    /// then carry the data path in the clear. Kept for the cluster's
    /// restarts.
    #[arg(long)]
    encrypt_in_transit: bool,
    /// NBD over TCP of a new cluster's nodes: require, allow or off TLS
    /// [default: allow on loopback]. Client credentials are written to
    /// DATA/tls/client/ either way.
    #[arg(long)]
    nbd_tls: Option<String>,
    /// NBD over TCP of a new cluster's nodes proves clients by the
    /// pre-shared keys of FILE (TLS-PSK; `identity:hexkey` lines as
    /// GnuTLS's psktool writes, mode 0600) instead of certificates.
    #[arg(long, value_name = "FILE")]
    nbd_tls_psk: Option<PathBuf>,
    /// Set the cluster's repair delay once it is up, new or not (as
    /// `shoal cluster set repair-delay` does): how long a copy whose host
    /// is unreachable is waited for before its data is rebuilt elsewhere,
    /// 1s to 7d [default: the cluster's, 60m unless set].
    #[arg(long, value_name = "DURATION", value_parser = crate::parse_repair_delay_s)]
    repair_delay: Option<u64>,
}

impl UpArgs {
    /// The flags that shape a new cluster, by name, when given: they
    /// cannot change a cluster that exists.
    fn layout_flags(&self) -> Vec<&'static str> {
        let given = [
            ("--nodes", self.nodes.is_some()),
            ("--device-size", self.device_size.is_some()),
            ("--devices-per-node", self.devices_per_node.is_some()),
            ("--net", self.net.is_some()),
            ("--nbd-port", self.nbd_port.is_some()),
            ("--api-port", self.api_port.is_some()),
            ("--peer-port", self.peer_port.is_some()),
            ("--demo-size", self.demo_size.is_some()),
            ("--node-device", !self.node_devices.is_empty()),
            ("--thick", self.thick),
            ("--encrypt-in-transit", self.encrypt_in_transit),
            ("--nbd-tls", self.nbd_tls.is_some()),
            ("--nbd-tls-psk", self.nbd_tls_psk.is_some()),
        ];
        given.iter().filter(|(_, g)| *g).map(|(n, _)| *n).collect()
    }
}

/// The `--node-device ID=PATH` overrides, by node id.
fn node_devices(specs: &[String]) -> Result<std::collections::BTreeMap<u64, PathBuf>> {
    let mut out = std::collections::BTreeMap::new();
    for s in specs {
        let Some((id, path)) = s.split_once('=') else {
            bail!("--node-device {s:?}: expected ID=PATH");
        };
        let id: u64 = id
            .trim()
            .parse()
            .with_context(|| format!("--node-device {s:?}: bad node id"))?;
        if path.is_empty() {
            bail!("--node-device {s:?}: empty path");
        }
        out.insert(id, PathBuf::from(path));
    }
    Ok(out)
}

#[derive(Serialize, Deserialize, Clone)]
pub struct LocalNode {
    pub id: u64,
    pub dir: PathBuf,
    pub api: String,
    pub nbd: String,
    pub peer: String,
    pub device: String,
    /// The node's other devices (`--devices-per-node`), started with it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_devices: Vec<String>,
}

#[derive(Serialize, Deserialize)]
pub struct LocalCluster {
    pub nodes: Vec<LocalNode>,
    /// Nodes start with `--encrypt-in-transit`.
    #[serde(default)]
    pub encrypt_in_transit: bool,
    /// Nodes start with `--nbd-tls` this (none: the node's default).
    #[serde(default)]
    pub nbd_tls: Option<String>,
    /// Nodes start with `--nbd-tls-psk` this key file (absolute).
    #[serde(default)]
    pub nbd_tls_psk: Option<PathBuf>,
    /// The cluster key every node is started with (`--key-file`), made
    /// with the cluster: `encrypt=on` volumes need it.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
}

fn layout_path(data: &Path) -> PathBuf {
    data.join("cluster.json")
}

pub fn load(data: &Path) -> Result<Option<LocalCluster>> {
    let p = layout_path(data);
    match std::fs::read(&p) {
        Ok(b) => Ok(Some(
            serde_json::from_slice(&b).with_context(|| format!("{} is damaged", p.display()))?,
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
    }
}

fn pid_file(n: &LocalNode) -> PathBuf {
    n.dir.join("node.pid")
}

/// The pid of the node's process, if it runs.
pub fn running(n: &LocalNode) -> Option<i32> {
    liveness(n).ok()
}

/// The pid of node `n`'s process if it runs, or what shows it does not:
/// no pid file, no such process, a zombie, or a process that is not a
/// node (its pid reused).
fn liveness(n: &LocalNode) -> Result<i32, String> {
    let file = pid_file(n);
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("no pid file {}: {e}", file.display()))?;
    let pid: i32 = text
        .trim()
        .parse()
        .map_err(|_| format!("pid file {} holds {text:?}", file.display()))?;
    // SAFETY: signal 0 only checks that the process exists.
    if unsafe { libc::kill(pid, 0) } != 0 {
        return Err(format!("no process {pid}"));
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name, which is in parentheses.
    let state = stat.rsplit_once(')').map(|(_, rest)| rest.trim_start());
    if state.is_some_and(|s| s.starts_with('Z')) {
        return Err(format!("process {pid} is a zombie"));
    }
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    if !String::from_utf8_lossy(&cmd).contains("node") {
        return Err(format!(
            "process {pid} is not a node: {:?}",
            String::from_utf8_lossy(&cmd).replace('\0', " ")
        ));
    }
    Ok(pid)
}

/// Runtime threads of each node of a local cluster of `nodes` nodes: the
/// machine's cores shared among them, at least one each (more threads than
/// cores only adds wake-ups of idle workers to every I/O), unless
/// `--workers` says otherwise.
fn workers_per_node(nodes: usize, asked: Option<usize>) -> usize {
    if let Some(n) = asked {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / nodes.max(1)).max(1)
}

/// Lines of a stopped node's log shown by `shoal status` and `shoal up`.
const LOG_TAIL_LINES: usize = 8;

/// The last `lines` lines of a node's log.
pub fn log_tail(n: &LocalNode, lines: usize) -> Vec<String> {
    let text = std::fs::read(n.dir.join("node.log")).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let mut tail: Vec<String> = text.lines().rev().take(lines).map(str::to_string).collect();
    tail.reverse();
    tail
}

/// A node of the local cluster whose process is not running.
#[derive(Serialize)]
pub struct StoppedNode {
    pub id: u64,
    /// What its exit record says, if it ever ran.
    pub last_exit: Option<String>,
    /// What showed it is not running.
    pub evidence: String,
    pub log: PathBuf,
    pub log_tail: Vec<String>,
}

/// The nodes of a local cluster that are not running.
pub fn stopped_nodes(c: &LocalCluster) -> Vec<StoppedNode> {
    c.nodes
        .iter()
        .filter_map(|n| liveness(n).err().map(|e| (n, e)))
        .map(|(n, evidence)| StoppedNode {
            id: n.id,
            last_exit: crate::daemon::last_exit(&n.dir),
            evidence,
            log: n.dir.join("node.log"),
            log_tail: log_tail(n, LOG_TAIL_LINES),
        })
        .collect()
}

/// Prints what is known of a node that is not running: why it ended and
/// the last lines of its log.
pub fn print_stopped(s: &StoppedNode, verb: &str) {
    let why = s
        .last_exit
        .as_deref()
        .unwrap_or("it has not run with this build (no exit record)");
    println!("node {} {verb}: {why} ({})", s.id, s.evidence);
    if !s.log_tail.is_empty() {
        println!("  last lines of {}:", s.log.display());
        for l in &s.log_tail {
            println!("    {l}");
        }
    }
}

/// Starts a node process; a node joining for the first time gets its join
/// token through the environment (not its command line, which every
/// local user can read).
fn start_node(
    n: &LocalNode,
    join: Option<&str>,
    join_token: Option<&str>,
    workers: usize,
    cluster: &LocalCluster,
) -> Result<i32> {
    std::fs::create_dir_all(&n.dir)?;
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(n.dir.join("node.log"))?;
    let exe = std::env::current_exe().context("finding the shoal binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("node")
        .arg("--id")
        .arg(n.id.to_string())
        .arg("--data")
        .arg(&n.dir)
        .arg("--device")
        .arg(&n.device)
        .args(n.more_devices.iter().flat_map(|d| ["--device", d.as_str()]))
        .arg("--api")
        .arg(&n.api)
        .arg("--nbd")
        .arg(&n.nbd)
        .arg("--peer")
        .arg(&n.peer)
        .arg("--workers")
        .arg(workers.to_string());
    if let Some(j) = join {
        cmd.arg("--join").arg(j);
    }
    if cluster.encrypt_in_transit {
        cmd.arg("--encrypt-in-transit");
    }
    if let Some(m) = &cluster.nbd_tls {
        cmd.arg("--nbd-tls").arg(m);
    }
    if let Some(k) = &cluster.nbd_tls_psk {
        cmd.arg("--nbd-tls-psk").arg(k);
    }
    if let Some(k) = &cluster.key_file {
        cmd.arg("--key-file").arg(k);
    }
    match join_token {
        Some(t) => cmd.env("SHOAL_JOIN_TOKEN", t),
        None => cmd.env_remove("SHOAL_JOIN_TOKEN"),
    };
    cmd.stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .process_group(0);
    let child = cmd.spawn().context("starting a node process")?;
    let pid = child.id() as i32;
    std::fs::write(pid_file(n), pid.to_string())?;
    // The child is reaped by init once we exit; it runs on its own.
    std::mem::forget(child);
    Ok(pid)
}

pub async fn up(a: UpArgs) -> Result<()> {
    let data = a.target.data.clone();
    std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
    {
        // The cluster's folder holds every node's data: the user's alone.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("setting the mode of {}", data.display()))?;
    }
    let data = data.canonicalize()?;
    let fresh;
    let cluster = match load(&data)? {
        Some(c) => {
            let flags = a.layout_flags();
            if !flags.is_empty() {
                bail!(
                    "{} shape a new cluster only; {} already holds a cluster of {} nodes \
                     (shoal down, then remove the folder, to make a new one)",
                    flags.join(", "),
                    data.display(),
                    c.nodes.len()
                );
            }
            fresh = false;
            c
        }
        None => {
            fresh = true;
            let nodes = a.nodes.unwrap_or(4);
            if nodes == 0 {
                bail!("a cluster needs at least one node");
            }
            let size = parse_size(a.device_size.as_deref().unwrap_or("8G"))?;
            let net = a.net.clone().unwrap_or_else(|| "127.0.0".into());
            let (nbd_port, api_port, peer_port) = (
                a.nbd_port.unwrap_or(10809),
                a.api_port.unwrap_or(9400),
                a.peer_port.unwrap_or(9500),
            );
            let overrides = node_devices(&a.node_devices)?;
            if let Some(id) = overrides.keys().find(|&&id| id == 0 || id > nodes as u64) {
                bail!("--node-device: there is no node {id}");
            }
            let per_node = a.devices_per_node.unwrap_or(1);
            if per_node > 1 && !overrides.is_empty() {
                bail!(
                    "--node-device gives a node its one device: use it without --devices-per-node"
                );
            }
            let spec = |file: PathBuf| match a.thick {
                true => format!("{}:{size}:thick", file.display()),
                false => format!("{}:{size}", file.display()),
            };
            let nodes = (1..=nodes as u64)
                .map(|i| {
                    let dir = data.join(format!("node{i}"));
                    let file = overrides
                        .get(&i)
                        .cloned()
                        .unwrap_or_else(|| dir.join("dev0.img"));
                    LocalNode {
                        id: i,
                        api: format!("{net}.{i}:{api_port}"),
                        nbd: format!("{net}.{i}:{nbd_port}"),
                        peer: format!("{net}.{i}:{peer_port}"),
                        device: if a.thick && !overrides.contains_key(&i) {
                            format!("{}:{size}:thick", file.display())
                        } else {
                            format!("{}:{size}", file.display())
                        },
                        more_devices: (1..per_node)
                            .map(|k| spec(dir.join(format!("dev{k}.img"))))
                            .collect(),
                        dir,
                    }
                })
                .collect();
            let nbd_tls = a
                .nbd_tls
                .as_deref()
                .map(str::parse::<shoal_node::NbdTlsMode>)
                .transpose()?;
            let nbd_tls_psk = match &a.nbd_tls_psk {
                Some(k) => {
                    shoal_node::NbdTlsMode::psk(nbd_tls, k)?;
                    Some(std::path::absolute(k).unwrap_or_else(|_| k.clone()))
                }
                None => None,
            };
            let key_file = data.join(CLUSTER_KEY_FILE);
            if !key_file.exists() {
                shoal_crypt::ClusterKey::generate_file(&key_file)
                    .with_context(|| format!("making the cluster key {}", key_file.display()))?;
            }
            let key_file = std::path::absolute(&key_file).unwrap_or(key_file);
            let c = LocalCluster {
                nodes,
                encrypt_in_transit: a.encrypt_in_transit,
                nbd_tls: a.nbd_tls.clone(),
                nbd_tls_psk,
                key_file: Some(key_file),
            };
            std::fs::write(layout_path(&data), serde_json::to_vec_pretty(&c)?)?;
            c
        }
    };
    let first_api = cluster.nodes[0].api.clone();
    if !fresh {
        for s in stopped_nodes(&cluster) {
            if s.last_exit.is_some() {
                print_stopped(&s, "was not running");
            }
        }
    }
    let mut join_token: Option<String> = None;
    for n in &cluster.nodes {
        if let Some(pid) = running(n) {
            println!("node {} already running (pid {pid})", n.id);
            continue;
        }
        let join = (n.id != cluster.nodes[0].id).then_some(first_api.as_str());
        let token = match join {
            Some(_) if !has_certificate(n) => {
                if join_token.is_none() {
                    join_token = Some(new_join_token(&data, &first_api).await?);
                }
                join_token.as_deref()
            }
            _ => None,
        };
        let pid = start_node(
            n,
            join,
            token,
            workers_per_node(cluster.nodes.len(), a.workers.map(usize::from)),
            &cluster,
        )?;
        println!(
            "started node {} (pid {pid}) api {} nbd {}",
            n.id, n.api, n.nbd
        );
        if fresh && n.id == cluster.nodes[0].id {
            // Let the first node found the cluster before the others join.
            wait_api(&n.api, Duration::from_secs(a.timeout)).await?;
            take_admin_token(n, &data, Duration::from_secs(a.timeout)).await?;
            let admin = Client::with_token(&n.api, self::token(&a.target));
            let limit = Duration::from_secs(a.timeout);
            client_credentials_when_ready(&admin, "shoal-up", &client_tls_dir(&data), limit)
                .await
                .context("writing the NBD client credentials")?;
        }
    }

    // Wait for every node to be up in the directory.
    let deadline = Instant::now() + Duration::from_secs(a.timeout);
    let want = cluster.nodes.len();
    let want_devices: usize = cluster.nodes.iter().map(|n| 1 + n.more_devices.len()).sum();
    let mut suspects: Vec<u64> = Vec::new();
    let status = loop {
        // Every node answers (so it serves NBD too) and sees a leader, and
        // the directory has every node up with its devices.
        let mut last = String::new();
        let mut answered = 0;
        let mut view = None;
        for n in &cluster.nodes {
            match Client::with_token(&n.api, token(&a.target)).status().await {
                Ok(s) if s.leader.is_some() => {
                    answered += 1;
                    view = Some(s);
                }
                Ok(_) => last = format!("node {} sees no leader", n.id),
                Err(e) => last = format!("node {}: {e}", n.id),
            }
        }
        if let Some(s) = view {
            let up = s.nodes.iter().filter(|x| x.state == NodeState::Up).count();
            if answered == want && up == want && s.devices.len() >= want_devices {
                break s;
            }
            if last.is_empty() {
                last = format!("{up} of {want} nodes up");
            }
        }
        // Seen stopped twice in a row, 300 ms apart: a node that died
        // stays so, and one look at /proc is not taken for a death.
        let stopped = stopped_nodes(&cluster);
        if let Some(s) = stopped.iter().find(|s| suspects.contains(&s.id)) {
            print_stopped(s, "stopped while the cluster was starting");
            bail!("node {} is not running; see {}", s.id, s.log.display());
        }
        suspects = stopped.iter().map(|s| s.id).collect();
        if Instant::now() > deadline {
            bail!(
                "cluster not healthy after {}s: {last}; see {}/node*/node.log",
                a.timeout,
                data.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    println!(
        "cluster {} healthy: {} nodes up, leader node {}",
        status.cluster_id,
        want,
        status.leader.unwrap_or(0)
    );

    let c = Client::with_token(&first_api, token(&a.target));
    if let Some(s) = a.repair_delay {
        set_repair_delay(&c, s).await?;
    }
    if !a.no_demo && status.volumes.iter().all(|v| v.volume.name != "demo") && fresh {
        let policy = match want {
            1 | 2 => "ftt=0",
            3 | 4 => "raid1 ftt=1",
            _ => "raid1 ftt=2",
        };
        let r = c
            .create_volume(&CreateVolume {
                name: "demo".into(),
                size: parse_size(a.demo_size.as_deref().unwrap_or("1G"))?,
                policy: policy.into(),
            })
            .await
            .context("creating the demo volume")?;
        println!(
            "created volume demo ({}, {})",
            shoal_model::human_size(r.volume.size),
            r.volume.policy
        );
    }
    let nbd1 = &cluster.nodes[0].nbd;
    println!();
    println!("Volumes are NBD exports on every node, e.g.:");
    for n in &cluster.nodes {
        println!("  nbd://{}/demo", n.nbd);
    }
    println!("and, for clients on this host, on each node's Unix socket:");
    let sock = cluster.nodes[0].dir.join("nbd.sock");
    let sock = std::path::absolute(&sock).unwrap_or(sock);
    println!("  nbd+unix:///demo?socket={}", sock.display());
    println!();
    match &cluster.nbd_tls_psk {
        Some(psk) => {
            // An identity of the key file for the example (the nodes
            // read the file themselves; IDENTITY if it cannot be read).
            let identity = shoal_node::NbdTlsMode::psk(None, psk)
                .ok()
                .and_then(|(_, ids)| ids.into_iter().next())
                .unwrap_or_else(|| "IDENTITY".into());
            println!("and over TLS with a pre-shared key of {}:", psk.display());
            println!(
                "  nbds://{identity}@{nbd1}/demo?tls-psk-file={}",
                psk.display()
            );
        }
        None => {
            let creds = client_tls_dir(&data);
            let creds = std::path::absolute(&creds).unwrap_or(creds);
            println!("and over TLS with this cluster's client credentials:");
            println!("  nbds://{nbd1}/demo?tls-certificates={}", creds.display());
        }
    }
    println!();
    println!("Try:");
    println!("  nbdinfo nbd://{nbd1}/demo");
    println!("  qemu-img convert -n -O raw disk.img nbd://{nbd1}/demo");
    println!("  fio --name=t --ioengine=nbd --uri=nbd://{nbd1}/demo --rw=randwrite --bs=4k --iodepth=32 --size=256M --runtime=10 --time_based");
    println!("  mkdir -p /tmp/shoal-fuse && nbdfuse /tmp/shoal-fuse/disk nbd://{nbd1}/demo &   # then mkfs.ext4 + mount -o loop");
    println!("  shoal status; shoal volume show demo; shoal down");
    Ok(())
}

/// `shoal up --repair-delay`: sets the cluster's repair delay.
async fn set_repair_delay(c: &Client, repair_delay_s: u64) -> Result<()> {
    let update = shoal_api::ClusterSettingsUpdate {
        repair_delay_s: Some(repair_delay_s),
        ..Default::default()
    };
    let s = c
        .set_cluster_settings(&update)
        .await
        .context("setting the repair delay")?;
    println!(
        "repair delay: {}",
        crate::human_duration_s(s.repair_delay_s)
    );
    Ok(())
}

async fn wait_api(api: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(s) = Client::new(api).livez().await {
            if !s.cluster_id.is_empty() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("node at {api} did not start within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

pub fn down(data: &Path) -> Result<()> {
    let Some(c) = load(data)? else {
        bail!("no local cluster in {} (no cluster.json)", data.display());
    };
    let mut pids = Vec::new();
    for n in &c.nodes {
        if let Some(pid) = running(n) {
            // SAFETY: plain signal to a process we started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
            pids.push((n.id, pid, n.clone()));
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && pids.iter().any(|(_, _, n)| running(n).is_some()) {
        std::thread::sleep(Duration::from_millis(100));
    }
    for (id, pid, n) in &pids {
        if running(n).is_some() {
            // SAFETY: as above.
            unsafe { libc::kill(*pid, libc::SIGKILL) };
            println!("node {id} killed");
        } else {
            println!("node {id} stopped");
        }
        let _ = std::fs::remove_file(pid_file(n));
    }
    if pids.is_empty() {
        println!("no node was running");
    }
    Ok(())
}

/// The admin token of the local cluster in `data` (`DATA/admin.token`).
pub fn admin_token_path(data: &Path) -> PathBuf {
    data.join(shoal_node::ADMIN_TOKEN_FILE)
}

/// The token to present: `--token` (or `SHOAL_TOKEN`), else the local
/// cluster's admin token.
fn token(t: &Target) -> Option<String> {
    if let Some(tok) = &t.token {
        return Some(tok.clone());
    }
    let text = std::fs::read_to_string(admin_token_path(&t.data)).ok()?;
    Some(text.trim().to_string())
}

/// Makes a key here, has the cluster sign a client certificate for it
/// under `name`, and writes the three files to `dir`.
pub async fn client_credentials(c: &Client, name: &str, dir: &Path) -> Result<()> {
    let req = shoal_tls::KeyRequest::new()?;
    let answer = c
        .client_cert(&shoal_api::ClientCertRequest {
            name: name.to_string(),
            csr_pem: req.csr_pem.clone(),
        })
        .await
        .context("asking the cluster for a client certificate")?;
    shoal_tls::ClientCredentials::save(dir, &answer.ca_pem, &answer.cert_pem, &req.key_pem)?;
    Ok(())
}

/// [`client_credentials`] from a cluster just founded: asked again while
/// the node answers that it cannot yet (its directory has not recorded the
/// cluster CA), at most `limit`.
async fn client_credentials_when_ready(
    c: &Client,
    name: &str,
    dir: &Path,
    limit: Duration,
) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        match client_credentials(c, name, dir).await {
            Err(e) if Instant::now() < deadline && is_unavailable(&e) => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            r => return r,
        }
    }
}

/// Whether the API answered that it cannot serve yet.
fn is_unavailable(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| matches!(c.downcast_ref(), Some(shoal_api::ApiError::Unavailable(_))))
}

/// The cluster key of a local cluster, in its folder (mode 0600): it wraps
/// the data keys of `encrypt=on` volumes.
pub const CLUSTER_KEY_FILE: &str = "cluster.key";

/// Where `shoal up` writes the NBD client credentials of its cluster.
pub fn client_tls_dir(data: &Path) -> PathBuf {
    data.join("tls").join("client")
}

/// Whether a local node has its certificate (it joined before).
fn has_certificate(n: &LocalNode) -> bool {
    n.dir
        .join(shoal_node::membership::TLS_DIR)
        .join(shoal_tls::CERT_FILE)
        .exists()
}

/// A join token for the nodes this `shoal up` adds, valid for an hour.
async fn new_join_token(data: &Path, first_api: &str) -> Result<String> {
    let admin = std::fs::read_to_string(admin_token_path(data))
        .with_context(|| format!("reading {}", admin_token_path(data).display()))?;
    let c = Client::with_token(first_api, Some(admin.trim().to_string()));
    let t = c
        .create_token(&shoal_api::CreateToken {
            role: shoal_model::Role::Join,
            note: "made by shoal up for its nodes".into(),
            ttl_s: Some(UP_JOIN_TOKEN_TTL_S),
        })
        .await
        .context("making a join token for the other nodes")?;
    Ok(t.token)
}

/// Lifetime of the join token `shoal up` makes, in seconds: its nodes join
/// within its `--timeout`; an hour leaves room and little to leak.
const UP_JOIN_TOKEN_TTL_S: u64 = 3600;

/// Waits for the founding node's admin token to be in the directory, then
/// copies it to the cluster's folder (mode 0600), where the command line
/// finds it.
async fn take_admin_token(first: &LocalNode, data: &Path, timeout: Duration) -> Result<()> {
    let from = first.dir.join(shoal_node::ADMIN_TOKEN_FILE);
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(text) = std::fs::read_to_string(&from) {
            let c = Client::with_token(&first.api, Some(text.trim().to_string()));
            if c.status().await.is_ok() {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                let to = admin_token_path(data);
                let mut f = std::fs::OpenOptions::new()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .mode(0o600)
                    .open(&to)
                    .with_context(|| format!("writing {}", to.display()))?;
                f.write_all(text.as_bytes())?;
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("node {} made no admin token within {timeout:?}", first.id);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A client for the cluster the target names: `--api`, or the first node
/// of the local cluster in `--data` that answers; with `--token`, or the
/// local cluster's admin token.
pub fn client(t: &Target) -> Result<Client> {
    if let Some(api) = &t.api {
        return Ok(Client::with_token(api, token(t)));
    }
    let Some(c) = load(&t.data)? else {
        bail!(
            "no cluster found: {} has no cluster.json; run `shoal up` or pass --api http://HOST:PORT",
            t.data.display()
        );
    };
    let n = c
        .nodes
        .iter()
        .find(|n| running(n).is_some())
        .or(c.nodes.first())
        .context("cluster.json lists no nodes")?;
    Ok(Client::with_token(&n.api, token(t)))
}
