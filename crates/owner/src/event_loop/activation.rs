//! Taking over a volume: activate every reachable copy under the granted
//! generation (fencing older owners), check the votes rule, reconcile the
//! regions a dead predecessor may have left half-written, and start the
//! loop. Also the activation of one copy, which reconnection and resync
//! reuse.

use super::replica::{Mode, Replica, ReplicaSet};
use super::votes::joint_majority;
use super::{Flow, Internal, Loop, CONNECT_TIMEOUT_MS, RECONCILE_REGIONS_IN_FLIGHT};
use crate::lease::Lease;
use crate::{Control, Event, OwnerConfig, OwnerError, ReadRoute, View, REGION};
use bytes::Bytes;
use futures::future::join_all;
use futures::stream::StreamExt;
use shoal_model::{ComponentRole, ComponentState, Generation};
use shoal_rpc::{Peer, PeerAuth, Request, Response, RpcError};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

/// A connection to `addr`.
pub(super) async fn connect(addr: &str, auth: &PeerAuth) -> Result<Arc<Peer>, RpcError> {
    Peer::connect(addr, Duration::from_millis(CONNECT_TIMEOUT_MS), auth)
        .await
        .map(Arc::new)
}

/// What activating one component answered.
pub(super) struct ActivatedCopy {
    pub(super) peer: Arc<Peer>,
    /// Regions (offset, len) it remembers as possibly half-written.
    pub(super) dirty: Vec<(u64, u64)>,
    /// How long a lease it granted to an older owner may still run, in
    /// milliseconds.
    pub(super) lease_ms: u32,
}

/// Creates (idempotently) and activates one component under `generation`,
/// returning its connection, the dirty regions it remembers, and what is
/// left of an older owner's lease there.
pub(super) async fn activate(
    r: &Replica,
    auth: &PeerAuth,
    volume: u64,
    size: u64,
    generation: Generation,
    timeout: Duration,
) -> Result<ActivatedCopy, RpcError> {
    let peer = connect(&r.addr, auth).await?;
    let size = if r.is_data() { size } else { 0 };
    let create = Request::CreateComponent {
        component: r.component,
        volume,
        device: r.device,
        size,
    };
    peer.call(&create, Bytes::new(), timeout).await?;
    let activate = Request::Activate {
        component: r.component,
        generation,
    };
    match peer.call(&activate, Bytes::new(), timeout).await? {
        (Response::Activated { dirty, lease_ms }, _) => Ok(ActivatedCopy {
            peer,
            dirty,
            lease_ms,
        }),
        (other, _) => Err(RpcError::Protocol(format!(
            "unexpected reply to activate: {other:?}"
        ))),
    }
}

/// Reads `len` bytes at `offset` of one copy.
async fn read_from(
    r: &Replica,
    generation: Generation,
    offset: u64,
    len: u32,
    timeout: Duration,
) -> Result<Bytes, RpcError> {
    let p = r.peer.as_ref().ok_or(RpcError::Closed)?;
    let read = Request::Read {
        component: r.component,
        generation,
        offset,
        len,
    };
    let (_, data) = p.call(&read, Bytes::new(), timeout).await?;
    if data.len() != len as usize {
        return Err(RpcError::Protocol(format!(
            "short read: {} of {len} bytes",
            data.len()
        )));
    }
    Ok(data)
}

/// What activating every copy found.
struct Activated {
    /// Regions some copy remembers as possibly half-written.
    dirty: BTreeSet<u64>,
    /// Copies the directory has active that could not be activated: to be
    /// recorded absent.
    unreachable: ReplicaSet,
    /// The longest any activated component says an older owner's lease
    /// may still run, in milliseconds: nothing is served before.
    lease_ms: u32,
}

/// Activates every copy whose node is up, in parallel: copies the
/// directory has active become in sync, witnesses that answer count.
async fn activate_all(
    replicas: &mut [Replica],
    auth: &PeerAuth,
    view: &View,
    generation: Generation,
    timeout: Duration,
) -> Activated {
    let vol = &view.volume;
    let acts = join_all(replicas.iter().map(|r| async move {
        if r.node_up {
            Some(activate(r, auth, vol.id, vol.size, generation, timeout).await)
        } else {
            None
        }
    }))
    .await;
    let mut found = Activated {
        dirty: BTreeSet::new(),
        unreachable: ReplicaSet::EMPTY,
        lease_ms: 0,
    };
    for (i, (r, act)) in replicas.iter_mut().zip(acts).enumerate() {
        let was_active = view.targets[i].component.state == ComponentState::Active;
        match act {
            Some(Ok(ActivatedCopy {
                peer,
                dirty,
                lease_ms,
            })) => {
                found.lease_ms = found.lease_ms.max(lease_ms);
                r.peer = Some(peer);
                match r.role {
                    ComponentRole::Witness => {
                        r.witness_ok = true;
                        r.out_since = None;
                    }
                    ComponentRole::Data if was_active => {
                        r.mode = Mode::InSync;
                        r.out_since = None;
                        found
                            .dirty
                            .extend(dirty.iter().map(|(off, _)| off / REGION));
                    }
                    ComponentRole::Data => {}
                }
                continue;
            }
            Some(Err(e)) => {
                tracing::warn!(
                    volume = vol.id,
                    component = r.component,
                    "activation failed: {e}"
                );
            }
            None => {}
        }
        if was_active && r.is_data() {
            found.unreachable.insert(i);
        }
    }
    found
}

