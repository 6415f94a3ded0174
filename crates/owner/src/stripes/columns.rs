//! Where a stripe's units, and each block in them, sit on the stripe
//! columns of a capacity leg (`docs/erasure-coding.md`, Layout), and how a
//! stripe is encoded whole and a row of it rebuilt from the others.
//!
//! Stripe slot `s` is bytes `[s * UNIT_BYTES, (s + 1) * UNIT_BYTES)` of
//! every column. Its data unit `j` is on column `(s + j) mod w` and its
//! parity unit `i` on column `(s + k + i) mod w` (`w = k + m`): parity and
//! degraded reads spread over every column. Row 0 of every data unit is
//! the stripe's summary; rows 1 to 31 hold volume blocks, the stripe's
//! block index `x` at data unit `x / 31`, row `1 + x % 31`. Reed-Solomon
//! works byte by byte, so one row of the `w` units is a code word of its
//! own: a block is rebuilt from the same row of `k` other columns.

use super::format::{RecordError, Summary, BLOCKS_PER_UNIT, PAD_BLOCK, RECORD_BYTES};
use shoal_erasure::{Codec, ErasureError, Geometry};

/// Bytes of a stripe unit: 32 blocks of 4 KiB, the first the summary.
pub const UNIT_BYTES: u64 = (BLOCKS_PER_UNIT as u64 + 1) * BLOCK_BYTES as u64;
/// Bytes of a volume block (and of a row of a unit).
pub const BLOCK_BYTES: usize = RECORD_BYTES;
/// Stripe slots a column offers per stripe the volume's data fills, so
/// that the cleaner always finds free slots while dead blocks wait to be
/// reclaimed: twice the data's stripes. Columns are thin: slots never
/// written take no space on a device.
const SLOTS_PER_FULL_STRIPE: u64 = 2;
/// Slots a column offers beyond that, for small volumes (a stripe in
/// flight, one being cleaned, and room to spare).
const SPARE_SLOTS: u64 = 16;

/// What a column holds in one stripe slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Data unit `j` of `k`.
    Data(usize),
    /// Parity unit `i` of `m`.
    Parity(usize),
}

/// Why a stripe cannot be encoded or a row rebuilt.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StripeError {
    #[error(transparent)]
    Erasure(#[from] ErasureError),
    #[error(transparent)]
    Summary(#[from] RecordError),
    #[error("a stripe holds at most {max} blocks, not {got}")]
    TooManyBlocks { max: usize, got: usize },
    #[error("a block is {BLOCK_BYTES} bytes, not {0}")]
    BlockSize(usize),
    #[error("a summary names {got} blocks for a stripe of {want}")]
    SummaryBlocks { want: usize, got: usize },
    #[error("{got} rows given for a stripe of {want} columns")]
    Rows { want: usize, got: usize },
}

/// The column arithmetic of one geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Columns {
    data: usize,
    parity: usize,
}

impl Columns {
    pub fn new(g: Geometry) -> Columns {
        Columns {
            data: g.data,
            parity: g.parity,
        }
    }

    /// Columns of the leg: `k + m`.
    pub fn width(&self) -> usize {
        self.data + self.parity
    }

    /// Data units of a stripe: `k`.
    pub fn data_units(&self) -> usize {
        self.data
    }

    /// Volume blocks one stripe holds: 31 per data unit.
    pub fn blocks_per_stripe(&self) -> usize {
        self.data * BLOCKS_PER_UNIT
    }

    /// The column that holds `unit` of slot `slot`.
    pub fn position_of(&self, slot: u64, unit: Unit) -> usize {
        let i = match unit {
            Unit::Data(j) => j,
            Unit::Parity(i) => self.data + i,
        };
        ((slot % self.width() as u64) as usize + i) % self.width()
    }

    /// What column `position` holds in slot `slot`.
    pub fn unit_at(&self, slot: u64, position: usize) -> Unit {
        let w = self.width();
        let i = (position + w - (slot % w as u64) as usize) % w;
        if i < self.data {
            Unit::Data(i)
        } else {
            Unit::Parity(i - self.data)
        }
    }

    /// Where block index `index` of the stripe in `slot` is: its column
    /// and the byte offset in that column.
    pub fn block_at(&self, slot: u64, index: usize) -> (usize, u64) {
        let unit = index / BLOCKS_PER_UNIT;
        let row = 1 + index % BLOCKS_PER_UNIT;
        (
            self.position_of(slot, Unit::Data(unit)),
            slot * UNIT_BYTES + (row * BLOCK_BYTES) as u64,
        )
    }

    /// Bytes of each column of a volume of `volume_bytes`: slots enough for
    /// `SLOTS_PER_FULL_STRIPE` times its data, and spares.
    pub fn column_bytes(&self, volume_bytes: u64) -> u64 {
        let blocks = volume_bytes.div_ceil(BLOCK_BYTES as u64);
        let stripes = blocks.div_ceil(self.blocks_per_stripe() as u64);
        (stripes * SLOTS_PER_FULL_STRIPE + SPARE_SLOTS) * UNIT_BYTES
    }

    /// The `k + m` units of a stripe, by column: `summary` (its `blocks`
    /// naming each of `data`'s blocks, padded to a whole stripe) as row 0
    /// of every data unit, `data`'s blocks in order after it, zeros for
    /// padding, then the parity of it all.
    pub fn encode(
        &self,
        codec: &Codec,
        summary: &Summary,
        data: &[&[u8]],
    ) -> Result<Vec<Vec<u8>>, StripeError> {
        self.encode_run(codec, &[(summary, data)])
    }

