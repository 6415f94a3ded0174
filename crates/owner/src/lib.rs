//! # shoal-owner: the one coordinator of a volume's I/O
//!
//! While a node owns a volume (under a generation the directory granted),
//! every read and write of that volume goes through its [`Owner`]: one task
//! driven by one loop of typed events, in the manner of Crucible's upstairs.
//! It fans writes out to every replica in one order, acknowledges a write
//! once it is durable on every replica that is up and on enough votes,
//! reads from one in-sync replica, marks replicas that fail absent (through
//! the directory, before acknowledging a write that skipped them),
//! reconciles what a dead predecessor left in flight, and resyncs replicas
//! that come back.
//!
//! Owns: the in-memory state of one owned volume. Must never touch devices
//! (it talks to replicas, even local ones, through `shoal-rpc`) and never
//! decides cluster state itself: it asks the directory through [`Control`].

pub mod capacity;
mod event_loop;
pub mod lease;
pub mod pace;
pub mod status;
pub mod stripes;
pub mod throttle;

use bytes::Bytes;
use shoal_model::{
    Component, ComponentId, ComponentRole, ComponentState, Generation, NodeId, Volume, VolumeId,
};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// Granularity of the regions replicas remember as dirty and of resync
/// copies, in bytes: large enough to keep the dirty sets tiny, small enough
/// that one copy step holds client writes back for well under a millisecond
/// on local disks.
pub const REGION: u64 = 1 << 20;

/// The repair delay until the directory says otherwise, as vSAN's: an
/// hour, long enough for a host to reboot or be patched without its data
/// being moved.
pub const DEFAULT_REPAIR_DELAY: Duration = Duration::from_secs(3600);

/// Tunables of an owner.
#[derive(Debug, Clone)]
pub struct OwnerConfig {
    /// This node; reads prefer a replica here.
    pub node: NodeId,
    /// How long a replica may take to answer one request before it is
    /// considered failed and marked absent, in seconds. Longer than any
    /// healthy fdatasync; short enough that a hung host pauses clients only
    /// briefly.
    pub io_timeout: Duration,
    /// Interval of barriers, witness pings and lease renewals.
    pub tick: Duration,
    /// How long a client request may wait for its volume to serve it
    /// (owner failover, no quorum, no read lease) before it fails with an
    /// I/O error the client sees, like vSAN's all-paths-down timeout:
    /// retried meanwhile, never left hanging. 30 s by default, the SCSI
    /// command timeout guests are used to; longer than a failover (under
    /// 5 s) by a wide margin.
    pub io_wait: Duration,
    /// How connections to replicas are proven (a node: its certificate).
    pub peer_auth: shoal_rpc::PeerAuth,
}

impl Default for OwnerConfig {
    fn default() -> Self {
        OwnerConfig {
            node: 0,
            io_timeout: Duration::from_secs(3),
            tick: Duration::from_millis(200),
            io_wait: Duration::from_secs(30),
            // Only tests run an owner against servers of their own.
            peer_auth: shoal_rpc::PeerAuth::Unauthenticated,
        }
    }
}

/// One component and where to reach it, as the directory says now.
#[derive(Debug, Clone)]
pub struct Target {
    pub component: Component,
    /// Peer RPC address of the component's node.
    pub addr: String,
    /// The directory believes the node is up.
    pub node_up: bool,
}

/// What the owner needs to know of the directory's state for its volume.
#[derive(Debug, Clone)]
pub struct View {
    pub volume: Volume,
    pub targets: Vec<Target>,
    /// How long a copy out of service because its host is unreachable is
    /// waited for before the owner rebuilds it elsewhere (the cluster's
    /// repair delay). A copy whose device failed is rebuilt at once.
    pub repair_delay: Duration,
    /// Static limit of the copy rate of resyncs and rebuilds, in bytes per
    /// second (None: as fast as the copies go).
    pub resync_bytes_per_s: Option<u64>,
    /// The previous owner is certainly gone: its node has started again
    /// since it claimed the volume, or it ran in this process and every
    /// loop of it has ended ([`OwnerEnd::has_ended`]). No read lease it
    /// holds can still serve a read, so a new owner need not wait out what
    /// the copies report.
    pub previous_owner_gone: bool,
}

