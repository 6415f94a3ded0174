//! The native engine: pipelined NBD connections, one per volume, each with
//! a writer half (issues requests while a slot is free: T in flight) and a
//! reader half (matches replies to requests by handle and records the
//! latency into the connection's histograms). Histograms are merged when
//! the run ends.
//!
//! Latency is measured from the moment a request is issued or, with a rate
//! limit, from the moment it was *meant* to be issued, so that a stalled
//! server is not hidden by requests that were never sent (coordinated
//! omission).

use crate::hist::Lat;
use crate::nbd;
use anyhow::{bail, Context, Result};
use shoal_nbd::codec::{Command, Request, SimpleReply, SIMPLE_REPLY_LEN};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// One volume (or region of an export) the engine drives.
#[derive(Debug, Clone)]
pub struct Target {
    /// `host:port` of the NBD server.
    pub addr: String,
    pub export: String,
    /// First byte of the working set in the export.
    pub base: u64,
    /// Bytes of the working set.
    pub size: u64,
}

/// What to run on every target.
#[derive(Debug, Clone)]
pub struct Spec {
    pub block_size: u64,
    pub read_pct: u8,
    pub random_pct: u8,
    /// In flight per target.
    pub outstanding: u32,
    pub warmup: Duration,
    pub duration: Duration,
    /// IOPS over all targets.
    pub rate_limit: Option<u64>,
    /// Stop each target after this many I/Os (the fill); `None`: time-based.
    pub ios_per_target: Option<u64>,
}

/// Counters every connection bumps on each completion, for the progress
/// line and the per-second series.
#[derive(Default, Debug)]
pub struct Live {
    pub ios: AtomicU64,
    pub bytes: AtomicU64,
    pub lat_sum_ns: AtomicU64,
    /// Highest latency since the sampler last reset it.
    pub lat_max_ns: AtomicU64,
    pub errors: AtomicU64,
}

/// What a run measured (only completions inside the measured window).
#[derive(Debug, Default, Clone)]
pub struct Outcome {
    pub read: Lat,
    pub write: Lat,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub errors: u64,
    /// First error message, if any.
    pub first_error: Option<String>,
}

impl Outcome {
    pub fn merge(&mut self, o: Outcome) {
        self.read.merge(&o.read);
        self.write.merge(&o.write);
        self.read_bytes += o.read_bytes;
        self.write_bytes += o.write_bytes;
        self.errors += o.errors;
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
    }
}

/// An open connection to one target.
pub struct Conn {
    target: Target,
    read_only: bool,
    rd: OwnedReadHalf,
    wr: OwnedWriteHalf,
}

/// Opens one connection per target, retrying for a while (a new volume
/// may take a moment to be known to every node).
pub async fn connect_all(targets: &[Target]) -> Result<Vec<Conn>> {
    let mut v = Vec::new();
    let opens = targets.iter().map(|t| async move {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match nbd::connect(&t.addr, &t.export).await {
                Ok((s, e)) => {
                    if e.size < t.base + t.size {
                        bail!(
                            "export {:?} at {} has {} bytes, the bench needs {}",
                            t.export,
                            t.addr,
                            e.size,
                            t.base + t.size
                        );
                    }
                    let (rd, wr) = s.into_split();
                    return Ok(Conn {
                        target: t.clone(),
                        read_only: e.flags & shoal_nbd::codec::NBD_FLAG_READ_ONLY != 0,
                        rd,
                        wr,
                    });
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(300)).await,
            }
        }
    });
    for r in futures::future::join_all(opens).await {
        v.push(r?);
    }
    Ok(v)
}

/// Data written by the engine: random bytes of which `zero_pct` percent of
/// every 4 KiB are zeros (compressibility), or all zeros.
pub fn data_pool(len: usize, zero_pct: u8, seed: u64) -> Arc<[u8]> {
    let mut v = vec![0u8; len];
    if zero_pct < 100 {
        let mut r = Rng::new(seed);
        let zeros = 4096 * zero_pct as usize / 100;
        for chunk in v.chunks_mut(4096) {
            let start = zeros.min(chunk.len());
            for b in chunk[start..].chunks_mut(8) {
                let x = r.next_u64().to_le_bytes();
                b.copy_from_slice(&x[..b.len()]);
            }
        }
    }
    v.into()
}

