//! A volume's new policy in place (`shoal volume set-policy`): which
//! components a change from the volume's layout to the one the new policy
//! asks for adds, and which it drops. Pure, like the rest of the crate;
//! the node turns the answer into one `BeginReconfig`
//! (`docs/reconfiguration.md`, Policy change).
//!
//! Rules (RAID-1 to RAID-1, another `ftt`; the other words of the policy,
//! `reserve=` and `iops=`, may change too):
//! - the new layout is what [`crate::place`] makes of the policy: `ftt + 1`
//!   data copies and `ftt` witnesses, one vote each (an odd total);
//! - going up, the data copies and witnesses missing are added on fault
//!   domains the volume does not use, data first on the domains with the
//!   most room (each copy needs the new policy's reservation on its
//!   device), witnesses on the least loaded domains left;
//! - going down, the surplus copies and witnesses are dropped, those that
//!   are not serving first (not active, on a node that is down or in
//!   maintenance, on a device that failed or is unknown), then those on
//!   the most loaded devices (least headroom); the copies kept always
//!   include an active one;
//! - a volume with a change in progress is refused: one change at a time;
//! - RAID-1 to RAID-5 or RAID-6 of the same ftt adds a capacity leg of
//!   stripe columns and keeps the RAID-1 layout as the performance leg;
//!   other changes between layouts are refused (`LayoutChange`).

use crate::{policy_name, reserved_bytes, usable, Domain, PlacementError, Planned};
use shoal_model::{
    Component, ComponentId, ComponentRole, ComponentState, DeviceInfo, NodeId, NodeInfo, NodeState,
    Policy, Volume,
};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

/// What a change of policy does to a volume's components.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyChange {
    /// Components to add (data copies first, then witnesses).
    pub add: Vec<Planned>,
    /// Components to drop, in the order they were chosen.
    pub remove: Vec<ComponentId>,
}

impl PolicyChange {
    /// Whether the change moves no component (only the policy's other
    /// words change, or nothing at all).
    pub fn moves_nothing(&self) -> bool {
        self.add.is_empty() && self.remove.is_empty()
    }
}

/// The components that take `volume` from its layout to the one `policy`
/// asks for: added ones on fault domains it does not use yet, dropped ones
/// chosen among its surplus (see the module's rules).
pub fn policy_change(
    volume: &Volume,
    policy: &Policy,
    nodes: &[NodeInfo],
    devices: &[DeviceInfo],
) -> Result<PolicyChange, PlacementError> {
    if let Some(r) = &volume.reconfig {
        return Err(PlacementError::ChangeInProgress {
            volume: volume.name.clone(),
            reason: r.reason.clone(),
        });
    }
    if volume.policy.layout == shoal_model::Layout::Raid1
        && policy.layout.is_erasure()
        && policy.ftt == volume.policy.ftt
    {
        return capacity_leg(volume, policy, nodes, devices);
    }
    if volume.policy.layout != policy.layout || volume.policy.layout.is_erasure() {
        return Err(PlacementError::LayoutChange {
            volume: volume.name.clone(),
            from: volume.policy.layout,
            to: policy.layout,
        });
    }
    let serving = Serving::new(nodes, devices);
    let mut remove = Vec::new();
    for (role, want) in [
        (ComponentRole::Data, policy.copies()),
        (ComponentRole::Witness, policy.witnesses()),
    ] {
        let mut of_role: Vec<&Component> = volume
            .components
            .iter()
            .filter(|c| c.role == role)
            .collect();
        of_role.sort_by_key(|c| serving.drop_rank(c));
        let surplus = of_role.len().saturating_sub(want);
        remove.extend(of_role.iter().take(surplus).map(|c| c.id));
    }
    let kept: Vec<&Component> = volume
        .components
        .iter()
        .filter(|c| !remove.contains(&c.id))
        .collect();
    let in_sync = kept
        .iter()
        .any(|c| c.role == ComponentRole::Data && c.state == ComponentState::Active);
    if !in_sync {
        return Err(PlacementError::NoCopyInSync {
            volume: volume.name.clone(),
        });
    }
    let count = |role| kept.iter().filter(|c| c.role == role).count();
    let add_data = policy.copies().saturating_sub(count(ComponentRole::Data));
    let add_witnesses = policy
        .witnesses()
        .saturating_sub(count(ComponentRole::Witness));
    let add = if add_data + add_witnesses == 0 {
        Vec::new()
    } else {
        let need = reserved_bytes(policy, volume.size);
        added(
            volume,
            policy,
            need,
            (add_data, add_witnesses),
            nodes,
            devices,
        )?
    };
    let votes: u32 =
        kept.iter().map(|c| c.votes).sum::<u32>() + add.iter().map(|p| p.votes).sum::<u32>();
    if votes.is_multiple_of(2) {
        return Err(PlacementError::EvenVotes {
            volume: volume.name.clone(),
            votes,
        });
    }
    Ok(PolicyChange { add, remove })
}

