//! A reader that keeps `depth` reads in flight on one NBD connection and
//! counts the answers, for tests of rates that change while a client stays
//! connected (an IOPS limit changed under load).

use shoal_nbd::codec::{Command as Nbd, Request, SimpleReply, SIMPLE_REPLY_LEN};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

struct Shared {
    /// Reads sent and not answered.
    inflight: Mutex<usize>,
    room: Condvar,
    answered: AtomicU64,
    failed: AtomicU64,
    stop: AtomicBool,
}

pub struct ReadLoad {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    stream: TcpStream,
}

impl ReadLoad {
    /// Reads of `bs` bytes at random offsets in the first `span` bytes of
    /// `export` at `addr`, `depth` at a time.
    pub fn start(addr: &str, export: &str, depth: usize, bs: u32, span: u64) -> ReadLoad {
        let s = super::ledger::connect(addr, export);
        let shared = Arc::new(Shared {
            inflight: Mutex::new(0),
            room: Condvar::new(),
            answered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let (w, r) = (s.try_clone().expect("clone"), s.try_clone().expect("clone"));
        let sh = shared.clone();
        let writer = std::thread::spawn(move || send_loop(w, &sh, depth, bs, span));
        let sh = shared.clone();
        let reader = std::thread::spawn(move || answer_loop(r, &sh, bs));
        ReadLoad {
            shared,
            threads: vec![writer, reader],
            stream: s,
        }
    }

    pub fn answered(&self) -> u64 {
        self.shared.answered.load(SeqCst)
    }

    pub fn failed(&self) -> u64 {
        self.shared.failed.load(SeqCst)
    }

    /// Reads answered per second over the next `window`.
    pub fn rate(&self, window: Duration) -> f64 {
        let (n0, t0) = (self.answered(), Instant::now());
        std::thread::sleep(window);
        (self.answered() - n0) as f64 / t0.elapsed().as_secs_f64()
    }

    pub fn stop(mut self) {
        self.shared.stop.store(true, SeqCst);
        self.shared.room.notify_all();
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        for t in self.threads.drain(..) {
            t.join().expect("load thread");
        }
    }
}

fn send_loop(mut s: TcpStream, sh: &Shared, depth: usize, bs: u32, span: u64) {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let blocks = (span / u64::from(bs)).max(1);
    let mut handle = 0u64;
    while !sh.stop.load(SeqCst) {
        {
            let mut n = sh.inflight.lock().unwrap_or_else(|e| e.into_inner());
            while *n >= depth && !sh.stop.load(SeqCst) {
                n = sh.room.wait(n).unwrap_or_else(|e| e.into_inner());
            }
            *n += 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        handle += 1;
        let req = Request {
            flags: 0,
            command: Nbd::Read,
            handle,
            offset: (x % blocks) * u64::from(bs),
            len: bs,
        };
        if s.write_all(&req.encode()).is_err() {
            break;
        }
    }
}

fn answer_loop(mut s: TcpStream, sh: &Shared, bs: u32) {
    let mut h = [0u8; SIMPLE_REPLY_LEN];
    let mut data = vec![0u8; bs as usize];
    while s.read_exact(&mut h).is_ok() {
        let Ok(r) = SimpleReply::decode(&h) else {
            break;
        };
        if r.error != 0 {
            sh.failed.fetch_add(1, SeqCst);
        } else if s.read_exact(&mut data).is_err() {
            break;
        } else {
            sh.answered.fetch_add(1, SeqCst);
        }
        *sh.inflight.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        sh.room.notify_all();
    }
    sh.stop.store(true, SeqCst);
    sh.room.notify_all();
}
