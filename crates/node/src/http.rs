//! The node's HTTP API: REST (`/v1/...`), Prometheus metrics (`/metrics`)
//! and the directory's Raft endpoints, on one port.

use crate::liveness::Liveness;
use crate::router::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response as HttpResponse};
use axum::routing::{get, post};
use axum::{Extension, Json};
use shoal_api::{
    healing_text, CapacityReport, ClusterSettingsUpdate, Connections, CopyDigest, CreateVolume,
    Digests, ErrorBody, HealingReport, Heartbeat, Owners, Resize, ResyncKind, ResyncReport,
    StatusReport, ThrottleReport, VolumeReport, VolumeSettings, WaitingComponent,
};
use shoal_directory::{Caller, ClusterState, Command, DirectoryError, StateError};
use shoal_model::{
    check_volume_name, check_volume_size, ClusterSettings, ComponentState, NodeId, NodeState,
    Policy, Volume, MAX_REPAIR_DELAY_S, MAX_RESYNC_MIB_PER_S, MIN_REPAIR_DELAY_S,
};
use shoal_owner::status::{HealingStatus, ResyncStatus};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone)]
pub struct Http {
    pub router: Arc<Router>,
    pub liveness: Arc<Liveness>,
    /// Set once the node's devices are registered.
    pub replicas: Arc<std::sync::OnceLock<Arc<crate::replica::Replicas>>>,
    /// Set once the scrubber runs.
    pub scrubber: Arc<std::sync::OnceLock<Arc<crate::scrub::Scrubber>>>,
    /// Set once the node's devices are registered.
    pub devices: Arc<std::sync::OnceLock<Arc<crate::devices::DeviceSet>>>,
}

struct ApiErr(StatusCode, String);

impl IntoResponse for ApiErr {
    fn into_response(self) -> HttpResponse {
        (self.0, Json(ErrorBody { error: self.1 })).into_response()
    }
}

fn bad(msg: impl ToString) -> ApiErr {
    ApiErr(StatusCode::BAD_REQUEST, msg.to_string())
}

impl From<DirectoryError> for ApiErr {
    fn from(e: DirectoryError) -> Self {
        match e {
            DirectoryError::State(StateError::NameTaken(_)) => {
                ApiErr(StatusCode::CONFLICT, e.to_string())
            }
            DirectoryError::State(StateError::NoSuchVolume(_) | StateError::NoSuchToken(_)) => {
                ApiErr(StatusCode::NOT_FOUND, e.to_string())
            }
            DirectoryError::State(_) => bad(e),
            other => ApiErr(StatusCode::SERVICE_UNAVAILABLE, other.to_string()),
        }
    }
}

pub fn report(state: &ClusterState, v: &Volume) -> VolumeReport {
    let uris = state
        .nodes
        .values()
        .filter(|n| n.state == NodeState::Up)
        .map(|n| format!("nbd://{}/{}", n.nbd_addr, v.name))
        .collect();
    let health = v.health(&state.nodes);
    VolumeReport {
        volume: v.clone(),
        health,
        uris,
        throttle: None,
        resync: None,
        healing: healing_text(health, None),
        capacity: None,
    }
}

/// Seconds a report waits for the owner's node to tell what the volume's
/// IOPS limit held back and how it heals: the report goes out without it
/// after that.
const OWNER_STATS_TIMEOUT_S: u64 = 2;

/// What node `owner` says of the volumes it owns: this node's own report,
/// or the owner's node's through its API (None when it is down or does
/// not answer in time).
async fn owners_of(
    h: &Http,
    state: &ClusterState,
    owner: NodeId,
    token: Option<String>,
) -> Option<Owners> {
    if owner == h.router.node {
        return Some(owners_report(h));
    }
    let n = state
        .nodes
        .get(&owner)
        .filter(|n| n.state == NodeState::Up)?;
    // Asked with the caller's own token: it may read this.
    let client = shoal_api::Client::with_token(&n.api_addr, token);
    tokio::time::timeout(Duration::from_secs(OWNER_STATS_TIMEOUT_S), client.owners())
        .await
        .ok()?
        .ok()
}

/// The reports of the volumes `vs`, with what their owners say (each
/// owner's node asked once, all at the same time).
async fn reports_with_owners(
    h: &Http,
    state: &ClusterState,
    vs: &[&Volume],
    token: Option<String>,
) -> Vec<VolumeReport> {
    let owners: BTreeSet<NodeId> = vs.iter().filter_map(|v| v.owner).collect();
    let asks = owners.into_iter().map(|o| {
        let token = token.clone();
        async move { owners_of(h, state, o, token).await.map(|r| (o, r)) }
    });
    let answers: BTreeMap<NodeId, Owners> = futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect();
    let owner_of = |name: &str| {
        let v = state.volume_by_name(name)?;
        answers.get(&v.owner?)
    };
    let written_of = |name: &str| {
        let o = owner_of(name)?;
        o.written.iter().find(|(n, _)| n == name).map(|(_, b)| *b)
    };
    let capacity = crate::capacity::measure(&h.router, state, vs, written_of).await;
    vs.iter()
        .zip(capacity)
        .map(|(v, c)| {
            let mut r = with_owner(report(state, v), v.owner.and_then(|o| answers.get(&o)));
            r.capacity = Some(c);
            r
        })
        .collect()
}

/// A volume's report completed with its owner's (None: the owner did not
/// answer, or there is none): the IOPS limit's counts, the copy being
/// brought up to date, and the healing line.
fn with_owner(mut r: VolumeReport, owners: Option<&Owners>) -> VolumeReport {
    let name = &r.volume.name;
    let healing = owners.and_then(|o| o.healing.iter().find(|x| &x.volume == name));
    r.throttle = owners
        .and_then(|o| o.throttles.iter().find(|t| &t.volume == name))
        .cloned();
    r.resync = healing.and_then(|x| x.resync.clone());
    r.healing = healing_text(r.health, healing);
    r
}

