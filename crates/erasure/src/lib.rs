//! Erasure coding of one stripe: `k` data shards and `m` parity shards of
//! equal length. RAID-5 has one parity shard, `P`, the XOR of the data;
//! RAID-6 has two, `P` and `Q = Σ 2^j · D_j` over GF(2^8) with the
//! polynomial 0x11d: the parity of Linux md's RAID-6 and the first rows of
//! ISA-L's Reed-Solomon matrix. Parity is computed here, by byte loops the
//! compiler vectorizes, and checked in property tests against the pinned
//! `rusty_erasure` (its scalar engine), which rebuilds lost shards. Any
//! `k` shards of a stripe give back the others.
//!
//! Owns the stripe geometries and the parity arithmetic on caller
//! buffers. Never touches a device, a socket or the directory: where
//! shards live and when they are written is the owner's.

use rusty_erasure::{Coder, Matrix};

/// Most data shards in a stripe: ESA's widest RAID-5 is 4+1, and wider
/// stripes cost more to rebuild than they save.
pub const MAX_DATA_SHARDS: usize = 16;
/// Most parity shards: RAID-6 tolerates two failures.
pub const MAX_PARITY_SHARDS: usize = 2;

/// Why a geometry or a stripe was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ErasureError {
    #[error(
        "a stripe has 1 to {MAX_DATA_SHARDS} data shards and 1 to {MAX_PARITY_SHARDS} parity \
         shards, not {data}+{parity}"
    )]
    Geometry { data: usize, parity: usize },
    #[error("a {data}+{parity} stripe has {expected} shards, not {got}")]
    ShardCount {
        data: usize,
        parity: usize,
        expected: usize,
        got: usize,
    },
    #[error("shard {index} is {got} bytes, the stripe's shards {expected}")]
    ShardLength {
        index: usize,
        expected: usize,
        got: usize,
    },
    #[error("{missing} shards of the stripe are missing; its {parity} parity shard(s) rebuild at most that many")]
    TooManyMissing { missing: usize, parity: usize },
}

/// The shape of a stripe: `data` + `parity` shards, each on its own
/// fault domain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Geometry {
    pub data: usize,
    pub parity: usize,
}

impl Geometry {
    pub fn new(data: usize, parity: usize) -> Result<Geometry, ErasureError> {
        if !(1..=MAX_DATA_SHARDS).contains(&data) || !(1..=MAX_PARITY_SHARDS).contains(&parity) {
            return Err(ErasureError::Geometry { data, parity });
        }
        Ok(Geometry { data, parity })
    }

    /// The geometry a volume records (`shoal_model::StripeGeometry`,
    /// chosen by its policy and the cluster's size).
    pub fn of(g: shoal_model::StripeGeometry) -> Result<Geometry, ErasureError> {
        Geometry::new(usize::from(g.data), usize::from(g.parity))
    }

    /// Shards in a stripe, each on a fault domain of its own.
    pub fn width(&self) -> usize {
        self.data + self.parity
    }

    /// Device bytes per byte of data: 1.5 for 2+1, 1.25 for 4+1.
    pub fn overhead(&self) -> f64 {
        self.width() as f64 / self.data as f64
    }
}

impl std::fmt::Display for Geometry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}+{}", self.data, self.parity)
    }
}

/// Computes and checks parity, and rebuilds lost shards, for one
/// geometry. Cheap to share: it holds the coding tables only.
pub struct Codec {
    geometry: Geometry,
    coder: Coder,
}

