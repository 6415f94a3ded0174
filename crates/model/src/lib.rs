//! # shoal-model: the vocabulary of a Shoal cluster
//!
//! Plain data types shared by every layer: nodes, devices, volumes, storage
//! policies, components and their states, and the rules that are pure
//! functions of them (votes and accessibility, policy parsing).
//!
//! Owns: type definitions and pure rules. Must never touch: I/O, the network,
//! the clock, Raft. Every other crate depends on this one; it depends on none.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

mod auth;
mod policy;
pub use auth::{ApiToken, CaRecord, JoinTokenText, Role, TokenError, TokenText};
pub use policy::{Layout, Policy, PolicyError, StripeGeometry};

/// The unit of addressing, checksumming and allocation of a volume, in bytes.
/// Requests not aligned to it are served by read-modify-write at the owner.
pub const BLOCK_SIZE: u64 = 4096;

/// A node (host) of the cluster. Also its Raft node id.
pub type NodeId = u64;
/// A device (one file or block device) owned by a node; unique in the cluster.
pub type DeviceId = u64;
/// A volume; unique in the cluster, never reused.
pub type VolumeId = u64;
/// A component of a volume; unique in the cluster, never reused.
pub type ComponentId = u64;
/// An owner generation. A replica refuses I/O carrying a smaller one.
pub type Generation = u64;

/// Liveness of a node as decided by the directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeState {
    /// Heartbeats arrive.
    Up,
    /// No heartbeat for longer than the down timeout.
    Down,
}

impl fmt::Display for NodeState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NodeState::Up => "up",
            NodeState::Down => "down",
        })
    }
}

/// A host of the cluster and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: NodeId,
    /// Fault domain; a host is its own (named `node-<id>`) unless told otherwise.
    pub fault_domain: String,
    /// Peer RPC address (data path between nodes), `ip:port`.
    pub peer_addr: String,
    /// HTTP API address (REST, metrics, Raft traffic), `ip:port`.
    pub api_addr: String,
    /// NBD address served to clients, `ip:port`.
    pub nbd_addr: String,
    pub state: NodeState,
}

/// How a node in maintenance is emptied before it is taken down (vSAN's
/// three modes; `docs/reconfiguration.md`, Maintenance mode). In every
/// mode placement puts no new component on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MaintenanceMode {
    /// Moves only what the volumes need to stay accessible without the
    /// node: the components without which a volume would lack a majority
    /// of its votes or an in-sync data copy (an `ftt=0` volume's copy).
    EnsureAccessibility,
    /// Moves every component off the node (before removing it for good).
    FullDataMigration,
    /// Moves nothing; refused while a volume would be inaccessible
    /// without the node.
    NoDataMigration,
}

impl MaintenanceMode {
    /// Every mode, in the order people read them.
    pub const ALL: [MaintenanceMode; 3] = [
        MaintenanceMode::EnsureAccessibility,
        MaintenanceMode::FullDataMigration,
        MaintenanceMode::NoDataMigration,
    ];
}

impl fmt::Display for MaintenanceMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MaintenanceMode::EnsureAccessibility => "ensure-accessibility",
            MaintenanceMode::FullDataMigration => "full-data-migration",
            MaintenanceMode::NoDataMigration => "no-data-migration",
        })
    }
}

impl std::str::FromStr for MaintenanceMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        MaintenanceMode::ALL
            .into_iter()
            .find(|m| m.to_string() == s)
            .ok_or_else(|| {
                format!(
                    "unknown maintenance mode {s:?}: expected ensure-accessibility, \
                     full-data-migration or no-data-migration"
                )
            })
    }
}

/// Health of a device as last reported by its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceState {
    Healthy,
    /// No free space left for new allocations.
    Full,
    /// I/O errors: its components are degraded.
    Failed,
}

