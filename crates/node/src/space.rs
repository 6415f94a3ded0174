//! Space promised to reserved (thick) volumes on this node's devices.
//!
//! The directory promises a reserved volume only space that is free
//! (placement, and `ClusterState::apply` for creates and resizes racing
//! each other); the node then keeps other components from taking it: a
//! write may use the device's free space except what the *other*
//! components' reservations still lack (their reservation less the bytes
//! they have allocated). A reserved component uses its own share, and past
//! it competes like a thin one. Overwrites of allocated blocks always
//! proceed.
//!
//! Known limit: the check runs just before the store's write, outside the
//! store's lock, so writes running at the same moment on one device can
//! overshoot the promise by at most their own size. A strict guarantee
//! needs the store to count reservations under its lock (a per-component
//! reservation in `LogStore`'s space check).

use crate::replica::{Device, Replicas};
use shoal_directory::ClusterState;
use shoal_model::ComponentId;
use shoal_store::StoreError;
use std::collections::HashMap;

const BLOCK: u64 = 4096;

/// Reserved bytes per component of one device (reserved ones only).
pub type Reservations = HashMap<ComponentId, u64>;

/// Reads the reservation of every data component on this node's devices
/// from the directory (on every directory change).
pub fn update(state: &ClusterState, replicas: &Replicas) {
    for d in replicas.devices() {
        // From the directory, not the store: a component is created on its
        // device only when an owner first activates it, but its space is
        // promised from the volume's creation.
        let mut m = Reservations::new();
        for v in state.volumes.values() {
            let r = shoal_directory::state::reservation(v.size, &v.policy);
            if r == 0 {
                continue;
            }
            for c in v.data_components() {
                if c.device == d.id {
                    m.insert(c.id, r);
                }
            }
        }
        if let Ok(mut g) = d.reserved.lock() {
            if *g != m {
                *g = m;
            }
        }
    }
}

/// Bytes the reserved components of `d` (except `except`) were promised
/// and have not allocated yet.
pub fn lacking(d: &Device, except: Option<ComponentId>) -> u64 {
    let Ok(g) = d.reserved.lock() else {
        return 0;
    };
    g.iter()
        .filter(|(&c, _)| Some(c) != except)
        .map(|(&c, &r)| {
            let have = d.store.component(c).map(|m| m.allocated).unwrap_or(0);
            r.saturating_sub(have)
        })
        .fold(0u64, u64::saturating_add)
}

/// Refuses with `NoSpace` a write of `len` bytes at `offset` of
/// `component` that would take space promised to other components.
pub fn admit(d: &Device, component: ComponentId, offset: u64, len: u64) -> Result<(), StoreError> {
    let lacking = lacking(d, Some(component));
    if lacking == 0 || len == 0 {
        return Ok(());
    }
    let room = d
        .store
        .capacity()
        .saturating_sub(d.store.used())
        .saturating_sub(lacking);
    let start = offset / BLOCK * BLOCK;
    let end = offset.saturating_add(len).div_ceil(BLOCK) * BLOCK;
    if end - start <= room {
        return Ok(());
    }
    // Near the limit: count only the blocks the write would add.
    let allocated: u64 = d
        .store
        .allocated_ranges(component)
        .into_iter()
        .map(|(o, l)| {
            let (s, e) = (o.max(start), (o + l).div_ceil(BLOCK) * BLOCK);
            e.min(end).saturating_sub(s)
        })
        .sum();
    if (end - start).saturating_sub(allocated) <= room {
        Ok(())
    } else {
        Err(StoreError::NoSpace)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::Store;
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    fn device(path: &std::path::Path) -> Device {
        let store = Arc::new(Store::create(path, 64 * MIB, "test").expect("store"));
        Device::new(1, path.display().to_string(), store).expect("device")
    }

    /// Admits and performs a write as the replica does.
    fn write(d: &Device, c: ComponentId, off: u64, len: u64) -> Result<(), StoreError> {
        admit(d, c, off, len)?;
        d.store.write(c, off, &vec![0x5a; len as usize])
    }

    #[test]
    fn thin_writes_leave_reserved_space_free() {
        let path = std::env::temp_dir().join(format!("shoal-space-{}.img", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let d = device(&path);
        let (thin, thick) = (10, 20);
        d.store.create_component(thin, 1, 256 * MIB).expect("thin");
        d.store.create_component(thick, 2, 16 * MIB).expect("thick");
        d.reserved.lock().expect("lock").insert(thick, 16 * MIB);
        assert_eq!(lacking(&d, None), 16 * MIB);
        assert_eq!(lacking(&d, Some(thick)), 0);

        let left = d.store.capacity() - 16 * MIB;
        let mut at = 0;
        let refused = loop {
            match write(&d, thin, at, MIB) {
                Ok(()) => at += MIB,
                Err(e) => break e,
            }
            assert!(at <= 256 * MIB, "never refused");
        };
        assert!(matches!(refused, StoreError::NoSpace), "{refused:?}");
        assert!(
            at <= left && at + MIB > left,
            "refused at {at}, {left} left"
        );
        // Overwrites proceed; so does a write of what is left exactly.
        write(&d, thin, 0, MIB).expect("overwrite");
        let rest = (left - at) / 4096 * 4096;
        if rest > 0 {
            write(&d, thin, at, rest).expect("the rest");
        }
        assert!(write(&d, thin, at + rest, 4096).is_err());
        // The reserved component gets all it was promised.
        write(&d, thick, 0, 16 * MIB).expect("reserved space");
        assert_eq!(lacking(&d, None), 0);
        drop(d);
        let _ = std::fs::remove_file(&path);
    }
}
