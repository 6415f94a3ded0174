//! The owner's event loop: all state of an owned volume lives in [`Loop`]
//! and changes only in `Loop::apply`, one event at a time. Work that waits
//! (replica replies, directory proposals) runs in spawned tasks that report
//! back with an [`Internal`] event.

use crate::{
    Control, ControlError, Event, LocalRead, Op, OwnerConfig, OwnerError, ReadRoute, View, REGION,
};
use bytes::Bytes;
use futures::future::join_all;
use futures::stream::{FuturesUnordered, StreamExt};
use shoal_model::{ComponentRole, ComponentState, Generation, BLOCK_SIZE};
use shoal_rpc::{Peer, RemoteError, Request, Response, RpcError};
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

/// Regions a new owner reconciles at once after a crash (each a 1 MiB read
/// from one copy and a write to the others): a few at once keep the copies'
/// devices busy instead of waiting one round trip per region. The 2,048
/// regions of a 2 GiB volume took 10.5 s one at a time, 7.5 s eight at a
/// time on the demo cluster (one run each; 4 GiB of I/O on one disk).
const RECONCILE_IN_FLIGHT: usize = 8;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

type Reply = oneshot::Sender<Result<Bytes, OwnerError>>;

/// How long to wait for a TCP connection to a replica.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1000);
/// Ticks between resync attempts of a copy whose device failed, rather
/// than the usual 10: its node must restart (reopen the store) first, and
/// each attempt raises the volume's generation.
const DEGRADED_RETRY_TICKS: u32 = 150;

/// Pause between retries of a directory proposal that found no leader.
const CONTROL_RETRY: Duration = Duration::from_millis(300);

