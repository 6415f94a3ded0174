//! Wrapping volume keys with the cluster key (AES-256-GCM).

use std::fmt;
use std::str::FromStr;

use rand::rngs::OsRng;
use rand::RngCore;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use zeroize::Zeroizing;

use crate::{hex, ClusterKey, CryptError, VolumeKey};

const ID_LEN: usize = ClusterKey::ID_HEX_LEN / 2;
const TAG_LEN: usize = 16;
/// nonce | encrypted volume key | GCM tag.
const SEALED_LEN: usize = NONCE_LEN + VolumeKey::LEN + TAG_LEN;
/// version | key id | sealed.
const BYTES_LEN: usize = 1 + ID_LEN + SEALED_LEN;
/// Prefix of the associated data, so that no other use of the cluster key
/// can produce a valid wrapped key.
const AAD_DOMAIN: &[u8] = b"shoal-crypt wrapped volume key\0";

/// A volume key encrypted and authenticated by a [`ClusterKey`], bound to
/// one volume id. Safe to store in a volume record and to print.
///
/// Byte form ([`to_bytes`](Self::to_bytes), 101 bytes): format version (1),
/// the 8-byte id of the cluster key, then a random 96-bit nonce, the 64
/// encrypted key bytes and the 16-byte GCM tag. Text form
/// ([`to_text`](Self::to_text), also `Display`/`FromStr`) for JSON records:
/// `v1:<16 hex digits of key id>:<184 hex digits of nonce|ciphertext|tag>`.
///
/// The associated data of the AEAD is a domain label, the format version,
/// the key id and the volume id (u64, little-endian): unwrapping for another
/// volume, with another key, or after any change to the bytes fails.
#[derive(Clone, PartialEq, Eq)]
pub struct WrappedKey {
    key_id: [u8; ID_LEN],
    sealed: [u8; SEALED_LEN],
}

impl WrappedKey {
    /// The only format version this build writes and reads.
    pub const VERSION: u8 = 1;

    /// The id ([`ClusterKey::id`]) of the cluster key that wrapped this key.
    pub fn key_id(&self) -> String {
        hex::encode(&self.key_id)
    }

    /// `v1:<key id>:<hex of nonce|ciphertext|tag>`.
    pub fn to_text(&self) -> String {
        let mut s = String::with_capacity(4 + 2 * ID_LEN + 2 * SEALED_LEN);
        s.push('v');
        s.push_str(&Self::VERSION.to_string());
        s.push(':');
        hex::encode_into(&self.key_id, &mut s);
        s.push(':');
        hex::encode_into(&self.sealed, &mut s);
        s
    }

    /// Parses [`to_text`](Self::to_text)'s form. Hex digits may be in either
    /// case; surrounding whitespace is not accepted.
    pub fn from_text(text: &str) -> Result<WrappedKey, CryptError> {
        let mut parts = text.split(':');
        let (Some(version), Some(id), Some(sealed), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(CryptError::WrappedKeyFormat(
                "expected v<version>:<key id>:<hex>",
            ));
        };
        if version != format!("v{}", Self::VERSION) {
            return Err(CryptError::UnsupportedVersion(version.to_string()));
        }
        let mut key_id = [0u8; ID_LEN];
        if !hex::decode_into(id.as_bytes(), &mut key_id) {
            return Err(CryptError::WrappedKeyFormat("key id must be 16 hex digits"));
        }
        let mut bytes = [0u8; SEALED_LEN];
        if !hex::decode_into(sealed.as_bytes(), &mut bytes) {
            return Err(CryptError::WrappedKeyFormat(
                "sealed key must be 184 hex digits",
            ));
        }
        Ok(WrappedKey {
            key_id,
            sealed: bytes,
        })
    }

    /// The byte form: version, key id, nonce, ciphertext, tag.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(BYTES_LEN);
        v.push(Self::VERSION);
        v.extend_from_slice(&self.key_id);
        v.extend_from_slice(&self.sealed);
        v
    }

    /// Parses [`to_bytes`](Self::to_bytes)'s form.
    pub fn from_bytes(bytes: &[u8]) -> Result<WrappedKey, CryptError> {
        let Some((&version, rest)) = bytes.split_first() else {
            return Err(CryptError::WrappedKeyFormat("empty"));
        };
        if version != Self::VERSION {
            return Err(CryptError::UnsupportedVersion(version.to_string()));
        }
        if rest.len() != ID_LEN + SEALED_LEN {
            return Err(CryptError::WrappedKeyFormat("wrong length"));
        }
        let mut key_id = [0u8; ID_LEN];
        key_id.copy_from_slice(&rest[..ID_LEN]);
        let mut sealed = [0u8; SEALED_LEN];
        sealed.copy_from_slice(&rest[ID_LEN..]);
        Ok(WrappedKey { key_id, sealed })
    }

    fn aad(key_id: &[u8; ID_LEN], volume_id: u64) -> Vec<u8> {
        let mut aad = Vec::with_capacity(AAD_DOMAIN.len() + 1 + ID_LEN + 8);
        aad.extend_from_slice(AAD_DOMAIN);
        aad.push(Self::VERSION);
        aad.extend_from_slice(key_id);
        aad.extend_from_slice(&volume_id.to_le_bytes());
        aad
    }
}