/// RAID-1 to RAID-5/6 of the same ftt: the RAID-1 layout is the
/// performance leg as it stands (ftt + 1 copies, ftt witnesses); the
/// change adds a capacity leg of `k + m` stripe columns on distinct
/// domains, the stripe as wide as the cluster allows
/// ([`StripeGeometry::for_layout`]).
fn capacity_leg(
    volume: &Volume,
    policy: &Policy,
    nodes: &[NodeInfo],
    devices: &[DeviceInfo],
) -> Result<PolicyChange, PlacementError> {
    let count = |role| volume.components.iter().filter(|c| c.role == role).count();
    let leg_as_policy = count(ComponentRole::Data) == policy.copies()
        && count(ComponentRole::Witness) == policy.witnesses();
    if !leg_as_policy {
        return Err(PlacementError::LayoutChange {
            volume: volume.name.clone(),
            from: volume.policy.layout,
            to: policy.layout,
        });
    }
    let domains = usable(nodes, devices);
    let g = shoal_model::StripeGeometry::for_layout(policy.layout, domains.len()).ok_or(
        PlacementError::NotEnoughFaultDomains {
            policy: policy_name(policy),
            needed: policy.fault_domains_needed(),
            have: domains.len(),
        },
    )?;
    let need = reserved_bytes(policy, volume.size).div_ceil(u64::from(g.data));
    let add = crate::fill_stripes(domains.values().collect(), g, need)?;
    Ok(PolicyChange {
        add,
        remove: Vec::new(),
    })
}

/// What the cluster says of the components' nodes and devices.
struct Serving<'a> {
    nodes: BTreeMap<NodeId, &'a NodeInfo>,
    devices: BTreeMap<u64, &'a DeviceInfo>,
}

impl<'a> Serving<'a> {
    fn new(nodes: &'a [NodeInfo], devices: &'a [DeviceInfo]) -> Serving<'a> {
        Serving {
            nodes: nodes.iter().map(|n| (n.id, n)).collect(),
            devices: devices.iter().map(|d| (d.id, d)).collect(),
        }
    }

    /// Whether `c` serves: active, its node up, its device healthy and
    /// not in maintenance.
    fn serves(&self, c: &Component) -> bool {
        c.state == ComponentState::Active
            && self
                .nodes
                .get(&c.node)
                .is_some_and(|n| n.state == NodeState::Up)
            && self
                .devices
                .get(&c.device)
                .is_some_and(|d| d.accepts_components())
    }

    /// The order components are dropped in, first first: those that do
    /// not serve, then the least headroom on their device (the most
    /// loaded), then the newest (ids count up).
    fn drop_rank(&self, c: &Component) -> (bool, i128, Reverse<ComponentId>) {
        let headroom = self
            .devices
            .get(&c.device)
            .map_or(i128::MIN, |d| d.headroom());
        (self.serves(c), headroom, Reverse(c.id))
    }
}

/// Places `data` copies and `witnesses` on fault domains `volume` does
/// not use: data where there is the most room (`need` bytes free on the
/// device), witnesses on the least loaded domains left.
fn added(
    volume: &Volume,
    policy: &Policy,
    need: u64,
    (data, witnesses): (usize, usize),
    nodes: &[NodeInfo],
    devices: &[DeviceInfo],
) -> Result<Vec<Planned>, PlacementError> {
    let domain_of = |node: NodeId| crate::domain_of(nodes, node);
    let used_domains: BTreeSet<&str> = volume
        .components
        .iter()
        .filter_map(|c| domain_of(c.node))
        .collect();
    let used_nodes: BTreeSet<NodeId> = volume.components.iter().map(|c| c.node).collect();
    let domains = usable(nodes, devices);
    let spare = |dev: &DeviceInfo, n: NodeId| {
        !used_nodes.contains(&n) && !volume.components.iter().any(|c| c.device == dev.id)
    };
    let free: Vec<&Domain> = domains
        .values()
        .filter(|d| !used_domains.contains(d.name))
        .filter(|d| d.best(spare).is_some())
        .collect();
    if free.len() < data + witnesses {
        return Err(PlacementError::NotEnoughFaultDomains {
            policy: policy_name(policy),
            needed: policy.fault_domains_needed(),
            have: used_domains.len() + free.len(),
        });
    }
    crate::fill(free, (data, witnesses), need, spare)
}

#[cfg(test)]
mod tests;
