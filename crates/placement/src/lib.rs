//! # shoal-placement: where a volume's components go
//!
//! Decides on which nodes and devices the components of a volume live, from
//! a snapshot of the cluster (nodes, devices) given by the caller. Owns no
//! state, does no I/O: every function here is a pure, deterministic function
//! of its arguments (ties are broken by name or id, never by input order).
//!
//! Rules:
//! - a RAID-1 policy with `ftt = n` gets `n + 1` data components and `n`
//!   witnesses, one vote each, all on distinct fault domains (hence also on
//!   distinct nodes);
//! - only nodes that are `Up` and devices that are `Healthy` are used, and
//!   no device of a node in maintenance (`DeviceInfo::maintenance`); a
//!   fault domain counts only if it has such a node with such a device;
//! - a data component needs a device with `free() >= size * reserve_pct /
//!   100`; thin volumes (`reserve_pct = 0`) need only some free space;
//! - data goes to the fault domains (and devices) with the most free space,
//!   witnesses to the remaining domains that are least loaded;
//! - a RAID-5/6 policy (`docs/erasure-coding.md`) places a performance leg
//!   as RAID-1 with the same `ftt` (copies and witnesses, one vote each),
//!   and a capacity leg of `k + m` stripe components (no votes) on
//!   distinct fault domains of their own, the roomiest; the two legs share
//!   domains. The stripe's width is the cluster's to choose
//!   ([`StripeGeometry::for_layout`]): 2+1 on 3 to 5 usable domains, 4+1
//!   on 6 or more, 4+2 for RAID-6.

use shoal_model::{
    human_size, ComponentId, ComponentRole, DeviceId, DeviceInfo, NodeId, NodeInfo, NodeState,
    Policy, StripeGeometry, Volume, VolumeId,
};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet};

/// Where one component is to be created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub role: ComponentRole,
    pub node: NodeId,
    pub device: DeviceId,
    pub votes: u32,
}

/// Why a volume (or a component) cannot be placed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// Fewer usable fault domains (an `Up` node with a `Healthy` device)
    /// than the policy needs.
    #[error("{policy} needs {needed} fault domains; the cluster has {have}")]
    NotEnoughFaultDomains {
        policy: String,
        needed: usize,
        have: usize,
    },
    /// No device left in enough fault domains can hold a data copy;
    /// `domain` is the roomiest domain that was still a candidate.
    #[error("{}", no_space_text(*needed, domain))]
    NoSpace { needed: u64, domain: String },
    /// `replacement` was asked about a component the volume does not have.
    #[error("volume {volume} has no component {component}")]
    NoSuchComponent {
        volume: VolumeId,
        component: ComponentId,
    },
    /// A policy change was asked of a volume already being reconfigured.
    #[error("volume {volume} is already being reconfigured ({reason}): one change at a time")]
    ChangeInProgress { volume: String, reason: String },
    /// A policy change between layouts (RAID-1 and RAID-5/6), which the
    /// owner cannot carry out yet.
    #[error("volume {volume}: a change from {from} to {to} is not available yet: only ftt changes within raid1")]
    LayoutChange {
        volume: String,
        from: shoal_model::Layout,
        to: shoal_model::Layout,
    },
    /// A policy change would keep no active data copy.
    #[error("volume {volume} would keep no active data copy")]
    NoCopyInSync { volume: String },
    /// A policy change would leave an even number of votes (components of
    /// more than one vote), which the votes rule cannot split.
    #[error("the new layout of volume {volume} would carry {votes} votes; it needs an odd number")]
    EvenVotes { volume: String, votes: u32 },
}

fn no_space_text(needed: u64, domain: &str) -> String {
    let what = if needed == 0 {
        "some free space (thin volume)".to_string()
    } else {
        format!("{} free", human_size(needed))
    };
    if domain.is_empty() {
        format!("not enough space: a data copy needs {what} on one healthy device, and no fault domain is left to try")
    } else {
        format!("not enough space: a data copy needs {what} on one healthy device, and not even fault domain {domain:?} (the roomiest left) has one")
    }
}

