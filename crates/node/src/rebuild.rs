//! Where lost components are rebuilt: the directory's side of an owner's
//! request to rebuild (`shoal_owner::Control::begin_rebuild`). Chooses a
//! replacement for each lost component with `shoal_placement::replacement`
//! (another fault domain, the same role, the space the policy reserves),
//! the replacements apart from each other too, and builds the
//! `BeginReconfig` that adds them and drops the lost ones. Pure: the state
//! is given, nothing is proposed here.

use shoal_directory::{ClusterState, Command, PlannedComponent};
use shoal_model::{Component, ComponentId, ComponentState, Generation, VolumeId};
use shoal_placement::PlacementError;

/// Why a volume's lost components cannot be rebuilt now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RebuildError {
    #[error("volume {0} does not exist")]
    NoSuchVolume(VolumeId),
    #[error("volume {0} is already being reconfigured")]
    InProgress(String),
    #[error("nothing to rebuild")]
    Nothing,
    #[error("cannot rebuild component {component}: {error}")]
    Placement {
        component: ComponentId,
        error: PlacementError,
    },
}

/// A new home for each of `comps` of `v` (same role, a fault domain the
/// volume does not use), the replacements apart from each other too: the
/// ones chosen so far join the volume placement sees. Rebuilds and
/// maintenance moves place their replacements so.
pub fn replacements(
    state: &ClusterState,
    v: &shoal_model::Volume,
    comps: &[ComponentId],
) -> Result<Vec<PlannedComponent>, (ComponentId, PlacementError)> {
    let nodes: Vec<_> = state.nodes.values().cloned().collect();
    let devices: Vec<_> = state.devices.values().cloned().collect();
    let mut seen = v.clone();
    let mut add = Vec::with_capacity(comps.len());
    for (k, &id) in comps.iter().enumerate() {
        let p = shoal_placement::replacement(&v.policy, &seen, id, &nodes, &devices)
            .map_err(|e| (id, e))?;
        seen.components.push(Component {
            // Never a real id: ids count up from 1.
            id: u64::MAX - k as u64,
            role: p.role,
            node: p.node,
            device: p.device,
            state: ComponentState::Reconfiguring,
            votes: p.votes,
        });
        add.push(PlannedComponent {
            role: p.role,
            node: p.node,
            device: p.device,
            votes: p.votes,
        });
    }
    Ok(add)
}

/// The change that moves `comps` of `v` elsewhere (a replacement placed
/// for each, as [`replacements`] places them, and `comps` dropped) for
/// `reason`: the moves of maintenance and of a device's removal.
pub fn move_off(
    state: &ClusterState,
    v: &shoal_model::Volume,
    comps: &[ComponentId],
    reason: String,
) -> Result<Command, String> {
    let add = replacements(state, v, comps)
        .map_err(|(id, e)| format!("no place for a replacement of component {id}: {e}"))?;
    Ok(Command::BeginReconfig {
        volume: v.id,
        generation: v.generation,
        add,
        remove: comps.to_vec(),
        policy: None,
        reason,
        wanted: None,
    })
}

/// The command that begins rebuilding `lost` components of `volume`
/// elsewhere, under the owner's `generation`.
pub fn plan(
    state: &ClusterState,
    volume: VolumeId,
    generation: Generation,
    lost: &[ComponentId],
) -> Result<Command, RebuildError> {
    let v = state
        .volumes
        .get(&volume)
        .ok_or(RebuildError::NoSuchVolume(volume))?;
    if v.reconfig.is_some() {
        return Err(RebuildError::InProgress(v.name.clone()));
    }
    let lost: Vec<ComponentId> = lost
        .iter()
        .copied()
        .filter(|id| v.components.iter().any(|c| c.id == *id))
        .collect();
    if lost.is_empty() {
        return Err(RebuildError::Nothing);
    }
    let add = replacements(state, v, &lost)
        .map_err(|(component, error)| RebuildError::Placement { component, error })?;
    let names: Vec<String> = lost.iter().map(|id| id.to_string()).collect();
    Ok(Command::BeginReconfig {
        volume,
        generation,
        add,
        remove: lost,
        policy: None,
        reason: format!("rebuild of component {}", names.join(", ")),
        wanted: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use shoal_model::{ComponentRole, NodeState};

    /// `n` nodes with a device each and a raid1 ftt=1 volume on nodes 1-3
    /// (copies on 1 and 2, witness on 3).
    fn cluster(n: u64) -> (ClusterState, VolumeId) {
        crate::testing::mirrored(n)
    }

    fn on_node(s: &ClusterState, v: VolumeId, node: u64) -> ComponentId {
        let comps = &s.volumes[&v].components;
        comps.iter().find(|c| c.node == node).unwrap().id
    }

    #[test]
    fn a_lost_copy_goes_to_the_free_fault_domain_and_the_begin_applies() {
        let (mut s, v) = cluster(4);
        s.apply(&Command::SetNodeState {
            node: 2,
            state: NodeState::Down,
        })
        .unwrap();
        let lost = on_node(&s, v, 2);
        let begin = plan(&s, v, 0, &[lost]).unwrap();
        let Command::BeginReconfig { add, remove, .. } = &begin else {
            panic!("{begin:?}");
        };
        assert_eq!(remove, &vec![lost]);
        assert_eq!(add.len(), 1);
        assert_eq!((add[0].node, add[0].role), (4, ComponentRole::Data));
        s.apply(&begin).unwrap();
        assert!(s.volumes[&v].reconfig.is_some());
        assert!(matches!(
            plan(&s, v, 0, &[lost]),
            Err(RebuildError::InProgress(_))
        ));
    }

    #[test]
    fn two_lost_components_go_to_two_different_domains() {
        let (mut s, v) = cluster(5);
        for n in [2, 3] {
            s.apply(&Command::SetNodeState {
                node: n,
                state: NodeState::Down,
            })
            .unwrap();
        }
        let lost = [on_node(&s, v, 2), on_node(&s, v, 3)];
        let Command::BeginReconfig { add, .. } = plan(&s, v, 0, &lost).unwrap() else {
            panic!("not a begin");
        };
        let mut nodes: Vec<u64> = add.iter().map(|a| a.node).collect();
        nodes.sort();
        assert_eq!(nodes, vec![4, 5]);
    }

    #[test]
    fn without_a_free_fault_domain_the_reason_is_given() {
        let (mut s, v) = cluster(3);
        s.apply(&Command::SetNodeState {
            node: 2,
            state: NodeState::Down,
        })
        .unwrap();
        let err = plan(&s, v, 0, &[on_node(&s, v, 2)]).unwrap_err();
        assert!(matches!(err, RebuildError::Placement { .. }), "{err}");
        assert!(err.to_string().contains("fault domains"), "{err}");
    }
}
