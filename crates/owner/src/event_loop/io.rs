//! Client I/O: writes fanned out to every copy in one order and
//! acknowledged once durable on enough of them (parked while a copy that
//! missed one, failing it or failing already when it was sent, is being
//! recorded absent), writes held back by a resync's region lock, and reads
//! from one in-sync copy, tried on another when it fails.

use super::health::{owner_error, state_for};
use super::replica::{Mode, ReplicaSet};
use super::votes::joint_majority;
use super::{report, Flow, Internal, Loop, Reply};
use crate::{Control, Op, OwnerError};
use bytes::Bytes;
use futures::future::join_all;
use shoal_model::{Generation, BLOCK_SIZE};
use shoal_rpc::{PendingReply, RemoteError, Request, RpcError};
use std::time::Duration;

/// A client operation that changes data, as fanned out to the copies.
pub(super) enum WriteOp {
    Data {
        offset: u64,
        data: Bytes,
    },
    Zeroes {
        offset: u64,
        len: u64,
    },
    /// Ranges (offset, len) in order and apart, checked by `trim_span`.
    Trims {
        ranges: Vec<(u64, u64)>,
    },
}

impl WriteOp {
    /// The byte range written, `[start, end)`; checked in range already.
    pub(super) fn range(&self) -> (u64, u64) {
        match self {
            WriteOp::Data { offset, data } => (*offset, offset + data.len() as u64),
            WriteOp::Zeroes { offset, len } => (*offset, offset + len),
            // The span the ranges cover: a lock over any of it holds them.
            WriteOp::Trims { ranges } => shoal_rpc::trim_span(ranges).unwrap_or((0, 0)),
        }
    }
}

/// An answered write waiting for the directory to record the copies that
/// missed it.
pub(super) struct Parked {
    /// Copies that missed the write (failed it, or were failing when it
    /// was sent); it is acknowledged once none of them is still `Failing`.
    pub(super) waiting: ReplicaSet,
    /// Copies that took the write.
    pub(super) ok: ReplicaSet,
    pub(super) reply: Reply,
    /// When it was sent to the copies: after the I/O wait bound its client
    /// is told it failed (the directory cannot be reached to record the
    /// copies that missed it).
    pub(super) since: std::time::Instant,
}

pub(super) fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// The byte range an operation touches, as (offset, len).
fn extent(op: &Op) -> Option<(u64, u64)> {
    match op {
        Op::Read { offset, len } => Some((*offset, *len as u64)),
        Op::Write { offset, data } => Some((*offset, data.len() as u64)),
        Op::Zero { offset, len } => Some((*offset, *len)),
        Op::Repair { offset, .. } => Some((*offset, 1)),
        Op::Trim { ranges } => {
            shoal_rpc::trim_span(ranges).map(|(first, end)| (first, end - first))
        }
        Op::Flush => None,
    }
}

/// The CRC-32C of each block of a whole-block write: computed once here,
/// checked by every replica and kept by its store.
fn block_crcs(w: &WriteOp) -> Option<Vec<u32>> {
    match w {
        WriteOp::Data { offset, data }
            if offset.is_multiple_of(BLOCK_SIZE)
                && (data.len() as u64).is_multiple_of(BLOCK_SIZE) =>
        {
            Some(
                data.chunks(BLOCK_SIZE as usize)
                    .map(crc32c::crc32c)
                    .collect(),
            )
        }
        _ => None,
    }
}

/// The request carrying write `seq` to one component.
fn write_request(
    w: &WriteOp,
    component: u64,
    generation: Generation,
    seq: u64,
    crcs: Option<&[u32]>,
) -> (Request, Bytes) {
    match w {
        WriteOp::Data { offset, data } => {
            let offset = *offset;
            let req = match crcs {
                Some(crcs) => Request::WriteChecked {
                    component,
                    generation,
                    offset,
                    seq,
                    crcs: crcs.to_vec(),
                },
                None => Request::Write {
                    component,
                    generation,
                    offset,
                    seq,
                },
            };
            (req, data.clone())
        }
        WriteOp::Trims { ranges } => (
            Request::TrimRanges {
                component,
                generation,
                ranges: ranges.clone(),
                seq,
            },
            Bytes::new(),
        ),
        WriteOp::Zeroes { offset, len } => (
            Request::WriteZeroes {
                component,
                generation,
                offset: *offset,
                len: *len,
                seq,
            },
            Bytes::new(),
        ),
    }
}