/// Bytes of the map log an erasure-coded volume of `volume_bytes` keeps
/// past its end on the performance leg (`docs/erasure-coding.md`).
pub fn map_log_bytes(volume_bytes: u64) -> u64 {
    stripes::log_records_for(volume_bytes) * stripes::BLOCK_BYTES as u64
}

impl View {
    /// The view of the RAID-1 layout the event loop serves: an
    /// erasure-coded volume's performance leg, without its stripe columns
    /// (the capacity leg, `docs/erasure-coding.md`), and [`map_log_bytes`]
    /// longer for the map log; a RAID-1 volume's view unchanged.
    pub fn performance_leg(mut self) -> View {
        let is_stripe = |c: &Component| matches!(c.role, ComponentRole::Stripe { .. });
        self.targets.retain(|t| !is_stripe(&t.component));
        self.volume.components.retain(|c| !is_stripe(c));
        // A change of the capacity leg only is none of the loop's: with
        // nothing left to add or drop it would find the change ready and
        // end it. (A change of the policy alone, naming no component,
        // stays the loop's.)
        let kept: Vec<ComponentId> = self.volume.components.iter().map(|c| c.id).collect();
        let stripes_only = self.volume.reconfig.as_mut().is_some_and(|r| {
            let named = r.added.len() + r.remove.len();
            r.added.retain(|id| kept.contains(id));
            r.remove.retain(|id| kept.contains(id));
            named > 0 && r.added.is_empty() && r.remove.is_empty()
        });
        // A RAID-1 volume gaining a capacity leg (a change to RAID-5/6)
        // is a change of its policy only, for this loop: it commits it
        // (the columns are created by the erasure-coded owner that
        // follows).
        if stripes_only && self.volume.stripe.is_some() {
            self.volume.reconfig = None;
        }
        // The map log lives past the volume's end, on this leg: during a
        // growth, at both its places (the new one past the old).
        if self.volume.stripe.is_some() {
            let v = &self.volume;
            let log = match v.grow_to {
                Some(to) => stripes::LogPlace::grown(v, to),
                None => stripes::LogPlace::of(v),
            };
            self.volume.size = log.end();
        }
        self
    }
}

/// Why the directory did not record a change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// Another owner holds a newer generation: this one is deposed.
    #[error("another owner holds a newer generation")]
    Conflict,
    /// The directory cannot decide now (no leader, partition); retry.
    #[error("directory unavailable: {0}")]
    Unavailable(String),
    /// The directory refused the change for what it is (a component it
    /// no longer has, a reconfiguration that cannot be placed or is not
    /// in sync); retrying the same request will not help.
    #[error("refused: {0}")]
    Refused(String),
}

/// One end of a reconfiguration, as the owner proposes it: which change
/// (the components it added and those it drops) and how it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChangeEnd {
    pub added: Vec<ComponentId>,
    pub remove: Vec<ComponentId>,
    /// Committed (the new layout) rather than aborted (the old one).
    pub commit: bool,
}