/// The owner's healing status of `volume` as the API reports it.
fn healing_report(volume: String, node: NodeId, s: &HealingStatus) -> HealingReport {
    HealingReport {
        volume,
        node,
        resync: s.resync.as_ref().map(resync_report),
        change: s.change.clone(),
        waiting: s
            .waiting
            .iter()
            .map(|(c, left)| WaitingComponent {
                component: *c,
                // Whole seconds, rounded up: "0 s left" only when due.
                left_s: left.as_secs() + u64::from(left.subsec_nanos() > 0),
            })
            .collect(),
        cannot_rebuild: s.cannot_rebuild.clone(),
    }
}

/// One copy being brought up to date, as the API reports it.
fn resync_report(r: &ResyncStatus) -> ResyncReport {
    ResyncReport {
        component: r.component,
        kind: if r.added {
            ResyncKind::Rebuild
        } else {
            ResyncKind::Resync
        },
        bytes_to_copy: r.bytes_total,
        bytes_copied: r.bytes_done,
        rate_bytes_per_s: r.rate_bytes_per_s(),
        eta_s: r.eta().map(|d| d.as_secs()),
    }
}

/// The REST API of plain HTTP: every call with an API token.
pub fn routes(h: Http) -> axum::Router {
    axum::Router::new()
        .route("/v1/status", get(status))
        .route("/v1/volumes", get(list).post(create))
        .route("/v1/volumes/{name}", get(show).delete(delete))
        .route("/v1/volumes/{name}/resize", post(resize))
        .route("/v1/volumes/{name}/settings", post(settings))
        .route("/v1/volumes/{name}/policy", post(set_policy))
        .route("/v1/volumes/{name}/digests", get(digests))
        .route(
            "/v1/cluster/settings",
            get(cluster_settings).post(set_cluster_settings),
        )
        .route("/v1/local/connections", get(connections))
        .route("/v1/local/owners", get(owners))
        .route("/v1/scrub", get(scrub_status).post(scrub_start))
        .route("/metrics", get(metrics))
        .route("/v1/tokens", get(tokens).post(create_token))
        .route("/v1/tokens/{id}", axum::routing::delete(revoke_token))
        .route("/v1/nodes/{id}/revoke", post(revoke_node))
        .route("/v1/maintenance", get(crate::maintenance::list))
        .route(
            "/v1/nodes/{id}/maintenance",
            get(crate::maintenance::show)
                .post(crate::maintenance::enter)
                .delete(crate::maintenance::exit),
        )
        .route("/v1/nodes/{id}/remove", post(crate::maintenance::remove))
        .route("/v1/devices", post(crate::devices::http::add))
        .route(
            "/v1/devices/{id}",
            get(crate::devices::http::show).delete(crate::devices::http::remove),
        )
        .route("/v1/devices/{id}/keep", post(crate::devices::http::keep))
        .route("/v1/certs/client", post(client_cert))
        .route("/v1/certs/client/{name}/revoke", post(revoke_client))
        .route("/livez", get(livez))
        .route_layer(axum::middleware::from_fn_with_state(
            h.clone(),
            crate::auth::require,
        ))
        .layer(axum::extract::DefaultBodyLimit::max(API_BODY_MAX_BYTES))
        .with_state(h)
}

/// The routes nodes call on each other, served only to proven members
/// (mutual TLS; each request carries its [`Caller`]).
pub fn member_routes(h: Http) -> axum::Router {
    axum::Router::new()
        .route("/v1/heartbeat", post(heartbeat))
        .route("/v1/local/devices", post(crate::devices::http::add_here))
        .route(
            "/v1/local/devices/{id}/blocked",
            get(crate::devices::http::blocked_here),
        )
        .layer(axum::extract::DefaultBodyLimit::max(API_BODY_MAX_BYTES))
        .with_state(h.clone())
        .merge(h.router.dir.router())
}

/// The one route for a node that has no certificate yet.
pub fn join_routes(h: Http) -> axum::Router {
    axum::Router::new()
        .route("/v1/join", post(join_cert))
        .layer(axum::extract::DefaultBodyLimit::max(JOIN_BODY_MAX_BYTES))
        .with_state(h)
}

/// Largest body of a join request, in bytes: a token, a few addresses and
/// a certificate request of a few hundred bytes.
const JOIN_BODY_MAX_BYTES: usize = 16 << 10;

async fn join_cert(
    State(h): State<Http>,
    Json(req): Json<shoal_api::JoinCertRequest>,
) -> Result<Json<shoal_api::JoinCertAnswer>, ApiErr> {
    use crate::membership::JoinRefused as R;
    crate::membership::issue_for_join(&h.router.dir, &req)
        .await
        .map(Json)
        .map_err(|e| {
            let status = match &e {
                R::Unauthorized(_) => StatusCode::UNAUTHORIZED,
                R::Conflict(_) => StatusCode::CONFLICT,
                R::Bad(_) => StatusCode::BAD_REQUEST,
                R::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            };
            ApiErr(status, e.to_string())
        })
}

async fn livez(State(h): State<Http>) -> Json<shoal_api::Livez> {
    Json(shoal_api::Livez {
        node: h.router.node,
        cluster_id: h.router.dir.state().cluster_id.clone(),
    })
}

async fn tokens(State(h): State<Http>) -> Json<Vec<shoal_api::TokenInfo>> {
    let s = h.router.dir.state();
    Json(
        s.tokens
            .values()
            .map(|t| shoal_api::TokenInfo {
                id: t.id.clone(),
                role: t.role,
                note: t.note.clone(),
            })
            .collect(),
    )
}

