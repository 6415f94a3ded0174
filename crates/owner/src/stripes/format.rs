//! On-disk forms of the capacity leg's map (`docs/erasure-coding.md`),
//! each one 4 KiB block, versioned and checksummed (CRC-32C):
//!
//! - [`Summary`]: the first block of every data unit of a stripe, naming
//!   the volume block of each data block of the stripe.
//! - [`MapRecord`]: one record of the map log (a stripe destaged or
//!   cleaned, several stripes at once, blocks unmapped, or a part of a
//!   checkpoint of the whole map).
//!
//! Every field is little-endian. Decoding never panics on any input: a
//! block that is not a valid record of a version this binary reads is an
//! error. Records are of version 3 since checkpoints are written as a
//! stream of parts whose last one says so (version 2 added the kind
//! that names several stripes); records of versions 1 and 2 still read.
//! A binary that reads an older version only does not read a newer log:
//! no downgrade past it.

use super::Loc;

/// Bytes of a summary block and of a map record: one store block.
pub const RECORD_BYTES: usize = 4096;
/// Data blocks per stripe unit: 32 blocks of 4 KiB (128 KiB), the first
/// of them the summary.
pub const BLOCKS_PER_UNIT: usize = 31;
/// Most data blocks a stripe (and its summary or record) names: 16 data
/// units (`shoal_erasure::MAX_DATA_SHARDS`) of [`BLOCKS_PER_UNIT`].
pub const MAX_SUMMARY_BLOCKS: usize = 16 * BLOCKS_PER_UNIT;
/// The block number that fills a stripe's unused places.
pub const PAD_BLOCK: u64 = u64::MAX;

const SUMMARY_MAGIC: &[u8; 8] = b"SHOALSTR";
const RECORD_MAGIC: &[u8; 8] = b"SHOALMAP";
/// Version of the summary blocks written and read.
const SUMMARY_VERSION: u16 = 1;
/// Version of the map records written; versions 1 to 3 are read.
const RECORD_VERSION: u16 = 3;
/// The oldest map record version read.
const OLDEST_RECORD_VERSION: u16 = 1;

const KIND_STRIPE: u8 = 1;
const KIND_UNMAP: u8 = 2;
const KIND_CHECKPOINT: u8 = 3;
/// Several stripes in one record (version 2 on).
const KIND_STRIPES: u8 = 4;
/// A part of a checkpoint that says whether it is the last, not how many
/// parts there are (version 3 on): a checkpoint is written as its parts
/// are walked from the map, never the whole map at once.
const KIND_CHECKPOINT_STREAMED: u8 = 5;

/// Bytes of a run of a stripes record: first block u64, len u16.
const STRIPE_RUN_BYTES: usize = 10;
/// Bytes of a stripe's entry in a stripes record before its runs: stripe
/// seq, slot, block count, run count.
const STRIPE_ENTRY_BYTES: usize = 8 + 8 + 4 + 2;
/// Payload bytes a stripes record has for its entries (after the count).
pub const STRIPES_PAYLOAD_BYTES: usize = RECORD_BYTES - RECORD_HEADER - 4 - 2;

/// Bytes of a checkpoint run: block u64, len u32, slot u64, index u16.
const RUN_BYTES: usize = 22;
/// Bytes before a record's payload: magic, version, kind, pad, volume,
/// seq, payload length.
const RECORD_HEADER: usize = 8 + 2 + 1 + 1 + 8 + 8 + 4;
/// Bytes before a checkpoint part's runs: part, parts (last: 1 for the
/// last part, else 0, since version 3), last stripe seq, (since version
/// 3: after, the block the part before ended at), run count.
const CHECKPOINT_HEADER: usize = 4 + 4 + 8 + 8 + 4;
/// Runs one checkpoint part holds.
pub(super) const RUNS_PER_CHECKPOINT_PART: usize =
    (RECORD_BYTES - RECORD_HEADER - 4 - CHECKPOINT_HEADER) / RUN_BYTES;

