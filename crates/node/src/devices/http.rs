//! The REST calls of `shoal device add` and `shoal device remove`
//! (`shoal_api::devices` has the table). An add is done by the device's
//! node: any other node hands it over on the member route
//! `POST /v1/local/devices`. A removal is recorded in the directory here,
//! after checking that every component on the device has a place to go;
//! the device's node carries it out ([`DeviceSet::spawn_removals`]).

use super::{begin_for, check_request, report, to_move_off, AddError, DeviceSet};
use crate::http::Http;
use crate::maintenance::Refused;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::Json;
use shoal_api::{AddDevice, DeviceAdded, DeviceRemoval};
use shoal_directory::{Caller, ClusterState, Command};
use shoal_model::{DeviceId, NodeState};
use std::sync::Arc;
use std::time::Duration;

/// Longest wait for the device's node to add it, in seconds: formatting
/// a thick file writes all of it.
const ADD_TIMEOUT_S: u64 = 300;

impl From<AddError> for Refused {
    fn from(e: AddError) -> Self {
        let code = match e {
            AddError::BadRequest(_) => StatusCode::BAD_REQUEST,
            AddError::AlreadyAdded { .. } | AddError::NotEmpty(_) => StatusCode::CONFLICT,
            AddError::Open { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            AddError::Directory(d) => return Refused::from(d),
        };
        Refused(code, e.to_string())
    }
}

fn local(h: &Http) -> Result<Arc<DeviceSet>, Refused> {
    h.devices.get().cloned().ok_or(Refused(
        StatusCode::SERVICE_UNAVAILABLE,
        "this node's devices are not registered yet".into(),
    ))
}

/// `POST /v1/devices` (admin): done here when the device is this node's,
/// else handed to its node.
pub async fn add(
    State(h): State<Http>,
    Json(req): Json<AddDevice>,
) -> Result<(StatusCode, Json<DeviceAdded>), Refused> {
    let spec = check_request(&req)?;
    let set = local(&h)?;
    if req.node == set.node() {
        return Ok((StatusCode::CREATED, Json(set.add(spec).await?)));
    }
    let state = h.router.dir.state();
    let Some(n) = state.nodes.get(&req.node) else {
        return Err(Refused(
            StatusCode::NOT_FOUND,
            format!("no node with id {} is registered", req.node),
        ));
    };
    if n.state != NodeState::Up {
        return Err(Refused(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "node {} is {}: a device is added on a running node",
                n.id, n.state
            ),
        ));
    }
    let t = h.liveness.transport();
    let url = format!("{}://{}/v1/local/devices", t.scheme, n.api_addr);
    let unreachable = |e: String| {
        Refused(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("node {}: {e}", req.node),
        )
    };
    let r = t
        .client
        .post(&url)
        .timeout(Duration::from_secs(ADD_TIMEOUT_S))
        .json(&req)
        .send()
        .await
        .map_err(|e| unreachable(e.to_string()))?;
    let code = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if code.is_success() {
        let added: DeviceAdded = r.json().await.map_err(|e| unreachable(e.to_string()))?;
        return Ok((StatusCode::CREATED, Json(added)));
    }
    let body: shoal_api::ErrorBody = r.json().await.map_err(|e| unreachable(e.to_string()))?;
    Err(Refused(code, body.error))
}

/// `POST /v1/local/devices` (member route): another node hands over an
/// add of one of this node's devices.
pub async fn add_here(
    State(h): State<Http>,
    Extension(caller): Extension<Caller>,
    Json(req): Json<AddDevice>,
) -> Result<(StatusCode, Json<DeviceAdded>), Refused> {
    if !matches!(caller, Caller::Node(_)) {
        return Err(Refused(
            StatusCode::FORBIDDEN,
            format!("{caller:?} may not add devices"),
        ));
    }
    let spec = check_request(&req)?;
    let set = local(&h)?;
    if req.node != set.node() {
        return Err(Refused(
            StatusCode::BAD_REQUEST,
            format!("this is node {}, not node {}", set.node(), req.node),
        ));
    }
    Ok((StatusCode::CREATED, Json(set.add(spec).await?)))
}

fn known(state: &ClusterState, id: DeviceId) -> Result<DeviceRemoval, Refused> {
    report(state, id).ok_or(Refused(
        StatusCode::NOT_FOUND,
        format!("no device with id {id} is registered"),
    ))
}

/// Longest wait for another node to say what its device's removal waits
/// for, in seconds: the report goes out without it after that.
const BLOCKED_ASK_TIMEOUT_S: u64 = 2;