/// Waits for every copy's answer to write `seq`.
async fn write_outcome(
    (seq, sent): (u64, std::time::Instant),
    pending: Vec<(usize, PendingReply)>,
    mut results: Vec<(usize, Result<(), RpcError>)>,
    reply: Reply,
    timeout: Duration,
) -> Internal {
    let done = join_all(
        pending
            .into_iter()
            .map(|(i, p)| async move { (i, p.wait(timeout).await.map(|_| ())) }),
    )
    .await;
    results.extend(done);
    Internal::WriteDone {
        seq,
        sent,
        results,
        reply,
    }
}

/// The data of a read sent (or not) to a copy, all `len` bytes of it.
async fn read_outcome(
    sent: Option<Result<PendingReply, RpcError>>,
    len: u32,
    timeout: Duration,
) -> Result<Bytes, RpcError> {
    let (_, data) = match sent {
        Some(Ok(p)) => p.wait(timeout).await?,
        Some(Err(e)) => return Err(e),
        None => return Err(RpcError::Closed),
    };
    if data.len() != len as usize {
        return Err(RpcError::Protocol("short read".into()));
    }
    Ok(data)
}

impl<C: Control> Loop<C> {
    pub(super) fn io(&mut self, op: Op, reply: Reply) {
        if let Some((off, len)) = extent(&op) {
            if off.checked_add(len).is_none_or(|end| end > self.size) {
                let _ = reply.send(Err(OwnerError::OutOfRange));
                return;
            }
        }
        match op {
            Op::Read { offset, len } => self.read_leased(offset, len, reply),
            // Every acknowledged write is already durable on its replicas.
            Op::Flush => {
                let _ = reply.send(Ok(Bytes::new()));
            }
            Op::Repair { component, offset } => self.repair_op(component, offset, reply),
            Op::Write { offset, data } => self.submit_write(WriteOp::Data { offset, data }, reply),
            Op::Zero { offset, len } => self.submit_write(WriteOp::Zeroes { offset, len }, reply),
            Op::Trim { ranges } if shoal_rpc::trim_span(&ranges).is_some() => {
                self.submit_write(WriteOp::Trims { ranges }, reply)
            }
            Op::Trim { ranges } => {
                let _ = reply.send(Err(OwnerError::Invalid(format!(
                    "a trim of {} ranges: 1 to {}, none empty, in order and apart",
                    ranges.len(),
                    shoal_rpc::MAX_TRIM_RANGES
                ))));
            }
        }
    }

    /// Sends a write, or holds it back while a resync copies its region.
    fn submit_write(&mut self, w: WriteOp, reply: Reply) {
        if self.locks.iter().any(|&l| overlaps(l, w.range())) {
            self.blocked.push_back((w, reply));
        } else {
            self.write(w, reply);
        }
    }

    /// Sends the writes held back by a lock just released.
    pub(super) fn unblock(&mut self) {
        for (w, reply) in std::mem::take(&mut self.blocked) {
            self.submit_write(w, reply);
        }
    }

