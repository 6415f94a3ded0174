//! Routes client I/O of a volume to its owner: the local [`Owner`] when this
//! node owns the volume, otherwise the owner node over RPC. Claims ownership
//! (through the directory) when the volume has no live owner. Clients see a
//! pause, never an error, while ownership moves.

use bytes::Bytes;
use shoal_directory::{ClusterState, Command, Directory, DirectoryError, Response, StateError};
use shoal_model::{ComponentState, Generation, NodeId, NodeState, VolumeId};
use shoal_owner::{
    ChangeEnd, Control, ControlError, Op, Owner, OwnerConfig, OwnerError, Target, View,
};
use shoal_rpc::{Peer, RemoteError, Request, RpcError, VolumeOp};
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Pause between attempts while a volume is unavailable.
const RETRY_PAUSE: Duration = Duration::from_millis(200);
/// After an owner failed to start here (its copies refused activation),
/// how long this node waits before claiming the volume again: each claim
/// is a directory write, and a volume whose copies keep refusing must not
/// cost one per client retry.
const START_RETRY_PAUSE: Duration = Duration::from_secs(2);
/// How long a claim waits for this node's own previous owner of the
/// volume, told to stop, to have ended every loop (a few milliseconds
/// normally): then no lease of it can serve a read, and the new owner
/// starts without waiting the lease out (about 2 s). Past it, the lease
/// is waited out as for an owner elsewhere.
const OWN_STOP_WAIT: Duration = Duration::from_millis(500);
/// Timeout of a forwarded request: covers the owner's own replica timeout.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// I/O counters exported as metrics.
#[derive(Default)]
pub struct Counters {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub read_bytes: AtomicU64,
    pub write_bytes: AtomicU64,
    /// Microseconds NBD reads and writes took, summed (with `reads` and
    /// `writes`: their mean latency as this node serves them).
    pub read_micros: AtomicU64,
    pub write_micros: AtomicU64,
    pub forwarded: AtomicU64,
    pub errors: AtomicU64,
    pub claims: AtomicU64,
}

pub struct Router {
    pub node: NodeId,
    pub dir: Directory,
    cfg: OwnerConfig,
    owners: Mutex<HashMap<VolumeId, Owner>>,
    /// The last owner that ran here of each volume, once out of `owners`
    /// (stopped, deposed, or its layout changed kind): a claim from its
    /// generation need not wait out its lease once it has ended
    /// ([`shoal_owner::OwnerEnd`], which holds none of its state).
    retired: Mutex<HashMap<VolumeId, shoal_owner::OwnerEnd>>,
    claim_locks: Mutex<HashMap<VolumeId, Arc<tokio::sync::Mutex<()>>>>,
    peers: tokio::sync::Mutex<HashMap<String, Arc<Peer>>>,
    /// The key that wraps encrypted volumes' data keys (`--key-file`).
    pub cluster_key: Option<Arc<shoal_crypt::ClusterKey>>,
    /// Volumes whose owner failed to start here: when, and why.
    failed_starts: Mutex<HashMap<VolumeId, (Instant, String)>>,
    /// Open NBD connections per volume name.
    pub connections: Mutex<BTreeMap<String, u64>>,
    pub counters: Counters,
    /// NBD requests of this node's clients read and not yet answered: a
    /// replica syncs a write inline only when the node is that quiet.
    pub client_requests: AtomicUsize,
}

/// The owner's way to the directory.
pub struct DirControl {
    dir: Directory,
    node: NodeId,
}

fn control_err(e: DirectoryError) -> ControlError {
    match e {
        DirectoryError::State(StateError::GenerationConflict { .. }) => ControlError::Conflict,
        DirectoryError::State(StateError::NoSuchVolumeId(_)) => ControlError::Conflict,
        DirectoryError::State(refused) => ControlError::Refused(refused.to_string()),
        other => ControlError::Unavailable(other.to_string()),
    }
}

impl Control for DirControl {
    async fn end_reconfig(
        &self,
        volume: VolumeId,
        generation: Generation,
        end: ChangeEnd,
    ) -> Result<(), ControlError> {
        let cmd = if end.commit {
            Command::CommitReconfig {
                volume,
                generation,
                added: end.added,
                remove: end.remove,
            }
        } else {
            Command::AbortReconfig {
                volume,
                generation,
                added: end.added,
                remove: end.remove,
            }
        };
        self.dir.propose(cmd).await.map(|_| ()).map_err(control_err)
    }

