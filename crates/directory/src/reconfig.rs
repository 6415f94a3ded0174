//! The directory's half of the reconfiguration primitive
//! (`docs/reconfiguration.md`): a change of a volume's layout is begun,
//! then committed or aborted, each step one command under the owner's
//! generation, so that whoever owns the volume next finds the change in
//! the directory and resumes or undoes it.
//!
//! - [`Command::BeginReconfig`]: components are added in state
//!   `Reconfiguring` (their space reserved), the components to drop and
//!   the policy to end with are recorded.
//! - [`Command::CommitReconfig`]: the added components become active, the
//!   dropped ones leave (their space released), the policy changes.
//! - [`Command::AbortReconfig`]: the added components leave, nothing else
//!   changes.
//!
//! Each builds the volume as it will be, then moves every device's
//! reservation from what the volume holds now to what it will hold
//! ([`reserved_for`]), refusing a device without the space: validate, then
//! mutate, like every command of the state machine.

use crate::state::{input, reservation, ClusterState, PlannedComponent, Response};
use crate::StateError;
use shoal_model::{
    Component, ComponentId, ComponentRole, ComponentState, DeviceId, Generation, Policy, Reconfig,
    Volume, VolumeId,
};
use std::collections::BTreeMap;

/// The components a commit or an abort names: those its change added, and
/// those it drops.
pub(crate) type Ids<'a> = (&'a [ComponentId], &'a [ComponentId]);

/// Most components a reconfiguration adds at once: a change to the
/// largest policy (three copies and two witnesses more) and a few to spare.
pub const MAX_RECONFIG_ADDS: usize = 8;
/// Longest reason kept, in bytes.
pub const MAX_REASON_BYTES: usize = 256;

/// Bytes a data component of `v` holds reserved on its device. Without a
/// change in progress, the policy's reservation; during one, an added
/// component holds the new policy's, a dropped one the old policy's, and a
/// kept one the larger of the two, so that both the commit and the abort
/// only release space.
pub fn reserved_for(v: &Volume, c: &Component) -> u64 {
    let size = v.provisioned_size();
    let old = reservation(size, &v.policy);
    let Some(r) = &v.reconfig else {
        return old;
    };
    let new = reservation(size, &r.policy.unwrap_or(v.policy));
    if r.added.contains(&c.id) {
        new
    } else if r.remove.contains(&c.id) {
        old
    } else {
        old.max(new)
    }
}

/// Per device, what the data components of `v` hold reserved.
fn reserved_by(v: Option<&Volume>) -> BTreeMap<DeviceId, u64> {
    let mut out = BTreeMap::new();
    for v in v.into_iter() {
        for c in v.data_components() {
            *out.entry(c.device).or_default() += reserved_for(v, c);
        }
    }
    out
}

/// A begin, as the command carries it.
pub(crate) struct Begin<'a> {
    pub(crate) volume: VolumeId,
    pub(crate) generation: Generation,
    pub(crate) add: &'a [PlannedComponent],
    pub(crate) remove: &'a [ComponentId],
    pub(crate) policy: Option<Policy>,
    pub(crate) reason: &'a str,
    pub(crate) wanted: Option<Policy>,
}

impl ClusterState {
    /// The volume `id` if `generation` is its current one.
    /// Volume `id`, if `generation` is its owner's.
    pub(crate) fn owned(
        &self,
        id: VolumeId,
        generation: Generation,
    ) -> Result<&Volume, StateError> {
        let v = self
            .volumes
            .get(&id)
            .ok_or(StateError::NoSuchVolumeId(id))?;
        if v.generation != generation {
            return Err(StateError::GenerationConflict {
                current: v.generation,
                owner: v.owner,
            });
        }
        Ok(v)
    }

