//! Maintenance mode (vSAN's three modes) and the removal of a node
//! (`docs/reconfiguration.md`, Maintenance mode).
//!
//! The planner ([`plan`], [`to_move`], [`report`]) is pure: for a node
//! and a mode, which components must leave the node, and the
//! `BeginReconfig` per volume that adds a replacement for each
//! (`shoal_placement::replacement`, on a fault domain the volume does not
//! use; the node itself counts as in maintenance, so nothing lands on it)
//! and drops the node's. Or why the mode cannot be entered: a volume that
//! would be inaccessible without the node and is not moved, or a
//! replacement that cannot be placed.
//!
//! - `full-data-migration`: every component on the node.
//! - `ensure-accessibility`: the components of the volumes that are
//!   accessible now and would not be with the node down (the votes rule,
//!   `Volume::quorum`, with the node's components unreachable): an
//!   `ftt=0` volume's copy, or a volume whose other components are
//!   already absent or degraded.
//! - `no-data-migration`: nothing; refused while such a volume exists.
//!
//! The HTTP handlers record the mode in the directory and propose the
//! changes, one per volume under its current generation (proposed once
//! more after a generation conflict). A volume with another change in
//! progress waits, and a move whose change is aborted is begun anew: the
//! node that took the call keeps a small loop ([`follow`]) that begins
//! what is left every [`RETRY_S`] seconds until nothing is left to move
//! or the node leaves maintenance (or changes mode). If that node stops
//! first, entering again (any node) resumes.
//! The owner of each volume carries its change through like any other.

use crate::http::Http;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::Json;
use shoal_api::{EnterMaintenance, ErrorBody, MaintenanceEntered, MaintenanceReport, NodeRemoved};
use shoal_directory::{ClusterState, Command, Directory, DirectoryError, StateError};
use shoal_model::{
    Component, ComponentId, ComponentState, MaintenanceMode, NodeId, NodeState, Volume, VolumeId,
};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

/// Seconds between two passes of [`follow`].
pub const RETRY_S: u64 = 2;

/// Why a node cannot enter maintenance in a mode, for one volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub volume: String,
    pub why: String,
}

/// What entering maintenance in a mode would do now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    /// One `BeginReconfig` per volume that can be moved now.
    pub begins: Vec<(VolumeId, Command)>,
    /// Volumes to move that have another change in progress: later.
    pub waiting: Vec<VolumeId>,
    /// Why the mode cannot be entered (empty: it can).
    pub refusals: Vec<Refusal>,
}

/// Whether `v` can serve I/O (the votes rule, as `Volume::health` counts
/// it) with the components on node `without` unreachable too.
fn accessible(state: &ClusterState, v: &Volume, without: Option<NodeId>) -> bool {
    let reachable = |c: &Component| {
        Some(c.node) != without
            && state
                .nodes
                .get(&c.node)
                .is_some_and(|n| n.state == NodeState::Up)
            && matches!(
                c.state,
                ComponentState::Active | ComponentState::Resyncing | ComponentState::Reconfiguring
            )
    };
    v.quorum(reachable, |c| c.state == ComponentState::Active)
}

/// Whether `v` needs `node` to stay accessible: it is accessible now and
/// would not be without the node.
fn needs(state: &ClusterState, v: &Volume, node: NodeId) -> bool {
    v.components.iter().any(|c| c.node == node)
        && accessible(state, v, None)
        && !accessible(state, v, Some(node))
}

/// Why `v` needs `node`, for people.
fn why_needed(v: &Volume, node: NodeId) -> String {
    let copies = v.data_components().filter(|c| v.in_old_layout(c)).count();
    if copies == 1 {
        format!(
            "its only data copy (ftt={}) is on node {node}: it would be inaccessible without it",
            v.policy.ftt
        )
    } else {
        format!(
            "it would be inaccessible without node {node}: its other components are absent, \
             degraded or on nodes that are down"
        )
    }
}

/// The components on `node` that `mode` moves off it, by volume.
pub fn to_move(
    state: &ClusterState,
    node: NodeId,
    mode: MaintenanceMode,
) -> BTreeMap<VolumeId, Vec<ComponentId>> {
    let mut out = BTreeMap::new();
    for v in state.volumes.values() {
        let moves = match mode {
            MaintenanceMode::FullDataMigration => true,
            MaintenanceMode::EnsureAccessibility => needs(state, v, node),
            MaintenanceMode::NoDataMigration => false,
        };
        let on: Vec<ComponentId> = v
            .components
            .iter()
            .filter(|c| c.node == node)
            .map(|c| c.id)
            .collect();
        if moves && !on.is_empty() {
            out.insert(v.id, on);
        }
    }
    out
}