async fn create_token(
    State(h): State<Http>,
    Json(req): Json<shoal_api::CreateToken>,
) -> Result<Json<shoal_api::NewToken>, ApiErr> {
    if req.note.len() > TOKEN_NOTE_MAX_BYTES {
        return Err(bad(format!(
            "a token's note is at most {TOKEN_NOTE_MAX_BYTES} bytes"
        )));
    }
    let (text, mut token) = crate::new_token(req.role, &req.note);
    let ttl_s = match req.role {
        shoal_model::Role::Join => Some(req.ttl_s.unwrap_or(shoal_api::JOIN_TOKEN_DEFAULT_TTL_S)),
        _ => req.ttl_s,
    };
    token.expires_unix_s = ttl_s.map(|t| crate::membership::now_unix_s().saturating_add(t));
    let shown = match req.role {
        shoal_model::Role::Join => {
            let ca = cluster_ca(&h)?;
            let pin = shoal_tls::JoinPin::of_pem(&ca.cert_pem)
                .map_err(|e| ApiErr(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
            shoal_model::JoinTokenText {
                token: text.clone(),
                ca_sha256: pin.0,
            }
            .reveal()
        }
        _ => text.reveal(),
    };
    h.router.dir.propose(Command::CreateToken { token }).await?;
    Ok(Json(shoal_api::NewToken {
        id: text.id.clone(),
        role: req.role,
        token: shown,
    }))
}

/// The cluster CA as the directory keeps it, or 503 while it is not
/// recorded yet (a cluster being founded).
fn cluster_ca(h: &Http) -> Result<shoal_tls::CaMaterial, ApiErr> {
    let state = h.router.dir.state();
    let ca = state.ca.as_ref().ok_or_else(|| {
        ApiErr(
            StatusCode::SERVICE_UNAVAILABLE,
            "the cluster CA is not recorded yet".into(),
        )
    })?;
    Ok(shoal_tls::CaMaterial {
        cert_pem: ca.cert_pem.clone(),
        key_pem: ca.key_pem.clone(),
    })
}

/// Longest name of an NBD client's certificate.
const CLIENT_NAME_MAX_BYTES: usize = 64;

async fn client_cert(
    State(h): State<Http>,
    Json(req): Json<shoal_api::ClientCertRequest>,
) -> Result<Json<shoal_api::JoinCertAnswer>, ApiErr> {
    let ok = |c: char| c.is_ascii_alphanumeric() || "._-".contains(c);
    if req.name.is_empty() || req.name.len() > CLIENT_NAME_MAX_BYTES || !req.name.chars().all(ok) {
        return Err(bad(format!(
            "a client's name is 1 to {CLIENT_NAME_MAX_BYTES} of A-Z a-z 0-9 . _ -"
        )));
    }
    let material = cluster_ca(&h)?;
    let cluster_id = h.router.dir.state().cluster_id.clone();
    let name = req.name;
    let subject = shoal_tls::Subject::Client { name: name.clone() };
    let cert_pem = shoal_tls::issue(&material, &cluster_id, &req.csr_pem, &subject)
        .map_err(|e| bad(e.to_string()))?;
    // Recorded before it is handed out, so that it can be revoked.
    let cert_sha256 = shoal_tls::fingerprint_pem(&cert_pem).map_err(|e| bad(e.to_string()))?;
    h.router
        .dir
        .propose(Command::RecordClientCert {
            name: name.clone(),
            cert_sha256,
        })
        .await?;
    Ok(Json(shoal_api::JoinCertAnswer {
        cert_pem,
        ca_pem: material.cert_pem,
    }))
}

async fn revoke_client(
    State(h): State<Http>,
    Path(name): Path<String>,
) -> Result<Json<serde_json::Value>, ApiErr> {
    h.router
        .dir
        .propose(Command::RevokeClientCerts { name: name.clone() })
        .await?;
    Ok(Json(serde_json::json!({ "revoked_client": name })))
}

async fn revoke_node(
    State(h): State<Http>,
    Path(id): Path<shoal_model::NodeId>,
) -> Result<Json<serde_json::Value>, ApiErr> {
    if id == h.router.node && h.router.dir.members().len() == 1 {
        return Err(bad("the only member cannot revoke itself"));
    }
    h.router
        .dir
        .propose(Command::RevokeNodeCerts { node: id })
        .await?;
    Ok(Json(serde_json::json!({ "revoked_node": id })))
}

/// Longest note of a token, in bytes.
const TOKEN_NOTE_MAX_BYTES: usize = 256;

async fn revoke_token(
    State(h): State<Http>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiErr> {
    h.router
        .dir
        .propose(Command::RevokeToken { id: id.clone() })
        .await?;
    Ok(Json(serde_json::json!({ "revoked": id })))
}

/// Largest body of a REST request, in bytes: the largest is a heartbeat
/// with a node's devices, a few hundred bytes each.
const API_BODY_MAX_BYTES: usize = 256 << 10;

async fn status(State(h): State<Http>, headers: HeaderMap) -> Json<StatusReport> {
    let s = h.router.dir.state();
    let vs: Vec<&Volume> = s.volumes.values().collect();
    let token = crate::auth::bearer(&headers).map(String::from);
    let volumes = reports_with_owners(&h, &s, &vs, token).await;
    // The cluster's: every volume's added up (unknown if one is).
    let capacity = volumes
        .iter()
        .map(|v| v.capacity.unwrap_or_default())
        .reduce(CapacityReport::plus);
    Json(StatusReport {
        cluster_id: s.cluster_id.clone(),
        leader: h.router.dir.leader(),
        voters: h.router.dir.voters(),
        nodes: s.nodes.values().cloned().collect(),
        devices: s
            .devices
            .values()
            .map(|d| shoal_api::DeviceReport {
                device: d.clone(),
                node_state: s
                    .nodes
                    .get(&d.node)
                    .map_or(shoal_model::NodeState::Down, |n| n.state),
            })
            .collect(),
        volumes,
        capacity,
    })
}

async fn list(State(h): State<Http>, headers: HeaderMap) -> Json<Vec<VolumeReport>> {
    let s = h.router.dir.state();
    let vs: Vec<&Volume> = s.volumes.values().collect();
    let token = crate::auth::bearer(&headers).map(String::from);
    Json(reports_with_owners(&h, &s, &vs, token).await)
}

async fn show(
    State(h): State<Http>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Result<Json<VolumeReport>, ApiErr> {
    show_report(&h, &name, &headers).await
}

/// The volume's report, with what its owner says of its IOPS limit and
/// its healing.
async fn show_report(
    h: &Http,
    name: &str,
    headers: &HeaderMap,
) -> Result<Json<VolumeReport>, ApiErr> {
    let s = h.router.state_knowing(name).await;
    let v = s
        .volume_by_name(name)
        .ok_or_else(|| ApiErr(StatusCode::NOT_FOUND, format!("no volume named {name:?}")))?;
    let token = crate::auth::bearer(headers).map(String::from);
    let owners = match v.owner {
        Some(o) => owners_of(h, &s, o, token).await,
        None => None,
    };
    let written_of = |n: &str| {
        let o = owners.as_ref()?;
        o.written.iter().find(|(x, _)| x == n).map(|(_, b)| *b)
    };
    let capacity = crate::capacity::measure(&h.router, &s, &[v], written_of).await;
    let mut r = with_owner(report(&s, v), owners.as_ref());
    r.capacity = capacity.into_iter().next();
    Ok(Json(r))
}

async fn settings(
    State(h): State<Http>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Json(req): Json<VolumeSettings>,
) -> Result<Json<VolumeReport>, ApiErr> {
    if let Some(iops_limit) = req.iops_limit {
        h.router
            .dir
            .propose(Command::SetIopsLimit {
                name: name.clone(),
                iops_limit,
            })
            .await?;
        wait_for(&h, |s| {
            s.volume_by_name(&name)
                .is_some_and(|v| v.policy.iops_limit == iops_limit)
        })
        .await;
    }
    show_report(&h, &name, &headers).await
}

/// Changes a volume's policy in place (`crate::policy_change`): begins
/// the change and answers the volume's report (with the change in
/// progress, or unchanged when it has the policy already).
async fn set_policy(
    State(h): State<Http>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Json(req): Json<shoal_api::SetPolicy>,
) -> Result<Json<VolumeReport>, ApiErr> {
    use crate::policy_change as pc;
    let refused = |e: pc::PolicyChangeError| {
        let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::CONFLICT);
        ApiErr(status, e.to_string())
    };
    let policy = pc::parse(&req.policy).map_err(refused)?;
    pc::change(&h.router.dir, &name, &policy)
        .await
        .map_err(refused)?;
    wait_for(&h, |s| {
        s.volume_by_name(&name)
            .is_some_and(|v| v.reconfig.is_some() || v.policy == policy)
    })
    .await;
    show_report(&h, &name, &headers).await
}

/// The cluster-wide settings, as this node's copy of the directory has
/// them.
async fn cluster_settings(State(h): State<Http>) -> Json<ClusterSettings> {
    Json(h.router.dir.state().settings.clone())
}

/// Changes the cluster-wide settings given (a value out of range: 400
/// with why, and nothing changes), and answers all of them.
async fn set_cluster_settings(
    State(h): State<Http>,
    Json(req): Json<ClusterSettingsUpdate>,
) -> Result<Json<ClusterSettings>, ApiErr> {
    check_settings(&req)?;
    if let Some(repair_delay_s) = req.repair_delay_s {
        h.router
            .dir
            .propose(Command::SetRepairDelay { repair_delay_s })
            .await?;
        wait_for(&h, |s| s.settings.repair_delay_s == repair_delay_s).await;
    }
    if let Some(resync_mib_per_s) = req.resync_mib_per_s {
        h.router
            .dir
            .propose(Command::SetResyncLimit { resync_mib_per_s })
            .await?;
        wait_for(&h, |s| s.settings.resync_mib_per_s == resync_mib_per_s).await;
    }
    Ok(Json(h.router.dir.state().settings.clone()))
}

/// Refuses an update with any value out of range before one is applied
/// (the directory checks each again), so that an update of two settings
/// with one bad changes neither.
fn check_settings(req: &ClusterSettingsUpdate) -> Result<(), ApiErr> {
    if let Some(v) = req.repair_delay_s {
        if !(MIN_REPAIR_DELAY_S..=MAX_REPAIR_DELAY_S).contains(&v) {
            return Err(bad(StateError::RepairDelayOutOfRange(v)));
        }
    }
    match req.resync_mib_per_s {
        Some(v) if v > MAX_RESYNC_MIB_PER_S => Err(bad(StateError::ResyncLimitOutOfRange(v))),
        _ => Ok(()),
    }
}

async fn create(
    State(h): State<Http>,
    Json(req): Json<CreateVolume>,
) -> Result<Json<VolumeReport>, ApiErr> {
    check_volume_name(&req.name).map_err(bad)?;
    check_volume_size(req.size).map_err(bad)?;
    let policy: Policy = req.policy.parse().map_err(bad)?;
    let s = h.router.dir.state();
    if s.volume_by_name(&req.name).is_some() {
        return Err(ApiErr(
            StatusCode::CONFLICT,
            format!("a volume named {:?} already exists", req.name),
        ));
    }
    let wrapped_key = match (policy.encrypt, &h.router.cluster_key) {
        (false, _) => None,
        (true, Some(k)) => Some(crate::encryption::new_wrapped_key(k, &req.name)),
        (true, None) => {
            return Err(bad(
                "encrypt=on needs the cluster key: start the nodes with --key-file \
                 (shoal up makes one)",
            ))
        }
    };
    let nodes: Vec<_> = s.nodes.values().cloned().collect();
    let devices: Vec<_> = s.devices.values().cloned().collect();
    let planned = shoal_placement::place(&policy, req.size, &nodes, &devices)
        .map_err(|e| ApiErr(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()))?;
    let components = planned
        .into_iter()
        .map(|p| shoal_directory::PlannedComponent {
            role: p.role,
            node: p.node,
            device: p.device,
            votes: p.votes,
        })
        .collect();
    h.router
        .dir
        .propose(Command::CreateVolume {
            name: req.name.clone(),
            size: req.size,
            policy,
            components,
            wrapped_key,
        })
        .await?;
    wait_for(&h, |s| s.volume_by_name(&req.name).is_some()).await;
    let s = h.router.dir.state();
    let v = s
        .volume_by_name(&req.name)
        .ok_or_else(|| ApiErr(StatusCode::INTERNAL_SERVER_ERROR, "volume vanished".into()))?;
    Ok(Json(report(&s, v)))
}

/// Waits (briefly) until this node's copy of the directory shows a change.
async fn wait_for(h: &Http, f: impl Fn(&ClusterState) -> bool) {
    let mut w = h.router.dir.watch();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            if f(&w.borrow_and_update()) {
                return;
            }
            if w.changed().await.is_err() {
                return;
            }
        }
    })
    .await;
}

