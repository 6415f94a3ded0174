//! Store-alone benchmark of `LogStore` on a file (no network, no
//! replication): what the store costs over the raw device. `bench/store.sh`
//! runs it beside fio on the same disk and prints the comparison.
//!
//!     cargo run --release -p shoal-store --example store_bench -- \
//!         randwrite --file /work/bench/store.img --size 4G --qd 32 --runtime 15
//!
//! Modes (one JSON line on stdout each):
//!
//! - `randwrite`: `--qd` threads, each: write `--bs` at a random aligned
//!   offset of a `--span` component, then `GroupCommit::commit_blocking`
//!   (the node's write path: a write is acknowledged once durable).
//! - `seqwrite`: the same with offsets handed out in order (wrapping).
//! - `randread` / `seqread`: `--qd` threads reading a component prefilled
//!   with `--fill seq` (1 MiB writes) or `--fill random` (random 4 KiB
//!   writes in random order: the layout that scatters a later sequential
//!   read over the whole log).
//! - `recovery`: a child process writes `--gib` GiB (`--qd` threads,
//!   `--bs` writes at random aligned offsets, group commit) and exits with
//!   `_exit` (no close, no final checkpoint: a kill -9), then the parent
//!   times `LogStore::open`. `--no-ckpt` keeps the child from taking
//!   checkpoints, so the whole log is replayed (seconds per GiB of log).
//!
//! - `--driver ring` (read modes): the node's way of reading: one thread
//!   keeps `--qd` reads in flight on an io_uring of its own. Each read is
//!   located with `LogStore::plan_read`, its device reads go into the
//!   ring, and it is checked and answered with `LogStore::finish_read`
//!   as soon as they complete; its slot is refilled at once.
//!
//! - `--driver pipeline` (write modes): the node's way instead of one
//!   thread per write: one submitting thread keeps `--qd` writes in flight
//!   (it applies each to the store as it goes, like the node's runtime
//!   thread) and one flusher thread syncs whatever was applied before its
//!   sync started (like the node's flusher). A write completes when a sync
//!   that started after it ends; its slot is refilled at once. No thread
//!   wake-up per write, one per sync. The default, `--driver threads`, is
//!   `--qd` threads each blocking in `commit_blocking`.
//!
//! Common options: `--file PATH` (recreated unless `--keep`), `--size`
//! (device bytes, sparse), `--runtime` seconds, `--ramp` seconds not
//! measured. Sizes take k/M/G suffixes (powers of two).

use shoal_store::log::SimRng;
use shoal_store::{GroupCommit, LogStore};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLUSTER: &str = "bench";
const COMP: u64 = 1;

#[derive(Clone, Debug)]
struct Opts {
    mode: String,
    file: PathBuf,
    size: u64,
    span: u64,
    bs: u64,
    qd: usize,
    runtime: f64,
    ramp: f64,
    fill: String,
    gib: f64,
    keep: bool,
    no_ckpt: bool,
    pipeline: bool,
    ring: bool,
}

fn parse_size(s: &str) -> u64 {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_lowercase()) {
        Some('k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m') => (&s[..s.len() - 1], 1 << 20),
        Some('g') => (&s[..s.len() - 1], 1 << 30),
        Some('t') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let v: f64 = num
        .parse()
        .unwrap_or_else(|_| die(&format!("bad size {s:?}")));
    (v * mul as f64) as u64
}

fn die(m: &str) -> ! {
    eprintln!("store_bench: {m}");
    std::process::exit(2)
}