    /// The copies a write goes to: data copies in sync or being resynced,
    /// with a connection.
    pub(super) fn targets(&self) -> ReplicaSet {
        (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.is_data()
                    && matches!(r.mode, Mode::InSync | Mode::Resyncing | Mode::Synced)
                    && r.peer.is_some()
            })
            .collect()
    }

    /// Fans a write out to every target, in the same order on each
    /// connection, and polls for the answers in [`Loop::writes`].
    fn write(&mut self, w: WriteOp, reply: Reply) {
        let targets = self.targets();
        if !targets
            .iter()
            .any(|i| self.replicas[i].mode == Mode::InSync)
        {
            let _ = reply.send(Err(OwnerError::Unavailable(
                "no in-sync copy reachable".into(),
            )));
            return;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.inflight.insert(seq, targets);
        let crcs = block_crcs(&w);
        let mut pending = Vec::with_capacity(targets.len());
        let mut results = Vec::new();
        for i in targets.iter() {
            let r = &self.replicas[i];
            let Some(peer) = &r.peer else { continue };
            let (req, payload) =
                write_request(&w, r.component, self.generation, seq, crcs.as_deref());
            match peer.send(&req, payload) {
                Ok(p) => pending.push((i, p)),
                Err(e) => results.push((i, Err(e))),
            }
        }
        let sent = std::time::Instant::now();
        let outcome = write_outcome((seq, sent), pending, results, reply, self.cfg.io_timeout);
        self.writes.push(Box::pin(outcome));
    }

    /// Every copy answered write `seq`: acknowledge it, or park it until
    /// the copies that missed it are recorded out of service.
    pub(super) fn write_done(
        &mut self,
        (seq, sent_at): (u64, std::time::Instant),
        results: Vec<(usize, Result<(), RpcError>)>,
        reply: Reply,
    ) -> Flow {
        let sent = self.inflight.remove(&seq);
        debug_assert_eq!(
            sent,
            Some(results.iter().map(|(i, _)| *i).collect()),
            "write {seq} answered by other copies than it was sent to"
        );
        // A copy that ran out of space while another took the write now
        // differs from it: it leaves service (degraded) like a copy with a
        // device error, rather than failing the write and leaving the
        // copies different.
        let any_ok = results.iter().any(|(_, r)| r.is_ok());
        let mut ok = ReplicaSet::EMPTY;
        for (i, res) in results {
            let e = match res {
                Ok(()) => {
                    ok.insert(i);
                    continue;
                }
                Err(e) => e,
            };
            match owner_error(&e) {
                Some(OwnerError::Deposed) => {
                    let _ = reply.send(Err(OwnerError::Deposed));
                    return Flow::Stop;
                }
                Some(OwnerError::NoSpace) if any_ok => {}
                Some(oe) => {
                    let _ = reply.send(Err(oe));
                    return Flow::Continue;
                }
                None => {}
            }
            self.fail(i, state_for(&e));
        }
        let waiting = self.missed(ok);
        if waiting.is_empty() {
            let _ = reply.send(self.ack(ok));
        } else {
            self.parked.push(Parked {
                waiting,
                ok,
                reply,
                since: sent_at,
            });
        }
        Flow::Continue
    }

    /// The copies a write that reached those in `ok` missed (it failed on
    /// them, or was sent while they were failing) and that are not yet
    /// recorded out of service: it is acknowledged only once they are.
    fn missed(&self, ok: ReplicaSet) -> ReplicaSet {
        (0..self.replicas.len())
            .filter(|&i| self.replicas[i].mode == Mode::Failing && !ok.contains(i))
            .collect()
    }

    /// The answer to a write that reached the copies in `ok`: success if
    /// one of them is in sync and they hold, with the witnesses, a majority
    /// of the votes (in both layouts during a change).
    pub(super) fn ack(&self, ok: ReplicaSet) -> Result<Bytes, OwnerError> {
        let copies = ok
            .iter()
            .filter(|&i| self.replicas[i].mode == Mode::InSync)
            .count();
        if copies == 0 {
            return Err(OwnerError::Unavailable(
                "no in-sync copy took the write".into(),
            ));
        }
        joint_majority(&self.replicas, |i, r| ok.contains(i) || r.witness_ok)
            .map(|()| Bytes::new())
            .map_err(OwnerError::Unavailable)
    }

    /// Acknowledges the parked writes whose failed copies are all recorded.
    pub(super) fn release_parked(&mut self) {
        let mut i = 0;
        while i < self.parked.len() {
            let ready = self.parked[i]
                .waiting
                .iter()
                .all(|w| self.replicas[w].mode != Mode::Failing);
            if ready {
                let p = self.parked.swap_remove(i);
                let _ = p.reply.send(self.ack(p.ok));
            } else {
                i += 1;
            }
        }
    }

    /// Fails the writes parked longer than the I/O wait bound: the copies
    /// that missed them cannot be recorded (the directory is out of
    /// reach), so their clients learn it instead of waiting forever. What
    /// such a write left on the copies that took it is settled like any
    /// write in flight: by the next owner's reconciliation, or by the
    /// resync of the copies that missed it.
    pub(super) fn expire_parked(&mut self) {
        let bound = self.cfg.io_wait;
        let (expired, kept): (Vec<Parked>, Vec<Parked>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|p| p.since.elapsed() >= bound);
        self.parked = kept;
        for p in expired {
            let _ = p.reply.send(Err(OwnerError::Unavailable(format!(
                "the copies that missed the write could not be recorded out of service \
                 within {bound:?} (is the directory reachable?)"
            ))));
        }
    }

    /// In-sync copies with a connection, but those in `tried`.
    pub(super) fn read_candidates(&self, tried: ReplicaSet) -> ReplicaSet {
        (0..self.replicas.len())
            .filter(|&i| {
                let r = &self.replicas[i];
                r.mode == Mode::InSync && r.peer.is_some() && !tried.contains(i)
            })
            .collect()
    }

    /// Reads `(offset, len)` from one in-sync copy not yet `tried`: the
    /// one on this node if there is one, else the next in turn.
    pub(super) fn read(&mut self, (offset, len): (u64, u32), tried: ReplicaSet, reply: Reply) {
        let mut candidates = self.read_candidates(tried);
        if let Some(source) = self.pinned_source(offset, u64::from(len)) {
            // Not yet reconciled: one version for every client.
            candidates = if candidates.contains(source) {
                ReplicaSet::one(source)
            } else {
                ReplicaSet::EMPTY
            };
        }
        let local = candidates
            .iter()
            .find(|&i| self.replicas[i].node == self.cfg.node);
        let chosen = match local {
            Some(i) => Some(i),
            None if candidates.is_empty() => None,
            None => {
                self.read_rr = self.read_rr.wrapping_add(1);
                candidates.nth(self.read_rr % candidates.len())
            }
        };
        let Some(idx) = chosen else {
            let _ = reply.send(Err(OwnerError::Unavailable(
                "no in-sync copy reachable".into(),
            )));
            return;
        };
        let r = &self.replicas[idx];
        let req = Request::Read {
            component: r.component,
            generation: self.generation,
            offset,
            len,
        };
        let sent = r.peer.as_ref().map(|p| p.send(&req, Bytes::new()));
        let tx = self.tx.clone();
        let timeout = self.cfg.io_timeout;
        tokio::spawn(async move {
            match read_outcome(sent, len, timeout).await {
                // Data goes straight to the client: the loop has nothing to
                // record for a read that succeeded.
                Ok(d) => {
                    let _ = reply.send(Ok(d));
                }
                Err(error) => report(
                    &tx,
                    Internal::ReadFailed {
                        idx,
                        offset,
                        len,
                        tried,
                        error,
                        reply,
                    },
                ),
            }
        });
    }

    /// A read from `idx` failed: answer the client if the error is its
    /// own, else take the copy out (or repair its bad block) and read
    /// from another.
    pub(super) fn read_failed(
        &mut self,
        idx: usize,
        extent: (u64, u32),
        mut tried: ReplicaSet,
        e: RpcError,
        reply: Reply,
    ) -> Flow {
        if let Some(oe) = owner_error(&e) {
            let deposed = oe == OwnerError::Deposed;
            let _ = reply.send(Err(oe));
            return if deposed { Flow::Stop } else { Flow::Continue };
        }
        tried.insert(idx);
        if let RpcError::Remote(RemoteError::Checksum { offset: bad }) = e {
            // One bad block: this copy stays in service; serve the read
            // from another copy and repair the block.
            if self.read_candidates(tried).is_empty() {
                let _ = reply.send(Err(OwnerError::Io(format!(
                    "{e} and no other copy to read it from"
                ))));
            } else {
                self.repair(idx, bad, None);
                self.read(extent, tried, reply);
            }
        } else {
            self.fail(idx, state_for(&e));
            self.read(extent, tried, reply);
        }
        Flow::Continue
    }
}