/// `GET /v1/devices/{id}`: the device and what its removal waits for
/// (why it cannot go on, as the device's node says: asked on the member
/// route when it is another node).
pub async fn show(
    State(h): State<Http>,
    Path(id): Path<DeviceId>,
) -> Result<Json<DeviceRemoval>, Refused> {
    let state = h.router.dir.state();
    let mut r = known(&state, id)?;
    if !r.retiring {
        return Ok(Json(r));
    }
    let here = h.devices.get().map(|s| s.node());
    r.blocked = match here {
        Some(n) if n == r.node => h.devices.get().and_then(|s| s.blocked(id)),
        _ => ask_blocked(&h, &state, r.node, id).await,
    };
    Ok(Json(r))
}

/// What node `node` says its device `id`'s removal waits for; None when
/// it waits for nothing or does not answer in time.
async fn ask_blocked(h: &Http, state: &ClusterState, node: u64, id: DeviceId) -> Option<String> {
    let n = state.nodes.get(&node)?;
    if n.state != NodeState::Up {
        return Some(format!(
            "node {node} is {}: the removal goes on when it is back (or remove the node)",
            n.state
        ));
    }
    let t = h.liveness.transport();
    let url = format!(
        "{}://{}/v1/local/devices/{id}/blocked",
        t.scheme, n.api_addr
    );
    let r = t
        .client
        .get(&url)
        .timeout(Duration::from_secs(BLOCKED_ASK_TIMEOUT_S))
        .send()
        .await
        .ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.json::<Option<String>>().await.ok().flatten()
}

/// `GET /v1/local/devices/{id}/blocked` (member route): what the removal
/// of this node's device `id` waits for, if anything.
pub async fn blocked_here(
    State(h): State<Http>,
    Extension(caller): Extension<Caller>,
    Path(id): Path<DeviceId>,
) -> Result<Json<Option<String>>, Refused> {
    if !matches!(caller, Caller::Node(_)) {
        return Err(Refused(
            StatusCode::FORBIDDEN,
            format!("{caller:?} may not ask this"),
        ));
    }
    Ok(Json(local(&h)?.blocked(id)))
}

/// `DELETE /v1/devices/{id}` (admin): refused, changing nothing, when it
/// is its node's last device or a component on it has nowhere to go;
/// else the device is marked for removal (202) and its node moves its
/// components off and then unregisters it.
pub async fn remove(
    State(h): State<Http>,
    Path(id): Path<DeviceId>,
) -> Result<(StatusCode, Json<DeviceRemoval>), Refused> {
    let dir = &h.router.dir;
    let state = dir.state();
    known(&state, id)?;
    check_removal(&state, id).map_err(|why| {
        Refused(
            StatusCode::CONFLICT,
            format!("device {id} cannot be removed; nothing changed: {why}"),
        )
    })?;
    dir.propose(Command::RetireDevice { device: id }).await?;
    tracing::info!(device = id, "device removal begun");
    Ok((StatusCode::ACCEPTED, Json(known(&dir.state(), id)?)))
}

/// `POST /v1/devices/{id}/keep` (admin): calls the device's removal off
/// while it still holds components (moves already begun go on; placement
/// may use the device again); 409, changing nothing, once it holds none.
pub async fn keep(
    State(h): State<Http>,
    Path(id): Path<DeviceId>,
) -> Result<Json<DeviceRemoval>, Refused> {
    let dir = &h.router.dir;
    known(&dir.state(), id)?;
    dir.propose(Command::KeepDevice { device: id }).await?;
    tracing::info!(device = id, "device removal called off");
    Ok(Json(known(&dir.state(), id)?))
}

/// Why `device` cannot be removed now: it is its node's last one, or a
/// component on it has no place to go once the device is retiring. A
/// volume with a change in progress is judged as it will stand once that
/// change ends: committed, or aborted when it cannot commit (an added
/// copy failed).
/// Ends, in `sim`, the change in progress on volume `vid` (if any) as it
/// will most likely end: committed, or else aborted.
fn end_change(sim: &mut ClusterState, vid: shoal_model::VolumeId) {
    let Some(v) = sim.volumes.get(&vid) else {
        return;
    };
    let Some(r) = v.reconfig.clone() else {
        return;
    };
    let (volume, generation) = (v.id, v.generation);
    let commit = Command::CommitReconfig {
        volume,
        generation,
        added: r.added.clone(),
        remove: r.remove.clone(),
    };
    if sim.apply(&commit).is_err() {
        let abort = Command::AbortReconfig {
            volume,
            generation,
            added: r.added,
            remove: r.remove,
        };
        let ended = sim.apply(&abort);
        debug_assert!(
            ended.is_ok(),
            "an abort of the change in progress: {ended:?}"
        );
    }
}

