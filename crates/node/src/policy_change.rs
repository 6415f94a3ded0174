//! `shoal volume set-policy`: a volume's policy changed in place, under
//! I/O (`docs/reconfiguration.md`, Policy change). Plans the change with
//! `shoal_placement::policy_change` (copies and witnesses added on fault
//! domains the volume does not use, with the new policy's space; the
//! surplus dropped) and proposes it as one `BeginReconfig` carrying the
//! new policy; the volume's owner then syncs the added copies and commits,
//! as for any reconfiguration. The directory reserves the space first and
//! refuses a device that lacks it.
//!
//! Owns the planning and the proposal only; the state comes from the
//! directory, and the change is carried through by the owner.

use shoal_directory::{ClusterState, Command, DirectoryError, PlannedComponent, Response};
use shoal_model::{ComponentId, Layout, Policy, PolicyError, StripeGeometry, Volume};
use shoal_placement::PlacementError;
use std::future::Future;
use std::sync::Arc;

/// Why a volume's policy cannot be changed (now).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyChangeError {
    #[error("no volume named {0:?}")]
    NoSuchVolume(String),
    /// The text is not a policy (an unknown word, a layout that does not
    /// exist yet, ftt out of range).
    #[error("{0}")]
    BadPolicy(#[from] PolicyError),
    /// The text does not say how many failures to tolerate: the one word
    /// that moves data is never left to its default.
    #[error("the new policy must say its failures to tolerate: add ftt=N (0 to 3) to {0:?}")]
    NoFtt(String),
    /// Encryption is chosen at creation: turning it on or off would
    /// rewrite every block.
    #[error(
        "volume {volume} is {}: encryption is chosen when a volume is created and cannot \
         change ({})", if *encrypted { "encrypted" } else { "not encrypted" },
        if *encrypted { "keep encrypt=on in the new policy" } else { "leave encrypt=on out" }
    )]
    Encryption { volume: String, encrypted: bool },
    /// The volume cannot be served (its copies refused the last owner):
    /// no owner would carry a change through.
    #[error("volume {volume} cannot be served now ({problem}); a change needs it served")]
    Inaccessible { volume: String, problem: String },
    #[error(
        "volume {volume} is already being reconfigured ({reason}); wait for that change to end"
    )]
    InProgress { volume: String, reason: String },
    /// Placement found no room for the new layout: too few fault domains,
    /// or no device with the space.
    #[error("cannot change volume {volume} to {policy}: {error}")]
    Placement {
        volume: String,
        policy: String,
        error: PlacementError,
    },
    /// The directory refused the change (a device lacks the space, the
    /// owner's generation moved twice, a change began meanwhile).
    #[error("cannot change volume {volume} to {policy}: {why}")]
    Refused {
        volume: String,
        policy: String,
        why: String,
    },
    /// The directory cannot decide now (no leader, no quorum).
    #[error("the directory cannot decide now: {0}")]
    Unavailable(String),
}

impl PolicyChangeError {
    /// The HTTP status the API answers with: 404 for an unknown volume,
    /// 400 for a policy that cannot be, 409 for a change the cluster
    /// refuses as it is now, 503 without a directory.
    pub fn http_status(&self) -> u16 {
        match self {
            PolicyChangeError::NoSuchVolume(_) => 404,
            PolicyChangeError::BadPolicy(_)
            | PolicyChangeError::NoFtt(_)
            | PolicyChangeError::Encryption { .. } => 400,
            PolicyChangeError::InProgress { .. }
            | PolicyChangeError::Inaccessible { .. }
            | PolicyChangeError::Placement { .. }
            | PolicyChangeError::Refused { .. } => 409,
            PolicyChangeError::Unavailable(_) => 503,
        }
    }
}

/// Parses the new policy of `set-policy` with the parser `volume create`
/// uses (every word works or is refused), and requires `ftt=`.
pub fn parse(text: &str) -> Result<Policy, PolicyChangeError> {
    let policy: Policy = text.parse()?;
    let has_ftt = text
        .split(|c: char| c.is_whitespace() || c == ',')
        .any(|w| w.to_ascii_lowercase().starts_with("ftt="));
    if !has_ftt {
        return Err(PolicyChangeError::NoFtt(text.to_string()));
    }
    Ok(policy)
}

