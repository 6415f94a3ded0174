//! Opening: load the newest checkpoint, validate it, replay the batches
//! written after it.
//!
//! The log after a checkpoint is a chain: the batch with the next seq is at
//! a known place (right after the previous one, or at the start of the
//! segment the previous one names as `next_seg` when its segment is full).
//! A batch belongs to the chain when its header is valid and carries the
//! device uuid, the checkpoint's epoch, the expected seq and its own place.
//! Only batches written after the last flush can be torn; a batch header
//! says which seq was durable when it was written, so the data of a batch
//! is checked only when no later batch in the chain proves it durable. The
//! first batch whose data does not match its checksums ends the log (it
//! and what follows were never acknowledged).

use super::batch::OpenBatch;
use super::checkpoint::{self, Loaded};
use super::format::{BatchHeader, CkptHeader, Entry, LogSuper, BLOCK, BLOCK_U64, MAX_ENTRIES};
use super::segment::{SegState, Segments};
use super::{BlockDevice, Comp, LogStats, Result, State};
use crate::direct::AlignedBuf;
use crate::StoreError;
use std::collections::BTreeMap;

fn corrupt(m: String) -> StoreError {
    StoreError::Corrupt(m)
}

/// Rebuilds the store's state from the device. Returns it and the seq of
/// the last batch in it (everything up to it is on the device).
pub(super) fn recover(dev: &dyn BlockDevice, sb: &LogSuper) -> Result<(State, u64)> {
    let Loaded {
        hdr,
        slot,
        comps,
        segs: recs,
    } = checkpoint::load(dev, sb)?;
    let mut segs = Segments::new(sb.nsegs, sb.seg_blocks, sb.seg_off as u32);
    for (s, _, bits) in &recs {
        segs.set_state(*s, SegState::Used);
        segs.set_bitmap(*s, bits);
    }
    if segs.state(hdr.next_seg) != SegState::Free {
        return Err(corrupt(format!(
            "checkpoint names segment {} as next but it holds data",
            hdr.next_seg
        )));
    }
    segs.set_state(hdr.head_seg, SegState::Head);
    segs.set_state(hdr.next_seg, SegState::Next);
    let live = validate(&comps, &mut segs, &hdr)?;
    for (s, n, _) in &recs {
        if segs.live(*s) != *n {
            return Err(corrupt(format!(
                "checkpoint: segment {s} has {} live blocks, recorded {n}",
                segs.live(*s)
            )));
        }
    }
    let base = segs.block(hdr.head_seg, hdr.head_off);
    let mut st = State {
        comps,
        segs,
        batch: OpenBatch::new(hdr.head_seg, hdr.head_off, base, sb.seg_blocks),
        next_seg: hdr.next_seg,
        seq: hdr.next_batch,
        epoch: hdr.epoch,
        ckpt_seq: hdr.seq,
        active_slot: slot,
        live,
        log_since_ckpt: 0,
        last_ckpt_blocks: 0,
        ckpt_due: false,
        ckpt_io: None,
        stats: LogStats::default(),
        reserved: Default::default(),
        cleaning: None,
    };
    replay(dev, sb, &mut st, &hdr)?;
    let max = super::format::max_tracked(sb.nsegs, sb.seg_blocks, sb.max_components);
    if super::track::enforce_bound(&mut st.comps, max) > 0 {
        tracing::warn!("more regions tracked than the bound after replay: the largest sets now track every region");
    }
    let last = st.seq - 1;
    Ok((st, last))
}

/// Checks the checkpoint's index (every block in a used segment, before
/// the log head, not a header, not shared, within its component) and
/// counts live blocks per segment.
fn validate(comps: &BTreeMap<u64, Comp>, segs: &mut Segments, hdr: &CkptHeader) -> Result<u64> {
    let n = segs.count() as usize * segs.seg_blocks as usize;
    let mut seen = vec![0u64; n.div_ceil(64)];
    let mut live = 0u64;
    let mut err: Option<String> = None;
    for (&id, c) in comps {
        let blocks = c.blocks();
        c.index.for_each(|b, d| {
            if err.is_some() {
                return;
            }
            let Some((s, off)) = segs.locate(d) else {
                err = Some(format!(
                    "{id}/{b} at device block {d}, outside the segments"
                ));
                return;
            };
            let rel = (s * segs.seg_blocks + off) as usize;
            let ok_state = matches!(segs.state(s), SegState::Used | SegState::Head);
            let before_head = s != hdr.head_seg || off < hdr.head_off;
            if !ok_state || !before_head || segs.is_header(d) || b >= blocks {
                err = Some(format!("{id}/{b} at device block {d} is not a data block"));
                return;
            }
            if seen[rel / 64] & (1 << (rel % 64)) != 0 {
                err = Some(format!("device block {d} mapped twice"));
                return;
            }
            seen[rel / 64] |= 1 << (rel % 64);
            segs.inc(d);
            live += 1;
        });
    }
    match err {
        Some(e) => Err(corrupt(format!("checkpoint index: {e}"))),
        None => Ok(live),
    }
}

