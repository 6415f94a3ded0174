//! Group commit: many writers, one `fdatasync`.

use crate::{DeviceStore, StoreError};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use tokio::sync::oneshot;

type Reply = Result<(), (io::ErrorKind, String)>;

struct State {
    waiters: Vec<oneshot::Sender<Reply>>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    syncs: AtomicU64,
}

/// Batches durability requests: a dedicated thread waits until a request is
/// pending, takes the whole batch, syncs the device once and completes them
/// all. Writes completed before [`commit`](Self::commit) was called are
/// durable when it returns.
pub struct GroupCommit {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl GroupCommit {
    pub fn new(store: Arc<DeviceStore>) -> GroupCommit {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                waiters: Vec::new(),
                stop: false,
            }),
            cv: Condvar::new(),
            syncs: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("shoal-group-commit".into())
            .spawn(move || run(&sh, &store))
            .ok();
        if thread.is_none() {
            tracing::error!("cannot start the group commit thread; commits will fail");
        }
        GroupCommit { shared, thread }
    }

    /// Waits until everything written before this call is durable.
    pub async fn commit(&self) -> Result<(), StoreError> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            if st.stop || self.thread.is_none() {
                return Err(stopped());
            }
            st.waiters.push(tx);
        }
        self.shared.cv.notify_one();
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err((kind, msg))) => Err(StoreError::Io(io::Error::new(kind, msg))),
            Err(_) => Err(stopped()),
        }
    }

    /// Number of syncs issued so far.
    pub fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }
}

fn stopped() -> StoreError {
    StoreError::Io(io::Error::other("group commit thread has stopped"))
}

fn run(sh: &Shared, store: &DeviceStore) {
    loop {
        let batch = {
            let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
            while st.waiters.is_empty() && !st.stop {
                st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if st.waiters.is_empty() {
                return;
            }
            std::mem::take(&mut st.waiters)
        };
        let r: Reply = store.sync().map_err(|e| match e {
            StoreError::Io(e) => (e.kind(), e.to_string()),
            other => (io::ErrorKind::Other, other.to_string()),
        });
        sh.syncs.fetch_add(1, Ordering::Relaxed);
        for tx in batch {
            let _ = tx.send(r.clone());
        }
    }
}

impl Drop for GroupCommit {
    /// Completes the pending batch, then stops the thread.
    fn drop(&mut self) {
        self.shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stop = true;
        self.shared.cv.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
