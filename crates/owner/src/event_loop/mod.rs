//! The owner's event loop: all state of an owned volume lives in [`Loop`]
//! and changes only in [`Loop::apply`], one event at a time, after which
//! the loop's invariants are checked. Work that waits (replica replies,
//! directory proposals) runs in spawned tasks, or for writes in futures the
//! loop polls itself, that report back with an [`Internal`] event.
//!
//! This file owns the state, the events and their dispatch; each concern
//! has its own file:
//! - `activation`: taking over the volume;
//! - `reconcile`: reconciling a dead owner's writes in flight, in the
//!   background;
//! - `io`: client reads and writes, acknowledgements, parked writes;
//! - `route`: the local in-sync copy published for reads around the loop;
//! - `lease`: renewing the read lease, reads waiting for it;
//! - `health`: failed copies, the directory's marks, barriers, witness
//!   pings, reconnection (the tick);
//! - `resync`: bringing a returning copy (or an added one) up to date;
//! - `delta`: what a returning copy gets: the regions tracked while it was
//!   out;
//! - `reconfig`: following a change of layout, committing or aborting it;
//! - `rebuild`: asking for lost components to be rebuilt elsewhere;
//! - `votes`: the votes rule, in both layouts during a change;
//! - `repair`: rewriting a bad block from a healthy copy;
//! - `invariants`: what must hold after every event.

mod activation;
mod delta;
mod health;
mod invariants;
mod io;
mod lease;
mod rebuild;
mod reconcile;
mod reconfig;
mod repair;
mod replica;
mod resync;
mod route;
#[cfg(test)]
mod tests;
mod votes;

pub(crate) use activation::start;

use crate::lease::Lease;
use crate::{ChangeEnd, Control, ControlError, Event, OwnerConfig, OwnerError, ReadRoute, View};
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use io::{Parked, WriteOp};
use lease::{Renewal, WaitingRead};
use repair::RepairError;
use replica::{Replica, ReplicaSet};
use resync::{Abandoned, Resync, ReviveError};
use route::Routed;
use shoal_model::{ComponentState, Generation};
use shoal_rpc::{Peer, RpcError};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

type Reply = oneshot::Sender<Result<Bytes, OwnerError>>;

/// The healing status the loop publishes ([`crate::status`]).
pub(crate) type SharedStatus = Arc<std::sync::Mutex<crate::status::HealingStatus>>;
/// What the loop shares with the [`crate::Owner`] handles.
pub(crate) struct Shared {
    /// The local in-sync copy for reads around the loop.
    pub(crate) route: ReadRoute,
    pub(crate) lease: Arc<Lease>,
    /// What the loop reports of the volume's healing.
    pub(crate) status: SharedStatus,
    /// The clients' latencies, which the handles record.
    pub(crate) latency: Arc<crate::pace::ClientLatency>,
    /// The loop's generation, raised when it reclaims the volume: what
    /// the tiered loop of an erasure-coded volume proposes under.
    pub(crate) generation: Arc<std::sync::atomic::AtomicU64>,
    /// Set once the loop has ended ([`crate::OwnerEnd`]).
    pub(crate) ended: crate::Ended,
}

/// The loop serves a RAID-1 layout: of an erasure-coded volume, only its
/// performance leg ([`crate::View::performance_leg`]); a stripe column
/// never reaches it.
const NO_STRIPES: &str = "a stripe column reached the RAID-1 loop";

/// How long to wait for a TCP connection to a replica, in milliseconds.
const CONNECT_TIMEOUT_MS: u64 = 1000;
/// Ticks between resync attempts after a failed one.
const RESYNC_RETRY_TICKS: u32 = 10;
/// Ticks between resync attempts of a copy whose device failed, rather
/// than [`RESYNC_RETRY_TICKS`]: its node must restart (reopen the store)
/// first, and each attempt raises the volume's generation.
const DEGRADED_RETRY_TICKS: u32 = 150;
/// Pause between retries of a directory proposal that found no leader, in
/// milliseconds.
const CONTROL_RETRY_MS: u64 = 300;

