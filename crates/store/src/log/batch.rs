//! The open batch (what the next group commit writes) and a small cache of
//! decoded batch headers (the checksums reads verify against).

use super::format::{BatchHeader, Entry, BLOCK, MAX_ENTRIES};
use crate::direct::AlignedBuf;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// The batch being filled: its position is fixed when it is opened, so
/// the index can point at its data blocks before they are written; reads
/// of those blocks are served from `buf`.
pub struct OpenBatch {
    pub seg: u32,
    /// Block offset of the header in the segment.
    pub off: u32,
    /// Device block of the header.
    pub base: u32,
    pub entries: Vec<Entry>,
    /// Header entry slots used.
    pub slots: usize,
    pub n_data: u32,
    /// Data blocks that fit after the header in this segment.
    pub cap_data: u32,
    /// Entry index of each data block.
    pub data_entry: Vec<usize>,
    /// Header block, then the data blocks.
    pub buf: AlignedBuf,
}

impl OpenBatch {
    pub fn new(seg: u32, off: u32, base: u32, seg_blocks: u32) -> OpenBatch {
        let mut b = OpenBatch {
            seg: 0,
            off: 0,
            base: 0,
            entries: Vec::with_capacity(MAX_ENTRIES),
            slots: 0,
            n_data: 0,
            cap_data: 0,
            data_entry: Vec::with_capacity(MAX_ENTRIES),
            buf: AlignedBuf::zeroed((1 + MAX_ENTRIES.min(seg_blocks as usize - 1)) * BLOCK),
        };
        b.reset(seg, off, base, seg_blocks);
        b
    }

    /// Empties the batch and places it at `off` of segment `seg`.
    pub fn reset(&mut self, seg: u32, off: u32, base: u32, seg_blocks: u32) {
        debug_assert!(seg_blocks - off >= 2);
        self.seg = seg;
        self.off = off;
        self.base = base;
        self.entries.clear();
        self.data_entry.clear();
        self.slots = 0;
        self.n_data = 0;
        self.cap_data = (MAX_ENTRIES as u32).min(seg_blocks - off - 1);
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn fits(&self, slots: usize, data: u32) -> bool {
        self.slots + slots <= MAX_ENTRIES && self.n_data + data <= self.cap_data
    }

    /// Index in the batch of data block `d`, if it is one of ours.
    pub fn slot_of(&self, d: u32) -> Option<usize> {
        (d > self.base && d <= self.base + self.n_data).then(|| (d - self.base - 1) as usize)
    }

    pub fn data(&self, i: usize) -> &[u8] {
        &self.buf.as_slice()[(1 + i) * BLOCK..(2 + i) * BLOCK]
    }

    pub fn data_mut(&mut self, i: usize) -> &mut [u8] {
        &mut self.buf.as_mut_slice()[(1 + i) * BLOCK..(2 + i) * BLOCK]
    }

    /// Adds an entry (and its data block); returns the data block's index.
    /// The caller checked [`fits`](Self::fits).
    pub fn push(&mut self, e: Entry, data: Option<&[u8]>) -> Option<usize> {
        debug_assert!(self.fits(e.slots(), data.is_some() as u32));
        self.slots += e.slots();
        self.entries.push(e);
        let i = data.map(|d| {
            let i = self.n_data as usize;
            self.n_data += 1;
            self.data_entry.push(self.entries.len() - 1);
            self.data_mut(i).copy_from_slice(d);
            i
        });
        i
    }

    /// Replaces data block `i` in place (a rewrite before the batch is
    /// written).
    pub fn overwrite(&mut self, i: usize, data: &[u8], crc: u32) {
        self.data_mut(i).copy_from_slice(data);
        let e = self.data_entry[i];
        if let Entry::Data { crc: c, bad: b, .. } = &mut self.entries[e] {
            *c = crc;
            *b = false;
        }
    }

    /// Bytes to write: the header (encoded into the buffer) and the data.
    pub fn seal(&mut self, h: &BatchHeader) -> &[u8] {
        h.encode_into(&mut self.buf.as_mut_slice()[..BLOCK]);
        &self.buf.as_slice()[..(1 + self.n_data as usize) * BLOCK]
    }
}

/// What a header says of one of its data blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataRef {
    pub comp: u64,
    pub block: u64,
    pub crc: u32,
    pub bad: bool,
}

pub fn data_refs(entries: &[Entry]) -> Arc<[DataRef]> {
    entries
        .iter()
        .filter_map(|e| match *e {
            Entry::Data {
                comp,
                block,
                crc,
                bad,
            } => Some(DataRef {
                comp,
                block,
                crc,
                bad,
            }),
            _ => None,
        })
        .collect()
}