/// Why a block is not a valid summary or record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("not a {0} (magic)")]
    Magic(&'static str),
    #[error("{what} of version {version}, which this binary does not read")]
    Version { what: &'static str, version: u16 },
    #[error("checksum mismatch")]
    Checksum,
    #[error("malformed: {0}")]
    Malformed(&'static str),
    #[error("{0} too large for one block")]
    TooLarge(&'static str),
}

/// A run of blocks that sit in order in one stripe.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub block: u64,
    pub len: u32,
    pub slot: u64,
    pub index: u16,
}

/// The block after run `r`'s last.
pub(super) fn run_end(r: &Run) -> u64 {
    r.block + u64::from(r.len)
}

/// Whether block `b`, at `l`, goes on run `r`: the next block number, in
/// the same stripe, at the next index.
pub(super) fn run_goes_on(r: &Run, b: u64, l: &Loc) -> bool {
    r.block + u64::from(r.len) == b
        && r.slot == l.slot
        && u32::from(r.index) + r.len == u32::from(l.index)
}

/// The first block of every data unit of a stripe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub data_shards: u8,
    pub parity_shards: u8,
    pub volume: u64,
    pub stripe_seq: u64,
    pub slot: u64,
    /// The volume block of each data block of the stripe, in order
    /// ([`PAD_BLOCK`] where none).
    pub blocks: Vec<u64>,
}

impl Summary {
    pub fn encode(&self) -> Result<Vec<u8>, RecordError> {
        if self.blocks.len() > MAX_SUMMARY_BLOCKS {
            return Err(RecordError::TooLarge("summary"));
        }
        let mut b = Vec::with_capacity(RECORD_BYTES);
        b.extend_from_slice(SUMMARY_MAGIC);
        b.extend_from_slice(&SUMMARY_VERSION.to_le_bytes());
        b.push(self.data_shards);
        b.push(self.parity_shards);
        b.extend_from_slice(&self.volume.to_le_bytes());
        b.extend_from_slice(&self.stripe_seq.to_le_bytes());
        b.extend_from_slice(&self.slot.to_le_bytes());
        b.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        for x in &self.blocks {
            b.extend_from_slice(&x.to_le_bytes());
        }
        seal(b)
    }

    pub fn decode(block: &[u8]) -> Result<Summary, RecordError> {
        let (mut r, _) = Reader::open(
            block,
            SUMMARY_MAGIC,
            "stripe summary",
            SUMMARY_VERSION..=SUMMARY_VERSION,
        )?;
        let data_shards = r.u8()?;
        let parity_shards = r.u8()?;
        let volume = r.u64()?;
        let stripe_seq = r.u64()?;
        let slot = r.u64()?;
        let n = r.u32()? as usize;
        if n > MAX_SUMMARY_BLOCKS {
            return Err(RecordError::Malformed("summary block count"));
        }
        let blocks = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
        r.close()?;
        Ok(Summary {
            data_shards,
            parity_shards,
            volume,
            stripe_seq,
            slot,
            blocks,
        })
    }
}

/// One record of the map log. `seq` orders the records of a volume's log
/// from 1; the log is circular, and replay finds its order by `seq`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapRecord {
    /// A stripe became durable in `slot`: its data blocks, in order.
    Stripe {
        volume: u64,
        seq: u64,
        stripe_seq: u64,
        slot: u64,
        blocks: Vec<u64>,
    },
    /// Several stripes became durable, in this order: what a
    /// [`MapRecord::Stripe`] says of each (one record for the stripes a
    /// writer had ready at once).
    Stripes {
        volume: u64,
        seq: u64,
        stripes: Vec<StripeEntry>,
    },
    /// Blocks `first..first + count` were trimmed: they read as zeros.
    Unmap {
        volume: u64,
        seq: u64,
        first: u64,
        count: u64,
    },
    /// Part `part` of the whole map as it stood before record
    /// `seq - part`; the parts take consecutive seqs, and `last` marks the
    /// last one. `after` (version 3 on): the block where the part before
    /// ended (its last run's end; 0 for part 0): the part holds the runs
    /// from there on, so parts that do not follow each other are seen.
    Checkpoint {
        volume: u64,
        seq: u64,
        part: u32,
        last: bool,
        last_stripe_seq: u64,
        after: Option<u64>,
        runs: Vec<Run>,
    },
}

