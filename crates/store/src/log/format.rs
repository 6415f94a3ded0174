//! Byte layout of a log-structured Shoal device, format version 4 (see
//! `docs/store-log-format.md`). Pure encoding, decoding and geometry; no I/O.
//! All integers are little-endian; CRC is CRC-32C.

use crate::format::MAGIC as SB_MAGIC;
use crate::StoreError;

/// Unit of data, of checksums and of device I/O.
pub const BLOCK: usize = 4096;
pub const BLOCK_U64: u64 = BLOCK as u64;
pub const LOG_VERSION: u32 = 4;
pub const BATCH_MAGIC: &[u8; 8] = b"SHOALLOG";
pub const CKPT_MAGIC: &[u8; 8] = b"SHOALCKP";
/// Fixed part of a batch header; entries follow.
pub const HDR_FIXED: usize = 80;
pub const ENTRY_SIZE: usize = 24;
/// Entries (24 B each) that fit in one 4 KiB batch header.
pub const MAX_ENTRIES: usize = (BLOCK - 4 - HDR_FIXED) / ENTRY_SIZE;
/// Blocks per index region (1 MiB).
pub const REGION_BLOCKS: u64 = 256;
/// Worst-case bytes of one mapped block in a checkpoint body.
pub const CKPT_BYTES_PER_BLOCK: u64 = 13;
/// Bytes of one component record in a checkpoint body without its marked
/// and tracked regions and its index's regions: id, volume, size,
/// generation, mark count, tracked count, index region count (u64 each).
pub const CKPT_COMP_BYTES: u64 = 56;
/// Bytes of one marked region in a checkpoint body.
pub const CKPT_BYTES_PER_MARK: u64 = 4;
/// Bytes of one tracked region in a checkpoint body.
pub const CKPT_BYTES_PER_TRACKED: u64 = 4;
/// The tracked count of a component record whose tracked set is `All`
/// (no regions follow it).
pub const CKPT_TRACKED_ALL: u64 = u64::MAX;
/// Fewest segments a device may have.
pub const MIN_SEGMENTS: u32 = 12;
pub const MAX_CLUSTER_ID: usize = crate::format::MAX_CLUSTER_ID;

const CRC_AT: usize = BLOCK - 4;

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

pub(crate) fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn seal_crc(b: &mut [u8]) {
    let crc = crc32c::crc32c(&b[..CRC_AT]);
    put32(b, CRC_AT, crc);
}

fn crc_ok(b: &[u8]) -> bool {
    b.len() >= BLOCK && crc32c::crc32c(&b[..CRC_AT]) == u32_at(b, CRC_AT)
}

/// Data blocks one segment holds when written in full batches.
pub fn dense_per_segment(seg_blocks: u32) -> u64 {
    let (mut off, mut data) = (0u64, 0u64);
    let seg = seg_blocks as u64;
    while seg - off >= 2 {
        let n = (MAX_ENTRIES as u64).min(seg - off - 1);
        data += n;
        off += 1 + n;
    }
    data
}

/// Upper bound of a checkpoint body in bytes.
pub fn ckpt_body_max(nsegs: u32, seg_blocks: u32, max_components: u32) -> u64 {
    let words = (seg_blocks as u64).div_ceil(64);
    16 + max_components as u64 * CKPT_COMP_BYTES
        + nsegs as u64 * (8 + 8 * words)
        + CKPT_BYTES_PER_BLOCK * nsegs as u64 * seg_blocks as u64
        + CKPT_BYTES_PER_MARK * max_marks(nsegs, seg_blocks, max_components)
        + CKPT_BYTES_PER_TRACKED * max_tracked(nsegs, seg_blocks, max_components)
}

/// Most regions a device keeps marked at once (all components): one per
/// region of its segments, and one more per component. A region is marked
/// while writes to it may be in flight (see `LogStore::mark_regions`), so a
/// device can only need more with more space than it has.
pub fn max_marks(nsegs: u32, seg_blocks: u32, max_components: u32) -> u64 {
    (nsegs as u64 * seg_blocks as u64).div_ceil(REGION_BLOCKS) + max_components as u64
}

/// Most regions a device keeps tracked one by one (all components): half
/// of [`max_marks`]. A component whose tracked set would pass it is
/// tracked as a whole instead (`Tracked::All`, no region in this count).
/// Marks and tracked regions together never pass `max_marks`
/// when a mark is made, so marks always have at least the other half;
/// tracking never fails for want of room, so both may be at their bound
/// at once (the checkpoint slot holds both).
pub fn max_tracked(nsegs: u32, seg_blocks: u32, max_components: u32) -> u64 {
    max_marks(nsegs, seg_blocks, max_components) / 2
}