    async fn commit_growth(
        &self,
        volume: VolumeId,
        generation: Generation,
        size: u64,
        map_log_at: Option<u64>,
    ) -> Result<(), ControlError> {
        self.dir
            .propose(Command::CommitGrowth {
                volume,
                generation,
                size,
                map_log_at,
            })
            .await
            .map(|_| ())
            .map_err(control_err)
    }

    async fn begin_rebuild(
        &self,
        volume: VolumeId,
        generation: Generation,
        components: Vec<shoal_model::ComponentId>,
    ) -> Result<(), ControlError> {
        let state = self.dir.state();
        let begin = crate::rebuild::plan(&state, volume, generation, &components)
            .map_err(|e| ControlError::Refused(e.to_string()))?;
        self.dir
            .propose(begin)
            .await
            .map(|_| ())
            .map_err(control_err)
    }

    async fn set_component_state(
        &self,
        volume: VolumeId,
        component: shoal_model::ComponentId,
        state: ComponentState,
        generation: Generation,
    ) -> Result<(), ControlError> {
        self.dir
            .propose(Command::SetComponentState {
                volume,
                component,
                state,
                generation,
            })
            .await
            .map(|_| ())
            .map_err(control_err)
    }

    async fn reclaim(
        &self,
        volume: VolumeId,
        expected: Generation,
    ) -> Result<Generation, ControlError> {
        match self
            .dir
            .propose(Command::ClaimOwner {
                volume,
                node: self.node,
                expected_generation: expected,
            })
            .await
        {
            Ok(Response::Claimed { generation, .. }) => Ok(generation),
            Ok(other) => Err(ControlError::Unavailable(format!(
                "unexpected answer {other:?}"
            ))),
            Err(e) => Err(control_err(e)),
        }
    }
}

/// The owner's view of a volume from a directory state.
pub fn view_of(state: &ClusterState, volume: VolumeId) -> Option<View> {
    let v = state.volumes.get(&volume)?;
    let targets = v
        .components
        .iter()
        .map(|c| {
            let n = state.nodes.get(&c.node);
            Target {
                component: c.clone(),
                addr: n.map(|n| n.peer_addr.clone()).unwrap_or_default(),
                node_up: n.map(|n| n.state) == Some(NodeState::Up),
            }
        })
        .collect();
    Some(View {
        volume: v.clone(),
        targets,
        repair_delay: Duration::from_secs(state.settings.repair_delay_s),
        resync_bytes_per_s: match state.settings.resync_mib_per_s {
            0 => None,
            mib => Some(mib << 20),
        },
        previous_owner_gone: false,
    })
}

fn to_owner_op(op: VolumeOp, payload: Bytes) -> Op {
    match op {
        VolumeOp::Read { offset, len } => Op::Read { offset, len },
        VolumeOp::Write { offset, .. } => Op::Write {
            offset,
            data: payload,
        },
        VolumeOp::Flush => Op::Flush,
        VolumeOp::Repair { component, offset } => Op::Repair { component, offset },
        VolumeOp::Trim { offset, len } | VolumeOp::WriteZeroes { offset, len } => Op::Zero {
            offset,
            len: len as u64,
        },
    }
}

/// Final errors a client sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IoFailure {
    OutOfRange,
    NoSpace,
    Gone,
    Io(String),
}

/// How long a lookup of a volume name this node does not know waits for
/// its directory to catch up with the leader before the name counts as
/// unknown: a heartbeat round and an apply, with room for a loaded
/// machine.
const LOOKUP_CATCH_UP: std::time::Duration = std::time::Duration::from_secs(2);

impl Router {
    /// The directory's state as this node has it, caught up with the
    /// leader first when it has no volume named `name` (one created
    /// through another node a moment ago: `Directory::catch_up`).
    pub async fn state_knowing(&self, name: &str) -> Arc<ClusterState> {
        let state = self.dir.state();
        if state.volume_by_name(name).is_some() {
            return state;
        }
        if let Err(e) = self.dir.catch_up(LOOKUP_CATCH_UP).await {
            tracing::info!(name, "could not catch up with the directory: {e}");
        }
        self.dir.state()
    }

    /// How this node proves itself to peers.
    pub fn peer_auth(&self) -> &shoal_rpc::PeerAuth {
        &self.cfg.peer_auth
    }

