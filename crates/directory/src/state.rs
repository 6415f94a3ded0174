//! The replicated state machine: pure, deterministic, no I/O.
//!
//! [`ClusterState::apply`] is validate-then-mutate: a command that is
//! rejected leaves the state exactly as it was, so every replica that applies
//! the same log reaches the same state and the same answers.

use serde::{Deserialize, Serialize};
use shoal_model::{
    check_volume_name, check_volume_size, ApiToken, CaRecord, ClusterSettings, Component,
    ComponentId, ComponentRole, ComponentState, DeviceId, DeviceInfo, DeviceState, Generation,
    MaintenanceMode, NodeId, NodeInfo, NodeState, Policy, StripeGeometry, Volume, VolumeId,
    MAX_REPAIR_DELAY_S, MAX_RESYNC_MIB_PER_S, MIN_REPAIR_DELAY_S,
};
use std::collections::{BTreeMap, BTreeSet};

/// Everything the directory knows about the cluster.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ClusterState {
    /// Set once by the first `SetClusterId`; empty until then.
    pub cluster_id: String,
    pub nodes: BTreeMap<NodeId, NodeInfo>,
    pub devices: BTreeMap<DeviceId, DeviceInfo>,
    pub volumes: BTreeMap<VolumeId, Volume>,
    /// Allocator for volume, component and device ids. The next id handed
    /// out is `max(next_id, 1)`; ids are never reused.
    pub next_id: u64,
    /// API tokens by id (their secrets' hashes only).
    #[serde(default)]
    pub tokens: BTreeMap<String, ApiToken>,
    /// The cluster's certificate authority (set once, by the founding
    /// node): any member can sign a joining node's certificate.
    #[serde(default)]
    pub ca: Option<CaRecord>,
    /// SHA-256 of every certificate issued to a node, by node.
    #[serde(default)]
    pub node_certs: BTreeMap<NodeId, BTreeSet<String>>,
    /// Certificates members refuse (SHA-256): those of revoked nodes and
    /// NBD clients.
    #[serde(default)]
    pub revoked_certs: BTreeSet<String>,
    /// SHA-256 of every certificate issued to an NBD client, by name.
    #[serde(default)]
    pub client_certs: BTreeMap<String, BTreeSet<String>>,
    /// Cluster-wide settings (`shoal cluster set`); a state from before
    /// they existed reads with the defaults.
    #[serde(default)]
    pub settings: ClusterSettings,
    /// Nodes in maintenance and their mode (`maintenance.rs`); their
    /// devices are marked `maintenance` as long as they are here.
    #[serde(default)]
    pub maintenance: BTreeMap<NodeId, MaintenanceMode>,
    /// Each node's process incarnation (a random number drawn at every
    /// start, [`Command::NodeStarted`]).
    #[serde(default)]
    pub incarnations: BTreeMap<NodeId, u64>,
    /// The incarnation of each volume's owner's node when it claimed the
    /// volume: once that node runs another incarnation, the owner (and any
    /// read lease it held) is gone for certain.
    #[serde(default)]
    pub owner_incarnations: BTreeMap<VolumeId, u64>,
}

impl ClusterState {
    /// Whether the owner of `volume` is certainly gone: its node has
    /// started again since it claimed the volume. (A node that merely
    /// stopped answering may still run its owner.)
    pub fn owner_restarted(&self, volume: VolumeId) -> bool {
        let Some(v) = self.volumes.get(&volume) else {
            return false;
        };
        let (Some(owner), Some(&claimed)) = (v.owner, self.owner_incarnations.get(&volume)) else {
            return false;
        };
        self.incarnations
            .get(&owner)
            .is_some_and(|&now| claimed != 0 && now != claimed)
    }
}

/// A change to the cluster state, the payload of a Raft log entry.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Command {
    /// Names the cluster: accepted when no id is set yet, or when it matches.
    SetClusterId { cluster_id: String },
    /// Adds or updates a node (addresses may change across restarts).
    RegisterNode { node: NodeInfo },
    /// A node's process started, as incarnation `incarnation` (random,
    /// non-zero): owners it ran before are gone.
    NodeStarted { node: NodeId, incarnation: u64 },
    /// Marks a node up or down. When it goes down, its active and resyncing
    /// components become absent.
    SetNodeState { node: NodeId, state: NodeState },
    /// Adds or updates the device `(node, path)`; answers its id.
    RegisterDevice {
        node: NodeId,
        path: String,
        capacity: u64,
        /// The uuid in the store's superblock: the device is known by it
        /// wherever its path moves (0: not told; known by its path).
        #[serde(default)]
        store_uuid: u64,
    },
    /// Usage and health as reported by the device's node.
    ReportDeviceUsage {
        device: DeviceId,
        used: u64,
        state: DeviceState,
    },
    /// Creates a volume with the given placement; answers its id.
    CreateVolume {
        name: String,
        size: u64,
        policy: Policy,
        components: Vec<PlannedComponent>,
        /// The volume's data key wrapped by the cluster key (text form of
        /// `shoal_crypt::WrappedKey`): present exactly when the policy
        /// says `encrypt=on`.
        #[serde(default)]
        wrapped_key: Option<String>,
    },
    /// Deletes a volume and releases its reservations.
    DeleteVolume { name: String },
    /// Grows a volume.
    ResizeVolume { name: String, size: u64 },
    /// Sets a volume's IOPS limit (0: none); its owner applies it to the
    /// I/O it admits from then on, without clients reconnecting.
    SetIopsLimit { name: String, iops_limit: u32 },
    /// Stores the cluster CA: once; the same CA again is accepted.
    SetClusterCa { ca: CaRecord },
    /// Records a certificate issued to a node (by its SHA-256), so that
    /// revoking the node names it.
    RecordNodeCert { node: NodeId, cert_sha256: String },
    /// Revokes every certificate issued to a node: members refuse its
    /// connections from then on, and a new certificate needs a new join.
    RevokeNodeCerts { node: NodeId },
    /// Records why a volume cannot be served (its copies refused the
    /// claimer's activation), or clears it once an owner started.
    SetVolumeProblem {
        volume: VolumeId,
        problem: Option<String>,
    },
    /// Adds an API token (its id must be new).
    CreateToken { token: ApiToken },
    /// Removes an API token: it opens nothing from then on.
    RevokeToken { id: String },
    /// Compare-and-set of the owner: succeeds only when the volume is at
    /// `expected_generation`; answers the new generation.
    ClaimOwner {
        volume: VolumeId,
        node: NodeId,
        expected_generation: Generation,
    },
    /// Clears the owner if the volume is still at `generation`.
    ReleaseOwner {
        volume: VolumeId,
        generation: Generation,
    },
    /// Sets a component's state; only the current owner (holding the
    /// volume's current generation) may.
    SetComponentState {
        volume: VolumeId,
        component: ComponentId,
        state: ComponentState,
        generation: Generation,
    },
    /// Records a certificate issued to an NBD client (by its SHA-256), so
    /// that revoking the client names it.
    RecordClientCert { name: String, cert_sha256: String },
    /// Revokes every certificate issued to an NBD client: nodes refuse its
    /// TLS handshakes from then on.
    RevokeClientCerts { name: String },
    /// Begins a change of a volume's layout under its owner's generation
    /// (`crates/directory/src/reconfig.rs`): adds components in state
    /// `Reconfiguring`, records those to drop and the policy to end with.
    BeginReconfig {
        volume: VolumeId,
        generation: Generation,
        add: Vec<PlannedComponent>,
        remove: Vec<ComponentId>,
        policy: Option<Policy>,
        reason: String,
        /// The policy this change is one step towards, when a change
        /// takes several (raid5 to raid6 goes through raid1): recorded as
        /// the volume's wanted policy, so that its caretaker begins the
        /// next step once this one commits. None: `policy` itself.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        wanted: Option<Policy>,
    },
    /// Switches the volume to its new layout: the added components become
    /// active, the dropped ones leave. `added` and `remove` name the
    /// change (as its begin recorded them): a commit proposed again after
    /// its answer was lost answers Ok when that change is already
    /// committed.
    CommitReconfig {
        volume: VolumeId,
        generation: Generation,
        #[serde(default)]
        added: Vec<ComponentId>,
        #[serde(default)]
        remove: Vec<ComponentId>,
    },
    /// Undoes a change in progress: the added components leave. Answers
    /// Ok when the change named by `added` and `remove` is already
    /// undone.
    AbortReconfig {
        volume: VolumeId,
        generation: Generation,
        #[serde(default)]
        added: Vec<ComponentId>,
        #[serde(default)]
        remove: Vec<ComponentId>,
    },
    /// Ends an erasure-coded volume's growth (`Volume::grow_to`) under its
    /// owner's generation: the volume takes the size it grew to, and its
    /// map log lies at `map_log_at` (None: at the new end). Proposing it
    /// again after a lost answer is safe: a growth already ended answers
    /// Ok.
    CommitGrowth {
        volume: VolumeId,
        generation: Generation,
        size: u64,
        map_log_at: Option<u64>,
    },
    /// Drops a volume's wanted policy (`Volume::wanted_policy`): the
    /// volume keeps the policy it has and nothing begins its change
    /// again. No change when it has none.
    KeepPolicy { volume: VolumeId },
    /// Sets the repair delay (`ClusterSettings::repair_delay_s`): refused
    /// outside `MIN_REPAIR_DELAY_S..=MAX_REPAIR_DELAY_S`.
    SetRepairDelay { repair_delay_s: u64 },
    /// Sets the static resync limit (`ClusterSettings::resync_mib_per_s`,
    /// 0: none): refused above `MAX_RESYNC_MIB_PER_S`.
    SetResyncLimit { resync_mib_per_s: u64 },
    /// Puts a node in maintenance (or changes its mode): placement puts
    /// nothing new on it (`maintenance.rs`).
    EnterMaintenance { node: NodeId, mode: MaintenanceMode },
    /// Takes a node out of maintenance.
    ExitMaintenance { node: NodeId },
    /// Removes a node that holds no component, with its devices; its
    /// certificates are revoked.
    RemoveNode { node: NodeId },
    /// Marks a device for removal (`DeviceInfo::retiring`): placement
    /// puts nothing new on it and its components are moved off it
    /// (`devices.rs`). Again on a retiring device: no change.
    RetireDevice { device: DeviceId },
    /// Removes a retiring device that holds no component; proposed by its
    /// node once it has closed it.
    UnregisterDevice { device: DeviceId },
    /// Calls off the removal of a retiring device that still holds
    /// components: placement may use it again. Refused once it holds
    /// none (its node closes it then). Again on a device in service: no
    /// change.
    KeepDevice { device: DeviceId },
}