fn parse() -> Opts {
    let mut a = std::env::args().skip(1);
    let mode = a.next().unwrap_or_else(|| {
        die("usage: store_bench randwrite|seqwrite|randread|seqread|recovery [options]")
    });
    let mut o = Opts {
        mode,
        file: PathBuf::from("store-bench.img"),
        size: 4 << 30,
        span: 0,
        bs: 4096,
        qd: 32,
        runtime: 15.0,
        ramp: 2.0,
        fill: "seq".into(),
        gib: 1.0,
        keep: false,
        no_ckpt: false,
        pipeline: false,
        ring: false,
    };
    while let Some(k) = a.next() {
        let mut v = || {
            a.next()
                .unwrap_or_else(|| die(&format!("{k} needs a value")))
        };
        match k.as_str() {
            "--file" => o.file = PathBuf::from(v()),
            "--size" => o.size = parse_size(&v()),
            "--span" => o.span = parse_size(&v()),
            "--bs" => o.bs = parse_size(&v()),
            "--qd" => o.qd = v().parse().unwrap_or_else(|_| die("bad --qd")),
            "--runtime" => o.runtime = v().parse().unwrap_or_else(|_| die("bad --runtime")),
            "--ramp" => o.ramp = v().parse().unwrap_or_else(|_| die("bad --ramp")),
            "--fill" => o.fill = v(),
            "--gib" => o.gib = v().parse().unwrap_or_else(|_| die("bad --gib")),
            "--keep" => o.keep = true,
            "--no-ckpt" => o.no_ckpt = true,
            "--driver" => match v().as_str() {
                "threads" => (o.pipeline, o.ring) = (false, false),
                "pipeline" => o.pipeline = true,
                "ring" => o.ring = true,
                d => die(&format!("unknown --driver {d} (threads, pipeline or ring)")),
            },
            _ => die(&format!("unknown option {k}")),
        }
    }
    if o.bs == 0 || !o.bs.is_multiple_of(4096) {
        die("--bs must be a multiple of 4k");
    }
    if o.span == 0 {
        o.span = (o.size / 2) / (1 << 20) * (1 << 20);
    }
    o
}

fn fresh_store(o: &Opts) -> LogStore {
    if !o.keep {
        let _ = std::fs::remove_file(&o.file);
    }
    let s = LogStore::create(&o.file, o.size, CLUSTER)
        .unwrap_or_else(|e| die(&format!("creating {}: {e}", o.file.display())));
    if !s.direct_io() {
        eprintln!("store_bench: warning: O_DIRECT refused, the store runs buffered");
    }
    if s.component(COMP).is_none() {
        s.create_component(COMP, 1, o.span)
            .unwrap_or_else(|e| die(&format!("create component: {e}")));
    }
    s
}

/// Latencies in µs of one thread.
#[derive(Default)]
struct Lat(Vec<u32>);

impl Lat {
    fn add(&mut self, d: Duration) {
        self.0.push(d.as_micros().min(u32::MAX as u128) as u32);
    }
}

struct Result_ {
    ops: u64,
    secs: f64,
    lat: Vec<u32>,
}

/// Runs `op(thread, rng, i)` on `qd` threads for ramp + runtime seconds;
/// counts only what completes after the ramp.
fn run<F>(o: &Opts, op: F) -> Result_
where
    F: Fn(usize, &mut SimRng) + Send + Sync + 'static,
{
    let op = Arc::new(op);
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for t in 0..o.qd {
        let (op, stop, measuring) = (op.clone(), stop.clone(), measuring.clone());
        hs.push(std::thread::spawn(move || {
            let mut rng = SimRng::new(0x5eed ^ ((t as u64 + 1) * 0x9E37_79B9));
            let mut lat = Lat::default();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                op(t, &mut rng);
                if measuring.load(Ordering::Relaxed) {
                    n += 1;
                    lat.add(t0.elapsed());
                }
            }
            (n, lat)
        }));
    }
    std::thread::sleep(Duration::from_secs_f64(o.ramp));
    measuring.store(true, Ordering::Relaxed);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(o.runtime));
    measuring.store(false, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    let mut lat = Vec::new();
    for h in hs {
        let (n, l) = h.join().unwrap_or_else(|_| die("a worker panicked"));
        ops += n;
        lat.extend(l.0);
    }
    lat.sort_unstable();
    Result_ { ops, secs, lat }
}

fn pct(lat: &[u32], p: f64) -> u32 {
    if lat.is_empty() {
        return 0;
    }
    lat[((lat.len() - 1) as f64 * p) as usize]
}

