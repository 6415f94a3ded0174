//! The read route: the in-sync copy on the owner's own node, published in
//! the shared [`crate::ReadRoute`] so that [`crate::Owner`] handles send
//! reads to it without a round through the loop. Set only while that copy
//! is in sync; withdrawn before any write is acknowledged without it.

use super::replica::Mode;
use super::Loop;
use crate::{Control, LocalRead};
use shoal_model::Generation;
use std::sync::Arc;

/// What the route holds: the replica, the generation and size it reads
/// under, and which connection (by address of the shared `Peer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Routed {
    pub(super) idx: usize,
    pub(super) generation: Generation,
    pub(super) size: u64,
    pub(super) conn: usize,
}

impl<C: Control> Loop<C> {
    /// The replica reads may go to without the loop: an in-sync data copy
    /// on this node with a connection.
    pub(super) fn local_copy(&self) -> Option<usize> {
        self.replicas.iter().position(|r| {
            r.node == self.cfg.node && r.is_data() && r.mode == Mode::InSync && r.peer.is_some()
        })
    }

    /// What the route should hold now.
    pub(super) fn route_now(&self) -> Option<Routed> {
        let idx = self.local_copy()?;
        if self.reconcile.as_ref().is_some_and(|rc| rc.source != idx) {
            // Reads of regions not yet reconciled go to the source only.
            return None;
        }
        let conn = Arc::as_ptr(self.replicas[idx].peer.as_ref()?) as usize;
        Some(Routed {
            idx,
            generation: self.generation,
            size: self.size,
            conn,
        })
    }

    /// Publishes the local in-sync copy for reads, if it changed.
    pub(super) fn publish_route(&mut self) {
        let now = self.route_now();
        if now == self.routed {
            return;
        }
        let value = now.and_then(|n| {
            let r = &self.replicas[n.idx];
            Some(LocalRead {
                component: r.component,
                generation: n.generation,
                size: n.size,
                timeout: self.cfg.io_timeout,
                peer: r.peer.clone()?,
            })
        });
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        *g = value;
        self.routed = now;
    }

    /// No reads around the loop any more: it stops, or the local copy
    /// leaves service.
    pub(super) fn withdraw_route(&mut self) {
        if self.routed.is_none() {
            return;
        }
        let mut g = self.route.write().unwrap_or_else(|e| e.into_inner());
        *g = None;
        self.routed = None;
    }
}
