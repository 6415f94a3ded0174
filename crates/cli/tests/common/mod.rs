//! Test harness: a local cluster of real `shoal` processes, started with
//! `shoal up` on its own loopback subnet (127.0.N.x) and data folder, and
//! stopped (kill -9 of leftovers) when dropped.
#![allow(dead_code)]

pub mod fio;
pub mod load;
pub mod ledger;

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
pub fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut cond: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(20);
    loop {
        match cond() {
            Ok(v) => return v,
            Err(last) if Instant::now() > deadline => {
                panic!("{what}: not after {timeout:?} (last: {last})")
            }
            Err(_) => {}
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(250));
    }
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

pub struct Cluster {
    pub data: PathBuf,
    pub net: String,
    pub nodes: u32,
    _tmp: tempfile::TempDir,
}

impl Cluster {
    /// Starts `nodes` nodes on 127.0.`subnet`.x. Each test uses its own
    /// subnet so tests can run in parallel.
    pub fn start(nodes: u32, subnet: u8) -> Cluster {
        Self::start_with(nodes, subnet, &[])
    }

    pub fn start_with(nodes: u32, subnet: u8, extra: &[&str]) -> Cluster {
        Self::start_sized(nodes, subnet, "4G", extra)
    }

    /// Like `start_with`, with devices of `device_size` (`shoal up
    /// --device-size`).
    pub fn start_sized(nodes: u32, subnet: u8, device_size: &str, extra: &[&str]) -> Cluster {
        let tmp = tempfile::Builder::new()
            .prefix("shoal-test")
            .tempdir()
            .expect("tempdir");
        let data = tmp.path().join("data");
        let net = format!("127.0.{subnet}");
        let c = Cluster {
            data,
            net,
            nodes,
            _tmp: tmp,
        };
        let mut cmd = c.cmd();
        cmd.args([
            "up",
            "--nodes",
            &nodes.to_string(),
            "--net",
            &c.net,
            "--device-size",
            device_size,
            "--no-demo",
        ]);
        cmd.args(extra);
        ok(&mut cmd);
        c
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

    pub fn uri(&self, node: u32, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.nbd_addr(node))
    }

    /// `host:port` of the node's NBD server.
    pub fn nbd_addr(&self, node: u32) -> String {
        format!("{}.{node}:10809", self.net)
    }

    /// The node's REST API (and `/metrics`).
    pub fn api(&self, node: u32) -> String {
        format!("http://{}.{node}:9400", self.net)
    }

    /// Sum of one metric (all its label sets) over the given nodes.
    pub fn metric(&self, nodes: &[u32], name: &str) -> u64 {
        let mut total = 0;
        for &n in nodes {
            let text = sh(&format!("curl -sf {}/metrics", self.api(n)));
            for line in text.lines() {
                if line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} ")) {
                    let v = line.rsplit(' ').next().unwrap_or("0");
                    total += v.parse::<u64>().unwrap_or(0);
                }
            }
        }
        total
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
        let raw = self.json(&["volume", "show", volume])["health"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut s = String::new();
        for (i, ch) in raw.chars().enumerate() {
            if ch.is_ascii_uppercase() && i > 0 {
                s.push('-');
            }
            s.push(ch.to_ascii_lowercase());
        }
        s
    }

    /// Waits until the volume is healthy (all components active).
    pub fn wait_healthy(&self, volume: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let h = self.health(volume);
            if h == "healthy" {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "volume {volume} not healthy after {timeout:?}: {h}\n{}",
                    self.shoal(&["volume", "show", volume])
                );
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    /// Waits until node `id` is in `state` ("up"/"down") in the directory.
    pub fn wait_node(&self, id: u32, state: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(out) = std::panic::catch_unwind(|| self.json(&["status"])) {
                let ok = out["nodes"].as_array().is_some_and(|ns| {
                    ns.iter().any(|n| {
                        n["id"] == id
                            && n["state"].as_str().map(|s| s.eq_ignore_ascii_case(state))
                                == Some(true)
                    })
                });
                if ok {
                    return;
                }
            }
            if Instant::now() > deadline {
                panic!("node {id} not {state} after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    }

    pub fn verify_copies(&self, volume: &str) {
        self.shoal(&["volume", "verify", volume]);
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for i in 1..=self.nodes {
            let p = self.node_dir(i).join("node.log");
            let t = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = t.lines().rev().take(30).collect();
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
        for i in 1..=self.nodes {
            let p = self.node_dir(i).join("node.pid");
            if let Ok(pid) = std::fs::read_to_string(&p) {
                let _ = Command::new("kill").args(["-CONT", pid.trim()]).output();
            }
        }
        let _ = self.cmd().arg("down").output();
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

pub fn tmpfile(dir: &Path, name: &str) -> PathBuf {
    dir.join(name)
}