async fn resize(
    State(h): State<Http>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Json(req): Json<Resize>,
) -> Result<Json<VolumeReport>, ApiErr> {
    check_volume_size(req.size).map_err(bad)?;
    h.router
        .dir
        .propose(Command::ResizeVolume {
            name: name.clone(),
            size: req.size,
        })
        .await?;
    // Applied here: the size, or an erasure-coded volume's growth to it
    // recorded (its owner commits the size later).
    wait_for(&h, |s| {
        s.volume_by_name(&name)
            .is_some_and(|v| v.size >= req.size || v.grow_to == Some(req.size))
    })
    .await;
    show_report(&h, &name, &headers).await
}

async fn delete(
    State(h): State<Http>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiErr> {
    let force = q.get("force").is_some_and(|v| v == "true" || v == "1");
    let s = h.router.dir.state();
    if s.volume_by_name(&name).is_none() {
        return Err(ApiErr(
            StatusCode::NOT_FOUND,
            format!("no volume named {name:?}"),
        ));
    }
    if !force {
        let mut open = Vec::new();
        for n in s.nodes.values().filter(|n| n.state == NodeState::Up) {
            let token = crate::auth::bearer(&headers).map(String::from);
            let c = shoal_api::Client::with_token(&n.api_addr, token);
            match c.get::<Connections>("/v1/local/connections").await {
                Ok(conns) => {
                    if let Some(k) = conns.volumes.get(&name) {
                        open.push(format!("{k} on node {}", n.id));
                    }
                }
                Err(e) => {
                    return Err(ApiErr(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("cannot check open connections on node {}: {e}; use --force to delete anyway", n.id),
                    ))
                }
            }
        }
        if !open.is_empty() {
            return Err(ApiErr(
                StatusCode::CONFLICT,
                format!(
                    "volume {name:?} has open connections ({}); disconnect the clients or use --force",
                    open.join(", ")
                ),
            ));
        }
    }
    h.router
        .dir
        .propose(Command::DeleteVolume { name: name.clone() })
        .await?;
    Ok(Json(serde_json::json!({ "deleted": name })))
}

/// Reads every data copy on its node and compares CRC-32C digests. Meant
/// for checks after I/O stopped: writes in flight make copies differ.
async fn digests(State(h): State<Http>, Path(name): Path<String>) -> Result<Json<Digests>, ApiErr> {
    let s = h.router.dir.state();
    let v = s
        .volume_by_name(&name)
        .ok_or_else(|| ApiErr(StatusCode::NOT_FOUND, format!("no volume named {name:?}")))?;
    let mut copies = Vec::new();
    for c in v.data_components() {
        let addr = s
            .nodes
            .get(&c.node)
            .map(|n| n.peer_addr.clone())
            .unwrap_or_default();
        let r = async {
            let p = shoal_rpc::Peer::connect(
                &addr,
                std::time::Duration::from_secs(1),
                h.router.peer_auth(),
            )
            .await?;
            p.call(
                &shoal_rpc::Request::Digest { component: c.id },
                bytes::Bytes::new(),
                std::time::Duration::from_secs(120),
            )
            .await
        }
        .await;
        let (crc32c, error) = match r {
            Ok((shoal_rpc::Response::Digest { crc, .. }, _)) => (Some(crc), None),
            Ok((other, _)) => (None, Some(format!("unexpected answer {other:?}"))),
            Err(e) => (None, Some(e.to_string())),
        };
        copies.push(CopyDigest {
            component: c.id,
            node: c.node,
            crc32c,
            error,
        });
    }
    let identical = !copies.is_empty()
        && copies
            .iter()
            .all(|c| c.crc32c.is_some() && c.crc32c == copies[0].crc32c);
    Ok(Json(Digests {
        volume: name,
        copies,
        identical,
    }))
}

async fn heartbeat(
    State(h): State<Http>,
    Extension(caller): Extension<Caller>,
    Json(hb): Json<Heartbeat>,
) -> Result<Json<serde_json::Value>, ApiErr> {
    if caller != Caller::Node(hb.node) {
        return Err(ApiErr(
            StatusCode::FORBIDDEN,
            format!("{caller:?} may not send node {}'s heartbeat", hb.node),
        ));
    }
    h.liveness.heard(hb).await;
    Ok(Json(serde_json::json!({})))
}

async fn connections(State(h): State<Http>) -> Json<Connections> {
    Json(Connections {
        volumes: h
            .router
            .connections
            .lock()
            .map(|m| m.clone())
            .unwrap_or_default(),
    })
}

async fn owners(State(h): State<Http>) -> Json<Owners> {
    Json(owners_report(&h))
}

fn owners_report(h: &Http) -> Owners {
    let s = h.router.dir.state();
    let name = |v: &shoal_model::VolumeId| s.volumes.get(v).map(|v| v.name.clone());
    Owners {
        volumes: h
            .router
            .owned()
            .into_iter()
            .filter_map(|v| s.volumes.get(&v).map(|v| (v.name.clone(), v.generation)))
            .collect(),
        throttles: h
            .router
            .throttles()
            .into_iter()
            .filter_map(|(v, t)| {
                Some(ThrottleReport {
                    volume: s.volumes.get(&v)?.name.clone(),
                    node: h.router.node,
                    iops_limit: t.iops_limit,
                    throttled_ios: t.throttled_ios,
                    throttled_us: t.throttled_us,
                })
            })
            .collect(),
        healing: h
            .router
            .healing()
            .into_iter()
            .filter_map(|(v, st)| Some(healing_report(name(&v)?, h.router.node, &st)))
            .collect(),
        written: h
            .router
            .tiers()
            .into_iter()
            .filter_map(|(v, t)| Some((name(&v)?, t.written_bytes)))
            .collect(),
    }
}

fn scrubber(h: &Http) -> Result<&Arc<crate::scrub::Scrubber>, ApiErr> {
    h.scrubber.get().ok_or_else(|| {
        ApiErr(
            StatusCode::SERVICE_UNAVAILABLE,
            "node still starting".into(),
        )
    })
}

/// Counters of this node's scrubber.
async fn scrub_status(State(h): State<Http>) -> Result<Json<shoal_api::ScrubReport>, ApiErr> {
    let st = &scrubber(&h)?.stats;
    Ok(Json(shoal_api::ScrubReport {
        node: h.router.node,
        running: st.running.load(Relaxed) == 1,
        passes: st.passes.load(Relaxed),
        bytes: st.bytes.load(Relaxed),
        bad_blocks: st.bad.load(Relaxed),
        repaired: st.repaired.load(Relaxed),
        unrepaired: st.unrepaired.load(Relaxed),
    }))
}

/// Starts a scrub pass on this node now.
async fn scrub_start(State(h): State<Http>) -> Result<StatusCode, ApiErr> {
    scrubber(&h)?.start_pass();
    Ok(StatusCode::ACCEPTED)
}

/// Node-wide counters (name, help), in the order `metrics` reads them.
const NODE_COUNTERS: [(&str, &str); 14] = [
    (
        "shoal_nbd_reads_total",
        "NBD read requests served by this node",
    ),
    (
        "shoal_nbd_writes_total",
        "NBD write requests served by this node",
    ),
    (
        "shoal_nbd_read_bytes_total",
        "Bytes read by NBD clients of this node",
    ),
    (
        "shoal_nbd_write_bytes_total",
        "Bytes written by NBD clients of this node",
    ),
    (
        "shoal_nbd_read_microseconds_total",
        "Time NBD reads of this node took, from request to answer, summed",
    ),
    (
        "shoal_nbd_write_microseconds_total",
        "Time NBD writes of this node took, from request to durable, summed",
    ),
    (
        "shoal_forwarded_total",
        "Requests forwarded to another node's owner",
    ),
    ("shoal_io_errors_total", "Client requests that failed"),
    (
        "shoal_owner_claims_total",
        "Volume ownership claims made by this node",
    ),
    ("shoal_scrub_passes_total", "Scrub passes finished"),
    (
        "shoal_scrub_bytes_total",
        "Bytes of written data the scrubber checked",
    ),
    (
        "shoal_scrub_bad_blocks_total",
        "Blocks the scrubber found failing their checksum",
    ),
    (
        "shoal_scrub_repaired_total",
        "Bad blocks found by the scrubber and repaired by the owner",
    ),
    (
        "shoal_scrub_unrepaired_total",
        "Bad blocks found by the scrubber and left bad",
    ),
];

/// Appends one Prometheus metric family: `(labels, value)` samples.
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, u64)]) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    for (labels, v) in samples {
        out.push_str(&format!("{name}{{{labels}}} {v}\n"));
    }
}

