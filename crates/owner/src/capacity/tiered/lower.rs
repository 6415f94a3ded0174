//! The lowering of an erasure-coded volume to RAID-1 of the same ftt
//! (`docs/erasure-coding.md`, Lowering to RAID-1): the directory records a
//! change that drops every stripe column and sets the RAID-1 policy; this
//! loop carries it out. No stripe is begun from then on. Every block whose
//! newest data is in a stripe only is read from the columns (degraded
//! reads if need be) and staged on the performance leg as a write, unless
//! a client wrote or zeroed it meanwhile. Once every mapped block is on
//! the leg, an empty checkpoint makes the map log say "no stripes"; the
//! rest of the log is trimmed, then that checkpoint; then the change is
//! committed. The node restarts the volume's owner as a RAID-1 one, whose
//! copies are the leg, and drops the columns.
//!
//! Crash cases: before the empty checkpoint, the next owner finds the map
//! and the blocks read back so far pending, and goes on; after it, the
//! next owner finds an empty map and every block pending, and goes
//! straight to the trim and the commit. The log is never left with
//! records and no checkpoint: the checkpoint, the newest record, is
//! trimmed last.

use super::{column_failure, Ev, Loop, Reply};
use crate::stripes::{Loc, BLOCK_BYTES};
use crate::{ChangeEnd, ControlError, Op, OwnerError, View};
use bytes::{Bytes, BytesMut};
use shoal_model::ComponentId;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Blocks read back from the columns at a time while lowering, each one
/// request: enough to keep every column busy, 1 MiB in memory.
const REHYDRATE_BLOCKS_IN_FLIGHT: usize = 256;
/// How long after a read back failed (too few columns answer) the loop
/// tries again, in milliseconds.
const REHYDRATE_RETRY_MS: u64 = 1000;

/// A block read back from the stripes: where it was read from, and what.
pub(super) type ReadBack = (u64, Loc, Result<Bytes, OwnerError>);

/// Where the loop is with the lowering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Reading the stripes' blocks back to the leg (then forgetting the
    /// map: the tier's record).
    ReadingBack,
    /// The log is being trimmed.
    TrimmingLog,
    /// The commit was proposed.
    Committing,
    /// The directory committed: the node restarts the owner.
    Committed,
}

/// The loop's state of a lowering in progress.
pub(super) struct Lowering {
    /// The columns the change drops, as it names them.
    remove: Vec<ComponentId>,
    step: Step,
    /// Blocks being read back.
    reading: BTreeSet<u64>,
    /// Stagings of blocks read back not yet done on the leg.
    writing: usize,
    /// No read back before this (after one failed).
    quiet_until: Option<Instant>,
    /// An event to look on is queued ([`Ev::ReadBackLook`]): at most one.
    look_queued: bool,
}

/// The columns a change of `view` drops when it lowers the volume to
/// RAID-1 (a policy that is not erasure-coded, nothing added), if it is
/// one.
fn lowering_change(view: &View) -> Option<Vec<ComponentId>> {
    let r = view.volume.reconfig.as_ref()?;
    let p = r.policy?;
    (!p.layout.is_erasure() && r.added.is_empty() && !r.remove.is_empty()).then(|| r.remove.clone())
}

impl Loop {
    /// A view: a lowering recorded begins; one that vanished before this
    /// loop committed it (aborted) stops the owner, whose successor starts
    /// from what the log says. Answers whether the loop goes on.
    pub(super) fn lower_view(&mut self, view: &View) -> bool {
        match (lowering_change(view), &self.lowering) {
            (Some(remove), None) => {
                tracing::info!(
                    volume = self.view().volume(),
                    "lowering to RAID-1: reading the stripes back"
                );
                self.tier().lower();
                self.lowering = Some(Lowering {
                    remove,
                    step: Step::ReadingBack,
                    reading: BTreeSet::new(),
                    writing: 0,
                    quiet_until: None,
                    look_queued: false,
                });
                true
            }
            (None, Some(l)) if l.step != Step::Committed => {
                tracing::warn!("the lowering to RAID-1 ended without this owner: it stops");
                false
            }
            _ => true,
        }
    }