/// Events produced by the loop's own tasks.
pub(crate) enum Internal {
    WriteDone {
        seq: u64,
        results: Vec<(usize, Result<(), RpcError>)>,
        reply: Reply,
    },
    ReadDone {
        idx: usize,
        offset: u64,
        len: u32,
        tried: Vec<usize>,
        result: Result<Bytes, RpcError>,
        reply: Reply,
    },
    Marked {
        idx: usize,
    },
    Deposed,
    Tick,
    WitnessPing {
        idx: usize,
        ok: bool,
        stale: bool,
    },
    Reclaimed(Result<Generation, ControlError>),
    Revived {
        idx: usize,
        peer: Result<Arc<Peer>, String>,
    },
    ResyncPlan(Result<Vec<u64>, String>),
    CopyRead {
        region: u64,
        result: Result<Bytes, RpcError>,
    },
    CopyWritten {
        result: Result<(), RpcError>,
    },
    ResyncDone {
        idx: usize,
        result: Result<(), ControlError>,
    },
    Reconnected {
        idx: usize,
        peer: Result<Arc<Peer>, String>,
    },
    /// A repair of a bad block of replica `idx` ended: whether the block
    /// was replaced, or the error and whether the repaired copy gave it.
    Repaired {
        idx: usize,
        offset: u64,
        result: Result<bool, (bool, RpcError)>,
        reply: Option<Reply>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Up to date: receives writes, serves reads.
    InSync,
    /// Receives writes, being copied to; serves no reads.
    Resyncing,
    /// Failed; waiting for the directory to record it absent.
    Failing,
    /// Not written to.
    Out,
}

struct Replica {
    role: ComponentRole,
    component: u64,
    node: u64,
    votes: u32,
    device: u64,
    addr: String,
    node_up: bool,
    peer: Option<Arc<Peer>>,
    mode: Mode,
    /// Witnesses only: answered the last ping under our generation.
    witness_ok: bool,
    /// A reconnection of this in-sync copy is under way.
    reconnecting: bool,
    /// Its device reported an I/O error (the directory says `Degraded`):
    /// a resync is tried only every [`DEGRADED_RETRY_TICKS`], since its
    /// store refuses everything until the node reopens it.
    degraded: bool,
}

impl Replica {
    /// A copy of the addressing fields, without connection or state, for a
    /// task that (re)activates the component.
    fn detached(&self) -> Replica {
        Replica {
            role: self.role,
            component: self.component,
            node: self.node,
            votes: self.votes,
            device: self.device,
            addr: self.addr.clone(),
            node_up: self.node_up,
            peer: None,
            mode: Mode::Out,
            witness_ok: false,
            reconnecting: false,
            degraded: self.degraded,
        }
    }
}

struct Parked {
    waiting: HashSet<usize>,
    ok: Vec<usize>,
    reply: Reply,
}

enum ResyncPhase {
    Reclaiming,
    Reviving,
    Planning,
    Copying,
    Finishing,
}

struct Resync {
    idx: usize,
    source: Option<usize>,
    phase: ResyncPhase,
    regions: VecDeque<u64>,
}

struct Loop<C: Control> {
    cfg: OwnerConfig,
    control: Arc<C>,
    tx: mpsc::UnboundedSender<Event>,
    volume: u64,
    size: u64,
    generation: Generation,
    replicas: Vec<Replica>,
    total_votes: u32,
    next_seq: u64,
    inflight: BTreeSet<u64>,
    last_barrier: u64,
    parked: Vec<Parked>,
    /// Region locked by a resync copy step; overlapping writes wait.
    lock: Option<(u64, u64)>,
    blocked: VecDeque<(Op, Reply)>,
    resync: Option<Resync>,
    /// Ticks to wait before trying another resync after a failed attempt.
    resync_backoff: u32,
    read_rr: usize,
    /// The local in-sync copy, shared with the [`crate::Owner`] handles for
    /// their reads.
    route: ReadRoute,
    /// What `route` holds now: (replica, generation, size, connection).
    routed: Option<(usize, Generation, u64, usize)>,
    /// The writes waiting for their copies' answers, polled by the loop
    /// itself: no task per write, and no event to carry its outcome.
    writes: FuturesUnordered<Pin<Box<dyn Future<Output = Internal> + Send>>>,
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

async fn connect(addr: &str) -> Result<Arc<Peer>, RpcError> {
    Peer::connect(addr, CONNECT_TIMEOUT).await.map(Arc::new)
}

/// Creates (idempotently) and activates one component under `generation`,
/// returning its connection and the dirty regions it remembers.
async fn activate(
    r: &Replica,
    volume: u64,
    size: u64,
    generation: Generation,
    timeout: Duration,
) -> Result<(Arc<Peer>, Vec<(u64, u64)>), String> {
    let peer = connect(&r.addr).await.map_err(|e| e.to_string())?;
    let size = if r.role == ComponentRole::Data {
        size
    } else {
        0
    };
    peer.call(
        &Request::CreateComponent {
            component: r.component,
            volume,
            device: r.device,
            size,
        },
        Bytes::new(),
        timeout,
    )
    .await
    .map_err(|e| e.to_string())?;
    let (resp, _) = peer
        .call(
            &Request::Activate {
                component: r.component,
                generation,
            },
            Bytes::new(),
            timeout,
        )
        .await
        .map_err(|e| e.to_string())?;
    match resp {
        Response::Activated { dirty } => Ok((peer, dirty)),
        other => Err(format!("unexpected reply to activate: {other:?}")),
    }
}

pub(crate) async fn start<C: Control>(
    cfg: OwnerConfig,
    view: View,
    generation: Generation,
    control: Arc<C>,
    route: ReadRoute,
) -> Result<mpsc::UnboundedSender<Event>, OwnerError> {
    let vol = &view.volume;
    let mut replicas: Vec<Replica> = view
        .targets
        .iter()
        .map(|t| Replica {
            role: t.component.role,
            component: t.component.id,
            node: t.component.node,
            votes: t.component.votes,
            device: t.component.device,
            addr: t.addr.clone(),
            node_up: t.node_up,
            peer: None,
            mode: Mode::Out,
            witness_ok: false,
            reconnecting: false,
            degraded: t.component.state == ComponentState::Degraded,
        })
        .collect();
    assert!(!replicas.is_empty(), "a volume has at least one component");
    let total_votes: u32 = replicas.iter().map(|r| r.votes).sum();

    // Activate everything reachable, in parallel.
    let acts = join_all(replicas.iter().map(|r| {
        let up = r.node_up;
        async move {
            if up {
                Some(activate(r, vol.id, vol.size, generation, cfg.io_timeout).await)
            } else {
                None
            }
        }
    }))
    .await;
    let mut dirty: BTreeSet<u64> = BTreeSet::new();
    let mut to_fail = Vec::new();
    for (i, (r, act)) in replicas.iter_mut().zip(acts).enumerate() {
        let was_active = view.targets[i].component.state == ComponentState::Active;
        match act {
            Some(Ok((peer, d))) => {
                r.peer = Some(peer);
                match r.role {
                    ComponentRole::Witness => r.witness_ok = true,
                    ComponentRole::Data if was_active => {
                        r.mode = Mode::InSync;
                        dirty.extend(d.iter().map(|(off, _)| off / REGION));
                    }
                    ComponentRole::Data => {}
                }
            }
            Some(Err(e)) => {
                tracing::warn!(
                    volume = vol.id,
                    component = r.component,
                    "activation failed: {e}"
                );
                if was_active && r.role == ComponentRole::Data {
                    to_fail.push(i);
                }
            }
            None => {
                if was_active && r.role == ComponentRole::Data {
                    to_fail.push(i);
                }
            }
        }
    }
    let votes: u32 = replicas
        .iter()
        .filter(|r| r.mode == Mode::InSync || r.witness_ok)
        .map(|r| r.votes)
        .sum();
    let copies = replicas.iter().filter(|r| r.mode == Mode::InSync).count();
    if copies == 0 || 2 * votes <= total_votes {
        return Err(OwnerError::Unavailable(format!(
            "{votes} of {total_votes} votes and {copies} in-sync copies reachable"
        )));
    }

    // Reconcile what an earlier owner left in flight: copy each dirty region
    // from one in-sync replica to the others before serving anything.
    let insync: Vec<usize> = (0..replicas.len())
        .filter(|&i| replicas[i].mode == Mode::InSync)
        .collect();
    if insync.len() > 1 && !dirty.is_empty() {
        tracing::info!(
            volume = vol.id,
            regions = dirty.len(),
            "reconciling regions left in flight"
        );
        let src = &replicas[insync[0]];
        let (replicas, insync, vol_size) = (&replicas, &insync, vol.size);
        let copy = |region: u64| async move {
            let off = region * REGION;
            let len = REGION.min(vol_size - off) as u32;
            let data = read_from(src, generation, off, len, cfg.io_timeout)
                .await
                .map_err(|e| OwnerError::Unavailable(format!("reconcile read: {e}")))?;
            for &i in &insync[1..] {
                let r = &replicas[i];
                let Some(p) = &r.peer else { continue };
                p.call(
                    &Request::Write {
                        component: r.component,
                        generation,
                        offset: off,
                        seq: 0,
                    },
                    data.clone(),
                    cfg.io_timeout,
                )
                .await
                .map_err(|e| OwnerError::Unavailable(format!("reconcile write: {e}")))?;
            }
            Ok::<(), OwnerError>(())
        };
        let regions = dirty.iter().copied().filter(|r| r * REGION < vol_size);
        let mut steps = futures::stream::iter(regions)
            .map(copy)
            .buffer_unordered(RECONCILE_IN_FLIGHT);
        while let Some(step) = steps.next().await {
            step?;
        }
    }
    // Everything before this generation is now consistent.
    for r in &replicas {
        if let Some(p) = &r.peer {
            let _ = p.send(
                &Request::Barrier {
                    component: r.component,
                    generation,
                    seq: 0,
                },
                Bytes::new(),
            );
        }
    }

    let (tx, mut rx) = mpsc::unbounded_channel();
    let mut lp = Loop {
        cfg: cfg.clone(),
        control,
        tx: tx.clone(),
        volume: vol.id,
        size: vol.size,
        generation,
        replicas,
        total_votes,
        next_seq: 1,
        inflight: BTreeSet::new(),
        last_barrier: 0,
        parked: Vec::new(),
        lock: None,
        blocked: VecDeque::new(),
        resync: None,
        resync_backoff: 0,
        read_rr: 0,
        route,
        routed: None,
        writes: FuturesUnordered::new(),
    };
    for i in to_fail {
        // Unreachable but recorded active: record it absent.
        lp.replicas[i].mode = Mode::InSync;
        lp.fail(i, ComponentState::Absent);
    }
    let ticker = tx.clone();
    let tick = cfg.tick;
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(tick);
        loop {
            iv.tick().await;
            if ticker.send(Event::Internal(Internal::Tick)).is_err() {
                break;
            }
        }
    });
    lp.publish_route();
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                biased;
                // Finished writes first: they answer clients and free
                // their regions for the writes behind them.
                Some(done) = lp.writes.next(), if !lp.writes.is_empty() => Event::Internal(done),
                ev = rx.recv() => match ev {
                    Some(ev) => ev,
                    None => break,
                },
            };
            if !lp.apply(ev) {
                break;
            }
            lp.publish_route();
        }
        lp.withdraw_route();
        lp.shutdown();
        tracing::info!(volume = lp.volume, "owner stopped");
    });
    Ok(tx)
}

