//! Partition tests (issue 22, "No split brain"): four real `shoal node`
//! processes, each on a host with a network of its own
//! (`common::netns`), under nemeses, with clients on both sides at once.
//!
//! - the scenario: a host cut off from the cluster never serves a
//!   read older than a write acknowledged elsewhere, and a write there
//!   fails within a bound instead of hanging;
//! - one register test per nemesis: each block has one writer (a client of
//!   one side), every client reads every block, and every read must
//!   return the last write acknowledged before it started or a later one
//!   sent; after the heal no acknowledged write is lost, the copies are
//!   identical, and the volume is healthy with nobody acting;
//! - the directory under a partition: the minority's API answers at once
//!   that it has no quorum, the majority goes on, the minority catches up;
//! - the harness itself: every nemesis cuts what it says and the heal
//!   restores every path.
//!
//! Every schedule runs in `.ci/run` (about two minutes in all).

mod common;

use common::ledger::block_image;
use common::netns::{self, Hosts, Layout, Nemesis, NetCluster};
use common::wait_for;
use shoal_nbd::codec::{Command as Nbd, Request, SimpleReply, SIMPLE_REPLY_LEN};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const BLOCK: usize = 4096;
/// The volume of every test.
const VOL: &str = "v";
/// Longest a healed cluster may take to report the volume healthy.
const HEAL: Duration = Duration::from_secs(90);
/// Longest the majority may take to acknowledge a write after the cut:
/// the target is 5 s (measured and printed); this catches a regression
/// without failing on a loaded 2-core machine.
const FAILOVER_LIMIT: Duration = Duration::from_secs(10);
/// How long reads on the cut-off host are watched after the other side's
/// write was acknowledged.
const STALE_WATCH: Duration = Duration::from_secs(10);
/// The bound on a request on the cut-off side (issue 22: it must fail,
/// not hang): the nodes' I/O wait bound and a little for the answer to
/// travel; the client waits longer to tell a slow failure from a hang.
const CUT_WRITE_BOUND: Duration = Duration::from_secs(netns::IO_WAIT.as_secs() + 2);
const CUT_WRITE_PATIENCE: Duration = Duration::from_secs(netns::IO_WAIT.as_secs() + 15);
/// The minority's API must refuse a write-type call this fast.
const NO_QUORUM_BOUND: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------- client

/// What became of one NBD request.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    /// Acknowledged (a read: with its data).
    Done(Vec<u8>),
    /// Answered with this NBD error.
    Refused(u32),
    /// The connection closed or failed first.
    Gone(String),
    /// No answer within the patience given (or the client was stopped).
    Silent,
}

/// A blocking NBD client with one request at a time and a bounded wait
/// for each answer. Its socket belongs to the network namespace of the
/// thread that connected it.
struct BlockClient {
    s: TcpStream,
    handle: u64,
}

impl BlockClient {
    /// Opens `export` on the NBD server at `addr`; call it on a thread of
    /// the client's host.
    fn connect(addr: &str, export: &str) -> Result<BlockClient, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        let (s, _) = rt
            .block_on(shoal_bench::nbd::connect(addr, export))
            .map_err(|e| format!("{e:#}"))?;
        let s = s.into_std().map_err(|e| format!("std stream: {e}"))?;
        s.set_nonblocking(false)
            .map_err(|e| format!("blocking: {e}"))?;
        Ok(BlockClient { s, handle: 0 })
    }

    fn write(&mut self, block: u64, data: &[u8], patience: Duration, stop: &AtomicBool) -> Answer {
        self.request(Nbd::Write, block, data.len() as u32, data, patience, stop)
    }

    fn read(&mut self, block: u64, blocks: u32, patience: Duration, stop: &AtomicBool) -> Answer {
        self.request(Nbd::Read, block, blocks * BLOCK as u32, &[], patience, stop)
    }

    fn request(
        &mut self,
        command: Nbd,
        block: u64,
        len: u32,
        payload: &[u8],
        patience: Duration,
        stop: &AtomicBool,
    ) -> Answer {
        self.handle += 1;
        let req = Request {
            flags: 0,
            command,
            handle: self.handle,
            offset: block * BLOCK as u64,
            len,
        };
        let mut frame = req.encode().to_vec();
        frame.extend_from_slice(payload);
        if let Err(e) = self.s.write_all(&frame) {
            return Answer::Gone(format!("sending: {e}"));
        }
        let deadline = Instant::now() + patience;
        let mut h = [0u8; SIMPLE_REPLY_LEN];
        if let Err(a) = self.fill(&mut h, deadline, stop) {
            return a;
        }
        let r = match SimpleReply::decode(&h) {
            Ok(r) if r.handle == self.handle => r,
            Ok(r) => return Answer::Gone(format!("a reply to handle {}", r.handle)),
            Err(e) => return Answer::Gone(format!("an undecodable reply: {e}")),
        };
        if r.error != 0 {
            return Answer::Refused(r.error);
        }
        let mut data = vec![
            0u8;
            if command == Nbd::Read {
                len as usize
            } else {
                0
            }
        ];
        match self.fill(&mut data, deadline, stop) {
            Ok(()) => Answer::Done(data),
            Err(a) => a,
        }
    }

    /// Reads `buf` full, giving up at `deadline` or when `stop` is set.
    fn fill(&mut self, buf: &mut [u8], deadline: Instant, stop: &AtomicBool) -> Result<(), Answer> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if stop.load(SeqCst) || left.is_zero() {
                return Err(Answer::Silent);
            }
            let wait = left.clamp(Duration::from_millis(1), Duration::from_millis(200));
            self.s
                .set_read_timeout(Some(wait))
                .map_err(|e| Answer::Gone(e.to_string()))?;
            match self.s.read(&mut buf[got..]) {
                Ok(0) => return Err(Answer::Gone("closed by the server".into())),
                Ok(n) => got += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Answer::Gone(e.to_string())),
            }
        }
        Ok(())
    }
}

