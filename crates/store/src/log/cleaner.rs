//! Space: every operation first makes sure the log has room for what it
//! appends; when free segments run low the cleaner moves the live blocks
//! of the emptiest segments to the head of the log (greedy), and a
//! checkpoint then makes the emptied segments free.
//!
//! Why it always makes progress: clients may fill at most `fill` (90 %) of
//! the segments outside a reserve, and cleaning starts once only the
//! reserve is left free; then the used segments hold on average at most
//! 90 % of a segment of live data, so the emptiest one does too, and moving
//! it gains at least a tenth of a segment.
//!
//! The background cleaner ([`LogStore::start_background`]) keeps free
//! segments ahead of the writers: woken when they fall below `bg_high`
//! (from `rotate`), it cleans in steps — each takes the state lock,
//! relocates the live blocks of one victim (or checkpoints, which frees
//! the emptied segments) and releases it — until free plus emptied
//! segments reach `bg_high`, so client writes interleave between steps.
//! Writers wait for its steps when free segments fall near the inline
//! threshold; the inline cleaning in `ensure_space` stays as the fallback
//! when it is stuck or not running.
//!
//! The same thread prepares unallocated space ahead of the log between
//! cleaning rounds (`prepare.rs`): cleaning always comes first, and a
//! preparation step (zeros over one segment, a few milliseconds) never
//! starts while free segments are short.

use super::format::{BatchHeader, Entry, BLOCK};
use super::prepare::{PrepStep, Preparer};
use super::segment::SegState;
use super::{byte_off, lock, LogStore, Need, Result, State};
use crate::direct::AlignedBuf;
use crate::StoreError;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

/// Flags shared by the store and its background cleaner thread.
#[derive(Default)]
pub(super) struct Bg {
    m: Mutex<BgFlags>,
    cv: Condvar,
}

#[derive(Default)]
struct BgFlags {
    /// The thread runs (started and not stopped or failed).
    running: bool,
    /// Work was asked for since the thread last looked.
    wake: bool,
    /// Preparation was asked for (the log took a segment).
    prep: bool,
    /// The store is going away.
    stop: bool,
    /// The last step could not make progress (no victim worth moving) or
    /// found nothing to do: writers do not wait for it until the next
    /// wake-up (they clean inline if they must).
    stuck: bool,
    /// Steps finished (writers waiting for one watch it change).
    steps: u64,
}

/// What one step of the background cleaner did.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Moved a victim or checkpointed: call again.
    Progress,
    /// Segment to relocate: read it outside the state lock, then move its
    /// live blocks.
    Victim(u32),
    /// Emptied segments are worth a checkpoint: take it, with its device
    /// writes outside the lock.
    Checkpoint,
    /// `bg_high` segments are free.
    Done,
    /// Nothing worth doing now.
    Stuck,
}

impl Bg {
    /// Asks the thread (if any) for a cleaning round. Called under the
    /// state lock (lock order: state, then `m`).
    pub(super) fn wake(&self) {
        let mut g = lock(&self.m);
        if g.running && !g.wake {
            g.wake = true;
            g.stuck = false;
            self.cv.notify_all();
        }
    }