/// A device of a node: a file or block device holding components.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub id: DeviceId,
    pub node: NodeId,
    pub path: String,
    /// Usable bytes for component data.
    pub capacity: u64,
    /// Bytes allocated to component data, as last reported.
    pub used: u64,
    /// Bytes promised to components of reserved (thick) volumes and not yet
    /// written; counted against free space by placement.
    pub reserved: u64,
    pub state: DeviceState,
    /// Logical bytes of the data components placed on this device (thin
    /// volumes included): what it would hold if every volume were full.
    /// Placement balances on it, so that new thin volumes spread out
    /// before any data is written.
    #[serde(default)]
    pub provisioned: u64,
    /// Its node is in maintenance (the directory's `maintenance` map):
    /// placement puts no new component here.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub maintenance: bool,
    /// Being removed (`shoal device remove`): placement puts nothing new
    /// here, its components move off it, and its node then closes it and
    /// unregisters it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retiring: bool,
    /// The uuid in its store's superblock, by which its node registers it
    /// again wherever its path moves; 0 for a device registered before
    /// it was recorded.
    #[serde(default)]
    pub store_uuid: u64,
}

impl DeviceInfo {
    /// Whether placement may put a new component here: healthy, its node
    /// not in maintenance, not being removed.
    pub fn accepts_components(&self) -> bool {
        self.state == DeviceState::Healthy && !self.maintenance && !self.retiring
    }

    /// Space left if every volume on the device filled up (negative when
    /// thin volumes overcommit it): the placement balance key.
    pub fn headroom(&self) -> i128 {
        self.capacity as i128
            - (self.used.saturating_add(self.reserved)).max(self.provisioned) as i128
    }

    /// Bytes placement may still promise on this device.
    pub fn free(&self) -> u64 {
        self.capacity
            .saturating_sub(self.used)
            .saturating_sub(self.reserved)
    }
}

/// What a component holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ComponentRole {
    /// A full copy of the volume's data (RAID-1 leg).
    Data,
    /// No data, only a vote: breaks ties so that a partition can never serve
    /// the volume on two sides.
    Witness,
    /// One column of an erasure-coded volume's capacity leg
    /// (`docs/erasure-coding.md`): `position` among the stripe's `k + m`
    /// columns, which with the slot decides whether it holds a data or a
    /// parity unit there. Carries no vote.
    Stripe { position: u8 },
}

impl ComponentRole {
    /// Which leg the component belongs to, 0 the copies and witnesses
    /// (RAID-1, or an erasure-coded volume's performance leg), 1 the
    /// stripe columns: a device holds at most one component of a volume
    /// per leg.
    pub fn device_leg(self) -> u8 {
        match self {
            ComponentRole::Stripe { .. } => 1,
            _ => 0,
        }
    }
}

impl fmt::Display for ComponentRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ComponentRole::Data => f.write_str("data"),
            ComponentRole::Witness => f.write_str("witness"),
            ComponentRole::Stripe { position } => write!(f, "stripe {position}"),
        }
    }
}

/// State of one component, as in vSAN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ComponentState {
    /// Up to date and serving.
    Active,
    /// Its host is unreachable; writes go on without it and are tracked.
    Absent,
    /// Its device failed; it must be rebuilt elsewhere.
    Degraded,
    /// Being brought up to date; receives writes but serves no reads.
    Resyncing,
    /// Added by a reconfiguration in progress ([`Reconfig`]): receives
    /// every write and is copied to from the in-sync copies; part of the
    /// new layout only, until the change is committed.
    Reconfiguring,
}

impl fmt::Display for ComponentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComponentState::Active => "active",
            ComponentState::Absent => "absent",
            ComponentState::Degraded => "degraded",
            ComponentState::Resyncing => "resyncing",
            ComponentState::Reconfiguring => "reconfiguring",
        })
    }
}

/// One placed piece of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Component {
    pub id: ComponentId,
    pub role: ComponentRole,
    pub node: NodeId,
    pub device: DeviceId,
    pub state: ComponentState,
    pub votes: u32,
}