/// Whether enough is reachable to serve: an in-sync copy, and with the
/// witnesses (and the components a change in progress added, which this
/// activation fenced too) a majority of the votes, in both layouts during
/// a change.
fn check_votes(replicas: &[Replica]) -> Result<(), OwnerError> {
    let copies = replicas.iter().filter(|r| r.mode == Mode::InSync).count();
    if copies == 0 {
        return Err(OwnerError::Unavailable("no in-sync copy reachable".into()));
    }
    joint_majority(replicas, |_, r| {
        r.mode == Mode::InSync || r.witness_ok || (r.layouts.added() && r.peer.is_some())
    })
    .map_err(OwnerError::Unavailable)
}

/// Copies each dirty region from one in-sync copy to the others, a few at
/// once, before anything is served.
async fn reconcile(
    replicas: &[Replica],
    dirty: &BTreeSet<u64>,
    (volume, size): (u64, u64),
    generation: Generation,
    timeout: Duration,
) -> Result<(), OwnerError> {
    let insync: Vec<&Replica> = replicas.iter().filter(|r| r.mode == Mode::InSync).collect();
    let Some((src, others)) = insync.split_first() else {
        return Ok(());
    };
    if others.is_empty() || dirty.is_empty() {
        return Ok(());
    }
    tracing::info!(
        volume,
        regions = dirty.len(),
        "reconciling regions left in flight"
    );
    let copy = |region: u64| async move {
        let off = region * REGION;
        let len = REGION.min(size - off) as u32;
        let data = read_from(src, generation, off, len, timeout)
            .await
            .map_err(|e| OwnerError::Unavailable(format!("reconcile read: {e}")))?;
        for r in others {
            let Some(p) = &r.peer else { continue };
            let write = Request::Write {
                component: r.component,
                generation,
                offset: off,
                seq: 0,
            };
            p.call(&write, data.clone(), timeout)
                .await
                .map_err(|e| OwnerError::Unavailable(format!("reconcile write: {e}")))?;
        }
        Ok::<(), OwnerError>(())
    };
    let regions = dirty.iter().copied().filter(|r| r * REGION < size);
    let mut steps = futures::stream::iter(regions)
        .map(copy)
        .buffer_unordered(RECONCILE_REGIONS_IN_FLIGHT);
    while let Some(step) = steps.next().await {
        step?;
    }
    Ok(())
}

/// Tells every connected copy that everything before this generation is
/// consistent now.
fn barrier_all(replicas: &[Replica], generation: Generation) {
    for r in replicas {
        if let Some(p) = &r.peer {
            let barrier = Request::Barrier {
                component: r.component,
                generation,
                seq: 0,
            };
            let _ = p.send(&barrier, Bytes::new());
        }
    }
}

/// Sends a tick to the loop every `tick`, for as long as it runs.
fn spawn_ticker(tx: mpsc::UnboundedSender<Event>, tick: Duration) {
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(tick);
        loop {
            iv.tick().await;
            if tx.send(Event::Internal(Internal::Tick)).is_err() {
                break;
            }
        }
    });
}

pub(crate) async fn start<C: Control>(
    cfg: OwnerConfig,
    view: View,
    generation: Generation,
    control: Arc<C>,
    (route, lease): (ReadRoute, Arc<Lease>),
) -> Result<mpsc::UnboundedSender<Event>, OwnerError> {
    let vol = &view.volume;
    let mut replicas: Vec<Replica> = view
        .targets
        .iter()
        .map(|t| Replica::from_target(t, vol))
        .collect();
    assert!(!replicas.is_empty(), "a volume has at least one component");
    if replicas.len() > ReplicaSet::CAPACITY {
        return Err(OwnerError::Unavailable(format!(
            "{} components; an owner handles at most {}",
            replicas.len(),
            ReplicaSet::CAPACITY
        )));
    }
    // The activation is this owner's first lease renewal: every copy
    // that answers records it as a lease granted from its arrival.
    let sent = Instant::now();
    let found = activate_all(
        &mut replicas,
        &cfg.peer_auth,
        &view,
        generation,
        cfg.io_timeout,
    )
    .await;
    check_votes(&replicas)?;
    // Nothing is served while an older owner's lease may still run; the
    // reconciliation of what it left in flight meanwhile changes nothing
    // a client could have seen acknowledged.
    let older_lease = Duration::from_millis(u64::from(found.lease_ms));
    if !older_lease.is_zero() {
        tracing::info!(
            volume = vol.id,
            "waiting {older_lease:?} for an older owner's read lease to end"
        );
    }
    let (reconciled, ()) = tokio::join!(
        reconcile(
            &replicas,
            &found.dirty,
            (vol.id, vol.size),
            generation,
            cfg.io_timeout,
        ),
        tokio::time::sleep(older_lease),
    );
    reconciled?;
    lease.renewed(sent);
    // Everything before this generation is now consistent.
    barrier_all(&replicas, generation);

    let (mut lp, rx) = Loop::new(
        cfg.clone(),
        control,
        (route, lease),
        vol.id,
        vol.size,
        generation,
        replicas,
    );
    lp.repair_delay = view.repair_delay;
    if let Some(r) = &vol.reconfig {
        // A change a dead owner began: its added components' content is
        // not trusted; they are copied to from scratch.
        lp.adopt(r, vol, &view.targets);
    }
    for i in found.unreachable.iter() {
        // Unreachable but recorded active: record it absent.
        lp.replicas[i].mode = Mode::InSync;
        lp.fail(i, ComponentState::Absent);
    }
    let tx = lp.tx.clone();
    spawn_ticker(tx.clone(), cfg.tick);
    lp.renew();
    lp.publish_route();
    lp.check_invariants(Flow::Continue);
    tokio::spawn(lp.run(rx));
    Ok(tx)
}