/// Events produced by the loop's own tasks. Errors are typed: the loop
/// branches on the variant, never on an error's text.
pub(crate) enum Internal {
    /// Every copy a write was sent to answered (or failed to).
    WriteDone {
        seq: u64,
        /// When it was sent to the copies.
        sent: Instant,
        results: Vec<(usize, Result<(), RpcError>)>,
        reply: Reply,
    },
    /// A read from replica `idx` failed; `tried` are the copies already
    /// asked, `idx` included. (A read that succeeds answers its client
    /// directly: the loop has nothing to record.)
    ReadFailed {
        idx: usize,
        offset: u64,
        len: u32,
        tried: ReplicaSet,
        error: RpcError,
        reply: Reply,
    },
    /// The directory recorded replica `idx` absent (or degraded).
    Marked {
        idx: usize,
    },
    /// The directory refused to record replica `idx` in `state` under
    /// `generation`: another owner holds a newer one, unless this owner
    /// raised it itself since (then recorded again under its own).
    RecordConflict {
        idx: usize,
        state: ComponentState,
        generation: Generation,
    },
    /// A lease renewal round sent at `sent` under `generation` ended.
    Renewed {
        sent: Instant,
        generation: Generation,
        outcome: Renewal,
    },
    Tick,
    /// A ping of witness `idx` ended: the connection it used (maybe one it
    /// made), or why it failed.
    WitnessPing {
        idx: usize,
        result: Result<Arc<Peer>, RpcError>,
    },
    /// A probe of in-sync replica `idx`, whose node the directory has
    /// down, ended.
    Probed {
        idx: usize,
        result: Result<(), RpcError>,
    },
    /// A bare connection to lost in-sync replica `idx` was made (or not).
    LostReached {
        idx: usize,
        result: Result<(), RpcError>,
    },
    /// The generation raised to reconnect lost in-sync copies (or why not).
    ReconnectReclaimed {
        result: Result<Generation, ControlError>,
    },
    /// The reconnection of in-sync replica `idx` ended.
    Reconnected {
        idx: usize,
        peer: Result<Arc<Peer>, RpcError>,
    },
    /// The reports of a resync carry its attempt number: those of an
    /// attempt since aborted are told apart from the current one's.
    Reclaimed {
        attempt: u64,
        result: Result<Generation, ControlError>,
    },
    Revived {
        attempt: u64,
        peer: Result<Arc<Peer>, ReviveError>,
    },
    ResyncPlan {
        attempt: u64,
        regions: Result<Vec<u64>, RpcError>,
    },
    /// A region to resync was read from copy `source` (or not).
    CopyRead {
        attempt: u64,
        region: u64,
        source: usize,
        result: Result<Bytes, RpcError>,
    },
    /// A region to reconcile was read from the source (or not).
    ReconcileRead {
        region: u64,
        result: Result<Bytes, RpcError>,
    },
    /// The other copies answered a reconciled region's copy; those in
    /// `failed` did not take it.
    ReconcileWritten {
        failed: Vec<(usize, RpcError)>,
    },
    /// A resync paused by its rate limit may copy its next region.
    CopyPaced {
        attempt: u64,
    },
    /// A region's copy was written (its bytes), or failed.
    CopyWritten {
        attempt: u64,
        region: u64,
        result: Result<u64, RpcError>,
    },
    /// The request to record the target active answered: the end of the
    /// attempt, or of an abandoned one's wait ([`resync::Abandoned`]).
    ResyncDone {
        attempt: u64,
        /// The generation the request was made under.
        generation: Generation,
        result: Result<(), ControlError>,
    },
    /// The directory answered the commit or abort of the change in
    /// progress.
    /// (`generation`: the one it was proposed under; a conflict under one
    /// this owner has since raised itself is no deposition.)
    ChangeEnded {
        end: ChangeEnd,
        generation: Generation,
        result: Result<(), ControlError>,
    },
    /// The directory answered a request to rebuild lost components, made
    /// under `generation`.
    RebuildBegun {
        generation: Generation,
        result: Result<(), ControlError>,
    },
    /// A repair of a bad block of replica `idx` ended: whether the block
    /// was replaced, or which side failed and why.
    Repaired {
        idx: usize,
        offset: u64,
        result: Result<bool, RepairError>,
        reply: Option<Reply>,
    },
}

