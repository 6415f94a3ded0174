//! Group commit on a thread of its own, with asynchronous waiters.
//!
//! One flusher thread per device makes writes durable (`LogStore::sync`:
//! write the open batch, flush the device). A writer takes a *ticket* after
//! its write is in the store, and awaits it on the async runtime: no
//! blocking thread is held per waiting write, and one sync covers every
//! ticket taken before it started. At high queue depth this replaces one
//! thread wake-up per write with one per sync.
//!
//! When the node is quiet (the caller says so: its request is the only one
//! in flight) and no sync is running, [`Flusher::commit_or_sync`] syncs on
//! the caller's own thread instead: a lone write then pays no hand-off to
//! the flusher thread and back, two wake-ups that cost more than the
//! flush itself on a virtual machine. Blocking the async worker is harmless
//! then: nothing else is waiting for it, and whatever arrives meanwhile
//! would have waited for this sync anyway.
//!
//! Owns only the durability counters of its device; never touches the
//! store's contents.

use shoal_store::{LogStore, StoreError, SyncFailure};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What is durable, as the flusher publishes it.
#[derive(Debug, Clone, Default)]
struct Durable {
    /// Every ticket up to this one is durable.
    upto: u64,
    /// The last failed sync.
    failed: Option<SyncFailure>,
}

/// Tickets and who is syncing, under one lock.
#[derive(Debug, Default)]
struct Tickets {
    /// Last ticket handed out.
    issued: u64,
    /// Every ticket up to this one is covered by a finished sync.
    done: u64,
    /// Every ticket up to this one is covered by a sync that started.
    started: u64,
    /// Syncs running (on the flusher threads or inline), at most
    /// [`crate::NodeTuning::sync_threads`].
    syncing: usize,
    /// The flusher threads should exit.
    exit: bool,
    /// Flusher threads waiting for tickets: only then does a new ticket
    /// notify one (a notify is a system call even with nobody waiting,
    /// once per write at high queue depth).
    idle: usize,
    /// Notifications sent to idle flusher threads that they have not yet
    /// woken up for. A thread takes a while to run after its notification,
    /// and the writes that arrive meanwhile must not notify again: each
    /// would be another system call for nothing.
    woken: usize,
    /// Writes accepted and not yet applied and ticketed ([`Applying`]).
    applying: usize,
    /// A flusher thread waits for `applying` to reach 0 before it syncs.
    gathering: bool,
}

/// A write accepted by the node and not yet in its device's store: the
/// flusher's next sync waits a little for it. Released when its commit
/// takes a ticket, or when dropped (the write failed).
pub struct Applying {
    shared: Arc<Shared>,
    live: bool,
}

impl Drop for Applying {
    fn drop(&mut self) {
        if self.live {
            self.shared.applied(&mut self.shared.lock());
        }
    }
}

struct Shared {
    /// Syncs that may run at once (flusher threads).
    at_once: usize,
    /// Longest wait of a sync for writes still being applied, in
    /// microseconds ([`crate::NodeTuning::gather_us`]).
    gather_us: u64,
    tickets: Mutex<Tickets>,
    wake: Condvar,
    durable: watch::Sender<Durable>,
    syncs: AtomicU64,
    inline_syncs: AtomicU64,
    /// Time spent in syncs (device writes and flushes), in microseconds.
    sync_micros: AtomicU64,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Tickets> {
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One accepted write is applied (or failed): the flusher stops waiting
    /// once none is left.
    fn applied(&self, t: &mut Tickets) {
        assert!(t.applying > 0, "more writes applied than accepted");
        t.applying -= 1;
        if t.applying == 0 && t.gathering {
            // All: with several flusher threads, an idle one could take a
            // single notification meant for the gathering one.
            self.wake.notify_all();
        }
    }

    /// Syncs for every ticket up to `target` (taken before this call) and
    /// publishes the outcome. Called with `syncing` counted by the caller.
    fn sync_upto(&self, store: &LogStore, target: u64) {
        let started = Instant::now();
        let r = store.sync();
        self.sync_micros
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.syncs.fetch_add(1, Ordering::Relaxed);
        {
            let mut t = self.lock();
            assert!(t.syncing > 0, "sync not counted as running");
            assert!(target <= t.started, "sync beyond the tickets it took");
            // Syncs running at once may end in any order: each covers the
            // tickets taken before it started.
            t.done = t.done.max(target);
            t.syncing -= 1;
            if t.issued > t.started && t.idle > 0 {
                // Tickets taken during this sync: a thread covers them.
                self.wake.notify_all();
            }
        }
        self.durable.send_modify(|d| match r {
            Ok(()) => d.upto = d.upto.max(target),
            Err(e) => d.failed = Some(SyncFailure::new(target, &e)),
        });
    }
}

/// Handle to a device's flusher thread. Dropping the last handle stops it.
pub struct Flusher {
    shared: Arc<Shared>,
    store: Arc<LogStore>,
}

impl Flusher {
    /// Starts the flusher threads of `store` as `tuning` says.
    pub fn start(
        store: Arc<LogStore>,
        name: &str,
        tuning: &crate::NodeTuning,
    ) -> io::Result<Flusher> {
        Self::with_threads(store, name, tuning.sync_threads, tuning.gather_us)
    }

