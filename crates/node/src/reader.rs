//! Reads of one device: on an io_uring driven by the runtime
//! ([`crate::ring`]) where the device allows it, else batched on threads of
//! their own.
//!
//! On threads, a read request is queued with a oneshot for its answer; a reader thread
//! takes up to a batch of the requests waiting and hands them to
//! `LogStore::read_batch`, which sends all their device reads in one
//! io_uring submission; what it leaves goes to the other thread at once.
//! That is one thread wake-up per batch instead of one blocking thread
//! (and two hand-offs) per read, with two batches at the device at a time.
//!
//! Owns only its queue; the store decides what is read and checks it.

use crate::ring::ReadRing;
use bytes::{Bytes, BytesMut};
use shoal_model::ComponentId;
use shoal_store::{LogStore, ReadReq, StoreError};
use std::io;
use std::sync::{Arc, Condvar, Mutex};
use tokio::sync::oneshot;

struct Job {
    component: ComponentId,
    offset: u64,
    len: usize,
    reply: oneshot::Sender<Result<Bytes, StoreError>>,
}

struct Queue {
    jobs: Vec<Job>,
    stop: bool,
    /// Reader threads waiting for jobs: a new job notifies only if one is
    /// (a notify is a system call even with nobody waiting); busy threads
    /// look at the queue when their batch is done.
    idle: usize,
    /// Notifications sent to idle threads that they have not woken up for
    /// yet: the other reads of a burst, queued before the thread runs,
    /// must not notify again.
    woken: usize,
}

impl Queue {
    /// Whether the caller should notify an idle thread, counting the
    /// notification as on its way. A thread on its way takes the jobs
    /// queued by then, so another is woken only once it has taken them.
    fn wake_one(&mut self) -> bool {
        let wake = self.idle > 0 && self.woken == 0;
        if wake {
            self.woken += 1;
        }
        wake
    }
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Most reads one thread takes at once.
    batch: usize,
}

/// Handle to a device's reads. Dropping it stops its threads or ring.
pub struct Reader {
    mode: Mode,
}

enum Mode {
    Threads(Arc<Shared>),
    Ring {
        ring: ReadRing,
        store: Arc<LogStore>,
    },
}

impl Reader {
    /// Reads of `store`: on a ring if its device has a descriptor for one
    /// and a runtime is running, else on threads.
    pub fn start(
        store: Arc<LogStore>,
        name: &str,
        tuning: &crate::NodeTuning,
    ) -> io::Result<Reader> {
        if let (Some((fd, _)), Ok(_)) = (store.ring_fd(), tokio::runtime::Handle::try_current()) {
            match ReadRing::start(fd, store.clone()) {
                Ok(ring) => {
                    return Ok(Reader {
                        mode: Mode::Ring { ring, store },
                    })
                }
                Err(e) => {
                    tracing::warn!(device = name, error = %e, "no read ring; reader threads")
                }
            }
        }
        Self::start_threads(store, name, tuning)
    }

    /// Reads of `store` on reader threads.
    pub fn start_threads(
        store: Arc<LogStore>,
        name: &str,
        tuning: &crate::NodeTuning,
    ) -> io::Result<Reader> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: Vec::new(),
                stop: false,
                idle: 0,
                woken: 0,
            }),
            wake: Condvar::new(),
            batch: tuning.read_batch.clamp(1, 256),
        });
        for i in 0..tuning.read_threads.clamp(1, 8) {
            let (sh, st) = (shared.clone(), store.clone());
            std::thread::Builder::new()
                .name(format!("read-{name}-{i}"))
                .spawn(move || {
                    crate::as_batch_thread();
                    run(&sh, &st)
                })?;
        }
        Ok(Reader {
            mode: Mode::Threads(shared),
        })
    }

    /// Whether reads go through a ring set up with
    /// `IORING_SETUP_DEFER_TASKRUN` (a runtime of one worker).
    pub fn deferred_ring(&self) -> bool {
        matches!(&self.mode, Mode::Ring { ring, .. } if ring.deferred())
    }

    /// Whether reads go through a ring that has the device registered.
    pub fn registered_ring(&self) -> bool {
        matches!(&self.mode, Mode::Ring { ring, .. } if ring.registered())
    }

    /// Whether reads go through a ring on the runtime.
    pub fn on_ring(&self) -> bool {
        matches!(self.mode, Mode::Ring { .. })
    }

    /// Reads `len` bytes of `component` at `offset`.
    pub async fn read(
        &self,
        component: ComponentId,
        offset: u64,
        len: usize,
    ) -> Result<Bytes, StoreError> {
        let shared = match &self.mode {
            Mode::Threads(sh) => sh,
            Mode::Ring { ring, store } => {
                return read_on_ring(ring, store, component, offset, len).await
            }
        };
        let (tx, rx) = oneshot::channel();
        let notify = {
            let mut q = shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.jobs.push(Job {
                component,
                offset,
                len,
                reply: tx,
            });
            q.wake_one()
        };
        if notify {
            shared.wake.notify_one();
        }
        rx.await
            .unwrap_or_else(|_| Err(StoreError::Io(io::Error::other("device reader stopped"))))
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        // A ring stops by itself when dropped.
        if let Mode::Threads(sh) = &self.mode {
            if let Ok(mut q) = sh.queue.lock() {
                q.stop = true;
            }
            sh.wake.notify_all();
        }
    }
}