fn report(o: &Opts, r: &Result_, extra: &str) {
    let iops = r.ops as f64 / r.secs;
    let mean = if r.lat.is_empty() {
        0.0
    } else {
        r.lat.iter().map(|&x| x as f64).sum::<f64>() / r.lat.len() as f64
    };
    println!(
        "{{\"mode\":\"{}\",\"bs\":{},\"qd\":{},\"iops\":{:.0},\"mib_s\":{:.1},\"lat_us_mean\":{:.0},\"lat_us_p99\":{}{}}}",
        o.mode,
        o.bs,
        o.qd,
        iops,
        iops * o.bs as f64 / (1 << 20) as f64,
        mean,
        pct(&r.lat, 0.99),
        extra
    );
}

fn prefill(s: &LogStore, o: &Opts) {
    let t = Instant::now();
    match o.fill.as_str() {
        "seq" => {
            let buf = vec![0xa5u8; 1 << 20];
            let mut off = 0;
            while off < o.span {
                let n = (o.span - off).min(buf.len() as u64) as usize;
                let mut b = buf.clone();
                b[..8].copy_from_slice(&off.to_le_bytes());
                s.write(COMP, off, &b[..n])
                    .unwrap_or_else(|e| die(&format!("prefill: {e}")));
                off += n as u64;
                if off % (64 << 20) == 0 {
                    s.sync()
                        .unwrap_or_else(|e| die(&format!("prefill sync: {e}")));
                }
            }
        }
        "random" => {
            // Every 4 KiB block once, in a random order.
            let n = o.span / 4096;
            let mut order: Vec<u32> = (0..n as u32).collect();
            let mut rng = SimRng::new(7);
            for i in (1..order.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                order.swap(i, j);
            }
            let mut b = vec![0x5au8; 4096];
            for (i, &blk) in order.iter().enumerate() {
                b[..8].copy_from_slice(&(blk as u64).to_le_bytes());
                s.write(COMP, blk as u64 * 4096, &b)
                    .unwrap_or_else(|e| die(&format!("prefill: {e}")));
                if i % 32 == 31 {
                    s.sync()
                        .unwrap_or_else(|e| die(&format!("prefill sync: {e}")));
                }
            }
        }
        "none" => {}
        f => die(&format!("unknown --fill {f}")),
    }
    s.sync()
        .unwrap_or_else(|e| die(&format!("prefill sync: {e}")));
    eprintln!(
        "store_bench: prefilled {} MiB ({}) in {:.1}s",
        o.span >> 20,
        o.fill,
        t.elapsed().as_secs_f64()
    );
}

/// Applied and durable counts of the pipeline driver.
#[derive(Default)]
struct Pipe {
    /// Writes applied to the store (a ticket each, in order).
    applied: u64,
    /// Every ticket up to this one is durable.
    durable: u64,
    /// The sync running covers tickets up to this one.
    syncing: bool,
    stop: bool,
}