/// Connects to node `node`'s NBD server from `host`.
fn connect_from(c: &NetCluster, host: u32, node: u32) -> Result<BlockClient, String> {
    let addr = c.nbd_addr(node);
    c.hosts
        .run_in(host, move || BlockClient::connect(&addr, VOL))
}

fn never() -> &'static AtomicBool {
    static NEVER: AtomicBool = AtomicBool::new(false);
    &NEVER
}

// ------------------------------------------------------------- the cluster

/// Four hosts with a node each, a `raid1 ftt=1` volume owned by node 1
/// (its first I/O, block 0 = `first`, went through node 1, from host 1);
/// returns the cluster, node 1's client and the layout.
fn cluster_owned_by_node1(first: &[u8]) -> (NetCluster, BlockClient, Layout) {
    let c = NetCluster::start(4);
    let create = [
        "volume",
        "create",
        VOL,
        "--size",
        "64M",
        "--policy",
        "raid1 ftt=1",
    ];
    c.shoal(2, 2, &create).expect("creating the volume");
    let mut client = connect_from(&c, 1, 1).expect("a client on host 1");
    let a = client.write(0, first, Duration::from_secs(30), never());
    assert_eq!(
        a,
        Answer::Done(Vec::new()),
        "the first write through node 1"
    );
    let layout = c.layout(VOL, 2).expect("the volume's layout");
    println!(
        "layout: owner {:?}, generation {}, data on {:?}, witnesses on {:?} ({})",
        layout.owner, layout.generation, layout.data, layout.witnesses, layout.components
    );
    assert_eq!(
        layout.owner,
        Some(1),
        "node 1 owns the volume after the first I/O through it"
    );
    (c, client, layout)
}

/// The checks after a heal: the volume healthy with nobody acting, then
/// its copies identical; each failure as a line.
fn after_heal(c: &NetCluster, failures: &mut Vec<String>) {
    match c.wait_healthy(VOL, 2, HEAL) {
        Ok(t) => println!("healthy {:.1} s after the heal", t.as_secs_f64()),
        Err(e) => failures.push(e),
    }
    if let Err(e) = c.verify(VOL, 2) {
        failures.push(format!("copies after the heal: {e}"));
    }
}

fn assert_no_failures(what: &str, failures: &[String]) {
    assert!(
        failures.is_empty(),
        "{what}: {} failure(s):\n  {}",
        failures.len(),
        failures.join("\n  ")
    );
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

// ---------------------------------------------------- the scenario

const OLD: u8 = b'O';
const NEW: u8 = b'N';

fn filled(b: u8) -> Vec<u8> {
    vec![b; BLOCK]
}

/// One read of block 0 on the cut-off host.
struct Seen {
    start: Instant,
    end: Instant,
    /// The first byte of the block when it is all one byte, else what
    /// came back.
    got: Result<u8, String>,
}

/// A client on host 1 reading block 0 through node 1 over and over
/// (reconnecting when a connection goes), until stopped.
struct Watch {
    stop: Arc<AtomicBool>,
    /// Reads that returned OLD so far.
    olds: Arc<AtomicUsize>,
    thread: JoinHandle<Vec<Seen>>,
}

impl Watch {
    fn start(c: &NetCluster) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let olds = Arc::new(AtomicUsize::new(0));
        let (s, o) = (stop.clone(), olds.clone());
        let addr = c.nbd_addr(1);
        let thread = c.hosts.spawn_in(1, move || watch_loop(&addr, &s, &o));
        Watch { stop, olds, thread }
    }

    fn olds(&self) -> usize {
        self.olds.load(SeqCst)
    }

    fn stop(self) -> Vec<Seen> {
        self.stop.store(true, SeqCst);
        self.thread.join().expect("the watching client")
    }
}

