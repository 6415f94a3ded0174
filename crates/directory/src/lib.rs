//! # shoal-directory: the cluster's replicated metadata
//!
//! Nodes, devices, volumes with their policies and component placement and
//! state, and owner generations: the only place where cluster state is
//! decided. Changes are [`Command`]s replicated with Raft (openraft) and
//! applied by the pure state machine in [`state`]; the Raft log, vote and
//! snapshots are persisted in one redb file, `<data_dir>/directory.redb`.
//!
//! Owns: the replicated state machine, its persistence and its Raft
//! transport (HTTP routes from [`Directory::router`]). Must never touch:
//! devices or the data path.
//!
//! Who calls: the routes serve only requests that carry a [`Caller`], which
//! the node's server adds once mutual TLS proved the calling member; a
//! member acts only as itself (its votes and appends, its joins, the
//! proposals that name a node).
//!
//! Membership: the first node calls [`Directory::bootstrap`]; others call
//! [`Directory::join`] through any member once their router is served. The
//! leader adds a joining node as a learner and promotes it to voter while
//! the cluster has fewer than 5 voters. [`Directory::remove_member`]
//! takes a node out of the membership (a removed node; `shoal cluster
//! remove-node`); promoting a learner in its place is not done here.

pub mod state;

pub mod device_removal;
pub mod maintenance;
mod network;
pub mod reconfig;
pub use network::CONNECT_TIMEOUT;
mod store;

