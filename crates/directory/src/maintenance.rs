//! Nodes in maintenance and the removal of a node: the directory's half
//! (`docs/reconfiguration.md`, Maintenance mode).
//!
//! - [`Command::EnterMaintenance`] records a node's mode (entering again
//!   changes it) and marks each of its devices `maintenance`, so that
//!   placement, which sees only nodes and devices, puts nothing new there;
//!   a device the node registers meanwhile is marked too. The directory
//!   also refuses a new component on such a node (`check_placed`), so a
//!   placement made from an older snapshot cannot land there either.
//! - [`Command::ExitMaintenance`] clears both.
//! - [`Command::RemoveNode`] removes a node that holds no component: its
//!   record, its devices, its maintenance state, and its certificates,
//!   which are revoked (a removed node comes back only by joining anew).
//!
//! Which components a mode moves, and the changes that move them, are the
//! node's (`shoal_node::maintenance`): the directory only records.

use crate::state::{input, ClusterState, Command, Response};
use crate::StateError;
use shoal_model::{MaintenanceMode, NodeId};

impl ClusterState {
    /// The maintenance mode of `node`, if it is in maintenance.
    pub fn maintenance_of(&self, node: NodeId) -> Option<MaintenanceMode> {
        self.maintenance.get(&node).copied()
    }

    /// How many components (of any volume, in any state, also those a
    /// change in progress adds or drops) are on `node`.
    pub fn components_on(&self, node: NodeId) -> usize {
        self.volumes
            .values()
            .flat_map(|v| &v.components)
            .filter(|c| c.node == node)
            .count()
    }

    /// Marks the devices of `node` as its maintenance state says.
    fn mark_devices(&mut self, node: NodeId) {
        let on = self.maintenance.contains_key(&node);
        for d in self.devices.values_mut().filter(|d| d.node == node) {
            d.maintenance = on;
        }
    }