/// Whether the loop goes on after an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    /// Deposed or stopped: the loop ends and answers what waits.
    Stop,
}

pub(super) struct Loop<C: Control> {
    cfg: OwnerConfig,
    control: Arc<C>,
    tx: mpsc::UnboundedSender<Event>,
    volume: u64,
    size: u64,
    generation: Generation,
    /// Every component the loop has known, by index: retired ones (that
    /// left the volume in a change this loop followed) keep their slot,
    /// since late reports of their tasks name it.
    replicas: Vec<Replica>,
    /// The change of layout in progress.
    change: Option<reconfig::Change>,
    /// Components retired by a change that ended: a late view still
    /// naming that change is not adopted again.
    retired_ids: BTreeSet<u64>,
    /// How long a copy whose host is down is waited for before it is
    /// rebuilt elsewhere.
    repair_delay: Duration,
    /// Static limit of a resync's copy rate, in bytes per second.
    resync_bytes_per_s: Option<u64>,
    rebuild: rebuild::Rebuild,
    next_seq: u64,
    /// Writes sent and not yet answered, by sequence number, with the
    /// copies each was sent to.
    inflight: BTreeMap<u64, ReplicaSet>,
    last_barrier: u64,
    /// Whether the last barrier asked the copies to track (`delta`).
    last_track: bool,
    /// Answered writes waiting for the directory to record the copies that
    /// missed them.
    parked: Vec<Parked>,
    /// What a dead owner left in flight, being reconciled.
    reconcile: Option<reconcile::Reconcile>,
    /// Regions locked by resync copies (at most
    /// [`COPY_REGIONS_IN_FLIGHT`](resync::COPY_REGIONS_IN_FLIGHT)) or by a
    /// reconcile step (one), each until its copy is queued; overlapping
    /// writes wait.
    locks: Vec<(u64, u64)>,
    blocked: VecDeque<(WriteOp, Reply)>,
    resync: Option<Resync>,
    /// An attempt given up while the directory was being asked to record
    /// its target active: no other starts until that request answered.
    abandoned: Option<Abandoned>,
    /// Resync attempts started so far; the last one numbers `resync` (or
    /// `abandoned`).
    resync_attempts: u64,
    /// Ticks to wait before trying another resync after a failed attempt.
    resync_backoff: u32,
    /// The generation is being raised to reconnect lost in-sync copies
    /// (`health`); no resync starts meanwhile.
    reconnect_reclaim: bool,
    read_rr: usize,
    /// The local in-sync copy, shared with the [`crate::Owner`] handles for
    /// their reads.
    route: ReadRoute,
    /// What `route` holds now.
    routed: Option<Routed>,
    /// The read lease, shared with the [`crate::Owner`] handles.
    lease: Arc<Lease>,
    /// What the loop last reported of the volume's healing, shared with
    /// the [`crate::Owner`] handles.
    status: SharedStatus,
    /// The clients' latencies, recorded by the [`crate::Owner`] handles.
    latency: Arc<crate::pace::ClientLatency>,
    /// `generation`, shared with the [`crate::Owner`] handles.
    shared_generation: Arc<std::sync::atomic::AtomicU64>,
    /// Set as the loop's last act.
    ended: crate::Ended,
    /// The adaptive pace of copies, fed those latencies every tick.
    adaptive: crate::pace::Adaptive,
    /// Bytes copied by the resync since the last tick.
    copied_since_tick: u64,
    /// A renewal round is in flight.
    renewing: bool,
    /// Reads waiting for the lease to be renewed, oldest first.
    lease_waiting: VecDeque<WaitingRead>,
    /// The writes waiting for their copies' answers, polled by the loop
    /// itself: no task per write, and no event to carry its outcome.
    writes: FuturesUnordered<Pin<Box<dyn Future<Output = Internal> + Send>>>,
}