    /// Stripes in consecutive slots (each a summary and its blocks' data,
    /// as [`Columns::encode`] takes them), by column: each column's units
    /// of every stripe, in slot order, in one buffer of `n` units. Each
    /// block is copied once, straight into its place; parity is computed
    /// in place.
    pub fn encode_run(
        &self,
        codec: &Codec,
        stripes: &[(&Summary, &[&[u8]])],
    ) -> Result<Vec<Vec<u8>>, StripeError> {
        let unit = UNIT_BYTES as usize;
        let mut columns: Vec<Vec<u8>> = (0..self.width())
            .map(|_| Vec::with_capacity(stripes.len() * unit))
            .collect();
        for (n, &(summary, data)) in stripes.iter().enumerate() {
            if let Some((first, _)) = stripes.first() {
                assert_eq!(
                    summary.slot,
                    first.slot + n as u64,
                    "a run of stripes in slots not consecutive"
                );
            }
            self.check_stripe(summary, data)?;
            let head = summary.encode()?;
            for j in 0..self.data {
                let column = &mut columns[self.position_of(summary.slot, Unit::Data(j))];
                let at = column.len();
                column.extend_from_slice(&head);
                column.resize(at + BLOCK_BYTES, 0);
                for b in data.iter().skip(j * BLOCKS_PER_UNIT).take(BLOCKS_PER_UNIT) {
                    column.extend_from_slice(b);
                }
                column.resize(at + unit, 0);
            }
            for i in 0..self.parity {
                let column = &mut columns[self.position_of(summary.slot, Unit::Parity(i))];
                column.resize(column.len() + unit, 0);
            }
            self.encode_parity(codec, summary.slot, n * unit, &mut columns)?;
        }
        Ok(columns)
    }

    fn check_stripe(&self, summary: &Summary, data: &[&[u8]]) -> Result<(), StripeError> {
        let per = self.blocks_per_stripe();
        if data.len() > per {
            return Err(StripeError::TooManyBlocks {
                max: per,
                got: data.len(),
            });
        }
        if summary.blocks.len() != per {
            return Err(StripeError::SummaryBlocks {
                want: per,
                got: summary.blocks.len(),
            });
        }
        match data.iter().find(|b| b.len() != BLOCK_BYTES) {
            Some(b) => Err(StripeError::BlockSize(b.len())),
            None => Ok(()),
        }
    }

    /// Computes the parity units of the stripe in `slot`, at byte `at` of
    /// its columns' buffers, from its data units there.
    fn encode_parity(
        &self,
        codec: &Codec,
        slot: u64,
        at: usize,
        columns: &mut [Vec<u8>],
    ) -> Result<(), StripeError> {
        let range = at..at + UNIT_BYTES as usize;
        let mut units: Vec<Option<&mut [u8]>> = columns
            .iter_mut()
            .map(|c| Some(&mut c[range.clone()]))
            .collect();
        let mut data: Vec<&[u8]> = Vec::with_capacity(self.data);
        for j in 0..self.data {
            let unit = units[self.position_of(slot, Unit::Data(j))].take();
            data.push(unit.expect("a stripe's units are on distinct columns"));
        }
        let mut parity: Vec<&mut [u8]> = Vec::with_capacity(self.parity);
        for i in 0..self.parity {
            let unit = units[self.position_of(slot, Unit::Parity(i))].take();
            parity.push(unit.expect("a stripe's units are on distinct columns"));
        }
        codec.encode(&data, &mut parity)?;
        Ok(())
    }

    /// Rebuilds the missing rows (`None`) of one row of the stripe in
    /// `slot`, given by column, from the others: at least `k` present.
    pub fn rebuild_row(
        &self,
        codec: &Codec,
        slot: u64,
        rows: Vec<Option<Vec<u8>>>,
    ) -> Result<Vec<Vec<u8>>, StripeError> {
        if rows.len() != self.width() {
            return Err(StripeError::Rows {
                want: self.width(),
                got: rows.len(),
            });
        }
        let shard_of = |position: usize| match self.unit_at(slot, position) {
            Unit::Data(j) => j,
            Unit::Parity(i) => self.data + i,
        };
        let mut shards: Vec<Option<Vec<u8>>> = vec![None; self.width()];
        for (position, row) in rows.into_iter().enumerate() {
            shards[shard_of(position)] = row;
        }
        codec.reconstruct(&mut shards)?;
        let mut by_column = Vec::with_capacity(self.width());
        for position in 0..self.width() {
            // Every shard is present after a reconstruction that succeeded.
            let row = shards[shard_of(position)].take().unwrap_or_default();
            by_column.push(row);
        }
        Ok(by_column)
    }
}

/// The summary of a stripe of volume `volume` holding `blocks` (volume
/// block numbers, in order), padded with [`PAD_BLOCK`] to `columns`'
/// whole stripe.
pub fn summary_of(
    columns: &Columns,
    volume: u64,
    (stripe_seq, slot): (u64, u64),
    blocks: &[u64],
) -> Summary {
    let mut named = blocks.to_vec();
    named.resize(columns.blocks_per_stripe().max(blocks.len()), PAD_BLOCK);
    Summary {
        data_shards: columns.data as u8,
        parity_shards: columns.parity as u8,
        volume,
        stripe_seq,
        slot,
        blocks: named,
    }
}