async fn read_from(
    r: &Replica,
    generation: Generation,
    offset: u64,
    len: u32,
    timeout: Duration,
) -> Result<Bytes, RpcError> {
    let p = r.peer.as_ref().ok_or(RpcError::Closed)?;
    let (_, data) = p
        .call(
            &Request::Read {
                component: r.component,
                generation,
                offset,
                len,
            },
            Bytes::new(),
            timeout,
        )
        .await?;
    if data.len() != len as usize {
        return Err(RpcError::Protocol(format!(
            "short read: {} of {len} bytes",
            data.len()
        )));
    }
    Ok(data)
}

fn state_for(e: &RpcError) -> ComponentState {
    match e {
        RpcError::Remote(
            RemoteError::Io(_) | RemoteError::Checksum { .. } | RemoteError::NoSpace,
        ) => ComponentState::Degraded,
        _ => ComponentState::Absent,
    }
}

fn owner_error(e: &RpcError) -> Option<OwnerError> {
    match e {
        RpcError::Remote(RemoteError::OutOfRange) => Some(OwnerError::OutOfRange),
        RpcError::Remote(RemoteError::NoSpace) => Some(OwnerError::NoSpace),
        RpcError::Remote(RemoteError::StaleGeneration { .. }) => Some(OwnerError::Deposed),
        _ => None,
    }
}

impl<C: Control> Loop<C> {
    fn send_internal(tx: &mpsc::UnboundedSender<Event>, ev: Internal) {
        let _ = tx.send(Event::Internal(ev));
    }

    /// Applies one event; false ends the loop.
    fn apply(&mut self, ev: Event) -> bool {
        match ev {
            Event::Io(op, reply) => self.io(op, reply),
            Event::View(v) => self.view(v),
            Event::Stop => return false,
            Event::Internal(i) => return self.internal(i),
        }
        self.check_invariants();
        true
    }

    /// The replica reads may go to without the loop: an in-sync data copy
    /// on this node with a connection.
    fn local_copy(&self) -> Option<usize> {
        (0..self.replicas.len()).find(|&i| {
            let r = &self.replicas[i];
            r.node == self.cfg.node
                && r.role == ComponentRole::Data
                && r.mode == Mode::InSync
                && r.peer.is_some()
        })
    }

    /// Publishes the local in-sync copy for reads, if it changed.
    fn publish_route(&mut self) {
        let now = self.local_copy().and_then(|i| {
            let conn = Arc::as_ptr(self.replicas[i].peer.as_ref()?) as usize;
            Some((i, self.generation, self.size, conn))
        });
        if now == self.routed {
            return;
        }
        let value = now.and_then(|(i, generation, size, _)| {
            let r = &self.replicas[i];
            Some(LocalRead {
                component: r.component,
                generation,
                size,
                timeout: self.cfg.io_timeout,
                peer: r.peer.clone()?,
            })
        });
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        *g = value;
        self.routed = now;
    }

    /// No reads around the loop any more: it stops, or the local copy
    /// leaves service.
    fn withdraw_route(&mut self) {
        if self.routed.is_none() {
            return;
        }
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        *g = None;
        self.routed = None;
    }

    fn check_invariants(&self) {
        debug_assert!(self
            .replicas
            .iter()
            .all(|r| r.mode != Mode::InSync || r.role == ComponentRole::Data));
        if let Some(l) = self.lock {
            assert!(l.0 < l.1, "empty resync lock");
        }
        assert!(
            self.last_barrier <= self.next_seq,
            "barrier ahead of writes"
        );
    }

    fn shutdown(&mut self) {
        for p in self.parked.drain(..) {
            let _ = p.reply.send(Err(OwnerError::Deposed));
        }
        for (_, r) in self.blocked.drain(..) {
            let _ = r.send(Err(OwnerError::Deposed));
        }
    }

