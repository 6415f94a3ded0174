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

use super::format::{BatchHeader, Entry, BLOCK};
use super::segment::SegState;
use super::{byte_off, LogStore, Need, Result, State};
use crate::direct::AlignedBuf;
use crate::StoreError;

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
        // The victim's last batches may still be in flight.
        self.drain(st)?;
        let seg_blocks = self.geo.seg_blocks as usize;
        let mut buf = AlignedBuf::zeroed(seg_blocks * BLOCK);
        let first = st.segs.block(v, 0);
        self.dev.read_at(buf.as_mut_slice(), byte_off(first))?;
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