/// A component chosen by placement, before it has an id.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PlannedComponent {
    pub role: ComponentRole,
    pub node: NodeId,
    pub device: DeviceId,
    pub votes: u32,
}

/// What an accepted command answers.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub enum Response {
    Ok,
    /// The id of the created or registered object.
    Id(u64),
    /// A claim's answer: the new owner generation, and whether the
    /// previous owner is certainly gone ([`ClusterState::owner_restarted`],
    /// decided as the claim is applied, so on the newest state).
    Claimed {
        generation: Generation,
        previous_owner_gone: bool,
    },
}

/// Why a command was rejected. The state is unchanged.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error("a volume named {0:?} already exists")]
    NameTaken(String),
    #[error("no volume named {0:?}")]
    NoSuchVolume(String),
    #[error("no volume with id {0}")]
    NoSuchVolumeId(VolumeId),
    #[error("no node with id {0} is registered")]
    NoSuchNode(NodeId),
    #[error("no device with id {0} is registered")]
    NoSuchDevice(DeviceId),
    #[error("volume {volume} has no component {component}")]
    NoSuchComponent {
        volume: VolumeId,
        component: ComponentId,
    },
    #[error("device {device} belongs to node {actual}, not to node {stated}")]
    DeviceNotOnNode {
        device: DeviceId,
        stated: NodeId,
        actual: NodeId,
    },
    #[error("volume {name:?} cannot shrink from {from} to {to} bytes: volumes only grow")]
    Shrink { name: String, from: u64, to: u64 },
    #[error("{0}")]
    Input(String),
    #[error("a token with id {0} already exists")]
    TokenTaken(String),
    #[error("no token with id {0}")]
    NoSuchToken(String),
    #[error(
        "device {device} cannot guarantee {needed} more reserved bytes: {free} bytes are free"
    )]
    NoSpace {
        device: DeviceId,
        needed: u64,
        free: u64,
    },
    #[error("generation conflict: the volume is at generation {current} (owner {owner:?})")]
    GenerationConflict {
        current: Generation,
        owner: Option<NodeId>,
    },
    #[error("this directory belongs to cluster {current:?}, not {requested:?}")]
    ClusterMismatch { current: String, requested: String },
    #[error(
        "a repair delay of {0} s is out of range: it is {MIN_REPAIR_DELAY_S} s to \
         {MAX_REPAIR_DELAY_S} s (a week)"
    )]
    RepairDelayOutOfRange(u64),
    #[error(
        "a resync limit of {0} MiB/s is out of range: it is 0 (no static limit) to \
         {MAX_RESYNC_MIB_PER_S} MiB/s"
    )]
    ResyncLimitOutOfRange(u64),
    #[error("node {0} is not in maintenance")]
    NotInMaintenance(NodeId),
    #[error("node {0} is in maintenance: no new component is placed on it")]
    NodeInMaintenance(NodeId),
    #[error(
        "node {node} holds {components} component(s) of volumes: move them off first \
         (shoal maintenance enter {node} --mode full-data-migration)"
    )]
    NodeHoldsComponents { node: NodeId, components: usize },
    #[error("device {device} holds {components} component(s) of volumes: they move off it first")]
    DeviceHoldsComponents { device: DeviceId, components: usize },
    #[error("device {0} is not being removed (shoal device remove {0} first)")]
    DeviceNotRetiring(DeviceId),
    #[error("device {0} is being removed: no new component is placed on it")]
    DeviceRetiring(DeviceId),
    #[error(
        "device {0} holds nothing any more and its node is closing it: the removal cannot be \
         called off now (add the device again once it is gone)"
    )]
    DeviceEmptied(DeviceId),
    #[error(
        "device {device} is the last device node {node} serves and is not removing: add another \
         first (shoal device add {node} PATH), or remove the node"
    )]
    LastDevice { device: DeviceId, node: NodeId },
}

/// Bytes reserved on a device for one data component of a volume.
pub fn reservation(size: u64, policy: &Policy) -> u64 {
    (size as u128 * policy.reserve_pct.min(100) as u128 / 100) as u64
}

/// The stripe geometry a new volume's components make under `policy`:
/// none for RAID-1 (which has no stripe column); for RAID-5/6 the columns'
/// count less the parity, which must be a geometry of the layout, the
/// columns at positions `0..k + m` once each, voteless, on distinct nodes.
pub(crate) fn stripe_of(
    policy: &Policy,
    components: &[PlannedComponent],
) -> Result<Option<StripeGeometry>, StateError> {
    let mut columns: Vec<(u8, NodeId, u32)> = components
        .iter()
        .filter_map(|c| match c.role {
            ComponentRole::Stripe { position } => Some((position, c.node, c.votes)),
            _ => None,
        })
        .collect();
    let Some(parity) = policy.layout.fixed_ftt() else {
        return match columns.is_empty() {
            true => Ok(None),
            false => Err(input("a raid1 volume has no stripe components")),
        };
    };
    columns.sort_unstable();
    let positions: Vec<u8> = columns.iter().map(|c| c.0).collect();
    if positions != (0..columns.len() as u8).collect::<Vec<_>>() {
        return Err(input(
            "stripe components take the positions 0 to k+m-1, once each",
        ));
    }
    let mut nodes: Vec<NodeId> = columns.iter().map(|c| c.1).collect();
    nodes.sort_unstable();
    nodes.dedup();
    if nodes.len() != columns.len() || columns.iter().any(|c| c.2 != 0) {
        return Err(input(
            "stripe components sit on distinct nodes and carry no vote",
        ));
    }
    let g = StripeGeometry {
        data: (columns.len() as u8).saturating_sub(parity),
        parity,
    };
    let allowed: &[StripeGeometry] = match policy.layout {
        shoal_model::Layout::Raid5 => &[StripeGeometry::RAID5_NARROW, StripeGeometry::RAID5_WIDE],
        _ => &[StripeGeometry::RAID6],
    };
    if !allowed.contains(&g) {
        return Err(input(format!("{} has no {g} stripe", policy.layout)));
    }
    Ok(Some(g))
}

pub(crate) fn input(e: impl std::fmt::Display) -> StateError {
    StateError::Input(e.to_string())
}

/// A certificate's SHA-256 as the directory keeps it: 64 hex digits.
fn check_sha256(sha256: &str) -> Result<(), StateError> {
    if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(input("a certificate's SHA-256 is 64 hex digits"));
    }
    Ok(())
}

impl ClusterState {
    pub fn volume_by_name(&self, name: &str) -> Option<&Volume> {
        self.volumes.values().find(|v| v.name == name)
    }

    fn volume_id_by_name(&self, name: &str) -> Result<VolumeId, StateError> {
        self.volume_by_name(name)
            .map(|v| v.id)
            .ok_or_else(|| StateError::NoSuchVolume(name.to_string()))
    }

    /// A planned component's node exists, is not in maintenance, and holds
    /// its device.
    pub(crate) fn check_placed(&self, c: &PlannedComponent) -> Result<(), StateError> {
        if !self.nodes.contains_key(&c.node) {
            return Err(StateError::NoSuchNode(c.node));
        }
        if self.maintenance.contains_key(&c.node) {
            return Err(StateError::NodeInMaintenance(c.node));
        }
        let d = self
            .devices
            .get(&c.device)
            .ok_or(StateError::NoSuchDevice(c.device))?;
        if d.node != c.node {
            return Err(StateError::DeviceNotOnNode {
                device: c.device,
                stated: c.node,
                actual: d.node,
            });
        }
        if d.retiring {
            return Err(StateError::DeviceRetiring(c.device));
        }
        Ok(())
    }

    fn alloc_id(&mut self) -> u64 {
        let id = self.next_id.max(1);
        self.next_id = id + 1;
        id
    }

    /// Per-device change of `reserved` when the data components of `v`
    /// change reservation from `old` to `new` bytes each. Checked, so that a
    /// rejected change never leaves a partial update. A reservation only
    /// grows on a device whose free space (capacity less used and already
    /// reserved bytes, as placement counts it) covers the growth, so two
    /// volumes placed from the same snapshot cannot both be promised the
    /// same space.
    fn reserve_delta(
        &self,
        components: &[(ComponentRole, DeviceId)],
        old: u64,
        new: u64,
    ) -> Result<BTreeMap<DeviceId, u64>, StateError> {
        let mut out: BTreeMap<DeviceId, u64> = BTreeMap::new();
        for (role, dev) in components {
            if *role != ComponentRole::Data {
                continue;
            }
            let d = self
                .devices
                .get(dev)
                .ok_or(StateError::NoSuchDevice(*dev))?;
            let cur = out.get(dev).copied().unwrap_or(d.reserved);
            let next = cur
                .checked_sub(old)
                .and_then(|v| v.checked_add(new))
                .ok_or_else(|| input(format!("reservation on device {dev} out of range")))?;
            if new > old {
                let free = d.capacity.saturating_sub(d.used).saturating_sub(cur);
                if new - old > free {
                    return Err(StateError::NoSpace {
                        device: *dev,
                        needed: new - old,
                        free,
                    });
                }
            }
            out.insert(*dev, next);
        }
        Ok(out)
    }

