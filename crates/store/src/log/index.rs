//! The index of one component: block number → device block number.
//!
//! Blocks are grouped in regions of 256 (1 MiB). A region is stored in the
//! cheapest of four forms, chosen again whenever a general update touches it:
//!
//! | form | heap bytes | good for |
//! |---|---|---|
//! | `Run` (one contiguous extent) | 0 | sequential data |
//! | `Extents` (packed u64 each) | 8 × extents | sequential data broken by batch headers |
//! | `Sparse` (256-bit map + u32 per mapped block) | 32 + 4 × blocks | scattered blocks |
//! | `Dense` (`[u32; 256]`) | 1024 | random data, densely written |
//!
//! So a region never costs more than 1 KiB plus its map entry, i.e. about
//! 4.2 bytes per block of densely written random data (1.05 GiB per TiB),
//! and sequential data costs well under a byte per block. A dense region
//! stays dense when its cheapest other form would still cost over 256
//! bytes (fragmented by random overwrites): updates to it are then O(1)
//! instead of an expand and a re-encode each. Device block 0
//! (the superblock) is never data, so 0 means "unmapped" inside a region.

use crate::StoreError;
use std::collections::btree_map::Entry as MapEntry;
use std::collections::BTreeMap;

/// Blocks per region.
pub const RB: usize = 256;
/// Most extents a region grows to by appending (8 bytes each, a quarter
/// of a dense region); past it, the general update picks the form.
const MAX_APPENDED_EXTENTS: usize = 32;
/// u32 words of a sparse region's bitmap.
const WORDS: usize = RB / 32;
/// A dense region whose cheapest other form costs more than this many
/// heap bytes (a quarter of its 1 KiB) stays dense: re-encoding it after
/// every random overwrite cost about a tenth of a node's CPU under random
/// 4 KiB writes, and keeping it costs at most 4x the cheapest form, never
/// more than 1 KiB a region.
const KEEP_DENSE_BYTES: usize = RB;

#[derive(Debug, Clone)]
enum Region {
    /// Blocks `first..=last` at `start..`.
    Run { first: u8, last: u8, start: u32 },
    /// Sorted, disjoint extents, packed by [`ext`].
    Extents(Box<[u64]>),
    /// `WORDS` words of bitmap, then the device block of each set bit.
    Sparse(Box<[u32]>),
    /// Device block per block, 0 = unmapped.
    Dense(Box<[u32; RB]>),
}

fn ext(first: usize, last: usize, start: u32) -> u64 {
    first as u64 | (last as u64) << 8 | (start as u64) << 32
}

fn ext_parts(e: u64) -> (usize, usize, u32) {
    (
        (e & 0xFF) as usize,
        ((e >> 8) & 0xFF) as usize,
        (e >> 32) as u32,
    )
}

/// Count of mapped blocks and of extents in a scratch region.
fn shape(s: &[u32; RB]) -> (usize, usize) {
    let (mut n, mut e) = (0, 0);
    for i in 0..RB {
        if s[i] != 0 {
            n += 1;
            if i == 0 || s[i - 1] == 0 || s[i - 1].wrapping_add(1) != s[i] {
                e += 1;
            }
        }
    }
    (n, e)
}

fn extents_of(s: &[u32; RB]) -> Vec<u64> {
    let mut v = Vec::new();
    let mut i = 0;
    while i < RB {
        if s[i] == 0 {
            i += 1;
            continue;
        }
        let first = i;
        while i + 1 < RB && s[i + 1] != 0 && s[i].wrapping_add(1) == s[i + 1] {
            i += 1;
        }
        v.push(ext(first, i, s[first]));
        i += 1;
    }
    v
}

impl Region {
    /// The cheapest in-memory form of a scratch region; `None` if empty.
    fn encode(s: &[u32; RB]) -> Option<Region> {
        let (n, e) = shape(s);
        if n == 0 {
            return None;
        }
        if e == 1 {
            let first = s.iter().position(|&p| p != 0).unwrap_or(0);
            return Some(Region::Run {
                first: first as u8,
                last: (first + n - 1) as u8,
                start: s[first],
            });
        }
        let (ce, cs, cd) = (8 * e, 4 * WORDS + 4 * n, 4 * RB);
        if ce <= cs && ce <= cd {
            return Some(Region::Extents(extents_of(s).into_boxed_slice()));
        }
        if cs <= cd {
            let mut v = vec![0u32; WORDS];
            for (i, &p) in s.iter().enumerate() {
                if p != 0 {
                    v[i / 32] |= 1 << (i % 32);
                    v.push(p);
                }
            }
            return Some(Region::Sparse(v.into_boxed_slice()));
        }
        Some(Region::Dense(Box::new(*s)))
    }