pub use state::{ClusterState, Command, PlannedComponent, Response, StateError};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::post;
use axum::{Extension, Json, Router};
use openraft::error::{ClientWriteError, Fatal, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use openraft::{BasicNode, ChangeMembers, Config, Raft, RaftMetrics, SnapshotPolicy, Vote};
use serde::{Deserialize, Serialize};
use shoal_model::NodeId;
use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

openraft::declare_raft_types!(
    /// Raft types of the directory.
    pub TypeConfig:
        D = Command,
        R = Result<Response, StateError>,
        NodeId = NodeId,
        Node = BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

/// How long `propose` and `join` keep retrying while there is no leader.
const RETRY_FOR: Duration = Duration::from_secs(10);
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Timeout of a forwarded proposal.
const PROPOSE_TIMEOUT: Duration = Duration::from_secs(5);
/// Timeout of a join request (the leader waits for the learner to catch up).
const JOIN_TIMEOUT: Duration = Duration::from_secs(30);
/// Most voters the leader promotes joining nodes to.
const MAX_VOTERS: usize = 5;
/// How long without contact with a quorum before this member says at
/// once that it has none, in milliseconds: a follower that heard no
/// leader, a leader that heard from no majority. Ten Raft heartbeats
/// (250 ms), longer than an election takes (1-2 s), so a normal change of
/// leader is retried through; a member cut off from the majority answers
/// "no quorum" instead of making its callers wait.
const QUORUM_LOST_MS: u64 = 2_500;
/// How often a write waiting on this leader checks that it still has a
/// quorum, in milliseconds.
const QUORUM_POLL_MS: u64 = 100;

/// Where and as whom a directory member runs.
#[derive(Clone, Debug)]
pub struct DirectoryConfig {
    /// This node's id, also its Raft id.
    pub node_id: NodeId,
    /// Folder of `directory.redb`; created if missing.
    pub data_dir: PathBuf,
    /// This node's HTTP API address `ip:port`, where [`Directory::router`]
    /// is served; peers reach this node's Raft there.
    pub api_addr: String,
    /// How this member reaches the others' routes.
    pub transport: Transport,
}

/// How members reach each other's routes.
#[derive(Clone, Debug)]
pub struct Transport {
    /// A client that proves this node where `scheme` is `https`.
    pub client: reqwest::Client,
    /// `https` between nodes; `http` in this crate's tests only.
    pub scheme: &'static str,
}

/// Who is calling a directory route, as the server that accepted the
/// connection proved it (a request extension). A request without one is
/// refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A member, proven by its certificate.
    Node(NodeId),
    /// No proof and no checks: this crate's tests over plain HTTP.
    Unchecked,
}

impl Caller {
    /// Whether this caller may act as `node`.
    fn is(self, node: NodeId) -> bool {
        match self {
            Caller::Node(n) => n == node,
            Caller::Unchecked => true,
        }
    }
}

/// Why a directory operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// The command was rejected by the state machine; the state is unchanged.
    #[error(transparent)]
    State(#[from] StateError),
    #[error("the directory has no leader (no quorum of directory members reachable)")]
    NoLeader,
    /// This member is cut off from the majority: it cannot decide anything.
    #[error("no quorum: {0}")]
    NoQuorum(String),
    #[error("directory storage: {0}")]
    Storage(String),
    #[error("directory network: {0}")]
    Network(String),
    #[error("directory raft: {0}")]
    Raft(String),
    /// The caller may not do this (it acted as another node).
    #[error("refused: {0}")]
    Forbidden(String),
}

/// Errors carried in the answers of `/directory/*` routes.
#[derive(Debug, Serialize, Deserialize)]
enum WireError {
    State(StateError),
    /// This node is not the leader (or knows none): retry later.
    NotLeader,
    Other(String),
    Forbidden(String),
    /// The leader lost contact with the majority while writing.
    NoQuorum(String),
}

/// Body of `/directory/remove`: take `node_id` out of the membership.
#[derive(Debug, Serialize, Deserialize)]
struct RemoveRequest {
    node_id: NodeId,
    /// Set when a member forwards the request to the leader (one hop only).
    #[serde(default)]
    forwarded: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct JoinRequest {
    node_id: NodeId,
    addr: String,
    /// Set when a member forwards the request to the leader (one hop only).
    #[serde(default)]
    forwarded: bool,
}

struct Inner {
    id: NodeId,
    api_addr: String,
    raft: Raft<TypeConfig>,
    metrics: watch::Receiver<RaftMetrics<NodeId, BasicNode>>,
    state: watch::Receiver<Arc<ClusterState>>,
    transport: Transport,
    /// Serializes membership changes made by this node as leader.
    membership: tokio::sync::Mutex<()>,
    /// One read barrier at a time from this member; holds the number of
    /// the last one that succeeded (see [`Directory::catch_up`]).
    barrier: tokio::sync::Mutex<u64>,
    /// Read barriers begun by this member, numbered from 1.
    barriers_begun: std::sync::atomic::AtomicU64,
    /// When this member last heard from a leader of the current term (an
    /// append accepted), in milliseconds after `started`.
    leader_contact_ms: std::sync::atomic::AtomicU64,
    started: Instant,
}

/// A directory member. Cheap to clone.
#[derive(Clone)]
pub struct Directory {
    inner: Arc<Inner>,
}

fn raft_config() -> Result<Config, DirectoryError> {
    Config {
        cluster_name: "shoal-directory".into(),
        heartbeat_interval: 250,
        election_timeout_min: 1000,
        election_timeout_max: 2000,
        install_snapshot_timeout: 30_000,
        snapshot_policy: SnapshotPolicy::LogsSinceLast(5000),
        max_in_snapshot_log_to_keep: 1000,
        purge_batch_size: 256,
        ..Default::default()
    }
    .validate()
    .map_err(|e| DirectoryError::Raft(e.to_string()))
}

/// Largest body of a vote, a join or a proposal, in bytes: a command is a
/// few hundred bytes (a volume with its components a few KiB).
const SMALL_BODY_MAX_BYTES: usize = 1 << 20;
/// Largest body of an append, in bytes: a batch of log entries (openraft
/// sends at most a few hundred at once, each a command).
const APPEND_BODY_MAX_BYTES: usize = 16 << 20;
/// Largest body of a snapshot, in bytes: the whole directory in JSON, a
/// few KiB per volume, so room for tens of thousands of volumes.
const SNAPSHOT_BODY_MAX_BYTES: usize = 256 << 20;

/// Outcome of one attempt of a retried operation.
enum Attempt {
    /// Give up with this error.
    Final(DirectoryError),
    /// Try again later; the error is reported if time runs out.
    Retry(DirectoryError),
}

impl Directory {
    /// Opens or creates `<data_dir>/directory.redb` and starts Raft. Does not
    /// initialize membership: call [`bootstrap`](Self::bootstrap) or
    /// [`join`](Self::join) (unless the node already was a member).
    pub async fn open(cfg: DirectoryConfig) -> Result<Directory, DirectoryError> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(|e| {
            DirectoryError::Storage(format!("cannot create {}: {e}", cfg.data_dir.display()))
        })?;
        let path = cfg.data_dir.join("directory.redb");
        let db = tokio::task::spawn_blocking(move || store::open_db(&path))
            .await
            .map_err(|e| DirectoryError::Storage(e.to_string()))??;
        let log = store::LogStore::new(db.clone());
        let (sm, state) = store::StateMachine::open(db)?;
        let transport = cfg.transport.clone();
        let raft = Raft::new(
            cfg.node_id,
            Arc::new(raft_config()?),
            network::Network::new(transport.clone()),
            log,
            sm,
        )
        .await
        .map_err(|e| DirectoryError::Raft(e.to_string()))?;
        let metrics = raft.metrics();
        Ok(Directory {
            inner: Arc::new(Inner {
                id: cfg.node_id,
                api_addr: cfg.api_addr,
                raft,
                metrics,
                state,
                transport,
                membership: tokio::sync::Mutex::new(()),
                barrier: tokio::sync::Mutex::new(0),
                barriers_begun: std::sync::atomic::AtomicU64::new(0),
                // No leader heard yet.
                leader_contact_ms: std::sync::atomic::AtomicU64::new(0),
                started: Instant::now(),
            }),
        })
    }

    /// Makes this node the single voter of a new cluster. No-op when the
    /// node is already initialized (bootstrapped or joined before).
    pub async fn bootstrap(&self) -> Result<(), DirectoryError> {
        if self.is_initialized().await {
            return Ok(());
        }
        let members = BTreeMap::from([(self.inner.id, BasicNode::new(&self.inner.api_addr))]);
        match self.inner.raft.initialize(members).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(DirectoryError::Raft(e.to_string())),
        }
    }

    /// Asks the member at `via_api_addr` (which forwards to the leader) to
    /// add this node: as a learner, then as a voter while the cluster has
    /// fewer than 5 voters. This node's [`router`](Self::router) must be
    /// served already. Idempotent (also refreshes this node's address).
    /// Retries for about 10 s while there is no leader.
    pub async fn join(&self, via_api_addr: &str) -> Result<(), DirectoryError> {
        let req = JoinRequest {
            node_id: self.inner.id,
            addr: self.inner.api_addr.clone(),
            forwarded: false,
        };
        let url = self.url(via_api_addr, "/directory/join");
        let (req, url) = (&req, &url);
        self.retry(|| async move { self.post_json::<_, ()>(url, req, JOIN_TIMEOUT).await })
            .await
    }

    /// The HTTP routes of the directory: `/raft/{append,vote,snapshot}` and
    /// `/directory/{join,propose}`, all POST with JSON bodies. State is
    /// applied, so the result can be merged into another router.
    pub fn router(&self) -> Router {
        let limit = |bytes: usize| DefaultBodyLimit::max(bytes);
        Router::new()
            .route(
                "/raft/append",
                post(h_append).layer(limit(APPEND_BODY_MAX_BYTES)),
            )
            .route(
                "/raft/vote",
                post(h_vote).layer(limit(SMALL_BODY_MAX_BYTES)),
            )
            .route(
                "/raft/snapshot",
                post(h_snapshot).layer(limit(SNAPSHOT_BODY_MAX_BYTES)),
            )
            .route(
                "/directory/join",
                post(h_join).layer(limit(SMALL_BODY_MAX_BYTES)),
            )
            .route(
                "/directory/propose",
                post(h_propose).layer(limit(SMALL_BODY_MAX_BYTES)),
            )
            .route(
                "/directory/read-index",
                post(h_read_index).layer(limit(SMALL_BODY_MAX_BYTES)),
            )
            .route(
                "/directory/remove",
                post(h_remove).layer(limit(SMALL_BODY_MAX_BYTES)),
            )
            .with_state(self.clone())
    }

    /// Replicates `cmd` and answers the state machine's response. On the
    /// leader it is written directly; elsewhere it is forwarded to the
    /// leader. Retries for about 10 s while there is no leader, then fails
    /// with [`DirectoryError::NoLeader`]. A rejected command fails with
    /// [`DirectoryError::State`].
    ///
    /// A forwarded proposal whose answer is lost may be retried and so
    /// applied twice; compare-and-set commands then report a conflict.
    pub async fn propose(&self, cmd: Command) -> Result<Response, DirectoryError> {
        self.quorum()?;
        self.retry(|| self.propose_once(&cmd)).await
    }

    /// Whether this member is in contact with a quorum: a leader that a
    /// majority acknowledged within [`QUORUM_LOST_MS`], or a follower
    /// that heard from a leader within it. [`DirectoryError::NoQuorum`]
    /// when it had contact and lost it: nothing proposed here could be
    /// decided now. A member that has not heard from any leader since it
    /// started (the whole cluster starting, an election) is not judged:
    /// its proposals are retried as before.
    pub fn quorum(&self) -> Result<(), DirectoryError> {
        let m = self.inner.metrics.borrow();
        if m.current_leader == Some(self.inner.id) {
            return match m.millis_since_quorum_ack {
                Some(ms) if ms > QUORUM_LOST_MS => Err(DirectoryError::NoQuorum(format!(
                    "this leader has heard from no majority of directory members for {ms} ms"
                ))),
                _ => Ok(()),
            };
        }
        drop(m);
        // 0: no leader heard since start; else milliseconds after start + 1.
        let last = self.inner.leader_contact_ms.load(Ordering::Acquire);
        if last == 0 {
            return Ok(());
        }
        let silent = self.since_start_ms().saturating_sub(last - 1);
        if silent > QUORUM_LOST_MS {
            return Err(DirectoryError::NoQuorum(format!(
                "no directory leader heard for {silent} ms (this node is cut off from \
                 the majority, or the cluster has lost it)"
            )));
        }
        Ok(())
    }

    /// Returns why, once [`Directory::quorum`] says this member lost the
    /// quorum (checked every [`QUORUM_POLL_MS`]).
    async fn quorum_lost(&self) -> String {
        loop {
            tokio::time::sleep(Duration::from_millis(QUORUM_POLL_MS)).await;
            if let Err(DirectoryError::NoQuorum(why)) = self.quorum() {
                return why;
            }
        }
    }

    fn since_start_ms(&self) -> u64 {
        u64::try_from(self.inner.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A leader's append was accepted here: we are in contact with it.
    fn heard_leader(&self) {
        let now = self.since_start_ms().saturating_add(1);
        self.inner
            .leader_contact_ms
            .fetch_max(now, Ordering::AcqRel);
    }

    async fn propose_once(&self, cmd: &Command) -> Result<Response, Attempt> {
        match self.leader() {
            None => Err(Attempt::Retry(DirectoryError::NoLeader)),
            Some(l) if l == self.inner.id => self.propose_local(cmd.clone()).await.map_err(wire),
            Some(l) => {
                let addr = self
                    .node_addr(l)
                    .ok_or(Attempt::Retry(DirectoryError::NoLeader))?;
                let url = self.url(&addr, "/directory/propose");
                self.post_json(&url, cmd, PROPOSE_TIMEOUT).await
            }
        }
    }

    /// Writes on this node if it is the leader; never forwards.
    async fn propose_local(&self, cmd: Command) -> Result<Response, WireError> {
        // A leader cut off from the majority waits here for a commit that
        // cannot come: it stops waiting once it knows it has no quorum,
        // and within a bound in any case.
        let write = tokio::time::timeout(PROPOSE_TIMEOUT, self.inner.raft.client_write(cmd));
        let written = tokio::select! {
            w = write => w,
            lost = self.quorum_lost() => return Err(WireError::NoQuorum(lost)),
        };
        let Ok(written) = written else {
            return Err(WireError::Other(format!(
                "not committed within {PROPOSE_TIMEOUT:?}"
            )));
        };
        match written {
            Ok(resp) => resp.data.map_err(WireError::State),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                Err(WireError::NotLeader)
            }
            Err(e) => Err(WireError::Other(e.to_string())),
        }
    }

    /// Runs `f` until it succeeds, fails for good, [`RETRY_FOR`] passes, or
    /// this member loses contact with the quorum (then at once).
    async fn retry<T, F, Fut>(&self, mut f: F) -> Result<T, DirectoryError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, Attempt>>,
    {
        let deadline = Instant::now() + RETRY_FOR;
        loop {
            match f().await {
                Ok(v) => return Ok(v),
                Err(Attempt::Final(e)) => return Err(e),
                Err(Attempt::Retry(e)) => {
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    self.quorum()?;
                    tracing::debug!("directory: retrying: {e}");
                    tokio::time::sleep(RETRY_PAUSE).await;
                }
            }
        }
    }

    /// The URL of `path` on the member at `addr`.
    fn url(&self, addr: &str, path: &str) -> String {
        format!("{}://{addr}{path}", self.inner.transport.scheme)
    }

    /// POSTs JSON to a `/directory/*` route and decodes its answer.
    async fn post_json<Q: Serialize, A: for<'de> Deserialize<'de>>(
        &self,
        url: &str,
        body: &Q,
        timeout: Duration,
    ) -> Result<A, Attempt> {
        let net = |e: String| Attempt::Retry(DirectoryError::Network(e));
        let resp = self
            .inner
            .transport
            .client
            .post(url)
            .timeout(timeout)
            .json(body)
            .send()
            .await
            .map_err(|e| net(format!("{url}: {e}")))?;
        if !resp.status().is_success() {
            return Err(net(format!("{url}: HTTP {}", resp.status())));
        }
        let answer: Result<A, WireError> = resp
            .json()
            .await
            .map_err(|e| net(format!("{url}: bad answer: {e}")))?;
        answer.map_err(wire)
    }

    /// The API address of a member, from the current membership.
    fn node_addr(&self, id: NodeId) -> Option<String> {
        self.inner
            .metrics
            .borrow()
            .membership_config
            .membership()
            .get_node(&id)
            .map(|n| n.addr.clone())
    }

    /// Handles a join: on the leader adds/promotes the node, elsewhere
    /// forwards once to the leader.
    async fn handle_join(&self, req: JoinRequest) -> Result<(), WireError> {
        match self.leader() {
            Some(l) if l == self.inner.id => self.add_member(req.node_id, req.addr).await,
            Some(l) if !req.forwarded => {
                let fwd = JoinRequest {
                    forwarded: true,
                    ..req
                };
                self.forward_to(l, "/directory/join", &fwd).await
            }
            _ => Err(WireError::NotLeader),
        }
    }

    /// Hands a membership request on to the leader `l`, once.
    async fn forward_to<R: Serialize>(
        &self,
        l: NodeId,
        path: &str,
        fwd: &R,
    ) -> Result<(), WireError> {
        let addr = self.node_addr(l).ok_or(WireError::NotLeader)?;
        let url = self.url(&addr, path);
        match self.post_json::<_, ()>(&url, fwd, JOIN_TIMEOUT).await {
            Ok(()) => Ok(()),
            Err(Attempt::Final(DirectoryError::State(s))) => Err(WireError::State(s)),
            Err(Attempt::Final(e) | Attempt::Retry(e)) => match e {
                DirectoryError::NoLeader => Err(WireError::NotLeader),
                e => Err(WireError::Other(e.to_string())),
            },
        }
    }

    /// On the leader: adds `id` as a learner (or updates its address), then
    /// promotes it to voter while there are fewer than [`MAX_VOTERS`].
    async fn add_member(&self, id: NodeId, addr: String) -> Result<(), WireError> {
        let _guard = self.inner.membership.lock().await;
        let raft_err = |e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>| match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => WireError::NotLeader,
            e => WireError::Other(e.to_string()),
        };
        let membership = self.membership();
        let node = BasicNode::new(&addr);
        match membership.get_node(&id) {
            None => {
                self.inner
                    .raft
                    .add_learner(id, node, true)
                    .await
                    .map_err(raft_err)?;
            }
            Some(old) if old.addr != addr => {
                self.inner
                    .raft
                    .change_membership(ChangeMembers::SetNodes(BTreeMap::from([(id, node)])), true)
                    .await
                    .map_err(raft_err)?;
            }
            Some(_) => {}
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        if !voters.contains(&id) && voters.len() < MAX_VOTERS {
            self.inner
                .raft
                .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), true)
                .await
                .map_err(raft_err)?;
        }
        Ok(())
    }

    /// Takes node `id` out of the directory's membership, through the
    /// leader (this member or the one it knows): a voter is removed from
    /// the voters (joint consensus; a leader that removes itself steps
    /// down once the change is committed), a learner from the learners.
    /// Idempotent: a node that is no member is Ok. Refused
    /// ([`DirectoryError::State`]) for the only voter. Retries for about
    /// 10 s while there is no leader.
    pub async fn remove_member(&self, id: NodeId) -> Result<(), DirectoryError> {
        let req = RemoveRequest {
            node_id: id,
            forwarded: false,
        };
        let req = &req;
        self.retry(|| async move {
            match self.leader() {
                None => Err(Attempt::Retry(DirectoryError::NoLeader)),
                Some(l) if l == self.inner.id => self.drop_member(id).await.map_err(wire),
                Some(l) => {
                    let addr = self
                        .node_addr(l)
                        .ok_or(Attempt::Retry(DirectoryError::NoLeader))?;
                    let url = self.url(&addr, "/directory/remove");
                    self.post_json::<_, ()>(&url, req, JOIN_TIMEOUT).await
                }
            }
        })
        .await
    }

    /// Handles a removal: on the leader removes the member, elsewhere
    /// forwards once to the leader.
    async fn handle_remove(&self, req: RemoveRequest) -> Result<(), WireError> {
        match self.leader() {
            Some(l) if l == self.inner.id => self.drop_member(req.node_id).await,
            Some(l) if !req.forwarded => {
                let fwd = RemoveRequest {
                    forwarded: true,
                    ..req
                };
                self.forward_to(l, "/directory/remove", &fwd).await
            }
            _ => Err(WireError::NotLeader),
        }
    }

    /// On the leader: removes `id` from the voters or the learners.
    async fn drop_member(&self, id: NodeId) -> Result<(), WireError> {
        let _guard = self.inner.membership.lock().await;
        let raft_err = |e: RaftError<NodeId, ClientWriteError<NodeId, BasicNode>>| match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(_)) => WireError::NotLeader,
            e => WireError::Other(e.to_string()),
        };
        let membership = self.membership();
        if membership.get_node(&id).is_none() {
            return Ok(());
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        let change = if voters.contains(&id) {
            if voters.len() == 1 {
                return Err(WireError::State(state::input(format!(
                    "node {id} is the directory's only voter: it cannot be removed"
                ))));
            }
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        self.inner
            .raft
            .change_membership(change, false)
            .await
            .map_err(raft_err)?;
        Ok(())
    }

    /// On the leader: replaces voter `dead` by learner `learner` in one
    /// joint-consensus change; `dead` stays a learner (it may come back
    /// and be promoted again). Ok without a change when `dead` is no
    /// voter any more or `learner` is one already (a repeat); refused
    /// ([`DirectoryError::State`]) for a `learner` that is no member.
    /// [`DirectoryError::NoLeader`] when this node is not the leader.
    pub async fn replace_voter(&self, dead: NodeId, learner: NodeId) -> Result<(), DirectoryError> {
        let _guard = self.inner.membership.lock().await;
        let membership = self.membership();
        let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
        if !voters.contains(&dead) || voters.contains(&learner) {
            return Ok(());
        }
        if membership.get_node(&learner).is_none() {
            return Err(DirectoryError::State(state::input(format!(
                "node {learner} is no member of the directory"
            ))));
        }
        let mut next = voters;
        next.remove(&dead);
        next.insert(learner);
        match self
            .inner
            .raft
            .change_membership(ChangeMembers::ReplaceAllVoters(next), true)
            .await
        {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                Err(DirectoryError::NoLeader)
            }
            Err(e) => Err(DirectoryError::Raft(e.to_string())),
        }
    }

    /// The Raft membership as this node last saw it.
    fn membership(&self) -> openraft::Membership<NodeId, BasicNode> {
        self.inner
            .metrics
            .borrow()
            .membership_config
            .membership()
            .clone()
    }

    /// Waits, at most `bound`, until this member has applied every
    /// command the leader had committed when asked: a read barrier, so
    /// that a change made through another member (a volume just created)
    /// is seen here. The leader confirms it still leads (a heartbeat round
    /// to a majority) before it answers; nothing is written. One barrier
    /// runs at a time per member, and a caller is served by any barrier
    /// begun after it asked: many callers at once cost one round.
    pub async fn catch_up(&self, bound: Duration) -> Result<(), DirectoryError> {
        let queued = Instant::now();
        let asked_after = self.inner.barriers_begun.load(Ordering::Acquire);
        let mut last_done = tokio::time::timeout(bound, self.inner.barrier.lock())
            .await
            .map_err(|_| DirectoryError::Network(format!("no read barrier within {bound:?}")))?;
        if *last_done > asked_after {
            return Ok(());
        }
        let number = self.inner.barriers_begun.fetch_add(1, Ordering::AcqRel) + 1;
        let index = tokio::time::timeout(bound, self.read_index())
            .await
            .map_err(|_| DirectoryError::Network(format!("no read index within {bound:?}")))??;
        let left = bound.saturating_sub(queued.elapsed());
        self.inner
            .raft
            .wait(Some(left))
            .applied_index_at_least(index, "read barrier")
            .await
            .map_err(|e| DirectoryError::Network(format!("catching up to index {index:?}: {e}")))?;
        *last_done = number;
        Ok(())
    }

    /// The leader's committed index once it has confirmed it still leads;
    /// asked of the leader when this member is not it.
    async fn read_index(&self) -> Result<Option<u64>, DirectoryError> {
        match self.leader() {
            None => Err(DirectoryError::NoLeader),
            Some(l) if l == self.inner.id => self.read_index_local().await.map_err(|e| match e {
                WireError::NotLeader => DirectoryError::NoLeader,
                other => DirectoryError::Network(format!("{other:?}")),
            }),
            Some(l) => {
                let addr = self.node_addr(l).ok_or(DirectoryError::NoLeader)?;
                let url = self.url(&addr, "/directory/read-index");
                match self.post_json(&url, &(), PROPOSE_TIMEOUT).await {
                    Ok(i) => Ok(i),
                    Err(Attempt::Retry(e)) | Err(Attempt::Final(e)) => Err(e),
                }
            }
        }
    }

    /// [`Directory::read_index`] on the leader itself.
    async fn read_index_local(&self) -> Result<Option<u64>, WireError> {
        match self.inner.raft.ensure_linearizable().await {
            Ok(read) => Ok(read.map(|l| l.index)),
            Err(RaftError::APIError(_)) => Err(WireError::NotLeader),
            Err(e) => Err(WireError::Other(e.to_string())),
        }
    }

    /// The latest applied cluster state.
    pub fn state(&self) -> Arc<ClusterState> {
        self.inner.state.borrow().clone()
    }

    /// Follows the applied cluster state.
    pub fn watch(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.inner.state.clone()
    }

    /// The current leader, as far as this node knows.
    pub fn leader(&self) -> Option<NodeId> {
        self.inner.metrics.borrow().current_leader
    }

    pub fn is_leader(&self) -> bool {
        self.leader() == Some(self.inner.id)
    }

    /// Voters of the current membership.
    pub fn voters(&self) -> Vec<NodeId> {
        self.inner
            .metrics
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect()
    }

    /// Voters and learners of the current membership.
    pub fn members(&self) -> Vec<NodeId> {
        self.inner
            .metrics
            .borrow()
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .collect()
    }

    /// Whether this node has a membership (bootstrapped, joined, or
    /// restarted as a member).
    pub async fn is_initialized(&self) -> bool {
        self.inner.raft.is_initialized().await.unwrap_or(false)
    }

    /// Resolves, with the reason, once the Raft core of this member has
    /// stopped for good (a storage error, a fatal bug): from then on the
    /// node can change nothing in the directory, and must not go on half
    /// alive.
    pub async fn stopped(&self) -> String {
        let mut m = self.inner.metrics.clone();
        loop {
            if let Err(e) = &m.borrow_and_update().running_state {
                return format!("the directory's Raft core stopped: {e}");
            }
            if m.changed().await.is_err() {
                return "the directory's Raft core stopped".into();
            }
        }
    }

    /// Stops Raft. The redb file is closed once the Raft tasks have ended.
    pub async fn shutdown(&self) {
        if let Err(e) = self.inner.raft.shutdown().await {
            tracing::warn!("directory shutdown: {e}");
        }
    }
}

