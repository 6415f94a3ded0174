//! Maintenance mode and node removal on the REST API
//! (`docs/reconfiguration.md`, Maintenance mode):
//!
//! | call | role | what |
//! |---|---|---|
//! | `GET /v1/maintenance` | read-only | every node in maintenance ([`MaintenanceReport`]) |
//! | `GET /v1/nodes/{id}/maintenance` | read-only | one node (its `mode` is null when it is not in maintenance) |
//! | `POST /v1/nodes/{id}/maintenance` | admin | enter, or change the mode ([`EnterMaintenance`] → [`MaintenanceEntered`]); 409 naming each volume when the mode would leave one inaccessible |
//! | `DELETE /v1/nodes/{id}/maintenance` | admin | exit (changes begun finish; nothing moves back) |
//! | `POST /v1/nodes/{id}/remove` | admin | remove a node that holds nothing ([`NodeRemoved`]) |

use crate::{ApiError, Client};
use serde::{Deserialize, Serialize};
use shoal_model::{MaintenanceMode, NodeId};

/// Body of `POST /v1/nodes/{id}/maintenance`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnterMaintenance {
    pub mode: MaintenanceMode,
}

/// A node's maintenance as the directory has it now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MaintenanceReport {
    pub node: NodeId,
    /// None: the node is not in maintenance.
    pub mode: Option<MaintenanceMode>,
    /// Components still on the node that its mode moves off it.
    pub components_to_move: usize,
    /// The volumes of those components, by name.
    pub volumes: Vec<String>,
    /// Of those volumes, the ones with a change of layout in progress now
    /// (being moved, or waiting for another change to end).
    pub changing: Vec<String>,
    /// Every component on the node (what its removal waits for).
    pub components_on_node: usize,
    /// In maintenance and nothing left to move: the node can be taken
    /// down (and, with nothing on it at all, removed).
    pub ready: bool,
}

/// Answer to `POST /v1/nodes/{id}/maintenance`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MaintenanceEntered {
    pub report: MaintenanceReport,
    /// Volumes whose move began with this call.
    pub begun: Vec<String>,
    /// Volumes whose move waits for another change of theirs to end: the
    /// node that took the call begins them later (every few seconds, for
    /// as long as it runs; entering again resumes it elsewhere).
    pub waiting: Vec<String>,
}

/// Answer to `POST /v1/nodes/{id}/remove`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRemoved {
    pub node: NodeId,
    /// It was a voter of the directory (Raft) and was removed from them.
    pub was_voter: bool,
}

impl Client {
    /// Every node in maintenance.
    pub async fn maintenance(&self) -> Result<Vec<MaintenanceReport>, ApiError> {
        self.get("/v1/maintenance").await
    }

    /// One node's maintenance.
    pub async fn node_maintenance(&self, node: NodeId) -> Result<MaintenanceReport, ApiError> {
        self.get(&format!("/v1/nodes/{node}/maintenance")).await
    }

    /// Puts a node in maintenance (admin), beginning the moves its mode
    /// asks for; refused, changing nothing, when the mode would leave a
    /// volume inaccessible.
    pub async fn enter_maintenance(
        &self,
        node: NodeId,
        mode: MaintenanceMode,
    ) -> Result<MaintenanceEntered, ApiError> {
        self.post(
            &format!("/v1/nodes/{node}/maintenance"),
            &EnterMaintenance { mode },
        )
        .await
    }

    /// Takes a node out of maintenance (admin).
    pub async fn exit_maintenance(&self, node: NodeId) -> Result<MaintenanceReport, ApiError> {
        self.delete(&format!("/v1/nodes/{node}/maintenance")).await
    }

    /// Removes a node that holds no component (admin): from the
    /// directory and from the directory's voters.
    pub async fn remove_node(&self, node: NodeId) -> Result<NodeRemoved, ApiError> {
        self.post(&format!("/v1/nodes/{node}/remove"), &serde_json::json!({}))
            .await
    }
}
