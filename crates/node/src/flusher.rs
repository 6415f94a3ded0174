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
    /// A sync is running (on the flusher thread or inline).
    syncing: bool,
    /// The flusher thread should exit.
    exit: bool,
    /// The flusher thread is waiting for tickets: only then does a new
    /// ticket notify it (a notify is a system call even with nobody
    /// waiting, once per write at high queue depth).
    idle: bool,
    /// Writes accepted and not yet applied and ticketed ([`Applying`]).
    applying: usize,
    /// The flusher thread waits for `applying` to reach 0 before it syncs.
    gathering: bool,
}

/// Longest wait of the flusher for writes that arrived with the ones it is
/// about to sync (already accepted, still being applied), in
/// microseconds: a burst of writes read from one connection is applied
/// within a few microseconds, and a sync that waits for it covers it all
/// instead of the first one or two.
const GATHER_US: u64 = 100;

/// [`GATHER_US`], or `SHOAL_GATHER_US` (0: no waiting; for measuring).
static GATHER: std::sync::LazyLock<u64> = std::sync::LazyLock::new(|| {
    std::env::var("SHOAL_GATHER_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(GATHER_US)
});

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
    tickets: Mutex<Tickets>,
    wake: Condvar,
    durable: watch::Sender<Durable>,
    syncs: AtomicU64,
    inline_syncs: AtomicU64,
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
            self.wake.notify_one();
        }
    }

    /// Syncs for every ticket up to `target` (taken before this call) and
    /// publishes the outcome. Called with `syncing` set by the caller.
    fn sync_upto(&self, store: &LogStore, target: u64) {
        let r = store.sync();
        self.syncs.fetch_add(1, Ordering::Relaxed);
        {
            let mut t = self.lock();
            assert!(t.syncing, "sync without the syncing flag");
            assert!(target > t.done, "durable point moved back");
            t.done = target;
            t.syncing = false;
            if t.issued > t.done && t.idle {
                // Tickets taken during this inline sync: the thread covers
                // them.
                self.wake.notify_one();
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
    /// Starts the flusher thread of `store`.
    pub fn start(store: Arc<LogStore>, name: &str) -> io::Result<Flusher> {
        let shared = Arc::new(Shared {
            tickets: Mutex::new(Tickets::default()),
            wake: Condvar::new(),
            durable: watch::channel(Durable::default()).0,
            syncs: AtomicU64::new(0),
            inline_syncs: AtomicU64::new(0),
        });
        let (sh, st) = (shared.clone(), store.clone());
        std::thread::Builder::new()
            .name(format!("flush-{name}"))
            .spawn(move || run(&sh, &st))?;
        Ok(Flusher { shared, store })
    }

    /// Waits until everything written to the store before this call is
    /// durable.
    pub async fn commit(&self) -> Result<(), StoreError> {
        self.commit_or_sync(false, None).await
    }

    /// Declares a write accepted (in arrival order, before it is applied):
    /// a sync about to start waits up to [`GATHER_US`] for it.
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
        let (ticket, inline, notify) = {
            let mut t = self.shared.lock();
            if let Some(mut a) = applying {
                a.live = false;
                self.shared.applied(&mut t);
            }
            t.issued += 1;
            let inline = quiet && !t.syncing && t.done + 1 == t.issued;
            if inline {
                t.syncing = true;
            }
            // A busy flusher looks for new tickets when its sync ends.
            (t.issued, inline, !inline && t.idle)
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

    /// Syncs run on a committer's own thread.
    pub fn inline_syncs(&self) -> u64 {
        self.shared.inline_syncs.load(Ordering::Relaxed)
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.shared.lock().exit = true;
        self.shared.wake.notify_one();
    }
}

fn run(sh: &Shared, store: &LogStore) {
    loop {
        let target = {
            let mut t = sh.lock();
            while (t.issued == t.done || t.syncing) && !t.exit {
                t.idle = true;
                t = sh.wake.wait(t).unwrap_or_else(|e| e.into_inner());
                t.idle = false;
            }
            if t.exit && (t.issued == t.done || t.syncing) {
                return;
            }
            // Writes accepted with these are still being applied: give
            // them a moment to join this sync.
            if t.applying > 0 && !t.exit && *GATHER > 0 {
                let until = Instant::now() + Duration::from_micros(*GATHER);
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
            if t.syncing {
                // An inline sync started meanwhile: it covers these.
                continue;
            }
            t.syncing = true;
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

    /// A store on a 64 MiB file with component 1, and its flusher.
    fn setup() -> (tempfile::TempDir, Arc<LogStore>, Arc<Flusher>) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(LogStore::create(&dir.path().join("dev.img"), 64 << 20, "t").unwrap());
        store.create_component(1, 1, 16 << 20).unwrap();
        let f = Arc::new(Flusher::start(store.clone(), "t").unwrap());
        (dir, store, f)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_share_syncs_and_see_their_writes_durable() {
        let (dir, store, f) = setup();
        let p = dir.path().join("dev.img");
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
        drop(f);
        // Everything committed survives a crash (no close: reopen the
        // device as it is on disk).
        let image = std::fs::read(&p).unwrap();
        drop(store);
        std::fs::write(&p, &image).unwrap();
        let s = LogStore::open(&p).unwrap();
        for i in 0..64u64 {
            let mut b = [0u8; 4096];
            s.read(1, i * 4096, &mut b).unwrap();
            assert_eq!(b, [i as u8 + 1; 4096]);
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn quiet_commits_sync_inline_and_mix_with_the_thread() {
        let (dir, store, f) = setup();
        let p = dir.path().join("dev.img");
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
        drop(f);
        let image = std::fs::read(&p).unwrap();
        drop(store);
        std::fs::write(&p, &image).unwrap();
        let s = LogStore::open(&p).unwrap();
        let mut b = [0u8; 4096];
        s.read(1, 0, &mut b).unwrap();
        assert_eq!(b, [9u8; 4096]);
        for i in 1..64u64 {
            s.read(1, i * 4096, &mut b).unwrap();
            assert_eq!(b, [i as u8 + 1; 4096]);
        }
    }
}