/// A virtual disk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub id: VolumeId,
    pub name: String,
    /// Size in bytes, a multiple of [`BLOCK_SIZE`].
    pub size: u64,
    pub policy: Policy,
    pub components: Vec<Component>,
    /// The node coordinating I/O, if any.
    pub owner: Option<NodeId>,
    /// Raised each time ownership is claimed; fences older owners.
    pub generation: Generation,
    /// Why the volume cannot be served, as the last node that claimed it
    /// found (its copies refused activation); cleared when an owner starts.
    /// While set, the volume is inaccessible whatever its components say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The data key of an encrypted volume (`encrypt=on`), wrapped by the
    /// cluster key (text form of `shoal_crypt::WrappedKey`); the cluster
    /// key itself is never in the directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrapped_key: Option<String>,
    /// A change of layout in progress: components added (state
    /// [`ComponentState::Reconfiguring`]) and components to drop when it
    /// is committed. While it lasts the volume has two layouts, and the
    /// votes rule must hold in both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconfig: Option<Reconfig>,
    /// The stripe geometry of an erasure-coded volume's capacity leg,
    /// chosen when it was placed (None: RAID-1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stripe: Option<StripeGeometry>,
    /// The policy `set-policy` asked for, while the volume does not have
    /// it yet: a change to it that ended aborted (an added copy's node
    /// died) is begun again by the volume's caretaker. Cleared when a
    /// change commits it, or when `set-policy` asks for the policy the
    /// volume has. The volume's own policy only during a restripe (its
    /// first step, the lowering to RAID-1, in progress); otherwise never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wanted_policy: Option<Policy>,
    /// An erasure-coded volume's growth in progress: the size it grows
    /// to. `size` stays the old one (what clients see) until the owner has
    /// moved the map log past the new end and commits it
    /// (`docs/erasure-coding.md`, Growing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grow_to: Option<u64>,
    /// Where an erasure-coded volume's map log begins on its performance
    /// leg, in bytes, when not at the volume's end: a growth moves the log
    /// past both the new end and the old log, so that the old log stays
    /// whole until the new one holds a checkpoint. None: at `size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub map_log_at: Option<u64>,
}

impl Volume {
    /// The size its devices hold room for: the size it grows to during a
    /// growth, else its size.
    pub fn provisioned_size(&self) -> u64 {
        self.grow_to.map_or(self.size, |to| to.max(self.size))
    }
}

/// A reconfiguration in progress (the one primitive behind rebuilds,
/// evacuations and policy changes; `docs/reconfiguration.md`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reconfig {
    /// Why, for people: "rebuild of component 7", "policy raid1 ftt=2".
    pub reason: String,
    /// Components added by the change (in the new layout only until it is
    /// committed), whatever state the owner has recorded them in since.
    pub added: Vec<ComponentId>,
    /// Components that leave the layout when the change is committed.
    pub remove: Vec<ComponentId>,
    /// The volume's policy once committed (None: unchanged).
    pub policy: Option<Policy>,
}

/// Longest reason a volume's `problem` keeps, in bytes.
pub const MAX_PROBLEM_BYTES: usize = 512;

/// The repair delay unless set otherwise, in seconds: an hour, as vSAN's
/// object repair timer, long enough for a host's reboot or an upgrade.
pub const DEFAULT_REPAIR_DELAY_S: u64 = 3600;
/// Shortest repair delay, in seconds: 0 would be no delay at all (a copy
/// rebuilt the moment it goes absent, even on a host that merely
/// restarts); a few seconds are for tests.
pub const MIN_REPAIR_DELAY_S: u64 = 1;
/// Longest repair delay, in seconds (a week): a host away longer is a
/// forgotten host, not a repair delay, and its volumes run with a copy
/// less all that time.
pub const MAX_REPAIR_DELAY_S: u64 = 7 * 24 * 3600;

/// Cluster-wide settings, kept in the directory (Raft-replicated) and
/// changed with `shoal cluster set`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterSettings {
    /// Seconds a component whose host is unreachable (state
    /// [`ComponentState::Absent`]) is waited for before its data is
    /// rebuilt elsewhere (vSAN's object repair timer): a host that comes
    /// back within it only resyncs what it missed, instead of a full copy
    /// being made. [`MIN_REPAIR_DELAY_S`] to [`MAX_REPAIR_DELAY_S`].
    pub repair_delay_s: u64,
    /// Static limit of the rate at which each owner copies data into a
    /// copy being resynced or rebuilt, in MiB/s; 0: no static limit (the
    /// copy runs as fast as the devices allow). Up to
    /// [`MAX_RESYNC_MIB_PER_S`].
    #[serde(default)]
    pub resync_mib_per_s: u64,
}

/// Highest static resync limit, in MiB/s (100 GiB/s): above any device
/// this cluster runs on; a typo beyond it is refused rather than taken as
/// "unlimited".
pub const MAX_RESYNC_MIB_PER_S: u64 = 100 * 1024;

impl Default for ClusterSettings {
    fn default() -> Self {
        ClusterSettings {
            repair_delay_s: DEFAULT_REPAIR_DELAY_S,
            resync_mib_per_s: 0,
        }
    }
}

