//! A client that remembers what the cluster acknowledged, for crash tests.
//!
//! [`Writer`] writes 4 KiB blocks over one NBD connection, several in
//! flight, never two on the same block at once; with [`Runs`], some of
//! its writes are runs of many consecutive blocks in one request. Each block's contents name
//! the block and a version (1, 2, ... per block) and are otherwise a
//! pattern derived from both, so a block read back tells which write put
//! it there, and a torn or misplaced block shows. The [`Ledger`] keeps, per
//! block, the last version the server acknowledged and the last one sent.
//!
//! After a crash, [`Ledger::check`] reads every block and holds the
//! cluster to the promise of an acknowledged write: a block holds a version
//! between the last acknowledged one and the last sent one (a write in
//! flight at the cut may or may not have landed), never an older one, and
//! exactly that version's contents.

use shoal_nbd::codec::{Command as Nbd, Request, SimpleReply, SIMPLE_REPLY_LEN};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

const BLOCK: usize = 4096;
const MAGIC: &[u8; 8] = b"SHOALLDG";

/// The contents of `block` written as `version` (version 0: never written,
/// all zeros).
pub fn block_image(block: u64, version: u32) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK];
    if version == 0 {
        return b;
    }
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&block.to_le_bytes());
    b[16..20].copy_from_slice(&version.to_le_bytes());
    let mut x = (block.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(version).wrapping_mul(0xD1B5_4A32_D192_ED03))
        | 1;
    for chunk in b[24..].chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    b
}

/// Opens `export` on the NBD server at `addr` (`host:port`) as a blocking
/// stream.
pub fn connect(addr: &str, export: &str) -> TcpStream {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let (s, _) = shoal_bench::nbd::connect(addr, export)
            .await
            .unwrap_or_else(|e| panic!("NBD connect to {addr}/{export}: {e:#}"));
        let s = s.into_std().expect("std stream");
        s.set_nonblocking(false).expect("blocking");
        s
    })
}

#[derive(Default)]
struct State {
    /// Per block: the last version the server acknowledged.
    acked: Vec<u32>,
    /// Per block: the last version sent (or about to be).
    sent: Vec<u32>,
    /// Blocks with a write in flight.
    busy: Vec<bool>,
    /// handle → (first block, each block's version) of the writes in
    /// flight.
    inflight: HashMap<u64, (u64, Vec<u32>)>,
    acks: u64,
    /// Writes answered with an error (an unacknowledged write: it may or
    /// may not have landed, as one in flight at the cut).
    errors: u64,
    /// A reply that breaks the protocol.
    refused: Option<String>,
    /// The connection is gone.
    closed: bool,
    /// The client was asked to stop sending.
    stopping: bool,
}

/// What the server acknowledged and what was in flight.
pub struct Ledger {
    state: Mutex<State>,
    room: Condvar,
}

impl Ledger {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes acknowledged.
    pub fn acks(&self) -> u64 {
        self.lock().acks
    }

    /// Writes answered with an error (a node dying under a write may
    /// answer so before the client's connection goes).
    pub fn errors(&self) -> u64 {
        self.lock().errors
    }

    /// Blocks written at least once (acknowledged).
    pub fn written(&self) -> usize {
        self.lock().acked.iter().filter(|&&v| v > 0).count()
    }

