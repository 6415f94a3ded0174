//! The segment table: state and live-block count of every segment, and
//! where its batch headers are (one bit per block), so a read can find the
//! header that holds a data block's checksum.

use std::collections::BTreeSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegState {
    /// May be written (no checkpoint or replay needs its contents).
    Free,
    /// The log is being appended to it.
    Head,
    /// Reserved as the head's successor (named in the head's batches).
    Next,
    /// Written; may hold live blocks. With none left it becomes `Free` at
    /// the next checkpoint.
    Used,
    /// A free segment the preparer is writing zeros over (`prepare.rs`):
    /// out of the free set, so the log never takes it meanwhile, but
    /// counted as free space (it is given back when the zeros are written).
    Zeroing,
    /// Freed by a durable checkpoint while a read in flight still reads
    /// it (`gate.rs`): becomes `Free` once that read is done. Not free
    /// space yet, and recorded by no checkpoint (free after a restart).
    Draining,
}

pub struct Segments {
    pub seg_blocks: u32,
    /// Device block of segment 0.
    pub seg_off: u32,
    state: Vec<SegState>,
    live: Vec<u32>,
    hdr: Vec<u64>,
    words: usize,
    free: BTreeSet<u32>,
    /// Free segments not allocated by the file system under them, to be
    /// prepared (`prepare.rs`). Only ever free or zeroing segments: the
    /// log taking one removes it.
    unprepared: BTreeSet<u32>,
    /// The segment in the `Zeroing` state, if any (at most one).
    zeroing: Option<u32>,
    /// The segments in the `Draining` state (few: those a read in flight
    /// pinned when a checkpoint freed them).
    draining: Vec<u32>,
}

impl Segments {
    pub fn new(nsegs: u32, seg_blocks: u32, seg_off: u32) -> Segments {
        let words = (seg_blocks as usize).div_ceil(64);
        Segments {
            seg_blocks,
            seg_off,
            state: vec![SegState::Free; nsegs as usize],
            live: vec![0; nsegs as usize],
            hdr: vec![0; nsegs as usize * words],
            words,
            free: (0..nsegs).collect(),
            unprepared: BTreeSet::new(),
            zeroing: None,
            draining: Vec::new(),
        }
    }

    pub fn count(&self) -> u32 {
        self.state.len() as u32
    }

    pub fn state(&self, s: u32) -> SegState {
        self.state[s as usize]
    }

    pub fn set_state(&mut self, s: u32, st: SegState) {
        // Only `claim_zeroing` and `end_zeroing` move a segment into or out
        // of `Zeroing`: nothing else may take it while zeros are written.
        assert!(
            self.state[s as usize] != SegState::Zeroing && st != SegState::Zeroing,
            "segment {s} changes state while it is being zeroed"
        );
        if st == SegState::Free {
            self.free.insert(s);
        } else {
            self.free.remove(&s);
        }
        let was = self.state[s as usize];
        if was == SegState::Draining && st != SegState::Draining {
            self.draining.retain(|&d| d != s);
        } else if st == SegState::Draining && was != SegState::Draining {
            self.draining.push(s);
        }
        self.state[s as usize] = st;
    }

    /// Free segments, the one being zeroed included (it is free space that
    /// is given back within one write of zeros).
    pub fn free_count(&self) -> usize {
        self.free.len() + self.zeroing.is_some() as usize
    }

    /// Takes the lowest free segment (never the one being zeroed).
    pub fn pop_free(&mut self) -> Option<u32> {
        let s = self.free.pop_first()?;
        self.state[s as usize] = SegState::Next;
        // The log writes it whole: it needs no preparation any more.
        self.unprepared.remove(&s);
        Some(s)
    }

