//! Checkpoints: the components (with their marked and tracked regions),
//! the index, the used segments (live count and header map) and the log
//! position, written to the inactive slot of
//! two. Order: body, flush, header copy 0, flush, header copy 1, flush; so
//! a valid header copy always names a durable body, and the slot written
//! last is the one with the highest seq among valid copies.

use super::format::{self, CkptHeader, BLOCK, BLOCK_U64, CKPT_TRACKED_ALL};
use super::index::BlockIndex;
use super::segment::SegState;
use super::track::{TrackSet, Tracked};
use super::{byte_off, lock, BlockDevice, Comp, LogStore, Result, State};
use crate::direct::AlignedBuf;
use crate::{StoreError, MAX_SIZE};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::MutexGuard;

/// Bytes a checkpoint body is written and read in.
const CHUNK: usize = 1 << 20;

/// Buffer size for a body of `len` bytes.
fn chunk_for(len: u64) -> usize {
    (len.div_ceil(BLOCK_U64).max(1) * BLOCK_U64).min(CHUNK as u64) as usize
}

/// Streams a body to the device in aligned chunks, with its CRC.
struct BodyWriter<'a> {
    dev: &'a dyn BlockDevice,
    at: u64,
    buf: AlignedBuf,
    fill: usize,
    len: u64,
    crc: u32,
    cap: u64,
}

impl<'a> BodyWriter<'a> {
    fn new(dev: &'a dyn BlockDevice, at: u64, cap: u64) -> BodyWriter<'a> {
        BodyWriter {
            dev,
            at,
            buf: AlignedBuf::zeroed(chunk_for(cap)),
            fill: 0,
            len: 0,
            crc: 0,
            cap,
        }
    }

    fn put(&mut self, mut b: &[u8]) -> io::Result<()> {
        self.len += b.len() as u64;
        if self.len > self.cap {
            return Err(io::Error::other("checkpoint larger than its slot"));
        }
        self.crc = crc32c::crc32c_append(self.crc, b);
        while !b.is_empty() {
            let size = self.buf.as_slice().len();
            let n = (size - self.fill).min(b.len());
            self.buf.as_mut_slice()[self.fill..self.fill + n].copy_from_slice(&b[..n]);
            self.fill += n;
            b = &b[n..];
            if self.fill == size {
                self.dev.write_at(self.buf.as_slice(), self.at)?;
                self.at += size as u64;
                self.fill = 0;
            }
        }
        Ok(())
    }

    /// Writes what is left; returns (length, CRC).
    fn finish(mut self) -> io::Result<(u64, u32)> {
        if self.fill > 0 {
            let n = self.fill.div_ceil(BLOCK) * BLOCK;
            self.buf.as_mut_slice()[self.fill..n].fill(0);
            self.dev.write_at(&self.buf.as_slice()[..n], self.at)?;
        }
        Ok((self.len, self.crc))
    }
}

/// Streams a body back, checking its length and CRC at the end.
struct BodyReader<'a> {
    dev: &'a dyn BlockDevice,
    at: u64,
    left: u64,
    buf: AlignedBuf,
    pos: usize,
    filled: usize,
    crc: u32,
}

impl<'a> BodyReader<'a> {
    fn read(&mut self, out: &mut [u8]) -> Result<()> {
        let mut o = 0;
        while o < out.len() {
            if self.pos == self.filled {
                if self.left == 0 {
                    return Err(StoreError::Corrupt("checkpoint body truncated".into()));
                }
                let valid = self.left.min(self.buf.as_slice().len() as u64) as usize;
                let n = valid.div_ceil(BLOCK) * BLOCK;
                self.dev
                    .read_at(&mut self.buf.as_mut_slice()[..n], self.at)?;
                self.crc = crc32c::crc32c_append(self.crc, &self.buf.as_slice()[..valid]);
                self.at += n as u64;
                self.left -= valid as u64;
                self.pos = 0;
                self.filled = valid;
            }
            let n = (self.filled - self.pos).min(out.len() - o);
            out[o..o + n].copy_from_slice(&self.buf.as_slice()[self.pos..self.pos + n]);
            self.pos += n;
            o += n;
        }
        Ok(())
    }

