//! The removal of a device while its node runs: the directory's half
//! (`docs/reconfiguration.md`, Adding and removing devices).
//!
//! - [`Command::RetireDevice`] marks the device `retiring` (refused for
//!   the last device of its node not being removed already): placement
//!   puts nothing new on it, and the directory refuses a new component
//!   there (`check_placed`), so a placement made from an older snapshot
//!   cannot land there either.
//! - [`Command::UnregisterDevice`] removes a retiring device that holds
//!   no component (of any volume, in any state, also those a change in
//!   progress adds or drops). Only its node proposes it, after closing it.
//!
//! - [`Command::KeepDevice`] calls a removal off while the device still
//!   holds components. A retiring device only ever loses components, so
//!   once it holds none it stays empty, and its node may close it: from
//!   then on the removal cannot be called off.
//!
//! Which components move and the changes that move them are the node's
//! (`shoal_node::devices`): the directory only records.

use crate::state::{input, ClusterState, Command, Response};
use crate::StateError;
use shoal_model::DeviceId;

impl ClusterState {
    /// How many components (of any volume, in any state, also those a
    /// change in progress adds or drops) are on `device`.
    pub fn components_on_device(&self, device: DeviceId) -> usize {
        self.volumes
            .values()
            .flat_map(|v| &v.components)
            .filter(|c| c.device == device)
            .count()
    }