/// The change that moves `comps` (on `node`) of `v` elsewhere, placed in
/// `state` (where `node` is in maintenance already).
fn begin_for(
    state: &ClusterState,
    v: &Volume,
    comps: &[ComponentId],
    node: NodeId,
    mode: MaintenanceMode,
) -> Result<Command, String> {
    crate::rebuild::move_off(
        state,
        v,
        comps,
        format!("maintenance of node {node} ({mode})"),
    )
}

/// What putting `node` in maintenance in `mode` would do now, from
/// `state`: each change is checked by applying it to a copy of the state
/// (with the node already in maintenance, and the changes before it), so
/// that the space it reserves counts for the next.
pub fn plan(state: &ClusterState, node: NodeId, mode: MaintenanceMode) -> Plan {
    let mut out = Plan::default();
    if mode == MaintenanceMode::NoDataMigration {
        for v in state.volumes.values().filter(|v| needs(state, v, node)) {
            out.refusals.push(Refusal {
                volume: v.name.clone(),
                why: why_needed(v, node),
            });
        }
        return out;
    }
    let mut sim = state.clone();
    if let Err(e) = sim.apply(&Command::EnterMaintenance { node, mode }) {
        out.refusals.push(Refusal {
            volume: String::new(),
            why: e.to_string(),
        });
        return out;
    }
    for (vid, comps) in to_move(state, node, mode) {
        let v = sim.volumes[&vid].clone();
        if v.reconfig.is_some() {
            out.waiting.push(vid);
            continue;
        }
        let refuse = |why: String| Refusal {
            volume: v.name.clone(),
            why,
        };
        match begin_for(&sim, &v, &comps, node, mode) {
            Err(why) => out.refusals.push(refuse(why)),
            Ok(cmd) => match sim.apply(&cmd) {
                Ok(_) => out.begins.push((vid, cmd)),
                Err(e) => out.refusals.push(refuse(e.to_string())),
            },
        }
    }
    out
}

/// `node`'s maintenance as `state` has it.
pub fn report(state: &ClusterState, node: NodeId) -> MaintenanceReport {
    let mode = state.maintenance_of(node);
    let moves = mode.map(|m| to_move(state, node, m)).unwrap_or_default();
    let name = |v: &VolumeId| state.volumes[v].name.clone();
    MaintenanceReport {
        node,
        mode,
        components_to_move: moves.values().map(Vec::len).sum(),
        volumes: moves.keys().map(name).collect(),
        changing: moves
            .keys()
            .filter(|v| state.volumes[v].reconfig.is_some())
            .map(name)
            .collect(),
        components_on_node: state.components_on(node),
        ready: mode.is_some() && moves.is_empty(),
    }
}

/// The refusals as one sentence per volume.
fn refusal_text(node: NodeId, mode: MaintenanceMode, refusals: &[Refusal]) -> String {
    format!(
        "node {node} cannot enter maintenance ({mode}); nothing changed: {}",
        each_text(refusals)
    )
}

/// "volume a: why; volume b: why".
fn each_text(refusals: &[Refusal]) -> String {
    let each: Vec<String> = refusals
        .iter()
        .map(|r| match r.volume.as_str() {
            "" => r.why.clone(),
            name => format!("volume {name}: {}", r.why),
        })
        .collect();
    each.join("; ")
}

// ------------------------------------------------------------- proposing

/// What became of one volume's move.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Begun,
    /// Another change is in progress, or the directory refused for now.
    Later(String),
}

