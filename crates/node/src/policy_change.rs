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
use shoal_model::{ComponentId, Layout, Policy, PolicyError, Volume};
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
    /// A change between layouts other than RAID-1 to RAID-5/6 of the same
    /// ftt, or of an erasure-coded volume: not built yet.
    #[error(
        "volume {volume} cannot change from {from} to {policy}: a change from {from_layout} to \
         {to_layout} is not available yet; ftt changes within raid1 are, and raid1 ftt=1 to \
         raid5, raid1 ftt=2 to raid6"
    )]
    Layout {
        volume: String,
        from: String,
        policy: String,
        from_layout: Layout,
        to_layout: Layout,
    },
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
            | PolicyChangeError::Layout { .. }
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
    // Within RAID-1, or from RAID-1 to RAID-5/6 of the same ftt (a
    // capacity leg added behind the copies).
    let to_erasure = v.policy.layout == Layout::Raid1
        && policy.layout.is_erasure()
        && v.policy.ftt == policy.ftt;
    if (v.policy.layout, policy.layout) != (Layout::Raid1, Layout::Raid1) && !to_erasure {
        return Err(PolicyChangeError::Layout {
            volume: v.name.clone(),
            from: v.policy.to_string(),
            policy: policy.to_string(),
            from_layout: v.policy.layout,
            to_layout: policy.layout,
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
    let change =
        shoal_placement::policy_change(v, policy, &nodes, &devices).map_err(
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
        policy: Some(*policy),
        reason: reason(policy),
    }))
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
    let mut tries = 0;
    loop {
        tries += 1;
        let cmd = match plan(&state(), name, policy)? {
            Plan::Unchanged => return Ok(Outcome::Unchanged),
            Plan::Keep(cmd) => {
                return match propose(cmd).await {
                    Ok(_) => Ok(Outcome::Unchanged),
                    Err(e) => Err(PolicyChangeError::Unavailable(e.to_string())),
                }
            }
            Plan::Begin(cmd) => cmd,
        };
        let Command::BeginReconfig { add, remove, .. } = &cmd else {
            unreachable!("plan answers a begin");
        };
        let begun = Outcome::Begun {
            add: add.clone(),
            remove: remove.clone(),
        };
        let refused = |why: String| PolicyChangeError::Refused {
            volume: name.to_string(),
            policy: policy.to_string(),
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
                if ours(state().volume_by_name(name), policy) {
                    return Ok(begun);
                }
                return Err(refused(e.to_string()));
            }
            Err(e @ DirectoryError::Forbidden(_)) => return Err(refused(e.to_string())),
            Err(e) => return Err(PolicyChangeError::Unavailable(e.to_string())),
        }
    }
}

/// Whether `v` is in the change to `policy` (begun by this call or one
/// just like it).
fn ours(v: Option<&Volume>, policy: &Policy) -> bool {
    v.and_then(|v| v.reconfig.as_ref())
        .is_some_and(|r| r.policy == Some(*policy) && r.reason == reason(policy))
}

#[cfg(test)]
mod tests;