    fn u64(&mut self) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn u32(&mut self) -> Result<u32> {
        let mut b = [0u8; 4];
        self.read(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
}

/// A checkpoint as read back.
pub(super) struct Loaded {
    pub hdr: CkptHeader,
    pub slot: usize,
    pub comps: BTreeMap<u64, Comp>,
    /// (segment, live blocks, header bitmap) of the used segments.
    pub segs: Vec<(u32, u32, Vec<u64>)>,
}

/// Largest checkpoint body, in bytes, for which the index is copied under
/// the lock so that it can be encoded and written outside it (the size of
/// the previous checkpoint decides). The copy costs memory next to the
/// index, a few times the body at most (dense regions), so a larger one
/// (an index of hundreds of GiB of random 4 KiB writes) is encoded and
/// streamed to the device under the lock as before.
const UNLOCKED_BODY_MAX: u64 = 64 << 20;

/// A checkpoint whose device writes are under way (taken by
/// `begin_checkpoint`, made current by `end_checkpoint`).
pub(super) struct CkptInFlight {
    seq: u64,
    slot: usize,
    /// `log_since_ckpt` when it was taken.
    log_at: u64,
    /// Used segments without live blocks when it was taken: free once it
    /// is durable.
    rec: Vec<u32>,
}

/// What a checkpoint body records of one component before its index.
struct CompHead {
    id: u64,
    volume: u64,
    size: u64,
    generation: u64,
    /// Marked regions, ascending.
    marks: Vec<u32>,
    tracked: Tracked,
}

impl CompHead {
    fn of(id: u64, c: &Comp) -> CompHead {
        CompHead {
            id,
            volume: c.volume,
            size: c.size,
            generation: c.generation,
            marks: c.marks.iter().copied().collect(),
            tracked: c.tracked.to_tracked(),
        }
    }
}

/// One component as a checkpoint body records it.
type CompRecord<'a> = (CompHead, &'a BlockIndex);

/// What a checkpoint body holds, copied under the lock (a copy of an
/// index costs far less than encoding it: about 1/10 here).
struct Snapshot {
    /// Per component, and its index (in the same order).
    heads: Vec<CompHead>,
    indexes: Vec<BlockIndex>,
    /// (segment, live blocks, header bitmap) per recorded segment.
    segs: Vec<(u32, u32, Vec<u64>)>,
}

/// What `write_checkpoint` writes, outside the state lock.
pub(super) struct CkptWrite {
    snap: Snapshot,
    hdr: CkptHeader,
    /// Byte offset of the slot.
    base: u64,
    /// Last batch the checkpoint covers: written and flushed before it.
    target: u64,
}

/// The outcome of the checkpoint writes in flight.
#[derive(Default)]
pub(super) struct CkptDone {
    /// Set by the writer (the checkpoint's device blocks, or the error),
    /// taken by `end_checkpoint`.
    result: Option<std::result::Result<u64, String>>,
    /// Checkpoint writes finished so far (for callers that only wait).
    writes_done: u64,
}

/// Sets the outcome of the checkpoint writes in flight when dropped,
/// panics included, so that nobody waits for it forever.
struct Outcome<'a> {
    store: &'a LogStore,
    result: Option<std::result::Result<u64, String>>,
}

impl Drop for Outcome<'_> {
    fn drop(&mut self) {
        let r = self
            .result
            .take()
            .unwrap_or_else(|| Err("checkpoint writer ended early".into()));
        let mut d = lock(&self.store.ckpt_done);
        d.result = Some(r);
        d.writes_done += 1;
        self.store.ckpt_landed.notify_all();
    }
}

impl LogStore {
    /// Writes a checkpoint of `st` to the inactive slot, then frees the
    /// segments that hold no live block; all under the state lock (for
    /// callers that need the space now: the cleaner, open and close).
    pub(super) fn checkpoint_locked(&self, st: &mut State) -> Result<()> {
        let started = std::time::Instant::now();
        let r = self.checkpoint_timed(st);
        st.stats.checkpoint_micros += started.elapsed().as_micros() as u64;
        r
    }

    fn checkpoint_timed(&self, st: &mut State) -> Result<()> {
        // One that is being written outside the lock first.
        self.end_checkpoint(st)?;
        if self.streams_checkpoint(st) {
            return self.checkpoint_streamed(st);
        }
        let Some(w) = self.begin_checkpoint(st)? else {
            unreachable!("no checkpoint in flight after end_checkpoint");
        };
        self.write_with_outcome(w);
        self.end_checkpoint(st)
    }