/// One read through the ring: located here, read by the kernel, checked
/// here when it is in.
async fn read_on_ring(
    ring: &ReadRing,
    store: &LogStore,
    component: ComponentId,
    offset: u64,
    len: usize,
) -> Result<Bytes, StoreError> {
    if !ring.here() {
        // Not the ring's thread (see `ReadRing::here`): the plain way.
        return read_plain(store, component, offset, len);
    }
    // The answer is the plan's device buffer when the device serves the
    // whole read (no zeroed buffer, no copy).
    let (plan, answer) = store.plan_read(component, offset, len);
    let (plan, read) = if plan.device_reads() == 0 {
        (plan, Ok(()))
    } else {
        let rx = ring.submit(plan).map_err(StoreError::Io)?;
        rx.await
            .map_err(|_| StoreError::Io(io::Error::other("device read ring stopped")))?
    };
    if read
        .as_ref()
        .is_err_and(|e| e.kind() == io::ErrorKind::UnexpectedEof)
    {
        // A short read from the kernel: read it again the plain way.
        drop(plan);
        return read_plain(store, component, offset, len);
    }
    store.finish_read(plan, read, answer)
}

fn read_plain(
    store: &LogStore,
    component: ComponentId,
    offset: u64,
    len: usize,
) -> Result<Bytes, StoreError> {
    let mut buf = BytesMut::zeroed(len);
    store.read(component, offset, &mut buf[..])?;
    Ok(buf.freeze())
}