/// `--driver pipeline`: one submitter keeps `qd` writes in flight, one
/// flusher thread syncs. Returns the result and the number of syncs.
fn run_pipeline(o: &Opts, s: Arc<LogStore>, sequential: bool) -> (Result_, u64) {
    use std::collections::VecDeque;
    use std::sync::{Condvar, Mutex};
    let pipe = Arc::new((Mutex::new(Pipe::default()), Condvar::new(), Condvar::new()));
    let syncs = Arc::new(AtomicU64::new(0));
    let flusher = {
        let (pipe, s, syncs) = (pipe.clone(), s.clone(), syncs.clone());
        std::thread::spawn(move || {
            let (m, work, done) = &*pipe;
            let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                while p.applied == p.durable && !p.stop {
                    p = work.wait(p).unwrap_or_else(|e| e.into_inner());
                }
                if p.stop {
                    return;
                }
                let target = p.applied;
                p.syncing = true;
                drop(p);
                s.sync().unwrap_or_else(|e| die(&format!("sync: {e}")));
                syncs.fetch_add(1, Ordering::Relaxed);
                p = m.lock().unwrap_or_else(|e| e.into_inner());
                p.syncing = false;
                p.durable = target;
                done.notify_one();
            }
        })
    };
    let blocks = o.span / o.bs;
    let bs = o.bs as usize;
    let mut rng = SimRng::new(0x5eed);
    let mut next = 0u64;
    let mut buf = vec![0u8; bs];
    // (ticket, start) of the writes in flight, oldest first.
    let mut inflight: VecDeque<(u64, Instant)> = VecDeque::with_capacity(o.qd);
    let mut ticket = 0u64;
    let mut lat = Lat::default();
    let mut ops = 0u64;
    let t_start = Instant::now();
    let ramp = Duration::from_secs_f64(o.ramp);
    let end = ramp + Duration::from_secs_f64(o.runtime);
    let (m, work, done) = &*pipe;
    let (mut t0, mut t1) = (None, None);
    while t1.is_none() {
        // Refill every free slot, then publish the burst at once (the
        // node's writes of one burst are ticketed before the flusher is
        // woken).
        while inflight.len() < o.qd {
            let i = if sequential {
                next += 1;
                (next - 1) % blocks
            } else {
                rng.below(blocks)
            };
            buf[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
            s.write(COMP, i * bs as u64, &buf)
                .unwrap_or_else(|e| die(&format!("write: {e}")));
            ticket += 1;
            inflight.push_back((ticket, Instant::now()));
        }
        let durable = {
            let mut p = m.lock().unwrap_or_else(|e| e.into_inner());
            p.applied = ticket;
            if !p.syncing {
                work.notify_one();
            }
            let oldest = inflight.front().map_or(0, |w| w.0);
            while p.durable < oldest {
                p = done.wait(p).unwrap_or_else(|e| e.into_inner());
            }
            p.durable
        };
        let now = Instant::now();
        let el = now - t_start;
        if t0.is_none() && el >= ramp {
            t0 = Some(now);
        }
        if el >= end {
            t1 = Some(now);
        }
        while inflight.front().is_some_and(|w| w.0 <= durable) {
            let (_, at) = inflight.pop_front().unwrap_or_else(|| die("empty"));
            if t0.is_some() && t1.is_none() {
                ops += 1;
                lat.add(now - at);
            }
        }
    }
    m.lock().unwrap_or_else(|e| e.into_inner()).stop = true;
    work.notify_one();
    let _ = flusher.join();
    let secs = match (t0, t1) {
        (Some(a), Some(b)) => (b - a).as_secs_f64(),
        _ => o.runtime,
    };
    let mut l = lat.0;
    l.sort_unstable();
    (Result_ { ops, secs, lat: l }, syncs.load(Ordering::Relaxed))
}

/// Reports a write run with the store's group-commit figures between
/// `before` and `after`; `extra` is more JSON fields (with a leading comma).
fn report_write(
    o: &Opts,
    r: &Result_,
    before: &shoal_store::LogStats,
    after: &shoal_store::LogStats,
    syncs: u64,
    extra: &str,
) {
    let flushes = after.flushes.saturating_sub(before.flushes);
    let total_ops = (after.client_bytes - before.client_bytes) / o.bs;
    report(
        o,
        r,
        &format!(
            "{extra},\"writes_per_flush\":{:.1},\"commits_per_sync\":{:.1},\"write_amp\":{:.3}",
            total_ops as f64 / flushes.max(1) as f64,
            total_ops as f64 / syncs.max(1) as f64,
            after.write_amplification()
        ),
    );
}