    /// Replaces volume `before` (if any) by `after` (if any), moving the
    /// devices' reservations with it; refused, changing nothing, when a
    /// device lacks the space for what grows.
    pub(crate) fn replace_volume(
        &mut self,
        before: Option<&Volume>,
        after: Option<Volume>,
    ) -> Result<(), StateError> {
        let (was, will) = (reserved_by(before), reserved_by(after.as_ref()));
        let mut reserved = BTreeMap::new();
        for dev in was.keys().chain(will.keys()) {
            let d = self
                .devices
                .get(dev)
                .ok_or(StateError::NoSuchDevice(*dev))?;
            let (from, to) = (
                was.get(dev).copied().unwrap_or(0),
                will.get(dev).copied().unwrap_or(0),
            );
            let rest = d
                .reserved
                .checked_sub(from)
                .ok_or_else(|| input(format!("reservation on device {dev} out of range")))?;
            if to > from {
                let free = d.capacity.saturating_sub(d.used).saturating_sub(d.reserved);
                if to - from > free {
                    return Err(StateError::NoSpace {
                        device: *dev,
                        needed: to - from,
                        free,
                    });
                }
            }
            reserved.insert(*dev, rest + to);
        }
        // Validated: mutate.
        for (dev, r) in reserved {
            if let Some(d) = self.devices.get_mut(&dev) {
                d.reserved = r;
            }
        }
        match after {
            Some(v) => {
                self.volumes.insert(v.id, v);
            }
            None => {
                if let Some(b) = before {
                    self.volumes.remove(&b.id);
                }
            }
        }
        Ok(())
    }

    pub(crate) fn begin_reconfig(&mut self, b: &Begin<'_>) -> Result<Response, StateError> {
        let before = self.owned(b.volume, b.generation)?.clone();
        self.check_begin(&before, b)?;
        let mut after = before.clone();
        let mut next_id = self.next_id.max(1);
        let mut added = Vec::with_capacity(b.add.len());
        for c in b.add {
            added.push(next_id);
            after.components.push(Component {
                id: next_id,
                role: c.role,
                node: c.node,
                device: c.device,
                state: ComponentState::Reconfiguring,
                votes: c.votes,
            });
            next_id += 1;
        }
        if let Some(p) = b.wanted.or(b.policy) {
            // What the change is for, kept should it end aborted (and
            // after it, when it is one step of several). A step towards
            // the policy the volume has (a restripe: lowered to RAID-1,
            // then raised again to the geometry the cluster now gives)
            // keeps it too.
            let beyond = b.wanted.is_some_and(|w| Some(w) != b.policy);
            after.wanted_policy = (p != before.policy || beyond).then_some(p);
        }
        after.reconfig = Some(Reconfig {
            reason: b.reason.to_string(),
            added,
            remove: b.remove.to_vec(),
            policy: b.policy,
        });
        self.replace_volume(Some(&before), Some(after))?;
        self.next_id = next_id;
        Ok(Response::Ok)
    }

    /// Everything a begin must satisfy, checked before anything changes.
    fn check_begin(&self, v: &Volume, b: &Begin<'_>) -> Result<(), StateError> {
        if v.reconfig.is_some() {
            return Err(input(format!(
                "volume {} is already being reconfigured",
                v.name
            )));
        }
        if let Some(to) = v.grow_to {
            // Its owner moves the map log and commits the size first; a
            // column placed meanwhile would be sized for the old end.
            return Err(input(format!(
                "volume {} is being grown to {to} bytes: changes of its layout wait until that is done",
                v.name
            )));
        }
        if b.add.is_empty() && b.remove.is_empty() && b.policy.is_none() {
            return Err(input("a reconfiguration changes something"));
        }
        if b.wanted.or(b.policy).is_some_and(|p| p.layout.is_erasure()) {
            // Refused at the first step of a change towards RAID-5/6, not
            // after a whole copy was added for it.
            shoal_model::check_erasure_volume_size(v.size).map_err(input)?;
        }
        if b.add.len() > MAX_RECONFIG_ADDS || b.reason.len() > MAX_REASON_BYTES {
            return Err(input(format!(
                "a reconfiguration adds at most {MAX_RECONFIG_ADDS} components, and its reason \
                 is at most {MAX_REASON_BYTES} bytes"
            )));
        }
        for id in b.remove {
            if !v.components.iter().any(|c| c.id == *id) {
                return Err(StateError::NoSuchComponent {
                    volume: v.id,
                    component: *id,
                });
            }
        }
        if let (Some(_), Some(p)) = (v.stripe, b.policy) {
            check_lowering(v, b, &p)?;
        } else {
            check_column_moves(v, b)?;
        }
        for (i, c) in b.add.iter().enumerate() {
            self.check_placed(c)?;
            // The legs of an erasure-coded volume share devices.
            let same = |k: ComponentRole| k.device_leg() == c.role.device_leg();
            let taken = v
                .components
                .iter()
                .any(|k| k.device == c.device && same(k.role))
                || b.add[..i]
                    .iter()
                    .any(|k| k.device == c.device && same(k.role));
            if taken {
                return Err(input(format!(
                    "device {} already holds a component of volume {}",
                    c.device, v.name
                )));
            }
        }
        let kept = v
            .data_components()
            .filter(|c| !b.remove.contains(&c.id))
            .count();
        let added = b
            .add
            .iter()
            .filter(|c| c.role == ComponentRole::Data)
            .count();
        if kept + added == 0 {
            return Err(input("the new layout needs at least one data component"));
        }
        Ok(())
    }

