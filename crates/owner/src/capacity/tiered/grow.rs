//! The growth of an erasure-coded volume (`docs/erasure-coding.md`,
//! Growing): the directory records the size it grows to
//! (`Volume::grow_to`) and keeps the old one, which clients see; this loop
//! carries it out. The map log lies past the volume's end on the
//! performance leg, where the new end's blocks will be, so it moves first:
//!
//! 1. **Resizing**: the columns and the leg's copies are grown (the leg to
//!    hold the old log and the new one, past both the new end and the old
//!    log).
//! 2. **Moving**: the next records are a whole checkpoint at the new place
//!    ([`Tier::move_log`]), numbered above every record found there; other
//!    records wait behind it as behind any checkpoint.
//! 3. **Trimming**: once it is complete, the old log is trimmed on the leg
//!    (its blocks become the volume's and must read as never written).
//! 4. **Committing**: the directory takes the new size and the log's new
//!    place, under this owner's generation; the loop then serves the new
//!    end and allocates stripes in the columns' new slots.
//!
//! Crash cases: before the new place holds a complete checkpoint, the
//! next owner reads the map from the old place and moves the log again,
//! numbered above what the torn move left; after it, the next owner reads
//! the map from the new place (its records are all newer) and trims the
//! old log again, then commits. Until the commit, no client reaches past
//! the old end and no stripe lands in a new slot, so nothing but the log
//! depends on the growth.

use super::{in_sync_copies, Ev, Loop};
use crate::stripes::{LogPlace, BLOCK_BYTES};
use crate::{ControlError, Op, OwnerError, View};
use bytes::Bytes;

/// Where the loop is with the growth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The columns and the leg's copies are being grown.
    Resizing,
    /// The log moves: a checkpoint at the new place is being written.
    Moving,
    /// The old log is being trimmed.
    Trimming,
    /// The commit was proposed.
    Committing,
}

/// The loop's state of a growth in progress.
pub(super) struct Growth {
    /// The size the volume grows to, in bytes.
    to: u64,
    /// The log's place before the growth.
    from: LogPlace,
    /// Its place after.
    place: LogPlace,
    step: Step,
}

impl Loop {
    /// A view: a growth recorded begins (for a new owner, goes on where
    /// the log says); one the directory shows committed ends.
    pub(super) fn grow_view(&mut self, view: &View) {
        let v = &view.volume;
        if let Some(g) = &self.growth {
            // The size committed (a next growth may be recorded already,
            // in the same view): this one ends, that one begins.
            if g.step != Step::Committing || v.size < g.to {
                return;
            }
            let to = g.to;
            self.grown(to);
        }
        let Some(to) = v.grow_to.filter(|&to| to > self.size) else {
            return;
        };
        if self.lowering.is_some() {
            // The directory records neither during the other.
            tracing::error!("a growth recorded during a lowering: not grown");
            return;
        }
        let (from, place) = (LogPlace::of(v), LogPlace::grown(v, to));
        let here = self.view().log_place();
        if here != from && here != place {
            tracing::error!(?here, ?from, ?place, "the map log is neither where the directory has it nor where the growth moves it: not grown");
            return;
        }
        tracing::info!(
            volume = v.id,
            from = self.size,
            to,
            "growing: the map log moves from byte {} to byte {}",
            from.at,
            place.at
        );
        self.growth = Some(Growth {
            to,
            from,
            place,
            step: Step::Resizing,
        });
        self.grow_components(view, to, place);
    }

    /// Grows the columns and the leg's in-sync copies (the RAID-1 loop
    /// grows its copies too, but sends the request without waiting for
    /// it): every copy reachable is grown before the log moves there.
    fn grow_components(&self, view: &View, to: u64, place: LogPlace) {
        let column_bytes = self.set.columns().column_bytes(to);
        let copies = in_sync_copies(view);
        let (set, tx) = (self.set.clone(), self.tx.clone());
        let (timeout, auth) = self.peer_io.clone();
        tokio::spawn(async move {
            let failed = set.grow(column_bytes).await;
            for (addr, component) in copies {
                let req = shoal_rpc::Request::ResizeComponent {
                    component,
                    size: place.end(),
                };
                let grown = async {
                    let p = shoal_rpc::Peer::connect(&addr, timeout, &auth).await?;
                    p.call(&req, Bytes::new(), timeout).await
                };
                if let Err(e) = grown.await {
                    // Its writes past the old size fail: the RAID-1 loop
                    // takes it out of service, and grows it when it
                    // activates it again.
                    tracing::warn!(component, error = %e, "copy of the performance leg not grown");
                }
            }
            let _ = tx.send(Ev::GrowResized(failed));
        });
    }

