//! Byte layout of a Shoal device (see `docs/store-format.md`). Pure
//! encoding and decoding; no I/O.

use crate::StoreError;

pub const MAGIC: &[u8; 8] = b"SHOALDEV";
pub const VERSION: u32 = 1;
/// Unit of allocation of component data.
pub const CHUNK_SIZE: u64 = 1 << 20;
/// Smallest device Shoal accepts.
pub const MIN_CAPACITY: u64 = 64 << 20;
pub const SUPER_SIZE: usize = 4096;
pub const SLOT_SIZE: usize = 128;
pub const SLOTS: u32 = 1024;
pub const ENTRY_SIZE: usize = 16;
pub const TABLE_OFF: u64 = SUPER_SIZE as u64;
pub const MAX_CLUSTER_ID: usize = 64;

const SB_CRC_AT: usize = SUPER_SIZE - 4;
const SLOT_CRC_AT: usize = SLOT_SIZE - 4;

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

fn put64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

/// The fixed header of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub uuid: u64,
    /// Bytes of the device Shoal uses (the `capacity` given at creation).
    pub device_size: u64,
    pub chunk_size: u64,
    pub slots: u32,
    pub chunks: u64,
    pub table_off: u64,
    pub map_off: u64,
    pub data_off: u64,
    pub cluster_id: String,
}