/// The fixed header of a log device (two copies: blocks 0 and 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSuper {
    pub uuid: u64,
    /// Bytes of the device Shoal uses.
    pub device_size: u64,
    pub seg_blocks: u32,
    pub nsegs: u32,
    /// Blocks of one checkpoint slot (two header copies + body).
    pub slot_blocks: u32,
    /// First block of the checkpoint slots.
    pub ckpt_off: u64,
    /// First block of segment 0.
    pub seg_off: u64,
    pub max_components: u32,
    /// Live data may fill this share (‰) of the segments outside the
    /// cleaner's reserve.
    pub fill_permille: u32,
    pub cluster_id: String,
}

impl LogSuper {
    /// Lays out a device of `device_size` bytes; `None` if too small.
    pub fn new(
        device_size: u64,
        uuid: u64,
        cluster_id: &str,
        seg_blocks: u32,
        max_components: u32,
        fill_permille: u32,
    ) -> Option<LogSuper> {
        let total = (device_size / BLOCK_U64).min(u32::MAX as u64);
        let seg = seg_blocks as u64;
        let align = seg.min(256);
        let mut nsegs = (total / seg) as u32;
        loop {
            if nsegs < MIN_SEGMENTS {
                return None;
            }
            let body = ckpt_body_max(nsegs, seg_blocks, max_components);
            let slot_blocks = 2 + body.div_ceil(BLOCK_U64);
            let ckpt_end = 2 + 2 * slot_blocks;
            let seg_off = ckpt_end.div_ceil(align) * align;
            let fit = (total.saturating_sub(seg_off) / seg) as u32;
            if fit >= nsegs {
                return Some(LogSuper {
                    uuid,
                    device_size,
                    seg_blocks,
                    nsegs,
                    slot_blocks: slot_blocks as u32,
                    ckpt_off: 2,
                    seg_off,
                    max_components,
                    fill_permille,
                    cluster_id: cluster_id.to_string(),
                });
            }
            nsegs = fit;
        }
    }

