//! Key material: the per-volume data key and the cluster key with its file.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use rand::rngs::OsRng;
use rand::RngCore;
use zeroize::{Zeroize, Zeroizing};

use crate::{hex, CryptError};

/// The data key of one volume: two AES-256 keys, the first encrypting the
/// sectors and the second the tweaks (IEEE 1619's Key1 and Key2).
///
/// It is never printed (`Debug` shows nothing of it), not `Clone`, and its
/// bytes are overwritten with zeros when it is dropped. It leaves the process
/// only wrapped by a [`ClusterKey`](crate::ClusterKey).
pub struct VolumeKey {
    /// Key1: encrypts the data blocks.
    data: [u8; 32],
    /// Key2: encrypts the tweaks.
    tweak: [u8; 32],
}

impl VolumeKey {
    /// Length of a volume key in bytes.
    pub const LEN: usize = 64;

    /// A fresh random key from the operating system's generator.
    ///
    /// # Panics
    /// If the operating system's random number generator fails (on Linux,
    /// `getrandom(2)` does not fail once the pool is initialised).
    pub fn generate() -> VolumeKey {
        loop {
            let mut bytes = Zeroizing::new([0u8; Self::LEN]);
            OsRng.fill_bytes(&mut bytes[..]);
            // Equal halves have probability 2^-256; retry rather than fail.
            if let Ok(key) = Self::from_bytes(&bytes) {
                return key;
            }
        }
    }

    /// Builds a key from raw bytes (an unwrapped key or a test vector): Key1
    /// then Key2. Refuses equal halves, as IEEE 1619-2018 requires.
    pub(crate) fn from_bytes(bytes: &[u8; Self::LEN]) -> Result<VolumeKey, CryptError> {
        let mut key = VolumeKey {
            data: [0; 32],
            tweak: [0; 32],
        };
        key.data.copy_from_slice(&bytes[..32]);
        key.tweak.copy_from_slice(&bytes[32..]);
        if key.data == key.tweak {
            return Err(CryptError::WeakKey);
        }
        Ok(key)
    }

    /// The 64 key bytes, Key1 then Key2, in a buffer zeroed on drop.
    pub(crate) fn to_bytes(&self) -> Zeroizing<[u8; Self::LEN]> {
        let mut bytes = Zeroizing::new([0u8; Self::LEN]);
        bytes[..32].copy_from_slice(&self.data);
        bytes[32..].copy_from_slice(&self.tweak);
        bytes
    }

    /// Key1, the AES-256 key that encrypts the data blocks.
    pub(crate) fn data_key(&self) -> &[u8; 32] {
        &self.data
    }

    /// Key2, the AES-256 key that encrypts the tweaks.
    pub(crate) fn tweak_key(&self) -> &[u8; 32] {
        &self.tweak
    }
}

impl Drop for VolumeKey {
    fn drop(&mut self) {
        self.data.zeroize();
        self.tweak.zeroize();
    }
}

impl fmt::Debug for VolumeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("VolumeKey(<secret>)")
    }
}

/// The cluster key: an AES-256-GCM key that wraps volume keys so that they
/// can be stored in volume records. It lives in a file holding 64 hex digits
/// and a newline, mode 0600, outside the replicated state.
///
/// `Debug` shows only its public [`id`](ClusterKey::id); the bytes are zeroed
/// on drop.
pub struct ClusterKey {
    bytes: [u8; ClusterKey::LEN],
}

/// Domain separation prefix of the key id hash.
const KEY_ID_DOMAIN: &[u8] = b"shoal-crypt cluster key id v1\0";

/// Longest key file accepted (64 digits, whitespace and a little slack).
const KEY_FILE_MAX: u64 = 256;

impl ClusterKey {
    /// Length of a cluster key in bytes.
    pub const LEN: usize = 32;

    /// Length of [`ClusterKey::id`] in hex digits.
    pub const ID_HEX_LEN: usize = 16;