/// Decoded headers by device block, evicted in insertion order. The
/// capacity counts data refs (a header counts at least 1), so it bounds
/// memory (24 B per ref) whatever the batch sizes.
pub struct HeaderCache {
    map: HashMap<u32, Arc<[DataRef]>>,
    order: VecDeque<u32>,
    cap: usize,
    /// Refs held (each header counted as at least 1).
    held: usize,
}

fn weight(r: &[DataRef]) -> usize {
    r.len().max(1)
}

impl HeaderCache {
    pub fn new(cap: usize) -> HeaderCache {
        HeaderCache {
            map: HashMap::new(),
            order: VecDeque::new(),
            cap,
            held: 0,
        }
    }

    pub fn get(&self, h: u32) -> Option<Arc<[DataRef]>> {
        self.map.get(&h).cloned()
    }

    /// Entry `i` of header `h`, copied: `None` if the header is not
    /// cached, `Some(None)` if it has no such entry. (Cheaper than [`get`]
    /// (Self::get) on a read's path: no reference count to touch.)
    pub fn entry(&self, h: u32, i: usize) -> Option<Option<DataRef>> {
        self.map.get(&h).map(|r| r.get(i).copied())
    }

    pub fn insert(&mut self, h: u32, refs: Arc<[DataRef]>) {
        self.held += weight(&refs);
        match self.map.insert(h, refs) {
            None => self.order.push_back(h),
            Some(old) => self.held -= weight(&old),
        }
        while self.held > self.cap {
            let Some(k) = self.order.pop_front() else {
                break;
            };
            if let Some(old) = self.map.remove(&k) {
                self.held -= weight(&old);
            }
        }
        if self.order.len() > 4 * self.cap.max(16) {
            let map = &self.map;
            self.order.retain(|k| map.contains_key(k));
        }
    }

    pub fn remove(&mut self, h: u32) {
        if let Some(old) = self.map.remove(&h) {
            self.held -= weight(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_batch_places_and_rewrites_blocks() {
        let mut b = OpenBatch::new(3, 10, 1000, 16);
        assert_eq!(b.cap_data, 5);
        assert!(b.is_empty() && b.fits(2, 5) && !b.fits(1, 6));
        let d = |c, blk| Entry::Data {
            comp: c,
            block: blk,
            crc: 0,
            bad: false,
        };
        assert_eq!(b.push(d(1, 7), Some(&[1u8; BLOCK])), Some(0));
        assert_eq!(b.push(Entry::Delete { comp: 9 }, None), None);
        assert_eq!(b.push(d(1, 8), Some(&[2u8; BLOCK])), Some(1));
        assert_eq!(
            (b.slot_of(1000), b.slot_of(1001), b.slot_of(1002)),
            (None, Some(0), Some(1))
        );
        assert_eq!(b.slot_of(1003), None);
        b.overwrite(1, &[3u8; BLOCK], 42);
        assert_eq!(b.data(1), &[3u8; BLOCK][..]);
        assert!(matches!(b.entries[2], Entry::Data { crc: 42, .. }));
        let h = BatchHeader {
            uuid: 1,
            seq: 2,
            epoch: 3,
            durable_seq: 1,
            ckpt_seq: 1,
            seg: 3,
            off: 10,
            next_seg: 4,
            entries: b.entries.clone(),
        };
        let bytes = b.seal(&h).to_vec();
        assert_eq!(bytes.len(), 3 * BLOCK);
        assert_eq!(BatchHeader::decode(&bytes[..BLOCK]), Some(h.clone()));
        let refs = data_refs(&h.entries);
        assert_eq!(refs.len(), 2);
        assert_eq!((refs[1].block, refs[1].crc), (8, 42));
        b.reset(4, 0, 2000, 16);
        assert!(b.is_empty() && b.cap_data == 15 && b.slot_of(2001).is_none());
    }

    fn d(comp: u64, block: u64) -> Entry {
        Entry::Data {
            comp,
            block,
            crc: 0,
            bad: false,
        }
    }

    #[test]
    fn header_cache_evicts_oldest() {
        let mut c = HeaderCache::new(2);
        let r = data_refs(&[]);
        c.insert(1, r.clone());
        c.insert(2, r.clone());
        c.insert(3, r.clone());
        assert!(c.get(1).is_none() && c.get(2).is_some() && c.get(3).is_some());
        c.remove(2);
        assert!(c.get(2).is_none());
        for k in 10..200 {
            c.insert(k, r.clone());
        }
        assert!(c.map.len() <= 2 && c.order.len() <= 4 * 16 + 2);
        // Capacity counts refs: one header of 3 refs evicts two of 1.
        let mut c = HeaderCache::new(3);
        c.insert(1, r.clone());
        c.insert(2, r.clone());
        let three = data_refs(&[d(1, 1), d(1, 2), d(1, 3)]);
        c.insert(3, three);
        assert!(c.get(1).is_none() && c.get(2).is_none() && c.get(3).is_some());
        assert_eq!(c.held, 3);
    }
}