/// `raid1 ftt=2`: the part of a policy that decides the fault domains.
fn policy_name(policy: &Policy) -> String {
    format!("{} ftt={}", policy.layout, policy.ftt)
}

/// Bytes a data component must find free on its device (0 = thin).
pub fn reserved_bytes(policy: &Policy, size: u64) -> u64 {
    let b = size as u128 * policy.reserve_pct as u128 / 100;
    b.min(u64::MAX as u128) as u64
}

fn fits(d: &DeviceInfo, need: u64) -> bool {
    if need == 0 {
        d.free() > 0
    } else {
        d.free() >= need
    }
}

/// A fault domain with its usable devices.
struct Domain<'a> {
    name: &'a str,
    /// Usable devices with their node, sorted by device id.
    devices: Vec<(&'a DeviceInfo, NodeId)>,
    free: u64,
    load: u64,
    /// Sum of the devices' headroom (free space if every volume filled).
    headroom: i128,
}

impl<'a> Domain<'a> {
    /// The device with the most free space satisfying `ok` (ties: lowest id).
    fn best(&self, ok: impl Fn(&DeviceInfo, NodeId) -> bool) -> Option<(&'a DeviceInfo, NodeId)> {
        self.devices
            .iter()
            .copied()
            .filter(|(d, n)| ok(d, *n))
            .max_by_key(|(d, _)| (d.headroom(), d.free(), Reverse(d.id)))
    }
}

/// How many fault domains could hold a component now (see [`usable`]):
/// a change of several steps checks its end fits before its first.
pub fn usable_fault_domains(nodes: &[NodeInfo], devices: &[DeviceInfo]) -> usize {
    usable(nodes, devices).len()
}

/// Usable fault domains by name: those with an `Up` node that has a
/// `Healthy` device, not in maintenance.
fn usable<'a>(nodes: &'a [NodeInfo], devices: &'a [DeviceInfo]) -> BTreeMap<&'a str, Domain<'a>> {
    let mut by_id: BTreeMap<NodeId, &NodeInfo> = BTreeMap::new();
    for n in nodes {
        // Duplicate ids: keep the smallest domain name, independent of order.
        let keep = by_id
            .get(&n.id)
            .is_none_or(|o| n.fault_domain < o.fault_domain);
        if keep {
            by_id.insert(n.id, n);
        }
    }
    let mut devs: Vec<&DeviceInfo> = devices.iter().collect();
    devs.sort_by_key(|d| (d.id, d.node));
    devs.dedup_by_key(|d| d.id);
    let mut out: BTreeMap<&str, Domain> = BTreeMap::new();
    for d in devs {
        if !d.accepts_components() {
            continue;
        }
        let Some(n) = by_id.get(&d.node) else {
            continue;
        };
        if n.state != NodeState::Up {
            continue;
        }
        let dom = out.entry(&n.fault_domain).or_insert(Domain {
            name: &n.fault_domain,
            devices: Vec::new(),
            free: 0,
            load: 0,
            headroom: 0,
        });
        dom.devices.push((d, n.id));
        dom.free = dom.free.saturating_add(d.free());
        dom.headroom += d.headroom();
        dom.load = dom.load.saturating_add(d.used.saturating_add(d.reserved));
    }
    out
}

/// Chooses a node and device for every component of a new volume of `size`
/// bytes under `policy`: data components first, then witnesses.
pub fn place(
    policy: &Policy,
    size: u64,
    nodes: &[NodeInfo],
    devices: &[DeviceInfo],
) -> Result<Vec<Planned>, PlacementError> {
    let domains = usable(nodes, devices);
    let needed = policy.fault_domains_needed();
    if domains.len() < needed {
        return Err(PlacementError::NotEnoughFaultDomains {
            policy: policy_name(policy),
            needed,
            have: domains.len(),
        });
    }
    let need = reserved_bytes(policy, size);
    let ranked: Vec<&Domain> = domains.values().collect();
    let mut planned = fill(
        ranked.clone(),
        (policy.copies(), policy.witnesses()),
        need,
        |_, _| true,
    )?;
    if let Some(g) = StripeGeometry::for_layout(policy.layout, domains.len()) {
        planned.extend(fill_stripes(ranked, g, need.div_ceil(u64::from(g.data)))?);
    }
    Ok(planned)
}

