//! # shoal-api: the REST API's messages and its client
//!
//! The JSON types every node's HTTP API speaks (`/v1/...`) and a small
//! client for them, used by the `shoal` CLI and by nodes talking to each
//! other's management endpoints. Owns the REST contract; must never hold
//! cluster state or serve requests itself (the node serves them).

use serde::{Deserialize, Serialize};
use shoal_model::{
    ClusterSettings, DeviceId, DeviceInfo, DeviceState, Generation, NodeId, NodeInfo, NodeState,
    Role, Volume, VolumeHealth,
};
use std::time::Duration;

pub mod devices;
pub use devices::{AddDevice, DeviceAdded, DeviceRemoval};
pub mod healing;
pub use healing::{
    healing_text, HealingReport, ResyncKind, ResyncReport, WaitingComponent, OWNER_NOT_REACHABLE,
};
pub mod maintenance;
pub use maintenance::{EnterMaintenance, MaintenanceEntered, MaintenanceReport, NodeRemoved};

/// Body of `POST /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreateVolume {
    pub name: String,
    pub size: u64,
    pub policy: String,
}

/// Body of `POST /v1/volumes/{name}/resize`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resize {
    pub size: u64,
}

/// Body of `POST /v1/volumes/{name}/settings`: what to change of a
/// volume's settings that take effect without moving data (absent: keep).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct VolumeSettings {
    /// IOPS limit in 32 KiB units, reads and writes together; 0: none.
    pub iops_limit: Option<u32>,
}

/// Body of `POST /v1/volumes/{name}/policy` (admin): the volume's new
/// policy, whole, in the text `volume create` takes (`"raid1 ftt=2"`;
/// `ftt=` must be given). Answered with the volume's report: the change
/// in progress (`volume.reconfig`), or nothing when the volume has the
/// policy already; refused with 400 (not a policy), 404 (no such
/// volume) or 409 (not possible now: too few fault domains or too little
/// space, a change in progress) and why.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetPolicy {
    pub policy: String,
}

/// Body of `POST /v1/cluster/settings`: the cluster-wide settings to
/// change (absent: keep); answered with all of them, as `GET` answers
/// ([`ClusterSettings`]). A name it does not know is refused.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettingsUpdate {
    /// Seconds an absent component is waited for before its data is
    /// rebuilt elsewhere ([`ClusterSettings::repair_delay_s`]).
    #[serde(default)]
    pub repair_delay_s: Option<u64>,
    /// Static limit of each owner's resync and rebuild copies, MiB/s; 0:
    /// none ([`ClusterSettings::resync_mib_per_s`]).
    #[serde(default)]
    pub resync_mib_per_s: Option<u64>,
}

/// One volume as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VolumeReport {
    pub volume: Volume,
    pub health: VolumeHealth,
    /// `nbd://host:port/name` for every up node.
    pub uris: Vec<String>,
    /// What the IOPS limit held back, as the owner counts it (since it
    /// became owner); None without an owner that answered.
    #[serde(default)]
    pub throttle: Option<ThrottleReport>,
    /// The copy being brought up to date now, as the owner reports it;
    /// None when there is none or the owner did not answer.
    #[serde(default)]
    pub resync: Option<ResyncReport>,
    /// One line for people on how the volume heals ([`healing_text`]):
    /// "healthy", "reduced availability: rebuilding (REASON)", ...,
    /// "inaccessible".
    #[serde(default)]
    pub healing: String,
    /// What the volume takes on the devices; None where it was not
    /// measured.
    #[serde(default)]
    pub capacity: Option<CapacityReport>,
}

/// What a volume (or the cluster's volumes together) takes: its size,
/// the bytes of it written, and the bytes every component takes on the
/// devices (copies, witnesses, performance leg and stripe columns alike).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapacityReport {
    pub size_bytes: u64,
    /// Bytes of the volume's address space that hold data; None when it
    /// could not be told (the owner of an erasure-coded volume did not
    /// answer, no copy's node did).
    pub written_bytes: Option<u64>,
    /// Bytes its components' written blocks take on the devices; None
    /// when a component's node did not answer.
    pub used_bytes: Option<u64>,
}

impl CapacityReport {
    /// Bytes on the devices per byte written: the policy's overhead (2
    /// for raid1 ftt=1, 1.5 for 2+1 stripes, more while writes wait on an
    /// erasure-coded volume's performance leg).
    pub fn overhead(&self) -> Option<f64> {
        match (self.written_bytes, self.used_bytes) {
            (Some(w), Some(u)) if w > 0 => Some(u as f64 / w as f64),
            _ => None,
        }
    }