async fn metrics(State(h): State<Http>) -> String {
    let c = &h.router.counters;
    let node = format!("node=\"{}\"", h.router.node);
    let mut out = String::new();
    let zero = crate::scrub::ScrubStats::default();
    let st = h.scrubber.get().map(|s| &s.stats).unwrap_or(&zero);
    let values = [
        &c.reads,
        &c.writes,
        &c.read_bytes,
        &c.write_bytes,
        &c.read_micros,
        &c.write_micros,
        &c.forwarded,
        &c.errors,
        &c.claims,
        &st.passes,
        &st.bytes,
        &st.bad,
        &st.repaired,
        &st.unrepaired,
    ]
    .map(|a| a.load(Relaxed));
    for ((name, help), v) in NODE_COUNTERS.iter().zip(values) {
        family(&mut out, name, "counter", help, &[(node.clone(), v)]);
    }
    let rates: Vec<(String, u64)> = h
        .liveness
        .clocks
        .rates()
        .into_iter()
        .map(|(n, ppm)| (format!("{node},peer=\"{n}\""), ppm.unsigned_abs()))
        .collect();
    family(
        &mut out,
        "shoal_clock_rate_error_ppm",
        "gauge",
        "How far a node's clock rate differs from this leader's, in parts per million \
         (the read lease assumes at most 10000)",
        &rates,
    );
    let devices: Vec<_> = h
        .replicas
        .get()
        .into_iter()
        .flat_map(|r| r.devices())
        .collect();
    let per_device = |f: &dyn Fn(&crate::replica::Device) -> u64| -> Vec<(String, u64)> {
        devices
            .iter()
            .map(|d| (format!("{node},device=\"{}\"", d.id), f(d)))
            .collect()
    };
    type DeviceMetric<'a> = (
        &'a str,
        &'a str,
        &'a str,
        &'a dyn Fn(&crate::replica::Device) -> u64,
    );
    let device_metrics: [DeviceMetric; 17] = [
        (
            "shoal_device_used_bytes",
            "gauge",
            "Bytes of component data on the device",
            &|d| d.store.used(),
        ),
        (
            "shoal_device_syncs_total",
            "counter",
            "Group commits (device flushes) issued",
            &|d| d.flusher.syncs(),
        ),
        (
            "shoal_device_sync_microseconds_total",
            "counter",
            "Time spent in group commits (writing the open batch and flushing the device)",
            &|d| d.flusher.sync_micros(),
        ),
        (
            "shoal_device_commits_total",
            "counter",
            "Writes from owners made durable on the device",
            &|d| d.commits.load(Relaxed),
        ),
        (
            "shoal_device_commit_microseconds_total",
            "counter",
            "Time from a write's arrival at the replica to its durability, summed",
            &|d| d.commit_micros.load(Relaxed),
        ),
        (
            "shoal_device_write_bytes_total",
            "counter",
            "Bytes written to the device by owners (client writes and resync copies)",
            &|d| d.written.load(Relaxed),
        ),
        (
            "shoal_device_resync_bytes_total",
            "counter",
            "Bytes written to the device by owners' copies (resync, rebuild, reconciliation after a crash)",
            &|d| d.resync_written.load(Relaxed),
        ),
        (
            "shoal_device_read_blocks_total",
            "counter",
            "Blocks client reads took from the device (not from memory)",
            &|d| d.store.read_counters().0,
        ),
        (
            "shoal_device_header_misses_total",
            "counter",
            "Batch headers client reads had to read from the device too (not cached)",
            &|d| d.store.read_counters().1,
        ),
        (
            "shoal_device_checksum_errors_total",
            "counter",
            "Blocks read from the device that failed their checksum",
            &|d| d.checksum_errors.load(Relaxed),
        ),
        (
            "shoal_device_repaired_blocks_total",
            "counter",
            "Bad blocks replaced with a good copy from another replica",
            &|d| d.repaired.load(Relaxed),
        ),
        (
            "shoal_device_cleaner_blocks_total",
            "counter",
            "Live blocks the log cleaner moved to free segments (since the device was opened)",
            &|d| d.store.stats().cleaner_blocks,
        ),
        (
            "shoal_device_cleaned_segments_total",
            "counter",
            "Log segments the cleaner emptied (since the device was opened)",
            &|d| d.store.stats().cleaned_segments,
        ),
        (
            "shoal_device_cleaner_waits_total",
            "counter",
            "Client writes that waited for a step of the log cleaner (since the device was opened)",
            &|d| d.store.stats().cleaner_waits,
        ),
        (
            "shoal_device_checkpoints_total",
            "counter",
            "Index checkpoints written (since the device was opened)",
            &|d| d.store.stats().checkpoints,
        ),
        (
            "shoal_device_relocate_microseconds_total",
            "counter",
            "Time the log cleaner spent moving victims' live blocks while client writes waited",
            &|d| d.store.stats().relocate_micros,
        ),
        (
            "shoal_device_checkpoint_microseconds_total",
            "counter",
            "Time spent writing index checkpoints while client writes waited",
            &|d| d.store.stats().checkpoint_micros,
        ),
    ];
    for (name, kind, help, f) in device_metrics {
        family(&mut out, name, kind, help, &per_device(f));
    }
    let resync_bytes = devices.iter().map(|d| d.resync_written.load(Relaxed)).sum();
    family(
        &mut out,
        "shoal_resync_bytes_total",
        "counter",
        "Bytes written into copies on this node by owners' resyncs and rebuilds \
         (and reconciliations after a crash)",
        &[(node.clone(), resync_bytes)],
    );
    let unsettled = h.replicas.get().map_or(0, |r| r.unsettled_regions());
    family(
        &mut out,
        "shoal_unsettled_regions",
        "gauge",
        "Regions of this node's copies written and not yet covered by an owner's barrier",
        &[(node.clone(), unsettled)],
    );
    component_metrics(&h, &node, &mut out);
    volume_metrics(&h, &node, &mut out);
    out
}