fn bench_write(o: &Opts, sequential: bool) {
    let s = Arc::new(fresh_store(o));
    if o.pipeline {
        let before = s.stats();
        let (r, syncs) = run_pipeline(o, s.clone(), sequential);
        report_write(
            o,
            &r,
            &before,
            &s.stats(),
            syncs,
            ",\"driver\":\"pipeline\"",
        );
        if let Ok(s) = Arc::try_unwrap(s) {
            let _ = s.close();
        }
        return;
    }
    let gc = GroupCommit::new(s.clone());
    let blocks = o.span / o.bs;
    let next = Arc::new(AtomicU64::new(0));
    let bs = o.bs as usize;
    let before = s.stats();
    let syncs0 = gc.syncs();
    let (s2, gc2) = (s.clone(), gc.clone());
    let r = run(o, move |_, rng| {
        let i = if sequential {
            next.fetch_add(1, Ordering::Relaxed) % blocks
        } else {
            rng.below(blocks)
        };
        let mut buf = vec![0u8; bs];
        buf[..8].copy_from_slice(&rng.next_u64().to_le_bytes());
        s2.write(COMP, i * bs as u64, &buf)
            .unwrap_or_else(|e| die(&format!("write: {e}")));
        gc2.commit_blocking()
            .unwrap_or_else(|e| die(&format!("commit: {e}")));
    });
    report_write(o, &r, &before, &s.stats(), gc.syncs() - syncs0, "");
    drop(gc);
    if let Ok(s) = Arc::try_unwrap(s) {
        let _ = s.close();
    }
}

fn bench_read(o: &Opts, sequential: bool) {
    let s = Arc::new(fresh_store(o));
    prefill(&s, o);
    if o.ring {
        let r = run_ring(o, &s, sequential);
        report(
            o,
            &r,
            &format!(",\"fill\":\"{}\",\"driver\":\"ring\"", o.fill),
        );
        return;
    }
    let blocks = o.span / o.bs;
    let next = Arc::new(AtomicU64::new(0));
    let bs = o.bs as usize;
    let s2 = s.clone();
    let r = run(o, move |_, rng| {
        let i = if sequential {
            next.fetch_add(1, Ordering::Relaxed) % blocks
        } else {
            rng.below(blocks)
        };
        let mut buf = vec![0u8; bs];
        s2.read(COMP, i * bs as u64, &mut buf)
            .unwrap_or_else(|e| die(&format!("read: {e}")));
    });
    report(o, &r, &format!(",\"fill\":\"{}\"", o.fill));
}

/// One read of the ring driver: its buffer, and its plan while the device
/// reads are in flight.
struct RingSlot {
    offset: u64,
    /// The answer to come (the store allocates it only when some block
    /// is not read from the device), with the plan.
    answer: Option<shoal_store::ReadAnswer>,
    plan: Option<shoal_store::ReadPlan>,
    /// Device reads not yet completed, and whether one failed or came
    /// back short.
    left: usize,
    failed: bool,
    t0: Instant,
}

/// Checks a ring read that is in and answers it, as the node does; a bad
/// block or a failed device read ends the benchmark.
fn finish_slot(
    s: &LogStore,
    sl: &mut RingSlot,
    plan: shoal_store::ReadPlan,
    read: std::io::Result<()>,
) {
    let Some(answer) = sl.answer.take() else {
        die("a finished read without its answer")
    };
    if let Err(e) = s.finish_read(plan, read, answer) {
        die(&format!("read: {e}"));
    }
}

/// Reads handed to the kernel one `io_uring_enter` each (the default), or,
/// with `RING_BURST` set, all that are ready in one (for measuring).
static SUBMIT_EACH: std::sync::LazyLock<bool> =
    std::sync::LazyLock::new(|| std::env::var("RING_BURST").is_err());