    fn get(&self, i: usize) -> Option<u32> {
        match self {
            Region::Run { first, last, start } => {
                let (f, l) = (*first as usize, *last as usize);
                (f..=l).contains(&i).then(|| start + (i - f) as u32)
            }
            Region::Extents(v) => {
                let k = v.partition_point(|&e| ext_parts(e).0 <= i);
                let (f, l, s) = ext_parts(*v.get(k.checked_sub(1)?)?);
                (i <= l).then(|| s + (i - f) as u32)
            }
            Region::Sparse(v) => {
                let (w, bit) = (i / 32, 1u32 << (i % 32));
                if v[w] & bit == 0 {
                    return None;
                }
                Some(v[WORDS + sparse_rank(v, i)])
            }
            Region::Dense(a) => (a[i] != 0).then_some(a[i]),
        }
    }

    fn for_each(&self, mut f: impl FnMut(usize, u32)) {
        match self {
            Region::Run { first, last, start } => {
                for i in *first as usize..=*last as usize {
                    f(i, start + (i - *first as usize) as u32);
                }
            }
            Region::Extents(v) => {
                for &e in v.iter() {
                    let (fi, l, s) = ext_parts(e);
                    for i in fi..=l {
                        f(i, s + (i - fi) as u32);
                    }
                }
            }
            Region::Sparse(v) => {
                let mut k = WORDS;
                for i in 0..RB {
                    if v[i / 32] & (1 << (i % 32)) != 0 {
                        f(i, v[k]);
                        k += 1;
                    }
                }
            }
            Region::Dense(a) => {
                for (i, &p) in a.iter().enumerate() {
                    if p != 0 {
                        f(i, p);
                    }
                }
            }
        }
    }

    fn expand(&self, s: &mut [u32; RB]) {
        s.fill(0);
        self.for_each(|i, p| s[i] = p);
    }

    fn heap_bytes(&self) -> usize {
        match self {
            Region::Run { .. } => 0,
            Region::Extents(v) => 8 * v.len(),
            Region::Sparse(v) => 4 * v.len(),
            Region::Dense(_) => 4 * RB,
        }
    }
}

/// Set bits of a sparse region's bitmap before bit `i`.
fn sparse_rank(v: &[u32], i: usize) -> usize {
    let w = i / 32;
    let below: u32 = v[..w].iter().map(|x| x.count_ones()).sum();
    below as usize + (v[w] & ((1u32 << (i % 32)) - 1)).count_ones() as usize
}

/// The block map of one component.
#[derive(Debug, Clone, Default)]
pub struct BlockIndex {
    regions: BTreeMap<u32, Region>,
    mapped: u64,
    /// The region a general update changed last. It is left `Dense`, so a
    /// run of updates there (rewriting sequential data: each one would
    /// otherwise expand and re-encode the whole region) costs O(1) each; it
    /// goes back to its cheapest form when a general update changes another
    /// region. So at most one region per component is dense beyond the
    /// rule of [`compact`](Self::compact).
    hot: Option<u32>,
}

fn split(block: u64) -> (u32, usize) {
    ((block / RB as u64) as u32, (block % RB as u64) as usize)
}

impl BlockIndex {
    pub fn new() -> BlockIndex {
        BlockIndex::default()
    }

    /// Mapped blocks.
    pub fn mapped(&self) -> u64 {
        self.mapped
    }

    pub fn get(&self, block: u64) -> Option<u32> {
        let (r, i) = split(block);
        self.regions.get(&r)?.get(i)
    }

