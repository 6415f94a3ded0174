//! Persistence of the Raft log, vote, committed index and state-machine
//! snapshot in one redb file, and the in-memory state machine.
//!
//! Every write is one redb write transaction with the default durability
//! (fsync on commit): an append is acknowledged to Raft only after its
//! transaction is durable. The state machine itself lives in memory and is
//! rebuilt at start from the last snapshot plus replay of committed entries
//! (openraft replays them because the committed index is persisted).

use crate::state::{ClusterState, StateError};
use crate::{DirectoryError, TypeConfig};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, Entry, EntryPayload, LogId, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};
use redb::{Database, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use shoal_model::NodeId;
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::RangeBounds;
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

const KEY_VOTE: &str = "vote";
const KEY_COMMITTED: &str = "committed";
const KEY_PURGED: &str = "last_purged";
const KEY_SNAPSHOT_META: &str = "snapshot_meta";
const KEY_SNAPSHOT_DATA: &str = "snapshot_data";

type SErr = StorageError<NodeId>;

fn read_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::read(AnyError::error(e)).into()
}

fn write_err(e: impl std::fmt::Display) -> SErr {
    StorageIOError::write(AnyError::error(e)).into()
}

/// Opens (or creates) the redb file. Retries for a few seconds while a
/// previous instance in this process still holds the file lock.
pub(crate) fn open_db(path: &Path) -> Result<Arc<Database>, DirectoryError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let db = loop {
        match Database::create(path) {
            Ok(db) => break db,
            Err(redb::DatabaseError::DatabaseAlreadyOpen) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => {
                return Err(DirectoryError::Storage(format!(
                    "cannot open {}: {e}",
                    path.display()
                )))
            }
        }
    };
    let tx = db.begin_write().map_err(storage)?;
    tx.open_table(LOGS).map_err(storage)?;
    tx.open_table(META).map_err(storage)?;
    tx.commit().map_err(storage)?;
    Ok(Arc::new(db))
}

fn storage(e: impl std::fmt::Display) -> DirectoryError {
    DirectoryError::Storage(e.to_string())
}

fn meta_get<T: for<'de> Deserialize<'de>>(db: &Database, key: &str) -> Result<Option<T>, String> {
    let tx = db.begin_read().map_err(|e| e.to_string())?;
    let t = tx.open_table(META).map_err(|e| e.to_string())?;
    match t.get(key).map_err(|e| e.to_string())? {
        None => Ok(None),
        Some(v) => serde_json::from_slice(v.value())
            .map(Some)
            .map_err(|e| e.to_string()),
    }
}

fn meta_put<T: Serialize>(
    db: &Database,
    key: &str,
    value: &T,
    durability: redb::Durability,
) -> Result<(), String> {
    let bytes = serde_json::to_vec(value).map_err(|e| e.to_string())?;
    let mut tx = db.begin_write().map_err(|e| e.to_string())?;
    tx.set_durability(durability);
    {
        let mut t = tx.open_table(META).map_err(|e| e.to_string())?;
        t.insert(key, bytes.as_slice()).map_err(|e| e.to_string())?;
    }
    tx.commit().map_err(|e| e.to_string())
}

/// Stores a snapshot's metadata (JSON) and bytes (raw) in one transaction.
fn put_snapshot(db: &Database, s: &StoredSnapshot) -> Result<(), String> {
    let meta = serde_json::to_vec(&s.meta).map_err(|e| e.to_string())?;
    let tx = db.begin_write().map_err(|e| e.to_string())?;
    {
        let mut t = tx.open_table(META).map_err(|e| e.to_string())?;
        t.insert(KEY_SNAPSHOT_META, meta.as_slice())
            .map_err(|e| e.to_string())?;
        t.insert(KEY_SNAPSHOT_DATA, s.data.as_slice())
            .map_err(|e| e.to_string())?;
    }
    tx.commit().map_err(|e| e.to_string())
}