/// The owner's way to the directory.
pub trait Control: Send + Sync + 'static {
    /// Records a component state, accepted only under the current generation.
    fn set_component_state(
        &self,
        volume: VolumeId,
        component: ComponentId,
        state: ComponentState,
        generation: Generation,
    ) -> impl Future<Output = Result<(), ControlError>> + Send;
    /// Raises the generation from `expected` (compare-and-set), keeping this
    /// node as owner; used to fence stale frames before a resync.
    fn reclaim(
        &self,
        volume: VolumeId,
        expected: Generation,
    ) -> impl Future<Output = Result<Generation, ControlError>> + Send;
    /// Ends the volume's reconfiguration in progress (`docs/reconfiguration.md`),
    /// accepted only under the current generation. Proposing it again
    /// after a lost answer is safe: an end that already happened answers
    /// Ok.
    fn end_reconfig(
        &self,
        volume: VolumeId,
        generation: Generation,
        end: ChangeEnd,
    ) -> impl Future<Output = Result<(), ControlError>> + Send;
    /// Ends an erasure-coded volume's growth to `size` bytes
    /// (`docs/erasure-coding.md`, Growing), its map log now at byte
    /// `map_log_at` of the performance leg (None: at the new end),
    /// accepted only under the current generation. Proposing it again
    /// after a lost answer is safe.
    fn commit_growth(
        &self,
        volume: VolumeId,
        generation: Generation,
        size: u64,
        map_log_at: Option<u64>,
    ) -> impl Future<Output = Result<(), ControlError>> + Send;
    /// Begins a reconfiguration that rebuilds each of `components` on a
    /// device placement chooses (another fault domain), dropping them at
    /// the commit. `Refused` says why it cannot be placed.
    fn begin_rebuild(
        &self,
        volume: VolumeId,
        generation: Generation,
        components: Vec<ComponentId>,
    ) -> impl Future<Output = Result<(), ControlError>> + Send;
}

/// Why an I/O failed. Callers branch on it: `Deposed` and `Stopped` mean
/// "find the new owner", `Unavailable` means "retry later".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OwnerError {
    #[error("this node no longer owns the volume")]
    Deposed,
    #[error("owner stopped")]
    Stopped,
    #[error("volume unavailable: {0}")]
    Unavailable(String),
    #[error("I/O past the end of the volume")]
    OutOfRange,
    #[error("no space left on the devices")]
    NoSpace,
    #[error("I/O error: {0}")]
    Io(String),
    /// A request no owner carries out as asked (an internal caller's
    /// mistake, never a client's: clients' requests are checked first).
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// A client operation.
#[derive(Debug, Clone)]
pub enum Op {
    Read {
        offset: u64,
        len: u32,
    },
    Write {
        offset: u64,
        data: Bytes,
    },
    Flush,
    /// Trim and write-zeroes: both read back as zeros afterwards.
    Zero {
        offset: u64,
        len: u64,
    },
    /// Zero (trim) each of `ranges`, (offset, len) in bytes, in order and
    /// apart (`shoal_rpc::trim_span`): one request to each copy. Not a
    /// client's: an erasure-coded volume's owner trims what a stripe took
    /// off its performance leg with it.
    Trim {
        ranges: Vec<(u64, u64)>,
    },
    /// Block `offset` of `component` failed its checksum (found by a
    /// scrubber): rewrite it from a healthy copy. Answers with one byte, 1
    /// if the block was replaced, 0 if it had been rewritten since.
    Repair {
        component: ComponentId,
        offset: u64,
    },
}

pub(crate) enum Event {
    Io(Op, oneshot::Sender<Result<Bytes, OwnerError>>),
    /// Boxed: a view is large, and the loop's queue holds mostly I/O.
    View(Box<View>),
    Stop,
    Internal(event_loop::Internal),
}

/// The in-sync copy on the owner's own node, published by the loop for
/// reads that skip it ([`Owner::execute`]).
pub(crate) struct LocalRead {
    pub(crate) component: ComponentId,
    pub(crate) generation: Generation,
    pub(crate) size: u64,
    pub(crate) timeout: Duration,
    pub(crate) peer: Arc<shoal_rpc::Peer>,
}

/// Where reads may go without the loop: set by the loop while the local
/// copy is in sync, cleared before any write is acknowledged without it.
pub(crate) type ReadRoute = Arc<std::sync::RwLock<Option<LocalRead>>>;

/// An operation handed to the owner ([`Owner::submit`]), its answer to come.
pub struct Submitted {
    state: SubmitState,
    /// When a client read, write or zeroing was admitted, and where its
    /// latency is recorded once answered (for the resync's adaptive pace).
    timed: Option<(Instant, Arc<pace::ClientLatency>)>,
}