    pub fn encode(&self, copy: u32) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK];
        b[0..8].copy_from_slice(SB_MAGIC);
        put32(&mut b, 8, LOG_VERSION);
        put32(&mut b, 12, copy);
        put64(&mut b, 16, self.uuid);
        put64(&mut b, 24, self.device_size);
        put32(&mut b, 32, BLOCK as u32);
        put32(&mut b, 36, self.seg_blocks);
        put32(&mut b, 40, self.nsegs);
        put32(&mut b, 44, self.slot_blocks);
        put64(&mut b, 48, self.seg_off);
        put64(&mut b, 56, self.ckpt_off);
        put32(&mut b, 64, self.max_components);
        put32(&mut b, 68, self.fill_permille);
        let id = self.cluster_id.as_bytes();
        let n = id.len().min(MAX_CLUSTER_ID);
        put16(&mut b, 72, n as u16);
        b[74..74 + n].copy_from_slice(&id[..n]);
        seal_crc(&mut b);
        b
    }

    /// Whether `b` starts with the Shoal magic (whatever else it holds).
    pub fn has_magic(b: &[u8]) -> bool {
        b.len() >= 8 && &b[0..8] == SB_MAGIC
    }

    /// Decodes and validates one copy; never panics on any input.
    pub fn decode(b: &[u8]) -> Result<LogSuper, StoreError> {
        if b.len() < BLOCK || !Self::has_magic(b) {
            return Err(StoreError::BadFormat(
                "not a Shoal device: no SHOALDEV superblock at offset 0".into(),
            ));
        }
        // The version sits at byte 8 in every format: check it before the
        // checksum, whose place other versions may not share.
        let version = u32_at(b, 8);
        if version != LOG_VERSION {
            return Err(StoreError::BadFormat(format!(
                "device format version {version} is not supported by the log store (it reads version {LOG_VERSION})"
            )));
        }
        if !crc_ok(b) {
            return Err(StoreError::Corrupt("superblock checksum mismatch".into()));
        }
        let n = u16_at(b, 72) as usize;
        if n > MAX_CLUSTER_ID {
            return Err(StoreError::Corrupt(format!(
                "cluster id length {n} > {MAX_CLUSTER_ID}"
            )));
        }
        let cluster_id = std::str::from_utf8(&b[74..74 + n])
            .map_err(|_| StoreError::Corrupt("cluster id is not UTF-8".into()))?
            .to_string();
        if u32_at(b, 32) != BLOCK as u32 {
            return Err(StoreError::Corrupt(format!(
                "superblock: block size {}",
                u32_at(b, 32)
            )));
        }
        let sb = LogSuper {
            uuid: u64_at(b, 16),
            device_size: u64_at(b, 24),
            seg_blocks: u32_at(b, 36),
            nsegs: u32_at(b, 40),
            slot_blocks: u32_at(b, 44),
            seg_off: u64_at(b, 48),
            ckpt_off: u64_at(b, 56),
            max_components: u32_at(b, 64),
            fill_permille: u32_at(b, 68),
            cluster_id,
        };
        sb.check()?;
        Ok(sb)
    }

    /// The geometry is consistent, so no offset computed from it can
    /// overflow or overlap.
    pub fn check(&self) -> Result<(), StoreError> {
        let bad = |what: String| Err(StoreError::Corrupt(format!("superblock: {what}")));
        if !(8..=65536).contains(&self.seg_blocks) {
            return bad(format!("segment of {} blocks", self.seg_blocks));
        }
        if self.nsegs < MIN_SEGMENTS {
            return bad(format!("{} segments", self.nsegs));
        }
        if self.max_components == 0 || self.max_components > 1 << 20 {
            return bad(format!("{} components", self.max_components));
        }
        if !(100..=990).contains(&self.fill_permille) {
            return bad(format!("fill {}‰", self.fill_permille));
        }
        let body = ckpt_body_max(self.nsegs, self.seg_blocks, self.max_components);
        if (self.slot_blocks as u64) < 2 + body.div_ceil(BLOCK_U64) {
            return bad("checkpoint slots too small".into());
        }
        if self.ckpt_off < 2 {
            return bad("checkpoint slots overlap the superblocks".into());
        }
        let ckpt_end = self.ckpt_off + 2 * self.slot_blocks as u64;
        if self.seg_off < ckpt_end {
            return bad("segments overlap the checkpoint slots".into());
        }
        let end = self.seg_off + self.nsegs as u64 * self.seg_blocks as u64;
        if end > self.device_size / BLOCK_U64 || end > u32::MAX as u64 {
            return bad("segments extend past the device size".into());
        }
        Ok(())
    }

    /// First block of checkpoint slot `slot` (0 or 1).
    pub fn slot_block(&self, slot: usize) -> u64 {
        self.ckpt_off + slot as u64 * self.slot_blocks as u64
    }

    /// Bytes a checkpoint body may take.
    pub fn body_capacity(&self) -> u64 {
        (self.slot_blocks as u64 - 2) * BLOCK_U64
    }
}

/// One record of a batch header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// Block `block` of `comp` is the next data block of the batch. `bad`:
    /// the block was known corrupt when the cleaner moved it (reads fail);
    /// `crc` is then of the bytes as written.
    Data {
        comp: u64,
        block: u64,
        crc: u32,
        bad: bool,
    },
    /// Blocks `first..first+count` of `comp` read as zeros.
    Trim { comp: u64, first: u64, count: u32 },
    /// Creates or updates a component (takes two entries).
    Put {
        comp: u64,
        volume: u64,
        size: u64,
        generation: u64,
    },
    /// Deletes a component and all its blocks.
    Delete { comp: u64 },
    /// Marks (`on`) or unmarks region `region` (1 MiB: blocks
    /// `region·256 ..`) of `comp`: writes to it may be in flight in the
    /// cluster, so its copies may differ after a crash.
    Mark { comp: u64, region: u64, on: bool },
    /// Region `region` of `comp` is tracked: written while another copy
    /// of its volume was out of service (see `LogStore::track_regions`).
    Track { comp: u64, region: u64 },
    /// Every region of `comp` is tracked (its set collapsed to `All`).
    TrackAll { comp: u64 },
    /// No region of `comp` is tracked any more.
    UntrackAll { comp: u64 },
}

const K_DATA: u8 = 1;
const K_BAD: u8 = 2;
const K_TRIM: u8 = 3;
const K_PUT: u8 = 4;
const K_PUT2: u8 = 5;
const K_DELETE: u8 = 6;
const K_MARK: u8 = 7;
const K_UNMARK: u8 = 8;
const K_TRACK: u8 = 9;
const K_TRACK_ALL: u8 = 10;
const K_UNTRACK_ALL: u8 = 11;