    /// Reads every block of `export` through `addr` and checks it against
    /// the ledger; panics with the blocks that break the promise. Returns
    /// the version each block holds.
    pub fn check(&self, addr: &str, export: &str) -> Vec<u32> {
        let st = self.lock();
        let blocks = st.acked.len();
        let mut s = connect(addr, export);
        let chunk = 64usize;
        let mut found = vec![0u32; blocks];
        let mut bad = Vec::new();
        let mut buf = vec![0u8; chunk * BLOCK];
        for first in (0..blocks).step_by(chunk) {
            let n = chunk.min(blocks - first);
            let req = Request {
                flags: 0,
                command: Nbd::Read,
                handle: first as u64,
                offset: (first * BLOCK) as u64,
                len: (n * BLOCK) as u32,
            };
            s.write_all(&req.encode()).expect("sending a read");
            let mut h = [0u8; SIMPLE_REPLY_LEN];
            s.read_exact(&mut h).expect("reading a reply header");
            let r = SimpleReply::decode(&h).expect("a simple reply");
            assert_eq!(r.handle, first as u64, "reply to another request");
            assert_eq!(r.error, 0, "read of blocks {first}.. failed");
            s.read_exact(&mut buf[..n * BLOCK]).expect("reading data");
            for i in 0..n {
                let b = first + i;
                let got = &buf[i * BLOCK..(i + 1) * BLOCK];
                let v = if got.iter().all(|&x| x == 0) {
                    0
                } else {
                    u32::from_le_bytes(got[16..20].try_into().expect("4 bytes"))
                };
                found[b] = v;
                let (acked, sent) = (st.acked[b], st.sent[b]);
                if got != block_image(b as u64, v).as_slice() {
                    bad.push(format!("block {b}: torn or misplaced contents"));
                } else if v < acked {
                    bad.push(format!(
                        "block {b}: version {v}, but version {acked} was acknowledged"
                    ));
                } else if v > sent {
                    bad.push(format!("block {b}: version {v} was never sent ({sent})"));
                }
            }
        }
        let _ = s.write_all(
            &Request {
                flags: 0,
                command: Nbd::Disc,
                handle: u64::MAX,
                offset: 0,
                len: 0,
            }
            .encode(),
        );
        assert!(
            bad.is_empty(),
            "{} of {blocks} blocks through {addr} break the ledger: {:?}",
            bad.len(),
            &bad[..bad.len().min(10)]
        );
        found
    }
}

/// Which of a [`Writer`]'s writes are runs of blocks: every `every`th
/// write (0: none) is `blocks` consecutive blocks in one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Runs {
    pub every: u64,
    pub blocks: u64,
}

/// Writes random blocks until the connection goes.
pub struct Writer {
    ledger: Arc<Ledger>,
    threads: Vec<JoinHandle<()>>,
    stream: TcpStream,
}

impl Writer {
    /// Starts writing the first `versions.len()` 4 KiB blocks of `export`
    /// at `addr`, `depth` writes in flight. `versions`: what each block
    /// holds now (all 0 on a new volume; what [`Ledger::check`] found,
    /// to go on after a crash).
    pub fn start(addr: &str, export: &str, versions: Vec<u32>, depth: usize) -> Writer {
        Writer::start_with_runs(addr, export, versions, depth, Runs::default())
    }

    /// [`Writer::start`], some writes being runs of blocks.
    pub fn start_with_runs(
        addr: &str,
        export: &str,
        versions: Vec<u32>,
        depth: usize,
        runs: Runs,
    ) -> Writer {
        let blocks = versions.len();
        assert!(runs.blocks <= blocks as u64, "runs longer than the volume");
        let ledger = Arc::new(Ledger {
            state: Mutex::new(State {
                acked: versions.clone(),
                sent: versions,
                busy: vec![false; blocks],
                ..State::default()
            }),
            room: Condvar::new(),
        });
        let s = connect(addr, export);
        let r = s.try_clone().expect("clone stream");
        let stream = s.try_clone().expect("clone stream");
        let l = ledger.clone();
        let writer = std::thread::spawn(move || write_loop(s, &l, depth, runs));
        let l = ledger.clone();
        let reader = std::thread::spawn(move || read_loop(r, &l));
        Writer {
            ledger,
            threads: vec![writer, reader],
            stream,
        }
    }