    /// The bytes component `component` takes on its device, asked of its
    /// node at `addr` ([`shoal_rpc::Request::Usage`]).
    pub async fn usage(
        &self,
        addr: &str,
        component: shoal_model::ComponentId,
    ) -> Result<u64, String> {
        let p = self.peer(addr).await.map_err(|e| e.to_string())?;
        let req = shoal_rpc::Request::Usage { component };
        match p.call(&req, Bytes::new(), Duration::from_secs(2)).await {
            Ok((shoal_rpc::Response::Usage { allocated_bytes }, _)) => Ok(allocated_bytes),
            Ok((other, _)) => Err(format!("unexpected answer {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    pub fn new(
        node: NodeId,
        dir: Directory,
        cfg: OwnerConfig,
        cluster_key: Option<Arc<shoal_crypt::ClusterKey>>,
    ) -> Router {
        Router {
            node,
            dir,
            cfg,
            cluster_key,
            owners: Mutex::new(HashMap::new()),
            retired: Mutex::new(HashMap::new()),
            claim_locks: Mutex::new(HashMap::new()),
            peers: tokio::sync::Mutex::new(HashMap::new()),
            failed_starts: Mutex::new(HashMap::new()),
            connections: Mutex::new(BTreeMap::new()),
            counters: Counters::default(),
            client_requests: AtomicUsize::new(0),
        }
    }

    fn local_owner(&self, v: VolumeId) -> Option<Owner> {
        let mut m = self.owners.lock().ok()?;
        match m.get(&v) {
            Some(o) if o.is_running() => Some(o.clone()),
            Some(_) => {
                if let Some(o) = m.remove(&v) {
                    self.retire(v, o);
                }
                None
            }
            None => None,
        }
    }

    /// A forwarded request for a volume the directory says this node owns,
    /// whose owner here ended (a change of its layout's kind restarts it):
    /// the volume is claimed again here, at once, without waiting out the
    /// ended owner's lease, rather than by the forwarding node, which
    /// would have to. Nothing when that is not the case; a claim that
    /// fails leaves the forwarding node to claim as before.
    async fn claim_again_here(&self, volume: VolumeId) {
        let generation = {
            let state = self.dir.state();
            let Some(v) = state.volumes.get(&volume) else {
                return;
            };
            let Ok(retired) = self.retired.lock() else {
                return;
            };
            let ended_here = retired
                .get(&volume)
                .is_some_and(|o| o.generation() == v.generation);
            if v.owner != Some(self.node) || !ended_here {
                return;
            }
            v.generation
        };
        if let Err(e) = self.claim(volume, generation).await {
            tracing::debug!(volume, "not claimed again here: {e}");
        }
    }

    /// Keeps owner `o` of `volume`, out of service here, for the next claim
    /// ([`Router::retired`]).
    fn retire(&self, volume: VolumeId, o: Owner) {
        if let Ok(mut r) = self.retired.lock() {
            r.insert(volume, o.end());
        }
    }

    /// Whether the owner of `volume` at generation `generation` ran here
    /// and has ended every loop, waiting up to [`OWN_STOP_WAIT`] for it.
    async fn own_owner_stopped(&self, volume: VolumeId, generation: Generation) -> bool {
        let retired = self
            .retired
            .lock()
            .ok()
            .and_then(|r| r.get(&volume).cloned());
        let Some(o) = retired.filter(|o| o.generation() == generation) else {
            return false;
        };
        let until = Instant::now() + OWN_STOP_WAIT;
        while !o.has_ended() {
            if Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// The IOPS limit of every volume owned here now, with what it held
    /// back.
    pub fn throttles(&self) -> Vec<(VolumeId, shoal_owner::throttle::ThrottleStats)> {
        self.owners
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, o)| o.is_running())
                    .map(|(v, o)| (*v, o.throttle_stats()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The capacity leg of every erasure-coded volume owned here now, as
    /// its owner last published it.
    pub fn tiers(&self) -> Vec<(VolumeId, shoal_owner::status::TierStatus)> {
        self.owners
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, o)| o.is_running())
                    .filter_map(|(v, o)| Some((*v, o.tier_status()?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The healing status of every volume owned here now, as its owner
    /// last reported it.
    pub fn healing(&self) -> Vec<(VolumeId, shoal_owner::status::HealingStatus)> {
        self.owners
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, o)| o.is_running())
                    .map(|(v, o)| (*v, o.healing()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Makes sure `volume` has an owner here, claiming it unless one runs
    /// here already: for a volume that needs one without client I/O
    /// (`crate::caretaker`).
    pub async fn ensure_owned(&self, volume: VolumeId) -> Result<(), String> {
        if self.local_owner(volume).is_some() {
            return Ok(());
        }
        let generation = self
            .dir
            .state()
            .volumes
            .get(&volume)
            .map(|v| v.generation)
            .ok_or("volume deleted")?;
        self.claim(volume, generation).await
    }

    /// Volumes owned here now.
    pub fn owned(&self) -> Vec<VolumeId> {
        self.owners
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(_, o)| o.is_running())
                    .map(|(v, _)| *v)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Passes a new directory state to the local owners; stops owners of
    /// deleted volumes.
    pub fn directory_changed(&self, state: &ClusterState) {
        let Ok(mut m) = self.owners.lock() else {
            return;
        };
        m.retain(|vid, o| hand_view(state, *vid, o, |o| self.retire(*vid, o.clone())));
        drop(m);
        if let Ok(mut r) = self.retired.lock() {
            r.retain(|vid, _| state.volumes.contains_key(vid));
        }
    }

    async fn peer(&self, addr: &str) -> Result<Arc<Peer>, RpcError> {
        // One connection per peer: concurrent callers wait for the first
        // one's connect instead of opening their own.
        let mut m = self.peers.lock().await;
        if let Some(p) = m.get(addr) {
            if !p.is_closed() {
                return Ok(p.clone());
            }
        }
        let p =
            Arc::new(Peer::connect(addr, Duration::from_millis(1000), &self.cfg.peer_auth).await?);
        m.insert(addr.to_string(), p.clone());
        Ok(p)
    }

    /// Takes ownership of `volume` if it is still at `expected`, and starts
    /// the owner. Errors mean "retry".
    async fn claim(&self, volume: VolumeId, expected: Generation) -> Result<(), String> {
        let lock = {
            let mut m = self.claim_locks.lock().map_err(|_| "poisoned")?;
            m.entry(volume).or_default().clone()
        };
        let _g = lock.lock().await;
        if self.local_owner(volume).is_some() {
            return Ok(());
        }
        if let Some(why) = self.recently_failed(volume) {
            return Err(why);
        }
        // Others may have claimed while we waited: only claim from the
        // generation we saw if nobody moved it since.
        let state = self.dir.state();
        let Some(v) = state.volumes.get(&volume) else {
            return Err("volume deleted".into());
        };
        if v.generation != expected {
            return Err(format!(
                "generation moved to {} while waiting",
                v.generation
            ));
        }
        // This node's own owner of that generation, ended: no lease of it
        // can serve a read (a policy change between RAID-1 and an
        // erasure-coded layout restarts the owner here).
        let own_stopped =
            v.owner == Some(self.node) && self.own_owner_stopped(volume, expected).await;
        let (gen, previous_owner_gone) = match self
            .dir
            .propose(Command::ClaimOwner {
                volume,
                node: self.node,
                expected_generation: expected,
            })
            .await
        {
            // Decided by the directory as it applied the claim: a node
            // that started again since it claimed runs no owner it had.
            Ok(Response::Claimed {
                generation,
                previous_owner_gone,
            }) => (generation, previous_owner_gone),
            Ok(other) => return Err(format!("unexpected answer {other:?}")),
            Err(e) => return Err(e.to_string()),
        };
        self.counters.claims.fetch_add(1, Ordering::Relaxed);
        tracing::info!(volume, generation = gen, "claimed ownership");
        let mut view = view_of(&self.dir.state(), volume).ok_or("volume deleted")?;
        // The local copy of the directory may lag behind the claim.
        view.volume.generation = gen;
        view.volume.owner = Some(self.node);
        view.previous_owner_gone = previous_owner_gone || own_stopped;
        let control = Arc::new(DirControl {
            dir: self.dir.clone(),
            node: self.node,
        });
        let owner = match Owner::start(self.cfg.clone(), view, gen, control).await {
            Ok(o) => o,
            Err(e) => {
                let why = format!("its copies refused activation: {e}");
                self.start_failed(volume, &why).await;
                return Err(why);
            }
        };
        if let Ok(mut m) = self.owners.lock() {
            // What the directory changed while the owner started (a change
            // begun meanwhile) reached no owner: it gets it now.
            if hand_view(&self.dir.state(), volume, &owner, |o| {
                self.retire(volume, o.clone())
            }) {
                m.insert(volume, owner);
            }
        }
        self.start_succeeded(volume).await;
        Ok(())
    }

    /// An owner could not start: remember when (this node waits
    /// [`START_RETRY_PAUSE`] before claiming again) and say why in the
    /// directory, where health shows it.
    async fn start_failed(&self, volume: VolumeId, why: &str) {
        if let Ok(mut m) = self.failed_starts.lock() {
            m.insert(volume, (Instant::now(), why.to_string()));
        }
        let mut why = why.to_string();
        if why.len() > shoal_model::MAX_PROBLEM_BYTES {
            let mut end = shoal_model::MAX_PROBLEM_BYTES;
            while !why.is_char_boundary(end) {
                end -= 1;
            }
            why.truncate(end);
        }
        let known = self
            .dir
            .state()
            .volumes
            .get(&volume)
            .map(|v| v.problem.clone());
        if known.is_some_and(|p| p.as_deref() != Some(why.as_str())) {
            let cmd = Command::SetVolumeProblem {
                volume,
                problem: Some(why),
            };
            if let Err(e) = self.dir.propose(cmd).await {
                tracing::warn!(volume, "cannot record the volume's problem: {e}");
            }
        }
    }

    /// An owner started: the volume's problem, if one was recorded, is over.
    async fn start_succeeded(&self, volume: VolumeId) {
        if let Ok(mut m) = self.failed_starts.lock() {
            m.remove(&volume);
        }
        let had = self
            .dir
            .state()
            .volumes
            .get(&volume)
            .is_some_and(|v| v.problem.is_some());
        if had {
            let cmd = Command::SetVolumeProblem {
                volume,
                problem: None,
            };
            if let Err(e) = self.dir.propose(cmd).await {
                tracing::warn!(volume, "cannot clear the volume's problem: {e}");
            }
        }
    }

    /// Why this node should not claim `volume` yet: its last owner here
    /// failed to start less than [`START_RETRY_PAUSE`] ago.
    fn recently_failed(&self, volume: VolumeId) -> Option<String> {
        let m = self.failed_starts.lock().ok()?;
        let (at, why) = m.get(&volume)?;
        (at.elapsed() < START_RETRY_PAUSE).then(|| why.clone())
    }

    /// Serves one client operation like [`io`](Self::io), but hands it to
    /// a local owner now, before the returned future is first polled: the
    /// NBD reader submits a whole burst of requests in arrival order before
    /// any of their tasks runs, and the owner takes them together.
    pub fn start_io(
        self: &Arc<Self>,
        volume: VolumeId,
        op: VolumeOp,
        payload: Bytes,
    ) -> impl std::future::Future<Output = Result<Bytes, IoFailure>> + Send + 'static {
        let started = Instant::now();
        let first = self
            .local_owner(volume)
            .map(|o| o.submit(to_owner_op(op, payload.clone())));
        let me = self.clone();
        async move {
            if let Some(s) = first {
                match s.wait().await {
                    Ok(b) => return Ok(b),
                    Err(e) => {
                        if let Some(f) = me.final_failure(&e) {
                            return Err(f);
                        }
                        // Deposed, stopped, unavailable: the full path
                        // waits through it (and finds the new owner).
                    }
                }
            }
            me.io_boxed(volume, op, payload, started).await
        }
    }

    /// [`Router::io`] on the heap. Its state is large (about 11 KiB), and
    /// the fast path of `start_io` would otherwise carry it, and copy it,
    /// for every request. Built in a plain function, so that the unboxed
    /// future is never part of the caller's state.
    fn io_boxed(
        self: Arc<Self>,
        volume: VolumeId,
        op: VolumeOp,
        payload: Bytes,
        started: Instant,
    ) -> Pin<Box<dyn Future<Output = Result<Bytes, IoFailure>> + Send>> {
        Box::pin(async move { self.io_since(volume, op, payload, started).await })
    }

    /// The client's answer for an owner error that retrying cannot change
    /// (counted as a failed request if it is an I/O error), or None.
    fn final_failure(&self, e: &OwnerError) -> Option<IoFailure> {
        match e {
            OwnerError::OutOfRange => Some(IoFailure::OutOfRange),
            OwnerError::NoSpace => Some(IoFailure::NoSpace),
            // Every copy of a block is bad: not a pause to wait out.
            OwnerError::Io(msg) => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                Some(IoFailure::Io(msg.clone()))
            }
            _ => None,
        }
    }

    /// Serves one client operation, waiting through ownership changes
    /// for at most the I/O wait bound, after which it fails.
    pub async fn io(
        &self,
        volume: VolumeId,
        op: VolumeOp,
        payload: Bytes,
    ) -> Result<Bytes, IoFailure> {
        self.io_since(volume, op, payload, Instant::now()).await
    }

    /// [`Router::io`] of an operation the client sent at `started`.
    async fn io_since(
        &self,
        volume: VolumeId,
        op: VolumeOp,
        payload: Bytes,
        started: Instant,
    ) -> Result<Bytes, IoFailure> {
        let deadline = started + self.cfg.io_wait;
        let mut last = String::from("no owner yet");
        let out = tokio::time::timeout_at(deadline.into(), async {
            self.io_until(volume, op, payload, deadline, &mut last)
                .await
        })
        .await;
        out.unwrap_or_else(|_| {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
            Err(IoFailure::Io(format!(
                "volume unavailable for {:?} (the I/O wait bound): {last}",
                self.cfg.io_wait
            )))
        })
    }

    /// [`Router::io`] until `deadline`, noting in `last` why the volume
    /// did not serve yet.
    async fn io_until(
        &self,
        volume: VolumeId,
        op: VolumeOp,
        payload: Bytes,
        deadline: Instant,
        last: &mut String,
    ) -> Result<Bytes, IoFailure> {
        loop {
            let state = self.dir.state();
            let Some(v) = state.volumes.get(&volume) else {
                return Err(IoFailure::Gone);
            };
            if let Some(o) = self.local_owner(volume) {
                match o.execute(to_owner_op(op, payload.clone())).await {
                    Ok(b) => return Ok(b),
                    Err(e) => {
                        if let Some(f) = self.final_failure(&e) {
                            return Err(f);
                        }
                        if matches!(e, OwnerError::Deposed | OwnerError::Stopped) {
                            // The owner that failed, not one started since.
                            let failed = o.generation();
                            let removed = self.owners.lock().ok().and_then(|mut m| {
                                let same =
                                    m.get(&volume).is_some_and(|cur| cur.generation() == failed);
                                if same {
                                    m.remove(&volume)
                                } else {
                                    None
                                }
                            });
                            if let Some(o) = removed {
                                self.retire(volume, o);
                            }
                            *last = "owner deposed".into();
                        } else {
                            *last = e.to_string();
                            tokio::time::sleep(RETRY_PAUSE).await;
                        }
                        continue;
                    }
                }
            }
            let owner_node = v.owner.and_then(|o| state.nodes.get(&o));
            match owner_node {
                Some(n) if n.id != self.node && n.state == NodeState::Up => {
                    self.counters.forwarded.fetch_add(1, Ordering::Relaxed);
                    let forward = async {
                        let p = self.peer(&n.peer_addr).await?;
                        // Never past the client's bound.
                        let left = deadline.saturating_duration_since(Instant::now());
                        p.call(
                            &Request::VolumeIo { volume, op },
                            payload.clone(),
                            FORWARD_TIMEOUT.min(left),
                        )
                        .await
                    };
                    // An owner whose node the directory marks down (or that
                    // is replaced) will not answer: stop waiting for it and
                    // go to the new owner at once.
                    let r = tokio::select! {
                        r = forward => r,
                        () = self.owner_changes(volume, n.id, v.generation) => {
                            *last = format!("owner node {} went away", n.id);
                            continue;
                        }
                    };
                    match r {
                        Ok((_, data)) => return Ok(data),
                        Err(RpcError::Remote(RemoteError::OutOfRange)) => {
                            return Err(IoFailure::OutOfRange)
                        }
                        Err(RpcError::Remote(RemoteError::NoSpace)) => {
                            return Err(IoFailure::NoSpace)
                        }
                        Err(RpcError::Remote(RemoteError::Io(e))) => {
                            self.counters.errors.fetch_add(1, Ordering::Relaxed);
                            return Err(IoFailure::Io(e));
                        }
                        Err(RpcError::Remote(RemoteError::NotOwner { .. })) => {
                            // It does not own it (restarted, or deposed): take over.
                            if let Err(e) = self.claim(volume, v.generation).await {
                                *last = e;
                                tokio::time::sleep(RETRY_PAUSE).await;
                            }
                        }
                        Err(e) => {
                            // Wait for the directory to notice a dead owner.
                            *last = e.to_string();
                            tokio::time::sleep(RETRY_PAUSE).await;
                        }
                    }
                }
                _ => {
                    if let Err(e) = self.claim(volume, v.generation).await {
                        *last = e;
                        tokio::time::sleep(RETRY_PAUSE).await;
                    }
                }
            }
        }
    }

    /// Returns once the directory no longer has `node` up as the owner of
    /// `volume` at `generation`.
    async fn owner_changes(&self, volume: VolumeId, node: NodeId, generation: Generation) {
        let mut w = self.dir.watch();
        loop {
            let moved = {
                let s = w.borrow_and_update();
                let v = s.volumes.get(&volume);
                let up = s.nodes.get(&node).map(|n| n.state) == Some(NodeState::Up);
                v.is_none_or(|v| v.owner != Some(node) || v.generation != generation) || !up
            };
            if moved || w.changed().await.is_err() {
                return;
            }
        }
    }

    /// Serves I/O forwarded by another node: only a local owner may answer.
    pub async fn serve_forwarded(
        &self,
        volume: VolumeId,
        op: VolumeOp,
        payload: Bytes,
    ) -> Result<Bytes, RemoteError> {
        let mut owner = self.local_owner(volume);
        if owner.is_none() {
            // A claim in progress here finishes before we answer.
            let lock = self
                .claim_locks
                .lock()
                .ok()
                .and_then(|m| m.get(&volume).cloned());
            if let Some(lock) = lock {
                let _g = lock.lock().await;
                owner = self.local_owner(volume);
            }
        }
        let Some(o) = owner else {
            // Claimed again here if its owner here ended, but this request
            // is not served: the forwarding node gives it up as the claim
            // moves the generation and sends it again, so serving this copy
            // too could apply it after a later write.
            self.claim_again_here(volume).await;
            return Err(RemoteError::NotOwner { volume });
        };
        let bounded = tokio::time::timeout(self.cfg.io_wait, async {
            let answer = o.execute(to_owner_op(op, payload)).await;
            if matches!(answer, Err(OwnerError::Stopped)) {
                // Stopped under the request by a change of the layout's
                // kind: its successor starts here (the request is sent
                // again, as above).
                self.claim_again_here(volume).await;
            }
            answer
        });
        let Ok(answer) = bounded.await else {
            return Err(RemoteError::Unavailable(format!(
                "the owner could not serve within {:?}",
                self.cfg.io_wait
            )));
        };
        answer.map_err(|e| match e {
            OwnerError::OutOfRange => RemoteError::OutOfRange,
            OwnerError::NoSpace => RemoteError::NoSpace,
            OwnerError::Io(e) => RemoteError::Io(e),
            OwnerError::Deposed | OwnerError::Stopped => RemoteError::NotOwner { volume },
            other => RemoteError::Unavailable(other.to_string()),
        })
    }
}

/// Hands owner `o` of `volume` its view of `state`. Answers whether it
/// stays: an owner of a deleted volume stops, and so does one whose
/// volume's layout changed kind (a change of policy between RAID-1 and an
/// erasure-coded layout committed: the next I/O claims the volume again
/// with the owner of its new kind).
///
/// `retire` is handed an owner that stops before it is told to, so that
/// a request it fails as stopped finds it retired ([`Router::retired`]).
fn hand_view(
    state: &ClusterState,
    volume: VolumeId,
    o: &Owner,
    retire: impl FnOnce(&Owner),
) -> bool {
    match view_of(state, volume) {
        Some(view) if view.volume.stripe.is_some() != o.is_tiered() => {
            tracing::info!(
                volume,
                "the volume's layout changed kind: its owner restarts"
            );
            retire(o);
            o.stop();
            false
        }
        Some(view) => {
            o.update(view);
            let running = o.is_running();
            if !running {
                retire(o);
            }
            running
        }
        None => {
            retire(o);
            o.stop();
            false
        }
    }
}