    /// The sum of two reports (unknown if either part is).
    pub fn plus(self, o: CapacityReport) -> CapacityReport {
        let add = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_add(b?));
        CapacityReport {
            size_bytes: self.size_bytes.saturating_add(o.size_bytes),
            written_bytes: add(self.written_bytes, o.written_bytes),
            used_bytes: add(self.used_bytes, o.used_bytes),
        }
    }
}

/// The IOPS limit of a volume as its owner applies it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThrottleReport {
    pub volume: String,
    /// The owner that counted.
    pub node: NodeId,
    /// The limit in force, in 32 KiB units per second; 0: none.
    pub iops_limit: u32,
    /// I/Os that waited for their turn.
    pub throttled_ios: u64,
    /// Their waits, summed, in microseconds.
    pub throttled_us: u64,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusReport {
    pub cluster_id: String,
    pub leader: Option<NodeId>,
    pub voters: Vec<NodeId>,
    pub nodes: Vec<NodeInfo>,
    pub devices: Vec<DeviceReport>,
    pub volumes: Vec<VolumeReport>,
    /// The volumes' capacity added up.
    #[serde(default)]
    pub capacity: Option<CapacityReport>,
}

/// A device as `GET /v1/status` reports it: what the directory keeps (its
/// state as its node last reported it) and the state of its node, so that
/// a down node's devices do not look healthy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceReport {
    #[serde(flatten)]
    pub device: DeviceInfo,
    pub node_state: NodeState,
}

impl std::ops::Deref for DeviceReport {
    type Target = DeviceInfo;
    fn deref(&self) -> &DeviceInfo {
        &self.device
    }
}

impl DeviceReport {
    /// The device's state as a person should read it: its node's when
    /// the node is down (nothing is known of the device then).
    pub fn shown_state(&self) -> String {
        match self.node_state {
            NodeState::Up if self.device.retiring => {
                format!("{:?}, being removed", self.device.state).to_lowercase()
            }
            NodeState::Up => format!("{:?}", self.device.state).to_lowercase(),
            other => format!("node {other}"),
        }
    }
}

/// `POST /v1/heartbeat`, sent by every node to the directory leader.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Heartbeat {
    pub node: NodeId,
    pub devices: Vec<DeviceUsage>,
    /// The sender's monotonic clock in milliseconds (from an origin of its
    /// own): the leader checks clock rates with it (`shoal_node::clock`).
    #[serde(default)]
    pub mono_ms: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceUsage {
    pub device: DeviceId,
    pub used: u64,
    pub state: DeviceState,
}

/// `GET /v1/local/connections`: NBD connections open on this node, per volume name.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Connections {
    pub volumes: std::collections::BTreeMap<String, u64>,
}

/// `GET /v1/local/owners`: volumes this node owns now, with their generation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Owners {
    pub volumes: Vec<(String, Generation)>,
    /// The IOPS limit of each owned volume and what it held back.
    #[serde(default)]
    pub throttles: Vec<ThrottleReport>,
    /// How each owned volume heals.
    #[serde(default)]
    pub healing: Vec<HealingReport>,
    /// Bytes written of each owned erasure-coded volume (its map and its
    /// performance leg together: only its owner can tell).
    #[serde(default)]
    pub written: Vec<(String, u64)>,
}

/// `GET /v1/scrub`: the counters of one node's scrubber (`POST` starts a
/// pass now).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScrubReport {
    pub node: NodeId,
    /// A pass is running now.
    pub running: bool,
    /// Passes finished since the node started.
    pub passes: u64,
    /// Bytes of written data checked.
    pub bytes: u64,
    /// Blocks found failing their checksum.
    pub bad_blocks: u64,
    /// Of those, repaired from a healthy copy by the volume's owner.
    pub repaired: u64,
    /// Of those, left bad (no healthy copy reachable).
    pub unrepaired: u64,
}

/// `GET /v1/volumes/{name}/digests`: CRC-32C of every data copy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Digests {
    pub volume: String,
    pub copies: Vec<CopyDigest>,
    /// True when every copy answered with the same digest.
    pub identical: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CopyDigest {
    pub component: u64,
    pub node: NodeId,
    /// `Some(crc)` or the error that prevented reading the copy.
    pub crc32c: Option<u32>,
    pub error: Option<String>,
}

