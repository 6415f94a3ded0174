//! Integrity: writes checked against the CRCs their sender computed,
//! scrubbing (finding blocks whose data no longer matches its checksum),
//! and repair (replacing them with a good copy from another replica).
//!
//! The store never returns a bad block: a read fails with
//! [`StoreError::Checksum`]. The scrubber (in the node) walks the mapped
//! blocks with [`LogStore::scrub_range`]; the owner of the volume reads the
//! block from a healthy replica and hands it to [`LogStore::repair_block`].
//! A repair is conditional: it replaces the block only while it is still
//! bad, so a repair that races with a newer write never undoes it.

use super::format::{BLOCK, BLOCK_U64};
use super::{check_range, LogStore, Need, Result};
use crate::StoreError;

impl LogStore {
    /// [`write`](Self::write) of whole blocks whose CRC-32C the sender
    /// computed (`crcs[i]` for the `i`-th block): each block is checked
    /// against its CRC first, and nothing is written if one disagrees
    /// ([`StoreError::DamagedInTransit`]). The CRCs stored are those same
    /// values, so a block's checksum is carried from where the data entered
    /// the cluster to the disk.
    pub fn write_checked(&self, id: u64, offset: u64, data: &[u8], crcs: &[u32]) -> Result<()> {
        if !offset.is_multiple_of(BLOCK_U64)
            || !data.len().is_multiple_of(BLOCK)
            || crcs.len() != data.len() / BLOCK
        {
            return Err(StoreError::BadFormat(format!(
                "checked write of {} bytes at {offset} with {} checksums: whole blocks only",
                data.len(),
                crcs.len()
            )));
        }
        for (i, (b, &crc)) in data.chunks(BLOCK).zip(crcs).enumerate() {
            if crc32c::crc32c(b) != crc {
                return Err(StoreError::DamagedInTransit {
                    component: id,
                    offset: offset + (i * BLOCK) as u64,
                });
            }
        }
        // Checked: the store keeps the sender's CRCs, computed once.
        self.write_with_crcs(id, offset, data, crcs.iter().map(|&c| Some(c)).collect())
    }

    /// Reads `[offset, offset + len)` of component `id` and returns the
    /// byte offsets of the blocks that fail their checksum (empty when all
    /// are good). Unmapped blocks cost nothing. Other errors (unknown
    /// component, I/O) are returned as they are.
    pub fn scrub_range(&self, id: u64, offset: u64, len: u64) -> Result<Vec<u64>> {
        let mut buf = vec![0u8; len as usize];
        match self.read(id, offset, &mut buf) {
            Ok(()) => return Ok(Vec::new()),
            Err(StoreError::Checksum { .. }) => {}
            Err(e) => return Err(e),
        }
        // At least one bad block: find them all, one block at a time.
        let mut bad = Vec::new();
        let mut at = offset / BLOCK_U64 * BLOCK_U64;
        let end = offset + len;
        let mut one = vec![0u8; BLOCK];
        while at < end {
            let size = self
                .component(id)
                .ok_or(StoreError::NoSuchComponent(id))?
                .size;
            let n = (size.saturating_sub(at)).min(BLOCK_U64) as usize;
            if n == 0 {
                break;
            }
            match self.read(id, at, &mut one[..n]) {
                Ok(()) => {}
                Err(StoreError::Checksum { offset, .. }) => bad.push(offset),
                Err(e) => return Err(e),
            }
            at += BLOCK_U64;
        }
        Ok(bad)
    }