/// Every state a component can be in, for `shoal_components` (a state
/// with none is 0, not missing).
const COMPONENT_STATES: [ComponentState; 5] = [
    ComponentState::Active,
    ComponentState::Absent,
    ComponentState::Degraded,
    ComponentState::Resyncing,
    ComponentState::Reconfiguring,
];

/// Components placed on this node, by state, as the directory has them:
/// each node counts its own, and the directory's leader also those of the
/// nodes that are not up (labelled with that node), so a sum over the
/// nodes that answer counts each component once.
fn component_metrics(h: &Http, node: &str, out: &mut String) {
    let s = h.router.dir.state();
    let me = h.router.node;
    let mut samples: Vec<(String, u64)> = components_by_state(&s, me)
        .into_iter()
        .map(|(state, n)| (format!("{node},state=\"{state}\""), n))
        .collect();
    if h.router.dir.leader() == Some(me) {
        let down = s
            .nodes
            .values()
            .filter(|n| n.state != NodeState::Up && n.id != me);
        for n in down {
            samples.extend(
                components_by_state(&s, n.id)
                    .into_iter()
                    .map(|(state, k)| (format!("node=\"{}\",state=\"{state}\"", n.id), k)),
            );
        }
    }
    family(
        out,
        "shoal_components",
        "gauge",
        "Components placed on this node, by state (from the directory)",
        &samples,
    );
}