    fn io(&mut self, op: Op, reply: Reply) {
        let range = match &op {
            Op::Read { offset, len } => Some((*offset, *len as u64)),
            Op::Write { offset, data } => Some((*offset, data.len() as u64)),
            Op::Zero { offset, len } => Some((*offset, *len)),
            Op::Repair { offset, .. } => Some((*offset, 1)),
            Op::Flush => None,
        };
        if let Some((off, len)) = range {
            if off.checked_add(len).is_none_or(|end| end > self.size) {
                let _ = reply.send(Err(OwnerError::OutOfRange));
                return;
            }
        }
        match op {
            Op::Read { offset, len } => self.read(offset, len, Vec::new(), reply),
            // Every acknowledged write is already durable on its replicas.
            Op::Flush => {
                let _ = reply.send(Ok(Bytes::new()));
            }
            Op::Repair { component, offset } => {
                let found = self
                    .replicas
                    .iter()
                    .position(|r| r.component == component && r.role == ComponentRole::Data);
                match found {
                    None => {
                        let _ = reply.send(Err(OwnerError::Io(format!(
                            "component {component} is not a data copy of volume {}",
                            self.volume
                        ))));
                    }
                    // A copy being resynced gets the block from the copy
                    // step; one out of service is rebuilt as a whole.
                    Some(idx) if self.replicas[idx].mode != Mode::InSync => {
                        let _ = reply.send(Ok(Bytes::from_static(&[0])));
                    }
                    Some(idx) => self.repair(idx, offset, Some(reply)),
                }
            }
            Op::Write { .. } | Op::Zero { .. } => {
                let (off, len) = range.unwrap_or((0, 0));
                if let Some(l) = self.lock {
                    if overlaps(l, (off, off + len)) {
                        self.blocked.push_back((op, reply));
                        return;
                    }
                }
                self.write(op, reply);
            }
        }
    }