impl Superblock {
    /// The layout of a new device of `device_size` bytes; `None` if not even
    /// one chunk fits.
    pub fn new(device_size: u64, uuid: u64, cluster_id: &str) -> Option<Superblock> {
        let map_off = TABLE_OFF + SLOTS as u64 * SLOT_SIZE as u64;
        let mut chunks = device_size.saturating_sub(map_off) / (CHUNK_SIZE + ENTRY_SIZE as u64);
        let data_off = loop {
            let data_off = align_up(map_off + chunks * ENTRY_SIZE as u64, CHUNK_SIZE)?;
            if data_off + chunks * CHUNK_SIZE <= device_size {
                break data_off;
            }
            chunks = chunks.checked_sub(1)?;
        };
        if chunks == 0 {
            return None;
        }
        Some(Superblock {
            uuid,
            device_size,
            chunk_size: CHUNK_SIZE,
            slots: SLOTS,
            chunks: chunks.min(u32::MAX as u64),
            table_off: TABLE_OFF,
            map_off,
            data_off,
            cluster_id: cluster_id.to_string(),
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SUPER_SIZE];
        b[0..8].copy_from_slice(MAGIC);
        put32(&mut b, 8, VERSION);
        put32(&mut b, 12, self.slots);
        put64(&mut b, 16, self.uuid);
        put64(&mut b, 24, self.device_size);
        put64(&mut b, 32, self.chunk_size);
        put64(&mut b, 40, self.chunks);
        put64(&mut b, 48, self.table_off);
        put64(&mut b, 56, self.map_off);
        put64(&mut b, 64, self.data_off);
        let id = self.cluster_id.as_bytes();
        let n = id.len().min(MAX_CLUSTER_ID);
        b[72..74].copy_from_slice(&(n as u16).to_le_bytes());
        b[74..74 + n].copy_from_slice(&id[..n]);
        let crc = crc32c::crc32c(&b[..SB_CRC_AT]);
        put32(&mut b, SB_CRC_AT, crc);
        b
    }

    /// Whether `b` starts with the Shoal magic (whatever else it holds).
    pub fn has_magic(b: &[u8]) -> bool {
        b.len() >= 8 && &b[0..8] == MAGIC
    }

    /// Decodes and validates a superblock; never panics on any input.
    pub fn decode(b: &[u8]) -> Result<Superblock, StoreError> {
        if b.len() < SUPER_SIZE || !Self::has_magic(b) {
            return Err(StoreError::BadFormat(
                "not a Shoal device: no SHOALDEV superblock at offset 0".into(),
            ));
        }
        if crc32c::crc32c(&b[..SB_CRC_AT]) != u32_at(b, SB_CRC_AT) {
            return Err(StoreError::Corrupt("superblock checksum mismatch".into()));
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(StoreError::BadFormat(format!(
                "device format version {version} is not supported (this build reads version {VERSION})"
            )));
        }
        let n = u16::from_le_bytes([b[72], b[73]]) as usize;
        if n > MAX_CLUSTER_ID {
            return Err(StoreError::Corrupt(format!(
                "cluster id length {n} > {MAX_CLUSTER_ID}"
            )));
        }
        let cluster_id = std::str::from_utf8(&b[74..74 + n])
            .map_err(|_| StoreError::Corrupt("cluster id is not UTF-8".into()))?
            .to_string();
        let sb = Superblock {
            uuid: u64_at(b, 16),
            device_size: u64_at(b, 24),
            chunk_size: u64_at(b, 32),
            chunks: u64_at(b, 40),
            slots: u32_at(b, 12),
            table_off: u64_at(b, 48),
            map_off: u64_at(b, 56),
            data_off: u64_at(b, 64),
            cluster_id,
        };
        sb.check()?;
        Ok(sb)
    }

    /// The geometry is consistent (so offsets computed from it cannot
    /// overflow or overlap).
    fn check(&self) -> Result<(), StoreError> {
        let bad = |what: &str| Err(StoreError::Corrupt(format!("superblock: {what}")));
        if self.chunk_size != CHUNK_SIZE {
            return bad(&format!(
                "chunk size {} (expected {CHUNK_SIZE})",
                self.chunk_size
            ));
        }
        if self.slots == 0 || self.slots > 1 << 20 {
            return bad(&format!("{} component slots", self.slots));
        }
        if self.chunks == 0 || self.chunks > u32::MAX as u64 {
            return bad(&format!("{} chunks", self.chunks));
        }
        if self.table_off < SUPER_SIZE as u64 {
            return bad("component table overlaps the superblock");
        }
        let table_end = self
            .table_off
            .checked_add(self.slots as u64 * SLOT_SIZE as u64);
        if past(table_end, self.map_off) {
            return bad("chunk map overlaps the component table");
        }
        let map_end = self.map_off.checked_add(self.chunks * ENTRY_SIZE as u64);
        if past(map_end, self.data_off) || !self.data_off.is_multiple_of(CHUNK_SIZE) {
            return bad("data area overlaps the chunk map or is unaligned");
        }
        let end = self
            .chunks
            .checked_mul(CHUNK_SIZE)
            .and_then(|d| d.checked_add(self.data_off));
        if past(end, self.device_size) {
            return bad("data area extends past the device size");
        }
        Ok(())
    }

    /// Byte offset of a component slot.
    pub fn slot_off(&self, slot: u32) -> u64 {
        self.table_off + slot as u64 * SLOT_SIZE as u64
    }

    /// Byte offset of a chunk map entry.
    pub fn entry_off(&self, chunk: u32) -> u64 {
        self.map_off + chunk as u64 * ENTRY_SIZE as u64
    }

    /// Byte offset of a data chunk.
    pub fn chunk_off(&self, chunk: u32) -> u64 {
        self.data_off + chunk as u64 * CHUNK_SIZE
    }
}

/// `v` is missing (overflow) or past `limit`.
fn past(v: Option<u64>, limit: u64) -> bool {
    v.is_none_or(|v| v > limit)
}

/// One component table slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub id: u64,
    pub volume: u64,
    pub size: u64,
    pub generation: u64,
    pub flags: u32,
}

impl Slot {
    pub fn encode(&self) -> [u8; SLOT_SIZE] {
        let mut b = [0u8; SLOT_SIZE];
        put64(&mut b, 0, self.id);
        put64(&mut b, 8, self.volume);
        put64(&mut b, 16, self.size);
        put64(&mut b, 24, self.generation);
        put32(&mut b, 32, self.flags);
        let crc = crc32c::crc32c(&b[..SLOT_CRC_AT]);
        put32(&mut b, SLOT_CRC_AT, crc);
        b
    }