/// `--driver ring`: one thread keeps `qd` reads in flight on an io_uring,
/// the node's way (plan, ring, finish per read).
fn run_ring(o: &Opts, s: &LogStore, sequential: bool) -> Result_ {
    use io_uring::{opcode, types, IoUring};
    let Some((fd, _direct)) = s.ring_fd() else {
        die("--driver ring: the store's device cannot be read on a ring")
    };
    let mut ring = IoUring::new(256).unwrap_or_else(|e| die(&format!("io_uring: {e}")));
    let blocks = o.span / o.bs;
    let bs = o.bs as usize;
    let mut rng = SimRng::new(0x5eed);
    let mut next = 0u64;
    let mut slots: Vec<RingSlot> = (0..o.qd)
        .map(|_| RingSlot {
            offset: 0,
            answer: None,
            plan: None,
            left: 0,
            failed: false,
            t0: Instant::now(),
        })
        .collect();
    let start = Instant::now();
    let ramp = Duration::from_secs_f64(o.ramp);
    let end = ramp + Duration::from_secs_f64(o.runtime);
    let mut lat = Lat::default();
    let mut ops = 0u64;
    let mut measured_from: Option<Instant> = None;
    // Slots to (re)start; every slot starts once.
    let mut free: Vec<usize> = (0..o.qd).collect();
    loop {
        let now = start.elapsed();
        if now >= end {
            break;
        }
        if now >= ramp && measured_from.is_none() {
            measured_from = Some(Instant::now());
        }
        while let Some(i) = free.pop() {
            let sl = &mut slots[i];
            let b = if sequential {
                next += 1;
                (next - 1) % blocks
            } else {
                rng.below(blocks)
            };
            sl.offset = b * o.bs;
            sl.t0 = Instant::now();
            let (mut plan, answer) = s.plan_read(COMP, sl.offset, bs);
            sl.answer = Some(answer);
            if plan.device_reads() == 0 {
                // Answered from memory: finish at once, refill next round.
                finish_slot(s, sl, plan, Ok(()));
                if measured_from.is_some() {
                    ops += 1;
                    lat.add(sl.t0.elapsed());
                }
                free.push(i);
                continue;
            }
            let parts = plan.raw_parts();
            sl.left = parts.len();
            sl.failed = false;
            for (k, (off, ptr, len)) in parts.into_iter().enumerate() {
                let e = opcode::Read::new(types::Fd(fd), ptr, len as u32)
                    .offset(off)
                    .build()
                    .user_data(((i as u64) << 16) | ((len as u64) << 32) | k as u64);
                // SAFETY: the buffer is the plan's, kept in this slot until
                // every completion of the plan has been reaped.
                while unsafe { ring.submission().push(&e) }.is_err() {
                    ring.submit()
                        .unwrap_or_else(|e| die(&format!("io_uring submit: {e}")));
                }
            }
            sl.plan = Some(plan);
            // Each read goes to the kernel on its own, as fio's io_uring
            // engine does by default: on the virtual disk measured, reads
            // handed over in bursts (one `io_uring_enter` for many) are
            // slower (fio: 58k IOPS with bursts of 32 against 70k).
            if *SUBMIT_EACH {
                ring.submit()
                    .unwrap_or_else(|e| die(&format!("io_uring submit: {e}")));
            }
        }
        ring.submit_and_wait(1)
            .unwrap_or_else(|e| die(&format!("io_uring submit: {e}")));
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in done {
            let i = ((ud >> 16) & 0xffff) as usize;
            let want = (ud >> 32) as i32;
            let sl = &mut slots[i];
            if res != want {
                sl.failed = true;
            }
            sl.left -= 1;
            if sl.left > 0 {
                continue;
            }
            let Some(plan) = sl.plan.take() else {
                die("a completion for a slot without a plan")
            };
            let read = if sl.failed {
                Err(std::io::Error::other(
                    "device read failed or came back short",
                ))
            } else {
                Ok(())
            };
            finish_slot(s, sl, plan, read);
            if measured_from.is_some() {
                ops += 1;
                lat.add(sl.t0.elapsed());
            }
            free.push(i);
        }
    }
    let secs = measured_from.map_or(0.0, |t| t.elapsed().as_secs_f64());
    // Let the reads in flight land before their buffers go away.
    while slots.iter().any(|s| s.plan.is_some()) {
        ring.submit_and_wait(1)
            .unwrap_or_else(|e| die(&format!("io_uring submit: {e}")));
        let done: Vec<u64> = ring.completion().map(|c| c.user_data()).collect();
        for ud in done {
            let sl = &mut slots[((ud >> 16) & 0xffff) as usize];
            sl.left -= 1;
            if sl.left == 0 {
                sl.plan = None;
            }
        }
    }
    let mut l = lat.0;
    l.sort_unstable();
    Result_ { ops, secs, lat: l }
}

