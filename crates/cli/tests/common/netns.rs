//! Hosts with networks of their own, for the partition tests (issue 22).
//!
//! [`Hosts`] makes N network namespaces, each a host with one veth on a
//! Linux bridge of its own in the root namespace and an address on a
//! private /24 (host i is `NET.i`); the root namespace has no address on
//! it. Code runs on a host through [`Hosts::run_in`] / [`Hosts::spawn_in`]
//! (a thread that enters the namespace first, so every socket it makes is
//! the host's, and stays so when handed to another thread), commands
//! through [`Hosts::cmd`] (`ip netns exec`).
//!
//! Nemeses ([`Nemesis`], started by [`Hosts::start`], ended by
//! [`Active::heal`]) drop packets where they arrive (iptables `INPUT` of
//! the receiving host), so a sender meets silence as on a cut cable, never
//! an error: isolate a host, split the hosts in two groups, cut one
//! direction, flap a host's link, delay and lose packets (NFQUEUE and
//! [`Delayer`]: this kernel has no netem and no tc drop action). Each
//! nemesis and each heal is checked with UDP probes between every pair of
//! hosts, each direction on its own ([`Hosts::reach`]).
//!
//! [`NetCluster`] runs one `shoal node` per host, founded and joined as
//! `shoal up` does it (`crates/cli/src/local.rs`), and the command line
//! inside a host's namespace.
//!
//! Names carry the test process's pid and a counter; namespaces and
//! bridges left by a process that is gone are removed, their processes
//! killed, when the next `Hosts` is made.

use super::{pid_alive, poll_for, shoal_bin};
use std::collections::{BTreeSet, VecDeque};
use std::fs::File;
use std::net::UdpSocket;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Ports of every node (the `shoal node` defaults).
pub const NBD_PORT: u16 = 10809;
pub const API_PORT: u16 = 9400;
pub const PEER_PORT: u16 = 9500;

/// How long UDP probes run to tell which pairs of hosts reach each other.
const PROBE_WINDOW: Duration = Duration::from_millis(1500);
/// Namespaces of this harness are `shoal-PID-SEQ-HOST`.
const NS_PREFIX: &str = "shoal-";
/// Data folders of [`NetCluster`]s are `TMP/shoal-netns-PID-XXXXXX`.
const DIR_PREFIX: &str = "shoal-netns-";

static NEXT_SEQ: AtomicU32 = AtomicU32::new(0);

/// Runs a command to its end: its standard output, or an error with
/// everything it said.
pub fn exec(cmd: &mut Command) -> Result<String, String> {
    let out = cmd
        .output()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{cmd:?}: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn must(cmd: &mut Command) -> String {
    exec(cmd).unwrap_or_else(|e| panic!("{e}"))
}

fn ip(args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(args);
    c
}

/// Runs `cmd` (output piped) for at most `limit`: its output, or an
/// error once it ran that long (it is then killed).
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Result<Output, String> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(r) => r.map_err(|e| format!("waiting for {cmd:?}: {e}")),
        Err(_) => {
            // SAFETY: a plain signal to the child we started; its waiter
            // thread reaps it (at worst it just did: pids are not reused
            // within an instant).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = rx.recv();
            Err(format!("{cmd:?}: no end after {limit:?}"))
        }
    }
}

/// Names and addresses of one set of hosts; cheap to clone into the
/// threads of nemeses.
#[derive(Clone, Debug)]
struct Net {
    pid: u32,
    seq: u32,
    hosts: u32,
    /// The first three octets of the hosts' addresses.
    prefix: String,
}

impl Net {
    fn ns(&self, h: u32) -> String {
        format!("{NS_PREFIX}{}-{}-{h}", self.pid, self.seq)
    }

    /// Link names are at most 15 bytes: `sh<pid hex>r<seq hex>` (the
    /// letters between the numbers are not hex digits).
    fn bridge(&self) -> String {
        format!("sh{:x}r{:x}", self.pid, self.seq)
    }

    fn veth(&self, h: u32) -> String {
        format!("sh{:x}v{:x}h{h}", self.pid, self.seq)
    }

    fn addr(&self, h: u32) -> String {
        format!("{}.{h}", self.prefix)
    }

    fn all(&self) -> Vec<u32> {
        (1..=self.hosts).collect()
    }

    fn iptables(&self, h: u32, args: &[&str]) {
        must(
            Command::new("ip")
                .args(["netns", "exec", &self.ns(h), "iptables", "-w"])
                .args(args),
        );
    }

    /// Host `h` drops what it receives from `from`.
    fn drop_from(&self, h: u32, from: &[u32]) {
        if from.is_empty() {
            return;
        }
        let srcs: Vec<String> = from.iter().map(|&f| self.addr(f)).collect();
        let srcs = srcs.join(",");
        self.iptables(h, &["-A", "INPUT", "-i", "eth0", "-s", &srcs, "-j", "DROP"]);
    }