    /// Starts `threads` flusher threads (1 to 4) for `store`, each waiting
    /// up to `gather_us` for writes being applied.
    pub fn with_threads(
        store: Arc<LogStore>,
        name: &str,
        threads: usize,
        gather_us: u64,
    ) -> io::Result<Flusher> {
        let threads = threads.clamp(1, 4);
        let shared = Arc::new(Shared {
            at_once: threads,
            gather_us,
            tickets: Mutex::new(Tickets::default()),
            wake: Condvar::new(),
            durable: watch::channel(Durable::default()).0,
            syncs: AtomicU64::new(0),
            inline_syncs: AtomicU64::new(0),
            sync_micros: AtomicU64::new(0),
        });
        for i in 0..threads {
            let (sh, st) = (shared.clone(), store.clone());
            let name = match i {
                0 => format!("flush-{name}"),
                _ => format!("flush{i}-{name}"),
            };
            std::thread::Builder::new().name(name).spawn(move || {
                crate::as_batch_thread();
                run(&sh, &st)
            })?;
        }
        Ok(Flusher { shared, store })
    }

    /// Waits until everything written to the store before this call is
    /// durable.
    pub async fn commit(&self) -> Result<(), StoreError> {
        self.commit_or_sync(false, None).await
    }

    /// Declares a write accepted (in arrival order, before it is applied):
    /// a sync about to start waits up to `gather_us` for it.
    pub fn begin(&self) -> Applying {
        self.shared.lock().applying += 1;
        Applying {
            shared: self.shared.clone(),
            live: true,
        }
    }

    /// [`commit`](Self::commit), syncing on this thread if `quiet` (the
    /// caller's request is the only one in flight on the node) and no sync
    /// is running or waited for. `applying` is the write's own
    /// [`begin`](Self::begin), released here.
    pub async fn commit_or_sync(
        &self,
        quiet: bool,
        applying: Option<Applying>,
    ) -> Result<(), StoreError> {
        let ticket = self.ticket(applying);
        self.wait(ticket, quiet).await
    }

    /// Takes a ticket for everything written to the store so far, without
    /// waking the flusher: [`wait`](Self::wait) does that. A writer that
    /// applies its write synchronously as it arrives takes its ticket then,
    /// and waits later, so that a burst of writes applied one after the
    /// other is all ticketed before the flusher starts its sync.
    pub fn ticket(&self, applying: Option<Applying>) -> u64 {
        let mut t = self.shared.lock();
        if let Some(mut a) = applying {
            a.live = false;
            self.shared.applied(&mut t);
        }
        t.issued += 1;
        t.issued
    }