    /// Waits until the thread finishes one step (waking it first). Returns
    /// false at once if there is no thread or it is stuck. Call without
    /// the state lock.
    pub(super) fn wait_step(&self) -> bool {
        let mut g = lock(&self.m);
        if !g.running || g.stop || g.stuck {
            return false;
        }
        let s0 = g.steps;
        g.wake = true;
        self.cv.notify_all();
        while g.steps == s0 && g.running && !g.stop && !g.stuck {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        true
    }

    /// Asks the thread (if any) to look at preparation. Called under the
    /// state lock.
    pub(super) fn wake_prep(&self) {
        let mut g = lock(&self.m);
        if g.running && !g.prep {
            g.prep = true;
            self.cv.notify_all();
        }
    }

    /// Whether a cleaning round was asked for and not started yet.
    fn clean_wanted(&self) -> bool {
        lock(&self.m).wake
    }

    pub(super) fn stop(&self) {
        let mut g = lock(&self.m);
        g.stop = true;
        self.cv.notify_all();
    }

    fn finished_step(&self, step: &Result<Step>) {
        let mut g = lock(&self.m);
        g.steps += 1;
        match step {
            Ok(Step::Progress) | Ok(Step::Victim(_)) | Ok(Step::Checkpoint) => {}
            Ok(Step::Done) | Ok(Step::Stuck) => g.stuck = true,
            Err(_) => g.running = false,
        }
        self.cv.notify_all();
    }

    /// Sleeps until woken or `until`; `None` when the thread must end,
    /// else whether cleaning was asked for.
    fn sleep(&self, until: Option<Instant>) -> Option<bool> {
        let mut g = lock(&self.m);
        while !g.wake && !g.prep && !g.stop {
            match until {
                None => g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let now = Instant::now();
                    if now >= t {
                        break;
                    }
                    g = self
                        .cv
                        .wait_timeout(g, t - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
        if g.stop {
            return None;
        }
        g.prep = false;
        Some(std::mem::take(&mut g.wake))
    }

    fn stopping(&self) -> bool {
        lock(&self.m).stop
    }

    fn exit(&self) {
        let mut g = lock(&self.m);
        g.running = false;
        self.cv.notify_all();
    }
}

/// The background cleaner thread: holds the store only between its wake-up
/// and the end of each step, so dropping the last `Arc` elsewhere ends it.
/// Between cleaning rounds it prepares space ahead of the log.
fn bg_loop(store: Weak<LogStore>, bg: Arc<Bg>) {
    /// Marks the thread gone however it ends, a panic included: writers
    /// waiting for its steps then clean inline instead of waiting forever.
    struct Exit(Arc<Bg>);
    impl Drop for Exit {
        fn drop(&mut self) {
            self.0.exit();
        }
    }
    let _exit = Exit(bg.clone());
    let mut prep = Preparer::new();
    let mut until = None;
    while let Some(clean) = bg.sleep(until) {
        until = None;
        let mut cleaning = clean;
        while cleaning {
            let Some(s) = store.upgrade() else {
                bg.exit();
                return;
            };
            let r = s.clean_step();
            if let Err(e) = &r {
                tracing::warn!(device = %s.dev.name().display(), error = %e, "background cleaner stopped");
            }
            // May be the last reference: the store's drop then runs here.
            drop(s);
            bg.finished_step(&r);
            match r {
                Ok(Step::Progress) if !bg.stopping() => continue,
                Ok(_) => cleaning = false,
                Err(_) => {
                    bg.exit();
                    return;
                }
            }
        }
        // Preparation, one segment per step, until there is nothing to do
        // now or cleaning is asked for (then it goes on after the round).
        while !bg.stopping() && !bg.clean_wanted() {
            let Some(s) = store.upgrade() else {
                bg.exit();
                return;
            };
            let r = s.prepare_step(&mut prep);
            // May be the last reference, as above.
            drop(s);
            match r {
                PrepStep::Again => continue,
                PrepStep::Later(t) => {
                    until = t;
                    break;
                }
            }
        }
    }
    bg.exit();
}

impl LogStore {
    /// Makes room for appending `data` blocks and `slots` other entries:
    /// cleans if needed. `NoSpace` (and nothing changed) if impossible.
    pub(super) fn ensure_space(
        &self,
        st: &mut State,
        data: u64,
        slots: u64,
        need: Need,
    ) -> Result<()> {
        let keep = match need {
            Need::Client => self.geo.clean_low,
            Need::Freeing => 3,
        };
        let target = self.geo.rotations(data, slots) + keep;
        if st.segs.free_count() >= target {
            return Ok(());
        }
        self.release_drained(st);
        if st.segs.free_count() >= target {
            return Ok(());
        }
        self.clean_until(st, target)?;
        if st.segs.free_count() >= target {
            Ok(())
        } else {
            Err(StoreError::NoSpace)
        }
    }

    /// Cleans until `target` segments are free (or up to the cleaner's
    /// high mark), or no progress is possible. Victims are ranked once per
    /// round (moving blocks only empties them further), so a round costs
    /// one scan of the segment table plus the blocks moved.
    fn clean_until(&self, st: &mut State, target: usize) -> Result<()> {
        let goal = target.max(self.geo.clean_high);
        let mut recl = st.segs.reclaimable().len();
        let mut victims = self.victims(st).into_iter();
        let mut next = victims.next();
        for _ in 0..(2 * self.geo.nsegs as usize + 8) {
            let free = st.segs.free_count();
            if free >= goal {
                break;
            }
            if free + recl >= goal {
                self.checkpoint_locked(st)?;
                recl = 0;
                continue;
            }
            // The next victim still worth moving.
            while let Some(v) = next {
                if st.segs.state(v) == SegState::Used && st.segs.live(v) > 0 {
                    break;
                }
                next = victims.next();
            }
            match next {
                Some(v) if free > self.geo.rotations(st.segs.live(v) as u64, 0) => {
                    self.relocate(st, v)?;
                    recl += 1;
                    next = victims.next();
                }
                _ if recl > 0 => {
                    self.checkpoint_locked(st)?;
                    recl = 0;
                }
                _ => break,
            }
        }
        Ok(())
    }

    /// Starts the background cleaner thread of this store (once; later
    /// calls do nothing). It ends when the last `Arc` is dropped. Without
    /// it (tests over `FaultyDevice`, tools) the store cleans inline only,
    /// deterministically.
    pub fn start_background(self: &Arc<Self>) -> std::io::Result<()> {
        let mut t = lock(&self.bg_thread);
        if t.is_some() {
            return Ok(());
        }
        lock(&self.bg.m).running = true;
        // Before the thread starts, so its first look finds the holes.
        self.start_preparation();
        let (w, bg) = (Arc::downgrade(self), self.bg.clone());
        let name = format!("shoal-cleaner-{:x}", self.sb.uuid & 0xffff);
        match std::thread::Builder::new()
            .name(name)
            .spawn(move || bg_loop(w, bg))
        {
            Ok(h) => {
                *t = Some(h);
                drop(t);
                // Start ahead of the writers if space is already short.
                let st = self.lock_state();
                if st.segs.free_count() < self.geo.bg_high {
                    self.bg.wake();
                }
                if self.prep.on() && st.segs.unprepared_count() > 0 {
                    self.bg.wake_prep();
                }
                Ok(())
            }
            Err(e) => {
                lock(&self.bg.m).running = false;
                Err(e)
            }
        }
    }

    /// Stops the background cleaner and waits for its thread to end (it
    /// ends on its own when the last `Arc` is dropped, but its current step
    /// may hold one for a moment: whoever must know the store closed when
    /// dropping its `Arc`, e.g. to reopen the device in this process,
    /// calls this first). Returns at once without a thread.
    pub fn stop_background(&self) {
        self.bg.stop();
        let handle = lock(&self.bg_thread).take();
        if let Some(h) = handle {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }

    /// One step of the background cleaner: checkpoints, or relocates one
    /// victim; writes what it sealed outside the lock.
    ///
    /// A victim's segment is read outside the state lock (a read of up to
    /// a segment took about 5 ms here, and client writes waited for it:
    /// 3–4% of the time during steady cleaning, which added tens of
    /// microseconds to the mean QD1 write). Only the moves of its live
    /// blocks hold the lock. Its blocks that clients overwrite or trim
    /// meanwhile are no longer in the index and are not moved; if a
    /// checkpoint frees the segment meanwhile (all its blocks went), it
    /// clears `cleaning` and the copy read is dropped unused.
    fn clean_step(&self) -> Result<Step> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let r = self.clean_step_locked(&mut st);
        if let Ok(Step::Checkpoint) = r {
            return self.checkpoint_unlocked(st).map(|()| Step::Progress);
        }
        let victim = match r {
            Ok(Step::Victim(v)) => {
                // Its last batches may still be in flight.
                self.drain(&st)?;
                assert!(st.cleaning.is_none(), "one background victim at a time");
                st.cleaning = Some(v);
                Some((v, st.segs.block(v, 0)))
            }
            _ => None,
        };
        drop(st);
        let Some((v, first)) = victim else {
            self.write_sealed(false)?;
            return r;
        };
        let mut buf = AlignedBuf::zeroed(self.geo.seg_blocks as usize * BLOCK);
        let read = self.dev.read_at(buf.as_mut_slice(), byte_off(first));
        #[cfg(test)]
        {
            // Tests widen the window in which writers race the cleaner.
            let us = self
                .cleaner_pause_us
                .load(std::sync::atomic::Ordering::Relaxed);
            if us > 0 {
                std::thread::sleep(std::time::Duration::from_micros(us));
            }
        }
        let moved = {
            let mut st = self.lock_state();
            let kept = st.cleaning.take() == Some(v);
            match read {
                Err(e) => Err(e.into()),
                // Freed (and maybe reused) meanwhile: nothing left to move.
                Ok(()) if !kept => Ok(()),
                // Writers took free segments meanwhile: leave it for later.
                Ok(()) if st.segs.free_count() <= self.geo.rotations(st.segs.live(v) as u64, 0) => {
                    Ok(())
                }
                Ok(()) if st.segs.live(v) == 0 => Ok(()),
                Ok(()) => {
                    let started = std::time::Instant::now();
                    let r = self.move_live(&mut st, v, &buf);
                    st.stats.relocate_micros += started.elapsed().as_micros() as u64;
                    if r.is_ok() {
                        st.stats.cleaned_segments_background += 1;
                    }
                    r
                }
            }
        };
        self.write_sealed(false)?;
        moved.map(|()| Step::Progress)
    }

    fn clean_step_locked(&self, st: &mut State) -> Result<Step> {
        self.release_drained(st);
        let free = st.segs.free_count();
        // Emptied segments become free at a checkpoint: take one after a
        // round's worth (as many as an inline round cleans: one checkpoint
        // per round, not per segment), or when no victim can be moved.
        let recl = st.segs.reclaimable().len();
        let round = self.geo.clean_high - self.geo.clean_low;
        if recl >= round.max(1) {
            return Ok(Step::Checkpoint);
        }
        if free + recl >= self.geo.bg_high {
            return Ok(Step::Done);
        }
        match self.best_victim(st) {
            Some(v) if free > self.geo.rotations(st.segs.live(v) as u64, 0) => Ok(Step::Victim(v)),
            _ if recl > 0 => Ok(Step::Checkpoint),
            _ => Ok(Step::Stuck),
        }
    }

    /// The used segment worth cleaning with the fewest live blocks
    /// (greedy, as the inline cleaner), in one scan of the segment table.
    /// LFS cost-benefit ((1 − u) × age ÷ (1 + u)) was tried and measured
    /// no better here (docs/store-log-format.md).
    fn best_victim(&self, st: &State) -> Option<u32> {
        (0..st.segs.count())
            .filter(|&s| st.segs.state(s) == SegState::Used)
            .map(|s| (st.segs.live(s), s))
            .filter(|&(live, _)| live > 0 && (live as u64) < self.geo.dense)
            .min()
            .map(|(_, s)| s)
    }

    /// Runs one cleaning round if free segments are below the cleaner's
    /// high mark (a hook for a background cleaner). Returns the free
    /// segments after it.
    pub fn clean(&self) -> Result<usize> {
        self.fail_check()?;
        let mut st = self.lock_state();
        if st.segs.free_count() < self.geo.clean_high {
            self.clean_until(&mut st, self.geo.clean_high)?;
        }
        let free = st.segs.free_count();
        drop(st);
        self.write_sealed(false)?;
        Ok(free)
    }

    /// Used segments worth cleaning (moving their live blocks gains
    /// space), fewest live blocks first (greedy).
    fn victims(&self, st: &State) -> Vec<u32> {
        let mut v: Vec<(u32, u32)> = (0..st.segs.count())
            .filter(|&s| st.segs.state(s) == SegState::Used)
            .map(|s| (st.segs.live(s), s))
            .filter(|&(live, _)| live > 0 && (live as u64) < self.geo.dense)
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, s)| s).collect()
    }

    /// Moves every live block of segment `v` to the head of the log. Blocks
    /// keep their checksums; a block whose data no longer matches is moved
    /// marked bad (reads keep failing), never given a fresh checksum.
    pub(super) fn relocate(&self, st: &mut State, v: u32) -> Result<()> {
        let started = std::time::Instant::now();
        let r = self.relocate_timed(st, v);
        st.stats.relocate_micros += started.elapsed().as_micros() as u64;
        r
    }

    fn relocate_timed(&self, st: &mut State, v: u32) -> Result<()> {
        // The victim's last batches may still be in flight.
        self.drain(st)?;
        let mut buf = AlignedBuf::zeroed(self.geo.seg_blocks as usize * BLOCK);
        let first = st.segs.block(v, 0);
        self.dev.read_at(buf.as_mut_slice(), byte_off(first))?;
        self.move_live(st, v, &buf)
    }

    /// Moves the blocks of segment `v` that the index still maps there,
    /// from `buf` (the whole segment as read from the device, after its
    /// batches were written, and not reused since).
    fn move_live(&self, st: &mut State, v: u32, buf: &AlignedBuf) -> Result<()> {
        let seg_blocks = self.geo.seg_blocks as usize;
        let first = st.segs.block(v, 0);
        let mut moved = 0u64;
        for off in st.segs.headers(v) {
            let o = off as usize;
            let Some(h) = BatchHeader::decode(&buf.as_slice()[o * BLOCK..(o + 1) * BLOCK])
                .filter(|h| h.uuid == self.sb.uuid && h.seg == v && h.off == off)
            else {
                continue;
            };
            let mut j = 0usize;
            for e in &h.entries {
                let Entry::Data {
                    comp,
                    block,
                    crc,
                    bad,
                } = *e
                else {
                    continue;
                };
                let at = o + 1 + j;
                j += 1;
                let d = first + at as u32;
                if st.comps.get(&comp).and_then(|c| c.index.get(block)) != Some(d) {
                    continue;
                }
                let data = &buf.as_slice()[at * BLOCK..(at + 1) * BLOCK];
                let actual = crc32c::crc32c(data);
                if actual != crc && !bad {
                    tracing::warn!(
                        component = comp,
                        block,
                        device_block = d,
                        "cleaner found a block whose checksum does not match; moved as bad"
                    );
                }
                self.put_block(st, comp, block, data, actual, bad || actual != crc)?;
                moved += 1;
            }
        }
        if st.segs.live(v) > 0 {
            // Blocks under a damaged header: find them through the index and
            // move them as bad (their checksum is lost).
            let end = first + seg_blocks as u32;
            let mut orphans = Vec::new();
            for (&id, c) in &st.comps {
                c.index.for_each(|b, d| {
                    if d >= first && d < end {
                        orphans.push((id, b, d));
                    }
                });
            }
            for (id, b, d) in orphans {
                let at = (d - first) as usize;
                let data = &buf.as_slice()[at * BLOCK..(at + 1) * BLOCK];
                tracing::warn!(
                    component = id,
                    block = b,
                    "block under a damaged header moved as bad"
                );
                self.put_block(st, id, b, data, crc32c::crc32c(data), true)?;
                moved += 1;
            }
        }
        debug_assert_eq!(st.segs.live(v), 0);
        st.stats.cleaner_blocks += moved;
        st.stats.cleaned_segments += 1;
        Ok(())
    }
}
