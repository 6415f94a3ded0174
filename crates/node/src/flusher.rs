//! Group commit on a thread of its own, with asynchronous waiters.
//!
//! One flusher thread per device makes writes durable (`LogStore::sync`:
//! write the open batch, flush the device). A writer takes a *ticket* after
//! its write is in the store, and awaits it on the async runtime: no
//! blocking thread is held per waiting write, and one sync covers every
//! ticket taken before it started. At queue depth 1 this costs the same
//! two thread hand-offs as running the sync on a blocking thread; at high
//! queue depth it replaces one thread wake-up per write with one per sync.
//!
//! Owns only the durability counters of its device; never touches the
//! store's contents.

use shoal_store::{LogStore, StoreError};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use tokio::sync::watch;

/// What is durable, as the flusher publishes it.
#[derive(Debug, Clone, Default)]
struct Durable {
    /// Every ticket up to this one is durable.
    upto: u64,
    /// The last failed sync: tickets up to `.0` get its error.
    failed: Option<(u64, io::ErrorKind, String)>,
}

struct Shared {
    /// Last ticket handed out, and whether the flusher should exit.
    issued: Mutex<(u64, bool)>,
    wake: Condvar,
    durable: watch::Sender<Durable>,
    syncs: AtomicU64,
}

/// Handle to a device's flusher thread. Dropping the last handle stops it.
pub struct Flusher {
    shared: Arc<Shared>,
}

impl Flusher {
    /// Starts the flusher thread of `store`.
    pub fn start(store: Arc<LogStore>, name: &str) -> io::Result<Flusher> {
        let shared = Arc::new(Shared {
            issued: Mutex::new((0, false)),
            wake: Condvar::new(),
            durable: watch::channel(Durable::default()).0,
            syncs: AtomicU64::new(0),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name(format!("flush-{name}"))
            .spawn(move || run(&sh, &store))?;
        Ok(Flusher { shared })
    }

    /// Waits until everything written to the store before this call is
    /// durable.
    pub async fn commit(&self) -> Result<(), StoreError> {
        let ticket = {
            let mut g = self.shared.issued.lock().unwrap_or_else(|e| e.into_inner());
            g.0 += 1;
            g.0
        };
        self.shared.wake.notify_one();
        let mut rx = self.shared.durable.subscribe();
        loop {
            {
                let d = rx.borrow_and_update();
                if let Some((upto, kind, msg)) = &d.failed {
                    if ticket <= *upto && d.upto < ticket {
                        return Err(StoreError::Io(io::Error::new(*kind, msg.clone())));
                    }
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

    /// Syncs issued so far.
    pub fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        if let Ok(mut g) = self.shared.issued.lock() {
            g.1 = true;
        }
        self.shared.wake.notify_one();
    }
}

fn run(sh: &Shared, store: &LogStore) {
    let mut done = 0u64;
    loop {
        let target = {
            let mut g = sh.issued.lock().unwrap_or_else(|e| e.into_inner());
            while g.0 == done && !g.1 {
                g = sh.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            if g.1 && g.0 == done {
                return;
            }
            g.0
        };
        // Every ticket up to `target` was taken after its write was in the
        // store, and this sync starts after that: it covers them all.
        let r = store.sync();
        sh.syncs.fetch_add(1, Ordering::Relaxed);
        assert!(target > done, "durable point moved back");
        done = target;
        sh.durable.send_modify(|d| match r {
            Ok(()) => d.upto = target,
            Err(e) => {
                let (kind, msg) = match &e {
                    StoreError::Io(io) => (io.kind(), io.to_string()),
                    other => (io::ErrorKind::Other, other.to_string()),
                };
                tracing::error!("device sync failed: {msg}");
                d.failed = Some((target, kind, msg));
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_commits_share_syncs_and_see_their_writes_durable() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dev.img");
        let store = Arc::new(LogStore::create(&p, 64 << 20, "t").unwrap());
        store.create_component(1, 1, 16 << 20).unwrap();
        let f = Arc::new(Flusher::start(store.clone(), "t").unwrap());
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
}