    /// Creates a new random cluster key in a new file at `path` (64 lower-case
    /// hex digits and a newline, mode 0600, flushed to disk together with its
    /// directory entry) and returns it. Refuses to overwrite an existing file
    /// ([`CryptError::KeyFileExists`]); if writing fails the partial file is
    /// removed.
    pub fn generate_file(path: impl AsRef<Path>) -> Result<ClusterKey, CryptError> {
        let path = path.as_ref();
        let mut bytes = [0u8; Self::LEN];
        OsRng
            .try_fill_bytes(&mut bytes)
            .map_err(|e| CryptError::Rng(e.to_string()))?;
        let key = ClusterKey { bytes };
        bytes.zeroize();

        let mut text = Zeroizing::new(String::with_capacity(2 * Self::LEN + 1));
        hex::encode_into(&key.bytes, &mut text);
        text.push('\n');

        let io_err = |source| CryptError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = match OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(CryptError::KeyFileExists {
                    path: path.to_path_buf(),
                })
            }
            Err(e) => return Err(io_err(e)),
        };
        let written = file
            .write_all(text.as_bytes())
            .and_then(|()| file.sync_all());
        drop(file);
        if let Err(e) = written {
            let _ = fs::remove_file(path);
            return Err(io_err(e));
        }
        // Make the new directory entry durable too: losing the cluster key
        // loses every encrypted volume.
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| CryptError::Io {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(key)
    }

    /// Reads the cluster key from `path`. Refuses a file whose mode grants
    /// any access to group or others ([`CryptError::KeyFileMode`]) and
    /// content other than exactly 64 hex digits, optionally surrounded by
    /// ASCII whitespace such as the trailing newline
    /// ([`CryptError::KeyFileFormat`]).
    pub fn load(path: impl AsRef<Path>) -> Result<ClusterKey, CryptError> {
        let path = path.as_ref();
        let io_err = |source| CryptError::Io {
            path: path.to_path_buf(),
            source,
        };
        let format_err = |reason| CryptError::KeyFileFormat {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(io_err)?;
        // fstat the open file, so the mode checked is that of the file read.
        let meta = file.metadata().map_err(io_err)?;
        if !meta.is_file() {
            return Err(format_err("not a regular file"));
        }
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(CryptError::KeyFileMode {
                path: path.to_path_buf(),
                mode,
            });
        }
        let mut content = Zeroizing::new(Vec::with_capacity(KEY_FILE_MAX as usize + 1));
        file.take(KEY_FILE_MAX + 1)
            .read_to_end(&mut content)
            .map_err(io_err)?;
        if content.len() as u64 > KEY_FILE_MAX {
            return Err(format_err("file too long: expected 64 hex digits"));
        }
        let digits = content.trim_ascii();
        if digits.len() != 2 * Self::LEN {
            return Err(format_err("expected exactly 64 hex digits"));
        }
        let mut bytes = [0u8; Self::LEN];
        let ok = hex::decode_into(digits, &mut bytes);
        let key = ClusterKey { bytes };
        bytes.zeroize();
        if !ok {
            return Err(format_err("expected exactly 64 hex digits"));
        }
        Ok(key)
    }

    /// A short public fingerprint of the key: the first 16 hex digits of
    /// SHA-256 over a domain-separation prefix and the key. A volume record
    /// stores it (inside its [`WrappedKey`](crate::WrappedKey)) to say which
    /// cluster key wrapped its volume key. It reveals nothing useful about
    /// the key.
    pub fn id(&self) -> String {
        hex::encode(&self.id_bytes())
    }

    pub(crate) fn id_bytes(&self) -> [u8; Self::ID_HEX_LEN / 2] {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(KEY_ID_DOMAIN);
        ctx.update(&self.bytes);
        let digest = ctx.finish();
        let mut id = [0u8; Self::ID_HEX_LEN / 2];
        id.copy_from_slice(&digest.as_ref()[..Self::ID_HEX_LEN / 2]);
        id
    }

    pub(crate) fn as_bytes(&self) -> &[u8; Self::LEN] {
        &self.bytes
    }

    #[cfg(test)]
    pub(crate) fn from_bytes_for_test(bytes: [u8; Self::LEN]) -> ClusterKey {
        ClusterKey { bytes }
    }
}

impl Drop for ClusterKey {
    fn drop(&mut self) {
        self.bytes.zeroize();
    }
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterKey")
            .field("id", &self.id())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn volume_key_debug_hides_bytes_and_halves_differ() {
        let k = VolumeKey::generate();
        let shown = format!("{k:?}");
        assert_eq!(shown, "VolumeKey(<secret>)");
        assert_ne!(k.data_key(), k.tweak_key());
        assert_ne!(*VolumeKey::generate().to_bytes(), *k.to_bytes());
    }