/// Hands a task's outcome to the loop (gone if the loop stopped).
fn report(tx: &mpsc::UnboundedSender<Event>, ev: Internal) {
    let _ = tx.send(Event::Internal(ev));
}

impl<C: Control> Loop<C> {
    /// Raises the loop's generation to `g` (a reclaim answered) and
    /// shares it with the handles.
    pub(super) fn set_generation(&mut self, g: Generation) {
        assert!(g > self.generation, "reclaim must raise the generation");
        self.generation = g;
        self.shared_generation
            .store(g, std::sync::atomic::Ordering::Release);
    }

    /// A loop over `replicas` (connected or not, in whatever modes the
    /// caller set), and the receiving end of its events.
    fn new(
        cfg: OwnerConfig,
        control: Arc<C>,
        shared: Shared,
        volume: u64,
        size: u64,
        generation: Generation,
        replicas: Vec<Replica>,
    ) -> (Self, mpsc::UnboundedReceiver<Event>) {
        assert!(!replicas.is_empty(), "a volume has at least one component");
        assert!(
            replicas.len() <= ReplicaSet::CAPACITY,
            "too many components"
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let lp = Loop {
            cfg,
            control,
            tx,
            volume,
            size,
            generation,
            replicas,
            change: None,
            retired_ids: BTreeSet::new(),
            repair_delay: crate::DEFAULT_REPAIR_DELAY,
            resync_bytes_per_s: None,
            rebuild: rebuild::Rebuild::default(),
            next_seq: 1,
            inflight: BTreeMap::new(),
            last_barrier: 0,
            last_track: false,
            parked: Vec::new(),
            reconcile: None,
            locks: Vec::new(),
            blocked: VecDeque::new(),
            resync: None,
            abandoned: None,
            resync_attempts: 0,
            resync_backoff: 0,
            reconnect_reclaim: false,
            read_rr: 0,
            route: shared.route,
            routed: None,
            lease: shared.lease,
            status: shared.status,
            latency: shared.latency,
            shared_generation: shared.generation,
            ended: shared.ended,
            adaptive: Default::default(),
            copied_since_tick: 0,
            renewing: false,
            lease_waiting: VecDeque::new(),
            writes: FuturesUnordered::new(),
        };
        (lp, rx)
    }

    /// Applies events until the loop is stopped or deposed, then answers
    /// whatever still waits.
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Event>) {
        loop {
            let ev = tokio::select! {
                biased;
                // Finished writes first: they answer clients and free
                // their regions for the writes behind them.
                Some(done) = self.writes.next(), if !self.writes.is_empty() => Event::Internal(done),
                ev = rx.recv() => match ev {
                    Some(ev) => ev,
                    None => break,
                },
            };
            if self.apply(ev) == Flow::Stop {
                break;
            }
        }
        self.withdraw_route();
        self.lease.end();
        self.shutdown();
        drop(rx);
        self.ended.set();
        tracing::info!(volume = self.volume, "owner stopped");
    }

    /// Applies one event, publishes (or withdraws) the read route to match,
    /// and checks the invariants: every event, whatever its outcome.
    fn apply(&mut self, ev: Event) -> Flow {
        let flow = self.dispatch(ev);
        match flow {
            Flow::Continue => self.publish_route(),
            Flow::Stop => self.withdraw_route(),
        }
        self.check_invariants(flow);
        flow
    }

    fn dispatch(&mut self, ev: Event) -> Flow {
        match ev {
            Event::Io(op, reply) => {
                self.io(op, reply);
                Flow::Continue
            }
            Event::View(v) => {
                self.view(*v);
                Flow::Continue
            }
            Event::Stop => Flow::Stop,
            Event::Internal(i) => self.internal(i),
        }
    }