fn wire(e: WireError) -> Attempt {
    match e {
        WireError::State(s) => Attempt::Final(DirectoryError::State(s)),
        WireError::NotLeader => Attempt::Retry(DirectoryError::NoLeader),
        WireError::Other(s) => Attempt::Retry(DirectoryError::Raft(s)),
        WireError::Forbidden(s) => Attempt::Final(DirectoryError::Forbidden(s)),
        WireError::NoQuorum(s) => Attempt::Final(DirectoryError::NoQuorum(s)),
    }
}

// ------------------------------------------------------------ HTTP handlers

/// A refusal: the request carried no proven caller, or acted as another.
type Refused = (StatusCode, String);

fn caller_of(c: Option<Extension<Caller>>) -> Result<Caller, Refused> {
    c.map(|Extension(c)| c).ok_or((
        StatusCode::FORBIDDEN,
        "directory routes serve members only (mutual TLS)".into(),
    ))
}

/// A vote or append must come from the node it names as candidate/leader.
fn check_vote(c: Option<Extension<Caller>>, vote: &Vote<NodeId>) -> Result<(), Refused> {
    let caller = caller_of(c)?;
    match vote.leader_id().voted_for() {
        Some(n) if caller.is(n) => Ok(()),
        other => Err((
            StatusCode::FORBIDDEN,
            format!("{caller:?} may not speak for node {other:?}"),
        )),
    }
}