/// Body of `POST /v1/tokens`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreateToken {
    pub role: Role,
    #[serde(default)]
    pub note: String,
    /// Seconds until it expires (join tokens: default
    /// [`JOIN_TOKEN_DEFAULT_TTL_S`]; API tokens last until revoked).
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

/// How long a join token opens a join unless told otherwise, in seconds:
/// a day, time enough to install a host; a token that leaks later opens
/// nothing.
pub const JOIN_TOKEN_DEFAULT_TTL_S: u64 = 24 * 3600;

/// Body of `POST /v1/join` (over TLS, from a node that has no certificate
/// yet): the join token, who the node is, and a request for a
/// certificate over a key it keeps.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JoinCertRequest {
    pub token: String,
    pub node: NodeId,
    /// The IP addresses the node serves on (named in its certificate).
    pub addrs: Vec<std::net::IpAddr>,
    pub csr_pem: String,
}

/// Body of `POST /v1/certs/client` (admin): a certificate for an NBD
/// client named `name`, over the key of `csr_pem` (the key stays with
/// the client).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientCertRequest {
    pub name: String,
    pub csr_pem: String,
}

/// Answer to `POST /v1/join`: the node's certificate and the cluster CA.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinCertAnswer {
    pub cert_pem: String,
    pub ca_pem: String,
}

/// Answer to `POST /v1/tokens`: the token's text, shown this once.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NewToken {
    pub id: String,
    pub role: Role,
    pub token: String,
}

/// One token in `GET /v1/tokens` (never its secret).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenInfo {
    pub id: String,
    pub role: Role,
    pub note: String,
}

/// `GET /livez`: the one call that needs no token (liveness probes, a
/// joining node learning the cluster's id).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Livez {
    pub node: NodeId,
    pub cluster_id: String,
}

/// Error body of any non-2xx answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The server refused the request; the message says why.
    #[error("{0}")]
    Refused(String),
    /// The server cannot answer yet (503: no directory leader, a cluster
    /// being founded); the same request may succeed later.
    #[error("{0}")]
    Unavailable(String),
    /// What the request names does not exist (404).
    #[error("{0}")]
    NotFound(String),
    #[error("cannot reach the Shoal API at {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("unexpected answer from {url}: {reason}")]
    Protocol { url: String, reason: String },
}

/// A client of one node's API.
#[derive(Clone)]
pub struct Client {
    base: String,
    http: reqwest::Client,
    /// Sent as `Authorization: Bearer ...` with every request.
    token: Option<String>,
}

impl Client {
    /// A client that presents `token` (the text of an API token).
    pub fn with_token(base: &str, token: Option<String>) -> Client {
        Client {
            token,
            ..Client::new(base)
        }
    }