    /// Stops sending, waits (up to `timeout`) for the answers to the
    /// writes in flight, closes the connection and returns the ledger.
    /// Panics if a reply broke the protocol or the answers did not come.
    pub fn stop(self, timeout: std::time::Duration) -> Arc<Ledger> {
        let deadline = std::time::Instant::now() + timeout;
        {
            let mut st = self.ledger.lock();
            st.stopping = true;
            self.ledger.room.notify_all();
            while !st.inflight.is_empty() && !st.closed {
                let left = deadline.saturating_duration_since(std::time::Instant::now());
                assert!(
                    !left.is_zero(),
                    "{} writes unanswered after {timeout:?}",
                    st.inflight.len()
                );
                st = self
                    .ledger
                    .room
                    .wait_timeout(st, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.wait_cut()
    }

    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Waits, at most `timeout`, until `more` writes past those
    /// acknowledged now are acknowledged (`what` names the wait).
    pub fn wait_more(&self, what: &str, more: u64, timeout: std::time::Duration) {
        let from = self.ledger.acks();
        super::wait_for(what, timeout, || match self.ledger.acks() {
            n if n >= from + more => Ok(()),
            n => Err(format!("{n} acknowledged")),
        });
    }

    /// Waits until the connection is gone (the server was killed), and
    /// returns the ledger. Panics if a reply broke the protocol.
    pub fn wait_cut(self) -> Arc<Ledger> {
        for t in self.threads {
            t.join().expect("ledger thread");
        }
        if let Some(e) = &self.ledger.lock().refused {
            panic!("the server broke the protocol: {e}");
        }
        self.ledger
    }
}

/// The next write: its first block and count, none of them busy (a run
/// that finds a busy block is a single block this time).
fn pick(st: &State, x: &mut u64, run: u64) -> (u64, u64) {
    let blocks = st.acked.len() as u64;
    let mut next = || {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    };
    if run > 1 {
        let first = next() % (blocks - run + 1);
        if (first..first + run).all(|b| !st.busy[b as usize]) {
            return (first, run);
        }
    }
    loop {
        let b = next() % blocks;
        if !st.busy[b as usize] {
            return (b, 1);
        }
    }
}

fn write_loop(mut s: TcpStream, l: &Ledger, depth: usize, runs: Runs) {
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut handle = 0u64;
    loop {
        let (first, versions) = {
            let mut st = l.lock();
            while st.inflight.len() >= depth && !st.closed && !st.stopping {
                st = l.room.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.closed || st.stopping {
                break;
            }
            handle += 1;
            let run = match runs.every {
                0 => 1,
                every if handle.is_multiple_of(every) => runs.blocks,
                _ => 1,
            };
            let (first, count) = pick(&st, &mut x, run);
            let mut versions = Vec::with_capacity(count as usize);
            for b in first..first + count {
                let v = st.sent[b as usize] + 1;
                st.sent[b as usize] = v;
                st.busy[b as usize] = true;
                versions.push(v);
            }
            st.inflight.insert(handle, (first, versions.clone()));
            (first, versions)
        };
        let req = Request {
            flags: 0,
            command: Nbd::Write,
            handle,
            offset: first * BLOCK as u64,
            len: (versions.len() * BLOCK) as u32,
        };
        let mut frame = req.encode().to_vec();
        for (b, &v) in (first..).zip(&versions) {
            frame.extend_from_slice(&block_image(b, v));
        }
        if s.write_all(&frame).is_err() {
            break;
        }
    }
}

fn read_loop(mut s: TcpStream, l: &Ledger) {
    let mut h = [0u8; SIMPLE_REPLY_LEN];
    while s.read_exact(&mut h).is_ok() {
        let Ok(r) = SimpleReply::decode(&h) else {
            l.lock().refused = Some("an undecodable reply".into());
            break;
        };
        let mut st = l.lock();
        let Some((first, versions)) = st.inflight.remove(&r.handle) else {
            st.refused = Some(format!("a reply for unknown handle {}", r.handle));
            break;
        };
        for (b, &v) in (first as usize..).zip(&versions) {
            st.busy[b] = false;
            if r.error == 0 {
                assert!(v > st.acked[b], "versions acknowledged out of order");
                st.acked[b] = v;
            }
        }
        match r.error {
            0 => st.acks += 1,
            _ => st.errors += 1,
        }
        drop(st);
        l.room.notify_all();
    }
    l.lock().closed = true;
    l.room.notify_all();
}