    /// Waits until `ticket` is durable, syncing on this thread if `quiet`
    /// and it is the only ticket no sync covers yet, or waking a flusher
    /// thread if none is looking.
    pub async fn wait(&self, ticket: u64, quiet: bool) -> Result<(), StoreError> {
        let (inline, notify) = {
            let mut t = self.shared.lock();
            assert!(ticket <= t.issued, "a ticket that was never taken");
            let inline = quiet && t.syncing == 0 && t.started + 1 == t.issued && ticket == t.issued;
            if inline {
                t.syncing += 1;
                t.started = t.issued;
            }
            // A busy flusher looks for new tickets when its sync ends.
            let notify = !inline
                && t.started < ticket
                && t.idle > t.woken
                && t.syncing < self.shared.at_once;
            if notify {
                t.woken += 1;
            }
            (inline, notify)
        };
        if inline {
            self.shared.inline_syncs.fetch_add(1, Ordering::Relaxed);
            self.shared.sync_upto(&self.store, ticket);
        } else if notify {
            self.shared.wake.notify_one();
        }
        let mut rx = self.shared.durable.subscribe();
        loop {
            {
                let d = rx.borrow_and_update();
                if let Some(e) = d.failed.as_ref().and_then(|f| f.error_for(ticket, d.upto)) {
                    return Err(e);
                }
                if d.upto >= ticket {
                    return Ok(());
                }
            }
            if rx.changed().await.is_err() {
                return Err(StoreError::Io(io::Error::other("device flusher stopped")));
            }
        }
    }

    /// Syncs issued so far (on the thread and inline).
    pub fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }

    /// Microseconds spent syncing so far: with [`syncs`](Self::syncs), the
    /// mean time a group commit takes, and how busy the device is with them.
    pub fn sync_micros(&self) -> u64 {
        self.shared.sync_micros.load(Ordering::Relaxed)
    }

    /// Syncs run on a committer's own thread.
    pub fn inline_syncs(&self) -> u64 {
        self.shared.inline_syncs.load(Ordering::Relaxed)
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.shared.lock().exit = true;
        self.shared.wake.notify_all();
    }
}

