//! Space promised to reserved (thick) volumes on this node's devices.
//!
//! The directory promises a reserved volume only space that is free
//! (placement, and `ClusterState::apply` for creates and resizes racing
//! each other); the node hands each device's promises to its store
//! ([`LogStore::set_reservations`](shoal_store::LogStore::set_reservations)),
//! which keeps other components from taking that space: a write may use
//! the device's free space except what the *other* components'
//! reservations still lack (their reservation less the blocks they have
//! mapped). A reserved component uses its own share, and past it competes
//! like a thin one. Overwrites of mapped blocks always proceed. The store
//! checks this under its own lock, so writes racing each other cannot
//! overshoot the promise.

use crate::replica::Replicas;
use shoal_directory::ClusterState;
use shoal_model::ComponentId;
use std::collections::HashMap;

/// Reserved bytes per component of one device (reserved ones only).
pub type Reservations = HashMap<ComponentId, u64>;

/// Reads the reservation of every data component on this node's devices
/// from the directory (on every directory change) and hands it to the
/// device's store.
pub fn update(state: &ClusterState, replicas: &Replicas) {
    for d in replicas.devices() {
        // From the directory, not the store: a component is created on its
        // device only when an owner first activates it, but its space is
        // promised from the volume's creation.
        let mut m = Reservations::new();
        for v in state.volumes.values() {
            // During a growth, for the size it grows to (reserved when the
            // growth was recorded).
            let r = shoal_directory::state::reservation(v.provisioned_size(), &v.policy);
            if r == 0 {
                continue;
            }
            for c in v.data_components() {
                if c.device == d.id {
                    m.insert(c.id, r);
                }
            }
        }
        d.store.set_reservations(&m);
    }
}
