//! Test harness: a local cluster of real `shoal` processes, started with
//! `shoal up` on a loopback subnet (127.0.N.x) of its own, claimed with
//! [`Subnet::claim`], and data folder, and stopped (kill -9 of leftovers)
//! when dropped.
#![allow(dead_code)]

pub mod bitrot;
pub mod fio;
pub mod ledger;
pub mod load;
pub mod netns;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub fn shoal_bin() -> &'static str {
    env!("CARGO_BIN_EXE_shoal")
}

/// True if a program is on PATH. Interop tests require their tools: CI
/// installs them, so a missing tool is a failure, not a skip.
pub fn require(tool: &str) {
    let ok = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(ok, "{tool} is not installed (CI installs it: see .ci/run)");
}

/// Polls `cond` until it holds, at most `timeout`; panics with `what` and
/// the last state `cond` described (its `Err`) if it never does. Tests wait
/// for conditions, never for a fixed time.
pub fn wait_for<T>(what: &str, timeout: Duration, cond: impl FnMut() -> Result<T, String>) -> T {
    match poll_for(timeout, cond) {
        Ok(v) => v,
        Err(last) => panic!("{what}: not after {timeout:?} (last: {last})"),
    }
}

/// What [`wait_for`] does, with the last `Err` of `cond` returned instead
/// of a panic: for clean-ups (`Drop`), which must not panic and have a
/// way out when the condition never comes.
pub fn poll_for<T>(
    timeout: Duration,
    mut cond: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(20);
    loop {
        match cond() {
            Ok(v) => return Ok(v),
            Err(last) if Instant::now() > deadline => return Err(last),
            Err(_) => {}
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// Checks that `cond` keeps holding for all of `window`, polling it; panics
/// with `what` as soon as it does not. Only for claims that something does
/// NOT change, which no condition can show earlier than the window's end.
pub fn holds_for(what: &str, window: Duration, mut cond: impl FnMut() -> Result<(), String>) {
    let end = Instant::now() + window;
    loop {
        if let Err(e) = cond() {
            panic!("{what}: no longer holds: {e}");
        }
        if Instant::now() >= end {
            return;
        }
        std::thread::sleep(Duration::from_millis(100).min(end - Instant::now()));
    }
}

/// Whether process `pid` still runs (a zombie does not).
pub fn pid_alive(pid: i32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the command name in parentheses.
    let state = stat
        .rsplit(')')
        .next()
        .and_then(|r| r.split_whitespace().next());
    matches!(state, Some(s) if s != "Z" && s != "X")
}

/// HTTP status (0: no answer, e.g. a refused handshake) and body of
/// `curl URL` with `extra` arguments, within 10 s.
#[allow(dead_code)]
pub fn curl(url: &str, extra: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args([
            "-s",
            "--max-time",
            "10",
            "-o",
            "-",
            "-w",
            "\n%{http_code}",
            url,
        ])
        .args(extra)
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

pub fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

/// Runs a command and panics with its output if it fails.
pub fn ok(cmd: &mut Command) -> String {
    let out = run(cmd);
    if !out.status.success() {
        panic!(
            "command failed: {:?}\nstatus: {}\nstdout:\n{}\nstderr:\n{}",
            cmd,
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn sh(script: &str) -> String {
    ok(Command::new("bash").arg("-c").arg(script))
}

/// Test clusters take their addresses from 127.0.N.x for N in this range
/// (lower subnets are left to clusters people start by hand with `shoal up
/// --net`, e.g. for benchmarks).
pub const SUBNETS: std::ops::RangeInclusive<u8> = 100..=250;

/// Ports of every node (`shoal up` defaults).
pub const NBD_PORT: u16 = 10809;
pub const API_PORT: u16 = 9400;
pub const PEER_PORT: u16 = 9500;

/// A loopback subnet 127.0.N.x held by this test for as long as the value
/// lives: the first N of [`SUBNETS`] whose lock file
/// `/tmp/shoal-test-subnet-N.lock` this process can `flock` exclusively,
/// so no two tests share one, whether they run on threads of one test
/// binary or in test processes running at the same time. (The lock goes
/// with the process, so a killed test run leaves none behind.) Node `i` is
/// 127.0.N.i.
pub struct Subnet {
    n: u8,
    _lock: File,
}

impl Subnet {
    pub fn claim() -> Subnet {
        for n in SUBNETS {
            let path = format!("/tmp/shoal-test-subnet-{n}.lock");
            // A lock file we cannot open (another user's) is a subnet in use.
            let Ok(f) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
            else {
                continue;
            };
            // SAFETY: flock on a descriptor this function owns; the lock
            // lives as long as `f`, and is released when it is closed.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                continue;
            }
            let s = Subnet { n, _lock: f };
            // Nodes left running by a test process that was killed hold
            // their addresses with no lock: skip such a subnet.
            let free = [NBD_PORT, API_PORT, PEER_PORT]
                .iter()
                .all(|&p| std::net::TcpListener::bind(s.addr(1, p)).is_ok());
            if free {
                return s;
            }
        }
        panic!(
            "no free test subnet in 127.0.{}-{} (locks /tmp/shoal-test-subnet-N.lock)",
            SUBNETS.start(),
            SUBNETS.end()
        );
    }

    /// The first three octets, as `shoal up --net` takes them.
    pub fn net(&self) -> String {
        format!("127.0.{}", self.n)
    }

    /// Address of host `node` of the subnet.
    pub fn host(&self, node: u32) -> String {
        format!("127.0.{}.{node}", self.n)
    }

    /// `host:port` on host `node`.
    pub fn addr(&self, node: u32, port: u16) -> String {
        format!("{}:{port}", self.host(node))
    }

    pub fn nbd_addr(&self, node: u32) -> String {
        self.addr(node, NBD_PORT)
    }

    pub fn api_addr(&self, node: u32) -> String {
        self.addr(node, API_PORT)
    }

    pub fn peer_addr(&self, node: u32) -> String {
        self.addr(node, PEER_PORT)
    }
}

pub struct Cluster {
    pub data: PathBuf,
    pub nodes: u32,
    _tmp: tempfile::TempDir,
    /// Last: released after the nodes are gone and the folder removed.
    subnet: Subnet,
}

impl Cluster {
    /// Starts `nodes` nodes on a subnet of their own ([`Subnet::claim`]),
    /// so tests can run in parallel.
    pub fn start(nodes: u32) -> Cluster {
        Self::start_with(nodes, &[])
    }

    /// Like `start`, with more arguments to `shoal up`.
    pub fn start_with(nodes: u32, extra: &[&str]) -> Cluster {
        Self::start_sized(nodes, "4G", extra)
    }

    /// Like `start_with`, with devices of `device_size` (`shoal up
    /// --device-size`).
    pub fn start_sized(nodes: u32, device_size: &str, extra: &[&str]) -> Cluster {
        let tmp = tempfile::Builder::new()
            .prefix("shoal-test")
            .tempdir()
            .expect("tempdir");
        let data = tmp.path().join("data");
        let c = Cluster {
            data,
            nodes,
            _tmp: tmp,
            subnet: Subnet::claim(),
        };
        let mut cmd = c.cmd();
        cmd.args([
            "up",
            "--nodes",
            &nodes.to_string(),
            "--net",
            &c.subnet.net(),
            "--device-size",
            device_size,
            "--no-demo",
        ]);
        cmd.args(extra);
        ok(&mut cmd);
        c
    }

    /// The subnet the nodes are on (node `i` is its host `i`); also for
    /// addresses of nodes the test starts by hand.
    pub fn subnet(&self) -> &Subnet {
        &self.subnet
    }

    /// `shoal` with `--data` of this cluster.
    pub fn cmd(&self) -> Command {
        let mut c = Command::new(shoal_bin());
        // SHOAL_API would override SHOAL_DATA and point at another cluster.
        c.env("SHOAL_DATA", &self.data).env_remove("SHOAL_API");
        c
    }

    pub fn shoal(&self, args: &[&str]) -> String {
        ok(self.cmd().args(args))
    }

    /// Runs shoal expecting failure; returns stderr.
    pub fn shoal_fails(&self, args: &[&str]) -> String {
        let out = run(self.cmd().args(args));
        assert!(
            !out.status.success(),
            "expected failure of shoal {args:?}, got success: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    }

    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut a = args.to_vec();
        a.push("--json");
        serde_json::from_str(&self.shoal(&a)).expect("json output")
    }

    /// `json` for conditions polled while nodes come and go: a failed
    /// command is an `Err`, not a panic.
    pub fn try_json(&self, args: &[&str]) -> Result<serde_json::Value, String> {
        let out = run(self.cmd().args(args).arg("--json"));
        if !out.status.success() {
            return Err(format!(
                "shoal {args:?}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("shoal {args:?}: {e}"))
    }

    pub fn uri(&self, node: u32, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.nbd_addr(node))
    }

    /// `host:port` of the node's NBD server.
    pub fn nbd_addr(&self, node: u32) -> String {
        self.subnet.nbd_addr(node)
    }

    /// `host:port` of the node's REST API.
    pub fn api_addr(&self, node: u32) -> String {
        self.subnet.api_addr(node)
    }

    /// `host:port` of the node's peer (replication) service.
    pub fn peer_addr(&self, node: u32) -> String {
        self.subnet.peer_addr(node)
    }

    /// The node's REST API (and `/metrics`).
    pub fn api(&self, node: u32) -> String {
        format!("http://{}", self.api_addr(node))
    }

    /// Sum of one metric (all its label sets) over the given nodes.
    pub fn metric(&self, nodes: &[u32], name: &str) -> u64 {
        self.try_metric(nodes, name)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The cluster's admin API token (`shoal up` leaves it in the data
    /// folder, where the `shoal` command finds it).
    pub fn token(&self) -> String {
        let p = self.data.join("admin.token");
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .trim()
            .to_string()
    }

    /// `curl` of the REST `path` (e.g. "/metrics") on `node` with the
    /// admin token, and `extra` arguments (e.g. `["-X", "POST"]`): the
    /// body, or `Err` when the node does not answer or refuses.
    pub fn try_rest(&self, node: u32, path: &str, extra: &[&str]) -> Result<String, String> {
        let url = format!("{}{path}", self.api(node));
        let auth = format!("Authorization: Bearer {}", self.token());
        let out = run(Command::new("curl")
            .args(["-sS", "--fail-with-body", "-H", &auth])
            .args(extra)
            .arg(&url));
        let body = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(body)
        } else {
            Err(format!(
                "curl {extra:?} {url}: {}: {body}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// `try_rest` that panics on failure.
    pub fn rest(&self, node: u32, path: &str, extra: &[&str]) -> String {
        self.try_rest(node, path, extra)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `metric` for conditions polled while nodes come and go: a node that
    /// does not answer is an `Err`.
    pub fn try_metric(&self, nodes: &[u32], name: &str) -> Result<u64, String> {
        let mut total = 0;
        for &n in nodes {
            for line in self.try_rest(n, "/metrics", &[])?.lines() {
                if line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} ")) {
                    let v = line.rsplit(' ').next().unwrap_or("0");
                    total += v.parse::<u64>().unwrap_or(0);
                }
            }
        }
        Ok(total)
    }

    /// Waits until the sum of `name` over `nodes` is at least `at_least`;
    /// returns it.
    pub fn wait_metric(&self, nodes: &[u32], name: &str, at_least: u64, timeout: Duration) -> u64 {
        wait_for(
            &format!("{name} of nodes {nodes:?} at {at_least}"),
            timeout,
            || {
                let v = self.try_metric(nodes, name)?;
                if v >= at_least {
                    Ok(v)
                } else {
                    Err(format!("{v}"))
                }
            },
        )
    }

    /// The volume's URI on the node's Unix socket (clients on its host).
    pub fn unix_uri(&self, node: u32, volume: &str) -> String {
        format!(
            "nbd+unix:///{volume}?socket={}",
            self.node_dir(node).join("nbd.sock").display()
        )
    }

    pub fn node_dir(&self, node: u32) -> PathBuf {
        self.data.join(format!("node{node}"))
    }

    pub fn pid(&self, node: u32) -> i32 {
        std::fs::read_to_string(self.node_dir(node).join("node.pid"))
            .expect("pid file")
            .trim()
            .parse()
            .expect("pid")
    }

    pub fn signal(&self, node: u32, sig: &str) {
        sh(&format!("kill -{sig} {}", self.pid(node)));
    }

    /// `shoal up` again: starts nodes that are not running.
    pub fn up(&self) {
        self.shoal(&["up", "--no-demo"]);
    }

    pub fn create_volume(&self, name: &str, size: &str, policy: &str) {
        self.shoal(&["volume", "create", name, "--size", size, "--policy", policy]);
    }

    /// The volume's health as `shoal volume show` prints it: "healthy",
    /// "reduced-availability" or "inaccessible". (The JSON has the serde
    /// variant names, "Healthy", "ReducedAvailability", ...)
    pub fn health(&self, volume: &str) -> String {
        health_of(&self.json(&["volume", "show", volume]))
    }

    /// Waits until the volume is healthy (all components active).
    pub fn wait_healthy(&self, volume: &str, timeout: Duration) {
        wait_for(&format!("volume {volume} healthy"), timeout, || {
            let v = self.try_json(&["volume", "show", volume])?;
            match health_of(&v) {
                h if h == "healthy" => Ok(()),
                h => Err(format!("{h}; components: {}", components_of(&v))),
            }
        })
    }

    /// Waits until the data component of `volume` on `node` is in `state`
    /// ("Active", "Absent", "Degraded", "Resyncing").
    pub fn wait_component_state(&self, volume: &str, node: u32, state: &str, timeout: Duration) {
        wait_for(
            &format!("the copy of {volume} on node {node} {state}"),
            timeout,
            || {
                let v = self.try_json(&["volume", "show", volume])?;
                let found = v["volume"]["components"].as_array().and_then(|cs| {
                    cs.iter()
                        .find(|x| x["role"] == "Data" && x["node"] == node)
                        .and_then(|x| x["state"].as_str())
                });
                match found {
                    Some(s) if s == state => Ok(()),
                    _ => Err(components_of(&v)),
                }
            },
        );
    }

    /// Waits until node `id` is in `state` ("up"/"down") in the directory.
    pub fn wait_node(&self, id: u32, state: &str, timeout: Duration) {
        wait_for(&format!("node {id} {state}"), timeout, || {
            let st = self.try_json(&["status"])?;
            let now = st["nodes"]
                .as_array()
                .and_then(|ns| ns.iter().find(|n| n["id"] == id))
                .and_then(|n| n["state"].as_str())
                .unwrap_or("not listed")
                .to_string();
            if now.eq_ignore_ascii_case(state) {
                Ok(())
            } else {
                Err(now)
            }
        })
    }

    /// Waits, at most `timeout`, until node `node`'s log holds every one
    /// of `needles`.
    pub fn wait_log(&self, node: u32, needles: &[&str], timeout: Duration) {
        let log = self.node_dir(node).join("node.log");
        wait_for(&format!("node {node} logging {needles:?}"), timeout, || {
            let text = std::fs::read_to_string(&log).map_err(|e| e.to_string())?;
            match needles.iter().find(|n| !text.contains(**n)) {
                None => Ok(()),
                Some(n) => Err(format!("no {n:?} yet")),
            }
        });
    }

    /// Waits, at most `timeout`, until some node's log holds every one of
    /// `needles`; that node.
    pub fn wait_log_any(&self, needles: &[&str], timeout: Duration) -> u32 {
        wait_for(&format!("a node logging {needles:?}"), timeout, || {
            (1..=self.nodes)
                .find(|&n| {
                    let log = self.node_dir(n).join("node.log");
                    let text = std::fs::read_to_string(log).unwrap_or_default();
                    needles.iter().all(|x| text.contains(x))
                })
                .ok_or_else(|| "none yet".to_string())
        })
    }

    pub fn verify_copies(&self, volume: &str) {
        self.shoal(&["volume", "verify", volume]);
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for i in 1..=self.nodes {
            let p = self.node_dir(i).join("node.log");
            let t = std::fs::read_to_string(&p).unwrap_or_default();
            // The directory's retries to a dead peer repeat every half
            // second and would fill the tail: the node's own lines only.
            let own = t.lines().filter(|l| !l.contains("openraft::"));
            let tail: Vec<&str> = own.rev().take(40).collect();
            s.push_str(&format!("--- node {i} ---\n"));
            for l in tail.into_iter().rev() {
                s.push_str(l);
                s.push('\n');
            }
        }
        s
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Wake stopped nodes so that they can exit, then stop everything.
        let mut pids = Vec::new();
        for i in 1..=self.nodes {
            let p = self.node_dir(i).join("node.pid");
            if let Ok(pid) = std::fs::read_to_string(&p) {
                let _ = Command::new("kill").args(["-CONT", pid.trim()]).output();
                pids.extend(pid.trim().parse::<i32>());
            }
        }
        let _ = self.cmd().arg("down").output();
        // `shoal down` does not wait for the nodes it kills -9: the subnet
        // is free for the next test once they are gone.
        let _ = poll_for(Duration::from_secs(10), || {
            match pids.iter().find(|&&p| pid_alive(p)) {
                Some(p) => Err(format!("process {p} still runs")),
                None => Ok(()),
            }
        });
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

/// `health` of a `volume show` JSON.
fn health_of(v: &serde_json::Value) -> String {
    let raw = v["health"].as_str().unwrap_or_default();
    let mut s = String::new();
    for (i, ch) in raw.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            s.push('-');
        }
        s.push(ch.to_ascii_lowercase());
    }
    s
}

/// The components of a `volume show` JSON, one "role@node state" each.
pub fn components_of(v: &serde_json::Value) -> String {
    let cs = v["volume"]["components"].as_array();
    cs.map(|cs| {
        cs.iter()
            .map(|x| {
                format!(
                    "{}@{} {}",
                    x["role"].as_str().unwrap_or("?"),
                    x["node"],
                    x["state"].as_str().unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    })
    .unwrap_or_else(|| format!("no components in {v}"))
}

pub fn tmpfile(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}