fn run(sh: &Shared, store: &LogStore) {
    loop {
        let jobs: Vec<Job> = {
            let mut q = sh.queue.lock().unwrap_or_else(|e| e.into_inner());
            while q.jobs.is_empty() && !q.stop {
                q.idle += 1;
                q = sh.wake.wait(q).unwrap_or_else(|e| e.into_inner());
                q.idle -= 1;
                q.woken = q.woken.saturating_sub(1);
            }
            if q.stop && q.jobs.is_empty() {
                return;
            }
            let n = q.jobs.len().min(sh.batch);
            let jobs = q.jobs.drain(..n).collect();
            // More than one batch waiting: hand the rest to an idle thread
            // now rather than after this batch.
            let more = !q.jobs.is_empty() && q.wake_one();
            drop(q);
            if more {
                sh.wake.notify_one();
            }
            jobs
        };
        let mut bufs: Vec<BytesMut> = jobs.iter().map(|j| BytesMut::zeroed(j.len)).collect();
        let results = {
            let mut reqs: Vec<ReadReq<'_>> = jobs
                .iter()
                .zip(bufs.iter_mut())
                .map(|(j, b)| ReadReq {
                    id: j.component,
                    offset: j.offset,
                    buf: &mut b[..],
                })
                .collect();
            store.read_batch(&mut reqs)
        };
        for ((job, buf), r) in jobs.into_iter().zip(bufs).zip(results) {
            let _ = job.reply.send(r.map(|()| buf.freeze()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store whose 64 blocks of 8 KiB at `i * 8192` hold `i + 1`,
    /// reopened so that every read goes to the device (headers included),
    /// plus one unsynced write still in memory.
    fn store(dir: &std::path::Path) -> Arc<LogStore> {
        let p = dir.join("dev.img");
        {
            let store = LogStore::create(&p, 64 << 20, "t").unwrap();
            store.create_component(1, 1, 16 << 20).unwrap();
            for i in 0..64u64 {
                store.write(1, i * 8192, &[i as u8 + 1; 8192]).unwrap();
            }
            store.sync().unwrap();
        }
        let store = Arc::new(LogStore::open(&p).unwrap());
        store.write(1, 64 * 8192, &[65; 8192]).unwrap();
        store
    }

    async fn reads_return_their_own_data(ring: bool) {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let r = if ring {
            Reader::start(store.clone(), "t", &crate::NodeTuning::default()).unwrap()
        } else {
            Reader::start_threads(store.clone(), "t", &crate::NodeTuning::default()).unwrap()
        };
        // The ring is used wherever the device offers it, with the device
        // registered (kernels from 5.1 allow it).
        assert_eq!(r.on_ring(), ring && store.ring_fd().is_some());
        assert_eq!(r.registered_ring(), r.on_ring());
        let r = Arc::new(r);
        let mut tasks = Vec::new();
        for i in 0..65u64 {
            let r = r.clone();
            tasks.push(tokio::spawn(async move {
                let d = r.read(1, i * 8192 + 100, 8000).await.unwrap();
                assert!(d.iter().all(|&b| b == i as u8 + 1), "read {i}");
                // Across two blocks and one unwritten.
                let d = r.read(1, i * 8192 + 4096, 12288).await.unwrap();
                assert!(d[..4096].iter().all(|&b| b == i as u8 + 1), "read {i}");
                assert!(d[4096..].iter().all(|&b| b == i as u8 + 2 || i >= 64));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(matches!(
            r.read(9, 0, 10).await,
            Err(StoreError::NoSuchComponent(9))
        ));
        assert!(matches!(
            r.read(1, 16 << 20, 4096).await,
            Err(StoreError::OutOfRange { .. })
        ));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ring_reads_return_their_own_data() {
        reads_return_their_own_data(true).await;
    }

    /// A runtime of one worker gets a deferred ring (on kernels that
    /// have it): reads spawned on the worker go through it, and a read
    /// from another thread (this test's own, which is not the worker)
    /// is done the plain way, with the same data.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn deferred_ring_reads_return_their_own_data() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let r = Reader::start(store.clone(), "t", &crate::NodeTuning::default()).unwrap();
        if store.ring_fd().is_some() && crate::ring::kernel_at_least(6, 2) {
            assert!(r.deferred_ring(), "one worker, a recent kernel: deferred");
            assert!(
                r.registered_ring(),
                "the device registered with a disabled ring"
            );
        }
        let r = Arc::new(r);
        let before = store.read_counters();
        let mut tasks = Vec::new();
        for i in 0..64u64 {
            let r = r.clone();
            tasks.push(tokio::spawn(async move {
                let d = r.read(1, i * 8192, 8192).await.unwrap();
                assert!(d.iter().all(|&b| b == i as u8 + 1), "read {i}");
            }));
        }
        for t in tasks {
            // A ring that never reaps would hang here: fail instead.
            tokio::time::timeout(std::time::Duration::from_secs(20), t)
                .await
                .expect("a read on the deferred ring never completed")
                .unwrap();
        }
        assert!(
            store.read_counters().0 > before.0,
            "reads went to the device"
        );
        // This thread is not the ring's: the plain way, the same data.
        for i in [0u64, 17, 63] {
            let d = r.read(1, i * 8192, 8192).await.unwrap();
            assert!(
                d.iter().all(|&b| b == i as u8 + 1),
                "read {i} off the worker"
            );
        }
        let d = r.read(1, 64 * 8192, 8192).await.unwrap();
        assert!(d.iter().all(|&b| b == 65), "the block still in memory");
    }

    /// A current-thread runtime: everything runs on the ring's thread.
    #[tokio::test]
    async fn current_thread_ring_reads_return_their_own_data() {
        reads_return_their_own_data(true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn thread_reads_return_their_own_data() {
        reads_return_their_own_data(false).await;
    }

    /// Reads abandoned by their callers while at the kernel (a client
    /// that disconnects) leave the ring working, and a ring dropped with
    /// reads in flight stops without waiting on anyone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abandoned_reads_and_a_dropped_ring() {
        abandoned_reads().await;
    }

    /// The same on a deferred ring (one worker).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn abandoned_reads_and_a_dropped_deferred_ring() {
        abandoned_reads().await;
    }

    async fn abandoned_reads() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path());
        let r = Arc::new(Reader::start(store.clone(), "t", &crate::NodeTuning::default()).unwrap());
        for round in 0..20u64 {
            let tasks: Vec<_> = (0..64u64)
                .map(|i| {
                    let r = r.clone();
                    tokio::spawn(async move { r.read(1, i * 8192, 8192).await })
                })
                .collect();
            // Abandon every other read, some of them surely mid-flight.
            for (i, t) in tasks.iter().enumerate() {
                if (i as u64 + round).is_multiple_of(2) {
                    t.abort();
                }
            }
            for (i, t) in tasks.into_iter().enumerate() {
                if let Ok(d) = t.await {
                    assert!(d.unwrap().iter().all(|&b| b == i as u8 + 1));
                }
            }
        }
        let d = r.read(1, 5 * 8192, 8192).await.unwrap();
        assert!(d.iter().all(|&b| b == 6));
        // Abandon reads at the kernel and drop the reader (its ring) with
        // them in flight: the ring's reaper waits for them, then stops and
        // lets go of the store.
        let tasks: Vec<_> = (0..64u64)
            .map(|i| {
                let r = r.clone();
                tokio::spawn(async move { r.read(1, i * 8192, 8192).await.map(|_| ()) })
            })
            .collect();
        tokio::task::yield_now().await;
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
        drop(r);
        let t0 = std::time::Instant::now();
        while Arc::strong_count(&store) > 1 {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "the ring's reaper did not stop"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }
}