/// The stripe geometry that `planned` (a placement of `policy`) has: its
/// stripe components' count less the policy's parity (None: RAID-1).
pub fn stripe_geometry(policy: &Policy, planned: &[Planned]) -> Option<StripeGeometry> {
    let width = planned
        .iter()
        .filter(|p| matches!(p.role, ComponentRole::Stripe { .. }))
        .count();
    let parity = policy.layout.fixed_ftt()?;
    let data = u8::try_from(width).ok()?.checked_sub(parity)?;
    Some(StripeGeometry { data, parity })
}

/// Places the `k + m` stripe components of a capacity leg on distinct
/// domains among `domains`, the roomiest first (`need` bytes free on the
/// device: a column's share of a reservation), positions in that order.
pub(crate) fn fill_stripes(
    mut domains: Vec<&Domain>,
    g: StripeGeometry,
    need: u64,
) -> Result<Vec<Planned>, PlacementError> {
    domains.sort_by_key(|d| (Reverse(d.headroom), Reverse(d.free), d.name));
    let mut out = Vec::with_capacity(g.width());
    for dom in &domains {
        if out.len() == g.width() {
            break;
        }
        if let Some((dev, node)) = dom.best(|d, _| fits(d, need)) {
            out.push(Planned {
                role: ComponentRole::Stripe {
                    position: out.len() as u8,
                },
                node,
                device: dev.id,
                votes: 0,
            });
        }
    }
    if out.len() < g.width() {
        let domain = domains
            .get(out.len())
            .map(|d| d.name.to_string())
            .unwrap_or_default();
        return Err(PlacementError::NoSpace {
            needed: need,
            domain,
        });
    }
    Ok(out)
}

/// Places `data` copies and then `witnesses` on distinct domains among
/// `domains`, on devices `ok` accepts: data where there is the most room
/// (`need` bytes free on the device), witnesses on the least loaded
/// domains left. `place` and the policy change share it.
pub(crate) fn fill<'a>(
    mut domains: Vec<&'a Domain<'a>>,
    (data, witnesses): (usize, usize),
    need: u64,
    ok: impl Fn(&DeviceInfo, NodeId) -> bool,
) -> Result<Vec<Planned>, PlacementError> {
    domains.sort_by_key(|d| (Reverse(d.headroom), Reverse(d.free), d.name));
    let mut out = Vec::with_capacity(data + witnesses);
    let mut taken: BTreeSet<&str> = BTreeSet::new();
    for dom in &domains {
        if out.len() == data {
            break;
        }
        if let Some((dev, node)) = dom.best(|d, n| ok(d, n) && fits(d, need)) {
            taken.insert(dom.name);
            out.push(Planned {
                role: ComponentRole::Data,
                node,
                device: dev.id,
                votes: 1,
            });
        }
    }
    if out.len() < data {
        let domain = domains
            .iter()
            .find(|d| !taken.contains(d.name))
            .map(|d| d.name.to_string())
            .unwrap_or_default();
        return Err(PlacementError::NoSpace {
            needed: need,
            domain,
        });
    }
    let mut rest: Vec<&Domain> = domains
        .into_iter()
        .filter(|d| !taken.contains(d.name))
        .collect();
    rest.sort_by_key(|d| (d.load, d.name));
    for dom in rest.into_iter().take(witnesses) {
        // Every domain given has a device `ok` accepts.
        if let Some((dev, node)) = dom.best(&ok) {
            out.push(Planned {
                role: ComponentRole::Witness,
                node,
                device: dev.id,
                votes: 1,
            });
        }
    }
    Ok(out)
}