impl fmt::Display for WrappedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_text())
    }
}

impl fmt::Debug for WrappedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WrappedKey({})", self.to_text())
    }
}

impl FromStr for WrappedKey {
    type Err = CryptError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        WrappedKey::from_text(s)
    }
}

impl ClusterKey {
    fn aead_key(&self) -> LessSafeKey {
        // AES_256_GCM takes exactly 32 bytes, which is what a ClusterKey holds.
        match UnboundKey::new(&AES_256_GCM, self.as_bytes()) {
            Ok(k) => LessSafeKey::new(k),
            Err(_) => unreachable!("AES-256-GCM key length is 32 bytes"),
        }
    }

    /// Encrypts `key` for storage in the record of volume `volume_id`, with a
    /// fresh random 96-bit nonce (safe for far more than the 2^32 wraps per
    /// cluster key that NIST allows for random nonces).
    ///
    /// # Panics
    /// If the operating system's random number generator fails.
    pub fn wrap(&self, key: &VolumeKey, volume_id: u64) -> WrappedKey {
        let key_id = self.id_bytes();
        let mut nonce = [0u8; NONCE_LEN];
        OsRng.fill_bytes(&mut nonce);
        let mut in_out = key.to_bytes();
        let aad = WrappedKey::aad(&key_id, volume_id);
        let tag = match self.aead_key().seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(&aad[..]),
            &mut in_out[..],
        ) {
            Ok(tag) => tag,
            // ring refuses only inputs longer than GCM's limit (64 GiB).
            Err(_) => unreachable!("sealing 64 bytes cannot fail"),
        };
        let mut sealed = [0u8; SEALED_LEN];
        sealed[..NONCE_LEN].copy_from_slice(&nonce);
        sealed[NONCE_LEN..NONCE_LEN + VolumeKey::LEN].copy_from_slice(&in_out[..]);
        sealed[NONCE_LEN + VolumeKey::LEN..].copy_from_slice(tag.as_ref());
        WrappedKey { key_id, sealed }
    }

    /// Recovers the volume key from `w`, which must have been made by
    /// [`wrap`](Self::wrap) with this cluster key and the same `volume_id`.
    ///
    /// Fails with [`CryptError::WrongClusterKey`] if `w` names another
    /// cluster key, and with [`CryptError::UnwrapFailed`] if authentication
    /// fails (other volume, altered bytes, or a forged key id).
    pub fn unwrap(&self, w: &WrappedKey, volume_id: u64) -> Result<VolumeKey, CryptError> {
        let key_id = self.id_bytes();
        if w.key_id != key_id {
            return Err(CryptError::WrongClusterKey {
                expected: hex::encode(&key_id),
                found: w.key_id(),
            });
        }
        let mut nonce = [0u8; NONCE_LEN];
        nonce.copy_from_slice(&w.sealed[..NONCE_LEN]);
        let mut in_out = Zeroizing::new([0u8; VolumeKey::LEN + TAG_LEN]);
        in_out.copy_from_slice(&w.sealed[NONCE_LEN..]);
        let aad = WrappedKey::aad(&key_id, volume_id);
        let plain = self
            .aead_key()
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&aad[..]),
                &mut in_out[..],
            )
            .map_err(|_| CryptError::UnwrapFailed)?;
        let mut bytes = Zeroizing::new([0u8; VolumeKey::LEN]);
        if plain.len() != VolumeKey::LEN {
            return Err(CryptError::UnwrapFailed);
        }
        bytes.copy_from_slice(plain);
        VolumeKey::from_bytes(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SectorCipher;

    fn same_key(a: &VolumeKey, b: &VolumeKey) -> bool {
        *a.to_bytes() == *b.to_bytes()
    }

    #[test]
    fn wrap_unwrap_round_trip() {
        let ck = ClusterKey::from_bytes_for_test([9; 32]);
        let vk = VolumeKey::generate();
        let w = ck.wrap(&vk, 42);
        assert_eq!(w.key_id(), ck.id());
        let back = ck.unwrap(&w, 42).unwrap();
        assert!(same_key(&vk, &back));

        // The unwrapped key encrypts like the original.
        let mut a = vec![3u8; 1024];
        let mut b = a.clone();
        SectorCipher::new(&vk).encrypt(512, &mut a).unwrap();
        SectorCipher::new(&back).encrypt(512, &mut b).unwrap();
        assert_eq!(a, b);

        // Random nonce: wrapping twice differs, both unwrap.
        let w2 = ck.wrap(&vk, 42);
        assert_ne!(w, w2);
        assert!(same_key(&ck.unwrap(&w2, 42).unwrap(), &vk));
    }

    #[test]
    fn text_and_bytes_round_trip() {
        let ck = ClusterKey::from_bytes_for_test([9; 32]);
        let vk = VolumeKey::generate();
        let w = ck.wrap(&vk, u64::MAX);

        let text = w.to_text();
        let parts: Vec<&str> = text.split(':').collect();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[0], "v1");
        assert_eq!(parts[1], ck.id());
        assert_eq!(parts[2].len(), 2 * (12 + 64 + 16));
        assert!(parts[2]
            .bytes()
            .all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f')));
        assert_eq!(WrappedKey::from_text(&text).unwrap(), w);
        assert_eq!(
            WrappedKey::from_text(&text.to_uppercase().replacen('V', "v", 1)).unwrap(),
            w
        );
        assert_eq!(text.parse::<WrappedKey>().unwrap(), w);
        assert_eq!(w.to_string(), text);
        assert_eq!(format!("{w:?}"), format!("WrappedKey({text})"));

        let bytes = w.to_bytes();
        assert_eq!(bytes.len(), BYTES_LEN);
        assert_eq!(bytes[0], 1);
        assert_eq!(WrappedKey::from_bytes(&bytes).unwrap(), w);
        assert!(same_key(
            &ck.unwrap(&WrappedKey::from_bytes(&bytes).unwrap(), u64::MAX)
                .unwrap(),
            &vk
        ));
    }

    #[test]
    fn malformed_text_and_bytes_refused() {
        let ck = ClusterKey::from_bytes_for_test([9; 32]);
        let text = ck.wrap(&VolumeKey::generate(), 1).to_text();
        let (id, sealed) = (&text[3..19], &text[20..]);
        let bad_format = [
            String::new(),
            "v1".to_string(),
            format!("v1:{id}"),
            format!("v1:{id}:{sealed}:"),
            format!("v1:{id}:{}", &sealed[1..]),
            format!("v1:{id}:{sealed}0"),
            format!("v1:{id}:{}z", &sealed[1..]),
            format!("v1:{}:{sealed}", &id[2..]),
            format!("v1:{id}:{sealed}\n"),
        ];
        for t in &bad_format {
            assert!(
                matches!(
                    WrappedKey::from_text(t),
                    Err(CryptError::WrappedKeyFormat(_))
                ),
                "{t:?}"
            );
        }
        for t in [
            format!("v2:{id}:{sealed}"),
            format!("V1:{id}:{sealed}"),
            format!(" v1:{id}:{sealed}"),
        ] {
            assert!(
                matches!(
                    WrappedKey::from_text(&t),
                    Err(CryptError::UnsupportedVersion(_))
                ),
                "{t:?}"
            );
        }
        assert!(matches!(
            WrappedKey::from_bytes(&[]),
            Err(CryptError::WrappedKeyFormat(_))
        ));
        let mut bytes = WrappedKey::from_text(&text).unwrap().to_bytes();
        bytes.pop();
        assert!(matches!(
            WrappedKey::from_bytes(&bytes),
            Err(CryptError::WrappedKeyFormat(_))
        ));
        bytes[0] = 2;
        assert!(matches!(
            WrappedKey::from_bytes(&bytes),
            Err(CryptError::UnsupportedVersion(_))
        ));
    }

    #[test]
    fn unwrap_with_other_cluster_key_fails() {
        let ck = ClusterKey::from_bytes_for_test([9; 32]);
        let other = ClusterKey::from_bytes_for_test([10; 32]);
        let w = ck.wrap(&VolumeKey::generate(), 7);
        match other.unwrap(&w, 7) {
            Err(CryptError::WrongClusterKey { expected, found }) => {
                assert_eq!(expected, other.id());
                assert_eq!(found, ck.id());
            }
            r => panic!("{r:?}"),
        }
        // Even with the key id rewritten to the other key's, GCM refuses it.
        let forged = format!("v1:{}:{}", other.id(), &w.to_text()[20..]);
        let forged = WrappedKey::from_text(&forged).unwrap();
        assert!(matches!(
            other.unwrap(&forged, 7),
            Err(CryptError::UnwrapFailed)
        ));
    }

    #[test]
    fn unwrap_for_other_volume_fails() {
        let ck = ClusterKey::from_bytes_for_test([9; 32]);
        let w = ck.wrap(&VolumeKey::generate(), 7);
        for v in [0, 6, 8, 7 | 1 << 32, u64::MAX] {
            assert!(
                matches!(ck.unwrap(&w, v), Err(CryptError::UnwrapFailed)),
                "{v}"
            );
        }
        assert!(ck.unwrap(&w, 7).is_ok());
    }

    #[test]
    fn unwrap_after_any_bit_flip_fails() {
        let ck = ClusterKey::from_bytes_for_test([9; 32]);
        let w = ck.wrap(&VolumeKey::generate(), 7);
        let bytes = w.to_bytes();
        for i in 0..bytes.len() {
            for bit in [0x01u8, 0x80] {
                let mut b = bytes.clone();
                b[i] ^= bit;
                match WrappedKey::from_bytes(&b) {
                    // Flipping the version byte makes an unknown version.
                    Err(CryptError::UnsupportedVersion(_)) => assert_eq!(i, 0),
                    Ok(t) => assert!(ck.unwrap(&t, 7).is_err(), "byte {i} bit {bit:#x}"),
                    Err(e) => panic!("byte {i}: {e}"),
                }
            }
        }
    }
}