    /// Maps `block` to device block `phys` (not 0); returns the old one.
    pub fn set(&mut self, block: u64, phys: u32) -> Option<u32> {
        assert!(phys != 0, "device block 0 is never data");
        let (r, i) = split(block);
        let reg = match self.regions.entry(r) {
            MapEntry::Vacant(v) => {
                v.insert(Region::Run {
                    first: i as u8,
                    last: i as u8,
                    start: phys,
                });
                self.mapped += 1;
                return None;
            }
            MapEntry::Occupied(o) => o.into_mut(),
        };
        // Fast paths: in-place updates that keep the form.
        match reg {
            Region::Dense(a) => {
                let old = std::mem::replace(&mut a[i], phys);
                if old == 0 {
                    self.mapped += 1;
                    return None;
                }
                return Some(old);
            }
            Region::Run { first, last, start }
                if i == *last as usize + 1
                    && phys == start.wrapping_add((i - *first as usize) as u32) =>
            {
                *last += 1;
                self.mapped += 1;
                return None;
            }
            Region::Extents(v) => {
                let n = v.len();
                let (f, l, s) = ext_parts(v[n - 1]);
                if i == l + 1 && phys == s.wrapping_add((i - f) as u32) {
                    v[n - 1] = ext(f, i, s);
                    self.mapped += 1;
                    return None;
                }
                // A new extent past the last one (sequential data after a
                // batch header), while extents stay cheaper than a sparse
                // region (8 bytes an extent against 32 + 4 a block).
                let blocks: usize = v
                    .iter()
                    .map(|&e| {
                        let (f, l, _) = ext_parts(e);
                        l - f + 1
                    })
                    .sum();
                if i > l && n < MAX_APPENDED_EXTENTS && 8 * (n + 1) <= 32 + 4 * (blocks + 1) {
                    let mut nv = v.to_vec();
                    nv.push(ext(i, i, phys));
                    *v = nv.into_boxed_slice();
                    self.mapped += 1;
                    return None;
                }
            }
            // A second extent after a run.
            Region::Run { first, last, start } if i > *last as usize => {
                let v = vec![
                    ext(*first as usize, *last as usize, *start),
                    ext(i, i, phys),
                ];
                *reg = Region::Extents(v.into_boxed_slice());
                self.mapped += 1;
                return None;
            }
            Region::Sparse(v) => {
                if v[i / 32] & (1 << (i % 32)) != 0 {
                    let k = WORDS + sparse_rank(v, i);
                    return Some(std::mem::replace(&mut v[k], phys));
                }
                if v.len() - WORDS < 248 {
                    let k = WORDS + sparse_rank(v, i);
                    let mut nv = Vec::with_capacity(v.len() + 1);
                    nv.extend_from_slice(&v[..k]);
                    nv.push(phys);
                    nv.extend_from_slice(&v[k..]);
                    nv[i / 32] |= 1 << (i % 32);
                    *v = nv.into_boxed_slice();
                    self.mapped += 1;
                    return None;
                }
            }
            _ => {}
        }
        let mut s = Box::new([0u32; RB]);
        reg.expand(&mut s);
        let old = std::mem::replace(&mut s[i], phys);
        *reg = Region::Dense(s);
        if self.hot != Some(r) {
            if let Some(h) = self.hot.replace(r) {
                self.compact(h);
            }
        }
        if old == 0 {
            self.mapped += 1;
            None
        } else {
            Some(old)
        }
    }

    /// Puts region `r` back in its cheapest form, unless it is a dense
    /// region whose cheapest form would still cost more than a quarter of
    /// it: such a region (random overwrites of written data) would be
    /// expanded again by its next update, so it stays dense and later
    /// updates take the O(1) path.
    fn compact(&mut self, r: u32) {
        if let Some(reg) = self.regions.get_mut(&r) {
            if let Region::Dense(a) = reg {
                let (n, e) = shape(a);
                if n > 0 && (8 * e).min(4 * WORDS + 4 * n) > KEEP_DENSE_BYTES {
                    return;
                }
            }
            let mut s = [0u32; RB];
            reg.expand(&mut s);
            match Region::encode(&s) {
                Some(c) => *reg = c,
                None => {
                    self.regions.remove(&r);
                }
            }
        }
    }

    /// Unmaps `block`; returns where it was.
    pub fn remove(&mut self, block: u64) -> Option<u32> {
        let mut out = None;
        self.remove_range(block, block + 1, |_, p| out = Some(p));
        out
    }