/// The reason the change records: "policy raid1 ftt=2".
pub fn reason(policy: &Policy) -> String {
    format!("policy {policy}")
}

/// What a policy change does.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// The volume has the policy already: nothing to do.
    Unchanged,
    /// The volume has the policy, and a change to another one is wanted
    /// (it ended aborted): drop that want (`Command::KeepPolicy`).
    Keep(Command),
    /// The change to propose.
    Begin(Command),
}

/// Plans the change of volume `name` to `policy` from the directory's
/// `state`, under the volume's current generation. Pure.
pub fn plan(state: &ClusterState, name: &str, policy: &Policy) -> Result<Plan, PolicyChangeError> {
    let v = state
        .volume_by_name(name)
        .ok_or_else(|| PolicyChangeError::NoSuchVolume(name.to_string()))?;
    if let Some(r) = &v.reconfig {
        return Err(PolicyChangeError::InProgress {
            volume: v.name.clone(),
            reason: r.reason.clone(),
        });
    }
    if let Some(problem) = &v.problem {
        return Err(PolicyChangeError::Inaccessible {
            volume: v.name.clone(),
            problem: problem.clone(),
        });
    }
    if policy.encrypt != v.policy.encrypt {
        return Err(PolicyChangeError::Encryption {
            volume: v.name.clone(),
            encrypted: v.policy.encrypt,
        });
    }
    if *policy == v.policy {
        return Ok(match v.wanted_policy {
            Some(_) => Plan::Keep(Command::KeepPolicy { volume: v.id }),
            None => Plan::Unchanged,
        });
    }
    let nodes: Vec<_> = state.nodes.values().cloned().collect();
    let devices: Vec<_> = state.devices.values().cloned().collect();
    let step = next_step(&v.policy, policy);
    let wanted = (step != *policy).then_some(*policy);
    if wanted.is_some() {
        end_fits(v, policy, (&nodes, &devices))?;
    }
    if v.policy.layout.is_erasure() {
        return Ok(Plan::Begin(erasure_step(v, &step, wanted)));
    }
    let change =
        shoal_placement::policy_change(v, &step, &nodes, &devices).map_err(
            |error| match error {
                PlacementError::ChangeInProgress { volume, reason } => {
                    PolicyChangeError::InProgress { volume, reason }
                }
                error => PolicyChangeError::Placement {
                    volume: v.name.clone(),
                    policy: policy.to_string(),
                    error,
                },
            },
        )?;
    let add = change
        .add
        .iter()
        .map(|p| PlannedComponent {
            role: p.role,
            node: p.node,
            device: p.device,
            votes: p.votes,
        })
        .collect();
    Ok(Plan::Begin(Command::BeginReconfig {
        volume: v.id,
        generation: v.generation,
        add,
        remove: change.remove,
        policy: Some(step),
        reason: step_reason(&step, wanted.as_ref()),
        wanted,
    }))
}

/// A change of several steps: its end must fit the cluster (its fault
/// domains) before the first step begins, or the volume would be left
/// half way. Each step's placement checks the space as it begins.
fn end_fits(
    v: &Volume,
    policy: &Policy,
    (nodes, devices): (&[shoal_model::NodeInfo], &[shoal_model::DeviceInfo]),
) -> Result<(), PolicyChangeError> {
    let have = shoal_placement::usable_fault_domains(nodes, devices);
    let needed = policy.fault_domains_needed();
    if have >= needed {
        return Ok(());
    }
    Err(PolicyChangeError::Placement {
        volume: v.name.clone(),
        policy: policy.to_string(),
        error: PlacementError::NotEnoughFaultDomains {
            policy: format!("{} ftt={}", policy.layout, policy.ftt),
            needed,
            have,
        },
    })
}