    fn targets(&self) -> Vec<usize> {
        (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.role == ComponentRole::Data
                    && matches!(r.mode, Mode::InSync | Mode::Resyncing)
                    && r.peer.is_some()
            })
            .collect()
    }

    fn write(&mut self, op: Op, reply: Reply) {
        let targets = self.targets();
        if !targets
            .iter()
            .any(|&i| self.replicas[i].mode == Mode::InSync)
        {
            let _ = reply.send(Err(OwnerError::Unavailable(
                "no in-sync copy reachable".into(),
            )));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.inflight.insert(seq);
        let mut pending = Vec::with_capacity(targets.len());
        let mut results = Vec::new();
        // Whole-block writes carry the CRC-32C of each block from here to
        // the replicas' disks (computed once, checked by every replica).
        let crcs: Option<Vec<u32>> = match &op {
            Op::Write { offset, data }
                if offset.is_multiple_of(BLOCK_SIZE)
                    && (data.len() as u64).is_multiple_of(BLOCK_SIZE) =>
            {
                Some(
                    data.chunks(BLOCK_SIZE as usize)
                        .map(crc32c::crc32c)
                        .collect(),
                )
            }
            _ => None,
        };
        for i in targets {
            let r = &self.replicas[i];
            let Some(peer) = &r.peer else { continue };
            let (req, payload) = match &op {
                Op::Write { offset, data } => (
                    match &crcs {
                        Some(crcs) => Request::WriteChecked {
                            component: r.component,
                            generation: self.generation,
                            offset: *offset,
                            seq,
                            crcs: crcs.clone(),
                        },
                        None => Request::Write {
                            component: r.component,
                            generation: self.generation,
                            offset: *offset,
                            seq,
                        },
                    },
                    data.clone(),
                ),
                Op::Zero { offset, len } => (
                    Request::WriteZeroes {
                        component: r.component,
                        generation: self.generation,
                        offset: *offset,
                        len: *len,
                        seq,
                    },
                    Bytes::new(),
                ),
                _ => unreachable!("only writes are fanned out"),
            };
            match peer.send(&req, payload) {
                Ok(p) => pending.push((i, p)),
                Err(e) => results.push((i, Err(e))),
            }
        }
        let timeout = self.cfg.io_timeout;
        self.writes.push(Box::pin(async move {
            let done = join_all(
                pending
                    .into_iter()
                    .map(|(i, p)| async move { (i, p.wait(timeout).await.map(|_| ())) }),
            )
            .await;
            results.extend(done);
            Internal::WriteDone {
                seq,
                results,
                reply,
            }
        }));
    }

    /// In-sync copies with a connection, but those in `tried`.
    fn read_candidates(&self, tried: &[usize]) -> Vec<usize> {
        (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.mode == Mode::InSync && r.peer.is_some() && !tried.contains(&i)
            })
            .collect()
    }

    /// Rewrites the block holding byte `offset` of replica `idx`, which
    /// failed its checksum, with the block read from another in-sync copy.
    /// The replica replaces it only if it is still bad, so a newer write
    /// racing with the repair always wins.
    fn repair(&mut self, idx: usize, offset: u64, reply: Option<Reply>) {
        let block = offset / BLOCK_SIZE * BLOCK_SIZE;
        let len = (self.size.saturating_sub(block)).min(BLOCK_SIZE) as u32;
        let source = self
            .read_candidates(&[idx])
            .into_iter()
            .find(|&i| self.replicas[i].role == ComponentRole::Data);
        let target = &self.replicas[idx];
        let (Some(s), Some(dst), true) = (source, target.peer.clone(), len > 0) else {
            tracing::warn!(
                volume = self.volume,
                component = target.component,
                offset,
                "bad block, and no healthy copy to repair it from"
            );
            if let Some(r) = reply {
                let _ = r.send(Err(OwnerError::Unavailable(
                    "no healthy copy to repair from".into(),
                )));
            }
            return;
        };
        tracing::warn!(
            volume = self.volume,
            component = target.component,
            offset = block,
            from = self.replicas[s].component,
            "bad block: repairing it from another copy"
        );
        let read = Request::Read {
            component: self.replicas[s].component,
            generation: self.generation,
            offset: block,
            len,
        };
        let write = Request::Repair {
            component: target.component,
            generation: self.generation,
            offset: block,
        };
        let src = self.replicas[s].peer.clone();
        let (tx, timeout) = (self.tx.clone(), self.cfg.io_timeout);
        tokio::spawn(async move {
            let result = async {
                let src = src.ok_or((false, RpcError::Closed))?;
                let (_, data) = src
                    .call(&read, Bytes::new(), timeout)
                    .await
                    .map_err(|e| (false, e))?;
                if data.len() != len as usize {
                    return Err((false, RpcError::Protocol("short read".into())));
                }
                match dst.call(&write, data, timeout).await {
                    Ok((Response::Repaired(done), _)) => Ok(done),
                    Ok((other, _)) => Err((
                        true,
                        RpcError::Protocol(format!("unexpected answer to a repair: {other:?}")),
                    )),
                    Err(e) => Err((true, e)),
                }
            }
            .await;
            Self::send_internal(
                &tx,
                Internal::Repaired {
                    idx,
                    offset: block,
                    result,
                    reply,
                },
            );
        });
    }

    fn read(&mut self, offset: u64, len: u32, tried: Vec<usize>, reply: Reply) {
        let candidates = self.read_candidates(&tried);
        if candidates.is_empty() {
            let _ = reply.send(Err(OwnerError::Unavailable(
                "no in-sync copy reachable".into(),
            )));
            return;
        }
        let idx = candidates
            .iter()
            .copied()
            .find(|&i| self.replicas[i].node == self.cfg.node)
            .unwrap_or_else(|| {
                self.read_rr = self.read_rr.wrapping_add(1);
                candidates[self.read_rr % candidates.len()]
            });
        let r = &self.replicas[idx];
        let req = Request::Read {
            component: r.component,
            generation: self.generation,
            offset,
            len,
        };
        let sent = r.peer.as_ref().map(|p| p.send(&req, Bytes::new()));
        let tx = self.tx.clone();
        let timeout = self.cfg.io_timeout;
        tokio::spawn(async move {
            let result = match sent {
                Some(Ok(p)) => p.wait(timeout).await.and_then(|(_, d)| {
                    if d.len() == len as usize {
                        Ok(d)
                    } else {
                        Err(RpcError::Protocol("short read".into()))
                    }
                }),
                Some(Err(e)) => Err(e),
                None => Err(RpcError::Closed),
            };
            match result {
                // Data goes straight to the client: the loop has nothing to
                // record for a read that succeeded.
                Ok(d) => {
                    let _ = reply.send(Ok(d));
                }
                Err(e) => Self::send_internal(
                    &tx,
                    Internal::ReadDone {
                        idx,
                        offset,
                        len,
                        tried,
                        result: Err(e),
                        reply,
                    },
                ),
            }
        });
    }

    /// Takes a replica out of service and has the directory record it
    /// absent (or degraded). Writes that skipped it wait for that record.
    fn fail(&mut self, idx: usize, state: ComponentState) {
        if self.routed.is_some_and(|(i, ..)| i == idx) {
            // Before any write is acknowledged without this copy.
            self.withdraw_route();
        }
        let others_in_sync = self
            .replicas
            .iter()
            .enumerate()
            .any(|(i, r)| i != idx && r.mode == Mode::InSync);
        let r = &mut self.replicas[idx];
        if !matches!(r.mode, Mode::InSync | Mode::Resyncing) {
            return;
        }
        if r.mode == Mode::InSync && !others_in_sync {
            // The last up-to-date copy is never recorded absent: that would
            // leave no source to rebuild from. Keep it in sync, drop the
            // connection, and let the tick reconnect; I/O waits meanwhile.
            tracing::warn!(
                volume = self.volume,
                component = r.component,
                "last in-sync copy unreachable; reconnecting"
            );
            r.peer = None;
            return;
        }
        tracing::warn!(volume = self.volume, component = r.component, %state, "replica failed");
        r.mode = Mode::Failing;
        r.degraded |= state == ComponentState::Degraded;
        r.peer = None;
        let comp = r.component;
        if self
            .resync
            .as_ref()
            .is_some_and(|s| s.idx == idx || s.source == Some(idx))
        {
            self.abort_resync();
        }
        let (vol, gen) = (self.volume, self.generation);
        let control = self.control.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            loop {
                match control.set_component_state(vol, comp, state, gen).await {
                    Ok(()) => {
                        Self::send_internal(&tx, Internal::Marked { idx });
                        return;
                    }
                    Err(ControlError::Conflict) => {
                        Self::send_internal(&tx, Internal::Deposed);
                        return;
                    }
                    Err(ControlError::Unavailable(e)) => {
                        tracing::warn!("cannot record component {comp} {state}: {e}; retrying");
                        tokio::time::sleep(CONTROL_RETRY).await;
                        if tx.is_closed() {
                            return;
                        }
                    }
                }
            }
        });
    }

    fn ack(&self, ok: &[usize]) -> Result<Bytes, OwnerError> {
        let copies = ok
            .iter()
            .filter(|&&i| self.replicas[i].mode == Mode::InSync)
            .count();
        let votes: u32 = ok.iter().map(|&i| self.replicas[i].votes).sum::<u32>()
            + self
                .replicas
                .iter()
                .filter(|r| r.witness_ok)
                .map(|r| r.votes)
                .sum::<u32>();
        if copies == 0 {
            Err(OwnerError::Unavailable(
                "no in-sync copy took the write".into(),
            ))
        } else if 2 * votes <= self.total_votes {
            Err(OwnerError::Unavailable(format!(
                "only {votes} of {} votes reachable",
                self.total_votes
            )))
        } else {
            Ok(Bytes::new())
        }
    }

    fn release_parked(&mut self) {
        let mut i = 0;
        while i < self.parked.len() {
            let ready = self.parked[i]
                .waiting
                .iter()
                .all(|&w| self.replicas[w].mode != Mode::Failing);
            if ready {
                let p = self.parked.swap_remove(i);
                let res = self.ack(&p.ok);
                let _ = p.reply.send(res);
            } else {
                i += 1;
            }
        }
    }

    fn internal(&mut self, ev: Internal) -> bool {
        match ev {
            Internal::WriteDone {
                seq,
                results,
                reply,
            } => {
                self.inflight.remove(&seq);
                let mut ok = Vec::new();
                let mut waiting = HashSet::new();
                // A copy that ran out of space while another took the write
                // now differs from it: it leaves service (degraded) like a
                // copy with a device error, rather than failing the write
                // and leaving the copies different.
                let any_ok = results.iter().any(|(_, r)| r.is_ok());
                for (i, res) in results {
                    match res {
                        Ok(()) => ok.push(i),
                        Err(e) => {
                            match owner_error(&e) {
                                Some(OwnerError::Deposed) => {
                                    let _ = reply.send(Err(OwnerError::Deposed));
                                    return false;
                                }
                                Some(OwnerError::NoSpace) if any_ok => {}
                                Some(oe) => {
                                    let _ = reply.send(Err(oe));
                                    return true;
                                }
                                None => {}
                            }
                            self.fail(i, state_for(&e));
                            if self.replicas[i].mode == Mode::Failing {
                                waiting.insert(i);
                            }
                        }
                    }
                }
                if waiting.is_empty() {
                    let res = self.ack(&ok);
                    let _ = reply.send(res);
                } else {
                    self.parked.push(Parked { waiting, ok, reply });
                }
            }
            Internal::ReadDone {
                idx,
                offset,
                len,
                mut tried,
                result,
                reply,
            } => match result {
                Ok(d) => {
                    let _ = reply.send(Ok(d));
                }
                Err(e) => {
                    if let Some(oe) = owner_error(&e) {
                        let deposed = oe == OwnerError::Deposed;
                        let _ = reply.send(Err(oe));
                        return !deposed;
                    }
                    tried.push(idx);
                    if let RpcError::Remote(RemoteError::Checksum { offset: bad }) = e {
                        // One bad block: this copy stays in service; serve
                        // the read from another copy and repair the block.
                        if self.read_candidates(&tried).is_empty() {
                            let _ = reply.send(Err(OwnerError::Io(format!(
                                "{e} and no other copy to read it from"
                            ))));
                        } else {
                            self.repair(idx, bad, None);
                            self.read(offset, len, tried, reply);
                        }
                    } else {
                        self.fail(idx, state_for(&e));
                        self.read(offset, len, tried, reply);
                    }
                }
            },
            Internal::Marked { idx } => {
                if self.replicas[idx].mode == Mode::Failing {
                    self.replicas[idx].mode = Mode::Out;
                }
                self.release_parked();
            }
            Internal::Deposed => return false,
            Internal::Tick => self.tick(),
            Internal::WitnessPing { idx, ok, stale } => {
                if stale {
                    return false;
                }
                let r = &mut self.replicas[idx];
                r.witness_ok = ok;
                if !ok {
                    r.peer = None;
                }
            }
            Internal::Reclaimed(res) => match res {
                Ok(g) => {
                    assert!(g > self.generation, "reclaim must raise the generation");
                    self.generation = g;
                    self.revive();
                }
                Err(ControlError::Conflict) => return false,
                Err(ControlError::Unavailable(e)) => {
                    tracing::warn!(volume = self.volume, "reclaim failed: {e}");
                    self.abort_resync();
                }
            },
            Internal::Revived { idx, peer } => self.revived(idx, peer),
            Internal::ResyncPlan(res) => match res {
                Ok(regions) => {
                    if let Some(rs) = &mut self.resync {
                        tracing::info!(
                            volume = self.volume,
                            regions = regions.len(),
                            "resync copying"
                        );
                        rs.regions = regions.into();
                        rs.phase = ResyncPhase::Copying;
                        self.copy_next();
                    }
                }
                Err(e) => {
                    tracing::warn!(volume = self.volume, "resync plan failed: {e}");
                    self.abort_resync();
                }
            },
            Internal::CopyRead { region, result } => self.copy_read(region, result),
            Internal::CopyWritten { result } => match result {
                Ok(()) => self.copy_next(),
                Err(e) => {
                    if let Some(idx) = self.resync.as_ref().map(|r| r.idx) {
                        self.fail(idx, state_for(&e));
                    }
                }
            },
            Internal::Reconnected { idx, peer } => {
                let r = &mut self.replicas[idx];
                r.reconnecting = false;
                match peer {
                    Ok(p) if r.mode == Mode::InSync && r.peer.is_none() => {
                        tracing::info!(
                            volume = self.volume,
                            component = r.component,
                            "reconnected"
                        );
                        r.peer = Some(p);
                    }
                    Ok(_) => {}
                    Err(e) => {
                        if e.contains("stale generation") {
                            return false;
                        }
                        tracing::debug!(volume = self.volume, "reconnect failed: {e}");
                    }
                }
            }
            Internal::Repaired {
                idx,
                offset,
                result,
                reply,
            } => {
                let component = self.replicas[idx].component;
                let answer = match result {
                    Ok(done) => {
                        tracing::info!(
                            volume = self.volume,
                            component,
                            offset,
                            replaced = done,
                            "bad block repaired"
                        );
                        Ok(Bytes::from(vec![done as u8]))
                    }
                    Err((at_target, e)) => {
                        tracing::warn!(
                            volume = self.volume,
                            component,
                            offset,
                            "repair failed: {e}"
                        );
                        if let Some(OwnerError::Deposed) = owner_error(&e) {
                            if let Some(r) = reply {
                                let _ = r.send(Err(OwnerError::Deposed));
                            }
                            return false;
                        }
                        if at_target {
                            self.fail(idx, state_for(&e));
                        }
                        Err(OwnerError::Io(format!("repair failed: {e}")))
                    }
                };
                if let Some(r) = reply {
                    let _ = r.send(answer);
                }
            }
            Internal::ResyncDone { idx, result } => {
                self.resync = None;
                match result {
                    Ok(()) if self.replicas[idx].mode == Mode::Resyncing => {
                        tracing::info!(
                            volume = self.volume,
                            component = self.replicas[idx].component,
                            "resync complete"
                        );
                        self.replicas[idx].mode = Mode::InSync;
                        self.replicas[idx].degraded = false;
                    }
                    Ok(()) => {}
                    Err(ControlError::Conflict) => return false,
                    Err(ControlError::Unavailable(_)) => {
                        self.fail(idx, ComponentState::Absent);
                    }
                }
            }
        }
        self.check_invariants();
        true
    }

    fn view(&mut self, v: View) {
        if v.volume.generation > self.generation {
            // Someone else claimed the volume.
            if v.volume.owner != Some(self.cfg.node) {
                let _ = self.tx.send(Event::Stop);
            }
        }
        for t in &v.targets {
            if let Some(i) = self
                .replicas
                .iter()
                .position(|r| r.component == t.component.id)
            {
                // Liveness is a hint for resync only: a copy leaves service
                // when I/O to it fails, never because of the directory's
                // view (which may be this very node, just resumed).
                let r = &mut self.replicas[i];
                r.node_up = t.node_up;
                r.addr = t.addr.clone();
                if t.component.state == ComponentState::Degraded {
                    r.degraded = true;
                }
            }
        }
        if v.volume.size > self.size {
            // Grow every copy before any write past the old end is sent.
            for r in &self.replicas {
                if r.role != ComponentRole::Data {
                    continue;
                }
                if let Some(p) = &r.peer {
                    let _ = p.send(
                        &Request::ResizeComponent {
                            component: r.component,
                            size: v.volume.size,
                        },
                        Bytes::new(),
                    );
                }
            }
            self.size = v.volume.size;
        }
    }

    fn tick(&mut self) {
        // Barrier: every write older than the oldest in flight is complete.
        let upto = self.inflight.first().copied().unwrap_or(self.next_seq);
        if upto > self.last_barrier + 1 || (upto > self.last_barrier && self.inflight.is_empty()) {
            self.last_barrier = upto;
            for i in self.targets() {
                let r = &self.replicas[i];
                if let Some(p) = &r.peer {
                    let _ = p.send(
                        &Request::Barrier {
                            component: r.component,
                            generation: self.generation,
                            seq: upto,
                        },
                        Bytes::new(),
                    );
                }
            }
        }
        // Witness pings: a witness fenced by a newer owner deposes us.
        for (i, r) in self.replicas.iter().enumerate() {
            if r.role != ComponentRole::Witness || !r.node_up {
                continue;
            }
            let tx = self.tx.clone();
            let timeout = self.cfg.io_timeout;
            let (comp, gen, addr, peer, vol) = (
                r.component,
                self.generation,
                r.addr.clone(),
                r.peer.clone(),
                self.volume,
            );
            let dev = r.device;
            tokio::spawn(async move {
                let peer = match peer {
                    Some(p) if !p.is_closed() => p,
                    _ => match connect(&addr).await {
                        Ok(p) => {
                            let _ = p
                                .call(
                                    &Request::CreateComponent {
                                        component: comp,
                                        volume: vol,
                                        device: dev,
                                        size: 0,
                                    },
                                    Bytes::new(),
                                    timeout,
                                )
                                .await;
                            p
                        }
                        Err(_) => {
                            Self::send_internal(
                                &tx,
                                Internal::WitnessPing {
                                    idx: i,
                                    ok: false,
                                    stale: false,
                                },
                            );
                            return;
                        }
                    },
                };
                let r = peer
                    .call(
                        &Request::Flush {
                            component: comp,
                            generation: gen,
                        },
                        Bytes::new(),
                        timeout,
                    )
                    .await;
                let stale = matches!(
                    r,
                    Err(RpcError::Remote(RemoteError::StaleGeneration { .. }))
                );
                Self::send_internal(
                    &tx,
                    Internal::WitnessPing {
                        idx: i,
                        ok: r.is_ok(),
                        stale,
                    },
                );
            });
        }
        // Reconnect in-sync copies that lost their connection.
        for (i, r) in self.replicas.iter_mut().enumerate() {
            if r.mode != Mode::InSync || r.peer.is_some() || r.reconnecting {
                continue;
            }
            r.reconnecting = true;
            let tmp = r.detached();
            let (vol, size, gen, timeout) =
                (self.volume, self.size, self.generation, self.cfg.io_timeout);
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let peer = activate(&tmp, vol, size, gen, timeout)
                    .await
                    .map(|(p, _)| p);
                Self::send_internal(&tx, Internal::Reconnected { idx: i, peer });
            });
        }
        // Bring back one replica at a time.
        if self.resync_backoff > 0 {
            self.resync_backoff -= 1;
            return;
        }
        if self.resync.is_none() {
            let cand = (0..self.replicas.len()).find(|&i| {
                let r = &self.replicas[i];
                r.role == ComponentRole::Data && r.mode == Mode::Out && r.node_up
            });
            if let Some(idx) = cand {
                tracing::info!(
                    volume = self.volume,
                    component = self.replicas[idx].component,
                    "starting resync"
                );
                self.resync = Some(Resync {
                    idx,
                    source: None,
                    phase: ResyncPhase::Reclaiming,
                    regions: VecDeque::new(),
                });
                // A new generation fences frames of older sessions still
                // queued towards the returning replica.
                let control = self.control.clone();
                let tx = self.tx.clone();
                let (vol, gen) = (self.volume, self.generation);
                tokio::spawn(async move {
                    let r = control.reclaim(vol, gen).await;
                    Self::send_internal(&tx, Internal::Reclaimed(r));
                });
            }
        }
    }

    fn abort_resync(&mut self) {
        if let Some(rs) = self.resync.take() {
            let r = &mut self.replicas[rs.idx];
            if r.mode == Mode::Resyncing {
                r.mode = Mode::Out;
                r.peer = None;
            }
            self.resync_backoff = if r.degraded { DEGRADED_RETRY_TICKS } else { 10 };
        }
        if self.lock.take().is_some() {
            self.unblock();
        }
    }

    fn revive(&mut self) {
        let Some(rs) = &mut self.resync else { return };
        rs.phase = ResyncPhase::Reviving;
        let idx = rs.idx;
        let r = &self.replicas[idx];
        let tmp = r.detached();
        let (vol, size, gen, timeout) =
            (self.volume, self.size, self.generation, self.cfg.io_timeout);
        let control = self.control.clone();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let res = async {
                let (peer, _) = activate(&tmp, vol, size, gen, timeout).await?;
                control
                    .set_component_state(vol, tmp.component, ComponentState::Resyncing, gen)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(peer)
            }
            .await;
            Self::send_internal(&tx, Internal::Revived { idx, peer: res });
        });
    }

    fn revived(&mut self, idx: usize, peer: Result<Arc<Peer>, String>) {
        let Some(rs) = &mut self.resync else { return };
        if rs.idx != idx {
            return;
        }
        let peer = match peer {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(volume = self.volume, "resync: cannot revive replica: {e}");
                self.abort_resync();
                return;
            }
        };
        let Some(src) = (0..self.replicas.len())
            .find(|&i| self.replicas[i].mode == Mode::InSync && self.replicas[i].peer.is_some())
        else {
            self.abort_resync();
            return;
        };
        rs.source = Some(src);
        rs.phase = ResyncPhase::Planning;
        let r = &mut self.replicas[idx];
        r.mode = Mode::Resyncing;
        r.peer = Some(peer.clone());
        // From here every write reaches the target too; ask both sides what
        // is allocated, in order after all writes sent so far.
        let s = &self.replicas[src];
        let q_src = s.peer.as_ref().map(|p| {
            p.send(
                &Request::AllocatedRanges {
                    component: s.component,
                },
                Bytes::new(),
            )
        });
        let q_dst = peer.send(
            &Request::AllocatedRanges {
                component: self.replicas[idx].component,
            },
            Bytes::new(),
        );
        let tx = self.tx.clone();
        let timeout = self.cfg.io_timeout;
        tokio::spawn(async move {
            let res = async {
                let mut regions = BTreeSet::new();
                for q in [q_src.ok_or(RpcError::Closed).and_then(|x| x), q_dst] {
                    let (resp, _) = q?.wait(timeout).await?;
                    let Response::Ranges(v) = resp else {
                        return Err(RpcError::Protocol("expected ranges".into()));
                    };
                    for (off, len) in v {
                        let mut r = off / REGION;
                        while r * REGION < off + len {
                            regions.insert(r);
                            r += 1;
                        }
                    }
                }
                Ok(regions.into_iter().collect::<Vec<_>>())
            }
            .await
            .map_err(|e: RpcError| e.to_string());
            Self::send_internal(&tx, Internal::ResyncPlan(res));
        });
    }

    fn copy_next(&mut self) {
        let Some(rs) = &mut self.resync else { return };
        let next = loop {
            match rs.regions.pop_front() {
                Some(r) if r * REGION < self.size => break Some(r),
                Some(_) => continue,
                None => break None,
            }
        };
        let Some(region) = next else {
            rs.phase = ResyncPhase::Finishing;
            let idx = rs.idx;
            let comp = self.replicas[idx].component;
            let (vol, gen) = (self.volume, self.generation);
            let control = self.control.clone();
            let tx = self.tx.clone();
            tokio::spawn(async move {
                let result = control
                    .set_component_state(vol, comp, ComponentState::Active, gen)
                    .await;
                Self::send_internal(&tx, Internal::ResyncDone { idx, result });
            });
            return;
        };
        let Some(src) = rs.source else { return };
        let off = region * REGION;
        let len = REGION.min(self.size - off);
        debug_assert!(off.is_multiple_of(BLOCK_SIZE));
        self.lock = Some((off, off + len));
        let s = &self.replicas[src];
        let sent = s.peer.as_ref().map(|p| {
            p.send(
                &Request::Read {
                    component: s.component,
                    generation: self.generation,
                    offset: off,
                    len: len as u32,
                },
                Bytes::new(),
            )
        });
        let tx = self.tx.clone();
        let timeout = self.cfg.io_timeout;
        tokio::spawn(async move {
            let result = match sent {
                Some(Ok(p)) => p.wait(timeout).await.map(|(_, d)| d),
                Some(Err(e)) => Err(e),
                None => Err(RpcError::Closed),
            };
            Self::send_internal(&tx, Internal::CopyRead { region, result });
        });
    }

    fn copy_read(&mut self, region: u64, result: Result<Bytes, RpcError>) {
        let Some(rs) = &self.resync else { return };
        let (idx, src) = (rs.idx, rs.source);
        let data = match result {
            Ok(d) => d,
            Err(e) => {
                if let Some(s) = src {
                    self.fail(s, state_for(&e));
                }
                return;
            }
        };
        let off = region * REGION;
        let t = &self.replicas[idx];
        let sent = match &t.peer {
            Some(p) if t.mode == Mode::Resyncing => {
                let req = if data.iter().all(|&b| b == 0) {
                    (
                        Request::WriteZeroes {
                            component: t.component,
                            generation: self.generation,
                            offset: off,
                            len: data.len() as u64,
                            seq: 0,
                        },
                        Bytes::new(),
                    )
                } else {
                    (
                        Request::Write {
                            component: t.component,
                            generation: self.generation,
                            offset: off,
                            seq: 0,
                        },
                        data,
                    )
                };
                Some(p.send(&req.0, req.1))
            }
            _ => None,
        };
        // The copy is queued ahead of any later write: release the region.
        self.lock = None;
        self.unblock();
        let tx = self.tx.clone();
        let timeout = self.cfg.io_timeout;
        tokio::spawn(async move {
            let result = match sent {
                Some(Ok(p)) => p.wait(timeout).await.map(|_| ()),
                Some(Err(e)) => Err(e),
                None => Err(RpcError::Closed),
            };
            Self::send_internal(&tx, Internal::CopyWritten { result });
        });
    }

    fn unblock(&mut self) {
        let blocked: Vec<_> = self.blocked.drain(..).collect();
        for (op, reply) in blocked {
            self.io(op, reply);
        }
    }
}