/// Begins the move of volume `vid` (planned afresh from this node's copy
/// of the directory); after a generation conflict, waits for the newer
/// generation to arrive here and proposes once more.
async fn begin_one(dir: &Directory, node: NodeId, mode: MaintenanceMode, vid: VolumeId) -> Outcome {
    let mut last = String::new();
    for _attempt in 0..2 {
        let state = dir.state();
        let p = plan(&state, node, mode);
        let Some((_, cmd)) = p.begins.into_iter().find(|(v, _)| *v == vid) else {
            return match p.refusals.first() {
                Some(r) => Outcome::Later(r.why.clone()),
                None => Outcome::Later("another change is in progress".into()),
            };
        };
        let used = state.volumes.get(&vid).map(|v| v.generation);
        match dir.propose(cmd).await {
            Ok(_) => return Outcome::Begun,
            Err(DirectoryError::State(StateError::GenerationConflict { current, .. })) => {
                last = format!("generation conflict (now {current})");
                let mut w = dir.watch();
                let _ = tokio::time::timeout(Duration::from_secs(RETRY_S), async {
                    while w
                        .borrow_and_update()
                        .volumes
                        .get(&vid)
                        .map(|v| v.generation)
                        == used
                    {
                        if w.changed().await.is_err() {
                            return;
                        }
                    }
                })
                .await;
            }
            Err(e) => return Outcome::Later(e.to_string()),
        }
    }
    Outcome::Later(last)
}

/// The nodes (and modes) whose maintenance a [`follow`] loop of this
/// process keeps.
static FOLLOWED: Mutex<BTreeSet<(NodeId, String)>> = Mutex::new(BTreeSet::new());

/// Begins, every [`RETRY_S`] seconds, the moves of `node`'s maintenance
/// that have not begun (they waited for another change, or their change
/// was aborted), until nothing is left to move or the node leaves
/// maintenance or changes mode. One loop per node and mode in this
/// process.
pub fn follow(dir: Directory, node: NodeId, mode: MaintenanceMode) {
    let key = (node, mode.to_string());
    let Ok(mut f) = FOLLOWED.lock() else { return };
    if !f.insert(key.clone()) {
        return;
    }
    drop(f);
    tokio::spawn(async move {
        let mut said = String::new();
        loop {
            tokio::time::sleep(Duration::from_secs(RETRY_S)).await;
            let state = dir.state();
            if state.maintenance_of(node) != Some(mode) || to_move(&state, node, mode).is_empty() {
                break;
            }
            let p = plan(&state, node, mode);
            // Said once, not every pass, while it lasts.
            let why = each_text(&p.refusals);
            if !p.refusals.is_empty() && why != said {
                tracing::info!(node, %mode, "maintenance: cannot move yet: {why}");
            }
            said = why;
            for (vid, _) in p.begins {
                match begin_one(&dir, node, mode, vid).await {
                    Outcome::Begun => tracing::info!(node, vid, "maintenance: move begun"),
                    Outcome::Later(why) => {
                        tracing::info!(node, vid, "maintenance: move not begun yet: {why}")
                    }
                }
            }
        }
        if let Ok(mut f) = FOLLOWED.lock() {
            f.remove(&key);
        }
        tracing::info!(node, %mode, "maintenance: nothing left to move, or the mode ended");
    });
}