    /// The volume `id` under `generation` and the change in progress on
    /// it.
    fn changing(
        &self,
        id: VolumeId,
        generation: Generation,
        ids: Ids<'_>,
    ) -> Result<(Volume, Reconfig), StateError> {
        let v = self.owned(id, generation)?;
        match &v.reconfig {
            Some(r) if Self::names(r, ids) => Ok((v.clone(), r.clone())),
            Some(r) => Err(input(format!(
                "volume {} is in another change ({})",
                v.name, r.reason
            ))),
            None => Err(input(format!(
                "volume {} is not being reconfigured",
                v.name
            ))),
        }
    }

    /// Whether the change named by `(added, remove)` on volume `id` under
    /// `generation` has already ended (committed, or else aborted): no
    /// change is in progress and the components stand as that end left
    /// them. A change that names nothing never counts as ended.
    fn already_ended(
        &self,
        id: VolumeId,
        generation: Generation,
        (added, remove): Ids<'_>,
        committed: bool,
    ) -> bool {
        let Ok(v) = self.owned(id, generation) else {
            return false;
        };
        let has = |id: &ComponentId| v.components.iter().any(|c| c.id == *id);
        let named = !added.is_empty() || !remove.is_empty();
        let stands = if committed {
            added.iter().all(has) && !remove.iter().any(has)
        } else {
            !added.iter().any(has) && remove.iter().all(has)
        };
        named && v.reconfig.is_none() && stands
    }

    /// Whether the change in progress `r` is the one named by `(added,
    /// remove)`; naming nothing names whatever change is in progress.
    fn names(r: &Reconfig, (added, remove): Ids<'_>) -> bool {
        (added.is_empty() && remove.is_empty()) || (r.added == added && r.remove == remove)
    }

    pub(crate) fn commit_reconfig(
        &mut self,
        volume: VolumeId,
        generation: Generation,
        ids: Ids<'_>,
    ) -> Result<Response, StateError> {
        if self.already_ended(volume, generation, ids, true) {
            return Ok(Response::Ok);
        }
        let (before, r) = self.changing(volume, generation, ids)?;
        // An added component the owner recorded failed was not brought
        // in sync: the change is aborted (or begun again), not committed.
        let mut added = before.components.iter().filter(|c| r.added.contains(&c.id));
        if let Some(c) = added.find(|c| c.state != ComponentState::Reconfiguring) {
            return Err(input(format!(
                "component {} added to volume {} is {}, not in sync",
                c.id, before.name, c.state
            )));
        }
        let mut after = before.clone();
        after.components.retain(|c| !r.remove.contains(&c.id));
        for c in &mut after.components {
            if r.added.contains(&c.id) {
                c.state = ComponentState::Active;
            }
        }
        after.policy = r.policy.unwrap_or(before.policy);
        if after.stripe.is_none() && after.policy.layout.is_erasure() {
            // A capacity leg added: its geometry, checked at the begin.
            let leg: Vec<PlannedComponent> = after
                .components
                .iter()
                .map(|c| PlannedComponent {
                    role: c.role,
                    node: c.node,
                    device: c.device,
                    votes: c.votes,
                })
                .collect();
            after.stripe = crate::state::stripe_of(&after.policy, &leg)?;
        }
        if !after.policy.layout.is_erasure() {
            // Lowered to RAID-1: the capacity leg is gone, and the map log
            // with it (trimmed by the owner before this commit).
            after.stripe = None;
            after.map_log_at = None;
        }
        if after.wanted_policy == Some(after.policy) {
            after.wanted_policy = None;
        }
        after.reconfig = None;
        self.replace_volume(Some(&before), Some(after))?;
        Ok(Response::Ok)
    }