    pub(crate) fn apply_device_removal(&mut self, cmd: &Command) -> Result<Response, StateError> {
        match cmd {
            Command::RetireDevice { device } => {
                let d = self
                    .devices
                    .get(device)
                    .ok_or(StateError::NoSuchDevice(*device))?;
                let node = d.node;
                // Decided here, on the state every command sees in order:
                // two removals checked on the same snapshot cannot both
                // pass and leave a node without a device.
                // A failed device (one its node does not serve) is no
                // device to keep the node's components on.
                let others = self.devices.values().any(|o| {
                    o.node == node
                        && o.id != *device
                        && !o.retiring
                        && o.state != shoal_model::DeviceState::Failed
                });
                if !d.retiring && !others {
                    return Err(StateError::LastDevice {
                        device: *device,
                        node,
                    });
                }
                if let Some(d) = self.devices.get_mut(device) {
                    d.retiring = true;
                }
                Ok(Response::Ok)
            }
            Command::UnregisterDevice { device } => {
                let d = self
                    .devices
                    .get(device)
                    .ok_or(StateError::NoSuchDevice(*device))?;
                if !d.retiring {
                    return Err(StateError::DeviceNotRetiring(*device));
                }
                let components = self.components_on_device(*device);
                if components > 0 {
                    return Err(StateError::DeviceHoldsComponents {
                        device: *device,
                        components,
                    });
                }
                self.devices.remove(device);
                Ok(Response::Ok)
            }
            Command::KeepDevice { device } => {
                let d = self
                    .devices
                    .get(device)
                    .ok_or(StateError::NoSuchDevice(*device))?;
                if !d.retiring {
                    return Ok(Response::Ok);
                }
                if self.components_on_device(*device) == 0 {
                    return Err(StateError::DeviceEmptied(*device));
                }
                if let Some(d) = self.devices.get_mut(device) {
                    d.retiring = false;
                }
                Ok(Response::Ok)
            }
            _ => Err(input("not a device removal command")),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::state::tests::node;
    use crate::state::{ClusterState, Command, PlannedComponent, Response, StateError};
    use shoal_model::ComponentRole;

    /// Two nodes, node 1 with devices 1 ("/a") and 3 ("/b"), node 2 with
    /// device 2; an `ftt=0` volume on device 1.
    fn setup() -> ClusterState {
        let mut s = ClusterState::default();
        for n in 1..=2 {
            s.apply(&Command::RegisterNode { node: node(n) }).unwrap();
            s.apply(&Command::RegisterDevice {
                node: n,
                path: "/a".into(),
                capacity: 1 << 30,
                store_uuid: 0,
            })
            .unwrap();
        }
        let r = s.apply(&Command::RegisterDevice {
            node: 1,
            path: "/b".into(),
            capacity: 1 << 30,
            store_uuid: 0,
        });
        assert_eq!(r, Ok(Response::Id(3)));
        s.apply(&Command::CreateVolume {
            name: "v".into(),
            size: 1 << 20,
            policy: "ftt=0".parse().unwrap(),
            wrapped_key: None,
            components: vec![planned(1, 1)],
        })
        .unwrap();
        s
    }

    fn planned(node: u64, device: u64) -> PlannedComponent {
        PlannedComponent {
            role: ComponentRole::Data,
            node,
            device,
            votes: 1,
        }
    }

    #[test]
    fn a_retiring_device_takes_nothing_new_and_leaves_once_empty() {
        let mut s = setup();
        s.apply(&Command::RetireDevice { device: 1 }).unwrap();
        // Again: no change, no error.
        s.apply(&Command::RetireDevice { device: 1 }).unwrap();
        assert!(s.devices[&1].retiring && !s.devices[&1].accepts_components());
        let before = s.clone();
        let create = Command::CreateVolume {
            name: "w".into(),
            size: 1 << 20,
            policy: "ftt=0".parse().unwrap(),
            wrapped_key: None,
            components: vec![planned(1, 1)],
        };
        assert_eq!(s.apply(&create), Err(StateError::DeviceRetiring(1)));
        // Not while it holds a component.
        let e = s
            .apply(&Command::UnregisterDevice { device: 1 })
            .unwrap_err();
        assert_eq!(
            e,
            StateError::DeviceHoldsComponents {
                device: 1,
                components: 1
            }
        );
        assert_eq!(s, before);
        // Moved to device 3 (same node), then it goes.
        let v = s.volume_by_name("v").unwrap().clone();
        let old = v.components[0].id;
        s.apply(&Command::BeginReconfig {
            volume: v.id,
            generation: v.generation,
            add: vec![planned(1, 3)],
            remove: vec![old],
            policy: None,
            reason: "test".into(),
            wanted: None,
        })
        .unwrap();
        assert!(s.apply(&Command::UnregisterDevice { device: 1 }).is_err());
        let added = s.volume_by_name("v").unwrap().components[1].id;
        s.apply(&Command::CommitReconfig {
            volume: v.id,
            generation: v.generation,
            added: vec![added],
            remove: vec![old],
        })
        .unwrap();
        s.apply(&Command::UnregisterDevice { device: 1 }).unwrap();
        assert!(!s.devices.contains_key(&1));
        assert_eq!(s.devices[&3].provisioned, 1 << 20);
        // Registering the same path again gives a new id.
        let r = s.apply(&Command::RegisterDevice {
            node: 1,
            path: "/a".into(),
            capacity: 1 << 30,
            store_uuid: 0,
        });
        assert!(matches!(r, Ok(Response::Id(id)) if id > 3), "{r:?}");
    }

    #[test]
    fn a_failed_device_does_not_count_as_the_node_keeping_one() {
        let mut s = setup();
        s.apply(&Command::ReportDeviceUsage {
            device: 3,
            used: 0,
            state: shoal_model::DeviceState::Failed,
        })
        .unwrap();
        assert_eq!(
            s.apply(&Command::RetireDevice { device: 1 }),
            Err(StateError::LastDevice { device: 1, node: 1 })
        );
        s.apply(&Command::ReportDeviceUsage {
            device: 3,
            used: 0,
            state: shoal_model::DeviceState::Healthy,
        })
        .unwrap();
        s.apply(&Command::RetireDevice { device: 1 }).unwrap();
    }

    #[test]
    fn a_removal_is_called_off_only_while_the_device_holds_components() {
        let mut s = setup();
        // In service: no change.
        s.apply(&Command::KeepDevice { device: 1 }).unwrap();
        assert!(!s.devices[&1].retiring);
        assert_eq!(
            s.apply(&Command::KeepDevice { device: 9 }),
            Err(StateError::NoSuchDevice(9))
        );
        // Retiring with the volume's copy on it: kept, and usable again.
        s.apply(&Command::RetireDevice { device: 1 }).unwrap();
        s.apply(&Command::KeepDevice { device: 1 }).unwrap();
        assert!(s.devices[&1].accepts_components());
        assert_eq!(
            s.apply(&Command::UnregisterDevice { device: 1 }),
            Err(StateError::DeviceNotRetiring(1))
        );
        // Retiring and empty (device 3 holds nothing): its node may be
        // closing it, so the removal stands.
        let r = s.apply(&Command::RetireDevice { device: 3 });
        assert_eq!(r, Ok(Response::Ok));
        let before = s.clone();
        assert_eq!(
            s.apply(&Command::KeepDevice { device: 3 }),
            Err(StateError::DeviceEmptied(3))
        );
        assert_eq!(s, before);
    }

    #[test]
    fn removal_commands_refuse_unknown_or_active_devices_and_change_nothing() {
        let mut s = setup();
        let before = s.clone();
        assert_eq!(
            s.apply(&Command::RetireDevice { device: 9 }),
            Err(StateError::NoSuchDevice(9))
        );
        // A node's last device is not retired: node 2's only one, then
        // node 1's second once its first is retiring.
        assert_eq!(
            s.apply(&Command::RetireDevice { device: 2 }),
            Err(StateError::LastDevice { device: 2, node: 2 })
        );
        let mut two = s.clone();
        two.apply(&Command::RetireDevice { device: 1 }).unwrap();
        let e = two.apply(&Command::RetireDevice { device: 3 }).unwrap_err();
        assert_eq!(e, StateError::LastDevice { device: 3, node: 1 });
        assert!(e.to_string().contains("shoal device add 1"), "{e}");
        assert_eq!(
            s.apply(&Command::UnregisterDevice { device: 9 }),
            Err(StateError::NoSuchDevice(9))
        );
        // An empty device in service is not removed without retiring.
        let e = s
            .apply(&Command::UnregisterDevice { device: 3 })
            .unwrap_err();
        assert_eq!(e, StateError::DeviceNotRetiring(3));
        assert!(e.to_string().contains("shoal device remove 3"), "{e}");
        assert_eq!(s, before);
        // Only the device's node may unregister it.
        assert_eq!(s.actor(&Command::UnregisterDevice { device: 3 }), Some(1));
    }
}