/// How many components of `node` are in each state (every state listed).
fn components_by_state(s: &ClusterState, node: NodeId) -> BTreeMap<String, u64> {
    let mut counts: BTreeMap<String, u64> = COMPONENT_STATES
        .iter()
        .map(|st| (st.to_string(), 0))
        .collect();
    let mine = s
        .volumes
        .values()
        .flat_map(|v| &v.components)
        .filter(|c| c.node == node);
    for c in mine {
        *counts.entry(c.state.to_string()).or_default() += 1;
    }
    counts
}

/// What the IOPS limits of the volumes owned here held back, and what
/// their copies being brought up to date have left to copy.
fn volume_metrics(h: &Http, node: &str, out: &mut String) {
    let Owners {
        throttles, healing, ..
    } = owners_report(h);
    let left: Vec<(String, u64)> = healing
        .iter()
        .map(|x| {
            let left = x.resync.as_ref().map_or(0, ResyncReport::bytes_left);
            (format!("{node},volume=\"{}\"", x.volume), left)
        })
        .collect();
    family(
        out,
        "shoal_volume_resync_bytes_left",
        "gauge",
        "Bytes a volume owned here still has to copy into the copy it brings up to date \
         (0: none being copied)",
        &left,
    );
    tier_metrics(h, node, out);
    let per_volume = |f: &dyn Fn(&ThrottleReport) -> u64| -> Vec<(String, u64)> {
        throttles
            .iter()
            .map(|t| (format!("{node},volume=\"{}\"", t.volume), f(t)))
            .collect()
    };
    family(
        out,
        "shoal_volume_iops_limit",
        "gauge",
        "IOPS limit of a volume owned here, in 32 KiB units per second (0: none)",
        &per_volume(&|t| u64::from(t.iops_limit)),
    );
    family(
        out,
        "shoal_volume_throttled_ios_total",
        "counter",
        "I/Os of a volume owned here that waited for the IOPS limit (since it became owner)",
        &per_volume(&|t| t.throttled_ios),
    );
    family(
        out,
        "shoal_volume_throttled_microseconds_total",
        "counter",
        "Time I/Os of a volume owned here waited for the IOPS limit, summed (since it became owner)",
        &per_volume(&|t| t.throttled_us),
    );
}