async fn h_append(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(req): Json<AppendEntriesRequest<TypeConfig>>,
) -> Result<Json<Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>>, Refused> {
    check_vote(c, &req.vote)?;
    let answer = d.inner.raft.append_entries(req).await;
    // Any answer but "your term is over" means the sender leads the
    // current term: contact with the majority's leader.
    if matches!(&answer, Ok(r) if !matches!(r, AppendEntriesResponse::HigherVote(_))) {
        d.heard_leader();
    }
    Ok(Json(answer))
}

async fn h_vote(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(req): Json<VoteRequest<NodeId>>,
) -> Result<Json<Result<VoteResponse<NodeId>, RaftError<NodeId>>>, Refused> {
    check_vote(c, &req.vote)?;
    Ok(Json(d.inner.raft.vote(req).await))
}

async fn h_snapshot(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(req): Json<network::SnapshotRequest>,
) -> Result<Json<Result<SnapshotResponse<NodeId>, Fatal<NodeId>>>, Refused> {
    check_vote(c, &req.vote)?;
    let snapshot = openraft::Snapshot {
        meta: req.meta,
        snapshot: Box::new(Cursor::new(req.data.into_bytes())),
    };
    Ok(Json(
        d.inner.raft.install_full_snapshot(req.vote, snapshot).await,
    ))
}