impl Codec {
    pub fn new(geometry: Geometry) -> Result<Codec, ErasureError> {
        let g = Geometry::new(geometry.data, geometry.parity)?;
        let refused = |_| ErasureError::Geometry {
            data: g.data,
            parity: g.parity,
        };
        let matrix = Matrix::reed_solomon(g.data, g.parity).map_err(refused)?;
        // The scalar engine: `Coder::new` never takes the SIMD kernels.
        let coder = Coder::new(matrix).map_err(refused)?;
        debug_assert_eq!((coder.k(), coder.p()), (g.data, g.parity));
        Ok(Codec { geometry: g, coder })
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    /// Fills `parity` from `data`: `k` data shards and `m` parity
    /// buffers, all of one length.
    pub fn encode(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), ErasureError> {
        self.check_shards(data, parity)?;
        parity_of(data, parity);
        Ok(())
    }

    /// Fills `parity` from `data` with the engine's own scalar kernel:
    /// the second implementation [`Codec::encode`] is checked against.
    pub fn encode_by_engine(
        &self,
        data: &[&[u8]],
        parity: &mut [&mut [u8]],
    ) -> Result<(), ErasureError> {
        self.check_shards(data, parity)?;
        self.coder
            .encode(data, parity)
            .map_err(|e| unreachable_error("encode", &e))
    }

    /// Whether `parity` is the parity of `data`.
    pub fn verify(&self, data: &[&[u8]], parity: &[&[u8]]) -> Result<bool, ErasureError> {
        self.check_counts(data.len(), parity.len())?;
        let len = data.first().map_or(0, |d| d.len());
        check_lengths(data.iter().chain(parity).map(|s| s.len()), len)?;
        self.coder
            .verify(data, parity)
            .map_err(|e| unreachable_error("verify", &e))
    }

    /// Rebuilds every missing shard of a stripe in place: `shards` holds
    /// the `k` data shards then the `m` parity shards, `None` where lost.
    /// Refused, changing nothing, when more than `m` are missing.
    pub fn reconstruct(&self, shards: &mut [Option<Vec<u8>>]) -> Result<(), ErasureError> {
        let g = self.geometry;
        if shards.len() != g.width() {
            return Err(self.count_error(shards.len()));
        }
        let lost: Vec<usize> = (0..shards.len()).filter(|&i| shards[i].is_none()).collect();
        if lost.len() > g.parity {
            return Err(ErasureError::TooManyMissing {
                missing: lost.len(),
                parity: g.parity,
            });
        }
        if lost.is_empty() {
            return Ok(());
        }
        let len = shards.iter().flatten().map(Vec::len).next().unwrap_or(0);
        check_lengths(shards.iter().flatten().map(Vec::len), len)?;
        let mut out: Vec<Vec<u8>> = lost.iter().map(|_| vec![0u8; len]).collect();
        {
            let present: Vec<Option<&[u8]>> = shards.iter().map(|s| s.as_deref()).collect();
            let mut bufs: Vec<&mut [u8]> = out.iter_mut().map(Vec::as_mut_slice).collect();
            self.coder
                .recover(&present, &lost, &mut bufs)
                .map_err(|e| unreachable_error("recover", &e))?;
        }
        for (i, b) in lost.into_iter().zip(out) {
            shards[i] = Some(b);
        }
        Ok(())
    }

    /// `k` data shards and `m` parity buffers, all of one length.
    fn check_shards(&self, data: &[&[u8]], parity: &[&mut [u8]]) -> Result<(), ErasureError> {
        self.check_counts(data.len(), parity.len())?;
        let len = data.first().map_or(0, |d| d.len());
        let lens = data
            .iter()
            .map(|d| d.len())
            .chain(parity.iter().map(|p| p.len()));
        check_lengths(lens, len)
    }

    fn check_counts(&self, data: usize, parity: usize) -> Result<(), ErasureError> {
        let g = self.geometry;
        if data != g.data || parity != g.parity {
            return Err(self.count_error(data + parity));
        }
        Ok(())
    }

    fn count_error(&self, got: usize) -> ErasureError {
        let g = self.geometry;
        ErasureError::ShardCount {
            data: g.data,
            parity: g.parity,
            expected: g.width(),
            got,
        }
    }
}

/// Every length in `lens` is `len`.
fn check_lengths(lens: impl Iterator<Item = usize>, len: usize) -> Result<(), ErasureError> {
    for (index, got) in lens.enumerate() {
        if got != len {
            return Err(ErasureError::ShardLength {
                index,
                expected: len,
                got,
            });
        }
    }
    Ok(())
}

/// `P` (the XOR of the data) and, with a second parity buffer, `Q` (Σ
/// 2^j · D_j, by Horner's rule: Q = ((D_{k-1} · 2 + D_{k-2}) · 2 + …) +
/// D_0), as Linux md's RAID-6 computes them: byte loops over whole
/// shards that the compiler turns into vector code, a few times faster
/// than the engine's per-byte table lookups. Counts and lengths are
/// checked by the caller; at most two parity buffers (MAX_PARITY_SHARDS).
fn parity_of(data: &[&[u8]], parity: &mut [&mut [u8]]) {
    assert!(parity.len() <= MAX_PARITY_SHARDS);
    let [first, rest @ ..] = data else {
        return;
    };
    let mut bufs = parity.iter_mut();
    if let Some(p) = bufs.next() {
        p.copy_from_slice(first);
        for d in rest {
            xor_into(p, d);
        }
    }
    if let Some(q) = bufs.next() {
        let Some((last, lower)) = data.split_last() else {
            return;
        };
        q.copy_from_slice(last);
        for d in lower.iter().rev() {
            times_two_xor(q, d);
        }
    }
}

/// `dst ^= src`, byte by byte (vectorized by the compiler).
fn xor_into(dst: &mut [u8], src: &[u8]) {
    for (a, b) in dst.iter_mut().zip(src) {
        *a ^= *b;
    }
}

/// `dst = dst · 2 ^ src` in GF(2^8)/0x11d, byte by byte: a shift, and
/// the polynomial's low byte where the top bit fell off.
fn times_two_xor(dst: &mut [u8], src: &[u8]) {
    for (a, b) in dst.iter_mut().zip(src) {
        let carry = ((*a as i8) >> 7) as u8;
        *a = (*a << 1) ^ (carry & 0x1d) ^ *b;
    }
}

/// An error of the engine on arguments this crate checked first: a bug.
fn unreachable_error(what: &str, e: &dyn std::fmt::Display) -> ErasureError {
    panic!("erasure {what} refused arguments checked before: {e}")
}

#[cfg(test)]
mod tests;