enum SubmitState {
    /// Through the loop.
    Loop(oneshot::Receiver<Result<Bytes, OwnerError>>),
    /// A read sent straight to the local in-sync copy.
    Local {
        /// The loop, for a read that fails there.
        tx: mpsc::UnboundedSender<Event>,
        pending: shoal_rpc::PendingReply,
        timeout: Duration,
        offset: u64,
        len: u32,
    },
    Stopped,
    /// A read of an erasure-coded volume's destaged blocks, sent to its
    /// columns without the loop (`TieredOwner::read_stripes`).
    Stripes(std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, OwnerError>> + Send>>),
    /// Over the volume's IOPS limit: sent to the owner at `at`.
    Throttled {
        owner: Owner,
        op: Op,
        at: Instant,
    },
}

impl Submitted {
    /// The operation's answer. A local read that fails (a bad block, a
    /// failed device, a newer owner) is done again through the loop, which
    /// handles the error as for any read.
    pub async fn wait(self) -> Result<Bytes, OwnerError> {
        let answer = Self::answer(self.state).await;
        if let Some((started, latency)) = self.timed {
            latency.record(started.elapsed());
        }
        answer
    }

    async fn answer(state: SubmitState) -> Result<Bytes, OwnerError> {
        match state {
            SubmitState::Loop(rx) => rx.await.map_err(|_| OwnerError::Stopped)?,
            SubmitState::Stopped => Err(OwnerError::Stopped),
            SubmitState::Stripes(read) => read.await,
            SubmitState::Throttled { owner, op, at } => Self::wait_throttled(owner, op, at).await,
            SubmitState::Local {
                tx,
                pending,
                timeout,
                offset,
                len,
            } => Self::wait_local(tx, pending, timeout, offset, len).await,
        }
    }