/// The capacity legs of the erasure-coded volumes owned here.
fn tier_metrics(h: &Http, node: &str, out: &mut String) {
    let s = h.router.dir.state();
    let tiers: Vec<(String, shoal_owner::status::TierStatus)> = h
        .router
        .tiers()
        .into_iter()
        .filter_map(|(v, t)| Some((format!("{node},volume=\"{}\"", s.volumes.get(&v)?.name), t)))
        .collect();
    let each = |f: &dyn Fn(&shoal_owner::status::TierStatus) -> u64| -> Vec<(String, u64)> {
        tiers.iter().map(|(l, t)| (l.clone(), f(t))).collect()
    };
    family(
        out,
        "shoal_volume_staged_blocks",
        "gauge",
        "4 KiB blocks of an erasure-coded volume owned here held on its performance leg, \
         not destaged to stripes yet",
        &each(&|t| t.staged_blocks),
    );
    family(
        out,
        "shoal_volume_stripe_columns_out",
        "gauge",
        "Stripe columns of an erasure-coded volume owned here out of service (destage waits)",
        &each(&|t| t.columns_out),
    );
    family(
        out,
        "shoal_volume_stripes_written_total",
        "counter",
        "Full stripes an erasure-coded volume's owner here wrote (since it became owner)",
        &each(&|t| t.stripes_written),
    );
    family(
        out,
        "shoal_volume_direct_stripes_total",
        "counter",
        "Of those, stripes of client writes that went straight to the capacity leg (since it became owner)",
        &each(&|t| t.direct_stripes),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_model::{Component, ComponentRole, NodeInfo};

    fn component(id: u64, node: NodeId, state: ComponentState) -> Component {
        Component {
            id,
            role: ComponentRole::Data,
            node,
            device: node,
            state,
            votes: 1,
        }
    }

    /// Volume "v" over nodes 1 to 3, node 3's copy absent, owned by 1.
    fn state() -> ClusterState {
        let mut s = ClusterState::default();
        for id in 1..=3 {
            let n = NodeInfo {
                id,
                fault_domain: format!("node-{id}"),
                peer_addr: format!("10.0.0.{id}:9500"),
                api_addr: format!("10.0.0.{id}:9400"),
                nbd_addr: format!("10.0.0.{id}:10809"),
                state: NodeState::Up,
            };
            s.nodes.insert(id, n);
        }
        let v = Volume {
            id: 10,
            name: "v".into(),
            size: 1 << 30,
            policy: Policy::default(),
            components: vec![
                component(11, 1, ComponentState::Active),
                component(12, 2, ComponentState::Active),
                component(13, 3, ComponentState::Absent),
            ],
            owner: Some(1),
            generation: 4,
            problem: None,
            wrapped_key: None,
            reconfig: None,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: None,
        };
        s.volumes.insert(v.id, v);
        s
    }

    fn copying(added: bool) -> HealingStatus {
        HealingStatus {
            resync: Some(ResyncStatus {
                component: 14,
                added,
                bytes_total: 100 << 20,
                bytes_done: 30 << 20,
                elapsed: Duration::from_secs(3),
            }),
            change: added.then(|| "rebuild of component 13".to_string()),
            waiting: vec![(13, Duration::from_millis(4_200))],
            cannot_rebuild: None,
            reconciling: false,
        }
    }

    #[test]
    fn the_owners_status_reads_as_the_api_documents_it() {
        let r = healing_report("v".into(), 1, &copying(true));
        assert_eq!(r.waiting[0].left_s, 5, "rounded up");
        let json = serde_json::to_value(&r.resync).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "component": 14,
                "kind": "rebuild",
                "bytes_to_copy": 100u64 << 20,
                "bytes_copied": 30u64 << 20,
                "rate_bytes_per_s": 10u64 << 20,
                "eta_s": 7,
            })
        );
        let r = healing_report("v".into(), 1, &copying(false));
        assert_eq!(r.resync.map(|x| x.kind), Some(ResyncKind::Resync));
        assert_eq!(r.change, None);
    }

    #[test]
    fn a_report_takes_what_its_owner_says_or_says_the_owner_is_missing() {
        let s = state();
        let v = &s.volumes[&10];
        let owners = Owners {
            healing: vec![healing_report("v".into(), 1, &copying(true))],
            ..Owners::default()
        };
        let r = with_owner(report(&s, v), Some(&owners));
        assert_eq!(
            r.healing,
            "reduced availability: rebuilding (rebuild of component 13)"
        );
        assert_eq!(r.resync.as_ref().map(|x| x.component), Some(14));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["resync"]["bytes_copied"], 30u64 << 20);
        assert_eq!(json["health"], "ReducedAvailability", "unchanged");
        assert_eq!(json["volume"]["components"][2]["state"], "Absent");

        let r = with_owner(report(&s, v), None);
        assert_eq!(r.healing, "reduced availability: owner not reachable");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json["resync"].is_null(), "{json}");
    }

    #[test]
    fn components_are_counted_by_state_on_their_own_node() {
        let s = state();
        let on3 = components_by_state(&s, 3);
        assert_eq!(on3["absent"], 1);
        assert_eq!(on3["active"], 0);
        assert_eq!(on3.len(), COMPONENT_STATES.len(), "every state listed");
        assert_eq!(components_by_state(&s, 1)["active"], 1);
        assert_eq!(components_by_state(&s, 4).values().sum::<u64>(), 0);
    }
}