/// xorshift64*: fast, good enough to pick offsets.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// Runs `spec` on every connection. `t0` is the start of the warm-up;
/// completions in `[t0 + warmup, t0 + warmup + duration)` are measured.
pub async fn run(
    conns: Vec<Conn>,
    spec: &Spec,
    pool: Arc<[u8]>,
    t0: Instant,
    live: Arc<Live>,
) -> Result<Outcome> {
    let n = conns.len().max(1) as u64;
    if spec.read_pct < 100 {
        if let Some(c) = conns.iter().find(|c| c.read_only) {
            bail!(
                "export {:?} at {} is read-only",
                c.target.export,
                c.target.addr
            );
        }
    }
    let mut tasks = Vec::new();
    for (i, c) in conns.into_iter().enumerate() {
        let spec = spec.clone();
        let live = live.clone();
        let pool = pool.clone();
        let interval = spec
            .rate_limit
            .map(|r| Duration::from_secs_f64(n as f64 / r.max(1) as f64));
        tasks.push(tokio::spawn(async move {
            let name = c.target.export.clone();
            drive(c, spec, pool, t0, interval, live, i as u64 + 1)
                .await
                .with_context(|| format!("I/O on {name}"))
        }));
    }
    let mut out = Outcome::default();
    let mut failure = None;
    for t in tasks {
        match t.await.context("an I/O task panicked")? {
            Ok(o) => out.merge(o),
            Err(e) => failure = failure.or(Some(e)),
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// How long after the end of a run replies are awaited (longer than a
/// node's own patience with an unavailable volume, 60 s).
const DRAIN: Duration = Duration::from_secs(90);

struct Issued {
    slot: u16,
    start: Instant,
    read: bool,
    len: u32,
}

async fn drive(
    c: Conn,
    spec: Spec,
    pool: Arc<[u8]>,
    t0: Instant,
    interval: Option<Duration>,
    live: Arc<Live>,
    seed: u64,
) -> Result<Outcome> {
    let depth = spec.outstanding.clamp(1, 1024) as usize;
    let (free_tx, free_rx) = mpsc::channel::<u16>(depth);
    for i in 0..depth {
        free_tx.try_send(i as u16).expect("room for every slot");
    }
    let (iss_tx, iss_rx) = mpsc::unbounded_channel::<Issued>();
    let ms = t0 + spec.warmup;
    let me = ms + spec.duration;
    let reader = tokio::spawn(reader(
        c.rd,
        iss_rx,
        free_tx,
        depth,
        (ms, me),
        spec.block_size,
        live,
    ));
    let mut wr = BufWriter::with_capacity(256 * 1024, c.wr);
    let w = writer(
        &mut wr, free_rx, iss_tx, &spec, &c.target, &pool, t0, me, interval, seed,
    )
    .await;
    let r = reader.await.context("reader task panicked")?;
    // A writer error usually shows up on the reader too; report the first cause.
    w?;
    let out = r?;
    let disc = Request {
        flags: 0,
        command: Command::Disc,
        handle: u64::MAX,
        offset: 0,
        len: 0,
    };
    let _ = wr.write_all(&disc.encode()).await;
    let _ = wr.flush().await;
    let _ = wr.shutdown().await;
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
async fn writer(
    w: &mut BufWriter<OwnedWriteHalf>,
    mut free_rx: mpsc::Receiver<u16>,
    iss_tx: mpsc::UnboundedSender<Issued>,
    spec: &Spec,
    t: &Target,
    pool: &[u8],
    t0: Instant,
    end: Instant,
    interval: Option<Duration>,
    seed: u64,
) -> Result<()> {
    let bs = spec.block_size;
    let blocks = (t.size / bs).max(1);
    let mut rng = Rng::new(seed);
    let pool_blocks = ((pool.len() as u64).saturating_sub(bs) / 4096).max(1);
    let mut cursor = 0u64;
    let mut k = 0u64;
    loop {
        if spec.ios_per_target.is_some_and(|n| k >= n) {
            break;
        }
        let mut intended = interval.map(|iv| t0 + iv.mul_f64(k as f64));
        k += 1;
        if let Some(at) = intended {
            if at >= end {
                break;
            }
            if at > Instant::now() {
                w.flush().await?;
                tokio::time::sleep_until(at).await;
                // The timer wakes up to a millisecond late: that is the
                // generator's delay, not the server's. Time spent behind
                // schedule (no sleep) or waiting for a slot still counts.
                intended = Some(Instant::now().max(at));
            }
        }
        let slot = match free_rx.try_recv() {
            Ok(s) => s,
            Err(_) => {
                w.flush().await?;
                match free_rx.recv().await {
                    Some(s) => s,
                    None => break,
                }
            }
        };
        let now = Instant::now();
        if now >= end {
            break;
        }
        let read =
            spec.read_pct >= 100 || (spec.read_pct > 0 && rng.below(100) < spec.read_pct as u64);
        let random = spec.random_pct >= 100
            || (spec.random_pct > 0 && rng.below(100) < spec.random_pct as u64);
        let off = if random {
            let o = rng.below(blocks) * bs;
            cursor = (o + bs) % (blocks * bs);
            o
        } else {
            let o = cursor;
            cursor = (cursor + bs) % (blocks * bs);
            o
        };
        let len = bs.min(t.size) as u32;
        if iss_tx
            .send(Issued {
                slot,
                start: intended.unwrap_or(now),
                read,
                len,
            })
            .is_err()
        {
            // The reader stopped: it has the error.
            break;
        }
        let req = Request {
            flags: 0,
            command: if read { Command::Read } else { Command::Write },
            handle: slot as u64,
            offset: t.base + off,
            len,
        };
        w.write_all(&req.encode()).await?;
        if !read {
            let p = (rng.below(pool_blocks) * 4096) as usize;
            w.write_all(&pool[p..p + len as usize]).await?;
        }
    }
    w.flush().await?;
    Ok(())
}

async fn reader(
    rd: OwnedReadHalf,
    mut iss_rx: mpsc::UnboundedReceiver<Issued>,
    free_tx: mpsc::Sender<u16>,
    depth: usize,
    (ms, me): (Instant, Instant),
    bs: u64,
    live: Arc<Live>,
) -> Result<Outcome> {
    let mut rd = BufReader::with_capacity(256 * 1024, rd);
    let mut slots: Vec<Option<Issued>> = (0..depth).map(|_| None).collect();
    let mut outstanding = 0usize;
    let mut closed = false;
    let mut buf = vec![0u8; bs as usize];
    let mut out = Outcome::default();
    loop {
        loop {
            match iss_rx.try_recv() {
                Ok(i) => {
                    let s = i.slot as usize;
                    slots[s] = Some(i);
                    outstanding += 1;
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        if outstanding == 0 {
            if closed {
                break;
            }
            match iss_rx.recv().await {
                Some(i) => {
                    let s = i.slot as usize;
                    slots[s] = Some(i);
                    outstanding += 1;
                }
                None => closed = true,
            }
            continue;
        }
        let mut h = [0u8; SIMPLE_REPLY_LEN];
        match tokio::time::timeout_at(me + DRAIN, rd.read_exact(&mut h)).await {
            Ok(r) => {
                r.with_context(|| {
                    format!(
                        "the server closed the connection with {outstanding} requests in flight"
                    )
                })?;
            }
            Err(_) => {
                // Give up on a server that does not answer; the writer
                // stops when the slots channel closes.
                out.errors += outstanding as u64;
                live.errors.fetch_add(outstanding as u64, Relaxed);
                out.first_error.get_or_insert(format!(
                    "{outstanding} requests unanswered {} s after the end of the run",
                    DRAIN.as_secs()
                ));
                break;
            }
        }
        let reply = SimpleReply::decode(&h).context("bad reply from the server")?;
        let slot = reply.handle as usize;
        if slot >= depth {
            bail!("reply with unknown handle {}", reply.handle);
        }
        while slots[slot].is_none() {
            match iss_rx.recv().await {
                Some(i) => {
                    let s = i.slot as usize;
                    slots[s] = Some(i);
                    outstanding += 1;
                }
                None => bail!("reply with handle {} for no request", reply.handle),
            }
        }
        let rec = slots[slot].take().expect("filled above");
        outstanding -= 1;
        if reply.error == 0 && rec.read {
            rd.read_exact(&mut buf[..rec.len as usize]).await?;
        }
        let now = Instant::now();
        let ns = now.saturating_duration_since(rec.start).as_nanos() as u64;
        if reply.error != 0 {
            out.errors += 1;
            live.errors.fetch_add(1, Relaxed);
            if out.first_error.is_none() {
                out.first_error = Some(format!(
                    "{} of {} bytes failed with NBD error {}",
                    if rec.read { "read" } else { "write" },
                    rec.len,
                    reply.error
                ));
            }
        } else {
            live.ios.fetch_add(1, Relaxed);
            live.bytes.fetch_add(rec.len as u64, Relaxed);
            live.lat_sum_ns.fetch_add(ns, Relaxed);
            live.lat_max_ns.fetch_max(ns, Relaxed);
            if now >= ms && now < me {
                if rec.read {
                    out.read.record(ns);
                    out.read_bytes += rec.len as u64;
                } else {
                    out.write.record(ns);
                    out.write_bytes += rec.len as u64;
                }
            }
        }
        let _ = free_tx.try_send(slot as u16);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_below_is_in_range_and_spread() {
        let mut r = Rng::new(7);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            let x = r.below(10);
            assert!(x < 10);
            seen[x as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800 && c < 1200), "{seen:?}");
    }

    async fn mem_server(size: usize) -> (String, Arc<shoal_nbd::mem::MemDisk>) {
        let mut e = shoal_nbd::mem::MemExports::new();
        let disk = e.add("m", size);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(shoal_nbd::serve(
            l,
            Arc::new(e),
            std::future::pending(),
            shoal_nbd::NbdTls::Off,
        ));
        (addr, disk)
    }

    fn spec(read: u8, qd: u32, ms: u64) -> Spec {
        Spec {
            block_size: 4096,
            read_pct: read,
            random_pct: 100,
            outstanding: qd,
            warmup: Duration::from_millis(100),
            duration: Duration::from_millis(ms),
            rate_limit: None,
            ios_per_target: None,
        }
    }

    #[tokio::test]
    async fn drives_an_nbd_server() {
        const MIB: u64 = 1 << 20;
        let (addr, disk) = mem_server(8 << 20).await;
        let targets: Vec<Target> = (0..2)
            .map(|i| Target {
                addr: addr.clone(),
                export: "m".into(),
                base: i * 4 * MIB,
                size: 4 * MIB,
            })
            .collect();
        // The fill writes every byte of both regions, and nothing else.
        let fill = Spec {
            block_size: MIB,
            read_pct: 0,
            random_pct: 0,
            outstanding: 2,
            warmup: Duration::ZERO,
            duration: Duration::from_secs(60),
            rate_limit: None,
            ios_per_target: Some(4),
        };
        let pool = data_pool(4 * MIB as usize, 0, 1);
        let live = Arc::new(Live::default());
        let conns = connect_all(&targets).await.unwrap();
        let o = run(conns, &fill, pool.clone(), Instant::now(), live.clone())
            .await
            .unwrap();
        assert_eq!((o.write.count(), o.write_bytes, o.errors), (8, 8 * MIB, 0));
        let snap = disk.snapshot();
        for mib in snap.chunks(MIB as usize) {
            assert!(
                mib.iter().filter(|&&b| b == 0).count() < 20_000,
                "a MiB was not written"
            );
        }

        // A mixed, time-based run: both directions measured, no errors.
        let live = Arc::new(Live::default());
        let conns = connect_all(&targets).await.unwrap();
        let o = run(
            conns,
            &spec(50, 8, 300),
            pool.clone(),
            Instant::now(),
            live.clone(),
        )
        .await
        .unwrap();
        assert_eq!(o.errors, 0, "{:?}", o.first_error);
        assert!(o.read.count() > 10 && o.write.count() > 10, "{o:?}");
        assert_eq!(o.read_bytes, o.read.count() * 4096);
        assert!(live.ios.load(Relaxed) >= o.read.count() + o.write.count());
        let s = o.read.summary();
        assert!(s.p50_us > 0.0 && s.p50_us <= s.p99_us && s.p99_us <= s.max_us);

        // Rate-limited: about rate x seconds I/Os, whatever the depth.
        let mut sp = spec(100, 16, 500);
        sp.rate_limit = Some(400);
        let conns = connect_all(&targets).await.unwrap();
        let o = run(conns, &sp, pool, Instant::now(), Arc::new(Live::default()))
            .await
            .unwrap();
        let n = o.read.count();
        assert!((140..=260).contains(&n), "{n} I/Os at 400 IOPS for 0.5 s");
    }

    #[tokio::test]
    async fn refuses_a_too_small_export() {
        let (addr, _disk) = mem_server(1 << 20).await;
        let t = Target {
            addr,
            export: "m".into(),
            base: 0,
            size: 2 << 20,
        };
        let e = connect_all(&[t])
            .await
            .err()
            .expect("too small")
            .to_string();
        assert!(e.contains("bytes"), "{e}");
    }

    #[test]
    fn data_pool_compressibility() {
        let p = data_pool(64 * 1024, 50, 1);
        let zeros = p.iter().filter(|&&b| b == 0).count();
        // half of every 4 KiB is zeros, the rest almost never
        assert!((32 * 1024..33 * 1024).contains(&zeros), "{zeros}");
        assert!(data_pool(8192, 100, 1).iter().all(|&b| b == 0));
        let p = data_pool(8192, 0, 1);
        assert!(p.iter().filter(|&&b| b == 0).count() < 100);
    }
}