    /// Applies one command. On error nothing has changed.
    pub fn apply(&mut self, cmd: &Command) -> Result<Response, StateError> {
        let r = self.apply_inner(cmd);
        if r.is_ok()
            && matches!(
                cmd,
                Command::CreateVolume { .. }
                    | Command::DeleteVolume { .. }
                    | Command::ResizeVolume { .. }
                    | Command::RegisterDevice { .. }
                    | Command::UnregisterDevice { .. }
                    | Command::KeepDevice { .. }
                    | Command::BeginReconfig { .. }
                    | Command::CommitReconfig { .. }
                    | Command::AbortReconfig { .. }
                    | Command::CommitGrowth { .. }
            )
        {
            self.recount_provisioned();
        }
        r
    }

    /// Ends volume `id`'s growth under its owner's `generation`
    /// ([`Command::CommitGrowth`]): its reservation moved when the growth
    /// was recorded.
    fn commit_growth(
        &mut self,
        id: VolumeId,
        generation: Generation,
        size: u64,
        map_log_at: Option<u64>,
    ) -> Result<Response, StateError> {
        self.owned(id, generation)?;
        let v = self
            .volumes
            .get_mut(&id)
            .ok_or(StateError::NoSuchVolumeId(id))?;
        if v.size == size && v.map_log_at == map_log_at {
            // Proposed again after a lost answer (a next growth may have
            // been recorded since).
            return Ok(Response::Ok);
        }
        if v.grow_to != Some(size) {
            return Err(input(format!(
                "volume {} is not being grown to {size} bytes",
                v.name
            )));
        }
        if map_log_at.is_some_and(|at| at < size || !at.is_multiple_of(shoal_model::BLOCK_SIZE)) {
            return Err(input(format!(
                "a map log at byte {map_log_at:?} of volume {} would not lie past its end of {size} \
                 bytes, on a block",
                v.name
            )));
        }
        v.size = size;
        v.grow_to = None;
        v.map_log_at = map_log_at;
        Ok(Response::Ok)
    }

    /// `provisioned` of every device: the sizes of the data components on it.
    fn recount_provisioned(&mut self) {
        for d in self.devices.values_mut() {
            d.provisioned = 0;
        }
        for v in self.volumes.values() {
            for c in v.data_components() {
                if let Some(d) = self.devices.get_mut(&c.device) {
                    d.provisioned = d.provisioned.saturating_add(v.provisioned_size());
                }
            }
        }
    }

    /// The registered device of `node` that a registration of the store
    /// `store_uuid` at `path` names: the one holding that store, wherever
    /// it was (device names change when disks move); else the one at
    /// `path` registered before stores were told apart (uuid 0), or at
    /// `path` when the registration names no store. A device at `path`
    /// holding another store is another disk: not this one.
    fn known_device(&self, node: NodeId, path: &str, store_uuid: u64) -> Option<DeviceId> {
        let mine = || self.devices.values().filter(move |d| d.node == node);
        if store_uuid != 0 {
            if let Some(d) = mine().find(|d| d.store_uuid == store_uuid) {
                return Some(d.id);
            }
        }
        mine()
            .find(|d| d.path == path && (d.store_uuid == 0 || store_uuid == 0))
            .map(|d| d.id)
    }

    /// The node a command acts for, when it names one: only that node may
    /// propose it (its registration, devices and usage, its claims).
    pub fn actor(&self, cmd: &Command) -> Option<NodeId> {
        match cmd {
            Command::RegisterNode { node } => Some(node.id),
            Command::NodeStarted { node, .. } => Some(*node),
            Command::RegisterDevice { node, .. } => Some(*node),
            Command::UnregisterDevice { device } => self.devices.get(device).map(|d| d.node),
            Command::ClaimOwner { node, .. } => Some(*node),
            Command::ReportDeviceUsage { device, .. } => {
                // An unknown device is refused by the state machine itself.
                self.devices.get(device).map(|d| d.node)
            }
            _ => None,
        }
    }

    fn set_problem(
        &mut self,
        volume: VolumeId,
        problem: &Option<String>,
    ) -> Result<Response, StateError> {
        if problem
            .as_ref()
            .is_some_and(|p| p.len() > shoal_model::MAX_PROBLEM_BYTES)
        {
            return Err(input(format!(
                "a volume's problem is at most {} bytes",
                shoal_model::MAX_PROBLEM_BYTES
            )));
        }
        let v = self
            .volumes
            .get_mut(&volume)
            .ok_or(StateError::NoSuchVolumeId(volume))?;
        v.problem = problem.clone();
        Ok(Response::Ok)
    }

    fn set_ca(&mut self, ca: &CaRecord) -> Result<Response, StateError> {
        match &self.ca {
            Some(have) if have != ca => Err(input("the cluster already has another CA")),
            _ => {
                self.ca = Some(ca.clone());
                Ok(Response::Ok)
            }
        }
    }

    fn record_cert(&mut self, node: NodeId, sha256: &str) -> Result<Response, StateError> {
        check_sha256(sha256)?;
        if self.revoked_certs.contains(sha256) {
            return Err(input("this certificate is revoked"));
        }
        self.node_certs
            .entry(node)
            .or_default()
            .insert(sha256.to_string());
        Ok(Response::Ok)
    }

    fn record_client_cert(&mut self, name: &str, sha256: &str) -> Result<Response, StateError> {
        check_sha256(sha256)?;
        if name.is_empty() || name.len() > 64 {
            return Err(input("a client's name is 1 to 64 bytes"));
        }
        if self.revoked_certs.contains(sha256) {
            return Err(input("this certificate is revoked"));
        }
        self.client_certs
            .entry(name.to_string())
            .or_default()
            .insert(sha256.to_string());
        Ok(Response::Ok)
    }

    fn revoke_client_certs(&mut self, name: &str) -> Result<Response, StateError> {
        let certs = self
            .client_certs
            .remove(name)
            .ok_or_else(|| input(format!("no certificate was issued to a client {name:?}")))?;
        self.revoked_certs.extend(certs);
        Ok(Response::Ok)
    }

    fn revoke_certs(&mut self, node: NodeId) -> Result<Response, StateError> {
        let certs = self
            .node_certs
            .remove(&node)
            .ok_or_else(|| input(format!("no certificate was issued to node {node}")))?;
        self.revoked_certs.extend(certs);
        Ok(Response::Ok)
    }

    fn set_repair_delay(&mut self, repair_delay_s: u64) -> Result<Response, StateError> {
        if !(MIN_REPAIR_DELAY_S..=MAX_REPAIR_DELAY_S).contains(&repair_delay_s) {
            return Err(StateError::RepairDelayOutOfRange(repair_delay_s));
        }
        self.settings.repair_delay_s = repair_delay_s;
        Ok(Response::Ok)
    }

    fn set_resync_limit(&mut self, resync_mib_per_s: u64) -> Result<Response, StateError> {
        if resync_mib_per_s > MAX_RESYNC_MIB_PER_S {
            return Err(StateError::ResyncLimitOutOfRange(resync_mib_per_s));
        }
        self.settings.resync_mib_per_s = resync_mib_per_s;
        Ok(Response::Ok)
    }