/// Availability of a volume, as vSAN reports object health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumeHealth {
    /// Every component active.
    Healthy,
    /// Accessible, but some component is not active.
    ReducedAvailability,
    /// Fewer than half the votes, or no full copy, reachable.
    Inaccessible,
}

impl fmt::Display for VolumeHealth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            VolumeHealth::Healthy => "healthy",
            VolumeHealth::ReducedAvailability => "reduced-availability",
            VolumeHealth::Inaccessible => "inaccessible",
        })
    }
}

impl Volume {
    /// Data components (full copies).
    pub fn data_components(&self) -> impl Iterator<Item = &Component> {
        self.components
            .iter()
            .filter(|c| c.role == ComponentRole::Data)
    }

    /// The stripe components of the capacity leg (none for RAID-1).
    pub fn stripe_components(&self) -> impl Iterator<Item = &Component> {
        self.components
            .iter()
            .filter(|c| matches!(c.role, ComponentRole::Stripe { .. }))
    }

    /// Whether the capacity leg can be read: at least `k` of its stripe
    /// components in the layout `layout` accepts are reachable (always
    /// true for RAID-1).
    fn stripes_readable(
        &self,
        layout: &dyn Fn(&Component) -> bool,
        reachable: &dyn Fn(&Component) -> bool,
    ) -> bool {
        let Some(g) = self.stripe else {
            return true;
        };
        let have = self
            .stripe_components()
            .filter(|c| layout(c) && reachable(c))
            .count();
        have >= usize::from(g.data)
    }

    /// Total votes of the volume (of the layout before a change in
    /// progress).
    pub fn total_votes(&self) -> u32 {
        self.components
            .iter()
            .filter(|c| self.in_old_layout(c))
            .map(|c| c.votes)
            .sum()
    }

    /// Whether `c` is part of the layout before the change in progress
    /// (with none, the only layout): every component but those added.
    pub fn in_old_layout(&self, c: &Component) -> bool {
        self.reconfig
            .as_ref()
            .is_none_or(|r| !r.added.contains(&c.id))
    }

    /// Whether `c` is part of the layout after the change in progress
    /// (with none, the only layout): every component but those removed.
    pub fn in_new_layout(&self, c: &Component) -> bool {
        self.reconfig
            .as_ref()
            .is_none_or(|r| !r.remove.contains(&c.id))
    }

    /// The votes rule: a volume may serve I/O while the components that
    /// `reachable` accepts carry more than half of all votes and include at
    /// least one full, up-to-date data copy (`in_sync` decides which are);
    /// an erasure-coded volume also needs `k` of its stripe components
    /// (whose units hold what was destaged).
    ///
    /// While a reconfiguration is in progress the rule must hold in the
    /// old layout and in the new one (joint majorities, as Raft changes
    /// its membership): any majority an owner uses then intersects any
    /// majority a later owner uses, whichever layout it knows.
    pub fn quorum(
        &self,
        reachable: impl Fn(&Component) -> bool,
        in_sync: impl Fn(&Component) -> bool,
    ) -> bool {
        let majority = |layout: &dyn Fn(&Component) -> bool| {
            let (mut total, mut have) = (0u32, 0u32);
            for c in self.components.iter().filter(|c| layout(c)) {
                total += c.votes;
                if reachable(c) {
                    have += c.votes;
                }
            }
            2 * have > total
        };
        let copy = self
            .data_components()
            .any(|c| self.in_old_layout(c) && reachable(c) && in_sync(c));
        let old = majority(&|c| self.in_old_layout(c));
        let new = self.reconfig.is_none() || majority(&|c| self.in_new_layout(c));
        let stripes =
            self.stripes_readable(&|c| self.in_old_layout(c), &|c| reachable(c) && in_sync(c));
        old && new && copy && stripes
    }

    /// Health from the directory's view: a component counts as reachable
    /// when its node is up and it is not absent or degraded.
    pub fn health(&self, nodes: &BTreeMap<NodeId, NodeInfo>) -> VolumeHealth {
        let up = |c: &Component| {
            nodes.get(&c.node).map(|n| n.state) == Some(NodeState::Up)
                && matches!(
                    c.state,
                    ComponentState::Active
                        | ComponentState::Resyncing
                        | ComponentState::Reconfiguring
                )
        };
        if self.problem.is_some() || !self.quorum(up, |c| c.state == ComponentState::Active) {
            VolumeHealth::Inaccessible
        } else if self
            .components
            .iter()
            .all(|c| c.state == ComponentState::Active && up(c))
        {
            VolumeHealth::Healthy
        } else {
            VolumeHealth::ReducedAvailability
        }
    }
}