/// Chooses a new home for component `failed` of `volume` (same role), on a
/// fault domain no other component of the volume uses. The failed
/// component's own domain is taken only as a last resort, and never its
/// device, so a volume whose device died can be rebuilt on another device of
/// the same host when the cluster has no spare domain.
pub fn replacement(
    policy: &Policy,
    volume: &Volume,
    failed: ComponentId,
    nodes: &[NodeInfo],
    devices: &[DeviceInfo],
) -> Result<Planned, PlacementError> {
    let Some(old) = volume.components.iter().find(|c| c.id == failed) else {
        return Err(PlacementError::NoSuchComponent {
            volume: volume.id,
            component: failed,
        });
    };
    let domain_of = |node: NodeId| crate::domain_of(nodes, node);
    // The legs of an erasure-coded volume share domains: a stripe column
    // keeps clear of the other columns, a copy or witness of the others
    // of the performance leg.
    let is_stripe = |r: ComponentRole| matches!(r, ComponentRole::Stripe { .. });
    let others: Vec<_> = volume
        .components
        .iter()
        .filter(|c| c.id != failed && is_stripe(c.role) == is_stripe(old.role))
        .collect();
    let used_domains: BTreeSet<&str> = others.iter().filter_map(|c| domain_of(c.node)).collect();
    let used_nodes: BTreeSet<NodeId> = others.iter().map(|c| c.node).collect();
    let old_domain = domain_of(old.node);
    let domains = usable(nodes, devices);
    let ok = |d: &DeviceInfo, n: NodeId| d.id != old.device && !used_nodes.contains(&n);
    let candidates: Vec<&Domain> = domains
        .values()
        .filter(|d| !used_domains.contains(d.name))
        .filter(|d| d.best(ok).is_some())
        .collect();
    if candidates.is_empty() {
        return Err(PlacementError::NotEnoughFaultDomains {
            policy: policy_name(policy),
            needed: policy.fault_domains_needed(),
            have: used_domains.len(),
        });
    }
    let pick = match old.role {
        ComponentRole::Data | ComponentRole::Stripe { .. } => {
            let need = match (old.role, volume.stripe) {
                (ComponentRole::Stripe { .. }, Some(g)) => {
                    reserved_bytes(policy, volume.size).div_ceil(u64::from(g.data))
                }
                _ => reserved_bytes(policy, volume.size),
            };
            let mut c: Vec<&Domain> = candidates.clone();
            c.sort_by_key(|d| (Some(d.name) == old_domain, Reverse(d.free), d.name));
            let found = c
                .iter()
                .find_map(|d| d.best(|x, n| ok(x, n) && fits(x, need)));
            match found {
                Some(p) => p,
                None => {
                    let domain = c
                        .iter()
                        .max_by_key(|d| (d.free, Reverse(d.name)))
                        .map(|d| d.name.to_string())
                        .unwrap_or_default();
                    return Err(PlacementError::NoSpace {
                        needed: need,
                        domain,
                    });
                }
            }
        }
        ComponentRole::Witness => {
            let mut c = candidates;
            c.sort_by_key(|d| (Some(d.name) == old_domain, d.load, d.name));
            // Candidates all have a device passing `ok`.
            match c.iter().find_map(|d| d.best(ok)) {
                Some(p) => p,
                None => {
                    return Err(PlacementError::NotEnoughFaultDomains {
                        policy: policy_name(policy),
                        needed: policy.fault_domains_needed(),
                        have: used_domains.len(),
                    })
                }
            }
        }
    };
    let votes = match old.role {
        ComponentRole::Stripe { .. } => 0,
        _ => old.votes.max(1),
    };
    Ok(Planned {
        role: old.role,
        node: pick.1,
        device: pick.0.id,
        votes,
    })
}

/// The fault domain of node `node` among `nodes` (None: not listed).
fn domain_of(nodes: &[NodeInfo], node: NodeId) -> Option<&str> {
    nodes
        .iter()
        .filter(|n| n.id == node)
        .map(|n| n.fault_domain.as_str())
        .min()
}

mod policy_change;
pub use policy_change::{policy_change, PolicyChange};

#[cfg(test)]
mod tests;