/// Waits (5 s at most) until this node's copy of the directory shows
/// what was just decided.
async fn settle(dir: &Directory, f: impl Fn(&ClusterState) -> bool) {
    let mut w = dir.watch();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while !f(&w.borrow_and_update()) {
            if w.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
}

// ------------------------------------------------------------ HTTP

/// An answer with an error body, as the rest of the API answers.
pub struct Refused(pub StatusCode, pub String);

impl IntoResponse for Refused {
    fn into_response(self) -> HttpResponse {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

impl From<DirectoryError> for Refused {
    fn from(e: DirectoryError) -> Self {
        match e {
            DirectoryError::State(StateError::NoSuchNode(_)) => {
                Refused(StatusCode::NOT_FOUND, e.to_string())
            }
            DirectoryError::State(_) => Refused(StatusCode::CONFLICT, e.to_string()),
            e => Refused(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        }
    }
}

fn known(state: &ClusterState, node: NodeId) -> Result<(), Refused> {
    if state.nodes.contains_key(&node) {
        Ok(())
    } else {
        Err(Refused(
            StatusCode::NOT_FOUND,
            format!("no node with id {node} is registered"),
        ))
    }
}

/// `GET /v1/maintenance`.
pub async fn list(State(h): State<Http>) -> Json<Vec<MaintenanceReport>> {
    let s = h.router.dir.state();
    Json(s.maintenance.keys().map(|&n| report(&s, n)).collect())
}

/// `GET /v1/nodes/{id}/maintenance`.
pub async fn show(
    State(h): State<Http>,
    Path(node): Path<NodeId>,
) -> Result<Json<MaintenanceReport>, Refused> {
    let s = h.router.dir.state();
    known(&s, node)?;
    Ok(Json(report(&s, node)))
}

/// `POST /v1/nodes/{id}/maintenance`: refused (409, each volume named,
/// nothing changed) when the mode would leave a volume inaccessible;
/// else records the mode and begins the moves.
pub async fn enter(
    State(h): State<Http>,
    Path(node): Path<NodeId>,
    Json(req): Json<EnterMaintenance>,
) -> Result<Json<MaintenanceEntered>, Refused> {
    let dir = &h.router.dir;
    let state = dir.state();
    known(&state, node)?;
    let mode = req.mode;
    let p = plan(&state, node, mode);
    if !p.refusals.is_empty() {
        return Err(Refused(
            StatusCode::CONFLICT,
            refusal_text(node, mode, &p.refusals),
        ));
    }
    dir.propose(Command::EnterMaintenance { node, mode })
        .await?;
    settle(dir, |s| s.maintenance_of(node) == Some(mode)).await;
    let name = |v: VolumeId| {
        state
            .volumes
            .get(&v)
            .map(|v| v.name.clone())
            .unwrap_or_default()
    };
    let (mut begun, mut waiting) = (Vec::new(), Vec::new());
    for (vid, _) in &p.begins {
        match begin_one(dir, node, mode, *vid).await {
            Outcome::Begun => begun.push(name(*vid)),
            Outcome::Later(why) => {
                tracing::info!(node, vid, "maintenance: move not begun yet: {why}");
                waiting.push(name(*vid));
            }
        }
    }
    waiting.extend(p.waiting.iter().map(|&v| name(v)));
    tracing::info!(node, %mode, ?begun, ?waiting, "node entered maintenance");
    if mode != MaintenanceMode::NoDataMigration {
        // Also for what began: a move whose change is aborted is begun
        // again.
        follow(dir.clone(), node, mode);
    }
    Ok(Json(MaintenanceEntered {
        report: report(&dir.state(), node),
        begun,
        waiting,
    }))
}

/// `DELETE /v1/nodes/{id}/maintenance`: changes begun finish; nothing
/// moves back.
pub async fn exit(
    State(h): State<Http>,
    Path(node): Path<NodeId>,
) -> Result<Json<MaintenanceReport>, Refused> {
    let dir = &h.router.dir;
    dir.propose(Command::ExitMaintenance { node }).await?;
    settle(dir, |s| s.maintenance_of(node).is_none()).await;
    tracing::info!(node, "node left maintenance");
    Ok(Json(report(&dir.state(), node)))
}

/// `POST /v1/nodes/{id}/remove`: a node that holds no component leaves
/// the directory's voters (or learners) and then the directory, its
/// certificates revoked. A node asked to remove itself hands the call to
/// another node that is up (its own proposals would not outlive its
/// leaving the voters).
pub async fn remove(
    State(h): State<Http>,
    Path(node): Path<NodeId>,
    headers: HeaderMap,
) -> Result<Json<NodeRemoved>, Refused> {
    let dir = &h.router.dir;
    let state = dir.state();
    if node == h.router.node {
        let other = state
            .nodes
            .values()
            .find(|n| n.id != node && n.state == NodeState::Up)
            .ok_or_else(|| {
                Refused(
                    StatusCode::CONFLICT,
                    format!("node {node} is the only node up: it cannot remove itself"),
                )
            })?;
        let token = crate::auth::bearer(&headers).map(String::from);
        let c = shoal_api::Client::with_token(&other.api_addr, token);
        return c.remove_node(node).await.map(Json).map_err(|e| {
            Refused(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("asking node {} to remove node {node}: {e}", other.id),
            )
        });
    }
    let member = dir.members().contains(&node);
    let was_voter = dir.voters().contains(&node);
    if !state.nodes.contains_key(&node) && !member {
        return Err(Refused(
            StatusCode::NOT_FOUND,
            format!("no node with id {node} is registered"),
        ));
    }
    let on = state.components_on(node);
    if on > 0 {
        let r = report(&state, node);
        let hint = match r.mode {
            Some(MaintenanceMode::FullDataMigration) => format!(
                "it is in full-data-migration maintenance and {} component(s) are still to \
                 move: wait until `shoal maintenance status {node}` says ready",
                r.components_to_move
            ),
            _ => format!(
                "move them first: `shoal maintenance enter {node} --mode full-data-migration`"
            ),
        };
        return Err(Refused(
            StatusCode::CONFLICT,
            format!("node {node} holds {on} component(s), so it cannot be removed; {hint}"),
        ));
    }
    if member {
        dir.remove_member(node).await?;
    }
    if state.nodes.contains_key(&node) {
        dir.propose(Command::RemoveNode { node }).await?;
    }
    tracing::info!(node, was_voter, "node removed from the cluster");
    Ok(Json(NodeRemoved { node, was_voter }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::create;
    use shoal_directory::PlannedComponent;
    use shoal_model::ComponentRole;

    /// `n` nodes with a device each (device i on node i); a `raid1
    /// ftt=1` volume "mirror" with copies on nodes 1 and 2 and its
    /// witness on node 3, and an `ftt=0` volume "single" on node 3.
    fn cluster(n: u64) -> (ClusterState, u64, u64) {
        let mut s = crate::testing::nodes(n);
        use ComponentRole::*;
        let m = create(
            &mut s,
            "mirror",
            "raid1 ftt=1",
            &[(1, Data), (2, Data), (3, Witness)],
        );
        let one = create(&mut s, "single", "ftt=0", &[(3, Data)]);
        (s, m, one)
    }

    fn begun(p: &Plan) -> Vec<u64> {
        p.begins.iter().map(|(v, _)| *v).collect()
    }

    /// Applies the plan's changes; every added component is off `node`
    /// and on a fault domain of its own.
    fn apply(s: &mut ClusterState, p: &Plan, node: u64) {
        for (vid, cmd) in &p.begins {
            let Command::BeginReconfig { add, remove, .. } = cmd else {
                panic!("{cmd:?}");
            };
            let v = &s.volumes[vid];
            assert!(remove
                .iter()
                .all(|id| v.components.iter().any(|c| c.id == *id && c.node == node)));
            let mut nodes: BTreeSet<u64> = v
                .components
                .iter()
                .filter(|c| !remove.contains(&c.id))
                .map(|c| c.node)
                .collect();
            for a in add {
                assert_ne!(a.node, node);
                assert!(nodes.insert(a.node), "two components on node {}", a.node);
            }
            s.apply(cmd).unwrap();
        }
    }

    /// Commits every change in progress, as its owner would.
    fn commit_all(s: &mut ClusterState) {
        let ids: Vec<u64> = s.volumes.keys().copied().collect();
        for id in ids {
            let v = &s.volumes[&id];
            if v.reconfig.is_some() {
                s.apply(&Command::CommitReconfig {
                    volume: id,
                    generation: v.generation,
                    added: vec![],
                    remove: vec![],
                })
                .unwrap();
            }
        }
    }

    #[test]
    fn full_data_migration_moves_every_component_off_the_node() {
        let (mut s, m, one) = cluster(5);
        let p = plan(&s, 3, MaintenanceMode::FullDataMigration);
        assert!(p.refusals.is_empty(), "{:?}", p.refusals);
        assert_eq!(begun(&p), vec![m, one]);
        s.apply(&Command::EnterMaintenance {
            node: 3,
            mode: MaintenanceMode::FullDataMigration,
        })
        .unwrap();
        apply(&mut s, &p, 3);
        let r = report(&s, 3);
        assert_eq!((r.components_to_move, r.ready), (2, false));
        assert_eq!(r.changing, vec!["mirror", "single"]);
        commit_all(&mut s);
        let r = report(&s, 3);
        assert!(r.ready && r.components_on_node == 0, "{r:?}");
        assert!(plan(&s, 3, MaintenanceMode::FullDataMigration)
            .begins
            .is_empty());
    }

    #[test]
    fn ensure_accessibility_moves_only_what_the_volumes_need() {
        let (mut s, m, one) = cluster(5);
        let p = plan(&s, 3, MaintenanceMode::EnsureAccessibility);
        assert_eq!(begun(&p), vec![one], "only the ftt=0 copy");
        s.apply(&Command::EnterMaintenance {
            node: 3,
            mode: MaintenanceMode::EnsureAccessibility,
        })
        .unwrap();
        apply(&mut s, &p, 3);
        commit_all(&mut s);
        let r = report(&s, 3);
        assert!(r.ready, "{r:?}");
        assert_eq!(r.components_on_node, 1, "the mirror's witness stays");
        assert!(s.volumes[&m].components.iter().any(|c| c.node == 3));
        // A copy of the mirror absent elsewhere: node 1's copy is needed.
        let v = &s.volumes[&m];
        let (c2, g) = (
            v.components.iter().find(|c| c.node == 2).unwrap().id,
            v.generation,
        );
        s.apply(&Command::SetComponentState {
            volume: m,
            component: c2,
            state: ComponentState::Absent,
            generation: g,
        })
        .unwrap();
        // (The single copy went to node 1, the roomiest by name: it is
        // needed there too.)
        let p = plan(&s, 1, MaintenanceMode::EnsureAccessibility);
        assert_eq!(begun(&p), vec![m, one]);
        let Command::BeginReconfig { remove, .. } = &p.begins[0].1 else {
            panic!()
        };
        let on = |id: &u64| {
            s.volumes[&m]
                .components
                .iter()
                .find(|c| c.id == *id)
                .map(|c| c.node)
        };
        assert_eq!(remove.iter().map(on).collect::<Vec<_>>(), vec![Some(1)]);
    }

    #[test]
    fn no_data_migration_is_refused_while_a_volume_needs_the_node() {
        let (s, _, _) = cluster(5);
        let p = plan(&s, 3, MaintenanceMode::NoDataMigration);
        assert!(p.begins.is_empty());
        assert_eq!(p.refusals.len(), 1, "{:?}", p.refusals);
        assert_eq!(p.refusals[0].volume, "single");
        let text = refusal_text(3, MaintenanceMode::NoDataMigration, &p.refusals);
        assert!(
            text.contains("volume single: its only data copy (ftt=0)"),
            "{text}"
        );
        // Node 1 holds a copy of the mirror only: the other one serves.
        assert_eq!(
            plan(&s, 1, MaintenanceMode::NoDataMigration),
            Plan::default()
        );
    }

    #[test]
    fn a_replacement_that_cannot_be_placed_refuses_the_mode() {
        // Three nodes: the mirror uses every fault domain.
        let (s, _, _) = cluster(3);
        let p = plan(&s, 1, MaintenanceMode::FullDataMigration);
        assert!(p.begins.is_empty());
        assert_eq!(p.refusals.len(), 1, "{:?}", p.refusals);
        assert_eq!(p.refusals[0].volume, "mirror");
        assert!(
            p.refusals[0].why.contains("fault domains"),
            "{:?}",
            p.refusals
        );
        // Node 3 as well: the single copy could go, the witness cannot.
        let p = plan(&s, 3, MaintenanceMode::FullDataMigration);
        let names: Vec<&str> = p.refusals.iter().map(|r| r.volume.as_str()).collect();
        assert_eq!(names, vec!["mirror"]);
    }

    #[test]
    fn a_volume_with_a_change_in_progress_waits() {
        let (mut s, m, one) = cluster(5);
        // Another change of the mirror: its witness moves to node 4.
        let w = s.volumes[&m]
            .components
            .iter()
            .find(|c| c.node == 3)
            .unwrap()
            .id;
        s.apply(&Command::BeginReconfig {
            volume: m,
            generation: 0,
            add: vec![PlannedComponent {
                role: ComponentRole::Witness,
                node: 4,
                device: 4,
                votes: 1,
            }],
            remove: vec![w],
            policy: None,
            reason: "test".into(),
            wanted: None,
        })
        .unwrap();
        let p = plan(&s, 3, MaintenanceMode::FullDataMigration);
        assert!(p.refusals.is_empty(), "{:?}", p.refusals);
        assert_eq!((begun(&p), p.waiting.clone()), (vec![one], vec![m]));
        // Once that change ended, the witness is gone from node 3 anyway.
        commit_all(&mut s);
        assert_eq!(
            to_move(&s, 3, MaintenanceMode::FullDataMigration)
                .keys()
                .collect::<Vec<_>>(),
            vec![&one]
        );
    }

    #[test]
    fn the_report_of_a_node_out_of_maintenance_is_not_ready() {
        let (s, _, _) = cluster(4);
        let r = report(&s, 3);
        assert_eq!((r.mode, r.ready, r.components_on_node), (None, false, 2));
        assert!(r.volumes.is_empty());
    }
}