    pub(crate) fn apply_maintenance(&mut self, cmd: &Command) -> Result<Response, StateError> {
        match cmd {
            Command::EnterMaintenance { node, mode } => {
                if !self.nodes.contains_key(node) {
                    return Err(StateError::NoSuchNode(*node));
                }
                self.maintenance.insert(*node, *mode);
                self.mark_devices(*node);
                Ok(Response::Ok)
            }
            Command::ExitMaintenance { node } => {
                if self.maintenance.remove(node).is_none() {
                    return Err(StateError::NotInMaintenance(*node));
                }
                self.mark_devices(*node);
                Ok(Response::Ok)
            }
            Command::RemoveNode { node } => {
                if !self.nodes.contains_key(node) {
                    return Err(StateError::NoSuchNode(*node));
                }
                let components = self.components_on(*node);
                if components > 0 {
                    return Err(StateError::NodeHoldsComponents {
                        node: *node,
                        components,
                    });
                }
                self.nodes.remove(node);
                self.devices.retain(|_, d| d.node != *node);
                self.maintenance.remove(node);
                if let Some(certs) = self.node_certs.remove(node) {
                    self.revoked_certs.extend(certs);
                }
                Ok(Response::Ok)
            }
            _ => Err(input("not a maintenance command")),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::state::tests::node;
    use crate::state::{ClusterState, Command, PlannedComponent, Response, StateError};
    use shoal_model::{ComponentRole, MaintenanceMode, NodeState};

    /// Four nodes with a device each and an `ftt=0` volume on node 2.
    fn setup() -> ClusterState {
        let mut s = ClusterState::default();
        for n in 1..=4 {
            s.apply(&Command::RegisterNode { node: node(n) }).unwrap();
            s.apply(&Command::RegisterDevice {
                node: n,
                path: "/a".into(),
                capacity: 1 << 30,
                store_uuid: 0,
            })
            .unwrap();
        }
        s.apply(&Command::CreateVolume {
            name: "v".into(),
            size: 1 << 20,
            policy: "ftt=0".parse().unwrap(),
            wrapped_key: None,
            components: vec![planned(2)],
        })
        .unwrap();
        s
    }

    fn planned(n: u64) -> PlannedComponent {
        PlannedComponent {
            role: ComponentRole::Data,
            node: n,
            device: n,
            votes: 1,
        }
    }

    fn enter(node: u64, mode: MaintenanceMode) -> Command {
        Command::EnterMaintenance { node, mode }
    }

    #[test]
    fn a_node_in_maintenance_takes_no_new_component_until_it_exits() {
        let mut s = setup();
        s.apply(&enter(3, MaintenanceMode::EnsureAccessibility))
            .unwrap();
        assert_eq!(
            s.maintenance_of(3),
            Some(MaintenanceMode::EnsureAccessibility)
        );
        assert!(s.devices[&3].maintenance && !s.devices[&2].maintenance);
        // Entering again changes the mode.
        s.apply(&enter(3, MaintenanceMode::FullDataMigration))
            .unwrap();
        assert_eq!(
            s.maintenance_of(3),
            Some(MaintenanceMode::FullDataMigration)
        );
        // A device registered meanwhile is marked too.
        let Response::Id(d) = s
            .apply(&Command::RegisterDevice {
                node: 3,
                path: "/b".into(),
                capacity: 1 << 30,
                store_uuid: 0,
            })
            .unwrap()
        else {
            panic!("no id")
        };
        assert!(s.devices[&d].maintenance);
        // Nothing new is placed there, by a create or a change.
        let before = s.clone();
        let create = Command::CreateVolume {
            name: "w".into(),
            size: 1 << 20,
            policy: "ftt=0".parse().unwrap(),
            wrapped_key: None,
            components: vec![planned(3)],
        };
        assert_eq!(s.apply(&create), Err(StateError::NodeInMaintenance(3)));
        let v = s.volume_by_name("v").unwrap().id;
        let begin = Command::BeginReconfig {
            volume: v,
            generation: 0,
            add: vec![planned(3)],
            remove: vec![],
            policy: None,
            reason: "test".into(),
            wanted: None,
        };
        assert_eq!(s.apply(&begin), Err(StateError::NodeInMaintenance(3)));
        assert_eq!(s, before);
        s.apply(&Command::ExitMaintenance { node: 3 }).unwrap();
        assert_eq!(s.maintenance_of(3), None);
        assert!(s.devices.values().all(|d| !d.maintenance));
        s.apply(&create).unwrap();
    }

    #[test]
    fn maintenance_commands_refuse_unknown_nodes_and_change_nothing() {
        let mut s = setup();
        let before = s.clone();
        assert_eq!(
            s.apply(&enter(9, MaintenanceMode::NoDataMigration)),
            Err(StateError::NoSuchNode(9))
        );
        let e = s.apply(&Command::ExitMaintenance { node: 1 }).unwrap_err();
        assert_eq!(e, StateError::NotInMaintenance(1));
        assert!(e.to_string().contains("not in maintenance"), "{e}");
        assert_eq!(s, before);
    }

    #[test]
    fn a_node_is_removed_only_once_it_holds_nothing() {
        let mut s = setup();
        let sha = "a".repeat(64);
        s.apply(&Command::RecordNodeCert {
            node: 2,
            cert_sha256: sha.clone(),
        })
        .unwrap();
        s.apply(&enter(2, MaintenanceMode::FullDataMigration))
            .unwrap();
        let before = s.clone();
        let e = s.apply(&Command::RemoveNode { node: 2 }).unwrap_err();
        assert_eq!(
            e,
            StateError::NodeHoldsComponents {
                node: 2,
                components: 1
            }
        );
        assert!(e.to_string().contains("holds 1 component"), "{e}");
        assert_eq!(s, before);
        s.apply(&Command::DeleteVolume { name: "v".into() })
            .unwrap();
        s.apply(&Command::RemoveNode { node: 2 }).unwrap();
        assert!(!s.nodes.contains_key(&2));
        assert!(s.devices.values().all(|d| d.node != 2));
        assert_eq!(s.maintenance_of(2), None);
        assert!(s.revoked_certs.contains(&sha), "its certificates revoked");
        assert_eq!(
            s.apply(&Command::RemoveNode { node: 2 }),
            Err(StateError::NoSuchNode(2))
        );
        // A node that holds nothing needs no maintenance first.
        s.apply(&Command::SetNodeState {
            node: 4,
            state: NodeState::Down,
        })
        .unwrap();
        s.apply(&Command::RemoveNode { node: 4 }).unwrap();
        assert_eq!(s.nodes.len(), 2);
    }
}
