//! Repair of a bad block: a block of one copy that failed its checksum
//! (found by a read, or reported by a scrubber as [`crate::Op::Repair`]) is
//! rewritten with the block read from another in-sync copy. The copy
//! replaces it only if it is still bad, so a newer write racing with the
//! repair always wins.

use super::health::{owner_error, state_for};
use super::replica::{Mode, ReplicaSet};
use super::{Flow, Internal, Loop, Reply};
use crate::{Control, OwnerError};
use bytes::Bytes;
use shoal_model::{ComponentId, BLOCK_SIZE};
use shoal_rpc::{Peer, Request, Response, RpcError};
use std::sync::Arc;
use std::time::Duration;

/// Which side of a repair failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RepairError {
    /// Reading the block from the healthy copy.
    #[error("{0}")]
    Source(RpcError),
    /// Writing it to the copy repaired: that copy is at fault.
    #[error("{0}")]
    Target(RpcError),
}

impl RepairError {
    fn rpc(&self) -> &RpcError {
        match self {
            RepairError::Source(e) | RepairError::Target(e) => e,
        }
    }
}

/// Reads the block from `src` and has `dst` replace its bad copy of it:
/// whether it did (false if the block was rewritten since).
async fn fetch_and_replace(
    src: Option<Arc<Peer>>,
    dst: Arc<Peer>,
    (read, write): (Request, Request),
    len: u32,
    timeout: Duration,
) -> Result<bool, RepairError> {
    let src = src.ok_or(RepairError::Source(RpcError::Closed))?;
    let (_, data) = src
        .call(&read, Bytes::new(), timeout)
        .await
        .map_err(RepairError::Source)?;
    if data.len() != len as usize {
        return Err(RepairError::Source(RpcError::Protocol("short read".into())));
    }
    match dst.call(&write, data, timeout).await {
        Ok((Response::Repaired(done), _)) => Ok(done),
        Ok((other, _)) => Err(RepairError::Target(RpcError::Protocol(format!(
            "unexpected answer to a repair: {other:?}"
        )))),
        Err(e) => Err(RepairError::Target(e)),
    }
}

impl<C: Control> Loop<C> {
    /// A scrubber's report of a bad block of `component`.
    pub(super) fn repair_op(&mut self, component: ComponentId, offset: u64, reply: Reply) {
        let found = self
            .replicas
            .iter()
            .position(|r| r.component == component && r.is_data());
        match found {
            None => {
                let _ = reply.send(Err(OwnerError::Io(format!(
                    "component {component} is not a data copy of volume {}",
                    self.volume
                ))));
            }
            // A copy being resynced gets the block from the copy step; one
            // out of service is rebuilt as a whole.
            Some(idx) if self.replicas[idx].mode != Mode::InSync => {
                let _ = reply.send(Ok(Bytes::from_static(&[0])));
            }
            Some(idx) => self.repair(idx, offset, Some(reply)),
        }
    }

    /// Rewrites the block holding byte `offset` of replica `idx`, which
    /// failed its checksum, with the block read from another in-sync copy.
    pub(super) fn repair(&mut self, idx: usize, offset: u64, reply: Option<Reply>) {
        let block = offset / BLOCK_SIZE * BLOCK_SIZE;
        let len = (self.size.saturating_sub(block)).min(BLOCK_SIZE) as u32;
        let source = self
            .read_candidates(ReplicaSet::one(idx))
            .iter()
            .find(|&i| self.replicas[i].is_data());
        let target = &self.replicas[idx];
        let (Some(s), Some(dst), true) = (source, target.peer.clone(), len > 0) else {
            tracing::warn!(
                volume = self.volume,
                component = target.component,
                offset,
                "bad block, and no healthy copy to repair it from"
            );
            if let Some(r) = reply {
                let _ = r.send(Err(OwnerError::Unavailable(
                    "no healthy copy to repair from".into(),
                )));
            }
            return;
        };
        let src = &self.replicas[s];
        tracing::warn!(
            volume = self.volume,
            component = target.component,
            offset = block,
            from = src.component,
            "bad block: repairing it from another copy"
        );
        let read = Request::Read {
            component: src.component,
            generation: self.generation,
            offset: block,
            len,
        };
        let write = Request::Repair {
            component: target.component,
            generation: self.generation,
            offset: block,
        };
        let work = fetch_and_replace(
            src.peer.clone(),
            dst,
            (read, write),
            len,
            self.cfg.io_timeout,
        );
        self.spawn_report(async move {
            let result = work.await;
            Internal::Repaired {
                idx,
                offset: block,
                result,
                reply,
            }
        });
    }

    pub(super) fn repaired(
        &mut self,
        idx: usize,
        offset: u64,
        result: Result<bool, RepairError>,
        reply: Option<Reply>,
    ) -> Flow {
        let component = self.replicas[idx].component;
        let (answer, flow) = match result {
            Ok(done) => {
                tracing::info!(
                    volume = self.volume,
                    component,
                    offset,
                    replaced = done,
                    "bad block repaired"
                );
                (Ok(Bytes::from(vec![done as u8])), Flow::Continue)
            }
            Err(e) => {
                tracing::warn!(
                    volume = self.volume,
                    component,
                    offset,
                    "repair failed: {e}"
                );
                if owner_error(e.rpc()) == Some(OwnerError::Deposed) {
                    (Err(OwnerError::Deposed), Flow::Stop)
                } else {
                    if let RepairError::Target(t) = &e {
                        self.fail(idx, state_for(t));
                    }
                    (
                        Err(OwnerError::Io(format!("repair failed: {e}"))),
                        Flow::Continue,
                    )
                }
            }
        };
        if let Some(r) = reply {
            let _ = r.send(answer);
        }
        flow
    }
}