fn run(sh: &Shared, store: &LogStore) {
    let at_once = sh.at_once;
    loop {
        let target = {
            let mut t = sh.lock();
            while (t.issued == t.started || t.syncing >= at_once) && !t.exit {
                t.idle += 1;
                t = sh.wake.wait(t).unwrap_or_else(|e| e.into_inner());
                t.idle -= 1;
                t.woken = t.woken.saturating_sub(1);
            }
            if t.exit && (t.issued == t.started || t.syncing >= at_once) {
                return;
            }
            // Writes accepted with these are still being applied: give
            // them a moment to join this sync.
            if t.applying > 0 && !t.exit && sh.gather_us > 0 {
                let until = Instant::now() + Duration::from_micros(sh.gather_us);
                t.gathering = true;
                while t.applying > 0 {
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    t = sh
                        .wake
                        .wait_timeout(t, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                t.gathering = false;
            }
            if t.issued == t.started || t.syncing >= at_once {
                // Another sync started meanwhile and covers these.
                continue;
            }
            t.syncing += 1;
            t.started = t.issued;
            t.issued
        };
        // Every ticket up to `target` was taken after its write was in the
        // store, and this sync starts after that: it covers them all.
        sh.sync_upto(store, target);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store on a 64 MiB file with component 1, and its flusher with
    /// `threads` threads.
    fn setup_with(threads: usize) -> (tempfile::TempDir, Arc<LogStore>, Arc<Flusher>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LogStore::create(&dir.path().join("dev.img"), 64 << 20, "t").unwrap());
        store.create_component(1, 1, 16 << 20).unwrap();
        let f = Arc::new(
            Flusher::with_threads(
                store.clone(),
                "t",
                threads,
                crate::tuning::GATHER_US_DEFAULT,
            )
            .unwrap(),
        );
        (dir, store, f)
    }

    /// Stops the flusher and reopens the store from its device file as it
    /// is on disk (a crash: no close), then checks that 4 KiB block `i`
    /// holds `value(i)` for every `i` in `blocks`.
    fn after_crash(
        dir: &tempfile::TempDir,
        store: Arc<LogStore>,
        f: Arc<Flusher>,
        blocks: std::ops::Range<u64>,
        value: impl Fn(u64) -> u8,
    ) {
        let p = dir.path().join("dev.img");
        drop(f);
        // The flusher's threads end on their own once told to (its drop
        // does not join them), each dropping its handle on the store: the
        // store (and its lock on the device file) goes with the last.
        let start = std::time::Instant::now();
        while Arc::strong_count(&store) > 1 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "flusher threads linger"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let image = std::fs::read(&p).unwrap();
        drop(store);
        std::fs::write(&p, &image).unwrap();
        let s = LogStore::open(&p).unwrap();
        let mut b = [0u8; 4096];
        for i in blocks {
            s.read(1, i * 4096, &mut b).unwrap();
            assert_eq!(b, [value(i); 4096], "block {i}");
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_share_syncs_and_see_their_writes_durable() {
        for threads in [1, 2] {
            commits_are_durable(threads).await;
        }
    }

    async fn commits_are_durable(threads: usize) {
        let (dir, store, f) = setup_with(threads);
        let mut tasks = Vec::new();
        for i in 0..64u64 {
            let (s, f) = (store.clone(), f.clone());
            tasks.push(tokio::spawn(async move {
                s.write(1, i * 4096, &[i as u8 + 1; 4096]).unwrap();
                f.commit().await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(f.syncs() >= 1 && f.syncs() <= 64, "{}", f.syncs());
        assert_eq!(f.inline_syncs(), 0, "commit() never syncs inline");
        // Everything committed survives a crash.
        after_crash(&dir, store, f, 0..64, |i| i as u8 + 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_ticketed_before_any_wait_shares_one_sync() {
        let (dir, store, f) = setup_with(1);
        while f.shared.lock().idle == 0 {
            // The thread is starting: it looks at the tickets on its own.
            std::thread::sleep(Duration::from_millis(1));
        }
        // Applied and ticketed as they arrive; nobody waits yet, so the
        // idle flusher is not woken.
        let tickets: Vec<u64> = (0..20u64)
            .map(|i| {
                store.write(1, i * 4096, &[i as u8 + 1; 4096]).unwrap();
                f.ticket(None)
            })
            .collect();
        assert_eq!(f.syncs(), 0);
        let waits: Vec<_> = tickets
            .into_iter()
            .map(|t| {
                let f = f.clone();
                tokio::spawn(async move { f.wait(t, false).await })
            })
            .collect();
        for w in waits {
            w.await.unwrap().unwrap();
        }
        assert_eq!(f.syncs(), 1, "one sync for the whole burst");
        after_crash(&dir, store, f, 0..20, |i| i as u8 + 1);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quiet_commits_sync_inline_and_mix_with_the_thread() {
        for threads in [1, 2] {
            quiet_and_busy_commits(threads).await;
        }
    }

    async fn quiet_and_busy_commits(threads: usize) {
        let (dir, store, f) = setup_with(threads);
        while f.shared.lock().idle < threads {
            // The threads are starting: one that has not yet gone idle
            // looks at the tickets on its own and would take this sync.
            std::thread::sleep(Duration::from_millis(1));
        }
        // Alone: the sync runs on this thread.
        store.write(1, 0, &[9u8; 4096]).unwrap();
        f.commit_or_sync(true, None).await.unwrap();
        assert_eq!((f.syncs(), f.inline_syncs()), (1, 1));
        // Quiet and not quiet committers at once: every one returns only
        // once its write is durable, whoever synced.
        let mut tasks = Vec::new();
        for i in 1..64u64 {
            let (s, f) = (store.clone(), f.clone());
            tasks.push(tokio::spawn(async move {
                let a = f.begin();
                s.write(1, i * 4096, &[i as u8 + 1; 4096]).unwrap();
                f.commit_or_sync(i % 2 == 0, (i % 3 != 0).then_some(a))
                    .await
                    .unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(
            f.syncs() > f.inline_syncs(),
            "{} {}",
            f.syncs(),
            f.inline_syncs()
        );
        after_crash(
            &dir,
            store,
            f,
            0..64,
            |i| if i == 0 { 9 } else { i as u8 + 1 },
        );
    }
}