    /// The free segments in the order [`pop_free`](Self::pop_free) takes
    /// them.
    pub fn free_in_order(&self) -> impl Iterator<Item = u32> + '_ {
        self.free.iter().copied()
    }

    /// Records the free segments among `segs` as unprepared (not
    /// allocated under them); others are ignored.
    pub fn set_unprepared(&mut self, segs: impl IntoIterator<Item = u32>) {
        for s in segs {
            if s < self.count() && self.state(s) == SegState::Free {
                self.unprepared.insert(s);
            }
        }
    }

    pub fn is_unprepared(&self, s: u32) -> bool {
        self.unprepared.contains(&s)
    }

    /// Free segments still unprepared (the one being zeroed included).
    pub fn unprepared_count(&self) -> usize {
        self.unprepared.len()
    }

    /// The lowest unprepared free segment not being zeroed.
    pub fn first_unprepared(&self) -> Option<u32> {
        self.unprepared
            .iter()
            .copied()
            .find(|&s| Some(s) != self.zeroing)
    }

    /// Forgets every unprepared segment (preparation stopped).
    pub fn clear_unprepared(&mut self) {
        self.unprepared.clear();
    }

    /// The segment being zeroed, if any.
    pub fn zeroing(&self) -> Option<u32> {
        self.zeroing
    }

    /// Takes free segment `s` out of the free set to write zeros over it:
    /// the log cannot take it until [`end_zeroing`](Self::end_zeroing).
    pub fn claim_zeroing(&mut self, s: u32) {
        assert!(
            self.state(s) == SegState::Free && self.live(s) == 0 && self.zeroing.is_none(),
            "claiming segment {s} ({:?}, {} live) for zeroing while {:?} is",
            self.state(s),
            self.live(s),
            self.zeroing
        );
        self.free.remove(&s);
        self.state[s as usize] = SegState::Zeroing;
        self.zeroing = Some(s);
    }

    /// Gives segment `s` back to the free set once its zeros are written
    /// (`prepared`) or failed.
    pub fn end_zeroing(&mut self, s: u32, prepared: bool) {
        assert!(
            self.zeroing == Some(s) && self.state(s) == SegState::Zeroing,
            "segment {s} was not being zeroed"
        );
        self.zeroing = None;
        self.state[s as usize] = SegState::Free;
        self.free.insert(s);
        if prepared {
            self.unprepared.remove(&s);
        }
    }

    pub fn live(&self, s: u32) -> u32 {
        self.live[s as usize]
    }

    /// A data block at device block `d` became live.
    pub fn inc(&mut self, d: u32) {
        let (s, _) = self.locate(d).expect("live block outside the segments");
        self.live[s as usize] += 1;
    }

    /// The data block at device block `d` died.
    pub fn dec(&mut self, d: u32) {
        let (s, _) = self.locate(d).expect("live block outside the segments");
        self.live[s as usize] -= 1;
    }

    /// (segment, offset in it) of device block `d`, if in the segment area.
    pub fn locate(&self, d: u32) -> Option<(u32, u32)> {
        let rel = d.checked_sub(self.seg_off)?;
        let s = rel / self.seg_blocks;
        (s < self.count()).then_some((s, rel % self.seg_blocks))
    }

    /// Device block of `off` in segment `s`.
    pub fn block(&self, s: u32, off: u32) -> u32 {
        self.seg_off + s * self.seg_blocks + off
    }

    pub fn set_header(&mut self, s: u32, off: u32) {
        let w = s as usize * self.words + off as usize / 64;
        self.hdr[w] |= 1 << (off % 64);
    }

    pub fn is_header(&self, d: u32) -> bool {
        let Some((s, off)) = self.locate(d) else {
            return false;
        };
        self.hdr[s as usize * self.words + off as usize / 64] & (1 << (off % 64)) != 0
    }

    /// Device block of the header of the batch holding data block `d`: the
    /// last header at or before it in its segment.
    pub fn header_of(&self, d: u32) -> Option<u32> {
        let (s, off) = self.locate(d)?;
        let base = s as usize * self.words;
        let mut w = off as usize / 64;
        let mut mask = if off % 64 == 63 {
            u64::MAX
        } else {
            (1u64 << (off % 64 + 1)) - 1
        };
        loop {
            let bits = self.hdr[base + w] & mask;
            if bits != 0 {
                let o = w as u32 * 64 + 63 - bits.leading_zeros();
                return Some(self.block(s, o));
            }
            if w == 0 {
                return None;
            }
            w -= 1;
            mask = u64::MAX;
        }
    }

    /// Offsets of the batch headers of segment `s`, in order.
    pub fn headers(&self, s: u32) -> Vec<u32> {
        let mut v = Vec::new();
        for (w, &bits) in self.bitmap(s).iter().enumerate() {
            let mut b = bits;
            while b != 0 {
                let i = b.trailing_zeros();
                v.push(w as u32 * 64 + i);
                b &= b - 1;
            }
        }
        v
    }

    pub fn bitmap(&self, s: u32) -> &[u64] {
        let base = s as usize * self.words;
        &self.hdr[base..base + self.words]
    }

    pub fn set_bitmap(&mut self, s: u32, bits: &[u64]) {
        let base = s as usize * self.words;
        self.hdr[base..base + self.words].copy_from_slice(bits);
    }

    pub fn clear_headers(&mut self, s: u32) {
        let base = s as usize * self.words;
        self.hdr[base..base + self.words].fill(0);
    }

    /// Used segments without live blocks (free after the next checkpoint).
    pub fn reclaimable(&self) -> Vec<u32> {
        (0..self.count())
            .filter(|&s| self.state(s) == SegState::Used && self.live(s) == 0)
            .collect()
    }

    /// The segments in the `Draining` state.
    pub fn draining(&self) -> &[u32] {
        &self.draining
    }

    /// Heap bytes of the table.
    pub fn heap_bytes(&self) -> usize {
        self.state.len() * (1 + 4 + 8 * self.words) + (self.free.len() + self.unprepared.len()) * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_found() {
        let mut t = Segments::new(4, 130, 1000);
        assert_eq!(t.locate(999), None);
        assert_eq!(t.locate(1000 + 131), Some((1, 1)));
        assert_eq!(t.locate(1000 + 4 * 130), None);
        t.set_header(1, 0);
        t.set_header(1, 64);
        t.set_header(1, 127);
        let b = |o: u32| t.block(1, o);
        assert_eq!(t.header_of(b(0)), Some(b(0)));
        assert_eq!(t.header_of(b(63)), Some(b(0)));
        assert_eq!(t.header_of(b(64)), Some(b(64)));
        assert_eq!(t.header_of(b(100)), Some(b(64)));
        assert_eq!(t.header_of(b(129)), Some(b(127)));
        assert_eq!(t.header_of(t.block(2, 5)), None);
        assert!(t.is_header(b(127)) && !t.is_header(b(128)));
        assert_eq!(t.headers(1), vec![0, 64, 127]);
        t.clear_headers(1);
        assert_eq!(t.headers(1), Vec::<u32>::new());
        assert_eq!(t.pop_free(), Some(0));
        assert_eq!(t.free_count(), 3);
        t.set_state(0, SegState::Used);
        assert_eq!(t.reclaimable(), vec![0]);
        t.inc(1000);
        assert_eq!(t.reclaimable(), Vec::<u32>::new());
    }

    #[test]
    fn a_segment_being_zeroed_is_never_taken() {
        let mut t = Segments::new(5, 64, 0);
        assert_eq!(t.pop_free(), Some(0));
        t.set_unprepared([0, 1, 2, 4]);
        // Segment 0 is not free: not recorded.
        assert!(!t.is_unprepared(0) && t.is_unprepared(1));
        assert_eq!(t.unprepared_count(), 3);
        t.claim_zeroing(1);
        assert_eq!(t.state(1), SegState::Zeroing);
        // Still free space, but the log takes the others.
        assert_eq!(t.free_count(), 4);
        assert_eq!(t.first_unprepared(), Some(2));
        assert_eq!(t.free_in_order().collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(t.pop_free(), Some(2));
        assert!(!t.is_unprepared(2));
        assert_eq!(t.pop_free(), Some(3));
        assert_eq!(t.pop_free(), Some(4));
        assert_eq!(t.pop_free(), None);
        assert_eq!(t.free_count(), 1);
        t.end_zeroing(1, true);
        assert_eq!(t.unprepared_count(), 0);
        assert_eq!(t.pop_free(), Some(1));
        // A failed zeroing leaves it unprepared.
        let mut t = Segments::new(3, 64, 0);
        t.set_unprepared(0..3);
        t.claim_zeroing(2);
        t.end_zeroing(2, false);
        assert!(t.is_unprepared(2) && t.state(2) == SegState::Free);
    }

    #[test]
    #[should_panic(expected = "being zeroed")]
    fn a_segment_being_zeroed_keeps_its_state() {
        let mut t = Segments::new(3, 64, 0);
        t.claim_zeroing(1);
        t.set_state(1, SegState::Used);
    }
}