fn replay(dev: &dyn BlockDevice, sb: &LogSuper, st: &mut State, hdr: &CkptHeader) -> Result<()> {
    let seg_blocks = sb.seg_blocks;
    // 1. Follow the chain of valid headers.
    let mut chain: Vec<BatchHeader> = Vec::new();
    let (mut seg, mut off) = (hdr.head_seg, hdr.head_off);
    let mut next = Some(hdr.next_seg);
    let mut seq = hdr.next_batch;
    let mut hb = AlignedBuf::zeroed(BLOCK);
    let limit = sb.nsegs as usize * seg_blocks as usize;
    while chain.len() < limit {
        let d = st.segs.block(seg, off);
        dev.read_at(hb.as_mut_slice(), d as u64 * BLOCK_U64)?;
        let Some(h) = BatchHeader::decode(hb.as_slice()) else {
            break;
        };
        let ok = h.uuid == sb.uuid
            && h.epoch == hdr.epoch
            && h.seq == seq
            && h.seg == seg
            && h.off == off
            && h.n_data() < seg_blocks - off
            && h.next_seg < sb.nsegs
            && h.next_seg != seg
            && next.is_none_or(|n| n == h.next_seg);
        if !ok {
            break;
        }
        next = Some(h.next_seg);
        let end = off + 1 + h.n_data();
        chain.push(h);
        seq += 1;
        if seg_blocks - end < 2 {
            seg = next.take().unwrap_or(seg);
            off = 0;
        } else {
            off = end;
        }
    }
    let ended_at = (seg, off, seq);
    // 2. Check the data of batches not proven durable.
    let durable = chain
        .iter()
        .map(|h| h.durable_seq)
        .max()
        .unwrap_or(0)
        .max(hdr.next_batch - 1);
    let mut cut = chain.len();
    let mut buf = AlignedBuf::zeroed(MAX_ENTRIES.min(seg_blocks as usize) * BLOCK);
    for (i, h) in chain.iter().enumerate() {
        if h.seq <= durable || h.n_data() == 0 {
            continue;
        }
        let n = h.n_data() as usize;
        let d0 = st.segs.block(h.seg, h.off + 1);
        dev.read_at(&mut buf.as_mut_slice()[..n * BLOCK], d0 as u64 * BLOCK_U64)?;
        let mut j = 0;
        let intact = h.entries.iter().all(|e| match e {
            Entry::Data { crc, .. } => {
                let ok = crc32c::crc32c(&buf.as_slice()[j * BLOCK..(j + 1) * BLOCK]) == *crc;
                j += 1;
                ok
            }
            _ => true,
        });
        if !intact {
            tracing::info!(seq = h.seq, "torn batch at the end of the log discarded");
            cut = i;
            break;
        }
    }
    if cut == chain.len() {
        probe(dev, sb, st, hdr, ended_at)?;
    } else {
        chain.truncate(cut);
    }
    // 3. Apply.
    let (mut seg, mut off) = (hdr.head_seg, hdr.head_off);
    let mut next = Some(hdr.next_seg);
    for h in &chain {
        if seg_blocks - off < 2 || h.seg != seg {
            // The log moved into the next segment; its first batch names
            // the one after.
            st.segs.set_state(seg, SegState::Used);
            seg = h.seg;
            off = 0;
            st.segs.set_state(seg, SegState::Head);
            if st.segs.state(h.next_seg) != SegState::Free {
                return Err(corrupt(format!(
                    "batch {} names segment {} as next, which is not free",
                    h.seq, h.next_seg
                )));
            }
            st.segs.set_state(h.next_seg, SegState::Next);
            next = Some(h.next_seg);
        }
        debug_assert_eq!((h.seg, h.off), (seg, off));
        st.segs.set_header(h.seg, h.off);
        apply(st, h);
        off = h.off + 1 + h.n_data();
    }
    if seg_blocks - off < 2 {
        st.segs.set_state(seg, SegState::Used);
        seg = next.take().expect("next segment");
        st.segs.set_state(seg, SegState::Head);
        off = 0;
    }
    let next = match next {
        Some(n) => n,
        None => st
            .segs
            .pop_free()
            .ok_or_else(|| corrupt("no free segment".into()))?,
    };
    st.next_seg = next;
    let base = st.segs.block(seg, off);
    st.batch.reset(seg, off, base, seg_blocks);
    st.seq = hdr.next_batch + chain.len() as u64;
    st.stats.replayed_batches = chain.len() as u64;
    st.stats.replayed_blocks = chain.iter().map(|h| 1 + h.n_data() as u64).sum();
    if !chain.is_empty() {
        tracing::info!(
            batches = chain.len(),
            "replayed the log after the checkpoint"
        );
    }
    Ok(())
}

