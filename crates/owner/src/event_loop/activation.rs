//! Taking over a volume: activate every reachable copy under the granted
//! generation (fencing older owners), check the votes rule, wait out an
//! older owner's read lease, and start the loop, which reconciles the
//! regions a dead predecessor may have left half-written in the
//! background (`super::reconcile`). Also the activation of one copy,
//! which reconnection and resync reuse.

use super::replica::{Mode, Replica, ReplicaSet};
use super::votes::joint_majority;
use super::{Flow, Internal, Loop, Shared, CONNECT_TIMEOUT_MS};
use crate::{Control, Event, OwnerConfig, OwnerError, View, REGION};
use bytes::Bytes;
use futures::future::join_all;
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
                    ComponentRole::Stripe { .. } => unreachable!("{}", super::NO_STRIPES),
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

/// Tells every connected copy that everything before this generation is
/// consistent now (tracking the regions it settles if a copy is out,
/// `super::delta`).
fn barrier_all(replicas: &[Replica], generation: Generation, track: bool) {
    for r in replicas {
        if let Some(p) = &r.peer {
            let barrier = Request::Barrier {
                component: r.component,
                generation,
                seq: 0,
                track,
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
    shared: Shared,
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
    let older_lease = if view.previous_owner_gone {
        tracing::info!(
            volume = vol.id,
            "the previous owner is gone (its node started again since it claimed the volume, \
             or it ran in this process and has stopped): no lease of it can run"
        );
        Duration::ZERO
    } else {
        Duration::from_millis(u64::from(found.lease_ms))
    };
    if !older_lease.is_zero() {
        tracing::info!(
            volume = vol.id,
            "waiting {older_lease:?} for an older owner's read lease to end"
        );
    }
    tokio::time::sleep(older_lease).await;
    shared.lease.renewed(sent);

    let (mut lp, rx) = Loop::new(
        cfg.clone(),
        control,
        shared,
        vol.id,
        vol.size,
        generation,
        replicas,
    );
    lp.repair_delay = view.repair_delay;
    lp.resync_bytes_per_s = view.resync_bytes_per_s;
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
    // What a dead owner left in flight is reconciled while the volume
    // serves; with nothing to reconcile, everything before this
    // generation is consistent now.
    lp.start_reconcile(found.dirty);
    if lp.reconcile.is_none() {
        barrier_all(&lp.replicas, generation, lp.tracking());
    }
    lp.publish_status();
    let tx = lp.tx.clone();
    spawn_ticker(tx.clone(), cfg.tick);
    lp.renew();
    lp.publish_route();
    lp.check_invariants(Flow::Continue);
    tokio::spawn(lp.run(rx));
    Ok(tx)
}