fn watch_loop(addr: &str, stop: &AtomicBool, olds: &AtomicUsize) -> Vec<Seen> {
    let mut seen = Vec::new();
    let mut conn = None;
    while !stop.load(SeqCst) {
        let Some(bc) = conn.as_mut() else {
            conn = BlockClient::connect(addr, VOL).ok();
            if conn.is_none() {
                std::thread::sleep(Duration::from_millis(100));
            }
            continue;
        };
        let start = Instant::now();
        let got = match bc.read(0, 1, Duration::from_secs(3600), stop) {
            Answer::Done(d) if d.iter().all(|&x| x == d[0]) => {
                if d[0] == OLD {
                    olds.fetch_add(1, SeqCst);
                }
                Ok(d[0])
            }
            Answer::Done(_) => Err("mixed contents".to_string()),
            Answer::Refused(e) => Err(format!("error {e}")),
            Answer::Silent => {
                // Stopped while it waited: a read that hung counts too.
                let waited = secs(start.elapsed());
                seen.push(Seen {
                    start,
                    end: Instant::now(),
                    got: Err(format!("no answer after {waited}, still waiting")),
                });
                break;
            }
            Answer::Gone(e) => {
                conn = None;
                Err(e)
            }
        };
        seen.push(Seen {
            start,
            end: Instant::now(),
            got,
        });
    }
    seen
}

