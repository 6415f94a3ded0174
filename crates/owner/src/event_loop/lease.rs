//! Renewing the read lease ([`crate::lease`]): every tick the loop asks
//! every connected component to confirm it under its generation; once
//! components with more than half of the votes did, the lease holds until
//! [`LEASE_MS`] after the round was sent. Reads (through the loop and
//! around it) are served only while it holds; reads that find it expired
//! wait here for the next successful round, and fail after the I/O
//! timeout so that the router retries them within the client's bound.

use super::health::is_stale;
use super::votes::Tally;
use super::{Flow, Internal, Loop, Reply};
use crate::lease::LEASE_MS;
use crate::{Control, OwnerError};
use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use shoal_model::Generation;
use shoal_rpc::Request;
use std::time::{Duration, Instant};

/// How a renewal round ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Renewal {
    /// Components with more than half of the votes confirmed it.
    Quorum,
    /// A component has a newer generation: another owner took over.
    Stale,
    /// Every component answered or timed out without a majority.
    NoQuorum,
}

/// A read waiting for the lease to be renewed.
pub(super) struct WaitingRead {
    pub(super) offset: u64,
    pub(super) len: u32,
    pub(super) since: Instant,
    pub(super) reply: Reply,
}

impl<C: Control> Loop<C> {
    /// Starts a renewal round unless one is in flight; reports
    /// [`Internal::Renewed`].
    pub(super) fn renew(&mut self) {
        if self.renewing {
            return;
        }
        let sent = Instant::now();
        let generation = self.generation;
        let total = Tally::total(&self.replicas);
        let timeout = Duration::from_millis(u64::from(LEASE_MS));
        let asks = FuturesUnordered::new();
        for r in &self.replicas {
            let Some(p) = &r.peer else { continue };
            let req = Request::Renew {
                component: r.component,
                generation,
                lease_ms: LEASE_MS,
            };
            if let Ok(pending) = p.send(&req, Bytes::new()) {
                let votes = Tally::of(r);
                asks.push(async move { (votes, pending.wait(timeout).await) });
            }
        }
        self.renewing = true;
        self.spawn_report(async move {
            let outcome = count_votes(asks, total).await;
            Internal::Renewed {
                sent,
                generation,
                outcome,
            }
        });
    }

    /// A renewal round ended. A quorum extends the lease (a round of an
    /// older generation of this same owner too: its grants were ours) and
    /// serves the reads that waited; a newer owner deposes this one.
    pub(super) fn renewed(
        &mut self,
        sent: Instant,
        generation: Generation,
        outcome: Renewal,
    ) -> Flow {
        self.renewing = false;
        match outcome {
            Renewal::Quorum => {
                self.lease.renewed(sent);
                self.serve_waiting_reads();
                Flow::Continue
            }
            Renewal::Stale if generation == self.generation => Flow::Stop,
            Renewal::Stale | Renewal::NoQuorum => Flow::Continue,
        }
    }

    /// A read through the loop: served if the lease holds, else it waits
    /// for the next renewal.
    pub(super) fn read_leased(&mut self, offset: u64, len: u32, reply: Reply) {
        if self.lease.holds() {
            self.read((offset, len), super::ReplicaSet::EMPTY, reply);
        } else {
            self.lease_waiting.push_back(WaitingRead {
                offset,
                len,
                since: Instant::now(),
                reply,
            });
            self.renew();
        }
    }

    /// Serves the reads that waited for a lease, now that it holds.
    fn serve_waiting_reads(&mut self) {
        while self.lease.holds() {
            let Some(w) = self.lease_waiting.pop_front() else {
                break;
            };
            self.read((w.offset, w.len), super::ReplicaSet::EMPTY, w.reply);
        }
    }

    /// Fails the reads that waited for a lease longer than the I/O
    /// timeout: the client's router retries them until its own bound.
    pub(super) fn expire_waiting_reads(&mut self) {
        let timeout = self.cfg.io_timeout;
        while let Some(w) = self.lease_waiting.front() {
            if w.since.elapsed() < timeout {
                break;
            }
            let Some(w) = self.lease_waiting.pop_front() else {
                break;
            };
            let _ = w.reply.send(Err(OwnerError::Unavailable(format!(
                "no read lease: components with a majority of the volume's votes have not \
                 confirmed this owner for {timeout:?}"
            ))));
        }
    }
}

/// Sums the votes of the components that confirm, until they make a
/// majority of `total` (in both layouts during a change), one answers that
/// a newer owner took over, or all answered.
async fn count_votes<F>(mut asks: FuturesUnordered<F>, total: Tally) -> Renewal
where
    F: std::future::Future<
        Output = (
            Tally,
            Result<(shoal_rpc::Response, Bytes), shoal_rpc::RpcError>,
        ),
    >,
{
    let mut votes = Tally::default();
    while let Some((v, answer)) = asks.next().await {
        match answer {
            Ok(_) => {
                votes.add(v);
                if votes.majority_of(total) {
                    return Renewal::Quorum;
                }
            }
            Err(e) if is_stale(&e) => return Renewal::Stale,
            Err(_) => {}
        }
    }
    Renewal::NoQuorum
}