    #[test]
    fn volume_key_equal_halves_refused() {
        assert!(matches!(
            VolumeKey::from_bytes(&[7u8; 64]),
            Err(CryptError::WeakKey)
        ));
    }

    #[test]
    fn key_file_round_trip_mode_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        let k = ClusterKey::generate_file(&path).unwrap();
        assert_eq!(mode_of(&path), 0o600);
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 65);
        assert!(text.ends_with('\n'));
        assert!(text[..64].bytes().all(|c| c.is_ascii_hexdigit()));

        let loaded = ClusterKey::load(&path).unwrap();
        assert_eq!(loaded.as_bytes(), k.as_bytes());
        assert_eq!(loaded.id(), k.id());
        assert_eq!(k.id().len(), ClusterKey::ID_HEX_LEN);

        // Debug shows only the public id.
        let shown = format!("{k:?}");
        assert!(shown.contains(&k.id()));
        assert!(!shown.contains(&text[..16]));
    }

    #[test]
    fn key_file_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        let first = ClusterKey::generate_file(&path).unwrap();
        let err = ClusterKey::generate_file(&path).unwrap_err();
        assert!(matches!(err, CryptError::KeyFileExists { .. }), "{err}");
        assert_eq!(ClusterKey::load(&path).unwrap().id(), first.id());
    }

    #[test]
    fn key_file_readable_by_others_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        ClusterKey::generate_file(&path).unwrap();
        for mode in [0o640, 0o604, 0o660, 0o610, 0o601, 0o644] {
            fs::set_permissions(&path, fs::Permissions::from_mode(mode)).unwrap();
            match ClusterKey::load(&path) {
                Err(CryptError::KeyFileMode { mode: m, .. }) => assert_eq!(m, mode),
                other => panic!("mode {mode:o}: {other:?}"),
            }
        }
        fs::set_permissions(&path, fs::Permissions::from_mode(0o400)).unwrap();
        ClusterKey::load(&path).unwrap();
    }

    #[test]
    fn key_file_malformed_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        let good = "00112233445566778899aabbccddeeff00112233445566778899AABBCCDDEEFF";
        let cases: [(&str, bool); 9] = [
            (good, true),
            (&format!("{good}\n")[..], true),
            (&format!("  {good}\r\n\n")[..], true),
            (&good[..63], false),
            (&format!("{good}0")[..], false),
            (&format!("{}g", &good[..63])[..], false),
            (&format!("{} {}", &good[..32], &good[32..])[..], false),
            ("", false),
            (&"0".repeat(1000)[..], false),
        ];
        for (content, ok) in cases {
            let _ = fs::remove_file(&path);
            fs::write(&path, content).unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).unwrap();
            match ClusterKey::load(&path) {
                Ok(k) => {
                    assert!(ok, "{content:?} accepted");
                    assert_eq!(k.as_bytes()[..4], [0x00, 0x11, 0x22, 0x33]);
                    assert_eq!(k.as_bytes()[28..], [0xcc, 0xdd, 0xee, 0xff]);
                }
                Err(CryptError::KeyFileFormat { .. }) => assert!(!ok, "{content:?} refused"),
                Err(e) => panic!("{content:?}: {e}"),
            }
        }
    }

    #[test]
    fn key_file_missing_is_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = ClusterKey::load(dir.path().join("absent")).unwrap_err();
        assert!(matches!(err, CryptError::Io { .. }), "{err}");
        let err = ClusterKey::generate_file(dir.path().join("no/such/dir/key")).unwrap_err();
        assert!(matches!(err, CryptError::Io { .. }), "{err}");
    }

    #[test]
    fn key_ids_differ_and_are_stable() {
        let a = ClusterKey::from_bytes_for_test([1; 32]);
        let b = ClusterKey::from_bytes_for_test([2; 32]);
        assert_ne!(a.id(), b.id());
        assert_eq!(a.id(), ClusterKey::from_bytes_for_test([1; 32]).id());
        assert!(a.id().bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