/// The next step from `from` towards `to` (`docs/reconfiguration.md`,
/// Policy change): an erasure-coded volume is lowered to RAID-1 of its
/// ftt first (unless only the policy's other words change); a RAID-1
/// volume changes its ftt within RAID-1 before it gains a capacity leg.
/// Every other change is one step.
pub fn next_step(from: &Policy, to: &Policy) -> Policy {
    let same_layout = from.layout == to.layout && from.ftt == to.ftt;
    let mut step = *to;
    if from.layout.is_erasure() && !same_layout {
        step.layout = Layout::Raid1;
        step.ftt = from.ftt;
    } else if !from.layout.is_erasure() && to.layout.is_erasure() && from.ftt != to.ftt {
        step.layout = Layout::Raid1;
    }
    step
}

/// The step of an erasure-coded volume: a change of the policy's other
/// words only (its owner commits it), or the lowering to RAID-1 of its
/// ftt, which drops every stripe column (its owner reads the stripes back
/// to the copies first).
fn erasure_step(v: &Volume, step: &Policy, wanted: Option<Policy>) -> Command {
    let lowering = !step.layout.is_erasure();
    let remove = if lowering {
        v.stripe_components().map(|c| c.id).collect()
    } else {
        Vec::new()
    };
    Command::BeginReconfig {
        volume: v.id,
        generation: v.generation,
        add: Vec::new(),
        remove,
        policy: Some(*step),
        reason: step_reason(step, wanted.as_ref()),
        wanted,
    }
}

/// The geometry `v`'s layout takes on the cluster as it is now, when it
/// is not the one `v` has and nothing else is going on with `v`: a
/// restripe is due (RAID-5 is 2+1 on 3 to 5 usable fault domains and 4+1
/// on 6 or more; RAID-6 has one geometry). None while a node is in
/// maintenance: a planned, passing change of the cluster's size.
pub fn restripe_due(state: &ClusterState, v: &Volume) -> Option<StripeGeometry> {
    let have = v.stripe?;
    let busy = v.reconfig.is_some() || v.problem.is_some() || v.wanted_policy.is_some();
    if busy || !state.maintenance.is_empty() {
        return None;
    }
    let want = StripeGeometry::for_layout(v.policy.layout, usable_domains(state))?;
    (want != have).then_some(want)
}

fn usable_domains(state: &ClusterState) -> usize {
    let nodes: Vec<_> = state.nodes.values().cloned().collect();
    let devices: Vec<_> = state.devices.values().cloned().collect();
    shoal_placement::usable_fault_domains(&nodes, &devices)
}

/// Plans the first step of the restripe of volume `name` to geometry
/// `to` (`docs/erasure-coding.md`, Restripe): its lowering to RAID-1 of
/// its ftt, wanting its own policy back; the caretaker then raises it
/// again, and placement gives the capacity leg the geometry of the
/// cluster as it is by then. Unchanged if the restripe is no longer due.
pub fn plan_restripe(
    state: &ClusterState,
    name: &str,
    to: StripeGeometry,
) -> Result<Plan, PolicyChangeError> {
    let v = state
        .volume_by_name(name)
        .ok_or_else(|| PolicyChangeError::NoSuchVolume(name.to_string()))?;
    let (Some(have), Some(due)) = (v.stripe, restripe_due(state, v)) else {
        return Ok(Plan::Unchanged);
    };
    if due != to {
        return Ok(Plan::Unchanged);
    }
    let step = Policy {
        layout: Layout::Raid1,
        ..v.policy
    };
    let mut cmd = erasure_step(v, &step, Some(v.policy));
    if let Command::BeginReconfig { reason, .. } = &mut cmd {
        let domains = usable_domains(state);
        *reason = format!("restripe {have} to {to} ({domains} fault domains): {reason}");
    }
    Ok(Plan::Begin(cmd))
}

/// Begins the restripe of volume `name` to geometry `to` through `dir`.
pub async fn restripe(
    dir: &shoal_directory::Directory,
    name: &str,
    to: StripeGeometry,
) -> Result<Outcome, PolicyChangeError> {
    let what = format!("{to} stripes");
    let planner = |s: &ClusterState| plan_restripe(s, name, to);
    carry_out(
        || dir.state(),
        |cmd| dir.propose(cmd),
        (name, &what),
        planner,
    )
    .await
}