    /// Starts what the lowering may start now (from the pump).
    pub(super) fn lower_pump(&mut self) {
        let Some(l) = &self.lowering else { return };
        if l.step != Step::ReadingBack {
            return;
        }
        let reading_back = l.reading.len() + l.writing;
        if reading_back == 0 && self.view().stripes_in_flight() == 0 {
            // Queues the empty checkpoint once every block is on the leg.
            self.tier().forget_map(reading_back);
        }
        let forgotten = self.view().forgotten_at();
        if let Some(at) = forgotten {
            if !self.recording {
                self.trim_log(at);
            }
            return;
        }
        self.read_back();
    }

    /// The queued event to look on arrived (the pump that follows looks).
    pub(super) fn read_back_look(&mut self) {
        if let Some(l) = &mut self.lowering {
            l.look_queued = false;
        }
    }

    /// Sends the next reads of blocks that are in a stripe only.
    fn read_back(&mut self) {
        let Some(l) = &mut self.lowering else { return };
        if l.quiet_until.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let room = REHYDRATE_BLOCKS_IN_FLIGHT.saturating_sub(l.reading.len());
        if room < REHYDRATE_BLOCKS_IN_FLIGHT / 2 {
            return;
        }
        let look = self
            .tier
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .to_rehydrate(room, &l.reading);
        if look.more && !l.look_queued {
            // The walk stopped at its bound: the next look comes after
            // the events already queued, not only with the next one.
            l.look_queued = true;
            let _ = self.tx.send(Ev::ReadBackLook);
        }
        let batch = look.blocks;
        if batch.is_empty() {
            return;
        }
        l.reading.extend(batch.iter().map(|&(b, _)| b));
        for &(_, loc) in &batch {
            self.reading.begin(loc.slot);
        }
        let (set, tx) = (self.set.clone(), self.tx.clone());
        tokio::spawn(async move {
            let reads = batch.iter().map(|&(_, loc)| {
                let set = set.clone();
                async move { set.read_block(loc.slot, usize::from(loc.index)).await }
            });
            let mut back: Vec<ReadBack> = Vec::with_capacity(batch.len());
            let mut failed = BTreeSet::new();
            for (r, &(b, loc)) in futures::future::join_all(reads)
                .await
                .into_iter()
                .zip(&batch)
            {
                let r = r.map(|r| {
                    failed.extend(r.failed);
                    r.data
                });
                back.push((b, loc, r.map_err(column_failure)));
            }
            let _ = tx.send(Ev::ReadBack(back, failed.into_iter().collect()));
        });
    }

    /// Blocks came back from the stripes: each still mapped where it was
    /// read from is staged on the leg (runs of neighbours as one write).
    pub(super) fn read_back_done(&mut self, back: Vec<ReadBack>, failed: Vec<usize>) {
        for p in failed {
            self.set.set_out(p);
        }
        let mut run: Option<(u64, BytesMut)> = None;
        let mut failures = 0;
        for (b, loc, r) in back {
            self.reading.end(loc.slot);
            if let Some(l) = &mut self.lowering {
                l.reading.remove(&b);
            }
            let data = match r {
                Ok(d) => d,
                Err(e) => {
                    failures += 1;
                    self.tier().rehydrate_failed(b);
                    tracing::debug!(block = b, error = %e, "block not read back; tried again");
                    continue;
                }
            };
            if !self.view().rehydrated(b, loc) {
                continue; // written or zeroed since: that is newer
            }
            match &mut run {
                Some((first, buf)) if *first + (buf.len() / BLOCK_BYTES) as u64 == b => {
                    buf.extend_from_slice(&data)
                }
                _ => {
                    if let Some((first, buf)) = run.take() {
                        self.stage_read_back(first, buf.freeze());
                    }
                    run = Some((b, BytesMut::from(&data[..])));
                }
            }
        }
        if let Some((first, buf)) = run {
            self.stage_read_back(first, buf.freeze());
        }
        if failures > 0 {
            tracing::warn!(
                failures,
                "blocks not read back from the stripes; tried again"
            );
            if let Some(l) = &mut self.lowering {
                l.quiet_until = Some(Instant::now() + Duration::from_millis(REHYDRATE_RETRY_MS));
            }
        }
    }