/// Errors in names and sizes given by users.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("volume size must be greater than 0")]
    ZeroSize,
    #[error("volume size {0} is not a multiple of the {BLOCK_SIZE}-byte block")]
    Unaligned(u64),
    #[error(
        "volume name {0:?} is invalid: use 1 to 64 characters from a-z, A-Z, 0-9, '-', '_', '.'"
    )]
    BadName(String),
    #[error("size {0:?} is not understood: use bytes or a suffix K, M, G, T (powers of 1024)")]
    BadSize(String),
    #[error("volume size {0} is larger than the largest volume, {MAX_VOLUME_SIZE} bytes (4 PiB less 1 MiB)")]
    TooLarge(u64),
    #[error("an erasure-coded volume of {0} bytes is larger than the largest, {MAX_ERASURE_VOLUME_SIZE} bytes (1 PiB less 256 KiB): its map log lies past its end")]
    ErasureTooLarge(u64),
    #[error("volume name {0:?} is reserved")]
    ReservedName(String),
}

/// Largest volume in bytes: just under 4 PiB (2^32 - 1 regions of 1 MiB),
/// far past any device, and small enough that block numbers and byte
/// offsets never overflow in the store, which keeps components to it.
pub const MAX_VOLUME_SIZE: u64 = (u32::MAX as u64) << 20;

/// Largest erasure-coded volume in bytes, and the farthest its map log
/// may lie (`Volume::map_log_at`) when it grows: a quarter of
/// [`MAX_VOLUME_SIZE`]. Its performance leg holds the map log past its
/// end (about 1.1% of the size more, and during a growth the old log
/// too), and no component may pass [`MAX_VOLUME_SIZE`]: a growth whose
/// new log could not be placed would never end.
pub const MAX_ERASURE_VOLUME_SIZE: u64 = MAX_VOLUME_SIZE / 4;

/// Checks the size of an erasure-coded volume (as [`check_volume_size`],
/// and at most [`MAX_ERASURE_VOLUME_SIZE`]).
pub fn check_erasure_volume_size(size: u64) -> Result<(), InputError> {
    check_volume_size(size)?;
    match size > MAX_ERASURE_VOLUME_SIZE {
        true => Err(InputError::ErasureTooLarge(size)),
        false => Ok(()),
    }
}

/// Checks a volume name: it is also the NBD export name.
pub fn check_volume_name(name: &str) -> Result<(), InputError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    // `.` and `..` would be paths, not names, wherever a name is one.
    if name == "." || name == ".." {
        return Err(InputError::ReservedName(name.to_string()));
    }
    if ok {
        Ok(())
    } else {
        Err(InputError::BadName(name.to_string()))
    }
}

/// Checks a volume size.
pub fn check_volume_size(size: u64) -> Result<(), InputError> {
    if size == 0 {
        Err(InputError::ZeroSize)
    } else if !size.is_multiple_of(BLOCK_SIZE) {
        Err(InputError::Unaligned(size))
    } else if size > MAX_VOLUME_SIZE {
        Err(InputError::TooLarge(size))
    } else {
        Ok(())
    }
}

/// Parses `4096`, `64K`, `256M`, `10G`, `1T` (also `10GiB`, `10g`).
pub fn parse_size(s: &str) -> Result<u64, InputError> {
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix("ib"))
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (num, mult) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&t[..t.len() - 1], 1 << 20),
        Some('g' | 'G') => (&t[..t.len() - 1], 1 << 30),
        Some('t' | 'T') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| InputError::BadSize(s.to_string()))?;
    n.checked_mul(mult)
        .ok_or_else(|| InputError::BadSize(s.to_string()))
}