    /// Replaces the block at `offset` (a multiple of 4096) of component
    /// `id` with `data` (one block, or the component's tail) if, and only
    /// if, it still fails its checksum. Returns whether it was replaced.
    /// Durable after the next [`sync`](Self::sync).
    pub fn repair_block(&self, id: u64, offset: u64, data: &[u8]) -> Result<bool> {
        self.fail_check()?;
        let mut st = self.lock_state();
        let c = st.comps.get(&id).ok_or(StoreError::NoSuchComponent(id))?;
        let size = c.size;
        let whole = (size - offset.min(size)).min(BLOCK_U64);
        if !offset.is_multiple_of(BLOCK_U64) || data.len() as u64 != whole || whole == 0 {
            return Err(StoreError::OutOfRange {
                id,
                offset,
                len: data.len() as u64,
                size,
            });
        }
        check_range(id, offset, data.len() as u64, size)?;
        let block = offset / BLOCK_U64;
        let mut cur = vec![0u8; BLOCK];
        match self.read_block_locked(&st, id, block, &mut cur) {
            // Rewritten since it was found bad (or never was): keep it.
            Ok(()) => return Ok(false),
            Err(StoreError::Checksum { .. }) => {}
            Err(e) => return Err(e),
        }
        let mut full = vec![0u8; BLOCK];
        full[..data.len()].copy_from_slice(data);
        self.ensure_space(&mut st, 1, 0, Need::Freeing)?;
        let crc = crc32c::crc32c(&full);
        self.put_block(&mut st, id, block, &full, crc, false)?;
        tracing::info!(component = id, offset, "bad block replaced by a good copy");
        self.after_op(&mut st)?;
        drop(st);
        // A batch sealed by this repair is written now, outside the lock.
        self.write_sealed(false)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::super::device::FaultyDevice;
    use super::super::LogStore;
    use crate::log::LogConfig;
    use std::sync::Arc;

    const M: u64 = 1 << 20;

    fn store() -> (Arc<FaultyDevice>, LogStore) {
        let dev = Arc::new(FaultyDevice::new(64 * M));
        let s = LogStore::format_device(dev.clone(), "t", &LogConfig::default()).unwrap();
        (dev, s)
    }

    /// Device byte offset of the data of block `block` of component `id`.
    fn locate(dev: &FaultyDevice, pattern: &[u8]) -> u64 {
        let img = dev.image();
        img.chunks(4096)
            .position(|b| b == pattern)
            .expect("block on the device") as u64
            * 4096
    }

    #[test]
    fn batched_reads_keep_errors_to_their_own_request() {
        let (dev, s) = store();
        s.create_component(1, 1, 8 * M).unwrap();
        s.create_component(2, 1, 8 * M).unwrap();
        let a: Vec<u8> = (0..64 * 1024).map(|i| (i % 249) as u8).collect();
        let b: Vec<u8> = (0..64 * 1024).map(|i| (i % 241) as u8 ^ 0x5a).collect();
        s.write(1, 0, &a).unwrap();
        s.write(2, 4096, &b).unwrap();
        s.sync().unwrap();
        // Rot in component 2's third block.
        let at = locate(&dev, &b[2 * 4096..3 * 4096]);
        dev.flip_bit(at * 8 + 3);
        let (mut x, mut y, mut z, mut w) = (
            vec![0u8; a.len()],
            vec![0u8; 8192],
            vec![0u8; 100],
            vec![0u8; 4096],
        );
        let mut reqs = [
            super::super::ReadReq {
                id: 1,
                offset: 0,
                buf: &mut x,
            },
            super::super::ReadReq {
                id: 2,
                offset: 2 * 4096,
                buf: &mut y,
            },
            super::super::ReadReq {
                id: 9,
                offset: 0,
                buf: &mut z,
            },
            super::super::ReadReq {
                id: 1,
                offset: 8 * M - 100,
                buf: &mut w,
            },
        ];
        let r = s.read_batch(&mut reqs);
        assert!(r[0].is_ok());
        assert!(matches!(
            r[1],
            Err(crate::StoreError::Checksum { offset: 12288, .. })
        ));
        assert!(matches!(r[2], Err(crate::StoreError::NoSuchComponent(9))));
        assert!(matches!(r[3], Err(crate::StoreError::OutOfRange { .. })));
        assert_eq!(x, a);
        // The batch equals the reads one by one.
        let mut one = vec![0u8; 4096];
        s.read(2, 4096, &mut one).unwrap();
        assert_eq!(one, b[..4096]);
    }

    #[test]
    fn checked_writes_refuse_damaged_blocks_and_write_nothing() {
        let (_dev, s) = store();
        s.create_component(1, 1, M).unwrap();
        let data: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        let crcs: Vec<u32> = data.chunks(4096).map(crc32c::crc32c).collect();
        let mut bad = data.clone();
        bad[4096 + 7] ^= 1;
        assert!(matches!(
            s.write_checked(1, 8192, &bad, &crcs),
            Err(crate::StoreError::DamagedInTransit { offset: 12288, .. })
        ));
        let mut back = vec![1u8; data.len()];
        s.read(1, 8192, &mut back).unwrap();
        assert!(back.iter().all(|&b| b == 0), "nothing written");
        assert!(s.write_checked(1, 100, &data, &crcs).is_err());
        assert!(s.write_checked(1, 8192, &data, &crcs[..2]).is_err());
        s.write_checked(1, 8192, &data, &crcs).unwrap();
        s.read(1, 8192, &mut back).unwrap();
        assert_eq!(back, data);
    }

    #[test]
    fn scrub_finds_flipped_blocks_and_repair_fixes_only_bad_ones() {
        let (dev, s) = store();
        s.create_component(1, 1, 8 * M).unwrap();
        let blocks: Vec<Vec<u8>> = (0..8u8).map(|i| vec![i + 1; 4096]).collect();
        for (i, b) in blocks.iter().enumerate() {
            s.write(1, i as u64 * 4096, b).unwrap();
        }
        s.sync().unwrap();
        assert!(s.scrub_range(1, 0, 8 * M).unwrap().is_empty());
        // Damage blocks 2 and 5 on the device.
        for i in [2usize, 5] {
            let at = locate(&dev, &blocks[i]);
            dev.flip_bit(at * 8 + 77);
        }
        let mut buf = vec![0u8; 4096];
        assert!(matches!(
            s.read(1, 2 * 4096, &mut buf),
            Err(crate::StoreError::Checksum { offset: 8192, .. })
        ));
        assert_eq!(
            s.scrub_range(1, 0, 8 * M).unwrap(),
            vec![2 * 4096, 5 * 4096]
        );
        // A good block is never replaced.
        assert!(!s.repair_block(1, 0, &[9u8; 4096]).unwrap());
        assert!(s.repair_block(1, 2 * 4096, &blocks[2]).unwrap());
        // Block 5 was rewritten by a client before its repair arrived: the
        // repair leaves the newer data alone.
        s.write(1, 5 * 4096, &[42u8; 4096]).unwrap();
        assert!(!s.repair_block(1, 5 * 4096, &blocks[5]).unwrap());
        s.sync().unwrap();
        assert!(s.scrub_range(1, 0, 8 * M).unwrap().is_empty());
        s.read(1, 2 * 4096, &mut buf).unwrap();
        assert_eq!(buf, blocks[2]);
        s.read(1, 5 * 4096, &mut buf).unwrap();
        assert_eq!(buf, vec![42u8; 4096]);
        // Misaligned or oversized repairs are refused.
        assert!(s.repair_block(1, 100, &[0u8; 4096]).is_err());
        assert!(s.repair_block(1, 0, &[0u8; 100]).is_err());
        s.check().unwrap();
        // The repair survives a reopen.
        drop(s);
        let s = LogStore::open_device(Arc::new(FaultyDevice::from_image(dev.image()))).unwrap();
        s.read(1, 2 * 4096, &mut buf).unwrap();
        assert_eq!(buf, blocks[2]);
        assert!(s.scrub_range(1, 0, 8 * M).unwrap().is_empty());
    }
}