impl Entry {
    /// Entry slots it takes in a header.
    pub fn slots(&self) -> usize {
        match self {
            Entry::Put { .. } => 2,
            _ => 1,
        }
    }

    fn encode(&self, b: &mut [u8]) {
        let (kind, a, x, y) = match *self {
            Entry::Data {
                comp,
                block,
                crc,
                bad,
            } => (if bad { K_BAD } else { K_DATA }, crc, comp, block),
            Entry::Trim { comp, first, count } => (K_TRIM, count, comp, first),
            Entry::Put { comp, size, .. } => (K_PUT, 0, comp, size),
            Entry::Delete { comp } => (K_DELETE, 0, comp, 0),
            Entry::Mark { comp, region, on } => {
                (if on { K_MARK } else { K_UNMARK }, 0, comp, region)
            }
            Entry::Track { comp, region } => (K_TRACK, 0, comp, region),
            Entry::TrackAll { comp } => (K_TRACK_ALL, 0, comp, 0),
            Entry::UntrackAll { comp } => (K_UNTRACK_ALL, 0, comp, 0),
        };
        b[0] = kind;
        put32(b, 4, a);
        put64(b, 8, x);
        put64(b, 16, y);
        if let Entry::Put {
            volume, generation, ..
        } = *self
        {
            let c = &mut b[ENTRY_SIZE..2 * ENTRY_SIZE];
            c[0] = K_PUT2;
            put64(c, 8, volume);
            put64(c, 16, generation);
        }
    }
}

/// The header block of a batch: what the data blocks after it are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchHeader {
    pub uuid: u64,
    pub seq: u64,
    pub epoch: u64,
    /// Every batch up to this seq was flushed before this one was written.
    pub durable_seq: u64,
    /// Seq of the newest durable checkpoint when this batch was written.
    pub ckpt_seq: u64,
    pub seg: u32,
    /// Block offset of this header in its segment.
    pub off: u32,
    /// Segment the log continues in once this one is full.
    pub next_seg: u32,
    pub entries: Vec<Entry>,
}

impl BatchHeader {
    pub fn n_data(&self) -> u32 {
        self.entries
            .iter()
            .filter(|e| matches!(e, Entry::Data { .. }))
            .count() as u32
    }

    pub fn encode_into(&self, b: &mut [u8]) {
        let b = &mut b[..BLOCK];
        b.fill(0);
        b[0..8].copy_from_slice(BATCH_MAGIC);
        put32(b, 8, LOG_VERSION);
        let slots: usize = self.entries.iter().map(Entry::slots).sum();
        assert!(slots <= MAX_ENTRIES, "batch header overflow");
        put32(b, 12, slots as u32);
        put64(b, 16, self.uuid);
        put64(b, 24, self.seq);
        put64(b, 32, self.epoch);
        put64(b, 40, self.durable_seq);
        put64(b, 48, self.ckpt_seq);
        put32(b, 56, self.seg);
        put32(b, 60, self.off);
        put32(b, 64, self.next_seg);
        put32(b, 68, self.n_data());
        let mut at = HDR_FIXED;
        for e in &self.entries {
            e.encode(&mut b[at..]);
            at += e.slots() * ENTRY_SIZE;
        }
        seal_crc(b);
    }