    /// Host `h` hears nobody, and nobody hears it.
    fn isolate(&self, h: u32) {
        self.iptables(h, &["-A", "INPUT", "-i", "eth0", "-j", "DROP"]);
        for k in self.all().into_iter().filter(|&k| k != h) {
            self.drop_from(k, &[h]);
        }
    }

    /// Removes every rule of every host.
    fn clear(&self) {
        for h in self.all() {
            self.iptables(h, &["-F", "INPUT"]);
        }
    }

    /// The ordered pairs (from, to) of hosts between which UDP datagrams
    /// got through, sent every 100 ms for [`PROBE_WINDOW`].
    fn reach(&self) -> BTreeSet<(u32, u32)> {
        let socks: Vec<UdpSocket> = self
            .all()
            .into_iter()
            .map(|h| {
                let addr = self.addr(h);
                let s = spawn_in_ns(self.ns(h), move || UdpSocket::bind((addr.as_str(), 0)))
                    .join()
                    .expect("probe thread");
                let s = s.expect("binding a probe socket");
                s.set_nonblocking(true).expect("non-blocking probe socket");
                s
            })
            .collect();
        let ports: Vec<_> = socks
            .iter()
            .map(|s| s.local_addr().expect("addr"))
            .collect();
        let mut seen = BTreeSet::new();
        let end = Instant::now() + PROBE_WINDOW;
        while Instant::now() < end {
            for (i, s) in socks.iter().enumerate() {
                for (k, to) in ports.iter().enumerate().filter(|(k, _)| *k != i) {
                    let _ = s.send_to(&[i as u8 + 1, k as u8 + 1], to);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
            for s in &socks {
                let mut b = [0u8; 2];
                while let Ok((2, _)) = s.recv_from(&mut b) {
                    seen.insert((u32::from(b[0]), u32::from(b[1])));
                }
            }
        }
        seen
    }

    /// Checks with `reach` that exactly the pairs `passes` allows
    /// reach each other.
    fn check_reach(&self, what: &str, passes: impl Fn(u32, u32) -> bool) -> Result<(), String> {
        let seen = self.reach();
        let mut wrong = Vec::new();
        for f in self.all() {
            for t in self.all().into_iter().filter(|&t| t != f) {
                match (passes(f, t), seen.contains(&(f, t))) {
                    (true, false) => wrong.push(format!("{f}->{t} lost")),
                    (false, true) => wrong.push(format!("{f}->{t} got through")),
                    _ => {}
                }
            }
        }
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(format!("{what}: {}", wrong.join(", ")))
        }
    }
}

/// Enters the network namespace `ns` on the calling thread.
fn enter(ns: &str) {
    let path = format!("/var/run/netns/{ns}");
    let f = File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    // SAFETY: setns on a descriptor this function owns; a network
    // namespace may be changed by one thread of a multithreaded process
    // (only this thread moves).
    let r = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(r, 0, "setns {path}: {}", std::io::Error::last_os_error());
}

fn spawn_in_ns<T: Send + 'static>(
    ns: String,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    std::thread::Builder::new()
        .name(ns.clone())
        .spawn(move || {
            enter(&ns);
            f()
        })
        .expect("spawning a thread")
}

/// N hosts, each a network namespace with one veth (`eth0`) on a bridge of
/// their own. Dropping it kills every process left in the namespaces and
/// removes them and the bridge.
pub struct Hosts {
    net: Net,
}

impl Hosts {
    /// Makes hosts 1..=n (at most 9), after removing what killed test runs
    /// left behind.
    pub fn new(n: u32) -> Hosts {
        assert!((1..=9).contains(&n), "1 to 9 hosts, not {n}");
        remove_leftovers();
        let pid = std::process::id();
        let seq = NEXT_SEQ.fetch_add(1, Ordering::SeqCst) % 256;
        let net = Net {
            pid,
            seq,
            hosts: n,
            prefix: format!("10.{}.{seq}", 100 + pid % 100),
        };
        // Made first, so that a failure part way is cleaned up too.
        let hosts = Hosts { net };
        hosts.build();
        hosts
    }