/// The child of `recovery`: writes and dies without closing.
fn recovery_child(o: &Opts) {
    let s = Arc::new(fresh_store(o));
    if o.no_ckpt {
        s.set_checkpoint_interval(u64::MAX);
    }
    let gc = GroupCommit::new(s.clone());
    let total = (o.gib * (1u64 << 30) as f64) as u64 / o.bs;
    let blocks = o.span / o.bs;
    let done = Arc::new(AtomicU64::new(0));
    let t = Instant::now();
    let mut hs = Vec::new();
    for th in 0..o.qd {
        let (s, gc, done) = (s.clone(), gc.clone(), done.clone());
        let bs = o.bs as usize;
        hs.push(std::thread::spawn(move || {
            let mut rng = SimRng::new(th as u64 + 99);
            let mut buf = vec![0x33u8; bs];
            while done.fetch_add(1, Ordering::Relaxed) < total {
                let i = rng.below(blocks);
                buf[..8].copy_from_slice(&i.to_le_bytes());
                s.write(COMP, i * bs as u64, &buf)
                    .unwrap_or_else(|e| die(&format!("write: {e}")));
                gc.commit_blocking()
                    .unwrap_or_else(|e| die(&format!("commit: {e}")));
            }
        }));
    }
    for h in hs {
        let _ = h.join();
    }
    let st = s.stats();
    eprintln!(
        "store_bench: child wrote {} MiB in {:.1}s ({} checkpoints, {} batches); exiting without close",
        (total * o.bs) >> 20,
        t.elapsed().as_secs_f64(),
        st.checkpoints,
        st.batches
    );
    // A kill -9: no close, no destructor, no final checkpoint.
    // SAFETY: _exit ends the process at once; nothing runs after it.
    unsafe { libc::_exit(0) }
}

fn recovery(o: &Opts) {
    let exe = std::env::current_exe().unwrap_or_else(|e| die(&format!("current_exe: {e}")));
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("recovery-child")
        .arg("--file")
        .arg(&o.file)
        .args(["--size", &o.size.to_string()])
        .args(["--span", &o.span.to_string()])
        .args(["--bs", &o.bs.to_string()])
        .args(["--qd", &o.qd.to_string()])
        .args(["--gib", &o.gib.to_string()]);
    if o.no_ckpt {
        cmd.arg("--no-ckpt");
    }
    let st = cmd.status().unwrap_or_else(|e| die(&format!("child: {e}")));
    if !st.success() {
        die(&format!("child failed: {st}"));
    }
    drop_caches();
    let t = Instant::now();
    let s = LogStore::open(Path::new(&o.file)).unwrap_or_else(|e| die(&format!("open: {e}")));
    let secs = t.elapsed().as_secs_f64();
    let rs = s.stats();
    let replayed = rs.replayed_blocks as f64 * 4096.0 / (1u64 << 30) as f64;
    println!(
        "{{\"mode\":\"recovery\",\"written_gib\":{:.2},\"no_ckpt\":{},\"open_s\":{:.3},\"replayed_gib\":{:.3},\"replayed_batches\":{},\"s_per_gib_replayed\":{:.3}}}",
        o.gib,
        o.no_ckpt,
        secs,
        replayed,
        rs.replayed_batches,
        if replayed > 0.0 { secs / replayed } else { 0.0 }
    );
    let _ = s.close();
}

/// Best effort: the store uses O_DIRECT anyway.
fn drop_caches() {
    let _ = std::fs::write("/proc/sys/vm/drop_caches", "1");
}

fn main() {
    let o = parse();
    if o.ring && !o.mode.ends_with("read") {
        die("--driver ring is for the read modes");
    }
    if o.pipeline && !o.mode.ends_with("write") {
        die("--driver pipeline is for the write modes");
    }
    match o.mode.as_str() {
        "randwrite" => bench_write(&o, false),
        "seqwrite" => bench_write(&o, true),
        "randread" => bench_read(&o, false),
        "seqread" => bench_read(&o, true),
        "recovery" => recovery(&o),
        "recovery-child" => recovery_child(&o),
        m => die(&format!("unknown mode {m}")),
    }
}