fn get_snapshot(db: &Database) -> Result<Option<StoredSnapshot>, String> {
    let tx = db.begin_read().map_err(|e| e.to_string())?;
    let t = tx.open_table(META).map_err(|e| e.to_string())?;
    let meta = match t.get(KEY_SNAPSHOT_META).map_err(|e| e.to_string())? {
        None => return Ok(None),
        Some(v) => serde_json::from_slice(v.value()).map_err(|e| e.to_string())?,
    };
    let data = match t.get(KEY_SNAPSHOT_DATA).map_err(|e| e.to_string())? {
        None => return Err("snapshot metadata without data".into()),
        Some(v) => v.value().to_vec(),
    };
    Ok(Some(StoredSnapshot { meta, data }))
}

// ---------------------------------------------------------------- log store

/// The Raft log, vote and committed index. Cheap to clone (it is its own
/// log reader).
#[derive(Clone)]
pub(crate) struct LogStore {
    db: Arc<Database>,
}

impl LogStore {
    pub(crate) fn new(db: Arc<Database>) -> Self {
        LogStore { db }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, SErr> {
        let tx = self.db.begin_read().map_err(read_err)?;
        let t = tx.open_table(LOGS).map_err(read_err)?;
        let mut out = Vec::new();
        for item in t.range(range).map_err(read_err)? {
            let (_, v) = item.map_err(read_err)?;
            out.push(serde_json::from_slice(v.value()).map_err(read_err)?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, SErr> {
        let last_purged: Option<LogId<NodeId>> =
            meta_get(&self.db, KEY_PURGED).map_err(read_err)?;
        let tx = self.db.begin_read().map_err(read_err)?;
        let t = tx.open_table(LOGS).map_err(read_err)?;
        let last = match t.last().map_err(read_err)? {
            Some((_, v)) => {
                let e: Entry<TypeConfig> = serde_json::from_slice(v.value()).map_err(read_err)?;
                Some(e.log_id)
            }
            None => last_purged,
        };
        Ok(LogState {
            last_purged_log_id: last_purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), SErr> {
        meta_put(&self.db, KEY_VOTE, vote, redb::Durability::Immediate)
            .map_err(|e| StorageIOError::write_vote(AnyError::error(e)).into())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, SErr> {
        meta_get(&self.db, KEY_VOTE)
            .map_err(|e| StorageIOError::read_vote(AnyError::error(e)).into())
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<(), SErr> {
        // Only a hint for replay at start: losing the latest value is safe.
        meta_put(
            &self.db,
            KEY_COMMITTED,
            &committed,
            redb::Durability::Eventual,
        )
        .map_err(write_err)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, SErr> {
        Ok(meta_get::<Option<LogId<NodeId>>>(&self.db, KEY_COMMITTED)
            .map_err(read_err)?
            .flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let res = (|| -> Result<(), String> {
            let tx = self.db.begin_write().map_err(|e| e.to_string())?;
            {
                let mut t = tx.open_table(LOGS).map_err(|e| e.to_string())?;
                for e in entries {
                    let bytes = serde_json::to_vec(&e).map_err(|e| e.to_string())?;
                    t.insert(e.log_id.index, bytes.as_slice())
                        .map_err(|e| e.to_string())?;
                }
            }
            tx.commit().map_err(|e| e.to_string())
        })();
        match res {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.clone())));
                Err(StorageIOError::write_logs(AnyError::error(e)).into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), SErr> {
        let tx = self.db.begin_write().map_err(write_err)?;
        {
            let mut t = tx.open_table(LOGS).map_err(write_err)?;
            t.retain_in(log_id.index.., |_, _| false)
                .map_err(write_err)?;
        }
        tx.commit().map_err(write_err)
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), SErr> {
        let bytes = serde_json::to_vec(&Some(log_id)).map_err(write_err)?;
        let tx = self.db.begin_write().map_err(write_err)?;
        {
            let mut m = tx.open_table(META).map_err(write_err)?;
            m.insert(KEY_PURGED, bytes.as_slice()).map_err(write_err)?;
            let mut t = tx.open_table(LOGS).map_err(write_err)?;
            t.retain_in(..=log_id.index, |_, _| false)
                .map_err(write_err)?;
        }
        tx.commit().map_err(write_err)
    }
}

// ------------------------------------------------------------ state machine

/// What a snapshot holds (serialized with serde_json).
#[derive(Serialize, Deserialize)]
struct SnapshotBody {
    state: ClusterState,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

/// A snapshot as stored in redb: its metadata and its bytes.
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

struct SmData {
    state: ClusterState,
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, BasicNode>,
}

/// The in-memory state machine. Cheap to clone (it is its own snapshot
/// builder); every clone shares the same state.
#[derive(Clone)]
pub(crate) struct StateMachine {
    db: Arc<Database>,
    data: Arc<RwLock<SmData>>,
    publish: Arc<watch::Sender<Arc<ClusterState>>>,
}

impl StateMachine {
    /// Loads the last snapshot, if any, and publishes its state.
    pub(crate) fn open(
        db: Arc<Database>,
    ) -> Result<(Self, watch::Receiver<Arc<ClusterState>>), DirectoryError> {
        let stored = get_snapshot(&db).map_err(storage)?;
        let data = match stored {
            Some(s) => {
                let body: SnapshotBody = serde_json::from_slice(&s.data).map_err(storage)?;
                SmData {
                    state: body.state,
                    last_applied: body.last_applied,
                    membership: body.membership,
                }
            }
            None => SmData {
                state: ClusterState::default(),
                last_applied: None,
                membership: StoredMembership::default(),
            },
        };
        let (tx, rx) = watch::channel(Arc::new(data.state.clone()));
        Ok((
            StateMachine {
                db,
                data: Arc::new(RwLock::new(data)),
                publish: Arc::new(tx),
            },
            rx,
        ))
    }

    fn publish(&self, state: ClusterState) {
        self.publish.send_replace(Arc::new(state));
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, SErr> {
        let (bytes, meta) = {
            let d = self.data.read().expect("state machine lock");
            let body = SnapshotBody {
                state: d.state.clone(),
                last_applied: d.last_applied,
                membership: d.membership.clone(),
            };
            let bytes =
                serde_json::to_vec(&body).map_err(|e| StorageIOError::read_state_machine(&e))?;
            let snapshot_id = match d.last_applied {
                Some(l) => format!("{}-{}-{}", l.leader_id, l.index, bytes.len()),
                None => format!("none-{}", bytes.len()),
            };
            let meta = SnapshotMeta {
                last_log_id: d.last_applied,
                last_membership: d.membership.clone(),
                snapshot_id,
            };
            (bytes, meta)
        };
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: bytes.clone(),
        };
        put_snapshot(&self.db, &stored)
            .map_err(|e| StorageIOError::write_snapshot(None, AnyError::error(e)))?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = StateMachine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>), SErr> {
        let d = self.data.read().expect("state machine lock");
        Ok((d.last_applied, d.membership.clone()))
    }

    async fn apply<I>(
        &mut self,
        entries: I,
    ) -> Result<Vec<Result<crate::Response, StateError>>, SErr>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut out = Vec::new();
        let snapshot = {
            let mut d = self.data.write().expect("state machine lock");
            for e in entries {
                d.last_applied = Some(e.log_id);
                match e.payload {
                    EntryPayload::Blank => out.push(Ok(crate::Response::Ok)),
                    EntryPayload::Normal(cmd) => out.push(d.state.apply(&cmd)),
                    EntryPayload::Membership(m) => {
                        d.membership = StoredMembership::new(Some(e.log_id), m);
                        out.push(Ok(crate::Response::Ok));
                    }
                }
            }
            d.state.clone()
        };
        self.publish(snapshot);
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, SErr> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), SErr> {
        let bytes = snapshot.into_inner();
        let body: SnapshotBody = serde_json::from_slice(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), &e))?;
        let stored = StoredSnapshot {
            meta: meta.clone(),
            data: bytes,
        };
        put_snapshot(&self.db, &stored).map_err(|e| {
            StorageIOError::write_snapshot(Some(meta.signature()), AnyError::error(e))
        })?;
        let state = {
            let mut d = self.data.write().expect("state machine lock");
            d.state = body.state;
            d.last_applied = meta.last_log_id;
            d.membership = meta.last_membership.clone();
            d.state.clone()
        };
        self.publish(state);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, SErr> {
        let stored = get_snapshot(&self.db)
            .map_err(|e| StorageIOError::read_snapshot(None, AnyError::error(e)))?;
        Ok(stored.map(|s| Snapshot {
            meta: s.meta,
            snapshot: Box::new(Cursor::new(s.data)),
        }))
    }
}