    /// The token this client presents.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    fn authorized(&self, r: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => r.bearer_auth(t),
            None => r,
        }
    }

    /// `base` is `http://ip:port` or `ip:port`.
    pub fn new(base: &str) -> Client {
        let base = if base.starts_with("http") {
            base.trim_end_matches('/').to_string()
        } else {
            format!("http://{base}")
        };
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(1000))
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_default();
        Client {
            base,
            http,
            token: None,
        }
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    async fn answer<T: for<'de> Deserialize<'de>>(
        &self,
        url: &str,
        r: Result<reqwest::Response, reqwest::Error>,
    ) -> Result<T, ApiError> {
        let r = r.map_err(|e| ApiError::Unreachable {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        let status = r.status();
        let text = r.text().await.map_err(|e| ApiError::Unreachable {
            url: url.to_string(),
            reason: e.to_string(),
        })?;
        if !status.is_success() {
            let msg = serde_json::from_str::<ErrorBody>(&text)
                .map(|e| e.error)
                .unwrap_or(text);
            if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
                return Err(ApiError::Unavailable(msg));
            }
            if status == reqwest::StatusCode::NOT_FOUND {
                return Err(ApiError::NotFound(msg));
            }
            return Err(ApiError::Refused(msg));
        }
        serde_json::from_str(&text).map_err(|e| ApiError::Protocol {
            url: url.to_string(),
            reason: e.to_string(),
        })
    }

    pub async fn get<T: for<'de> Deserialize<'de>>(&self, path: &str) -> Result<T, ApiError> {
        let url = format!("{}{}", self.base, path);
        let r = self.authorized(self.http.get(&url)).send().await;
        self.answer(&url, r).await
    }

    pub async fn post<B: Serialize, T: for<'de> Deserialize<'de>>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ApiError> {
        let url = format!("{}{}", self.base, path);
        let r = self
            .authorized(self.http.post(&url).json(body))
            .send()
            .await;
        self.answer(&url, r).await
    }

    pub async fn delete<T: for<'de> Deserialize<'de>>(&self, path: &str) -> Result<T, ApiError> {
        let url = format!("{}{}", self.base, path);
        let r = self.authorized(self.http.delete(&url)).send().await;
        self.answer(&url, r).await
    }

    pub async fn status(&self) -> Result<StatusReport, ApiError> {
        self.get("/v1/status").await
    }

    pub async fn volumes(&self) -> Result<Vec<VolumeReport>, ApiError> {
        self.get("/v1/volumes").await
    }

    pub async fn volume(&self, name: &str) -> Result<VolumeReport, ApiError> {
        self.get(&format!("/v1/volumes/{name}")).await
    }

    pub async fn create_volume(&self, req: &CreateVolume) -> Result<VolumeReport, ApiError> {
        self.post("/v1/volumes", req).await
    }

    pub async fn resize_volume(&self, name: &str, size: u64) -> Result<VolumeReport, ApiError> {
        self.post(&format!("/v1/volumes/{name}/resize"), &Resize { size })
            .await
    }

    /// Changes a volume's settings (`shoal volume set`).
    pub async fn set_volume(
        &self,
        name: &str,
        settings: &VolumeSettings,
    ) -> Result<VolumeReport, ApiError> {
        self.post(&format!("/v1/volumes/{name}/settings"), settings)
            .await
    }

    /// Changes a volume's policy in place (`shoal volume set-policy`):
    /// answers the volume with the change begun ([`SetPolicy`]).
    pub async fn set_policy(&self, name: &str, policy: &str) -> Result<VolumeReport, ApiError> {
        let body = SetPolicy {
            policy: policy.to_string(),
        };
        self.post(&format!("/v1/volumes/{name}/policy"), &body)
            .await
    }

    /// The cluster-wide settings (`shoal cluster settings`).
    pub async fn cluster_settings(&self) -> Result<ClusterSettings, ApiError> {
        self.get("/v1/cluster/settings").await
    }

    /// Changes cluster-wide settings (admin; `shoal cluster set`);
    /// answers all of them as they are then.
    pub async fn set_cluster_settings(
        &self,
        update: &ClusterSettingsUpdate,
    ) -> Result<ClusterSettings, ApiError> {
        self.post("/v1/cluster/settings", update).await
    }

    /// Makes an API token (admin).
    pub async fn create_token(&self, req: &CreateToken) -> Result<NewToken, ApiError> {
        self.post("/v1/tokens", req).await
    }

    pub async fn tokens(&self) -> Result<Vec<TokenInfo>, ApiError> {
        self.get("/v1/tokens").await
    }

    pub async fn revoke_token(&self, id: &str) -> Result<serde_json::Value, ApiError> {
        self.delete(&format!("/v1/tokens/{id}")).await
    }

    /// Revokes every certificate of node `id`: members refuse it from then
    /// on and close the connections it holds.
    pub async fn revoke_node(&self, id: NodeId) -> Result<serde_json::Value, ApiError> {
        self.post(&format!("/v1/nodes/{id}/revoke"), &serde_json::json!({}))
            .await
    }

    /// Revokes every certificate issued to the NBD client `name`.
    pub async fn revoke_client(&self, name: &str) -> Result<serde_json::Value, ApiError> {
        self.post(
            &format!("/v1/certs/client/{name}/revoke"),
            &serde_json::json!({}),
        )
        .await
    }

    /// A certificate for an NBD client (answered with the cluster CA).
    pub async fn client_cert(&self, req: &ClientCertRequest) -> Result<JoinCertAnswer, ApiError> {
        self.post("/v1/certs/client", req).await
    }

    /// Liveness and the cluster's id, without a token.
    pub async fn livez(&self) -> Result<Livez, ApiError> {
        self.get("/livez").await
    }

    /// The volumes this node owns, with their throttles.
    pub async fn owners(&self) -> Result<Owners, ApiError> {
        self.get("/v1/local/owners").await
    }

    pub async fn digests(&self, name: &str) -> Result<Digests, ApiError> {
        self.get(&format!("/v1/volumes/{name}/digests")).await
    }

    pub async fn delete_volume(
        &self,
        name: &str,
        force: bool,
    ) -> Result<serde_json::Value, ApiError> {
        self.delete(&format!("/v1/volumes/{name}?force={force}"))
            .await
    }
}