    /// Decodes a header block; `None` if it is not a valid header.
    pub fn decode(b: &[u8]) -> Option<BatchHeader> {
        if b.len() < BLOCK || &b[0..8] != BATCH_MAGIC || !crc_ok(b) {
            return None;
        }
        if u32_at(b, 8) != LOG_VERSION {
            return None;
        }
        let slots = u32_at(b, 12) as usize;
        if slots > MAX_ENTRIES {
            return None;
        }
        let mut entries = Vec::with_capacity(slots);
        let mut i = 0;
        while i < slots {
            let e = &b[HDR_FIXED + i * ENTRY_SIZE..HDR_FIXED + (i + 1) * ENTRY_SIZE];
            let (a, x, y) = (u32_at(e, 4), u64_at(e, 8), u64_at(e, 16));
            let entry = match e[0] {
                K_DATA | K_BAD => Entry::Data {
                    comp: x,
                    block: y,
                    crc: a,
                    bad: e[0] == K_BAD,
                },
                K_TRIM => Entry::Trim {
                    comp: x,
                    first: y,
                    count: a,
                },
                K_PUT => {
                    if i + 1 >= slots {
                        return None;
                    }
                    let c = &b[HDR_FIXED + (i + 1) * ENTRY_SIZE..];
                    if c[0] != K_PUT2 {
                        return None;
                    }
                    i += 1;
                    Entry::Put {
                        comp: x,
                        volume: u64_at(c, 8),
                        size: y,
                        generation: u64_at(c, 16),
                    }
                }
                K_DELETE => Entry::Delete { comp: x },
                K_MARK | K_UNMARK => Entry::Mark {
                    comp: x,
                    region: y,
                    on: e[0] == K_MARK,
                },
                K_TRACK => Entry::Track { comp: x, region: y },
                K_TRACK_ALL => Entry::TrackAll { comp: x },
                K_UNTRACK_ALL => Entry::UntrackAll { comp: x },
                _ => return None,
            };
            entries.push(entry);
            i += 1;
        }
        let h = BatchHeader {
            uuid: u64_at(b, 16),
            seq: u64_at(b, 24),
            epoch: u64_at(b, 32),
            durable_seq: u64_at(b, 40),
            ckpt_seq: u64_at(b, 48),
            seg: u32_at(b, 56),
            off: u32_at(b, 60),
            next_seg: u32_at(b, 64),
            entries,
        };
        if h.n_data() != u32_at(b, 68) {
            return None;
        }
        Some(h)
    }
}

/// One copy of a checkpoint slot's header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CkptHeader {
    pub uuid: u64,
    pub seq: u64,
    pub epoch: u64,
    /// Seq of the first batch after this checkpoint.
    pub next_batch: u64,
    /// Where that batch goes.
    pub head_seg: u32,
    pub head_off: u32,
    pub next_seg: u32,
    pub body_len: u64,
    pub body_crc: u32,
}

impl CkptHeader {
    pub fn encode(&self, copy: u32) -> Vec<u8> {
        let mut b = vec![0u8; BLOCK];
        b[0..8].copy_from_slice(CKPT_MAGIC);
        put32(&mut b, 8, LOG_VERSION);
        put32(&mut b, 12, copy);
        put64(&mut b, 16, self.uuid);
        put64(&mut b, 24, self.seq);
        put64(&mut b, 32, self.epoch);
        put64(&mut b, 40, self.next_batch);
        put32(&mut b, 48, self.head_seg);
        put32(&mut b, 52, self.head_off);
        put32(&mut b, 56, self.next_seg);
        put64(&mut b, 64, self.body_len);
        put32(&mut b, 72, self.body_crc);
        seal_crc(&mut b);
        b
    }