    fn apply_inner(&mut self, cmd: &Command) -> Result<Response, StateError> {
        match cmd {
            Command::SetClusterId { cluster_id } => {
                if cluster_id.is_empty() {
                    return Err(input("the cluster id must not be empty"));
                }
                if self.cluster_id.is_empty() {
                    self.cluster_id = cluster_id.clone();
                } else if &self.cluster_id != cluster_id {
                    return Err(StateError::ClusterMismatch {
                        current: self.cluster_id.clone(),
                        requested: cluster_id.clone(),
                    });
                }
                Ok(Response::Ok)
            }
            Command::RegisterNode { node } => {
                self.nodes.insert(node.id, node.clone());
                Ok(Response::Ok)
            }
            Command::NodeStarted { node, incarnation } => {
                if !self.nodes.contains_key(node) {
                    return Err(StateError::NoSuchNode(*node));
                }
                if *incarnation == 0 {
                    return Err(input("an incarnation is never 0"));
                }
                self.incarnations.insert(*node, *incarnation);
                Ok(Response::Ok)
            }
            Command::SetNodeState { node, state } => {
                // Liveness only: component states are the owner's to change,
                // because only the owner knows whether a copy missed writes.
                // (Marking the copies of a node absent here made a paused
                // owner's node lose its own, up-to-date copy.)
                let n = self
                    .nodes
                    .get_mut(node)
                    .ok_or(StateError::NoSuchNode(*node))?;
                n.state = *state;
                Ok(Response::Ok)
            }
            Command::RegisterDevice {
                node,
                path,
                capacity,
                store_uuid,
            } => {
                if !self.nodes.contains_key(node) {
                    return Err(StateError::NoSuchNode(*node));
                }
                if path.is_empty() {
                    return Err(input("the device path must not be empty"));
                }
                if let Some(id) = self.known_device(*node, path, *store_uuid) {
                    if let Some(d) = self.devices.get_mut(&id) {
                        d.capacity = *capacity;
                        d.path = path.clone();
                        if *store_uuid != 0 {
                            d.store_uuid = *store_uuid;
                        }
                    }
                    return Ok(Response::Id(id));
                }
                let id = self.alloc_id();
                self.devices.insert(
                    id,
                    DeviceInfo {
                        id,
                        node: *node,
                        path: path.clone(),
                        capacity: *capacity,
                        used: 0,
                        reserved: 0,
                        state: DeviceState::Healthy,
                        provisioned: 0,
                        maintenance: self.maintenance.contains_key(node),
                        retiring: false,
                        store_uuid: *store_uuid,
                    },
                );
                Ok(Response::Id(id))
            }
            Command::ReportDeviceUsage {
                device,
                used,
                state,
            } => {
                let d = self
                    .devices
                    .get_mut(device)
                    .ok_or(StateError::NoSuchDevice(*device))?;
                d.used = *used;
                d.state = *state;
                Ok(Response::Ok)
            }
            Command::CreateVolume {
                name,
                size,
                policy,
                components,
                wrapped_key,
            } => {
                check_volume_name(name).map_err(input)?;
                if policy.encrypt != wrapped_key.is_some() {
                    return Err(input(
                        "an encrypted volume needs its wrapped key, and only it has one",
                    ));
                }
                check_volume_size(*size).map_err(input)?;
                if policy.layout.is_erasure() {
                    shoal_model::check_erasure_volume_size(*size).map_err(input)?;
                }
                if self.volume_by_name(name).is_some() {
                    return Err(StateError::NameTaken(name.clone()));
                }
                if components.is_empty() {
                    return Err(input("a volume needs at least one component"));
                }
                if !components.iter().any(|c| c.role == ComponentRole::Data) {
                    return Err(input("a volume needs at least one data component"));
                }
                for c in components {
                    self.check_placed(c)?;
                }
                let stripe = stripe_of(policy, components)?;
                let placed: Vec<_> = components.iter().map(|c| (c.role, c.device)).collect();
                let reserved = self.reserve_delta(&placed, 0, reservation(*size, policy))?;
                // Validated: mutate.
                for (dev, r) in reserved {
                    if let Some(d) = self.devices.get_mut(&dev) {
                        d.reserved = r;
                    }
                }
                let id = self.alloc_id();
                let comps = components
                    .iter()
                    .map(|c| Component {
                        id: self.alloc_id(),
                        role: c.role,
                        node: c.node,
                        device: c.device,
                        state: ComponentState::Active,
                        votes: c.votes,
                    })
                    .collect();
                self.volumes.insert(
                    id,
                    Volume {
                        id,
                        name: name.clone(),
                        size: *size,
                        policy: *policy,
                        components: comps,
                        owner: None,
                        generation: 0,
                        problem: None,
                        wrapped_key: wrapped_key.clone(),
                        reconfig: None,
                        wanted_policy: None,
                        grow_to: None,
                        map_log_at: None,
                        stripe,
                    },
                );
                Ok(Response::Id(id))
            }
            Command::DeleteVolume { name } => {
                let id = self.volume_id_by_name(name)?;
                // Whatever change is in progress goes with it.
                let v = self.volumes[&id].clone();
                self.replace_volume(Some(&v), None)?;
                self.owner_incarnations.remove(&id);
                Ok(Response::Ok)
            }
            Command::SetClusterCa { ca } => self.set_ca(ca),
            Command::RecordNodeCert { node, cert_sha256 } => self.record_cert(*node, cert_sha256),
            Command::RevokeNodeCerts { node } => self.revoke_certs(*node),
            Command::RecordClientCert { name, cert_sha256 } => {
                self.record_client_cert(name, cert_sha256)
            }
            Command::RevokeClientCerts { name } => self.revoke_client_certs(name),
            Command::BeginReconfig { .. } => {
                let b = cmd.as_begin().ok_or_else(|| input("not a begin"))?;
                self.begin_reconfig(&b)
            }
            Command::CommitReconfig {
                volume,
                generation,
                added,
                remove,
            } => self.commit_reconfig(*volume, *generation, (added, remove)),
            Command::AbortReconfig {
                volume,
                generation,
                added,
                remove,
            } => self.abort_reconfig(*volume, *generation, (added, remove)),
            Command::CreateToken { token } => {
                if self.tokens.contains_key(&token.id) {
                    return Err(StateError::TokenTaken(token.id.clone()));
                }
                self.tokens.insert(token.id.clone(), token.clone());
                Ok(Response::Ok)
            }
            Command::RevokeToken { id } => match self.tokens.remove(id) {
                Some(_) => Ok(Response::Ok),
                None => Err(StateError::NoSuchToken(id.clone())),
            },
            Command::SetVolumeProblem { volume, problem } => self.set_problem(*volume, problem),
            Command::KeepPolicy { volume } => {
                let v = self
                    .volumes
                    .get_mut(volume)
                    .ok_or(StateError::NoSuchVolumeId(*volume))?;
                v.wanted_policy = None;
                Ok(Response::Ok)
            }
            Command::SetRepairDelay { repair_delay_s } => self.set_repair_delay(*repair_delay_s),
            Command::SetResyncLimit { resync_mib_per_s } => {
                self.set_resync_limit(*resync_mib_per_s)
            }
            Command::EnterMaintenance { .. }
            | Command::ExitMaintenance { .. }
            | Command::RemoveNode { .. } => self.apply_maintenance(cmd),
            Command::RetireDevice { .. }
            | Command::UnregisterDevice { .. }
            | Command::KeepDevice { .. } => self.apply_device_removal(cmd),
            Command::SetIopsLimit { name, iops_limit } => {
                let id = self.volume_id_by_name(name)?;
                if let Some(v) = self.volumes.get_mut(&id) {
                    v.policy.iops_limit = *iops_limit;
                    // The policy a change in progress ends with too.
                    if let Some(p) = v.reconfig.as_mut().and_then(|r| r.policy.as_mut()) {
                        p.iops_limit = *iops_limit;
                    }
                }
                Ok(Response::Ok)
            }
            Command::ResizeVolume { name, size } => {
                let id = self.volume_id_by_name(name)?;
                check_volume_size(*size).map_err(input)?;
                let v = &self.volumes[&id];
                if v.reconfig.is_some() {
                    return Err(input(format!(
                        "volume {name} is being reconfigured: resize it once that is done"
                    )));
                }
                if let Some(to) = v.grow_to {
                    return match *size == to {
                        true => Ok(Response::Ok),
                        false => Err(input(format!(
                            "volume {name} is being grown to {to} bytes: resize it again once that is done"
                        ))),
                    };
                }
                if v.stripe.is_some() && *size > v.size {
                    // The new log goes past the new end or past the old
                    // log (`Volume::map_log_at`), both bounded.
                    shoal_model::check_erasure_volume_size(*size).map_err(input)?;
                    let log = v.map_log_at.unwrap_or(0);
                    if log > shoal_model::MAX_ERASURE_VOLUME_SIZE {
                        return Err(input(format!(
                            "volume {name}'s map log lies at byte {log}, past the farthest a growth \
                             moves it ({}): lower it to RAID-1 and grow it then",
                            shoal_model::MAX_ERASURE_VOLUME_SIZE
                        )));
                    }
                }
                if *size < v.size {
                    return Err(StateError::Shrink {
                        name: name.clone(),
                        from: v.size,
                        to: *size,
                    });
                }
                let placed: Vec<_> = v.components.iter().map(|c| (c.role, c.device)).collect();
                let reserved = self.reserve_delta(
                    &placed,
                    reservation(v.size, &v.policy),
                    reservation(*size, &v.policy),
                )?;
                for (dev, r) in reserved {
                    if let Some(d) = self.devices.get_mut(&dev) {
                        d.reserved = r;
                    }
                }
                if let Some(v) = self.volumes.get_mut(&id) {
                    match v.stripe.is_some() && *size > v.size {
                        // Its owner moves the map log past the new end,
                        // then commits the size (CommitGrowth).
                        true => v.grow_to = Some(*size),
                        false => v.size = *size,
                    }
                }
                Ok(Response::Ok)
            }
            Command::CommitGrowth {
                volume,
                generation,
                size,
                map_log_at,
            } => self.commit_growth(*volume, *generation, *size, *map_log_at),
            Command::ClaimOwner {
                volume,
                node,
                expected_generation,
            } => {
                if !self.nodes.contains_key(node) {
                    return Err(StateError::NoSuchNode(*node));
                }
                let previous_owner_gone = self.owner_restarted(*volume);
                let v = self
                    .volumes
                    .get_mut(volume)
                    .ok_or(StateError::NoSuchVolumeId(*volume))?;
                if v.generation != *expected_generation {
                    return Err(StateError::GenerationConflict {
                        current: v.generation,
                        owner: v.owner,
                    });
                }
                v.owner = Some(*node);
                v.generation += 1;
                let generation = v.generation;
                let incarnation = self.incarnations.get(node).copied().unwrap_or(0);
                self.owner_incarnations.insert(*volume, incarnation);
                Ok(Response::Claimed {
                    generation,
                    previous_owner_gone,
                })
            }
            Command::ReleaseOwner { volume, generation } => {
                let v = self
                    .volumes
                    .get_mut(volume)
                    .ok_or(StateError::NoSuchVolumeId(*volume))?;
                if v.generation != *generation {
                    return Err(StateError::GenerationConflict {
                        current: v.generation,
                        owner: v.owner,
                    });
                }
                v.owner = None;
                Ok(Response::Ok)
            }
            Command::SetComponentState {
                volume,
                component,
                state,
                generation,
            } => {
                let v = self
                    .volumes
                    .get_mut(volume)
                    .ok_or(StateError::NoSuchVolumeId(*volume))?;
                if v.generation != *generation {
                    return Err(StateError::GenerationConflict {
                        current: v.generation,
                        owner: v.owner,
                    });
                }
                let c = v.components.iter_mut().find(|c| c.id == *component).ok_or(
                    StateError::NoSuchComponent {
                        volume: *volume,
                        component: *component,
                    },
                )?;
                c.state = *state;
                Ok(Response::Ok)
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    pub(crate) fn node(id: NodeId) -> NodeInfo {
        NodeInfo {
            id,
            fault_domain: format!("node-{id}"),
            peer_addr: format!("10.0.0.{id}:7000"),
            api_addr: format!("10.0.0.{id}:8000"),
            nbd_addr: format!("10.0.0.{id}:10809"),
            state: NodeState::Up,
        }
    }

    /// Three nodes with one device each; returns (state, device ids).
    /// Registers node `n` with one 1 GiB device; answers the device's id.
    fn add_node(s: &mut ClusterState, n: NodeId) -> DeviceId {
        s.apply(&Command::RegisterNode { node: node(n) }).unwrap();
        let Response::Id(d) = s
            .apply(&Command::RegisterDevice {
                node: n,
                path: "/dev/a".into(),
                capacity: 1 << 30,
                store_uuid: 0,
            })
            .unwrap()
        else {
            panic!()
        };
        d
    }

    fn cluster() -> (ClusterState, Vec<DeviceId>) {
        let mut s = ClusterState::default();
        let mut devs = vec![];
        for n in 1..=3 {
            devs.push(add_node(&mut s, n));
        }
        (s, devs)
    }

    fn planned(devs: &[DeviceId]) -> Vec<PlannedComponent> {
        vec![
            PlannedComponent {
                role: ComponentRole::Data,
                node: 1,
                device: devs[0],
                votes: 1,
            },
            PlannedComponent {
                role: ComponentRole::Data,
                node: 2,
                device: devs[1],
                votes: 1,
            },
            PlannedComponent {
                role: ComponentRole::Witness,
                node: 3,
                device: devs[2],
                votes: 1,
            },
        ]
    }

    fn create(s: &mut ClusterState, devs: &[DeviceId], name: &str, policy: &str) -> VolumeId {
        match s
            .apply(&Command::CreateVolume {
                name: name.into(),
                size: 1 << 20,
                policy: policy.parse().unwrap(),
                wrapped_key: None,
                components: planned(devs),
            })
            .unwrap()
        {
            Response::Id(id) => id,
            r => panic!("{r:?}"),
        }
    }

    #[test]
    fn an_owner_is_known_gone_once_its_node_started_again() {
        let (mut s, devs) = cluster();
        let v = create(&mut s, &devs, "v", "raid1 ftt=1");
        let started = |n, i| Command::NodeStarted {
            node: n,
            incarnation: i,
        };
        s.apply(&started(1, 11)).unwrap();
        assert!(s.apply(&started(1, 0)).is_err(), "incarnation 0");
        assert!(s.apply(&started(9, 5)).is_err(), "unknown node");
        let claim = |g| Command::ClaimOwner {
            volume: v,
            node: 1,
            expected_generation: g,
        };
        s.apply(&claim(0)).unwrap();
        assert!(!s.owner_restarted(v), "the claiming incarnation runs");
        // Merely down: its owner may still run.
        s.apply(&Command::SetNodeState {
            node: 1,
            state: NodeState::Down,
        })
        .unwrap();
        assert!(!s.owner_restarted(v));
        s.apply(&started(1, 12)).unwrap();
        assert!(
            s.owner_restarted(v),
            "a new incarnation of the owner's node"
        );
        s.apply(&claim(1)).unwrap();
        assert!(
            !s.owner_restarted(v),
            "claimed again by the new incarnation"
        );
    }

    #[test]
    fn a_revoked_clients_certificates_are_refused_and_cannot_return() {
        let mut s = ClusterState::default();
        let fp = |c: char| c.to_string().repeat(64);
        let record = |name: &str, sha: String| Command::RecordClientCert {
            name: name.into(),
            cert_sha256: sha,
        };
        s.apply(&record("backup", fp('a'))).unwrap();
        s.apply(&record("backup", fp('b'))).unwrap();
        s.apply(&record("web", fp('c'))).unwrap();
        assert!(s.apply(&record("web", "xyz".into())).is_err(), "bad hash");
        assert!(s.apply(&record("", fp('d'))).is_err(), "empty name");
        s.apply(&Command::RevokeClientCerts {
            name: "backup".into(),
        })
        .unwrap();
        assert!(s.revoked_certs.contains(&fp('a')) && s.revoked_certs.contains(&fp('b')));
        assert!(!s.revoked_certs.contains(&fp('c')), "another client stays");
        assert!(
            s.apply(&record("backup", fp('a'))).is_err(),
            "revoked stays revoked"
        );
        let again = Command::RevokeClientCerts {
            name: "backup".into(),
        };
        assert!(s.apply(&again).is_err(), "nothing left to revoke");
    }

    #[test]
    fn cluster_id_is_set_once() {
        let mut s = ClusterState::default();
        assert!(s
            .apply(&Command::SetClusterId {
                cluster_id: String::new()
            })
            .is_err());
        let set = |id: &str| Command::SetClusterId {
            cluster_id: id.into(),
        };
        assert_eq!(s.apply(&set("a")), Ok(Response::Ok));
        assert_eq!(s.apply(&set("a")), Ok(Response::Ok));
        assert!(matches!(
            s.apply(&set("b")),
            Err(StateError::ClusterMismatch { .. })
        ));
        assert_eq!(s.cluster_id, "a");
    }

    #[test]
    fn a_device_is_known_by_its_store_wherever_its_path_moves() {
        let (mut s, devs) = cluster();
        let reg = |path: &str, uuid: u64| Command::RegisterDevice {
            node: 1,
            path: path.into(),
            capacity: 1 << 30,
            store_uuid: uuid,
        };
        // A device registered before stores were told apart takes the
        // uuid of the store at its path.
        assert_eq!(s.apply(&reg("/dev/a", 7)), Ok(Response::Id(devs[0])));
        assert_eq!(s.devices[&devs[0]].store_uuid, 7);
        let Ok(Response::Id(b)) = s.apply(&reg("/dev/b", 8)) else {
            panic!("no id for /dev/b");
        };
        // The two disks trade slots: each keeps its id, at its new path.
        assert_eq!(s.apply(&reg("/dev/b", 7)), Ok(Response::Id(devs[0])));
        assert_eq!(s.apply(&reg("/dev/a", 8)), Ok(Response::Id(b)));
        assert_eq!(s.devices[&devs[0]].path, "/dev/b");
        assert_eq!(s.devices[&b].path, "/dev/a");
        // Another disk at a known path is another device.
        let Ok(Response::Id(c)) = s.apply(&reg("/dev/a", 9)) else {
            panic!("no id for the third disk");
        };
        assert!(c != devs[0] && c != b);
        // Told no uuid, a registration is known by its path; the device
        // keeps the uuid it has.
        let path_only = reg("/dev/b", 0);
        assert_eq!(s.apply(&path_only), Ok(Response::Id(devs[0])));
        assert_eq!(s.devices[&devs[0]].store_uuid, 7);
    }

    #[test]
    fn devices_upsert_by_node_and_path() {
        let (mut s, devs) = cluster();
        let again = s
            .apply(&Command::RegisterDevice {
                node: 1,
                path: "/dev/a".into(),
                capacity: 2 << 30,
                store_uuid: 0,
            })
            .unwrap();
        assert_eq!(again, Response::Id(devs[0]));
        assert_eq!(s.devices[&devs[0]].capacity, 2 << 30);
        assert_eq!(s.devices.len(), 3);
        assert_eq!(
            s.apply(&Command::RegisterDevice {
                node: 9,
                path: "/x".into(),
                capacity: 1,
                store_uuid: 0,
            }),
            Err(StateError::NoSuchNode(9))
        );
    }

    /// An erasure-coded volume's growth (volume `id`, 1 MiB, of `s`): the
    /// resize records it, its owner commits it; meanwhile other sizes and
    /// layout changes are refused, the devices hold room for the new size,
    /// and only the owner's generation commits.
    fn growth_of_an_erasure_coded_volume(mut s: ClusterState, id: VolumeId) {
        let resize = |size: u64| Command::ResizeVolume {
            name: "ec".into(),
            size,
        };
        let commit = |generation, size, map_log_at| Command::CommitGrowth {
            volume: id,
            generation,
            size,
            map_log_at,
        };
        let v = s.volumes[&id].clone();
        assert_eq!(v.size, 1 << 20);
        let dev = v.data_components().next().unwrap().device;
        let provisioned = s.devices[&dev].provisioned;
        s.apply(&resize(4 << 20)).unwrap();
        let v = s.volumes[&id].clone();
        assert_eq!((v.size, v.grow_to), (1 << 20, Some(4 << 20)));
        assert_eq!(s.devices[&dev].provisioned, provisioned + (3 << 20));
        // The same size again is the growth in progress; others wait.
        s.apply(&resize(4 << 20)).unwrap();
        for size in [2 << 20, 8 << 20] {
            let e = s.apply(&resize(size)).unwrap_err().to_string();
            assert!(e.contains("being grown to 4194304 bytes"), "{e}");
        }
        let begin = Command::BeginReconfig {
            volume: id,
            generation: 0,
            add: vec![],
            remove: vec![],
            policy: Some(Policy::default()),
            reason: String::new(),
            wanted: None,
        };
        let e = s.apply(&begin).unwrap_err().to_string();
        assert!(e.contains("being grown"), "{e}");
        // Only the owner's generation, the size recorded, a log past it.
        let before = s.clone();
        for (cmd, want) in [
            (commit(1, 4 << 20, None), "generation"),
            (commit(0, 2 << 20, None), "not being grown to 2097152"),
            (commit(0, 4 << 20, Some(1 << 20)), "past its end"),
            (commit(0, 4 << 20, Some((5 << 20) + 1)), "on a block"),
        ] {
            let e = s.apply(&cmd).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
        }
        assert_eq!(s, before);
        s.apply(&commit(0, 4 << 20, Some(5 << 20))).unwrap();
        let v = s.volumes[&id].clone();
        assert_eq!(
            (v.size, v.grow_to, v.map_log_at),
            (4 << 20, None, Some(5 << 20))
        );
        assert_eq!(s.devices[&dev].provisioned, provisioned + (3 << 20));
        // Proposed again after a lost answer: Ok, nothing changes.
        let after = s.clone();
        s.apply(&commit(0, 4 << 20, Some(5 << 20))).unwrap();
        assert_eq!(s, after);
        // Shrinking stays refused; so is a size the map log could not
        // follow past.
        let e = s.apply(&resize(2 << 20)).unwrap_err().to_string();
        assert!(e.contains("only grow"), "{e}");
        let huge = shoal_model::MAX_ERASURE_VOLUME_SIZE + 4096;
        let e = s.apply(&resize(huge)).unwrap_err().to_string();
        assert!(e.contains("erasure-coded volume"), "{e}");
        assert_eq!(s, after);
        // Even with a next growth recorded since, the first one's commit
        // proposed again answers Ok.
        s.apply(&resize(8 << 20)).unwrap();
        let next = s.clone();
        s.apply(&commit(0, 4 << 20, Some(5 << 20))).unwrap();
        assert_eq!(s, next);
        s.apply(&commit(0, 8 << 20, None)).unwrap();
        let v = s.volumes[&id].clone();
        assert_eq!((v.size, v.grow_to, v.map_log_at), (8 << 20, None, None));
    }

    /// A RAID-5 volume records the geometry its stripe columns make; bad
    /// columns (a raid1 volume with one, positions missing or twice,
    /// columns sharing a node or carrying votes, a geometry the layout
    /// has not) are refused and change nothing.
    #[test]
    fn erasure_volumes_record_their_stripe_geometry() {
        let (mut s, devs) = cluster();
        let raid5 = Policy {
            layout: shoal_model::Layout::Raid5,
            ..Policy::default()
        };
        let column = |position: u8, i: usize| PlannedComponent {
            role: ComponentRole::Stripe { position },
            node: i as u64 + 1,
            device: devs[i],
            votes: 0,
        };
        let create = |policy: Policy, extra: Vec<PlannedComponent>| {
            let mut components = planned(&devs);
            components.extend(extra);
            Command::CreateVolume {
                name: "ec".into(),
                size: 1 << 20,
                policy,
                components,
                wrapped_key: None,
            }
        };
        let good = vec![column(0, 0), column(1, 1), column(2, 2)];
        let bad = [
            (Policy::default(), good.clone(), "no stripe components"),
            (
                raid5,
                vec![column(0, 0), column(2, 1), column(3, 2)],
                "positions",
            ),
            (
                raid5,
                vec![column(0, 0), column(1, 0), column(2, 2)],
                "distinct nodes",
            ),
            (
                raid5,
                vec![column(0, 0), column(1, 1)],
                "raid5 has no 1+1 stripe",
            ),
            (raid5, Vec::new(), "raid5 has no 0+1 stripe"),
        ];
        for (policy, extra, want) in bad {
            let before = s.clone();
            let e = s.apply(&create(policy, extra)).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
            assert_eq!(s, before);
        }
        let mut voting = good.clone();
        voting[1].votes = 1;
        assert!(s.apply(&create(raid5, voting)).is_err());
        let Ok(Response::Id(id)) = s.apply(&create(raid5, good)) else {
            panic!("the raid5 volume was refused");
        };
        let v = s.volumes[&id].clone();
        assert_eq!(v.stripe, Some(StripeGeometry::RAID5_NARROW));
        assert_eq!(v.stripe_components().count(), 3);
        assert_eq!(v.total_votes(), 3);
        growth_of_an_erasure_coded_volume(s.clone(), id);
        // A column moves only one for one, to a node without another
        // column.
        let old = v.stripe_components().nth(1).unwrap().clone();
        let begin =
            |add: Vec<PlannedComponent>, remove: Vec<ComponentId>, policy: Option<Policy>| {
                Command::BeginReconfig {
                    volume: id,
                    generation: 0,
                    add,
                    remove,
                    policy,
                    reason: String::new(),
                    wanted: None,
                }
            };
        let d4 = add_node(&mut s, 4);
        let before = s.clone();
        let on4 = |position: u8| PlannedComponent {
            role: ComponentRole::Stripe { position },
            node: 4,
            device: d4,
            votes: 0,
        };
        for (cmd, want) in [
            (begin(vec![], vec![old.id], None), "one for one"),
            (begin(vec![on4(1)], vec![], None), "one for one"),
            (begin(vec![on4(2)], vec![old.id], None), "one for one"),
            (begin(vec![column(1, 0)], vec![old.id], None), "one for one"),
            (
                begin(vec![], vec![], Some(Policy::default())),
                "every stripe component dropped",
            ),
            (
                begin(vec![], vec![old.id], Some(Policy::default())),
                "every stripe component dropped",
            ),
        ] {
            let e = s.apply(&cmd).unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        assert_eq!(s, before);
        s.apply(&begin(vec![on4(1)], vec![old.id], None)).unwrap();
        let r = s.volumes[&id].reconfig.clone().unwrap();
        assert_eq!(r.remove, vec![old.id]);
        // Lowered to raid1 ftt=1: every column dropped, nothing added;
        // the commit leaves a RAID-1 volume of the performance leg.
        let mut s = before;
        let columns: Vec<ComponentId> = v.stripe_components().map(|c| c.id).collect();
        let lower = begin(vec![], columns.clone(), Some(Policy::default()));
        s.apply(&lower).unwrap();
        s.apply(&Command::CommitReconfig {
            volume: id,
            generation: 0,
            added: vec![],
            remove: columns,
        })
        .unwrap();
        let after = &s.volumes[&id];
        assert_eq!((after.stripe, after.policy), (None, Policy::default()));
        assert_eq!(after.stripe_components().count(), 0);
        assert_eq!(after.total_votes(), 3);
    }

    #[test]
    fn create_reserves_and_delete_releases() {
        let (mut s, devs) = cluster();
        let id = create(&mut s, &devs, "vol", "raid1 ftt=1 reserve=50");
        let v = &s.volumes[&id];
        assert_eq!(v.generation, 0);
        assert_eq!(v.owner, None);
        assert!(v
            .components
            .iter()
            .all(|c| c.state == ComponentState::Active));
        assert_eq!(s.devices[&devs[0]].reserved, 1 << 19);
        assert_eq!(s.devices[&devs[1]].reserved, 1 << 19);
        assert_eq!(s.devices[&devs[2]].reserved, 0, "witness reserves nothing");

        let before = s.clone();
        let err = s
            .apply(&Command::CreateVolume {
                name: "vol".into(),
                size: 4096,
                policy: Policy::default(),
                wrapped_key: None,
                components: planned(&devs),
            })
            .unwrap_err();
        assert_eq!(err, StateError::NameTaken("vol".into()));
        assert_eq!(err.to_string(), "a volume named \"vol\" already exists");
        assert_eq!(s, before);

        s.apply(&Command::ResizeVolume {
            name: "vol".into(),
            size: 2 << 20,
        })
        .unwrap();
        assert_eq!(s.devices[&devs[0]].reserved, 1 << 20);
        assert!(matches!(
            s.apply(&Command::ResizeVolume {
                name: "vol".into(),
                size: 4096
            }),
            Err(StateError::Shrink { .. })
        ));

        s.apply(&Command::SetIopsLimit {
            name: "vol".into(),
            iops_limit: 500,
        })
        .unwrap();
        assert_eq!(s.volume_by_name("vol").unwrap().policy.iops_limit, 500);
        assert!(matches!(
            s.apply(&Command::SetIopsLimit {
                name: "nope".into(),
                iops_limit: 1
            }),
            Err(StateError::NoSuchVolume(_))
        ));

        s.apply(&Command::DeleteVolume { name: "vol".into() })
            .unwrap();
        assert!(s.devices.values().all(|d| d.reserved == 0));
        assert_eq!(
            s.apply(&Command::DeleteVolume { name: "vol".into() }),
            Err(StateError::NoSuchVolume("vol".into()))
        );
        // Ids are never reused.
        let id2 = create(&mut s, &devs, "vol", "ftt=1");
        assert!(id2 > id);
    }

    /// A RAID-1 volume larger than an erasure-coded one may be is refused
    /// a change towards RAID-5/6 at its first step (here a raise; a
    /// change through raid1 ftt=2 names it as wanted), a RAID-1 change
    /// is not.
    #[test]
    fn a_volume_too_large_for_erasure_coding_is_refused_its_first_step() {
        let (mut s, devs) = cluster();
        let size = shoal_model::MAX_ERASURE_VOLUME_SIZE + 4096;
        let Ok(Response::Id(id)) = s.apply(&Command::CreateVolume {
            name: "huge".into(),
            size,
            policy: "raid1 ftt=1".parse().unwrap(),
            wrapped_key: None,
            components: planned(&devs),
        }) else {
            panic!("a thin RAID-1 volume of {size} bytes was refused");
        };
        let e = s
            .apply(&Command::CreateVolume {
                name: "huge5".into(),
                size,
                policy: "raid5".parse().unwrap(),
                wrapped_key: None,
                components: planned(&devs),
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("erasure-coded volume of"), "{e}");
        let step = |policy: &str, wanted: Option<&str>| Command::BeginReconfig {
            volume: id,
            generation: 0,
            add: vec![],
            remove: vec![],
            policy: Some(policy.parse().unwrap()),
            reason: String::new(),
            wanted: wanted.map(|w| w.parse().unwrap()),
        };
        let before = s.clone();
        for cmd in [
            step("raid5", None),
            step("raid1 ftt=1 iops=5", Some("raid6")),
        ] {
            let e = s.apply(&cmd).unwrap_err().to_string();
            assert!(e.contains("erasure-coded volume of"), "{e}");
            assert_eq!(s, before);
        }
        s.apply(&step("raid1 ftt=1 iops=5", None)).unwrap();
    }

    #[test]
    fn reservations_must_fit_the_free_space() {
        let (mut s, devs) = cluster();
        let cap = s.devices[&devs[0]].capacity;
        // Thin volumes may overcommit; reserved ones may not.
        let before = s.clone();
        let err = s
            .apply(&Command::CreateVolume {
                name: "big".into(),
                size: cap + (1 << 20),
                policy: "raid1 ftt=1 reserve=100".parse().unwrap(),
                wrapped_key: None,
                components: planned(&devs),
            })
            .unwrap_err();
        assert!(matches!(err, StateError::NoSpace { .. }), "{err:?}");
        assert_eq!(s, before);
        s.apply(&Command::CreateVolume {
            name: "thin".into(),
            size: cap + (1 << 20),
            policy: "raid1 ftt=1".parse().unwrap(),
            wrapped_key: None,
            components: planned(&devs),
        })
        .unwrap();
        // Two reservations of 60% each, as if placed from one snapshot:
        // the second is refused.
        let size = cap / 10 * 6 / 4096 * 4096;
        s.apply(&Command::CreateVolume {
            name: "r1".into(),
            size,
            policy: "raid1 ftt=1 reserve=100".parse().unwrap(),
            wrapped_key: None,
            components: planned(&devs),
        })
        .unwrap();
        let before = s.clone();
        let err = s
            .apply(&Command::CreateVolume {
                name: "r2".into(),
                size,
                policy: "raid1 ftt=1 reserve=100".parse().unwrap(),
                wrapped_key: None,
                components: planned(&devs),
            })
            .unwrap_err();
        assert!(matches!(err, StateError::NoSpace { .. }), "{err:?}");
        assert_eq!(s, before);
        // Nor can a reserved volume grow past the free space, while data
        // written meanwhile counts against it.
        let err = s
            .apply(&Command::ResizeVolume {
                name: "r1".into(),
                size: cap + (1 << 20),
            })
            .unwrap_err();
        assert!(matches!(err, StateError::NoSpace { .. }), "{err:?}");
        s.apply(&Command::ResizeVolume {
            name: "r1".into(),
            size: size + (1 << 20),
        })
        .unwrap();
        s.apply(&Command::ReportDeviceUsage {
            device: devs[0],
            used: cap - size - (1 << 20),
            state: DeviceState::Healthy,
        })
        .unwrap();
        let err = s
            .apply(&Command::ResizeVolume {
                name: "r1".into(),
                size: size + (2 << 20),
            })
            .unwrap_err();
        assert!(
            matches!(err, StateError::NoSpace { device, .. } if device == devs[0]),
            "{err:?}"
        );
    }

    #[test]
    fn create_validates_input() {
        let (mut s, devs) = cluster();
        let before = s.clone();
        let mk = |name: &str, size: u64, comps: Vec<PlannedComponent>| Command::CreateVolume {
            name: name.into(),
            size,
            policy: Policy::default(),
            wrapped_key: None,
            components: comps,
        };
        assert!(matches!(
            s.apply(&mk("a/b", 4096, planned(&devs))),
            Err(StateError::Input(_))
        ));
        assert!(matches!(
            s.apply(&mk("a", 4097, planned(&devs))),
            Err(StateError::Input(_))
        ));
        assert!(matches!(
            s.apply(&mk("a", 4096, vec![])),
            Err(StateError::Input(_))
        ));
        let mut bad = planned(&devs);
        bad[1].node = 1; // device of node 2 stated on node 1
        assert!(matches!(
            s.apply(&mk("a", 4096, bad)),
            Err(StateError::DeviceNotOnNode { .. })
        ));
        let mut bad = planned(&devs);
        bad[0].device = 999;
        assert_eq!(
            s.apply(&mk("a", 4096, bad)),
            Err(StateError::NoSuchDevice(999))
        );
        assert_eq!(s, before);
    }

    #[test]
    fn claim_owner_is_compare_and_set() {
        let (mut s, devs) = cluster();
        let id = create(&mut s, &devs, "vol", "ftt=1");
        let claim = |node, g| Command::ClaimOwner {
            volume: id,
            node,
            expected_generation: g,
        };
        let claimed = |generation| Response::Claimed {
            generation,
            previous_owner_gone: false,
        };
        assert_eq!(s.apply(&claim(1, 0)), Ok(claimed(1)));
        assert_eq!(
            s.apply(&claim(2, 0)),
            Err(StateError::GenerationConflict {
                current: 1,
                owner: Some(1)
            })
        );
        assert_eq!(s.apply(&claim(2, 1)), Ok(claimed(2)));
        assert_eq!(s.volumes[&id].owner, Some(2));

        // Only the current generation may set component states.
        let comp = s.volumes[&id].components[0].id;
        let set = |g| Command::SetComponentState {
            volume: id,
            component: comp,
            state: ComponentState::Resyncing,
            generation: g,
        };
        assert!(matches!(
            s.apply(&set(1)),
            Err(StateError::GenerationConflict { .. })
        ));
        assert_eq!(s.apply(&set(2)), Ok(Response::Ok));
        assert_eq!(
            s.volumes[&id].components[0].state,
            ComponentState::Resyncing
        );

        assert!(s
            .apply(&Command::ReleaseOwner {
                volume: id,
                generation: 1
            })
            .is_err());
        s.apply(&Command::ReleaseOwner {
            volume: id,
            generation: 2,
        })
        .unwrap();
        assert_eq!(s.volumes[&id].owner, None);
        assert_eq!(s.volumes[&id].generation, 2);
    }

    #[test]
    fn node_down_leaves_component_states_to_the_owner() {
        let (mut s, devs) = cluster();
        let id = create(&mut s, &devs, "vol", "ftt=1");
        s.apply(&Command::SetNodeState {
            node: 1,
            state: NodeState::Down,
        })
        .unwrap();
        let v = &s.volumes[&id];
        assert!(v
            .components
            .iter()
            .all(|c| c.state == ComponentState::Active));
        assert_eq!(s.nodes[&1].state, NodeState::Down);
        // Health sees the node down all the same.
        assert_ne!(v.health(&s.nodes), shoal_model::VolumeHealth::Healthy);
    }

    #[test]
    fn repair_delay_defaults_to_an_hour_and_is_set_in_range() {
        let mut s = ClusterState::default();
        assert_eq!(s.settings.repair_delay_s, 3600);
        let set = |v| Command::SetRepairDelay { repair_delay_s: v };
        assert_eq!(s.apply(&set(30)), Ok(Response::Ok));
        assert_eq!(s.settings.repair_delay_s, 30);
        for v in [MIN_REPAIR_DELAY_S, MAX_REPAIR_DELAY_S] {
            assert_eq!(s.apply(&set(v)), Ok(Response::Ok));
            assert_eq!(s.settings.repair_delay_s, v);
        }
    }

    #[test]
    fn repair_delay_out_of_range_is_refused_and_changes_nothing() {
        let mut s = ClusterState::default();
        s.apply(&Command::SetRepairDelay { repair_delay_s: 30 })
            .unwrap();
        let before = s.clone();
        for v in [0, MAX_REPAIR_DELAY_S + 1, u64::MAX] {
            let err = s
                .apply(&Command::SetRepairDelay { repair_delay_s: v })
                .unwrap_err();
            assert_eq!(err, StateError::RepairDelayOutOfRange(v));
            assert!(err.to_string().contains("out of range"), "{err}");
            assert_eq!(s, before);
        }
    }

    #[test]
    fn resync_limit_is_set_up_to_its_maximum_and_zero_means_none() {
        let mut s = ClusterState::default();
        assert_eq!(s.settings.resync_mib_per_s, 0);
        let set = |v| Command::SetResyncLimit {
            resync_mib_per_s: v,
        };
        for v in [50, MAX_RESYNC_MIB_PER_S, 0] {
            assert_eq!(s.apply(&set(v)), Ok(Response::Ok));
            assert_eq!(s.settings.resync_mib_per_s, v);
        }
        s.apply(&set(50)).unwrap();
        let before = s.clone();
        for v in [MAX_RESYNC_MIB_PER_S + 1, u64::MAX] {
            let err = s.apply(&set(v)).unwrap_err();
            assert_eq!(err, StateError::ResyncLimitOutOfRange(v));
            assert!(err.to_string().contains("out of range"), "{err}");
            assert_eq!(s, before);
        }
    }

    /// A snapshot written before the settings existed still loads, with
    /// the default settings.
    #[test]
    fn a_state_without_settings_reads_with_the_defaults() {
        let old = r#"{"cluster_id":"c1","nodes":{},"devices":{},"volumes":{},"next_id":7}"#;
        let s: ClusterState = serde_json::from_str(old).unwrap();
        assert_eq!(s.cluster_id, "c1");
        assert_eq!(s.next_id, 7);
        assert_eq!(s.settings, ClusterSettings::default());
        assert_eq!(s.settings.repair_delay_s, 3600);
    }

    // ---- property tests ----

    fn arb_command() -> impl Strategy<Value = Command> {
        let names = prop::sample::select(vec!["a", "b", "c", "bad/name"]);
        let sizes = prop::sample::select(vec![0u64, 4096, 4097, 8192, 1 << 20, u64::MAX - 4095]);
        let states = prop::sample::select(vec![
            ComponentState::Active,
            ComponentState::Absent,
            ComponentState::Degraded,
            ComponentState::Resyncing,
        ]);
        // Mostly the device that `setup` registered on the node.
        let planned = (
            prop::bool::ANY,
            1u64..5,
            prop::option::weighted(0.2, 1u64..12),
            1u32..3,
        )
            .prop_map(|(data, node, device, votes)| PlannedComponent {
                role: if data {
                    ComponentRole::Data
                } else {
                    ComponentRole::Witness
                },
                node,
                device: device.unwrap_or(node),
                votes,
            });
        prop_oneof![
            (1u64..5).prop_map(|id| Command::RegisterNode { node: node(id) }),
            (1u64..5, prop::bool::ANY).prop_map(|(n, up)| Command::SetNodeState {
                node: n,
                state: if up { NodeState::Up } else { NodeState::Down }
            }),
            (
                1u64..5,
                prop::sample::select(vec!["/a", "/b"]),
                0u64..1 << 40
            )
                .prop_map(|(n, p, c)| Command::RegisterDevice {
                    node: n,
                    path: p.into(),
                    capacity: c,
                    store_uuid: 0,
                }),
            (1u64..12, 0u64..1 << 30).prop_map(|(d, u)| Command::ReportDeviceUsage {
                device: d,
                used: u,
                state: DeviceState::Healthy
            }),
            (
                1u64..20,
                0u64..4,
                prop::collection::vec(planned.clone(), 0..3),
                prop::collection::vec(1u64..20, 0..2),
                prop::option::of(0u8..=100),
            )
                .prop_map(|(v, g, add, remove, reserve)| Command::BeginReconfig {
                    volume: v,
                    generation: g,
                    add,
                    remove,
                    policy: reserve.map(|r| Policy {
                        reserve_pct: r,
                        ..Policy::default()
                    }),
                    reason: "test".into(),
                    wanted: None,
                }),
            (1u64..20, 0u64..4).prop_map(|(v, g)| Command::CommitReconfig {
                volume: v,
                generation: g,
                added: vec![],
                remove: vec![],
            }),
            (1u64..20, 0u64..4).prop_map(|(v, g)| Command::AbortReconfig {
                volume: v,
                generation: g,
                added: vec![],
                remove: vec![],
            }),
            (
                names.clone(),
                sizes.clone(),
                0u8..=100,
                prop::collection::vec(planned, 0..4)
            )
                .prop_map(|(n, size, r, comps)| Command::CreateVolume {
                    name: n.into(),
                    size,
                    policy: Policy {
                        reserve_pct: r,
                        ..Policy::default()
                    },
                    wrapped_key: None,
                    components: comps
                }),
            names
                .clone()
                .prop_map(|n| Command::DeleteVolume { name: n.into() }),
            (names.clone(), sizes).prop_map(|(n, size)| Command::ResizeVolume {
                name: n.into(),
                size
            }),
            (names, 0u32..1000).prop_map(|(n, iops)| Command::SetIopsLimit {
                name: n.into(),
                iops_limit: iops
            }),
            (1u64..20, 1u64..5, 0u64..4).prop_map(|(v, n, g)| Command::ClaimOwner {
                volume: v,
                node: n,
                expected_generation: g
            }),
            (1u64..20, 0u64..4).prop_map(|(v, g)| Command::ReleaseOwner {
                volume: v,
                generation: g
            }),
            (1u64..20, 1u64..30, states, 0u64..4).prop_map(|(v, c, st, g)| {
                Command::SetComponentState {
                    volume: v,
                    component: c,
                    state: st,
                    generation: g,
                }
            }),
            // In range, at its bounds and out of range on both sides.
            prop_oneof![
                Just(0u64),
                Just(MIN_REPAIR_DELAY_S),
                MIN_REPAIR_DELAY_S..=MAX_REPAIR_DELAY_S,
                Just(MAX_REPAIR_DELAY_S),
                MAX_REPAIR_DELAY_S + 1..=u64::MAX,
            ]
            .prop_map(|v| Command::SetRepairDelay { repair_delay_s: v }),
            prop_oneof![
                Just(0u64),
                0..=MAX_RESYNC_MIB_PER_S,
                Just(MAX_RESYNC_MIB_PER_S),
                MAX_RESYNC_MIB_PER_S + 1..=u64::MAX,
            ]
            .prop_map(|v| Command::SetResyncLimit {
                resync_mib_per_s: v
            }),
            (1u64..6, prop::sample::select(MaintenanceMode::ALL.to_vec()))
                .prop_map(|(node, mode)| Command::EnterMaintenance { node, mode }),
            (1u64..6).prop_map(|node| Command::ExitMaintenance { node }),
            (1u64..6).prop_map(|node| Command::RemoveNode { node }),
            (1u64..12).prop_map(|device| Command::RetireDevice { device }),
            (1u64..12).prop_map(|device| Command::UnregisterDevice { device }),
            (1u64..12).prop_map(|device| Command::KeepDevice { device }),
            (1u64..20).prop_map(|volume| Command::KeepPolicy { volume }),
        ]
    }

    fn check_invariants(s: &ClusterState) {
        // Unique names.
        let names: BTreeSet<_> = s.volumes.values().map(|v| v.name.as_str()).collect();
        assert_eq!(names.len(), s.volumes.len());
        // Ids distinct across volumes, components and devices, below next_id.
        let mut ids = BTreeSet::new();
        for (k, v) in &s.volumes {
            assert_eq!(*k, v.id);
            assert!(ids.insert(v.id));
            for c in &v.components {
                assert!(ids.insert(c.id));
            }
        }
        for (k, d) in &s.devices {
            assert_eq!(*k, d.id);
            assert!(ids.insert(d.id));
        }
        if let Some(max) = ids.last() {
            assert!(*max < s.next_id);
        }
        // Reservations are the sum over data components.
        let mut want: BTreeMap<DeviceId, u64> = BTreeMap::new();
        for v in s.volumes.values() {
            for c in v.data_components() {
                *want.entry(c.device).or_default() += crate::reconfig::reserved_for(v, c);
            }
            // A change in progress names components of the volume only.
            if let Some(r) = &v.reconfig {
                for id in r.added.iter().chain(&r.remove) {
                    assert!(
                        v.components.iter().any(|c| c.id == *id),
                        "{id} not in {v:?}"
                    );
                }
                assert!(r.added.iter().all(|a| !r.remove.contains(a)));
            }
            // A wanted policy is one the volume does not have yet, but
            // during a restripe (a step away from it and back).
            if v.reconfig.as_ref().is_none_or(|r| r.policy.is_none()) {
                assert_ne!(v.wanted_policy, Some(v.policy), "{v:?}");
            }
        }
        for d in s.devices.values() {
            assert_eq!(d.reserved, want.get(&d.id).copied().unwrap_or(0));
        }
        // Maintenance is of known nodes, and their devices (only theirs)
        // are marked; every device and component is on a known node.
        assert!(s.maintenance.keys().all(|n| s.nodes.contains_key(n)));
        for d in s.devices.values() {
            assert!(s.nodes.contains_key(&d.node), "device {} orphaned", d.id);
            assert_eq!(d.maintenance, s.maintenance.contains_key(&d.node));
        }
        for v in s.volumes.values() {
            assert!(v.components.iter().all(|c| s.nodes.contains_key(&c.node)));
            // And on a registered device (a device leaves empty).
            assert!(v
                .components
                .iter()
                .all(|c| s.devices.contains_key(&c.device)));
        }
        // A node with devices keeps one that is not being removed.
        for d in s.devices.values() {
            assert!(
                s.devices.values().any(|o| o.node == d.node && !o.retiring),
                "node {} has only retiring devices",
                d.node
            );
        }
        // The settings stay in range.
        let delay = s.settings.repair_delay_s;
        assert!((MIN_REPAIR_DELAY_S..=MAX_REPAIR_DELAY_S).contains(&delay));
        assert!(s.settings.resync_mib_per_s <= MAX_RESYNC_MIB_PER_S);
    }

    proptest! {
        #[test]
        fn random_commands_keep_invariants(cmds in prop::collection::vec(arb_command(), 1..80)) {
            let mut s = ClusterState::default();
            // Nodes 1..=4 with device i on node i, so that creates succeed.
            for n in 1..=4 {
                s.apply(&Command::RegisterNode { node: node(n) }).unwrap();
                s.apply(&Command::RegisterDevice { node: n, path: "/a".into(), capacity: 1 << 40, store_uuid: 0 }).unwrap();
            }
            prop_assert_eq!(s.devices.keys().copied().collect::<Vec<_>>(), vec![1, 2, 3, 4]);
            let mut seen_volume_ids = BTreeSet::new();
            let mut generations: BTreeMap<VolumeId, Generation> = BTreeMap::new();
            for cmd in &cmds {
                let before = s.clone();
                let res = s.apply(cmd);
                match &res {
                    Err(_) => prop_assert_eq!(&s, &before, "rejected {:?} changed the state", cmd),
                    Ok(Response::Id(id)) => {
                        if let Command::CreateVolume { .. } = cmd {
                            prop_assert!(seen_volume_ids.insert(*id), "volume id {} reused", id);
                        }
                    }
                    Ok(_) => {}
                }
                for v in s.volumes.values() {
                    let g = generations.entry(v.id).or_insert(v.generation);
                    prop_assert!(v.generation >= *g, "generation went back");
                    *g = v.generation;
                }
                check_invariants(&s);
            }
        }
    }
}