/// The reason a step records: "policy raid1 ftt=1 (towards raid6 ftt=2)".
fn step_reason(step: &Policy, wanted: Option<&Policy>) -> String {
    match wanted {
        Some(w) => format!("{} (towards {w})", reason(step)),
        None => reason(step),
    }
}

/// What a proposed change did.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The volume had the policy already (a change to another one that
    /// was still wanted is no longer).
    Unchanged,
    /// The change began: the owner carries it through.
    Begun {
        /// Components added (as planned; the directory gives their ids).
        add: Vec<PlannedComponent>,
        /// Components to drop at the commit.
        remove: Vec<ComponentId>,
    },
}

/// Plans and proposes the change of volume `name` to `policy` through
/// `dir`.
pub async fn change(
    dir: &shoal_directory::Directory,
    name: &str,
    policy: &Policy,
) -> Result<Outcome, PolicyChangeError> {
    change_with(|| dir.state(), |cmd| dir.propose(cmd), name, policy).await
}

/// [`change`] over any view of the state and any proposer: plans from
/// `state()`, proposes, and plans and proposes once more if the volume's
/// generation moved meanwhile (the owner's resync of a copy raises it).
pub async fn change_with<S, P, F>(
    state: S,
    propose: P,
    name: &str,
    policy: &Policy,
) -> Result<Outcome, PolicyChangeError>
where
    S: Fn() -> Arc<ClusterState>,
    P: Fn(Command) -> F,
    F: Future<Output = Result<Response, DirectoryError>>,
{
    let what = policy.to_string();
    let planner = |s: &ClusterState| plan(s, name, policy);
    carry_out(state, propose, (name, &what), planner).await
}

/// Plans with `planner` from `state()` and proposes, planning and
/// proposing once more if the volume's generation moved meanwhile (the
/// owner's resync of a copy raises it). `what`: the volume's name and
/// what it is changed to, for the errors.
async fn carry_out<S, P, F, L>(
    state: S,
    propose: P,
    (name, what): (&str, &str),
    planner: L,
) -> Result<Outcome, PolicyChangeError>
where
    S: Fn() -> Arc<ClusterState>,
    P: Fn(Command) -> F,
    F: Future<Output = Result<Response, DirectoryError>>,
    L: Fn(&ClusterState) -> Result<Plan, PolicyChangeError>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        let cmd = match planner(&state())? {
            Plan::Unchanged => return Ok(Outcome::Unchanged),
            Plan::Keep(cmd) => {
                return match propose(cmd).await {
                    Ok(_) => Ok(Outcome::Unchanged),
                    Err(e) => Err(PolicyChangeError::Unavailable(e.to_string())),
                }
            }
            Plan::Begin(cmd) => cmd,
        };
        let Command::BeginReconfig {
            add,
            remove,
            policy: Some(step),
            reason: why,
            ..
        } = &cmd
        else {
            unreachable!("plan answers a begin with a policy");
        };
        let begun = Outcome::Begun {
            add: add.clone(),
            remove: remove.clone(),
        };
        let refused = |why: String| PolicyChangeError::Refused {
            volume: name.to_string(),
            policy: what.to_string(),
            why,
        };
        match propose(cmd.clone()).await {
            Ok(_) => return Ok(begun),
            Err(DirectoryError::State(shoal_directory::StateError::GenerationConflict {
                ..
            })) if tries < 2 => continue,
            Err(DirectoryError::State(e)) => {
                // A proposal applied twice (its first answer lost) is
                // refused the second time: the change stands all the same.
                if ours(state().volume_by_name(name), step, why) {
                    return Ok(begun);
                }
                return Err(refused(e.to_string()));
            }
            Err(e @ DirectoryError::Forbidden(_)) => return Err(refused(e.to_string())),
            Err(e) => return Err(PolicyChangeError::Unavailable(e.to_string())),
        }
    }
}

/// Whether `v` is in the change (step) to `step` recorded with `why`
/// (begun by this call or one just like it).
fn ours(v: Option<&Volume>, step: &Policy, why: &str) -> bool {
    v.and_then(|v| v.reconfig.as_ref())
        .is_some_and(|r| r.policy == Some(*step) && r.reason == why)
}

#[cfg(test)]
mod tests;