async fn h_join(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(req): Json<JoinRequest>,
) -> Result<Json<Result<(), WireError>>, Refused> {
    let caller = caller_of(c)?;
    // A node joins as itself; a member forwards another's join once.
    if !req.forwarded && !caller.is(req.node_id) {
        return Ok(Json(Err(WireError::Forbidden(format!(
            "{caller:?} may not join as node {}",
            req.node_id
        )))));
    }
    Ok(Json(d.handle_join(req).await))
}

async fn h_remove(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(req): Json<RemoveRequest>,
) -> Result<Json<Result<(), WireError>>, Refused> {
    // Any member may ask: removing a node is an admin's decision, taken
    // on the REST API of a member, which asks its leader here.
    caller_of(c)?;
    Ok(Json(d.handle_remove(req).await))
}

async fn h_propose(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(cmd): Json<Command>,
) -> Result<Json<Result<Response, WireError>>, Refused> {
    let caller = caller_of(c)?;
    if let Some(actor) = d.state().actor(&cmd) {
        if !caller.is(actor) {
            return Ok(Json(Err(WireError::Forbidden(format!(
                "{caller:?} may not act as node {actor}"
            )))));
        }
    }
    if !d.is_leader() {
        return Ok(Json(Err(WireError::NotLeader)));
    }
    Ok(Json(d.propose_local(cmd).await))
}

/// `/directory/read-index`: the leader's committed index, once it has
/// confirmed that it still leads. Members only; changes nothing.
async fn h_read_index(
    State(d): State<Directory>,
    c: Option<Extension<Caller>>,
    Json(()): Json<()>,
) -> Result<Json<Result<Option<u64>, WireError>>, Refused> {
    caller_of(c)?;
    if !d.is_leader() {
        return Ok(Json(Err(WireError::NotLeader)));
    }
    Ok(Json(d.read_index_local().await))
}

#[cfg(test)]
mod tests;
