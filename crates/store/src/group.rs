//! Group commit: many writers, one `fdatasync`.
//!
//! Leader/follower: a committer takes a ticket; if no sync is running it
//! becomes the leader and syncs on its own thread, covering every ticket
//! taken before the sync started; otherwise it waits for the next sync to
//! cover it. No dedicated thread and no hand-off: at queue depth 1 a write
//! and its sync run back to back on the same thread. (Making the leader
//! wait ~150 µs for writes still being applied gave fewer, larger syncs but
//! no more IOPS here: the data path is bound by thread wake-ups, not by
//! flushes.)

use crate::{LogStore, StoreError};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

struct State {
    /// Last ticket handed out.
    issued: u64,
    /// Every ticket up to this one is durable.
    durable: u64,
    syncing: bool,
    /// The last failed sync: tickets up to `.0` get its error.
    failed: Option<(u64, io::ErrorKind, String)>,
}

/// A store whose writes become durable with `sync`.
pub trait Durable: Send + Sync + 'static {
    fn sync(&self) -> Result<(), StoreError>;
}

impl Durable for LogStore {
    fn sync(&self) -> Result<(), StoreError> {
        LogStore::sync(self)
    }
}

struct Shared<S> {
    store: Arc<S>,
    state: Mutex<State>,
    cv: Condvar,
    syncs: AtomicU64,
}

/// Batches durability requests of one device. Writes completed before
/// [`commit`](Self::commit) (or [`commit_blocking`](Self::commit_blocking))
/// was called are durable when it returns.
pub struct GroupCommit<S: Durable = LogStore> {
    shared: Arc<Shared<S>>,
}

impl<S: Durable> Clone for GroupCommit<S> {
    fn clone(&self) -> Self {
        GroupCommit {
            shared: self.shared.clone(),
        }
    }
}

impl<S: Durable> GroupCommit<S> {
    pub fn new(store: Arc<S>) -> GroupCommit<S> {
        GroupCommit {
            shared: Arc::new(Shared {
                store,
                state: Mutex::new(State {
                    issued: 0,
                    durable: 0,
                    syncing: false,
                    failed: None,
                }),
                cv: Condvar::new(),
                syncs: AtomicU64::new(0),
            }),
        }
    }

    /// Blocks until everything written before this call is durable. Call it
    /// from a thread that may block (it may run the sync itself).
    pub fn commit_blocking(&self) -> Result<(), StoreError> {
        let sh = &self.shared;
        let mut st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
        st.issued += 1;
        let ticket = st.issued;
        loop {
            if let Some((upto, kind, msg)) = &st.failed {
                if ticket <= *upto {
                    return Err(StoreError::Io(io::Error::new(*kind, msg.clone())));
                }
            }
            if st.durable >= ticket {
                return Ok(());
            }
            if !st.syncing {
                // Lead: this sync covers every ticket issued so far.
                st.syncing = true;
                let target = st.issued;
                drop(st);
                let r = sh.store.sync();
                sh.syncs.fetch_add(1, Ordering::Relaxed);
                st = sh.state.lock().unwrap_or_else(|e| e.into_inner());
                st.syncing = false;
                match r {
                    Ok(()) => {
                        assert!(target >= st.durable, "durable point moved back");
                        st.durable = target;
                    }
                    Err(e) => {
                        let (kind, msg) = match &e {
                            StoreError::Io(io) => (io.kind(), io.to_string()),
                            other => (io::ErrorKind::Other, other.to_string()),
                        };
                        tracing::error!("device sync failed: {msg}");
                        st.failed = Some((target, kind, msg));
                    }
                }
                sh.cv.notify_all();
                continue;
            }
            st = sh.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Waits until everything written before this call is durable.
    pub async fn commit(&self) -> Result<(), StoreError> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.commit_blocking())
            .await
            .map_err(|e| StoreError::Io(io::Error::other(e.to_string())))?
    }

    /// Number of syncs issued so far.
    pub fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }
}