    pub(crate) fn abort_reconfig(
        &mut self,
        volume: VolumeId,
        generation: Generation,
        ids: Ids<'_>,
    ) -> Result<Response, StateError> {
        if self.already_ended(volume, generation, ids, false) {
            return Ok(Response::Ok);
        }
        let (before, r) = self.changing(volume, generation, ids)?;
        let mut after = before.clone();
        after.components.retain(|c| !r.added.contains(&c.id));
        after.reconfig = None;
        // An aborted restripe wants nothing: the volume has its policy,
        // and the restripe is asked again when due.
        if after.wanted_policy == Some(after.policy) {
            after.wanted_policy = None;
        }
        self.replace_volume(Some(&before), Some(after))?;
        Ok(Response::Ok)
    }
}

impl crate::state::Command {
    /// A begin's fields, if this is one.
    pub(crate) fn as_begin(&self) -> Option<Begin<'_>> {
        match self {
            crate::state::Command::BeginReconfig {
                volume,
                generation,
                add,
                remove,
                policy,
                reason,
                wanted,
            } => Some(Begin {
                volume: *volume,
                generation: *generation,
                add,
                remove,
                policy: *policy,
                reason,
                wanted: *wanted,
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;

/// An erasure-coded volume changes its layout only by lowering to RAID-1
/// of its ftt: every stripe column dropped, nothing added, the
/// performance leg kept as the copies (other layouts are reached from
/// there, step by step). A change of the policy's other words moves
/// nothing.
fn check_lowering(v: &Volume, b: &Begin<'_>, p: &Policy) -> Result<(), StateError> {
    let mut columns: Vec<ComponentId> = v.stripe_components().map(|c| c.id).collect();
    let mut remove = b.remove.to_vec();
    remove.sort_unstable();
    columns.sort_unstable();
    let lowering = p.layout == shoal_model::Layout::Raid1
        && p.ftt == v.policy.ftt
        && b.add.is_empty()
        && remove == columns;
    // The policy's other words only (an IOPS limit, the reserve).
    let words_only = (p.layout, p.ftt) == (v.policy.layout, v.policy.ftt)
        && b.add.is_empty()
        && b.remove.is_empty();
    if lowering || words_only {
        return Ok(());
    }
    Err(input(format!(
        "volume {} is {}: its policy changes only to raid1 ftt={} (every stripe component \
         dropped, nothing added); other policies are reached from there",
        v.name, v.policy, v.policy.ftt
    )))
}

/// Stripe columns move only one for one: each column added takes the
/// position of a column the same change removes (the rebuild of a lost
/// column), on a node that holds no other column of the volume; no other
/// change touches the capacity leg.
fn check_column_moves(v: &Volume, b: &Begin<'_>) -> Result<(), StateError> {
    let position = |r: ComponentRole| match r {
        ComponentRole::Stripe { position } => Some(position),
        _ => None,
    };
    let removed: Vec<&Component> = v
        .components
        .iter()
        .filter(|c| position(c.role).is_some() && b.remove.contains(&c.id))
        .collect();
    let added: Vec<_> = b
        .add
        .iter()
        .filter(|c| position(c.role).is_some())
        .collect();
    if removed.is_empty() && added.is_empty() {
        return Ok(());
    }
    // A RAID-1 volume becoming RAID-5/6: a whole capacity leg added.
    if let (None, Some(p)) = (v.stripe, b.policy.filter(|p| p.layout.is_erasure())) {
        shoal_model::check_erasure_volume_size(v.size).map_err(input)?;
        let leg: Vec<PlannedComponent> = added.iter().map(|c| (*c).clone()).collect();
        if removed.is_empty() && added.len() == b.add.len() {
            let spread = v.components.iter().all(|c| position(c.role).is_none());
            if spread && crate::state::stripe_of(&p, &leg)?.is_some() {
                return Ok(());
            }
        }
        return Err(input(format!(
            "volume {}: a change to {p} adds a whole capacity leg and nothing else",
            v.name
        )));
    }
    let refuse = |why: &str| {
        Err(input(format!(
            "volume {}: stripe components are only replaced one for one ({why})",
            v.name
        )))
    };
    if removed.len() != added.len() {
        return refuse("as many added as removed");
    }
    for a in &added {
        let Some(old) = removed.iter().find(|r| r.role == a.role) else {
            return refuse("each at the position of one removed");
        };
        let crowded = v
            .components
            .iter()
            .any(|c| c.id != old.id && position(c.role).is_some() && c.node == a.node);
        if crowded {
            return refuse("on a node without another of the volume's columns");
        }
    }
    Ok(())
}
