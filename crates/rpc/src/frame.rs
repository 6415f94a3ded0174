//! The fixed frame header.

/// "SHRP" read as little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"SHRP");
/// Wire version; a peer refuses frames of another version.
pub const VERSION: u16 = 4;
/// Header size in bytes.
pub const HEADER_LEN: usize = 32;
/// Largest body accepted, in bytes: bodies are small typed messages.
pub const MAX_BODY: u32 = 1 << 20;
/// Largest payload accepted, in bytes: the NBD maximum request (32 MiB)
/// plus room for internal copies.
pub const MAX_PAYLOAD: u32 = 64 << 20;

/// Bit of `flags`: this frame is a reply.
pub const FLAG_REPLY: u16 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub flags: u16,
    pub id: u64,
    pub body_len: u32,
    pub payload_len: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic {0:#x}")]
    Magic(u32),
    #[error("unsupported wire version {0} (this node speaks {VERSION})")]
    Version(u16),
    #[error("body of {0} bytes exceeds the limit")]
    BodyTooLarge(u32),
    #[error("payload of {0} bytes exceeds the limit")]
    PayloadTooLarge(u32),
}

impl Header {
    pub fn is_reply(&self) -> bool {
        self.flags & FLAG_REPLY != 0
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        b[20..24].copy_from_slice(&self.payload_len.to_le_bytes());
        // 24..32 reserved, zero.
        b
    }

    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, FrameError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(FrameError::Magic(magic));
        }
        let version = u16_at(4);
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[8..16]);
        let h = Header {
            flags: u16_at(6),
            id: u64::from_le_bytes(id),
            body_len: u32_at(16),
            payload_len: u32_at(20),
        };
        if h.body_len > MAX_BODY {
            return Err(FrameError::BodyTooLarge(h.body_len));
        }
        if h.payload_len > MAX_PAYLOAD {
            return Err(FrameError::PayloadTooLarge(h.payload_len));
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn header_round_trips(flags: u16, id: u64, body in 0..=MAX_BODY, payload in 0..=MAX_PAYLOAD) {
            let h = Header { flags, id, body_len: body, payload_len: payload };
            prop_assert_eq!(Header::decode(&h.encode()), Ok(h));
        }

        #[test]
        fn random_bytes_never_panic(bytes in proptest::array::uniform32(any::<u8>())) {
            let _ = Header::decode(&bytes);
        }
    }

    #[test]
    fn limits_are_enforced() {
        let mut b = Header {
            flags: 0,
            id: 1,
            body_len: MAX_BODY + 1,
            payload_len: 0,
        }
        .encode();
        assert_eq!(
            Header::decode(&b),
            Err(FrameError::BodyTooLarge(MAX_BODY + 1))
        );
        b[4] = 9;
        assert_eq!(Header::decode(&b), Err(FrameError::Version(9)));
        b[0] = 0;
        assert!(matches!(Header::decode(&b), Err(FrameError::Magic(_))));
    }
}