    fn internal(&mut self, ev: Internal) -> Flow {
        match ev {
            Internal::WriteDone {
                seq,
                sent,
                results,
                reply,
            } => self.write_done((seq, sent), results, reply),
            Internal::ReadFailed {
                idx,
                offset,
                len,
                tried,
                error,
                reply,
            } => self.read_failed(idx, (offset, len), tried, error, reply),
            Internal::Marked { idx } => self.marked(idx),
            Internal::RecordConflict {
                idx,
                state,
                generation,
            } => self.record_conflict(idx, state, generation),
            Internal::Renewed {
                sent,
                generation,
                outcome,
            } => self.renewed(sent, generation, outcome),
            Internal::Tick => self.tick(),
            Internal::WitnessPing { idx, result } => self.witness_pinged(idx, result),
            Internal::LostReached { idx, result } => self.lost_reached(idx, result),
            Internal::ReconnectReclaimed { result } => self.reconnect_reclaimed(result),
            Internal::Reconnected { idx, peer } => self.reconnected(idx, peer),
            Internal::Probed { idx, result } => self.probed(idx, result),
            Internal::Reclaimed { attempt, result } => self.reclaimed(attempt, result),
            Internal::Revived { attempt, peer } => self.revived(attempt, peer),
            Internal::ResyncPlan { attempt, regions } => self.planned(attempt, regions),
            Internal::CopyRead {
                attempt,
                region,
                source,
                result,
            } => self.copy_read(attempt, region, source, result),
            Internal::CopyWritten {
                attempt,
                region,
                result,
            } => self.copy_written(attempt, region, result),
            Internal::CopyPaced { attempt } => self.copy_paced(attempt),
            Internal::ReconcileRead { region, result } => self.reconcile_read(region, result),
            Internal::ReconcileWritten { failed } => self.reconcile_written(failed),
            Internal::ResyncDone {
                attempt,
                generation,
                result,
            } => self.resync_done(attempt, generation, result),
            Internal::ChangeEnded {
                end,
                generation,
                result,
            } => self.change_end_answered(end, generation, result),
            Internal::RebuildBegun { generation, result } => self.rebuild_begun(generation, result),
            Internal::Repaired {
                idx,
                offset,
                result,
                reply,
            } => self.repaired(idx, offset, result, reply),
        }
    }

    /// Runs `work` on its own task and hands its outcome to the loop.
    fn spawn_report<F>(&self, work: F)
    where
        F: Future<Output = Internal> + Send + 'static,
    {
        let tx = self.tx.clone();
        tokio::spawn(async move { report(&tx, work.await) });
    }

    /// The directory changed: liveness, addresses, size, owner.
    fn view(&mut self, v: View) {
        if v.volume.generation > self.generation && v.volume.owner != Some(self.cfg.node) {
            // Someone else claimed the volume; events queued before this
            // one are still applied.
            let _ = self.tx.send(Event::Stop);
        }
        self.repair_delay = v.repair_delay;
        self.resync_bytes_per_s = v.resync_bytes_per_s;
        self.follow_change(&v.volume, &v.targets);
        for t in &v.targets {
            let Some(i) = self.live_index(t.component.id) else {
                continue;
            };
            let r = &mut self.replicas[i];
            // Liveness is a hint for resync only: a copy leaves service
            // when I/O to it fails, never because of the directory's view
            // (which may be this very node, just resumed).
            r.node_up = t.node_up;
            r.addr = t.addr.clone();
            if t.component.state == ComponentState::Degraded {
                r.degraded = true;
            }
        }
        if v.volume.size > self.size {
            self.grow(v.volume.size);
        }
    }

    /// Grows every copy before any write past the old end is sent.
    fn grow(&mut self, size: u64) {
        for r in self.replicas.iter().filter(|r| r.is_data()) {
            if let Some(p) = &r.peer {
                let _ = p.send(
                    &shoal_rpc::Request::ResizeComponent {
                        component: r.component,
                        size,
                    },
                    Bytes::new(),
                );
            }
        }
        self.size = size;
    }

    /// The loop ends: what waits on it learns it is no longer the owner.
    fn shutdown(&mut self) {
        for p in self.parked.drain(..) {
            let _ = p.reply.send(Err(OwnerError::Deposed));
        }
        for (_, r) in self.blocked.drain(..) {
            let _ = r.send(Err(OwnerError::Deposed));
        }
        for w in self.lease_waiting.drain(..) {
            let _ = w.reply.send(Err(OwnerError::Deposed));
        }
    }
}