    /// Unmaps blocks `first..end`, calling `f(block, phys)` for each that
    /// was mapped.
    pub fn remove_range(&mut self, first: u64, end: u64, mut f: impl FnMut(u64, u32)) {
        if first >= end {
            return;
        }
        let (r0, r1) = (split(first).0, split(end - 1).0);
        let keys: Vec<u32> = self.regions.range(r0..=r1).map(|(&k, _)| k).collect();
        for r in keys {
            let base = r as u64 * RB as u64;
            let lo = first.max(base) - base;
            let hi = end.min(base + RB as u64) - base;
            let (lo, hi) = (lo as usize, hi as usize);
            if lo == 0 && hi == RB {
                if let Some(reg) = self.regions.remove(&r) {
                    reg.for_each(|i, p| {
                        self.mapped -= 1;
                        f(base + i as u64, p)
                    });
                }
                continue;
            }
            let Some(reg) = self.regions.get_mut(&r) else {
                continue;
            };
            // Fast paths at the ends of a run, and dense regions.
            match reg {
                Region::Run { first, last, start } if hi - lo == 1 => {
                    let i = lo;
                    let (fi, la) = (*first as usize, *last as usize);
                    if fi < la && (i == fi || i == la) {
                        let p = *start + (i - fi) as u32;
                        if i == fi {
                            *first += 1;
                            *start += 1;
                        } else {
                            *last -= 1;
                        }
                        self.mapped -= 1;
                        f(base + i as u64, p);
                        continue;
                    }
                    if !(fi..=la).contains(&i) {
                        continue;
                    }
                }
                Region::Dense(a) => {
                    for (i, slot) in a.iter_mut().enumerate().take(hi).skip(lo) {
                        if *slot != 0 {
                            self.mapped -= 1;
                            f(base + i as u64, std::mem::replace(slot, 0));
                        }
                    }
                    let n = a.iter().filter(|&&p| p != 0).count();
                    if n >= 192 {
                        continue;
                    }
                }
                _ => {}
            }
            let mut s = [0u32; RB];
            reg.expand(&mut s);
            for (i, slot) in s.iter_mut().enumerate().take(hi).skip(lo) {
                if *slot != 0 {
                    self.mapped -= 1;
                    f(base + i as u64, std::mem::replace(slot, 0));
                }
            }
            match Region::encode(&s) {
                Some(n) => *reg = n,
                None => {
                    self.regions.remove(&r);
                }
            }
        }
    }

    /// Calls `f(block, phys)` for every mapped block, in block order.
    pub fn for_each(&self, mut f: impl FnMut(u64, u32)) {
        for (&r, reg) in &self.regions {
            let base = r as u64 * RB as u64;
            reg.for_each(|i, p| f(base + i as u64, p));
        }
    }

    /// Calls `f(block, phys)` for the mapped blocks in `first..end`.
    pub fn for_each_in(&self, first: u64, end: u64, mut f: impl FnMut(u64, u32)) {
        if first >= end {
            return;
        }
        let (r0, r1) = (split(first).0, split(end - 1).0);
        for (&r, reg) in self.regions.range(r0..=r1) {
            let base = r as u64 * RB as u64;
            reg.for_each(|i, p| {
                let b = base + i as u64;
                if b >= first && b < end {
                    f(b, p)
                }
            });
        }
    }

    /// Whether any block in `first..end` is mapped.
    pub fn any_in(&self, first: u64, end: u64) -> bool {
        let mut any = false;
        self.for_each_in(first, end, |_, _| any = true);
        any
    }

    /// `(first block, count)` of the mapped runs of blocks, coalesced.
    pub fn ranges(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        self.for_each(|b, _| match out.last_mut() {
            Some((f, n)) if *f + *n == b => *n += 1,
            _ => out.push((b, 1)),
        });
        out
    }

    /// Approximate heap bytes (region payloads, plus 16 B of allocator
    /// overhead per allocation and ~48 B per map entry).
    pub fn heap_estimate(&self) -> usize {
        self.regions
            .values()
            .map(|r| 48 + r.heap_bytes() + if r.heap_bytes() > 0 { 16 } else { 0 })
            .sum()
    }