    /// `Ok(None)`: a free slot (id 0). `Err`: checksum mismatch.
    pub fn decode(b: &[u8]) -> Result<Option<Slot>, ()> {
        if b.len() < SLOT_SIZE {
            return Err(());
        }
        let id = u64_at(b, 0);
        if id == 0 {
            return Ok(None);
        }
        if crc32c::crc32c(&b[..SLOT_CRC_AT]) != u32_at(b, SLOT_CRC_AT) {
            return Err(());
        }
        Ok(Some(Slot {
            id,
            volume: u64_at(b, 8),
            size: u64_at(b, 16),
            generation: u64_at(b, 24),
            flags: u32_at(b, 32),
        }))
    }
}

/// Encodes a chunk map entry; owner 0 is a free chunk (all zero bytes).
pub fn encode_entry(owner: u64, index: u32) -> [u8; ENTRY_SIZE] {
    let mut b = [0u8; ENTRY_SIZE];
    if owner == 0 {
        return b;
    }
    put64(&mut b, 0, owner);
    put32(&mut b, 8, index);
    let crc = crc32c::crc32c(&b[..12]);
    put32(&mut b, 12, crc);
    b
}

/// `Ok(None)`: free. `Ok(Some((owner, index)))`: allocated. `Err`: checksum
/// mismatch.
pub fn decode_entry(b: &[u8]) -> Result<Option<(u64, u32)>, ()> {
    if b.len() < ENTRY_SIZE {
        return Err(());
    }
    let owner = u64_at(b, 0);
    if owner == 0 {
        return Ok(None);
    }
    if crc32c::crc32c(&b[..12]) != u32_at(b, 12) {
        return Err(());
    }
    Ok(Some((owner, u32_at(b, 8))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_of_the_smallest_device() {
        let sb = Superblock::new(MIN_CAPACITY, 1, "c").unwrap();
        assert_eq!(sb.data_off, CHUNK_SIZE);
        assert_eq!(sb.chunks, 63);
        assert!(sb.check().is_ok());
        let sb = Superblock::new(1 << 40, 1, "c").unwrap();
        assert!(sb.data_off + sb.chunks * CHUNK_SIZE <= 1 << 40);
        assert!(sb.map_off + sb.chunks * 16 <= sb.data_off);
        assert!(Superblock::new(1 << 20, 1, "c").is_none());
    }

    #[test]
    fn superblock_round_trips_and_detects_damage() {
        let sb = Superblock::new(100 << 20, 42, "prod-east").unwrap();
        let mut b = sb.encode();
        assert_eq!(Superblock::decode(&b).unwrap(), sb);
        b[20] ^= 1;
        assert!(matches!(
            Superblock::decode(&b),
            Err(StoreError::Corrupt(_))
        ));
        assert!(matches!(
            Superblock::decode(&[0u8; 4096]),
            Err(StoreError::BadFormat(_))
        ));
        assert!(Superblock::decode(b"SHOALDEV").is_err());
    }

    #[test]
    fn slots_and_entries_round_trip() {
        let s = Slot {
            id: 5,
            volume: 6,
            size: 7,
            generation: 8,
            flags: 0,
        };
        let mut b = s.encode();
        assert_eq!(Slot::decode(&b), Ok(Some(s)));
        b[17] ^= 4;
        assert_eq!(Slot::decode(&b), Err(()));
        assert_eq!(Slot::decode(&[0u8; 128]), Ok(None));
        let mut e = encode_entry(9, 3);
        assert_eq!(decode_entry(&e), Ok(Some((9, 3))));
        e[8] ^= 1;
        assert_eq!(decode_entry(&e), Err(()));
        assert_eq!(decode_entry(&encode_entry(0, 3)), Ok(None));
    }
}