pub fn check_removal(state: &ClusterState, device: DeviceId) -> Result<(), String> {
    let Some(d) = state.devices.get(&device) else {
        return Err(format!("no device with id {device} is registered"));
    };
    if d.retiring {
        return Ok(());
    }
    let serving = |o: &&shoal_model::DeviceInfo| {
        o.node == d.node
            && o.id != device
            && !o.retiring
            && o.state != shoal_model::DeviceState::Failed
    };
    if !state.devices.values().any(|o| serving(&o)) {
        return Err(format!(
            "it is the last device node {n} serves: add another first (shoal device add {n} PATH), \
             or remove the node (shoal maintenance enter {n} --mode full-data-migration, then \
             shoal cluster remove-node {n})",
            n = d.node
        ));
    }
    let mut sim = state.clone();
    sim.apply(&Command::RetireDevice { device })
        .map_err(|e| e.to_string())?;
    let mut why = Vec::new();
    for vid in to_move_off(state, device).into_keys() {
        end_change(&mut sim, vid);
        let v = sim.volumes[&vid].clone();
        let comps: Vec<_> = v
            .components
            .iter()
            .filter(|c| c.device == device)
            .map(|c| c.id)
            .collect();
        if comps.is_empty() {
            continue;
        }
        match begin_for(&sim, &v, &comps, device)
            .and_then(|c| sim.apply(&c).map_err(|e| e.to_string()))
        {
            Ok(_) => {}
            Err(e) => why.push(format!("volume {}: {e}", v.name)),
        }
    }
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{create, nodes};
    use shoal_directory::Response;
    use shoal_model::ComponentRole::{Data, Witness};

    /// Three nodes; volume "v" (`reserve=100`, so space counts) with
    /// copies on nodes 1 and 2 and its witness on 3; a second device on
    /// node 1 of `spare_bytes`. Answers the state, node 1's first device
    /// and the volume.
    fn cluster(spare_bytes: u64) -> (ClusterState, DeviceId, u64) {
        let mut s = nodes(3);
        let v = create(
            &mut s,
            "v",
            "raid1 ftt=1 reserve=100",
            &[(1, Data), (2, Data), (3, Witness)],
        );
        let first = s.devices.values().find(|d| d.node == 1).unwrap().id;
        let Ok(Response::Id(_)) = s.apply(&Command::RegisterDevice {
            node: 1,
            path: "/spare".into(),
            capacity: spare_bytes,
            store_uuid: 0,
        }) else {
            panic!("spare device not registered");
        };
        (s, first, v)
    }

    /// Begins a change of `v` that moves nothing (its reserve only).
    fn begin_reserve_change(s: &mut ClusterState, v: u64) {
        let generation = s.volumes[&v].generation;
        s.apply(&Command::BeginReconfig {
            volume: v,
            generation,
            add: vec![],
            remove: vec![],
            policy: Some("raid1 ftt=1 reserve=90".parse().unwrap()),
            reason: "policy raid1 ftt=1 reserve=90".into(),
            wanted: None,
        })
        .unwrap();
    }

    #[test]
    fn a_removal_is_judged_with_the_change_in_progress_ended() {
        // Every other fault domain holds a component of "v": its copy can
        // only move to the spare device beside it, which is too small.
        let (mut s, first, v) = cluster(64 << 10);
        let why = check_removal(&s, first).unwrap_err();
        assert!(why.contains("volume v"), "{why}");
        // With a change in progress on "v", the same: it is judged as it
        // will stand once the change commits (not skipped).
        begin_reserve_change(&mut s, v);
        let why = check_removal(&s, first).unwrap_err();
        assert!(why.contains("volume v"), "{why}");

        // A spare with room takes it, change in progress or not.
        let (mut s, first, v) = cluster(1 << 30);
        assert_eq!(check_removal(&s, first), Ok(()));
        begin_reserve_change(&mut s, v);
        assert_eq!(check_removal(&s, first), Ok(()));
        // The state itself is left as it was.
        assert!(s.volumes[&v].reconfig.is_some());
        assert!(!s.devices[&first].retiring);
    }
}