    /// Serializes the index for a checkpoint: region count (u64), then per
    /// region its number (u32), a kind byte and the cheapest of
    /// extents (1: u16 count, then first u8, last u8, start u32 each),
    /// sparse (2: 8 × u32 bitmap, then a u32 per set bit) or dense
    /// (3: 256 × u32). At most [`CKPT_BYTES_PER_BLOCK`] per mapped block.
    ///
    /// [`CKPT_BYTES_PER_BLOCK`]: super::format::CKPT_BYTES_PER_BLOCK
    pub fn encode(
        &self,
        mut emit: impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> std::io::Result<()> {
        emit(&(self.regions.len() as u64).to_le_bytes())?;
        let mut s = [0u32; RB];
        let mut out = Vec::with_capacity(8 + 4 * RB);
        for (&r, reg) in &self.regions {
            reg.expand(&mut s);
            out.clear();
            encode_region(r, &s, &mut out);
            emit(&out)?;
        }
        Ok(())
    }

    /// Reads what [`encode`](Self::encode) wrote. `read` fills a buffer
    /// with the next bytes of the body.
    pub fn decode(
        mut read: impl FnMut(&mut [u8]) -> Result<(), StoreError>,
    ) -> Result<BlockIndex, StoreError> {
        let bad = |m: &str| StoreError::Corrupt(format!("checkpoint index: {m}"));
        let mut b8 = [0u8; 8];
        read(&mut b8)?;
        let n = u64::from_le_bytes(b8);
        let mut ix = BlockIndex::new();
        let mut prev: Option<u32> = None;
        let mut s = [0u32; RB];
        let mut buf = vec![0u8; 4 * RB];
        for _ in 0..n {
            let mut h = [0u8; 5];
            read(&mut h)?;
            let r = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
            if prev.is_some_and(|p| p >= r) {
                return Err(bad("regions out of order"));
            }
            prev = Some(r);
            s.fill(0);
            match h[4] {
                1 => {
                    let mut c = [0u8; 2];
                    read(&mut c)?;
                    let e = u16::from_le_bytes(c) as usize;
                    if e == 0 || e > RB {
                        return Err(bad("extent count"));
                    }
                    read(&mut buf[..6 * e])?;
                    let mut next = 0usize;
                    for x in buf[..6 * e].chunks(6) {
                        let (f, l) = (x[0] as usize, x[1] as usize);
                        let st = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
                        if f < next || l < f || st == 0 || st.checked_add((l - f) as u32).is_none()
                        {
                            return Err(bad("bad extent"));
                        }
                        for (k, slot) in s[f..=l].iter_mut().enumerate() {
                            *slot = st + k as u32;
                        }
                        next = l + 1;
                    }
                }
                2 => {
                    read(&mut buf[..4 * WORDS])?;
                    let words: Vec<u32> = buf[..4 * WORDS]
                        .chunks(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    let cnt: usize = words.iter().map(|w| w.count_ones() as usize).sum();
                    if cnt == 0 {
                        return Err(bad("empty sparse region"));
                    }
                    read(&mut buf[..4 * cnt])?;
                    let mut k = 0;
                    for (i, slot) in s.iter_mut().enumerate() {
                        if words[i / 32] & (1 << (i % 32)) != 0 {
                            let c = &buf[4 * k..4 * k + 4];
                            *slot = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                            if *slot == 0 {
                                return Err(bad("sparse block at device block 0"));
                            }
                            k += 1;
                        }
                    }
                }
                3 => {
                    read(&mut buf[..4 * RB])?;
                    for (i, c) in buf[..4 * RB].chunks(4).enumerate() {
                        s[i] = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                }
                k => return Err(bad(&format!("region kind {k}"))),
            }
            let reg = Region::encode(&s).ok_or_else(|| bad("empty region"))?;
            ix.mapped += shape(&s).0 as u64;
            ix.regions.insert(r, reg);
        }
        Ok(ix)
    }
}

/// Appends the cheapest on-disk form of one region.
fn encode_region(r: u32, s: &[u32; RB], out: &mut Vec<u8>) {
    let (n, e) = shape(s);
    debug_assert!(n > 0);
    out.extend_from_slice(&r.to_le_bytes());
    let (ce, cs, cd) = (2 + 6 * e, 4 * WORDS + 4 * n, 4 * RB);
    if ce <= cs && ce <= cd {
        out.push(1);
        out.extend_from_slice(&(e as u16).to_le_bytes());
        for x in extents_of(s) {
            let (f, l, st) = ext_parts(x);
            out.push(f as u8);
            out.push(l as u8);
            out.extend_from_slice(&st.to_le_bytes());
        }
    } else if cs <= cd {
        out.push(2);
        let mut words = [0u32; WORDS];
        for (i, &p) in s.iter().enumerate() {
            if p != 0 {
                words[i / 32] |= 1 << (i % 32);
            }
        }
        for w in words {
            out.extend_from_slice(&w.to_le_bytes());
        }
        for &p in s.iter().filter(|&&p| p != 0) {
            out.extend_from_slice(&p.to_le_bytes());
        }
    } else {
        out.push(3);
        for p in s {
            out.extend_from_slice(&p.to_le_bytes());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap as Model;

    fn round_trip(ix: &BlockIndex) -> BlockIndex {
        let mut bytes = Vec::new();
        ix.encode(|b| {
            bytes.extend_from_slice(b);
            Ok(())
        })
        .unwrap();
        // The checkpoint bound holds.
        assert!(
            bytes.len() as u64 <= 8 + super::super::format::CKPT_BYTES_PER_BLOCK * ix.mapped(),
            "{} bytes for {} blocks",
            bytes.len(),
            ix.mapped()
        );
        let mut at = 0;
        let back = BlockIndex::decode(|buf| {
            if at + buf.len() > bytes.len() {
                return Err(StoreError::Corrupt("short".into()));
            }
            buf.copy_from_slice(&bytes[at..at + buf.len()]);
            at += buf.len();
            Ok(())
        })
        .unwrap();
        assert_eq!(at, bytes.len());
        back
    }

    fn same(ix: &BlockIndex, m: &Model<u64, u32>) {
        let mut got = Model::new();
        ix.for_each(|b, p| {
            got.insert(b, p);
        });
        assert_eq!(&got, m);
        assert_eq!(ix.mapped(), m.len() as u64);
        for (&b, &p) in m {
            assert_eq!(ix.get(b), Some(p));
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Set(u64, u32),
        Seq(u64, u32, u32),
        Remove(u64),
        RemoveRange(u64, u64),
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u64..1200, 1u32..100_000).prop_map(|(b, p)| Op::Set(b, p)),
            2 => (0u64..1200, 1u32..100_000, 1u32..300).prop_map(|(b, p, n)| Op::Seq(b, p, n)),
            2 => (0u64..1200).prop_map(Op::Remove),
            1 => (0u64..1200, 0u64..600).prop_map(|(b, n)| Op::RemoveRange(b, b + n)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn index_matches_a_model(ops in prop::collection::vec(arb_op(), 1..200)) {
            let mut ix = BlockIndex::new();
            let mut m: Model<u64, u32> = Model::new();
            for op in ops {
                match op {
                    Op::Set(b, p) => {
                        prop_assert_eq!(ix.set(b, p), m.insert(b, p));
                    }
                    Op::Seq(b, p, n) => {
                        for k in 0..n as u64 {
                            prop_assert_eq!(ix.set(b + k, p + k as u32), m.insert(b + k, p + k as u32));
                        }
                    }
                    Op::Remove(b) => {
                        prop_assert_eq!(ix.remove(b), m.remove(&b));
                    }
                    Op::RemoveRange(a, e) => {
                        let mut got = Vec::new();
                        ix.remove_range(a, e, |b, p| got.push((b, p)));
                        let want: Vec<(u64, u32)> = m.range(a..e).map(|(&b, &p)| (b, p)).collect();
                        for (b, _) in &want {
                            m.remove(b);
                        }
                        got.sort();
                        prop_assert_eq!(got, want);
                    }
                }
            }
            same(&ix, &m);
            same(&round_trip(&ix), &m);
            let mut want_ranges: Vec<(u64, u64)> = Vec::new();
            for &b in m.keys() {
                match want_ranges.last_mut() {
                    Some((f, n)) if *f + *n == b => *n += 1,
                    _ => want_ranges.push((b, 1)),
                }
            }
            prop_assert_eq!(ix.ranges(), want_ranges);
        }
    }

    #[test]
    fn forms_are_chosen_by_cost() {
        let mut ix = BlockIndex::new();
        for b in 0..256 {
            ix.set(b, 1000 + b as u32);
        }
        assert!(matches!(ix.regions[&0], Region::Run { .. }));
        ix.set(300, 5);
        ix.set(301, 9);
        assert!(matches!(ix.regions[&1], Region::Extents(_)));
        for k in 0..20u64 {
            ix.set(512 + k * 7, 50 + 2 * k as u32);
        }
        // The region a general update changed last stays dense until
        // another region is changed.
        assert!(matches!(ix.regions[&2], Region::Dense(_)));
        for k in 0..256u64 {
            ix.set(768 + (k * 37) % 256, 9000 + 3 * k as u32);
        }
        assert!(matches!(ix.regions[&2], Region::Sparse(_)));
        assert!(matches!(ix.regions[&3], Region::Dense(_)));
        // Rewriting a sequential region in place (blocks move to new
        // places one by one) keeps the region dense while it is written,
        // then compacts it.
        for b in 0..256u64 {
            ix.set(b, 20_000 + b as u32);
        }
        assert!(matches!(ix.regions[&0], Region::Dense(_)));
        ix.set(300, 77);
        assert!(matches!(ix.regions[&0], Region::Run { .. }));
        assert!(matches!(ix.regions[&1], Region::Dense(_)));
        ix.remove_range(768, 768 + 200, |_, _| {});
        assert!(!matches!(ix.regions[&3], Region::Dense(_)));
        assert_eq!(ix.mapped(), 256 + 2 + 20 + 56);
    }

    // --- Memory measurement: a counting allocator (per thread). ---

    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    pub struct Counting;

    thread_local! {
        static BYTES: Cell<isize> = const { Cell::new(0) };
        static ALLOCS: Cell<isize> = const { Cell::new(0) };
    }

    fn note(bytes: isize, allocs: isize) {
        let _ = BYTES.try_with(|c| c.set(c.get() + bytes));
        let _ = ALLOCS.try_with(|c| c.set(c.get() + allocs));
    }

    // SAFETY: delegates to the system allocator; only counts.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            note(l.size() as isize, 1);
            unsafe { System.alloc(l) }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            note(-(l.size() as isize), -1);
            unsafe { System.dealloc(p, l) }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            note(l.size() as isize, 1);
            unsafe { System.alloc_zeroed(l) }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
            note(n as isize - l.size() as isize, 0);
            unsafe { System.realloc(p, l, n) }
        }
    }

    #[global_allocator]
    static ALLOC: Counting = Counting;

    /// Heap bytes (plus 16 B per live allocation for the allocator's own
    /// header) that `f`'s result holds.
    pub(crate) fn measure<T>(f: impl FnOnce() -> T) -> (T, usize) {
        let (b0, a0) = (BYTES.with(Cell::get), ALLOCS.with(Cell::get));
        let t = f();
        let (b1, a1) = (BYTES.with(Cell::get), ALLOCS.with(Cell::get));
        (t, ((b1 - b0) + 16 * (a1 - a0)).max(0) as usize)
    }

    /// Bytes of index per block, for `n` blocks spread over `space` blocks
    /// in random order, or written sequentially in 167-block batches.
    pub(crate) fn bytes_per_block(n: u64, space: u64, sequential: bool) -> f64 {
        let (ix, bytes) = measure(|| {
            let mut ix = BlockIndex::new();
            let mut rng = super::super::device::SimRng::new(n ^ space);
            if sequential {
                let mut phys = 1000u32;
                for b in 0..n {
                    if b % 167 == 0 {
                        phys += 1; // the next batch's header
                    }
                    ix.set(b, phys);
                    phys += 1;
                }
            } else {
                // A random permutation of `space` blocks, the first n of it.
                let mut order: Vec<u64> = (0..space).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                order.truncate(n as usize);
                for (k, &b) in order.iter().enumerate() {
                    ix.set(b, 1000 + k as u32);
                }
                drop(order);
            }
            ix
        });
        assert_eq!(ix.mapped(), n);
        bytes as f64 / n as f64
    }

    #[test]
    fn index_memory_per_tib() {
        // 2^17 blocks = 512 MiB of data; per-block cost scales to a TiB.
        let n = 1u64 << 17;
        let gib_per_tib = |bpb: f64| bpb * (1u64 << 28) as f64 / (1u64 << 30) as f64;
        let dense = bytes_per_block(n, n, false);
        let sparse = bytes_per_block(n, 10 * n, false);
        let seq = bytes_per_block(n, n, true);
        eprintln!(
            "index memory: random dense {dense:.2} B/block ({:.2} GiB/TiB), random 10% dense {sparse:.2} B/block ({:.2} GiB/TiB), sequential {seq:.3} B/block ({:.3} GiB/TiB)",
            gib_per_tib(dense),
            gib_per_tib(sparse),
            gib_per_tib(seq)
        );
        assert!(gib_per_tib(dense) < 1.2, "{dense}");
        assert!(gib_per_tib(sparse) < 2.0, "{sparse}");
        assert!(gib_per_tib(seq) < 0.1, "{seq}");
    }
}