    /// Whether the next checkpoint is too large to copy (see
    /// [`UNLOCKED_BODY_MAX`]) and is streamed under the lock.
    fn streams_checkpoint(&self, st: &State) -> bool {
        #[cfg(test)]
        if self
            .stream_checkpoints
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return true;
        }
        st.last_ckpt_blocks * BLOCK_U64 > UNLOCKED_BODY_MAX
    }

    /// A checkpoint taken under the lock, written outside it: `st` is
    /// released while the body and headers are written and flushed, so
    /// writers go on meanwhile (they used to wait 5–30 ms per checkpoint
    /// on this machine's disk). Returns at once if another checkpoint is
    /// being written.
    pub(super) fn checkpoint_unlocked(&self, mut st: MutexGuard<'_, State>) -> Result<()> {
        if st.ckpt_io.is_some() {
            // Wait (without the lock) for its writes: what the caller
            // wanted durable is then durable, and it needs no other.
            let (seen, landed) = {
                let d = lock(&self.ckpt_done);
                (d.writes_done, d.result.is_some())
            };
            if landed {
                // Written: make it current now rather than wait for its
                // writer to come back for the lock.
                return self.end_checkpoint(&mut st);
            }
            drop(st);
            let mut d = lock(&self.ckpt_done);
            while d.writes_done == seen {
                d = self.ckpt_landed.wait(d).unwrap_or_else(|e| e.into_inner());
            }
            return Ok(());
        }
        if self.streams_checkpoint(&st) {
            return self.checkpoint_locked(&mut st);
        }
        let t0 = std::time::Instant::now();
        let w = self.begin_checkpoint(&mut st)?;
        let held = t0.elapsed();
        drop(st);
        let Some(w) = w else { return Ok(()) };
        self.write_with_outcome(w);
        let mut st = self.lock_state();
        let t1 = std::time::Instant::now();
        let r = self.end_checkpoint(&mut st);
        st.stats.checkpoint_micros += (held + t1.elapsed()).as_micros() as u64;
        r
    }

    /// Under the lock: seals the open batch and takes the checkpoint (the
    /// body encoded in memory, the log position, the segments it frees).
    /// `None` if one is already being written.
    fn begin_checkpoint(&self, st: &mut State) -> Result<Option<CkptWrite>> {
        if st.ckpt_io.is_some() {
            return Ok(None);
        }
        self.seal(st)?;
        let slot = 1 - st.active_slot;
        let seq = st.ckpt_seq + 1;
        let snap = Snapshot {
            heads: st
                .comps
                .iter()
                .map(|(&id, c)| CompHead::of(id, c))
                .collect(),
            indexes: st.comps.values().map(|c| c.index.clone()).collect(),
            segs: Self::seg_records(st)
                .into_iter()
                .map(|s| (s, st.segs.live(s), st.segs.bitmap(s).to_vec()))
                .collect(),
        };
        let hdr = self.ckpt_header(st, seq);
        st.ckpt_io = Some(CkptInFlight {
            seq,
            slot,
            log_at: st.log_since_ckpt,
            rec: st.segs.reclaimable(),
        });
        lock(&self.ckpt_done).result = None;
        Ok(Some(CkptWrite {
            snap,
            hdr,
            base: self.sb.slot_block(slot) * BLOCK_U64,
            target: st.seq - 1,
        }))
    }

    /// Without the state lock: makes the batches the checkpoint covers
    /// durable, then writes the body, flush, header copy 0, flush, header
    /// copy 1, flush. Records the outcome for `end_checkpoint`.
    fn write_with_outcome(&self, w: CkptWrite) {
        let mut o = Outcome {
            store: self,
            result: None,
        };
        o.result = Some(self.write_checkpoint(w).map_err(|e| e.to_string()));
    }

    /// Returns the checkpoint's size in device blocks.
    fn write_checkpoint(&self, w: CkptWrite) -> Result<u64> {
        self.write_sealed(false)?;
        self.wait_written(w.target)?;
        self.flush_written()?;
        let comps = w.snap.heads.into_iter().zip(w.snap.indexes.iter());
        let segs = w.snap.segs.iter().map(|(s, l, b)| (*s, *l, &b[..]));
        self.write_ckpt(comps, segs, w.hdr, w.base)
    }

    /// Writes a checkpoint to the slot at `base`: the body, flush, then
    /// `hdr` (completed with the body's length and CRC) in both copies,
    /// each flushed. Returns the checkpoint's size in device blocks.
    fn write_ckpt<'a>(
        &self,
        comps: impl ExactSizeIterator<Item = CompRecord<'a>>,
        segs: impl ExactSizeIterator<Item = (u32, u32, &'a [u64])>,
        hdr: CkptHeader,
        base: u64,
    ) -> Result<u64> {
        let io = |e| self.poison(e);
        let mut w = BodyWriter::new(&*self.dev, base + 2 * BLOCK_U64, self.sb.body_capacity());
        Self::encode_parts(comps, segs, &mut |b: &[u8]| w.put(b)).map_err(io)?;
        let (len, crc) = w.finish().map_err(io)?;
        self.dev.flush().map_err(io)?;
        let hdr = CkptHeader {
            body_len: len,
            body_crc: crc,
            ..hdr
        };
        self.write_ckpt_headers(&hdr, base)?;
        Ok(2 + len.div_ceil(BLOCK_U64))
    }

    /// A checkpoint header for the state now (body length and CRC to be
    /// filled in once the body is written).
    fn ckpt_header(&self, st: &State, seq: u64) -> CkptHeader {
        CkptHeader {
            uuid: self.sb.uuid,
            seq,
            epoch: st.epoch,
            next_batch: st.seq,
            head_seg: st.batch.seg,
            head_off: st.batch.off,
            next_seg: st.next_seg,
            body_len: 0,
            body_crc: 0,
        }
    }

    /// Header copy 0, flush, header copy 1, flush (the body is durable).
    fn write_ckpt_headers(&self, hdr: &CkptHeader, base: u64) -> Result<()> {
        for copy in 0..2u32 {
            self.dev
                .write_at(&hdr.encode(copy), base + copy as u64 * BLOCK_U64)
                .map_err(|e| self.poison(e))?;
            self.dev.flush().map_err(|e| self.poison(e))?;
        }
        Ok(())
    }

    /// Under the lock: waits for the writes of the checkpoint in flight
    /// (if any), then makes it the current one and frees the segments it
    /// no longer needs. Whoever holds the lock first after the writes
    /// does this: the writer, or a caller that needs a checkpoint now.
    fn end_checkpoint(&self, st: &mut State) -> Result<()> {
        let Some(c) = st.ckpt_io.take() else {
            return Ok(());
        };
        let outcome = {
            let mut d = lock(&self.ckpt_done);
            loop {
                if let Some(r) = d.result.take() {
                    break r;
                }
                d = self.ckpt_landed.wait(d).unwrap_or_else(|e| e.into_inner());
            }
        };
        // On an error the writer poisoned the store already.
        let blocks = outcome
            .map_err(|msg| StoreError::Io(io::Error::other(format!("checkpoint failed: {msg}"))))?;
        self.made_current(st, c, blocks);
        Ok(())
    }

    /// The old way, for bodies too large to copy: encoded and streamed to
    /// the device under the lock.
    fn checkpoint_streamed(&self, st: &mut State) -> Result<()> {
        self.seal(st)?;
        self.drain(st)?;
        self.flush_written()?;
        let slot = 1 - st.active_slot;
        let seq = st.ckpt_seq + 1;
        let base = self.sb.slot_block(slot) * BLOCK_U64;
        let comps = st
            .comps
            .iter()
            .map(|(&id, c)| (CompHead::of(id, c), &c.index));
        let recs = Self::seg_records(st);
        let segs = recs
            .iter()
            .map(|&s| (s, st.segs.live(s), st.segs.bitmap(s)));
        let blocks = self.write_ckpt(comps, segs, self.ckpt_header(st, seq), base)?;
        let done = CkptInFlight {
            seq,
            slot,
            log_at: st.log_since_ckpt,
            rec: st.segs.reclaimable(),
        };
        self.made_current(st, done, blocks);
        Ok(())
    }

    /// A durable checkpoint of `blocks` device blocks becomes the current
    /// one: the log counts from it, and the segments it frees are freed.
    fn made_current(&self, st: &mut State, c: CkptInFlight, blocks: u64) {
        st.ckpt_seq = c.seq;
        st.active_slot = c.slot;
        st.log_since_ckpt = st.log_since_ckpt.saturating_sub(c.log_at);
        st.last_ckpt_blocks = blocks;
        st.ckpt_due = st.log_since_ckpt >= self.ckpt_interval(st);
        st.stats.checkpoints += 1;
        st.stats.checkpoint_blocks += blocks;
        self.reclaim(st, c.rec);
    }

    /// Frees `rec`, segments no longer needed by the checkpoint just made
    /// durable (nor by replay from it): they may be written again, at once
    /// or, where a read in flight still reads one, once it is done
    /// (`Draining`, see `gate.rs`). Never waits.
    fn reclaim(&self, st: &mut State, rec: Vec<u32>) {
        if st.cleaning.is_some_and(|v| rec.contains(&v)) {
            // The background cleaner's copy of it is no longer safe to use.
            st.cleaning = None;
        }
        if !rec.is_empty() {
            let mut cache = lock(&self.cache);
            for s in rec {
                // Nothing writes into a used segment, and only checkpoints
                // (one at a time) free segments: still used and empty.
                assert!(
                    st.segs.state(s) == SegState::Used && st.segs.live(s) == 0,
                    "segment {s} changed between a checkpoint and its end"
                );
                for off in st.segs.headers(s) {
                    cache.remove(st.segs.block(s, off));
                }
                st.segs.clear_headers(s);
                if self.reuse.pinned(s) {
                    st.segs.set_state(s, SegState::Draining);
                } else {
                    self.make_free(st, s);
                }
            }
        }
        self.release_drained(st);
    }

    /// Frees the draining segments no read in flight pins any more, and
    /// publishes the free count. Cheap when none drains.
    pub(super) fn release_drained(&self, st: &mut State) {
        if !st.segs.draining().is_empty() {
            let done: Vec<u32> = st
                .segs
                .draining()
                .iter()
                .copied()
                .filter(|&s| !self.reuse.pinned(s))
                .collect();
            for s in done {
                self.make_free(st, s);
            }
        }
        self.free_hint
            .store(st.segs.free_count(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Segment `s`, emptied and no longer read, becomes free space.
    fn make_free(&self, st: &mut State, s: u32) {
        assert!(
            st.segs.live(s) == 0 && !self.reuse.pinned(s),
            "segment {s} freed while it holds live blocks or is read"
        );
        st.segs.set_state(s, SegState::Free);
        if self.prep.on() {
            // The device file is being prepared (allocated) ahead of the
            // log: a hole punched here would only be filled with zeros
            // again.
            #[cfg(test)]
            if self
                .prep
                .reprepare_freed
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                st.segs.set_unprepared([s]);
            }
            return;
        }
        let at = byte_off(st.segs.block(s, 0));
        if let Err(e) = self.dev.discard(at, self.geo.seg_blocks as u64 * BLOCK_U64) {
            tracing::debug!(segment = s, error = %e, "discard failed");
        }
    }

    /// The segments a checkpoint records: the head and the used ones
    /// with live blocks.
    fn seg_records(st: &State) -> Vec<u32> {
        (0..st.segs.count())
            .filter(|&s| match st.segs.state(s) {
                SegState::Head => true,
                SegState::Used => st.segs.live(s) > 0,
                _ => false,
            })
            .collect()
    }

    /// Body: component count (u64); per component (by id) its head
    /// ([`encode_head`](Self::encode_head)) and its index; count of
    /// segment records (u64); per record segment (u32), live blocks
    /// (u32), header bitmap.
    fn encode_parts<'a>(
        comps: impl ExactSizeIterator<Item = CompRecord<'a>>,
        segs: impl ExactSizeIterator<Item = (u32, u32, &'a [u64])>,
        w: &mut dyn FnMut(&[u8]) -> io::Result<()>,
    ) -> io::Result<()> {
        w(&(comps.len() as u64).to_le_bytes())?;
        for (head, index) in comps {
            Self::encode_head(&head, w)?;
            index.encode(|b| w(b))?;
        }
        w(&(segs.len() as u64).to_le_bytes())?;
        for (s, live, bitmap) in segs {
            w(&s.to_le_bytes())?;
            w(&live.to_le_bytes())?;
            for word in bitmap {
                w(&word.to_le_bytes())?;
            }
        }
        Ok(())
    }

    /// A component's head: id, volume, size, generation, count of marked
    /// regions (u64 each), the marked regions (u32 each, ascending), count
    /// of tracked regions (u64; [`CKPT_TRACKED_ALL`] for `All`, then no
    /// regions follow), the tracked regions (u32 each, ascending).
    fn encode_head(h: &CompHead, w: &mut dyn FnMut(&[u8]) -> io::Result<()>) -> io::Result<()> {
        let (ntracked, tracked): (u64, &[u32]) = match &h.tracked {
            Tracked::All => (CKPT_TRACKED_ALL, &[]),
            Tracked::Regions(r) => (r.len() as u64, r),
        };
        for v in [h.id, h.volume, h.size, h.generation, h.marks.len() as u64] {
            w(&v.to_le_bytes())?;
        }
        for r in &h.marks {
            w(&r.to_le_bytes())?;
        }
        w(&ntracked.to_le_bytes())?;
        for r in tracked {
            w(&r.to_le_bytes())?;
        }
        Ok(())
    }
}

/// Reads the newest checkpoint: the highest seq among the valid header
/// copies of both slots. Its body must match, or the device is corrupt
/// (an older checkpoint may need segments reused since).
pub(super) fn load(dev: &dyn BlockDevice, sb: &super::LogSuper) -> Result<Loaded> {
    let mut best: Option<(usize, CkptHeader)> = None;
    for slot in 0..2 {
        let mut b = AlignedBuf::zeroed(2 * BLOCK);
        dev.read_at(b.as_mut_slice(), sb.slot_block(slot) * BLOCK_U64)?;
        for copy in 0..2 {
            let Some(h) = CkptHeader::decode(&b.as_slice()[copy * BLOCK..(copy + 1) * BLOCK])
            else {
                continue;
            };
            if h.uuid != sb.uuid {
                continue;
            }
            if best.as_ref().is_none_or(|(_, b)| h.seq > b.seq) {
                best = Some((slot, h));
            }
        }
    }
    let Some((slot, hdr)) = best else {
        return Err(StoreError::Corrupt(
            "no valid checkpoint on the device".into(),
        ));
    };
    let bad = |m: &str| {
        StoreError::Corrupt(format!(
            "the newest checkpoint (seq {}, slot {slot}) is damaged: {m}",
            hdr.seq
        ))
    };
    if hdr.body_len > sb.body_capacity()
        || hdr.head_seg >= sb.nsegs
        || hdr.next_seg >= sb.nsegs
        || hdr.head_seg == hdr.next_seg
        || sb.seg_blocks - hdr.head_off.min(sb.seg_blocks) < 2
    {
        return Err(bad("impossible header fields"));
    }
    let mut r = BodyReader {
        dev,
        at: (sb.slot_block(slot) + 2) * BLOCK_U64,
        left: hdr.body_len,
        buf: AlignedBuf::zeroed(chunk_for(hdr.body_len)),
        pos: 0,
        filled: 0,
        crc: 0,
    };
    let parsed = parse_body(&mut r, sb);
    let complete = r.left == 0 && r.pos == r.filled && r.crc == hdr.body_crc;
    match parsed {
        Ok((comps, segs)) if complete => Ok(Loaded {
            hdr,
            slot,
            comps,
            segs,
        }),
        Ok(_) => Err(bad("body checksum or length mismatch")),
        Err(StoreError::Io(e)) => Err(StoreError::Io(e)),
        Err(e) => Err(bad(&e.to_string())),
    }
}

type Parsed = (BTreeMap<u64, Comp>, Vec<(u32, u32, Vec<u64>)>);

/// What the rest of a body may still hold of marked and tracked regions.
struct RegionsLeft {
    marks: u64,
    tracked: u64,
}

fn parse_body(r: &mut BodyReader<'_>, sb: &super::LogSuper) -> Result<Parsed> {
    let bad = |m: String| StoreError::Corrupt(m);
    let n = r.u64()?;
    if n > sb.max_components as u64 {
        return Err(bad(format!("{n} components")));
    }
    let mut comps = BTreeMap::new();
    let mut prev = 0u64;
    let mut left = RegionsLeft {
        marks: format::max_marks(sb.nsegs, sb.seg_blocks, sb.max_components),
        tracked: format::max_tracked(sb.nsegs, sb.seg_blocks, sb.max_components),
    };
    for _ in 0..n {
        let (id, comp) = parse_comp(r, &mut left)?;
        if id <= prev {
            return Err(bad(format!("component {id} after {prev}")));
        }
        prev = id;
        comps.insert(id, comp);
    }
    let nrec = r.u64()?;
    if nrec > sb.nsegs as u64 {
        return Err(bad(format!("{nrec} segment records")));
    }
    let words = (sb.seg_blocks as usize).div_ceil(64);
    let mut segs = Vec::with_capacity(nrec as usize);
    let mut last: Option<u32> = None;
    for _ in 0..nrec {
        let s = r.u32()?;
        let live = r.u32()?;
        if s >= sb.nsegs || last.is_some_and(|l| l >= s) || live >= sb.seg_blocks {
            return Err(bad(format!("segment record {s}")));
        }
        last = Some(s);
        let mut bits = vec![0u64; words];
        for w in bits.iter_mut() {
            *w = r.u64()?;
        }
        segs.push((s, live, bits));
    }
    Ok((comps, segs))
}

/// One component: its head (see `encode_head`) and its index.
fn parse_comp(r: &mut BodyReader<'_>, left: &mut RegionsLeft) -> Result<(u64, Comp)> {
    let (id, volume, size, generation) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    if size > MAX_SIZE {
        return Err(StoreError::Corrupt(format!(
            "component {id} of size {size}"
        )));
    }
    let nmarks = r.u64()?;
    let marks = parse_regions(r, id, "marked", nmarks, &mut left.marks)?;
    let tracked = match r.u64()? {
        CKPT_TRACKED_ALL => TrackSet::All,
        n => TrackSet::Regions(parse_regions(r, id, "tracked", n, &mut left.tracked)?),
    };
    let index = BlockIndex::decode(|b| r.read(b))?;
    let comp = Comp {
        volume,
        size,
        generation,
        index,
        marks,
        tracked,
    };
    Ok((id, comp))
}

/// `n` regions (u32 each, strictly ascending) of component `id`, taken
/// from what the body may still hold (`left`).
fn parse_regions(
    r: &mut BodyReader<'_>,
    id: u64,
    what: &str,
    n: u64,
    left: &mut u64,
) -> Result<BTreeSet<u32>> {
    let bad = |m: String| StoreError::Corrupt(format!("component {id}: {m}"));
    if n > *left {
        return Err(bad(format!(
            "{n} {what} regions, more than the device keeps"
        )));
    }
    *left -= n;
    let mut set = BTreeSet::new();
    for _ in 0..n {
        let x = r.u32()?;
        if set.last().is_some_and(|&l| l >= x) {
            return Err(bad(format!("{what} regions out of order")));
        }
        set.insert(x);
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::super::format::{ckpt_body_max, max_marks, max_tracked, LogSuper, REGION_BLOCKS};
    use super::super::FaultyDevice;
    use super::*;

    /// The largest body a device of `sb`'s geometry can need: every block
    /// of its segments mapped at the costliest encoding (one block per
    /// region: 13 bytes), every component in the table, the most marked
    /// and tracked regions at once, every segment recorded.
    fn worst_case(sb: &LogSuper) -> Snapshot {
        let comps = sb.max_components as u64;
        let blocks = sb.nsegs as u64 * sb.seg_blocks as u64;
        let marks = max_marks(sb.nsegs, sb.seg_blocks, sb.max_components);
        let tracked = max_tracked(sb.nsegs, sb.seg_blocks, sb.max_components);
        // Component i gets every `comps`-th block, mark and tracked region.
        let share = |n: u64, i: u64| (0..n).filter(move |k| k % comps == i);
        let heads = (0..comps)
            .map(|i| CompHead {
                id: i + 1,
                volume: 1,
                size: MAX_SIZE,
                generation: 7,
                marks: share(marks, i).map(|k| k as u32).collect(),
                tracked: Tracked::Regions(share(tracked, i).map(|k| k as u32).collect()),
            })
            .collect();
        let indexes = (0..comps)
            .map(|i| {
                let mut ix = BlockIndex::new();
                for k in share(blocks, i) {
                    ix.set(k * REGION_BLOCKS, k as u32 + 1);
                }
                ix
            })
            .collect();
        let words = (sb.seg_blocks as usize).div_ceil(64);
        let segs = (0..sb.nsegs)
            .map(|s| (s, sb.seg_blocks - 1, vec![u64::MAX; words]))
            .collect();
        Snapshot {
            heads,
            indexes,
            segs,
        }
    }

    /// The worst-case body is exactly what the slot is sized for, fits
    /// its slot and reads back: marks and tracked regions both at their
    /// bounds (tracking never fails for want of room, so both can be).
    #[test]
    fn the_worst_case_body_fits_its_slot_and_reads_back() {
        for (size, seg, comps) in [
            (1u64 << 20, 16, 8),
            (64 << 20, 64, 1024),
            (256 << 20, 1024, 64),
        ] {
            let sb = LogSuper::new(size, 1, "c", seg, comps, 900).unwrap();
            let Snapshot {
                heads,
                indexes,
                segs,
            } = worst_case(&sb);
            let dev = FaultyDevice::new(sb.device_size);
            let at = sb.slot_block(0) * BLOCK_U64 + 2 * BLOCK_U64;
            let mut w = BodyWriter::new(&dev, at, sb.body_capacity());
            let seg_refs = segs.iter().map(|(s, l, b)| (*s, *l, &b[..]));
            LogStore::encode_parts(
                heads.into_iter().zip(indexes.iter()),
                seg_refs,
                &mut |b: &[u8]| w.put(b),
            )
            .unwrap();
            let (len, crc) = w.finish().unwrap();
            let max = ckpt_body_max(sb.nsegs, sb.seg_blocks, sb.max_components);
            assert_eq!(len, max, "{size} B: the bound is exact");
            assert!(len <= sb.body_capacity());
            let mut r = BodyReader {
                dev: &dev,
                at,
                left: len,
                buf: AlignedBuf::zeroed(chunk_for(len)),
                pos: 0,
                filled: 0,
                crc: 0,
            };
            let (comps, segs_back) = parse_body(&mut r, &sb).unwrap();
            assert_eq!(r.crc, crc);
            assert_eq!(segs_back, segs);
            let listed: u64 = comps.values().map(|c| c.tracked.listed()).sum();
            let marked: usize = comps.values().map(|c| c.marks.len()).sum();
            assert_eq!(
                listed,
                max_tracked(sb.nsegs, sb.seg_blocks, sb.max_components)
            );
            assert_eq!(
                marked as u64,
                max_marks(sb.nsegs, sb.seg_blocks, sb.max_components)
            );
        }
    }

    /// A body naming more tracked regions than the device keeps, or out
    /// of order, is refused as corrupt, never loaded.
    #[test]
    fn bodies_past_the_tracked_bound_are_refused() {
        let sb = LogSuper::new(1 << 20, 1, "c", 16, 8, 900).unwrap();
        let max = max_tracked(sb.nsegs, sb.seg_blocks, sb.max_components);
        for (regions, what) in [
            (
                (0..=max as u32).collect::<Vec<_>>(),
                "more than the device keeps",
            ),
            (vec![3, 2], "out of order"),
        ] {
            let head = CompHead {
                id: 1,
                volume: 1,
                size: 1 << 20,
                generation: 0,
                marks: vec![],
                tracked: Tracked::Regions(regions),
            };
            let dev = FaultyDevice::new(sb.device_size);
            let mut body = Vec::new();
            let index = BlockIndex::new();
            LogStore::encode_parts(
                std::iter::once((head, &index)),
                std::iter::empty(),
                &mut |b: &[u8]| {
                    body.extend_from_slice(b);
                    Ok(())
                },
            )
            .unwrap();
            body.resize(body.len().div_ceil(BLOCK) * BLOCK, 0);
            dev.write_at(&body, 0).unwrap();
            let mut r = BodyReader {
                dev: &dev,
                at: 0,
                left: body.len() as u64,
                buf: AlignedBuf::zeroed(chunk_for(body.len() as u64)),
                pos: 0,
                filled: 0,
                crc: 0,
            };
            let e = parse_body(&mut r, &sb).err().expect("refused");
            assert!(e.to_string().contains(what), "{e}");
        }
    }
}