    fn build(&self) {
        let (net, br) = (&self.net, self.net.bridge());
        must(&mut ip(&["link", "add", &br, "type", "bridge"]));
        must(&mut ip(&["link", "set", &br, "up"]));
        for h in net.all() {
            let (ns, veth, addr) = (net.ns(h), net.veth(h), format!("{}/24", net.addr(h)));
            must(&mut ip(&["netns", "add", &ns]));
            must(&mut ip(&[
                "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
            ]));
            must(&mut ip(&["link", "set", &veth, "master", &br, "up"]));
            must(&mut ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"]));
            must(&mut ip(&["-n", &ns, "link", "set", "eth0", "up"]));
            must(&mut ip(&["-n", &ns, "link", "set", "lo", "up"]));
        }
    }

    pub fn count(&self) -> u32 {
        self.net.hosts
    }

    /// The host's network namespace.
    pub fn ns(&self, host: u32) -> String {
        self.net.ns(host)
    }

    /// The host's address.
    pub fn addr(&self, host: u32) -> String {
        self.net.addr(host)
    }

    /// `program` run on `host` (`ip netns exec`).
    pub fn cmd(&self, host: u32, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.net.ns(host), program]);
        c
    }

    /// Runs `f` on a thread on `host` and returns what it returns (a panic
    /// in it goes on in the caller).
    pub fn run_in<T: Send + 'static>(
        &self,
        host: u32,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> T {
        match self.spawn_in(host, f).join() {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    }

    /// Runs `f` on a new thread on `host`.
    pub fn spawn_in<T: Send + 'static>(
        &self,
        host: u32,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> JoinHandle<T> {
        spawn_in_ns(self.net.ns(host), f)
    }

    /// The ordered pairs (from, to) of hosts between which UDP datagrams
    /// got through, sent every 100 ms for [`PROBE_WINDOW`].
    pub fn reach(&self) -> BTreeSet<(u32, u32)> {
        self.net.reach()
    }

    /// Checks with [`Hosts::reach`] that exactly the pairs `passes` allows
    /// reach each other.
    pub fn check_reach(&self, what: &str, passes: impl Fn(u32, u32) -> bool) -> Result<(), String> {
        self.net.check_reach(what, passes)
    }

    /// Starts a nemesis and checks that it cuts what it should (for a
    /// flapping link: its first cut). Panics if it does not: the harness
    /// itself is broken then.
    pub fn start(&self, nemesis: Nemesis) -> Active {
        let mut a = Active {
            net: self.net.clone(),
            nemesis: nemesis.clone(),
            flapper: None,
            delayers: Vec::new(),
            healed: false,
        };
        a.apply();
        let what = format!("{nemesis:?} in force");
        if let Err(e) = self.check_reach(&what, |f, t| nemesis.passes(f, t)) {
            panic!("{e}");
        }
        a
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for h in self.net.all() {
            remove_ns(&self.net.ns(h));
        }
        let _ = exec(&mut ip(&["link", "del", &self.net.bridge()]));
    }
}