    /// Stages blocks read back as a write of their own data.
    fn stage_read_back(&mut self, first: u64, data: Bytes) {
        let Some(l) = &mut self.lowering else { return };
        l.writing += 1;
        let (reply, rx): (Reply, _) = oneshot::channel();
        self.write_unlocking(first * BLOCK_BYTES as u64, data, reply, None);
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let r = rx.await.unwrap_or(Err(OwnerError::Stopped));
            let _ = tx.send(Ev::ReadBackStaged(r.map(|_| ())));
        });
    }

    /// A staging of blocks read back ended. One that failed leaves the
    /// leg's copy unknown: the owner stops, and the next one reads the
    /// stripes back again. Answers whether the loop goes on.
    pub(super) fn read_back_staged(&mut self, r: Result<(), OwnerError>) -> bool {
        if let Some(l) = &mut self.lowering {
            l.writing = l.writing.saturating_sub(1);
        }
        match r {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "a block read back was not staged: the owner stops");
                false
            }
        }
    }

    /// Trims the map log: all of it but the empty checkpoint at `keep`,
    /// then that.
    fn trim_log(&mut self, keep: u64) {
        let Some(l) = &mut self.lowering else { return };
        l.step = Step::TrimmingLog;
        let (start, bytes) = self.view().log_range();
        let block = BLOCK_BYTES as u64;
        let before = (start, keep - start);
        let after = (keep + block, start + bytes - keep - block);
        let parts: Vec<crate::Submitted> = [before, after]
            .into_iter()
            .filter(|&(_, len)| len > 0)
            .map(|(offset, len)| self.leg.submit(Op::Zero { offset, len }))
            .collect();
        let (leg, tx) = (self.leg.clone(), self.tx.clone());
        tokio::spawn(async move {
            let mut r = Ok(());
            for p in parts {
                if let Err(e) = p.wait().await {
                    r = Err(e);
                }
            }
            if r.is_ok() {
                let last = leg.submit(Op::Zero {
                    offset: keep,
                    len: block,
                });
                r = last.wait().await.map(|_| ());
            }
            let _ = tx.send(Ev::LogTrimmed(r));
        });
    }

    /// The log is trimmed: the change is committed. Answers whether the
    /// loop goes on.
    pub(super) fn log_trimmed(&mut self, r: Result<(), OwnerError>) -> bool {
        if let Err(e) = r {
            tracing::warn!(error = %e, "the map log was not trimmed: the owner stops");
            return false;
        }
        let Some(l) = &mut self.lowering else {
            return true;
        };
        l.step = Step::Committing;
        let end = ChangeEnd {
            added: Vec::new(),
            remove: l.remove.clone(),
            commit: true,
        };
        self.end_change(end, Ev::Lowered);
        true
    }

    /// The directory answered the commit. Answers whether the loop goes
    /// on: until the node restarts the owner, it serves from the leg.
    pub(super) fn lowered(&mut self, r: Result<(), ControlError>) -> bool {
        match r {
            Ok(()) => {
                tracing::info!(volume = self.view().volume(), "lowered to RAID-1");
                if let Some(l) = &mut self.lowering {
                    l.step = Step::Committed;
                }
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "the lowering to RAID-1 was not committed: the owner stops");
                false
            }
        }
    }
}