    /// The columns and copies are grown (`failed`: columns that were not,
    /// now out of service): the log moves, unless the new owner found it
    /// moved already.
    pub(super) fn grow_resized(&mut self, failed: Vec<usize>) {
        for p in failed {
            self.set.set_out(p);
        }
        let Some(g) = &mut self.growth else { return };
        g.step = Step::Moving;
        let (from, place) = (g.from, g.place);
        let here = self.view().log_place();
        if here == place {
            // Read from the new place: it holds a complete checkpoint.
            self.trim_old_log(from);
        }
    }

    /// From the pump: moves the log once no record is in flight, and
    /// trims the old one once the new place holds a checkpoint.
    pub(super) fn grow_pump(&mut self) {
        let Some(g) = &self.growth else { return };
        if g.step != Step::Moving {
            return;
        }
        let (from, place) = (g.from, g.place);
        let here = self.view().log_place();
        if here != place {
            if !self.recording {
                let above = self.torn_move_upto;
                self.tier().move_log(place, above);
            }
            return;
        }
        let moved = self.view().log_moved();
        if let Some(old) = moved {
            debug_assert_eq!(old, from, "the log moved from elsewhere");
            self.trim_old_log(from);
        }
    }

    /// Trims the old log on the leg: its blocks become the volume's.
    fn trim_old_log(&mut self, from: LogPlace) {
        let Some(g) = &mut self.growth else { return };
        g.step = Step::Trimming;
        let trim = self.leg.submit(Op::Zero {
            offset: from.at,
            len: from.records * BLOCK_BYTES as u64,
        });
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Ev::GrowTrimmed(trim.wait().await.map(|_| ())));
        });
    }

    /// The old log is trimmed: the growth is committed. Answers whether
    /// the loop goes on.
    pub(super) fn grow_trimmed(&mut self, r: Result<(), OwnerError>) -> bool {
        if let Err(e) = r {
            tracing::warn!(error = %e, "the old map log was not trimmed: the owner stops");
            return false;
        }
        let Some(g) = &mut self.growth else {
            return true;
        };
        g.step = Step::Committing;
        let (to, place) = (g.to, g.place);
        let at = (place.at != to).then_some(place.at);
        self.propose(
            move |c, g| c.commit_growth(g, to, at),
            move |r| Ev::GrowCommitted(to, r),
        );
        true
    }

    /// The directory answered the commit of the growth to `to`. An answer
    /// that comes after a view showed that growth committed (the loop
    /// may be carrying out the next one by then) is of no growth in
    /// progress: it changes nothing. Answers whether the loop goes on.
    pub(super) fn grow_committed(&mut self, to: u64, r: Result<(), ControlError>) -> bool {
        let ours = self
            .growth
            .as_ref()
            .is_some_and(|g| g.step == Step::Committing && g.to == to);
        match r {
            Ok(()) => {
                self.grown(to);
                true
            }
            Err(e) if ours => {
                tracing::warn!(error = %e, "the growth was not committed: the owner stops");
                false
            }
            Err(e) => {
                tracing::debug!(error = %e, to, "a late answer to a growth's commit");
                true
            }
        }
    }

    /// The growth to `to`, being committed, is: the loop serves the new
    /// end, and stripes may take the columns' new slots. Nothing for any
    /// other growth.
    fn grown(&mut self, to: u64) {
        let ours = self
            .growth
            .as_ref()
            .is_some_and(|g| g.step == Step::Committing && g.to == to);
        if !ours {
            return;
        }
        let Some(g) = self.growth.take() else { return };
        let slots = crate::stripes::MapBounds::of(self.set.columns(), g.to).slots;
        self.tier().grown(g.to, slots);
        self.size = g.to;
        self.heal.volume_bytes = g.to;
        tracing::info!(volume = self.view().volume(), size = g.to, "grown");
    }
}