/// One stripe of a [`MapRecord::Stripes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StripeEntry {
    pub stripe_seq: u64,
    pub slot: u64,
    /// Its data blocks, in order ([`PAD_BLOCK`] where none).
    pub blocks: Vec<u64>,
}

impl StripeEntry {
    /// Bytes this entry takes in a stripes record: its blocks go as runs
    /// of consecutive numbers (a stripe written straight from one large
    /// write is one run).
    pub fn encoded_bytes(blocks: &[u64]) -> usize {
        STRIPE_ENTRY_BYTES + STRIPE_RUN_BYTES * block_runs(blocks).len()
    }
}

/// `blocks` as runs (first, len) of consecutive numbers, padding as runs
/// of [`PAD_BLOCK`].
fn block_runs(blocks: &[u64]) -> Vec<(u64, u16)> {
    let mut runs: Vec<(u64, u16)> = Vec::new();
    for &b in blocks {
        if let Some((first, len)) = runs.last_mut() {
            let next = match *first {
                PAD_BLOCK => b == PAD_BLOCK,
                f => f.checked_add(u64::from(*len)) == Some(b),
            };
            if next && *len < u16::MAX {
                *len += 1;
                continue;
            }
        }
        runs.push((b, 1));
    }
    runs
}

impl MapRecord {
    pub fn seq(&self) -> u64 {
        match self {
            MapRecord::Stripe { seq, .. }
            | MapRecord::Stripes { seq, .. }
            | MapRecord::Unmap { seq, .. }
            | MapRecord::Checkpoint { seq, .. } => *seq,
        }
    }