/// Writes `data` to block 0 through node `node` from `host`, retrying
/// (reconnecting) until acknowledged or `limit`: when it was
/// acknowledged, and the attempts that failed.
fn write_until_acked(
    c: &NetCluster,
    host: u32,
    node: u32,
    data: Vec<u8>,
    limit: Duration,
) -> (Option<Instant>, Vec<String>) {
    let addr = c.nbd_addr(node);
    c.hosts.run_in(host, move || {
        let deadline = Instant::now() + limit;
        let mut tries = Vec::new();
        while Instant::now() < deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            let answer =
                BlockClient::connect(&addr, VOL).map(|mut bc| bc.write(0, &data, left, never()));
            match answer {
                Ok(Answer::Done(_)) => return (Some(Instant::now()), tries),
                Ok(a) => tries.push(format!("{a:?}")),
                Err(e) => tries.push(e),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        (None, tries)
    })
}

/// What the reads on the cut-off host showed after `acked`.
struct Stale {
    after_ack: usize,
    stale: usize,
    last_stale: Option<Instant>,
    errors: usize,
    longest: Duration,
}

fn stale_reads(seen: &[Seen], acked: Instant) -> Stale {
    let after: Vec<&Seen> = seen.iter().filter(|s| s.start >= acked).collect();
    let stale: Vec<&&Seen> = after.iter().filter(|s| s.got == Ok(OLD)).collect();
    Stale {
        after_ack: after.len(),
        stale: stale.len(),
        last_stale: stale.last().map(|s| s.end),
        errors: after.iter().filter(|s| s.got.is_err()).count(),
        longest: seen
            .iter()
            .map(|s| s.end - s.start)
            .max()
            .unwrap_or_default(),
    }
}

/// Issue 22's scenario, exactly: four hosts, a `raid1 ftt=1` volume owned
/// by node 1; a client on host 1 wrote OLD through node 1; host 1 is cut
/// off; a client on host 2 writes NEW through node 2 until acknowledged
/// (the failover time) while a client on host 1 reads through node 1.
/// No read that started after NEW's acknowledgement may return OLD (a
/// read already under way then is concurrent with the write and may),
/// and a write on host 1 must fail (an error or the connection closing)
/// within the nodes' I/O wait bound, as must reads there once the lease
/// is gone. After the heal the volume is healthy with nobody acting,
/// its copies identical, and NEW is what every node serves.
#[test]
fn isolated_owner_never_serves_stale_reads() {
    let (c, mut cut_client, _) = cluster_owned_by_node1(&filled(OLD));
    let watch = Watch::start(&c);
    wait_for(
        "reads of OLD through node 1 before the cut",
        Duration::from_secs(10),
        || match watch.olds() {
            n if n >= 5 => Ok(()),
            n => Err(format!("{n} reads of OLD")),
        },
    );
    let cut = Instant::now();
    let nemesis = c.hosts.start(Nemesis::Isolate(1));
    let cut_write = std::thread::spawn(move || {
        let t = Instant::now();
        let a = cut_client.write(1, &filled(b'X'), CUT_WRITE_PATIENCE, never());
        (a, t.elapsed())
    });
    let (acked, tries) = write_until_acked(&c, 2, 2, filled(NEW), FAILOVER_LIMIT);
    if let Some(a) = acked {
        // The watch window: how long stale reads go on, not a condition.
        std::thread::sleep(STALE_WATCH.saturating_sub(a.elapsed()));
    }
    let seen = watch.stop();
    let (cut_answer, cut_took) = cut_write.join().expect("the cut-off writer");
    let mut failures = Vec::new();
    scenario_findings(cut, acked, &tries, &seen, &mut failures);
    cut_write_findings(&cut_answer, cut_took, &mut failures);
    nemesis.heal();
    after_heal(&c, &mut failures);
    for node in [1, 3] {
        match connect_from(&c, node, node).map(|mut bc| bc.read(0, 1, HEAL, never())) {
            Ok(Answer::Done(d)) if d == filled(NEW) => {}
            other => failures.push(format!(
                "block 0 through node {node} after the heal: {other:?}"
            )),
        }
    }
    assert_no_failures("isolated owner", &failures);
}

/// The failover time and the stale reads, printed and judged.
fn scenario_findings(
    cut: Instant,
    acked: Option<Instant>,
    tries: &[String],
    seen: &[Seen],
    failures: &mut Vec<String>,
) {
    let before = seen
        .iter()
        .filter(|s| s.end < cut && s.got == Ok(OLD))
        .count();
    println!("reads of OLD through node 1 before the cut: {before}");
    if before == 0 {
        failures.push("no read of OLD through node 1 before the cut".into());
    }
    let Some(acked) = acked else {
        let last = tries.last().cloned().unwrap_or_default();
        failures.push(format!(
            "NEW not acknowledged through node 2 within {} of the cut \
             ({} tries, last: {last})",
            secs(FAILOVER_LIMIT),
            tries.len()
        ));
        return;
    };
    println!(
        "failover: NEW acknowledged through node 2 {} after the cut ({} failed tries before)",
        secs(acked - cut),
        tries.len()
    );
    if let Some(last) = seen.last() {
        let at = last.start.saturating_duration_since(cut);
        println!(
            "the last read through node 1 started {} after the cut: {:?}",
            secs(at),
            last.got.as_ref().map(|b| char::from(*b))
        );
    }
    let s = stale_reads(seen, acked);
    println!(
        "reads through node 1 started after NEW's ack: {} ({} OLD, {} errors); longest read {}",
        s.after_ack,
        s.stale,
        s.errors,
        secs(s.longest)
    );
    if s.longest > CUT_WRITE_BOUND {
        failures.push(format!(
            "a read through the cut-off node 1 took {} (bound {})",
            secs(s.longest),
            secs(CUT_WRITE_BOUND)
        ));
    }
    if let Some(last) = s.last_stale {
        failures.push(format!(
            "{} reads through the cut-off node 1 returned OLD after NEW was \
             acknowledged, the last {} after the cut ({} after the ack)",
            s.stale,
            secs(last - cut),
            secs(last - acked)
        ));
    }
}

fn cut_write_findings(answer: &Answer, took: Duration, failures: &mut Vec<String>) {
    println!(
        "write through the cut-off node 1: {answer:?} after {}",
        secs(took)
    );
    match answer {
        Answer::Refused(_) | Answer::Gone(_) if took < CUT_WRITE_BOUND => {}
        Answer::Done(_) => failures.push(format!(
            "a write through the cut-off node 1 was acknowledged ({} after \
             the cut): a minority acknowledged a write",
            secs(took)
        )),
        Answer::Silent => failures.push(format!(
            "a write through the cut-off node 1 hung: no answer after {} \
             (bound {})",
            secs(took),
            secs(CUT_WRITE_BOUND)
        )),
        a => failures.push(format!(
            "a write through the cut-off node 1 failed only after {} \
             (bound {}): {a:?}",
            secs(took),
            secs(CUT_WRITE_BOUND)
        )),
    }
}

// ------------------------------------------------------------- registers

/// Blocks each client writes (the blocks of all clients are read by all).
const PER_CLIENT: u64 = 256;

/// Every block as a register with one writer: versions 1, 2, ... named
/// in its contents (`ledger::block_image`), the last acknowledged and the
/// last sent of each, and the reads that broke the promise.
struct Registers {
    epoch: Instant,
    state: Mutex<RegState>,
}

struct RegState {
    acked: Vec<u32>,
    sent: Vec<u32>,
    bad: Vec<String>,
}

impl Registers {
    fn new(blocks: u64) -> Arc<Registers> {
        Arc::new(Registers {
            epoch: Instant::now(),
            state: Mutex::new(RegState {
                acked: vec![0; blocks as usize],
                sent: vec![0; blocks as usize],
                bad: Vec::new(),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, RegState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn blocks(&self) -> u64 {
        self.lock().acked.len() as u64
    }

    /// Seconds since the registers were made, for messages.
    fn at(&self) -> String {
        secs(self.epoch.elapsed())
    }

    /// Judges what a read of `block` returned: a version between the last
    /// one acknowledged before the read started (`floor`) and the last one
    /// sent, with exactly that version's contents.
    fn judge(&self, who: &str, block: u64, floor: u32, data: &[u8]) -> Option<String> {
        let v = version_of(data);
        let ceil = self.lock().sent[block as usize];
        let why = if data != block_image(block, v).as_slice() {
            "torn or misplaced contents"
        } else if v < floor {
            "older than a write acknowledged before the read"
        } else if v > ceil {
            "never sent"
        } else {
            return None;
        };
        Some(format!(
            "{who} at {}: block {block} version {v} ({why}; acknowledged {floor}, sent {ceil})",
            self.at()
        ))
    }

    /// Reads every block through node `node` from its host and judges it
    /// against what was acknowledged and sent; the versions found.
    fn check_through(&self, c: &NetCluster, node: u32) -> Result<Vec<u32>, String> {
        let mut bc = connect_from(c, node, node)?;
        let (blocks, chunk) = (self.blocks(), 64u64);
        let mut found = Vec::new();
        let mut bad = Vec::new();
        for first in (0..blocks).step_by(chunk as usize) {
            let n = chunk.min(blocks - first);
            let data = match bc.read(first, n as u32, HEAL, never()) {
                Answer::Done(d) => d,
                a => {
                    return Err(format!(
                        "reading blocks {first}.. through node {node}: {a:?}"
                    ))
                }
            };
            for (i, d) in data.chunks(BLOCK).enumerate() {
                let b = first + i as u64;
                let floor = self.lock().acked[b as usize];
                found.push(version_of(d));
                bad.extend(self.judge(&format!("the check through node {node}"), b, floor, d));
            }
        }
        if bad.is_empty() {
            Ok(found)
        } else {
            Err(format!(
                "{} blocks break the ledger: {:?}",
                bad.len(),
                &bad[..bad.len().min(10)]
            ))
        }
    }
}

/// The version a block's contents name (0: all zeros, never written).
fn version_of(data: &[u8]) -> u32 {
    if data.iter().all(|&x| x == 0) {
        return 0;
    }
    u32::from_le_bytes(data[16..20].try_into().expect("4 bytes"))
}

/// What one register client went through.
#[derive(Debug, Default, Clone)]
struct Stats {
    acks: u64,
    write_errors: u64,
    reads: u64,
    read_errors: u64,
    /// Connections that closed or failed, and connects that failed.
    lost: u64,
    longest_wait: Duration,
    last_ack: Option<Instant>,
}

/// A client on one host writing its own blocks and reading everyone's
/// through one node: a writer and a reader, each with a connection of its
/// own and one request at a time (so a write that hangs does not stop
/// the reads), reconnecting when a connection goes, until stopped.
struct RegClient {
    name: String,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<Stats>>,
    threads: Vec<JoinHandle<()>>,
}

impl RegClient {
    fn start(
        c: &NetCluster,
        regs: &Arc<Registers>,
        host: u32,
        node: u32,
        writes: Range<u64>,
    ) -> RegClient {
        let name = format!("client on host {host} through node {node}");
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(Stats::default()));
        let me = Arc::new(Me {
            name: name.clone(),
            addr: c.nbd_addr(node),
            regs: regs.clone(),
            writes,
            stop: stop.clone(),
            stats: stats.clone(),
        });
        let threads = [true, false]
            .into_iter()
            .map(|writer| {
                let me = me.clone();
                c.hosts.spawn_in(host, move || me.run(writer))
            })
            .collect();
        RegClient {
            name,
            stop,
            stats,
            threads,
        }
    }

    fn stats(&self) -> Stats {
        self.stats.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn stop(self) {
        self.stop.store(true, SeqCst);
        for t in self.threads {
            t.join().expect("a register client");
        }
    }
}

/// What the threads of a register client share.
struct Me {
    name: String,
    addr: String,
    regs: Arc<Registers>,
    writes: Range<u64>,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<Stats>>,
}

/// A register client waits this long for one answer (it is stopped
/// sooner): how long the cluster makes it wait is what is measured.
const REG_PATIENCE: Duration = Duration::from_secs(3600);

impl Me {
    fn stats(&self) -> MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The writer's or the reader's loop.
    fn run(&self, writer: bool) {
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15 ^ self.writes.start ^ u64::from(writer);
        let mut conn = None;
        while !self.stop.load(SeqCst) {
            let Some(bc) = conn.as_mut() else {
                conn = BlockClient::connect(&self.addr, VOL).ok();
                if conn.is_none() {
                    self.stats().lost += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                continue;
            };
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = Instant::now();
            let alive = if writer {
                self.write(bc, x)
            } else {
                self.read(bc, x)
            };
            let mut st = self.stats();
            st.longest_wait = st.longest_wait.max(t.elapsed());
            if !alive {
                st.lost += 1;
                conn = None;
            }
        }
    }

    /// Writes the next version of one of its blocks; false if the
    /// connection is no longer usable.
    fn write(&self, bc: &mut BlockClient, x: u64) -> bool {
        let b = self.writes.start + (x >> 8) % (self.writes.end - self.writes.start);
        let v = {
            let mut st = self.regs.lock();
            st.sent[b as usize] += 1;
            st.sent[b as usize]
        };
        match bc.write(b, &block_image(b, v), REG_PATIENCE, &self.stop) {
            Answer::Done(_) => {
                let mut st = self.regs.lock();
                assert!(
                    v > st.acked[b as usize],
                    "versions acknowledged out of order"
                );
                st.acked[b as usize] = v;
                drop(st);
                let mut s = self.stats();
                s.acks += 1;
                s.last_ack = Some(Instant::now());
                true
            }
            Answer::Refused(_) => {
                self.stats().write_errors += 1;
                true
            }
            Answer::Gone(_) | Answer::Silent => false,
        }
    }

    /// Reads any block and judges it; false if the connection is no
    /// longer usable.
    fn read(&self, bc: &mut BlockClient, x: u64) -> bool {
        let b = (x >> 8) % self.regs.blocks();
        let floor = self.regs.lock().acked[b as usize];
        match bc.read(b, 1, REG_PATIENCE, &self.stop) {
            Answer::Done(d) => {
                if let Some(bad) = self.regs.judge(&self.name, b, floor, &d) {
                    self.regs.lock().bad.push(bad);
                }
                self.stats().reads += 1;
                true
            }
            Answer::Refused(_) => {
                self.stats().read_errors += 1;
                true
            }
            Answer::Gone(_) | Answer::Silent => false,
        }
    }
}

// ------------------------------------------------------------- schedules

/// A register test: a nemesis, the two clients' hosts (each through its
/// own host's node), and how long the nemesis holds.
struct Schedule {
    name: &'static str,
    nemesis: Nemesis,
    clients: [u32; 2],
    hold: Duration,
}

/// Runs a schedule: clients on both sides write and read at once before,
/// during and after the nemesis; after the heal both make progress again,
/// no read broke the promise, every acknowledged write is there through
/// two nodes, and the volume is healthy with identical copies.
fn registers_under(s: Schedule) {
    let (c, _, _) = cluster_owned_by_node1(&block_image(0, 1));
    let regs = Registers::new(PER_CLIENT * 2);
    // Block 0 holds version 1 already (the first write).
    {
        let mut st = regs.lock();
        st.acked[0] = 1;
        st.sent[0] = 1;
    }
    let clients: Vec<RegClient> = s
        .clients
        .iter()
        .enumerate()
        .map(|(i, &h)| {
            let first = i as u64 * PER_CLIENT;
            RegClient::start(&c, &regs, h, h, first..first + PER_CLIENT)
        })
        .collect();
    wait_progress(&clients, "before the nemesis", Duration::from_secs(30));
    let nemesis = c.hosts.start(s.nemesis.clone());
    println!("{}: {:?} at {}", s.name, s.nemesis, regs.at());
    // The schedule's own length: what the clients meet meanwhile is the test.
    std::thread::sleep(s.hold);
    let during: Vec<Stats> = clients.iter().map(|k| k.stats()).collect();
    nemesis.heal();
    println!("{}: healed at {}", s.name, regs.at());
    let mut failures = Vec::new();
    if let Err(e) = progress(&clients, "after the heal", Duration::from_secs(60)) {
        failures.push(e);
    }
    report(&clients, &during);
    for k in clients {
        k.stop();
    }
    let bad = regs.lock().bad.clone();
    if let (Some(first), Some(last)) = (bad.first(), bad.last()) {
        failures.push(format!(
            "{} reads broke the register promise; the first: {first}; the last: {last}",
            bad.len()
        ));
    }
    after_heal(&c, &mut failures);
    final_check(&c, &regs, &mut failures);
    assert_no_failures(s.name, &failures);
}

/// Waits until every client has made `n` more acknowledged writes;
/// the client that did not, with its stats.
fn progress(clients: &[RegClient], when: &str, limit: Duration) -> Result<(), String> {
    let from: Vec<u64> = clients.iter().map(|k| k.stats().acks).collect();
    common::poll_for(limit, || {
        for (k, f) in clients.iter().zip(&from) {
            let st = k.stats();
            if st.acks < f + 10 {
                return Err(format!(
                    "{}: {} writes acknowledged {when} ({st:?})",
                    k.name,
                    st.acks - f
                ));
            }
        }
        Ok(())
    })
    .map_err(|e| format!("no progress {when} within {limit:?}: {e}"))
}

fn wait_progress(clients: &[RegClient], when: &str, limit: Duration) {
    if let Err(e) = progress(clients, when, limit) {
        panic!("{e}");
    }
}

fn report(clients: &[RegClient], during: &[Stats]) {
    for (k, d) in clients.iter().zip(during) {
        let st = k.stats();
        println!(
            "{}: at the heal {} writes acknowledged, {} refused, {} reads, \
             {} refused, {} connections lost; now {} acknowledged; longest \
             wait for an answer {}",
            k.name,
            d.acks,
            d.write_errors,
            d.reads,
            d.read_errors,
            d.lost,
            st.acks,
            secs(st.longest_wait)
        );
    }
}

/// Every block through two nodes: the ledger holds and both agree.
fn final_check(c: &NetCluster, regs: &Registers, failures: &mut Vec<String>) {
    let through: Vec<Result<Vec<u32>, String>> =
        [2, 4].iter().map(|&n| regs.check_through(c, n)).collect();
    match (&through[0], &through[1]) {
        (Ok(a), Ok(b)) if a != b => failures.push("nodes 2 and 4 serve different versions".into()),
        (Ok(_), Ok(_)) => {}
        _ => failures.extend(through.into_iter().filter_map(Result::err)),
    }
}

#[test]
fn registers_isolate_owner() {
    registers_under(Schedule {
        name: "isolate the owner's host",
        nemesis: Nemesis::Isolate(1),
        clients: [1, 2],
        hold: Duration::from_secs(15),
    });
}

#[test]
fn registers_split_2_2() {
    registers_under(Schedule {
        name: "split 2/2",
        nemesis: Nemesis::Split(vec![1, 2], vec![3, 4]),
        clients: [1, 3],
        hold: Duration::from_secs(15),
    });
}

#[test]
fn registers_split_1_3_owner_in_minority() {
    registers_under(Schedule {
        name: "split 1/3, the owner alone",
        nemesis: Nemesis::Split(vec![1], vec![2, 3, 4]),
        clients: [1, 3],
        hold: Duration::from_secs(20),
    });
}

#[test]
fn registers_one_way_cut_from_owner() {
    registers_under(Schedule {
        name: "one way: the owner's host cannot send to the others",
        nemesis: Nemesis::OneWay {
            from: vec![1],
            to: vec![2, 3, 4],
        },
        clients: [1, 2],
        hold: Duration::from_secs(20),
    });
}

#[test]
fn registers_flapping_owner_link() {
    registers_under(Schedule {
        name: "the owner's link flapping every 3 s",
        nemesis: Nemesis::Flap {
            host: 1,
            period: Duration::from_secs(3),
        },
        clients: [1, 2],
        hold: Duration::from_secs(24),
    });
}

#[test]
fn registers_delay_and_loss() {
    registers_under(Schedule {
        name: "every link 50 ms late and 5% lossy",
        nemesis: Nemesis::Degrade {
            hosts: vec![1, 2, 3, 4],
            delay: Duration::from_millis(50),
            loss_pct: 5,
        },
        clients: [1, 3],
        hold: Duration::from_secs(20),
    });
}

// ------------------------------------------------------------- directory

/// With node 1 (the directory's founder, and so at first its leader)
/// isolated, its API refuses a volume create at once, saying it has no
/// quorum; the majority elects a leader and keeps creating volumes; after
/// the heal node 1 lists what was created meanwhile and creates volumes
/// again, with nobody acting.
#[test]
fn directory_minority_refuses_at_once_and_catches_up() {
    let c = NetCluster::start(4);
    let st = c.json(2, 2, &["status"]).expect("status");
    println!("directory leader before the cut: node {}", st["leader"]);
    let cut = Instant::now();
    let nemesis = c.hosts.start(Nemesis::Isolate(1));
    let mut failures = Vec::new();
    // The minority's calls and the majority's run at once: neither waits
    // for the other. The minority's second call comes once the first
    // answered: by then node 1 knows it is cut off.
    let (minority, made) = std::thread::scope(|sc| {
        let minority = sc.spawn(|| {
            let limit = Duration::from_secs(40);
            [
                create_through(&c, 1, "minority", limit),
                create_through(&c, 1, "minority2", limit),
            ]
        });
        let made = majority_creates(&c, cut);
        (minority.join().expect("the minority's calls"), made)
    });
    for (i, (took, r)) in minority.into_iter().enumerate() {
        println!(
            "create {} through the cut-off node 1: {} after {}",
            i + 1,
            short(&r),
            secs(took)
        );
        failures.extend(no_quorum_findings(i + 1, took, r));
    }
    failures.extend(made.err());
    nemesis.heal();
    catch_up(&c, &mut failures);
    assert_no_failures("directory under a partition", &failures);
}

/// A minority's create must fail within [`NO_QUORUM_BOUND`], saying it
/// has no quorum.
fn no_quorum_findings(call: usize, took: Duration, r: Result<String, String>) -> Option<String> {
    match r {
        Err(e) if took < NO_QUORUM_BOUND && e.to_lowercase().contains("quorum") => None,
        Err(e) => Some(format!(
            "the minority's create {call} failed after {} (bound {}), saying: {e}",
            secs(took),
            secs(NO_QUORUM_BOUND)
        )),
        Ok(out) => Some(format!("the minority's create {call} made a volume: {out}")),
    }
}

/// `volume create NAME` through node `node` from its host, at most
/// `limit`: how long the answer took, and the answer.
fn create_through(
    c: &NetCluster,
    node: u32,
    name: &str,
    limit: Duration,
) -> (Duration, Result<String, String>) {
    let t = Instant::now();
    let args = [
        "volume",
        "create",
        name,
        "--size",
        "16M",
        "--policy",
        "raid1 ftt=1",
    ];
    let r = c.shoal_within(node, node, &args, limit);
    (t.elapsed(), r)
}

/// Creates `name` through `node`, retrying for at most `limit` (a retry
/// told the volume exists: an earlier try that timed out made it).
fn create_retrying(c: &NetCluster, node: u32, name: &str, limit: Duration) -> Result<(), String> {
    common::poll_for(limit, || {
        match create_through(c, node, name, Duration::from_secs(10)).1 {
            Ok(_) => Ok(()),
            Err(e) if e.contains("exists") => Ok(()),
            Err(e) => Err(e),
        }
    })
}

/// The majority creates two volumes, through nodes 2 and 3, retrying
/// until the directory has a leader again (at most 60 s).
fn majority_creates(c: &NetCluster, cut: Instant) -> Result<(), String> {
    create_retrying(c, 2, "majority", Duration::from_secs(60))
        .map_err(|e| format!("the majority created no volume within 60 s of the cut: {e}"))?;
    println!(
        "the majority created a volume {} after the cut",
        secs(cut.elapsed())
    );
    create_through(c, 3, "majority2", Duration::from_secs(10))
        .1
        .map(|_| ())
        .map_err(|e| format!("the majority's second create: {e}"))
}

/// After the heal: node 1 lists the majority's volumes and creates one.
fn catch_up(c: &NetCluster, failures: &mut Vec<String>) {
    let t = Instant::now();
    let listed = common::poll_for(Duration::from_secs(30), || {
        let v = c.json(1, 1, &["volume", "list"])?;
        let text = v.to_string();
        if text.contains("\"majority\"") && text.contains("\"majority2\"") {
            Ok(())
        } else {
            Err(format!("node 1 lists {text}"))
        }
    });
    match listed {
        Ok(()) => println!(
            "node 1 listed the majority's volumes {} after the heal",
            secs(t.elapsed())
        ),
        Err(e) => failures.push(format!("node 1 did not catch up within 30 s: {e}")),
    }
    if let Err(e) = create_retrying(c, 1, "after", Duration::from_secs(30)) {
        failures.push(format!(
            "node 1 created no volume within 30 s of the heal: {e}"
        ));
    }
}

/// The first line of a command's answer, for the log.
fn short(r: &Result<String, String>) -> String {
    match r {
        Ok(o) => format!("ok: {}", o.lines().next().unwrap_or("")),
        Err(e) => format!("error: {e}"),
    }
}

// ---------------------------------------------------------------- harness

/// The harness itself, without nodes: every nemesis cuts exactly what it
/// says (checked per direction by `Hosts::start`), the heal restores every
/// path, a flapping link comes and goes, and a degraded link delays and
/// loses packets.
#[test]
fn harness_nemeses_cut_and_heal() {
    let h = Hosts::new(4);
    h.check_reach("new hosts", |_, _| true)
        .expect("every host reaches every other");
    for n in [
        Nemesis::Isolate(1),
        Nemesis::Split(vec![1, 2], vec![3, 4]),
        Nemesis::Split(vec![1], vec![2, 3, 4]),
        Nemesis::OneWay {
            from: vec![1],
            to: vec![2, 3, 4],
        },
    ] {
        h.start(n).heal();
    }
    let flap = h.start(Nemesis::Flap {
        host: 1,
        period: Duration::from_secs(3),
    });
    wait_for("the flapping link back", Duration::from_secs(10), || {
        host1_heard(&h)
    });
    wait_for(
        "the flapping link down again",
        Duration::from_secs(10),
        || host1_heard(&h).map_or(Ok(()), |()| Err("1->2 got through".to_string())),
    );
    flap.heal();
    degraded_link(&h);
}

fn host1_heard(h: &Hosts) -> Result<(), String> {
    if h.reach().contains(&(1, 2)) {
        Ok(())
    } else {
        Err("1->2 lost".into())
    }
}

/// Host 2's input 200 ms late and 30% lossy: a UDP datagram from host 1
/// takes at least 200 ms, and about 30% of 300 are lost.
fn degraded_link(h: &Hosts) {
    let (a1, a2) = (h.addr(1), h.addr(2));
    let rx = h
        .run_in(2, move || std::net::UdpSocket::bind((a2.as_str(), 0)))
        .expect("bind");
    let tx = h
        .run_in(1, move || std::net::UdpSocket::bind((a1.as_str(), 0)))
        .expect("bind");
    let to = rx.local_addr().expect("addr");
    rx.set_read_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    let n = h.start(Nemesis::Degrade {
        hosts: vec![2],
        delay: Duration::from_millis(200),
        loss_pct: 30,
    });
    let t = Instant::now();
    for i in 0..300u32 {
        tx.send_to(&i.to_le_bytes(), to).expect("send");
    }
    let mut buf = [0u8; 8];
    let mut got = 0;
    while rx.recv(&mut buf).is_ok() {
        if got == 0 {
            let late = t.elapsed();
            assert!(
                late >= Duration::from_millis(190),
                "the first datagram only {late:?} late"
            );
            println!("degraded link: the first datagram {late:?} late");
        }
        got += 1;
    }
    println!("degraded link: {got} of 300 datagrams through");
    assert!(
        (150..=260).contains(&got),
        "{got} of 300 through a 30% lossy link"
    );
    n.heal();
}
