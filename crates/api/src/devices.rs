//! Adding and removing a node's devices while it runs, on the REST API
//! (`docs/reconfiguration.md`, Adding and removing devices):
//!
//! | call | role | what |
//! |---|---|---|
//! | `POST /v1/devices` | admin | open (or format) a device on a node and serve it at once ([`AddDevice`] → [`DeviceAdded`]); any node takes it and hands it to the device's node |
//! | `GET /v1/devices/{id}` | read-only | a device and what its removal still waits for ([`DeviceRemoval`]) |
//! | `DELETE /v1/devices/{id}` | admin | remove a device: its components move off it, then its node closes it and it leaves the directory ([`DeviceRemoval`]) |
//! | `POST /v1/devices/{id}/keep` | admin | call a removal off while the device still holds components (those already moving still move); 409 once it holds none ([`DeviceRemoval`]) |

use crate::{ApiError, Client};
use serde::{Deserialize, Serialize};
use shoal_model::{DeviceId, NodeId};

/// Body of `POST /v1/devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddDevice {
    pub node: NodeId,
    /// Absolute path on that node: a block device or a file. A new file
    /// is created with `size_bytes`; an existing one must be empty (all
    /// zeros at its start) or a device of this cluster.
    pub path: String,
    /// Size of a file to create; a file or block device that exists keeps
    /// its own.
    #[serde(default)]
    pub size_bytes: Option<u64>,
    /// Create the file written in full (zeros) rather than sparse.
    #[serde(default)]
    pub thick: bool,
}

/// Answer to `POST /v1/devices`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceAdded {
    pub device: DeviceId,
    pub node: NodeId,
    pub path: String,
    /// Usable bytes for component data.
    pub capacity: u64,
}

/// A device and its removal, as the directory has it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRemoval {
    pub device: DeviceId,
    pub node: NodeId,
    pub path: String,
    /// Being removed.
    pub retiring: bool,
    /// Components still on the device (of any volume, in any state).
    pub components: usize,
    /// The volumes of those components, by name.
    pub volumes: Vec<String>,
    /// Of those volumes, the ones with a change of layout in progress now.
    pub changing: Vec<String>,
    /// Why a component cannot move now, if its node said so (no other
    /// device or fault domain, no space).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocked: Option<String>,
}

impl Client {
    /// Adds a device to a node (admin).
    pub async fn add_device(&self, req: &AddDevice) -> Result<DeviceAdded, ApiError> {
        self.post("/v1/devices", req).await
    }

    /// A device and what its removal still waits for.
    pub async fn device(&self, id: DeviceId) -> Result<DeviceRemoval, ApiError> {
        self.get(&format!("/v1/devices/{id}")).await
    }

    /// Begins removing a device (admin): answers at once; the device
    /// leaves once its components have moved off it.
    pub async fn remove_device(&self, id: DeviceId) -> Result<DeviceRemoval, ApiError> {
        self.delete(&format!("/v1/devices/{id}")).await
    }

    /// Calls a device's removal off (admin), while it still holds
    /// components.
    pub async fn keep_device(&self, id: DeviceId) -> Result<DeviceRemoval, ApiError> {
        self.post(&format!("/v1/devices/{id}/keep"), &()).await
    }
}