/// The chain ended at an unreadable header. If a later batch of the same
/// epoch in that segment says the missing one was durable, the header was
/// damaged after it was written: refuse rather than lose acknowledged
/// writes silently.
fn probe(
    dev: &dyn BlockDevice,
    sb: &LogSuper,
    st: &State,
    hdr: &CkptHeader,
    (seg, off, seq): (u32, u32, u64),
) -> Result<()> {
    let n = (sb.seg_blocks - off) as usize;
    let mut buf = AlignedBuf::zeroed(n * BLOCK);
    dev.read_at(
        buf.as_mut_slice(),
        st.segs.block(seg, off) as u64 * BLOCK_U64,
    )?;
    for k in 1..n {
        if let Some(h) = BatchHeader::decode(&buf.as_slice()[k * BLOCK..(k + 1) * BLOCK]) {
            if h.uuid == sb.uuid && h.epoch == hdr.epoch && h.seq > seq && h.durable_seq >= seq {
                return Err(corrupt(format!(
                    "batch {seq} of the log is unreadable but batch {} says it was durable",
                    h.seq
                )));
            }
        }
    }
    Ok(())
}

/// Applies one batch's entries, in order.
fn apply(st: &mut State, h: &BatchHeader) {
    let d0 = st.segs.block(h.seg, h.off + 1);
    let mut j = 0u32;
    for e in &h.entries {
        match *e {
            Entry::Data { comp, block, .. } => {
                let d = d0 + j;
                j += 1;
                let State {
                    comps, segs, live, ..
                } = &mut *st;
                let Some(c) = comps.get_mut(&comp) else {
                    continue;
                };
                if block >= c.blocks() {
                    continue;
                }
                match c.index.set(block, d) {
                    Some(old) => segs.dec(old),
                    None => *live += 1,
                }
                segs.inc(d);
            }
            Entry::Trim { comp, first, count } => {
                super::LogStore::unmap(st, comp, first, first.saturating_add(count as u64));
            }
            Entry::Put {
                comp,
                volume,
                size,
                generation,
            } => match st.comps.get_mut(&comp) {
                Some(c) => {
                    let keep = size.div_ceil(BLOCK_U64);
                    c.size = size;
                    c.volume = volume;
                    c.generation = generation;
                    super::LogStore::unmap(st, comp, keep, u64::MAX);
                }
                None => {
                    st.comps.insert(
                        comp,
                        Comp {
                            volume,
                            size,
                            generation,
                            index: super::index::BlockIndex::new(),
                            marks: Default::default(),
                            tracked: Default::default(),
                        },
                    );
                }
            },
            Entry::Delete { comp } => {
                super::LogStore::unmap(st, comp, 0, u64::MAX);
                st.comps.remove(&comp);
            }
            Entry::Mark { comp, region, on } => {
                if let (Some(c), Ok(r)) = (st.comps.get_mut(&comp), u32::try_from(region)) {
                    if on {
                        c.marks.insert(r);
                    } else {
                        c.marks.remove(&r);
                    }
                }
            }
            Entry::Track { comp, .. } | Entry::TrackAll { comp } | Entry::UntrackAll { comp } => {
                if let Some(c) = st.comps.get_mut(&comp) {
                    c.tracked.apply(e);
                }
            }
        }
    }
}