    pub fn decode(b: &[u8]) -> Option<CkptHeader> {
        if b.len() < BLOCK || &b[0..8] != CKPT_MAGIC || !crc_ok(b) {
            return None;
        }
        if u32_at(b, 8) != LOG_VERSION {
            return None;
        }
        Some(CkptHeader {
            uuid: u64_at(b, 16),
            seq: u64_at(b, 24),
            epoch: u64_at(b, 32),
            next_batch: u64_at(b, 40),
            head_seg: u32_at(b, 48),
            head_off: u32_at(b, 52),
            next_seg: u32_at(b, 56),
            body_len: u64_at(b, 64),
            body_crc: u32_at(b, 72),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry() {
        assert_eq!(MAX_ENTRIES, 167);
        assert_eq!(dense_per_segment(1024), 1017);
        assert_eq!(dense_per_segment(16), 15);
        let sb = LogSuper::new(64 << 20, 1, "c", 1024, 1024, 900).unwrap();
        sb.check().unwrap();
        assert_eq!(sb.nsegs, 15);
        let sb = LogSuper::new(1 << 40, 1, "c", 1024, 1024, 900).unwrap();
        sb.check().unwrap();
        // Checkpoint slots take about 0.6% of a large device.
        let meta = sb.seg_off as f64 / (sb.device_size / BLOCK_U64) as f64;
        assert!(meta < 0.007, "{meta}");
        assert!(sb.nsegs as u64 * 1024 + sb.seg_off <= (1 << 40) / 4096);
        let sb = LogSuper::new(1 << 20, 1, "c", 16, 4, 900).unwrap();
        sb.check().unwrap();
        assert!(LogSuper::new(64 << 10, 1, "c", 16, 4, 900).is_none());
        // Devices past 16 TiB are used up to 16 TiB.
        let sb = LogSuper::new(20 << 40, 1, "c", 1024, 1024, 900).unwrap();
        sb.check().unwrap();
    }

    #[test]
    fn superblock_round_trips_and_detects_damage() {
        let sb = LogSuper::new(100 << 20, 42, "prod-east", 1024, 1024, 900).unwrap();
        let mut b = sb.encode(1);
        assert_eq!(LogSuper::decode(&b).unwrap(), sb);
        b[20] ^= 1;
        assert!(matches!(LogSuper::decode(&b), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            LogSuper::decode(&[0u8; 4096]),
            Err(StoreError::BadFormat(_))
        ));
        // A version 1 superblock is refused, not misread.
        let mut v1 = vec![0u8; 4096];
        v1[0..8].copy_from_slice(crate::format::MAGIC);
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert!(matches!(
            LogSuper::decode(&v1),
            Err(StoreError::BadFormat(_))
        ));
        // So is every earlier log version (3: marks but no tracked
        // regions), even with a valid checksum, and so are its batch and
        // checkpoint headers.
        for old in 2..LOG_VERSION {
            let mut b = sb.encode(0);
            put32(&mut b, 8, old);
            seal_crc(&mut b);
            let e = LogSuper::decode(&b).unwrap_err();
            assert!(
                e.to_string()
                    .contains(&format!("format version {old} is not supported")),
                "{e}"
            );
        }
        let mut h = vec![0u8; BLOCK];
        BatchHeader {
            uuid: 1,
            seq: 2,
            epoch: 3,
            durable_seq: 1,
            ckpt_seq: 1,
            seg: 0,
            off: 0,
            next_seg: 1,
            entries: vec![Entry::TrackAll { comp: 1 }],
        }
        .encode_into(&mut h);
        assert!(BatchHeader::decode(&h).is_some());
        put32(&mut h, 8, 3);
        seal_crc(&mut h);
        assert_eq!(BatchHeader::decode(&h), None);
    }

    #[test]
    fn batch_headers_round_trip() {
        let h = BatchHeader {
            uuid: 7,
            seq: 9,
            epoch: 3,
            durable_seq: 8,
            ckpt_seq: 2,
            seg: 4,
            off: 10,
            next_seg: 5,
            entries: vec![
                Entry::Data {
                    comp: 1,
                    block: 2,
                    crc: 3,
                    bad: false,
                },
                Entry::Put {
                    comp: 1,
                    volume: 2,
                    size: 3,
                    generation: 4,
                },
                Entry::Trim {
                    comp: 5,
                    first: 6,
                    count: 7,
                },
                Entry::Delete { comp: 8 },
                Entry::Mark {
                    comp: 9,
                    region: 10,
                    on: true,
                },
                Entry::Mark {
                    comp: 9,
                    region: u64::MAX,
                    on: false,
                },
                Entry::Track {
                    comp: 11,
                    region: 12,
                },
                Entry::TrackAll { comp: 13 },
                Entry::UntrackAll { comp: u64::MAX },
                Entry::Data {
                    comp: u64::MAX,
                    block: u64::MAX,
                    crc: u32::MAX,
                    bad: true,
                },
            ],
        };
        let mut b = vec![0u8; BLOCK];
        h.encode_into(&mut b);
        assert_eq!(BatchHeader::decode(&b), Some(h.clone()));
        for i in [0, 30, 100, 4093] {
            let mut d = b.clone();
            d[i] ^= 0x10;
            assert_eq!(BatchHeader::decode(&d), None, "byte {i}");
        }
        let full = BatchHeader {
            entries: vec![Entry::Delete { comp: 1 }; MAX_ENTRIES],
            ..h
        };
        full.encode_into(&mut b);
        assert_eq!(BatchHeader::decode(&b).unwrap().entries.len(), MAX_ENTRIES);
    }

    #[test]
    fn checkpoint_headers_round_trip() {
        let c = CkptHeader {
            uuid: 1,
            seq: 2,
            epoch: 3,
            next_batch: 4,
            head_seg: 5,
            head_off: 6,
            next_seg: 7,
            body_len: 8,
            body_crc: 9,
        };
        let mut b = c.encode(0);
        assert_eq!(CkptHeader::decode(&b), Some(c.clone()));
        let mut v3 = b.clone();
        put32(&mut v3, 8, 3);
        seal_crc(&mut v3);
        assert_eq!(CkptHeader::decode(&v3), None, "a version 3 checkpoint");
        b[50] ^= 1;
        assert_eq!(CkptHeader::decode(&b), None);
    }
}