/// Kills every process in namespace `ns`, then removes it.
fn remove_ns(ns: &str) {
    let pids = exec(&mut ip(&["netns", "pids", ns])).unwrap_or_default();
    for pid in pids
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
    {
        // SAFETY: a plain signal to a process of this harness's namespace.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    let _ = exec(&mut ip(&["netns", "del", ns]));
}

/// Removes the namespaces, bridges and data folders of test processes
/// that are gone (their node processes killed).
fn remove_leftovers() {
    let gone = |pid: Option<i32>| matches!(pid, Some(p) if !pid_alive(p));
    let list = exec(&mut ip(&["netns", "list"])).unwrap_or_default();
    for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
        if gone(pid_after(name, NS_PREFIX, '-', 10)) {
            remove_ns(name);
        }
    }
    let links = exec(&mut ip(&["-o", "link", "show", "type", "bridge"])).unwrap_or_default();
    for name in links.lines().filter_map(|l| l.split(": ").nth(1)) {
        // `sh<pid hex>r<seq hex>`: both numbers in hex.
        let seq = name.split_once('r').map(|(_, q)| q).unwrap_or_default();
        if u32::from_str_radix(seq, 16).is_ok() && gone(pid_after(name, "sh", 'r', 16)) {
            let _ = exec(&mut ip(&["link", "del", name]));
        }
    }
    for e in std::fs::read_dir(std::env::temp_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if gone(pid_after(
            &e.file_name().to_string_lossy(),
            DIR_PREFIX,
            '-',
            10,
        )) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The pid in a name made by this harness: `PREFIX<pid>SEP<more>`, the
/// pid in `radix`.
fn pid_after(name: &str, prefix: &str, sep: char, radix: u32) -> Option<i32> {
    let (pid, more) = name.strip_prefix(prefix)?.split_once(sep)?;
    if more.is_empty() {
        return None;
    }
    i32::from_str_radix(pid, radix).ok()
}

/// A network fault between hosts.
#[derive(Clone, Debug)]
pub enum Nemesis {
    /// The host hears no other host and no other host hears it.
    Isolate(u32),
    /// Hosts of one group and of the other no longer reach each other;
    /// hosts in neither group reach both.
    Split(Vec<u32>, Vec<u32>),
    /// What hosts `from` send to hosts `to` is lost; what `to` send to
    /// `from` arrives (a TCP connection between them fails either way: its
    /// answers are lost).
    OneWay { from: Vec<u32>, to: Vec<u32> },
    /// The host is isolated for `period`, connected for `period`, and so
    /// on until healed.
    Flap { host: u32, period: Duration },
    /// Every packet the hosts receive waits `delay`, and `loss_pct`
    /// percent of them are lost.
    Degrade {
        hosts: Vec<u32>,
        delay: Duration,
        loss_pct: u32,
    },
}

impl Nemesis {
    /// Whether a datagram from `from` reaches `to` while the nemesis is in
    /// force (a flapping link: while it is down; lossy links: at all).
    pub fn passes(&self, from: u32, to: u32) -> bool {
        match self {
            Nemesis::Isolate(h) | Nemesis::Flap { host: h, .. } => from != *h && to != *h,
            Nemesis::Split(a, b) => {
                let across = |x: &[u32], y: &[u32]| x.contains(&from) && y.contains(&to);
                !across(a, b) && !across(b, a)
            }
            Nemesis::OneWay { from: f, to: t } => !(f.contains(&from) && t.contains(&to)),
            Nemesis::Degrade { .. } => true,
        }
    }
}

/// A nemesis in force. [`Active::heal`] ends it and checks that every
/// host reaches every other again; dropping it ends it unchecked.
pub struct Active {
    net: Net,
    nemesis: Nemesis,
    flapper: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    delayers: Vec<Delayer>,
    healed: bool,
}

impl Active {
    fn apply(&mut self) {
        let net = self.net.clone();
        match self.nemesis.clone() {
            Nemesis::Isolate(h) => net.isolate(h),
            Nemesis::Split(a, b) => {
                a.iter().for_each(|&h| net.drop_from(h, &b));
                b.iter().for_each(|&h| net.drop_from(h, &a));
            }
            Nemesis::OneWay { from, to } => to.iter().for_each(|&h| net.drop_from(h, &from)),
            Nemesis::Flap { host, period } => {
                assert!(
                    period >= PROBE_WINDOW * 2,
                    "flap period {period:?} too short"
                );
                net.isolate(host);
                self.flapper = Some(flap(net, host, period));
            }
            Nemesis::Degrade {
                hosts,
                delay,
                loss_pct,
            } => {
                for h in hosts {
                    self.delayers.push(degrade(&net, h, delay, loss_pct));
                }
            }
        }
    }

    pub fn nemesis(&self) -> &Nemesis {
        &self.nemesis
    }

    fn end(&mut self) {
        if let Some((stop, t)) = self.flapper.take() {
            stop.store(true, Ordering::SeqCst);
            t.thread().unpark();
            let _ = t.join();
        }
        // Rules first: packets queued with nobody listening pass anyway
        // (--queue-bypass), but not the other way round.
        self.net.clear();
        self.delayers.clear();
        self.healed = true;
    }

    /// Ends the nemesis and checks that every host reaches every other.
    /// Panics if one does not: the harness itself is broken then.
    pub fn heal(mut self) {
        self.end();
        if let Err(e) = self.net.check_reach("after the heal", |_, _| true) {
            panic!("{e}");
        }
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        if !self.healed {
            self.end();
        }
    }
}

/// A thread that connects `host` for `period`, isolates it for `period`,
/// and so on (it starts isolated), until told to stop; it leaves the host
/// isolated or not, for the heal to clear.
fn flap(net: Net, host: u32, period: Duration) -> (Arc<AtomicBool>, JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let t = std::thread::spawn(move || {
        let mut cut = true;
        loop {
            let until = Instant::now() + period;
            while !s.load(Ordering::SeqCst) && Instant::now() < until {
                std::thread::park_timeout(until.saturating_duration_since(Instant::now()));
            }
            if s.load(Ordering::SeqCst) {
                return;
            }
            if cut {
                net.clear();
            } else {
                net.isolate(host);
            }
            cut = !cut;
        }
    });
    (stop, t)
}

/// Makes what `host` receives lossy (iptables `statistic`) and late (every
/// other packet goes to NFQUEUE 0, where a [`Delayer`] holds it).
fn degrade(net: &Net, host: u32, delay: Duration, loss_pct: u32) -> Delayer {
    let d = Delayer::start(net.ns(host), delay);
    if loss_pct > 0 {
        let p = format!("{:.4}", f64::from(loss_pct) / 100.0);
        net.iptables(
            host,
            &[
                "-A",
                "INPUT",
                "-i",
                "eth0",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                &p,
                "-j",
                "DROP",
            ],
        );
    }
    net.iptables(
        host,
        &[
            "-A",
            "INPUT",
            "-i",
            "eth0",
            "-j",
            "NFQUEUE",
            "--queue-num",
            "0",
            "--queue-bypass",
        ],
    );
    d
}

/// Holds every packet of NFQUEUE 0 of a namespace for a fixed delay, then
/// lets it go, in arrival order (what netem's `delay` does). A thread in
/// the namespace speaks nfnetlink_queue; dropping the value stops it and
/// lets the packets it holds go.
pub struct Delayer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Delayer {
    /// Starts holding packets of NFQUEUE 0 of namespace `ns` for `delay`;
    /// returns once the queue is bound.
    pub fn start(ns: String, delay: Duration) -> Delayer {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = spawn_in_ns(ns, move || match nfq::Queue::bind(0) {
            Ok(q) => {
                let _ = tx.send(Ok(()));
                hold(&q, delay, &s);
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        });
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("binding NFQUEUE 0: {e}"),
            Err(_) => panic!("the delayer thread ended before binding its queue"),
        }
        Delayer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Delayer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The delayer's loop: each packet is let go `delay` after it was read.
fn hold(q: &nfq::Queue, delay: Duration, stop: &AtomicBool) {
    let mut held: VecDeque<(u32, Instant)> = VecDeque::new();
    let tick = Duration::from_millis(20);
    while !stop.load(Ordering::SeqCst) {
        let wait = held.front().map_or(tick, |(_, due)| {
            due.saturating_duration_since(Instant::now()).min(tick)
        });
        let ids = q.receive(wait);
        let now = Instant::now();
        held.extend(ids.into_iter().map(|id| (id, now + delay)));
        let now = Instant::now();
        let mut last = None;
        while let Some(&(id, due)) = held.front() {
            if due > now {
                break;
            }
            last = Some(id);
            held.pop_front();
        }
        if let Some(id) = last {
            q.accept_up_to(id);
        }
    }
    if let Some(&(id, _)) = held.back() {
        q.accept_up_to(id);
    }
}

/// The few messages of nfnetlink_queue a delayer needs
/// (`linux/netfilter/nfnetlink_queue.h`), over a raw netlink socket.
mod nfq {
    use super::*;

    const NETLINK_NETFILTER: i32 = 12;
    const NFNL_SUBSYS_QUEUE: u16 = 3;
    const MSG_PACKET: u16 = 0;
    const MSG_CONFIG: u16 = 2;
    const MSG_VERDICT_BATCH: u16 = 3;
    const CFG_CMD: u16 = 1;
    const CFG_PARAMS: u16 = 2;
    const CFG_QUEUE_MAXLEN: u16 = 3;
    const CMD_BIND: u8 = 1;
    const COPY_META: u8 = 1;
    const PACKET_HDR: u16 = 1;
    const VERDICT_HDR: u16 = 2;
    const NF_ACCEPT: u32 = 1;
    const NLMSG_ERROR: u16 = 2;
    const NLM_F_REQUEST: u16 = 1;
    const NLM_F_ACK: u16 = 4;
    const NLMSG_HDRLEN: usize = 16;

    fn align(n: usize) -> usize {
        (n + 3) & !3
    }

    /// One netlink message of the queue subsystem about queue `queue`.
    fn message(kind: u16, flags: u16, queue: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDRLEN];
        // struct nfgenmsg: family (unspecified), version 0, queue (BE).
        m.extend_from_slice(&[0, 0]);
        m.extend_from_slice(&queue.to_be_bytes());
        for (ty, data) in attrs {
            let len = 4 + data.len();
            m.extend_from_slice(&(len as u16).to_ne_bytes());
            m.extend_from_slice(&ty.to_ne_bytes());
            m.extend_from_slice(data);
            m.resize(align(m.len()), 0);
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
        m[6..8].copy_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        m
    }

    fn io_err(what: &str) -> String {
        format!("{what}: {}", std::io::Error::last_os_error())
    }

    /// A bound queue.
    pub struct Queue {
        fd: OwnedFd,
        num: u16,
    }

    impl Queue {
        /// Binds queue `num` of the calling thread's namespace; packets are
        /// reported without their contents.
        pub fn bind(num: u16) -> Result<Queue, String> {
            // SAFETY: a plain socket call; the descriptor is owned at once.
            let fd = unsafe {
                libc::socket(
                    libc::AF_NETLINK,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    NETLINK_NETFILTER,
                )
            };
            if fd < 0 {
                return Err(io_err("netlink socket"));
            }
            // SAFETY: `fd` is a new descriptor nobody else owns.
            let q = Queue {
                fd: unsafe { OwnedFd::from_raw_fd(fd) },
                num,
            };
            q.setup()?;
            Ok(q)
        }

        fn setup(&self) -> Result<(), String> {
            let big: libc::c_int = 16 << 20;
            // SAFETY: setsockopt with a pointer to a live int of the size
            // given.
            unsafe {
                libc::setsockopt(
                    self.fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVBUFFORCE,
                    (&big as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            let cmd = [CMD_BIND, 0, 0, 0];
            self.request(&[(CFG_CMD, &cmd)])?;
            let mut params = 0u32.to_be_bytes().to_vec();
            params.push(COPY_META);
            self.request(&[(CFG_PARAMS, &params)])?;
            self.request(&[(CFG_QUEUE_MAXLEN, &65536u32.to_be_bytes())])
        }

        fn send(&self, m: &[u8]) -> Result<(), String> {
            // SAFETY: sends `m.len()` bytes of a live buffer; the kernel
            // is the default destination of an unconnected netlink socket.
            let r = unsafe { libc::send(self.fd.as_raw_fd(), m.as_ptr().cast(), m.len(), 0) };
            if r < 0 {
                return Err(io_err("netlink send"));
            }
            Ok(())
        }

        /// Sends a configuration message and waits for its acknowledgement.
        fn request(&self, attrs: &[(u16, &[u8])]) -> Result<(), String> {
            self.send(&message(MSG_CONFIG, NLM_F_ACK, self.num, attrs))?;
            let mut buf = vec![0u8; 8192];
            // SAFETY: receives into a live buffer of its length.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < (NLMSG_HDRLEN + 4) as isize {
                return Err(io_err("netlink acknowledgement"));
            }
            let kind = u16::from_ne_bytes([buf[4], buf[5]]);
            let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
            if kind != NLMSG_ERROR || err != 0 {
                return Err(format!(
                    "nfnetlink_queue refused the configuration: {}",
                    std::io::Error::from_raw_os_error(-err)
                ));
            }
            Ok(())
        }

        /// Ids of the packets queued since the last call, waiting up to
        /// `wait` for the first.
        pub fn receive(&self, wait: Duration) -> Vec<u32> {
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: polls one live pollfd.
            unsafe { libc::poll(&mut pfd, 1, wait.as_millis() as libc::c_int) };
            let mut ids = Vec::new();
            let mut buf = vec![0u8; 1 << 16];
            loop {
                // SAFETY: receives into a live buffer of its length.
                let n = unsafe {
                    libc::recv(
                        self.fd.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                // Nothing more, or ENOBUFS (packets lost: loss, as on a
                // congested link).
                if n <= 0 {
                    return ids;
                }
                packet_ids(&buf[..n as usize], &mut ids);
            }
        }

        /// Lets every held packet up to `id` go.
        pub fn accept_up_to(&self, id: u32) {
            let mut v = NF_ACCEPT.to_be_bytes().to_vec();
            v.extend_from_slice(&id.to_be_bytes());
            // A lost verdict leaves the packets held: the next verdict,
            // or the queue's end, lets them go.
            let _ = self.send(&message(
                MSG_VERDICT_BATCH,
                0,
                self.num,
                &[(VERDICT_HDR, &v)],
            ));
        }
    }

    /// Appends the ids of the packet messages in `buf`.
    fn packet_ids(buf: &[u8], ids: &mut Vec<u32>) {
        let mut at = 0;
        while at + NLMSG_HDRLEN <= buf.len() {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
            if len < NLMSG_HDRLEN || at + len > buf.len() {
                return;
            }
            if kind == (NFNL_SUBSYS_QUEUE << 8) | MSG_PACKET {
                if let Some(id) = packet_id(&buf[at + NLMSG_HDRLEN + 4..at + len]) {
                    ids.push(id);
                }
            }
            at += align(len);
        }
    }

    /// The id in the packet header attribute of one packet message.
    fn packet_id(mut attrs: &[u8]) -> Option<u32> {
        while attrs.len() >= 4 {
            let len = u16::from_ne_bytes([attrs[0], attrs[1]]) as usize;
            let ty = u16::from_ne_bytes([attrs[2], attrs[3]]) & 0x7fff;
            if len < 4 || len > attrs.len() {
                return None;
            }
            if ty == PACKET_HDR && len >= 8 {
                return Some(u32::from_be_bytes(attrs[4..8].try_into().ok()?));
            }
            attrs = &attrs[align(len).min(attrs.len())..];
        }
        None
    }
}

/// The volume's owner and where its components are, as `volume show
/// --json` tells.
#[derive(Debug, Clone)]
pub struct Layout {
    pub owner: Option<u32>,
    pub generation: u64,
    pub data: Vec<u32>,
    pub witnesses: Vec<u32>,
    /// "role@node state" of each component.
    pub components: String,
}

/// The nodes' I/O wait bound (`--io-wait`): a client request that cannot
/// be served fails after this. Shorter than the default 30 s so that the
/// tests that wait for it stay short.
pub const IO_WAIT: Duration = Duration::from_secs(10);

/// A cluster of `shoal node` processes, one per host of its [`Hosts`]:
/// node i on host i, listening on the host's address. The command line
/// runs inside a host's namespace ([`NetCluster::cli`]) with the admin
/// token. Dropping it kills the nodes (then the hosts go).
pub struct NetCluster {
    pub hosts: Hosts,
    nodes: Vec<Child>,
    dir: tempfile::TempDir,
    token: String,
}

/// Wait for the cluster to form, for a node to answer.
const FORM: Duration = Duration::from_secs(90);
/// Longest a command line call may take before it counts as hung.
const CLI_LIMIT: Duration = Duration::from_secs(60);
/// Longest a `qemu-io` run may take (writing up to a few hundred MiB).
const QEMU_IO_LIMIT: Duration = Duration::from_secs(120);

impl NetCluster {
    /// Hosts 1..=n, node 1 founds the cluster, the others join with a
    /// join token, as `shoal up` does; returns once every node answers,
    /// sees a leader, and the directory has every node up with its device.
    pub fn start(n: u32) -> NetCluster {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()
            .expect("tempdir");
        let mut c = NetCluster {
            hosts: Hosts::new(n),
            nodes: Vec::new(),
            dir,
            token: String::new(),
        };
        c.launch(1, None);
        c.token = c.wait_founded();
        let join = c
            .shoal(1, 1, &["token", "create", "--join", "--ttl", "1h"])
            .unwrap_or_else(|e| panic!("a join token: {e}"));
        for h in 2..=n {
            c.launch(h, Some(join.trim()));
        }
        c.wait_formed();
        c
    }

    pub fn node_dir(&self, node: u32) -> PathBuf {
        self.dir.path().join(format!("node{node}"))
    }

    /// Starts node `h` on host `h`; a joining node gets the join token
    /// through its environment, as from `shoal up`.
    fn launch(&mut self, h: u32, join_token: Option<&str>) {
        let dir = self.node_dir(h);
        std::fs::create_dir_all(&dir).expect("node folder");
        let log = File::create(dir.join("node.log")).expect("node log");
        let addr = self.hosts.addr(h);
        let at = |port: u16| format!("{addr}:{port}");
        let mut cmd = self.hosts.cmd(h, shoal_bin());
        cmd.arg("node").args(["--id", &h.to_string()]);
        cmd.arg("--data").arg(&dir);
        cmd.arg("--device")
            .arg(format!("{}:4G", dir.join("dev0.img").display()));
        cmd.args(["--api", &at(API_PORT), "--peer", &at(PEER_PORT)]);
        cmd.args(["--nbd", &at(NBD_PORT), "--nbd-tls", "allow"]);
        cmd.args(["--workers", "1", "--fault-domain", &format!("host{h}")]);
        cmd.args(["--io-wait", &format!("{}s", IO_WAIT.as_secs())]);
        match join_token {
            Some(t) => {
                cmd.args(["--join", &format!("{}:{API_PORT}", self.hosts.addr(1))]);
                cmd.env("SHOAL_JOIN_TOKEN", t)
            }
            None => cmd.env_remove("SHOAL_JOIN_TOKEN"),
        };
        cmd.stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting node {h}: {e}"));
        self.nodes.push(child);
    }

    /// Panics with its log if a node process has ended.
    fn check_running(&mut self) {
        for (i, c) in self.nodes.iter_mut().enumerate() {
            if let Ok(Some(st)) = c.try_wait() {
                let node = i as u32 + 1;
                panic!("node {node} ended ({st}):\n{}", self.log_tail(node, 30));
            }
        }
    }

    /// Waits for node 1's admin token to open its API; returns it.
    fn wait_founded(&mut self) -> String {
        let path = self.node_dir(1).join("admin.token");
        let deadline = Instant::now() + FORM;
        loop {
            self.check_running();
            if let Ok(t) = std::fs::read_to_string(&path) {
                self.token = t.trim().to_string();
                if self.json(1, 1, &["status"]).is_ok() {
                    return self.token.clone();
                }
            }
            assert!(
                Instant::now() < deadline,
                "node 1 did not found a cluster within {FORM:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_formed(&mut self) {
        let deadline = Instant::now() + FORM;
        loop {
            self.check_running();
            match self.formed() {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("cluster not formed: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(300)),
            }
        }
    }

    fn formed(&self) -> Result<(), String> {
        let n = self.hosts.count();
        for h in 1..=n {
            let s = self.json(h, h, &["status"])?;
            if s["leader"].is_null() {
                return Err(format!("node {h} sees no leader"));
            }
        }
        let s = self.json(1, 1, &["status"])?;
        let up = s["nodes"].as_array().map_or(0, |ns| {
            ns.iter()
                .filter(|x| {
                    x["state"]
                        .as_str()
                        .is_some_and(|v| v.eq_ignore_ascii_case("up"))
                })
                .count()
        });
        let devices = s["devices"].as_array().map_or(0, |d| d.len());
        if up == n as usize && devices >= n as usize {
            Ok(())
        } else {
            Err(format!("{up} of {n} nodes up, {devices} devices"))
        }
    }

    /// `shoal` on `host`, talking to node `node`'s API with the admin
    /// token.
    pub fn cli(&self, host: u32, node: u32) -> Command {
        let mut c = self.hosts.cmd(host, shoal_bin());
        c.env("SHOAL_API", self.api(node))
            .env("SHOAL_TOKEN", &self.token)
            .env("SHOAL_DATA", self.dir.path().join("no-local-cluster"));
        c
    }

    /// `shoal ARGS` on `host` through node `node`, at most `limit`: its
    /// output, or an error with what it said.
    pub fn shoal_within(
        &self,
        host: u32,
        node: u32,
        args: &[&str],
        limit: Duration,
    ) -> Result<String, String> {
        let out = run_bounded(self.cli(host, node).args(args), limit)?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "shoal {args:?} through node {node}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// `shoal_within` with [`CLI_LIMIT`].
    pub fn shoal(&self, host: u32, node: u32, args: &[&str]) -> Result<String, String> {
        self.shoal_within(host, node, args, CLI_LIMIT)
    }

    /// `shoal ARGS --json` on `host` through node `node`.
    pub fn json(&self, host: u32, node: u32, args: &[&str]) -> Result<serde_json::Value, String> {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.shoal(host, node, &a)?;
        serde_json::from_str(&out).map_err(|e| format!("shoal {args:?}: {e}: {out}"))
    }

    /// The node's REST API.
    pub fn api(&self, node: u32) -> String {
        format!("http://{}:{API_PORT}", self.hosts.addr(node))
    }

    /// `host:port` of the node's NBD server.
    pub fn nbd_addr(&self, node: u32) -> String {
        format!("{}:{NBD_PORT}", self.hosts.addr(node))
    }

    /// The volume's layout as node `node` sees it, asked from its host.
    pub fn layout(&self, volume: &str, node: u32) -> Result<Layout, String> {
        let v = self.json(node, node, &["volume", "show", volume])?;
        let cs = v["volume"]["components"]
            .as_array()
            .ok_or_else(|| format!("no components in {v}"))?;
        let on = |role: &str| -> Vec<u32> {
            cs.iter()
                .filter(|x| x["role"] == role)
                .filter_map(|x| x["node"].as_u64().map(|n| n as u32))
                .collect()
        };
        Ok(Layout {
            owner: v["volume"]["owner"].as_u64().map(|o| o as u32),
            generation: v["volume"]["generation"].as_u64().unwrap_or(0),
            data: on("Data"),
            witnesses: on("Witness"),
            components: super::components_of(&v),
        })
    }

    /// The volume's health ("Healthy", "ReducedAvailability", ...) as
    /// node `node` reports it.
    pub fn health(&self, volume: &str, node: u32) -> Result<String, String> {
        let v = self.json(node, node, &["volume", "show", volume])?;
        Ok(v["health"].as_str().unwrap_or("?").to_string())
    }

    /// Waits, at most `limit`, until node `node` reports the volume
    /// healthy; how long that took, or the last state seen.
    pub fn wait_healthy(
        &self,
        volume: &str,
        node: u32,
        limit: Duration,
    ) -> Result<Duration, String> {
        let t = Instant::now();
        poll_for(limit, || match self.health(volume, node)? {
            h if h == "Healthy" => Ok(t.elapsed()),
            h => {
                let l = self.layout(volume, node)?;
                Err(format!("{h}: {}", l.components))
            }
        })
        .map_err(|e| format!("volume {volume} not healthy after {limit:?}: {e}"))
    }

    /// `shoal volume verify` through node `node`: the copies are identical.
    pub fn verify(&self, volume: &str, node: u32) -> Result<(), String> {
        self.shoal(node, node, &["volume", "verify", volume])
            .map(|_| ())
    }

    /// The sum of metric `name` (every label set) in node `node`'s
    /// `/metrics`, asked from its host.
    pub fn metric(&self, node: u32, name: &str) -> Result<u64, String> {
        let url = format!("{}/metrics", self.api(node));
        let auth = format!("Authorization: Bearer {}", self.token);
        let mut curl = self.hosts.cmd(node, "curl");
        curl.args(["-sS", "--fail-with-body", "-H", &auth, &url]);
        let body = exec(&mut curl)?;
        let mut total = 0;
        for line in body.lines() {
            if line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} ")) {
                let v = line.rsplit(' ').next().unwrap_or("");
                total += v.parse::<u64>().map_err(|e| format!("{line}: {e}"))?;
            }
        }
        Ok(total)
    }

    /// `qemu-io` on `host` against `volume` through node `node`'s NBD
    /// server, running `commands` (each a `-c` argument); its output.
    pub fn qemu_io(
        &self,
        host: u32,
        node: u32,
        volume: &str,
        commands: &[&str],
    ) -> Result<String, String> {
        let mut q = self.hosts.cmd(host, "qemu-io");
        q.args([
            "-f",
            "raw",
            &format!("nbd://{}/{volume}", self.nbd_addr(node)),
        ]);
        for c in commands {
            q.args(["-c", c]);
        }
        let out = run_bounded(&mut q, QEMU_IO_LIMIT)?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // qemu-io may exit 0 after a command failed: its words tell.
        if !out.status.success() || text.contains("failed") {
            return Err(format!("qemu-io {commands:?}: {}: {text}", out.status));
        }
        Ok(text)
    }

    /// The last `lines` lines of node `node`'s log.
    pub fn log_tail(&self, node: u32, lines: usize) -> String {
        let t = std::fs::read_to_string(self.node_dir(node).join("node.log")).unwrap_or_default();
        let tail: Vec<&str> = t.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for NetCluster {
    fn drop(&mut self) {
        for c in &mut self.nodes {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            for n in 1..=self.hosts.count() {
                eprintln!("--- node {n} ---\n{}", self.log_tail(n, 40));
            }
        }
    }
}