    /// A throttled operation's answer: it waits for its turn, then goes
    /// its way. On the heap, as a local read.
    fn wait_throttled(
        owner: Owner,
        op: Op,
        at: Instant,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, OwnerError>> + Send>>
    {
        Box::pin(async move {
            tokio::time::sleep_until(at.into()).await;
            owner.submit_admitted(op).wait().await
        })
    }

    /// A local read's answer, on the heap: its state is large, and writes,
    /// which never take this path, should not carry it. Built in a plain
    /// function, so that the unboxed future is never part of `wait`'s state.
    fn wait_local(
        owner: mpsc::UnboundedSender<Event>,
        pending: shoal_rpc::PendingReply,
        timeout: Duration,
        offset: u64,
        len: u32,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<Bytes, OwnerError>> + Send>>
    {
        Box::pin(async move {
            match pending.wait(timeout).await {
                Ok((_, data)) if data.len() == len as usize => Ok(data),
                _ => {
                    let (tx, rx) = oneshot::channel();
                    owner
                        .send(Event::Io(Op::Read { offset, len }, tx))
                        .map_err(|_| OwnerError::Stopped)?;
                    rx.await.map_err(|_| OwnerError::Stopped)?
                }
            }
        })
    }
}

/// Handle to a running owner. Cheap to clone.
#[derive(Clone)]
pub struct Owner {
    tx: mpsc::UnboundedSender<Event>,
    /// Of an erasure-coded volume: the loop in front of this RAID-1 loop
    /// of its performance leg, which every operation goes through.
    tier: Option<Arc<capacity::TieredOwner>>,
    volume: VolumeId,
    route: ReadRoute,
    /// The read lease: reads around the loop are sent only while it holds.
    lease: Arc<lease::Lease>,
    /// The volume's IOPS limit, kept here, before the loop: every I/O of
    /// the volume passes through `submit`.
    throttle: Arc<throttle::Throttle>,
    /// Latencies of the clients' operations, which the loop's adaptive
    /// resync pace reads.
    latency: Arc<pace::ClientLatency>,
    /// What the loop reports of the volume's healing.
    status: event_loop::SharedStatus,
    /// The loop's generation now (raised by its reclaims).
    generation: Arc<std::sync::atomic::AtomicU64>,
    /// Set once the RAID-1 loop has ended.
    ended: Ended,
}

/// Set as the last act of a loop that has ended for good: its channel is
/// closed (its handles refuse every operation), its lease over and its
/// read route withdrawn, so it sends nothing any more (a read it sent
/// before may still be on its way, concurrent with anything after).
#[derive(Clone, Default, Debug)]
pub(crate) struct Ended(Arc<std::sync::atomic::AtomicBool>);

impl Ended {
    pub(crate) fn set(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    fn is_set(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// What a node keeps of an owner it ran, once out of service
/// ([`Owner::end`]): holds none of its state (an erasure-coded owner's map
/// is hundreds of MB), only whether it has ended and its generation.
#[derive(Clone, Debug)]
pub struct OwnerEnd {
    generation: Arc<std::sync::atomic::AtomicU64>,
    loops: Vec<Ended>,
}

impl OwnerEnd {
    /// The owner's last generation.
    pub fn generation(&self) -> Generation {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether every loop of the owner has ended: no lease of it can
    /// serve a read any more.
    pub fn has_ended(&self) -> bool {
        self.loops.iter().all(Ended::is_set)
    }
}

impl Owner {
    /// Activates the replicas under `generation`, reconciles what an earlier
    /// owner may have left half-written, and starts serving. Fails with
    /// `Unavailable` when the votes rule does not hold.
    ///
    /// An erasure-coded volume (`Volume::stripe`) gets its RAID-1 loop for
    /// the performance leg and, in front of it, the tiered loop of
    /// [`capacity::TieredOwner`]; the handle hides which.
    pub async fn start<C: Control>(
        cfg: OwnerConfig,
        view: View,
        generation: Generation,
        control: Arc<C>,
    ) -> Result<Owner, OwnerError> {
        if view.volume.stripe.is_none() {
            return Owner::start_mirror(cfg, view, generation, control).await;
        }
        let tier = capacity::TieredOwner::start(cfg, view, generation, control).await?;
        let mut owner = tier.leg().clone();
        owner.tier = Some(Arc::new(tier));
        Ok(owner)
    }

    /// The RAID-1 loop alone: of a RAID-1 volume, or of an erasure-coded
    /// volume's performance leg.
    pub(crate) async fn start_mirror<C: Control>(
        cfg: OwnerConfig,
        view: View,
        generation: Generation,
        control: Arc<C>,
    ) -> Result<Owner, OwnerError> {
        let volume = view.volume.id;
        let route = ReadRoute::default();
        let lease = Arc::new(lease::Lease::default());
        let throttle = Arc::new(throttle::Throttle::new(view.volume.policy.iops_limit));
        let status = event_loop::SharedStatus::default();
        let latency = Arc::new(pace::ClientLatency::default());
        let shared_generation = Arc::new(std::sync::atomic::AtomicU64::new(generation));
        let ended = Ended::default();
        let shared = event_loop::Shared {
            ended: ended.clone(),
            route: route.clone(),
            lease: lease.clone(),
            status: status.clone(),
            latency: latency.clone(),
            generation: shared_generation.clone(),
        };
        let tx =
            event_loop::start(cfg, view.performance_leg(), generation, control, shared).await?;
        Ok(Owner {
            tx,
            tier: None,
            volume,
            route,
            lease,
            throttle,
            latency,
            status,
            generation: shared_generation,
            ended,
        })
    }

    /// What a node keeps of this owner once it is out of service: its
    /// generation, and whether every loop of it has ended.
    pub fn end(&self) -> OwnerEnd {
        let mut loops = vec![self.ended.clone()];
        loops.extend(self.tier.as_ref().map(|t| t.ended()));
        OwnerEnd {
            generation: self.generation.clone(),
            loops,
        }
    }

    /// The owner's generation now: the one it activated its copies
    /// under, raised by each reclaim.
    pub fn generation(&self) -> Generation {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The volume's healing as the loop last reported it (every tick).
    pub fn healing(&self) -> status::HealingStatus {
        let leg = match self.status.lock() {
            Ok(s) => s.clone(),
            Err(e) => e.into_inner().clone(),
        };
        match &self.tier {
            Some(t) => leg.with_columns(&t.status()),
            None => leg,
        }
    }

    /// Whether this owner serves an erasure-coded volume (its tiered loop
    /// in front of the performance leg's).
    pub fn is_tiered(&self) -> bool {
        self.tier.is_some()
    }

    /// An erasure-coded volume's capacity leg as its owner sees it (None
    /// for RAID-1).
    pub fn tier_status(&self) -> Option<status::TierStatus> {
        self.tier.as_ref().map(|t| t.status())
    }

    /// The IOPS limit in force and what it has held back.
    pub fn throttle_stats(&self) -> throttle::ThrottleStats {
        self.throttle.stats()
    }

    pub fn volume(&self) -> VolumeId {
        self.volume
    }

    /// False once the owner stopped or was deposed.
    pub fn is_running(&self) -> bool {
        !self.tx.is_closed() && self.tier.as_ref().is_none_or(|t| t.is_running())
    }

    /// Runs one operation; reads answer data, everything else empty bytes.
    ///
    /// A read goes straight to the in-sync copy on this node when there is
    /// one, as the loop would send it, without a round through the loop.
    /// Whatever goes wrong there (a bad block, a failed device, a newer
    /// owner) is left to the loop, which reads the block again and handles
    /// the error.
    pub async fn execute(&self, op: Op) -> Result<Bytes, OwnerError> {
        self.submit(op).wait().await
    }

    /// Starts one operation now (it takes its place in the volume's order
    /// at this call, not when the answer is awaited) and returns its
    /// answer to come. A caller that reads a burst of requests submits
    /// them all before awaiting any, so the loop sees them together: one
    /// frame per replica connection and one group commit for the burst.
    ///
    /// Reads, writes and zeroing count against the volume's IOPS limit; one
    /// over it is sent when its turn comes (flushes never wait).
    pub fn submit(&self, op: Op) -> Submitted {
        let units = match &op {
            Op::Read { len, .. } => throttle::units(u64::from(*len)),
            Op::Write { data, .. } => throttle::units(data.len() as u64),
            // A trim or zeroing of any size is one request to the copies.
            Op::Zero { .. } | Op::Trim { .. } => 1,
            Op::Flush | Op::Repair { .. } => 0,
        };
        if let Some(at) = self.throttle.admit(units, Instant::now()) {
            return Submitted {
                state: SubmitState::Throttled {
                    owner: self.clone(),
                    op,
                    at,
                },
                // Timed once admitted: the wait for its turn is the
                // limit's, not the copies'.
                timed: None,
            };
        }
        self.submit_admitted(op)
    }

    /// `submit` for an operation the IOPS limit has let through.
    fn submit_admitted(&self, op: Op) -> Submitted {
        let timed = matches!(
            op,
            Op::Read { .. } | Op::Write { .. } | Op::Zero { .. } | Op::Trim { .. }
        )
        .then(|| (Instant::now(), self.latency.clone()));
        if let Some(t) = &self.tier {
            if let Op::Read { offset, len } = op {
                if let Some(read) = t.read_stripes(offset, len) {
                    let state = SubmitState::Stripes(Box::pin(read));
                    return Submitted { state, timed };
                }
            }
            let state = match t.send(op) {
                Some(rx) => SubmitState::Loop(rx),
                None => SubmitState::Stopped,
            };
            return Submitted { state, timed };
        }
        if let Op::Read { offset, len } = op {
            if let Some((pending, timeout)) = self.read_local(offset, len) {
                let state = SubmitState::Local {
                    tx: self.tx.clone(),
                    pending,
                    timeout,
                    offset,
                    len,
                };
                return Submitted { state, timed };
            }
        }
        let (tx, rx) = oneshot::channel();
        let state = match self.tx.send(Event::Io(op, tx)) {
            Ok(()) => SubmitState::Loop(rx),
            Err(_) => SubmitState::Stopped,
        };
        Submitted { state, timed }
    }

    /// A read sent to the local in-sync copy, or None to go through the
    /// loop.
    fn read_local(&self, offset: u64, len: u32) -> Option<(shoal_rpc::PendingReply, Duration)> {
        // Without a lease the loop holds the read until one is renewed.
        if !self.lease.holds() {
            return None;
        }
        let route = self.route.read().ok()?;
        let r = route.as_ref()?;
        if offset.checked_add(len as u64)? > r.size {
            return None;
        }
        let req = shoal_rpc::Request::Read {
            component: r.component,
            generation: r.generation,
            offset,
            len,
        };
        // Sent under the lock: the loop cannot withdraw the route (and
        // then acknowledge a write without this copy) between the check
        // and the read taking its place among the copy's writes.
        Some((r.peer.send(&req, Bytes::new()).ok()?, r.timeout))
    }

    pub async fn read(&self, offset: u64, len: u32) -> Result<Bytes, OwnerError> {
        self.execute(Op::Read { offset, len }).await
    }

    /// Returns once durable on every replica that is up.
    pub async fn write(&self, offset: u64, data: Bytes) -> Result<(), OwnerError> {
        self.execute(Op::Write { offset, data }).await.map(|_| ())
    }

    pub async fn flush(&self) -> Result<(), OwnerError> {
        self.execute(Op::Flush).await.map(|_| ())
    }

    pub async fn zero(&self, offset: u64, len: u64) -> Result<(), OwnerError> {
        self.execute(Op::Zero { offset, len }).await.map(|_| ())
    }

    /// The directory changed: node liveness, size, components, the IOPS
    /// limit (in force for the next I/O).
    pub fn update(&self, view: View) {
        self.throttle.set_limit(view.volume.policy.iops_limit);
        if let Some(t) = &self.tier {
            t.update(view.clone());
        }
        let _ = self.tx.send(Event::View(Box::new(view.performance_leg())));
    }

    pub fn stop(&self) {
        if let Some(t) = &self.tier {
            t.stop();
        }
        let _ = self.tx.send(Event::Stop);
    }
}

#[cfg(test)]
mod view_tests {
    use super::*;
    use shoal_model::{Policy, Reconfig, StripeGeometry};

    /// The RAID-1 loop is handed an erasure-coded volume's performance leg
    /// only: its stripe columns leave the components, the targets and the
    /// change in progress.
    #[test]
    fn the_performance_leg_leaves_the_stripe_columns_out() {
        let comp = |id, role, votes| Component {
            id,
            role,
            node: id,
            device: id,
            state: ComponentState::Active,
            votes,
        };
        let stripe = |p| ComponentRole::Stripe { position: p };
        let components = vec![
            comp(1, ComponentRole::Data, 1),
            comp(2, ComponentRole::Data, 1),
            comp(3, ComponentRole::Witness, 1),
            comp(4, stripe(0), 0),
            comp(5, stripe(1), 0),
            comp(6, stripe(2), 0),
            comp(7, stripe(0), 0),
        ];
        let volume = Volume {
            id: 9,
            name: "ec".into(),
            size: 1 << 20,
            policy: Policy::default(),
            components: components.clone(),
            owner: Some(1),
            generation: 1,
            problem: None,
            wrapped_key: None,
            reconfig: Some(Reconfig {
                reason: "rebuild".into(),
                added: vec![7],
                remove: vec![4],
                policy: None,
            }),
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: Some(StripeGeometry::RAID5_NARROW),
        };
        let view = View {
            targets: components
                .iter()
                .map(|c| Target {
                    component: c.clone(),
                    addr: String::new(),
                    node_up: true,
                })
                .collect(),
            volume,
            repair_delay: DEFAULT_REPAIR_DELAY,
            resync_bytes_per_s: None,
            previous_owner_gone: false,
        };
        let leg = view.performance_leg();
        let ids: Vec<u64> = leg.volume.components.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        let ids: Vec<u64> = leg.targets.iter().map(|t| t.component.id).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        // A change of stripe columns only is none of the loop's.
        assert_eq!(leg.volume.reconfig, None);
        assert_eq!(leg.volume.size, (1 << 20) + map_log_bytes(1 << 20));
        assert_eq!(leg.volume.total_votes(), 3);
    }
}