/// Formats bytes for people: `256 MiB`, `1.5 GiB`.
pub fn human_size(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if v.fract() == 0.0 {
        format!("{} {}", v as u64, U[i])
    } else {
        format!("{:.1} {}", v, U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(states: &[(ComponentRole, ComponentState)]) -> Volume {
        Volume {
            problem: None,
            wrapped_key: None,
            reconfig: None,
            wanted_policy: None,
            grow_to: None,
            map_log_at: None,
            stripe: None,
            id: 1,
            name: "v".into(),
            size: 4096,
            policy: "raid1 ftt=1".parse().unwrap(),
            components: states
                .iter()
                .enumerate()
                .map(|(i, (r, s))| Component {
                    id: i as u64,
                    role: *r,
                    node: i as u64 + 1,
                    device: i as u64,
                    state: *s,
                    votes: 1,
                })
                .collect(),
            owner: None,
            generation: 0,
        }
    }

    #[test]
    fn quorum_needs_majority_and_a_copy() {
        use ComponentRole::*;
        use ComponentState::*;
        let v = vol(&[(Data, Active), (Data, Active), (Witness, Active)]);
        assert!(v.quorum(|_| true, |_| true));
        // One data copy plus the witness: 2 of 3 votes and a copy.
        assert!(v.quorum(|c| c.id != 1, |_| true));
        // Both data copies without the witness: still 2 of 3.
        assert!(v.quorum(|c| c.id != 2, |_| true));
        // Witness alone: no copy.
        assert!(!v.quorum(|c| c.id == 2, |_| true));
        // One data copy alone: 1 of 3 votes.
        assert!(!v.quorum(|c| c.id == 0, |_| true));
        // Majority but the reachable copy is stale.
        assert!(!v.quorum(|c| c.id != 0, |c| c.id == 0));
    }

    /// A RAID-5 volume: its votes are its performance leg's, and it also
    /// needs `k` of its stripe components.
    #[test]
    fn erasure_volumes_need_k_stripe_components_too() {
        use ComponentRole::*;
        use ComponentState::*;
        let mut v = vol(&[
            (Data, Active),
            (Data, Active),
            (Witness, Active),
            (Stripe { position: 0 }, Active),
            (Stripe { position: 1 }, Active),
            (Stripe { position: 2 }, Active),
        ]);
        for c in v.components.iter_mut().skip(3) {
            c.votes = 0;
        }
        v.stripe = Some(StripeGeometry::RAID5_NARROW);
        assert_eq!(v.total_votes(), 3);
        assert_eq!(v.stripe_components().count(), 3);
        assert!(v.quorum(|_| true, |_| true));
        // One host lost: a copy and a stripe column.
        assert!(v.quorum(|c| c.id != 0 && c.id != 3, |_| true));
        // Two stripe columns lost: 2+1 cannot read its stripes.
        assert!(!v.quorum(|c| c.id != 3 && c.id != 4, |_| true));
        // A stripe column not in sync counts as missing.
        assert!(!v.quorum(|c| c.id != 3, |c| c.id != 4));
        // Stripe columns carry no votes: the leg's majority decides.
        assert!(!v.quorum(|c| c.id != 0 && c.id != 1, |_| true));
    }

    #[test]
    fn maintenance_modes_read_back_as_written() {
        for m in MaintenanceMode::ALL {
            assert_eq!(m.to_string().parse::<MaintenanceMode>(), Ok(m));
        }
        let e = "full".parse::<MaintenanceMode>().unwrap_err();
        assert!(e.contains("full-data-migration"), "{e}");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64K").unwrap(), 65536);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert!(parse_size("x").is_err());
        assert!(parse_size("99999999999T").is_err());
        assert_eq!(check_volume_size(0), Err(InputError::ZeroSize));
        assert_eq!(check_volume_size(4097), Err(InputError::Unaligned(4097)));
        assert!(check_volume_name("demo-1").is_ok());
        assert!(check_volume_name("a/b").is_err());
        assert!(matches!(
            check_volume_name("."),
            Err(InputError::ReservedName(_))
        ));
        assert!(matches!(
            check_volume_name(".."),
            Err(InputError::ReservedName(_))
        ));
        assert!(check_volume_name("...").is_ok());
        assert!(check_volume_size(MAX_VOLUME_SIZE).is_ok());
        assert_eq!(
            check_volume_size(MAX_VOLUME_SIZE + 4096),
            Err(InputError::TooLarge(MAX_VOLUME_SIZE + 4096))
        );
        assert!(check_volume_size(u64::MAX - 4095).is_err());
        assert_eq!(human_size(256 << 20), "256 MiB");
    }
}