    pub fn volume(&self) -> u64 {
        match self {
            MapRecord::Stripe { volume, .. }
            | MapRecord::Stripes { volume, .. }
            | MapRecord::Unmap { volume, .. }
            | MapRecord::Checkpoint { volume, .. } => *volume,
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>, RecordError> {
        let mut p = Vec::new();
        let kind = match self {
            MapRecord::Stripe {
                stripe_seq,
                slot,
                blocks,
                ..
            } => {
                if blocks.len() > MAX_SUMMARY_BLOCKS {
                    return Err(RecordError::TooLarge("stripe record"));
                }
                p.extend_from_slice(&stripe_seq.to_le_bytes());
                p.extend_from_slice(&slot.to_le_bytes());
                p.extend_from_slice(&(blocks.len() as u32).to_le_bytes());
                for b in blocks {
                    p.extend_from_slice(&b.to_le_bytes());
                }
                KIND_STRIPE
            }
            MapRecord::Stripes { stripes, .. } => {
                encode_stripes(&mut p, stripes)?;
                KIND_STRIPES
            }
            MapRecord::Unmap { first, count, .. } => {
                p.extend_from_slice(&first.to_le_bytes());
                p.extend_from_slice(&count.to_le_bytes());
                KIND_UNMAP
            }
            MapRecord::Checkpoint {
                part,
                last,
                last_stripe_seq,
                after,
                runs,
                ..
            } => {
                if runs.len() > RUNS_PER_CHECKPOINT_PART {
                    return Err(RecordError::TooLarge("checkpoint part"));
                }
                let Some(after) = after else {
                    return Err(RecordError::Malformed("checkpoint part without its start"));
                };
                p.extend_from_slice(&part.to_le_bytes());
                p.extend_from_slice(&u32::from(*last).to_le_bytes());
                p.extend_from_slice(&last_stripe_seq.to_le_bytes());
                p.extend_from_slice(&after.to_le_bytes());
                p.extend_from_slice(&(runs.len() as u32).to_le_bytes());
                for r in runs {
                    p.extend_from_slice(&r.block.to_le_bytes());
                    p.extend_from_slice(&r.len.to_le_bytes());
                    p.extend_from_slice(&r.slot.to_le_bytes());
                    p.extend_from_slice(&r.index.to_le_bytes());
                }
                KIND_CHECKPOINT_STREAMED
            }
        };
        let mut b = Vec::with_capacity(RECORD_BYTES);
        b.extend_from_slice(RECORD_MAGIC);
        b.extend_from_slice(&RECORD_VERSION.to_le_bytes());
        b.push(kind);
        b.push(0);
        b.extend_from_slice(&self.volume().to_le_bytes());
        b.extend_from_slice(&self.seq().to_le_bytes());
        b.extend_from_slice(&(p.len() as u32).to_le_bytes());
        b.extend_from_slice(&p);
        seal(b)
    }

    pub fn decode(block: &[u8]) -> Result<MapRecord, RecordError> {
        let (mut r, version) = Reader::open(
            block,
            RECORD_MAGIC,
            "map record",
            OLDEST_RECORD_VERSION..=RECORD_VERSION,
        )?;
        let kind = r.u8()?;
        let _pad = r.u8()?;
        let volume = r.u64()?;
        let seq = r.u64()?;
        let len = r.u32()? as usize;
        let start = r.at;
        let rec = match kind {
            KIND_STRIPE => {
                let stripe_seq = r.u64()?;
                let slot = r.u64()?;
                let n = r.u32()? as usize;
                if n > MAX_SUMMARY_BLOCKS {
                    return Err(RecordError::Malformed("stripe block count"));
                }
                let blocks = (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?;
                MapRecord::Stripe {
                    volume,
                    seq,
                    stripe_seq,
                    slot,
                    blocks,
                }
            }
            KIND_UNMAP => MapRecord::Unmap {
                volume,
                seq,
                first: r.u64()?,
                count: r.u64()?,
            },
            KIND_CHECKPOINT => decode_checkpoint(&mut r, volume, seq, false)?,
            KIND_CHECKPOINT_STREAMED if version >= 3 => {
                decode_checkpoint(&mut r, volume, seq, true)?
            }
            KIND_STRIPES if version >= 2 => MapRecord::Stripes {
                volume,
                seq,
                stripes: decode_stripes(&mut r)?,
            },
            _ => return Err(RecordError::Malformed("record kind")),
        };
        if r.at - start != len {
            return Err(RecordError::Malformed("payload length"));
        }
        r.close()?;
        Ok(rec)
    }
}

fn encode_stripes(p: &mut Vec<u8>, stripes: &[StripeEntry]) -> Result<(), RecordError> {
    let count = u16::try_from(stripes.len()).map_err(|_| RecordError::TooLarge("stripes"))?;
    p.extend_from_slice(&count.to_le_bytes());
    for s in stripes {
        if s.blocks.len() > MAX_SUMMARY_BLOCKS {
            return Err(RecordError::TooLarge("stripe of a stripes record"));
        }
        let runs = block_runs(&s.blocks);
        p.extend_from_slice(&s.stripe_seq.to_le_bytes());
        p.extend_from_slice(&s.slot.to_le_bytes());
        p.extend_from_slice(&(s.blocks.len() as u32).to_le_bytes());
        p.extend_from_slice(&(runs.len() as u16).to_le_bytes());
        for (first, len) in runs {
            p.extend_from_slice(&first.to_le_bytes());
            p.extend_from_slice(&len.to_le_bytes());
        }
    }
    Ok(())
}

fn decode_stripes(r: &mut Reader<'_>) -> Result<Vec<StripeEntry>, RecordError> {
    let count = r.u16()?;
    // Each entry takes at least its header: a count past what fits is
    // refused before anything is allocated for it.
    if usize::from(count) * STRIPE_ENTRY_BYTES > STRIPES_PAYLOAD_BYTES {
        return Err(RecordError::Malformed("stripe count"));
    }
    let mut stripes = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let stripe_seq = r.u64()?;
        let slot = r.u64()?;
        let n = r.u32()? as usize;
        let runs = r.u16()?;
        if n > MAX_SUMMARY_BLOCKS || usize::from(runs) > n {
            return Err(RecordError::Malformed("stripe of a stripes record"));
        }
        let mut blocks = Vec::with_capacity(n);
        for _ in 0..runs {
            let first = r.u64()?;
            let len = u64::from(r.u16()?);
            let past = blocks.len() as u64 + len > n as u64;
            let overflows = first != PAD_BLOCK && first.checked_add(len).is_none();
            if len == 0 || past || overflows {
                return Err(RecordError::Malformed("run of a stripes record"));
            }
            match first {
                PAD_BLOCK => blocks.extend(std::iter::repeat_n(PAD_BLOCK, len as usize)),
                f => blocks.extend(f..f + len),
            }
        }
        if blocks.len() != n {
            return Err(RecordError::Malformed("stripe's runs short of its blocks"));
        }
        stripes.push(StripeEntry {
            stripe_seq,
            slot,
            blocks,
        });
    }
    Ok(stripes)
}

/// A checkpoint part: `streamed` (version 3) says whether it is the last
/// part; before, each part said how many there are.
fn decode_checkpoint(
    r: &mut Reader<'_>,
    volume: u64,
    seq: u64,
    streamed: bool,
) -> Result<MapRecord, RecordError> {
    let part = r.u32()?;
    let parts_or_last = r.u32()?;
    let last_stripe_seq = r.u64()?;
    let after = match streamed {
        true => Some(r.u64()?),
        false => None,
    };
    let n = r.u32()? as usize;
    let last = match (streamed, parts_or_last) {
        (true, 0) => false,
        (true, 1) => true,
        (true, _) => return Err(RecordError::Malformed("checkpoint part's last mark")),
        (false, parts) if part < parts => part + 1 == parts,
        (false, _) => return Err(RecordError::Malformed("checkpoint part")),
    };
    if n > RUNS_PER_CHECKPOINT_PART {
        return Err(RecordError::Malformed("checkpoint part"));
    }
    let mut runs = Vec::with_capacity(n);
    for _ in 0..n {
        let run = Run {
            block: r.u64()?,
            len: r.u32()?,
            slot: r.u64()?,
            index: r.u16()?,
        };
        let past = u64::from(run.index) + u64::from(run.len) > MAX_SUMMARY_BLOCKS as u64;
        if run.len == 0 || past || run.block.checked_add(u64::from(run.len)).is_none() {
            return Err(RecordError::Malformed("checkpoint run"));
        }
        runs.push(run);
    }
    Ok(MapRecord::Checkpoint {
        volume,
        seq,
        part,
        last,
        last_stripe_seq,
        after,
        runs,
    })
}

/// Appends the CRC-32C of `b` and pads it to [`RECORD_BYTES`].
fn seal(mut b: Vec<u8>) -> Result<Vec<u8>, RecordError> {
    if b.len() + 4 > RECORD_BYTES {
        return Err(RecordError::TooLarge("record"));
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b.resize(RECORD_BYTES, 0);
    Ok(b)
}

/// Reads the fields of a sealed block in order.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    /// Checks the block's size, magic and version (one of `versions`):
    /// the reader past them, and the version.
    fn open(
        b: &'a [u8],
        magic: &[u8; 8],
        what: &'static str,
        versions: std::ops::RangeInclusive<u16>,
    ) -> Result<(Reader<'a>, u16), RecordError> {
        if b.len() != RECORD_BYTES {
            return Err(RecordError::Malformed("block size"));
        }
        if &b[..8] != magic {
            return Err(RecordError::Magic(what));
        }
        let mut r = Reader { b, at: 8 };
        let version = r.u16()?;
        if !versions.contains(&version) {
            return Err(RecordError::Version { what, version });
        }
        Ok((r, version))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], RecordError> {
        let end = self.at.checked_add(n).filter(|&e| e + 4 <= self.b.len());
        let end = end.ok_or(RecordError::Malformed("truncated"))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, RecordError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, RecordError> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }

    fn u32(&mut self) -> Result<u32, RecordError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, RecordError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    /// Checks the CRC-32C after the fields read.
    fn close(self) -> Result<(), RecordError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(&self.b[self.at..self.at + 4]);
        if crc32c::crc32c(&self.b[..self.at]) != u32::from_le_bytes(a) {
            return Err(RecordError::Checksum);
        }
        Ok(())
    }
}
