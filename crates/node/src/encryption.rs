//! Encryption at rest of `encrypt=on` volumes, at the node a client
//! reaches: writes are encrypted before they leave for the owner (local or
//! on another node), reads decrypted when they come back, so only
//! ciphertext crosses the network and reaches the devices.
//!
//! Keys: each encrypted volume has a data key of its own, made when the
//! volume is created and kept in the directory wrapped by the cluster key
//! (`--key-file`, the same file on every node, never in the directory).
//! A node without the cluster key serves no encrypted volume.

use sha2::{Digest, Sha256};
use shoal_crypt::{ClusterKey, SectorCipher, VolumeKey, WrappedKey, SECTOR_BYTES};
use std::sync::Arc;

/// What binds a wrapped data key to its volume: the key unwraps only for
/// the volume whose name it was made for.
pub fn binding(volume_name: &str) -> u64 {
    let h = Sha256::digest(format!("shoal volume key\0{volume_name}").as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[..8]);
    u64::from_le_bytes(b)
}

/// A new data key for the volume `name`, wrapped by `key`, in text form.
pub fn new_wrapped_key(key: &ClusterKey, name: &str) -> String {
    key.wrap(&VolumeKey::generate(), binding(name)).to_text()
}

/// The cipher of an encrypted volume, from its wrapped key.
pub fn cipher(
    key: Option<&ClusterKey>,
    name: &str,
    wrapped: &str,
) -> Result<Arc<SectorCipher>, String> {
    let key = key.ok_or_else(|| {
        format!("volume {name:?} is encrypted and this node has no cluster key (--key-file)")
    })?;
    let w = WrappedKey::from_text(wrapped).map_err(|e| format!("volume {name:?}: {e}"))?;
    let vk = key
        .unwrap(&w, binding(name))
        .map_err(|e| format!("volume {name:?}: {e}"))?;
    Ok(Arc::new(SectorCipher::new(&vk)))
}

/// Whether `(offset, len)` is whole sectors: encrypted volumes take no
/// other I/O (they advertise a minimum block size of a sector).
pub fn aligned(offset: u64, len: u64) -> bool {
    let s = SECTOR_BYTES as u64;
    offset.is_multiple_of(s) && len.is_multiple_of(s)
}

/// Smallest I/O of an encrypted volume, in bytes.
pub const ENCRYPTED_MIN_BLOCK_BYTES: u32 = SECTOR_BYTES as u32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrapped_key_opens_its_volume_only() {
        let d = tempfile::tempdir().unwrap();
        let key = ClusterKey::generate_file(d.path().join("k")).unwrap();
        let w = new_wrapped_key(&key, "a");
        let c = cipher(Some(&key), "a", &w).unwrap();
        let mut buf = vec![7u8; 1024];
        c.encrypt(4096, &mut buf).unwrap();
        assert_ne!(buf, vec![7u8; 1024]);
        assert!(cipher(Some(&key), "b", &w).is_err(), "bound to its volume");
        assert!(cipher(None, "a", &w).unwrap_err().contains("--key-file"));
        let other = ClusterKey::generate_file(d.path().join("k2")).unwrap();
        assert!(cipher(Some(&other), "a", &w).is_err());
        assert!(aligned(512, 4096) && !aligned(100, 512) && !aligned(512, 100));
    }
}
