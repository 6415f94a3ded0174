//! NBD wire format: constants and pure encode/decode functions.
//!
//! Everything here is synchronous and allocation-bounded: decoders take a
//! byte slice, never panic on arbitrary input and never allocate more than
//! the input they were given. All integers are big-endian (network order).

use bytes::{BufMut, Bytes, BytesMut};

// ---------------------------------------------------------------------------
// Magic numbers
// ---------------------------------------------------------------------------

/// ASCII "NBDMAGIC": first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// ASCII "IHAVEOPT": newstyle magic, also prefixes every client option.
pub const NBD_IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic prefixing every option reply (fixed newstyle).
pub const NBD_OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission-phase request.
pub const NBD_REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const NBD_SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk (not used by this server).
pub const NBD_STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---------------------------------------------------------------------------
// Handshake flags (server, 16 bits) and client flags (32 bits)
// ---------------------------------------------------------------------------

pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;

pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------------------
// Transmission flags (16 bits)
// ---------------------------------------------------------------------------

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_PEEK_EXPORT: u32 = 4;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// Option reply types.
pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// Bit set on every error reply type.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;

// NBD_REP_INFO information types.
pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------------------
// Commands, command flags, errors
// ---------------------------------------------------------------------------

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;
pub const NBD_CMD_RESIZE: u16 = 8;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

pub const NBD_OK: u32 = 0;
pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

// ---------------------------------------------------------------------------
// Sizes and limits
// ---------------------------------------------------------------------------

/// Advertised minimum block size.
pub const MIN_BLOCK_SIZE: u32 = 1;
/// Advertised preferred block size.
pub const PREFERRED_BLOCK_SIZE: u32 = 4096;
/// Advertised maximum block size; also the largest READ/WRITE payload accepted.
pub const MAX_BLOCK_SIZE: u32 = 32 * 1024 * 1024;
/// Longest string (export name, message) the protocol allows.
pub const MAX_STRING_LEN: usize = 4096;

pub const GREETING_LEN: usize = 18;
pub const OPTION_HEADER_LEN: usize = 16;
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
pub const REQUEST_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Size of the NBD_OPT_EXPORT_NAME reply without / with the 124 zero bytes.
pub const EXPORT_NAME_REPLY_SHORT_LEN: usize = 10;
pub const EXPORT_NAME_REPLY_LONG_LEN: usize = 134;

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Why a byte sequence could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("truncated: need {need} bytes, have {have}")]
    Truncated { need: usize, have: usize },
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("inconsistent length field")]
    BadLength,
    #[error("string is not valid UTF-8")]
    InvalidUtf8,
    #[error("string longer than {MAX_STRING_LEN} bytes")]
    StringTooLong,
}

fn need(buf: &[u8], n: usize) -> Result<(), DecodeError> {
    if buf.len() < n {
        Err(DecodeError::Truncated {
            need: n,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn string(b: &[u8]) -> Result<String, DecodeError> {
    if b.len() > MAX_STRING_LEN {
        return Err(DecodeError::StringTooLong);
    }
    String::from_utf8(b.to_vec()).map_err(|_| DecodeError::InvalidUtf8)
}

/// Truncate `s` to at most [`MAX_STRING_LEN`] bytes on a char boundary.
pub fn clamp_string(s: &str) -> &str {
    if s.len() <= MAX_STRING_LEN {
        return s;
    }
    let mut end = MAX_STRING_LEN;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

// ---------------------------------------------------------------------------
// Handshake
// ---------------------------------------------------------------------------

/// Server greeting: NBDMAGIC, IHAVEOPT, 16-bit handshake flags.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut out = [0u8; GREETING_LEN];
    out[..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&NBD_IHAVEOPT.to_be_bytes());
    out[16..].copy_from_slice(&handshake_flags.to_be_bytes());
    out
}

/// Decode a newstyle greeting, returning the handshake flags.
pub fn decode_greeting(buf: &[u8]) -> Result<u16, DecodeError> {
    need(buf, GREETING_LEN)?;
    let m = be64(buf, 0);
    if m != NBD_MAGIC {
        return Err(DecodeError::BadMagic(m));
    }
    let m = be64(buf, 8);
    if m != NBD_IHAVEOPT {
        return Err(DecodeError::BadMagic(m));
    }
    Ok(be16(buf, 16))
}

/// Reply to NBD_OPT_EXPORT_NAME: size, transmission flags (and 124 zero
/// bytes unless NO_ZEROES was negotiated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportNameReply {
    pub size: u64,
    pub flags: u16,
}

impl ExportNameReply {
    pub fn encode(&self, no_zeroes: bool) -> Vec<u8> {
        let len = if no_zeroes {
            EXPORT_NAME_REPLY_SHORT_LEN
        } else {
            EXPORT_NAME_REPLY_LONG_LEN
        };
        let mut out = vec![0u8; len];
        out[..8].copy_from_slice(&self.size.to_be_bytes());
        out[8..10].copy_from_slice(&self.flags.to_be_bytes());
        out
    }

    /// Decodes the first 10 bytes (zero padding, if any, is the caller's business).
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, EXPORT_NAME_REPLY_SHORT_LEN)?;
        Ok(Self {
            size: be64(buf, 0),
            flags: be16(buf, 8),
        })
    }
}

// ---------------------------------------------------------------------------
// Options (client -> server)
// ---------------------------------------------------------------------------

/// Header of a client option: IHAVEOPT, option, data length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

impl OptionHeader {
    pub fn encode(&self) -> [u8; OPTION_HEADER_LEN] {
        let mut out = [0u8; OPTION_HEADER_LEN];
        out[..8].copy_from_slice(&NBD_IHAVEOPT.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..].copy_from_slice(&self.len.to_be_bytes());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, OPTION_HEADER_LEN)?;
        let m = be64(buf, 0);
        if m != NBD_IHAVEOPT {
            return Err(DecodeError::BadMagic(m));
        }
        Ok(Self {
            option: be32(buf, 8),
            len: be32(buf, 12),
        })
    }
}

/// A complete client option (header + data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionRequest {
    pub option: u32,
    pub data: Bytes,
}

impl OptionRequest {
    pub fn encode(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(OPTION_HEADER_LEN + self.data.len());
        out.put_slice(
            &OptionHeader {
                option: self.option,
                len: self.data.len() as u32,
            }
            .encode(),
        );
        out.put_slice(&self.data);
        out.freeze()
    }

    /// Decode one option from the front of `buf`; returns it and the bytes consumed.
    pub fn decode(buf: &[u8]) -> Result<(Self, usize), DecodeError> {
        let h = OptionHeader::decode(buf)?;
        let total = OPTION_HEADER_LEN + h.len as usize;
        need(buf, total)?;
        Ok((
            Self {
                option: h.option,
                data: Bytes::copy_from_slice(&buf[OPTION_HEADER_LEN..total]),
            },
            total,
        ))
    }
}

/// Data of NBD_OPT_INFO / NBD_OPT_GO: export name and requested info types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

impl InfoRequest {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(6 + self.name.len() + 2 * self.requests.len());
        out.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(&(self.requests.len() as u16).to_be_bytes());
        for r in &self.requests {
            out.extend_from_slice(&r.to_be_bytes());
        }
        out
    }

    /// Decode the option data; the lengths must account for exactly `buf.len()` bytes.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, 6)?;
        let name_len = be32(buf, 0) as usize;
        if name_len > buf.len() - 6 {
            return Err(DecodeError::BadLength);
        }
        let name = string(&buf[4..4 + name_len])?;
        let rest = &buf[4 + name_len..];
        let n = be16(rest, 0) as usize;
        if rest.len() != 2 + 2 * n {
            return Err(DecodeError::BadLength);
        }
        let requests = (0..n).map(|i| be16(rest, 2 + 2 * i)).collect();
        Ok(Self { name, requests })
    }
}

// ---------------------------------------------------------------------------
// Option replies (server -> client)
// ---------------------------------------------------------------------------

/// Header of an option reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub len: u32,
}

impl OptionReplyHeader {
    pub fn encode(&self) -> [u8; OPTION_REPLY_HEADER_LEN] {
        let mut out = [0u8; OPTION_REPLY_HEADER_LEN];
        out[..8].copy_from_slice(&NBD_OPT_REPLY_MAGIC.to_be_bytes());
        out[8..12].copy_from_slice(&self.option.to_be_bytes());
        out[12..16].copy_from_slice(&self.reply_type.to_be_bytes());
        out[16..].copy_from_slice(&self.len.to_be_bytes());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, OPTION_REPLY_HEADER_LEN)?;
        let m = be64(buf, 0);
        if m != NBD_OPT_REPLY_MAGIC {
            return Err(DecodeError::BadMagic(m));
        }
        Ok(Self {
            option: be32(buf, 8),
            reply_type: be32(buf, 12),
            len: be32(buf, 16),
        })
    }
}

/// A complete option reply (header + data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Bytes,
}

impl OptionReply {
    pub fn new(option: u32, reply_type: u32, data: impl Into<Bytes>) -> Self {
        Self {
            option,
            reply_type,
            data: data.into(),
        }
    }

    /// Error reply carrying a human-readable message (clamped to 4096 bytes).
    pub fn error(option: u32, reply_type: u32, message: &str) -> Self {
        Self::new(
            option,
            reply_type,
            Bytes::copy_from_slice(clamp_string(message).as_bytes()),
        )
    }

    pub fn is_error(&self) -> bool {
        self.reply_type & NBD_REP_FLAG_ERROR != 0
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(OPTION_REPLY_HEADER_LEN + self.data.len());
        out.extend_from_slice(
            &OptionReplyHeader {
                option: self.option,
                reply_type: self.reply_type,
                len: self.data.len() as u32,
            }
            .encode(),
        );
        out.extend_from_slice(&self.data);
        out
    }

    /// Decode one reply from the front of `buf`; returns it and the bytes consumed.
    pub fn decode(buf: &[u8]) -> Result<(Self, usize), DecodeError> {
        let h = OptionReplyHeader::decode(buf)?;
        let total = OPTION_REPLY_HEADER_LEN + h.len as usize;
        need(buf, total)?;
        Ok((
            Self {
                option: h.option,
                reply_type: h.reply_type,
                data: Bytes::copy_from_slice(&buf[OPTION_REPLY_HEADER_LEN..total]),
            },
            total,
        ))
    }
}

/// Payload of NBD_REP_SERVER (one NBD_OPT_LIST entry).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerEntry {
    pub name: String,
    /// Implementation-specific, human-readable details (may be empty).
    pub details: String,
}

impl ServerEntry {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.name.len() + self.details.len());
        out.extend_from_slice(&(self.name.len() as u32).to_be_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.extend_from_slice(self.details.as_bytes());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, 4)?;
        let n = be32(buf, 0) as usize;
        if n > buf.len() - 4 {
            return Err(DecodeError::BadLength);
        }
        Ok(Self {
            name: string(&buf[4..4 + n])?,
            details: string(&buf[4 + n..])?,
        })
    }
}

/// Payload of NBD_REP_INFO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    Export { size: u64, flags: u16 },
    Name(String),
    Description(String),
    BlockSize { min: u32, preferred: u32, max: u32 },
    Unknown { info_type: u16, data: Bytes },
}

impl Info {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Info::Export { size, flags } => {
                out.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
                out.extend_from_slice(&size.to_be_bytes());
                out.extend_from_slice(&flags.to_be_bytes());
            }
            Info::Name(s) => {
                out.extend_from_slice(&NBD_INFO_NAME.to_be_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            Info::Description(s) => {
                out.extend_from_slice(&NBD_INFO_DESCRIPTION.to_be_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            Info::BlockSize {
                min,
                preferred,
                max,
            } => {
                out.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
                out.extend_from_slice(&min.to_be_bytes());
                out.extend_from_slice(&preferred.to_be_bytes());
                out.extend_from_slice(&max.to_be_bytes());
            }
            Info::Unknown { info_type, data } => {
                out.extend_from_slice(&info_type.to_be_bytes());
                out.extend_from_slice(data);
            }
        }
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, 2)?;
        let t = be16(buf, 0);
        let body = &buf[2..];
        match t {
            NBD_INFO_EXPORT => {
                if body.len() != 10 {
                    return Err(DecodeError::BadLength);
                }
                Ok(Info::Export {
                    size: be64(body, 0),
                    flags: be16(body, 8),
                })
            }
            NBD_INFO_NAME => Ok(Info::Name(string(body)?)),
            NBD_INFO_DESCRIPTION => Ok(Info::Description(string(body)?)),
            NBD_INFO_BLOCK_SIZE => {
                if body.len() != 12 {
                    return Err(DecodeError::BadLength);
                }
                Ok(Info::BlockSize {
                    min: be32(body, 0),
                    preferred: be32(body, 4),
                    max: be32(body, 8),
                })
            }
            _ => Ok(Info::Unknown {
                info_type: t,
                data: Bytes::copy_from_slice(body),
            }),
        }
    }
}

// ---------------------------------------------------------------------------
// Transmission phase
// ---------------------------------------------------------------------------

/// Request type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    /// Any other value (never one of the above codes).
    Other(u16),
}

impl From<u16> for Command {
    fn from(v: u16) -> Self {
        match v {
            NBD_CMD_READ => Command::Read,
            NBD_CMD_WRITE => Command::Write,
            NBD_CMD_DISC => Command::Disc,
            NBD_CMD_FLUSH => Command::Flush,
            NBD_CMD_TRIM => Command::Trim,
            NBD_CMD_CACHE => Command::Cache,
            NBD_CMD_WRITE_ZEROES => Command::WriteZeroes,
            NBD_CMD_BLOCK_STATUS => Command::BlockStatus,
            other => Command::Other(other),
        }
    }
}

impl From<Command> for u16 {
    fn from(c: Command) -> u16 {
        match c {
            Command::Read => NBD_CMD_READ,
            Command::Write => NBD_CMD_WRITE,
            Command::Disc => NBD_CMD_DISC,
            Command::Flush => NBD_CMD_FLUSH,
            Command::Trim => NBD_CMD_TRIM,
            Command::Cache => NBD_CMD_CACHE,
            Command::WriteZeroes => NBD_CMD_WRITE_ZEROES,
            Command::BlockStatus => NBD_CMD_BLOCK_STATUS,
            Command::Other(v) => v,
        }
    }
}

/// Transmission-phase request header (the WRITE payload follows separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    /// Opaque handle (a.k.a. cookie), echoed in the reply.
    pub handle: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut out = [0u8; REQUEST_LEN];
        out[..4].copy_from_slice(&NBD_REQUEST_MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&self.flags.to_be_bytes());
        out[6..8].copy_from_slice(&u16::from(self.command).to_be_bytes());
        out[8..16].copy_from_slice(&self.handle.to_be_bytes());
        out[16..24].copy_from_slice(&self.offset.to_be_bytes());
        out[24..].copy_from_slice(&self.len.to_be_bytes());
        out
    }

    /// Decode the first [`REQUEST_LEN`] bytes of `buf`.
    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, REQUEST_LEN)?;
        let m = be32(buf, 0);
        if m != NBD_REQUEST_MAGIC {
            return Err(DecodeError::BadMagic(m as u64));
        }
        Ok(Self {
            flags: be16(buf, 4),
            command: Command::from(be16(buf, 6)),
            handle: be64(buf, 8),
            offset: be64(buf, 16),
            len: be32(buf, 24),
        })
    }
}

/// Simple reply header (a READ's data follows it on success).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    pub error: u32,
    pub handle: u64,
}

impl SimpleReply {
    pub fn encode(&self) -> [u8; SIMPLE_REPLY_LEN] {
        let mut out = [0u8; SIMPLE_REPLY_LEN];
        out[..4].copy_from_slice(&NBD_SIMPLE_REPLY_MAGIC.to_be_bytes());
        out[4..8].copy_from_slice(&self.error.to_be_bytes());
        out[8..].copy_from_slice(&self.handle.to_be_bytes());
        out
    }

    pub fn decode(buf: &[u8]) -> Result<Self, DecodeError> {
        need(buf, SIMPLE_REPLY_LEN)?;
        let m = be32(buf, 0);
        if m != NBD_SIMPLE_REPLY_MAGIC {
            return Err(DecodeError::BadMagic(m as u64));
        }
        Ok(Self {
            error: be32(buf, 4),
            handle: be64(buf, 8),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn short_string() -> impl Strategy<Value = String> {
        proptest::string::string_regex("[^\u{0}]{0,40}").unwrap()
    }

    fn info() -> impl Strategy<Value = Info> {
        prop_oneof![
            (any::<u64>(), any::<u16>()).prop_map(|(size, flags)| Info::Export { size, flags }),
            short_string().prop_map(Info::Name),
            short_string().prop_map(Info::Description),
            (any::<u32>(), any::<u32>(), any::<u32>()).prop_map(|(min, preferred, max)| {
                Info::BlockSize {
                    min,
                    preferred,
                    max,
                }
            }),
            (4u16.., proptest::collection::vec(any::<u8>(), 0..32)).prop_map(|(t, d)| {
                Info::Unknown {
                    info_type: t,
                    data: Bytes::from(d),
                }
            }),
        ]
    }

    proptest! {
        #[test]
        fn request_roundtrip(flags: u16, cmd: u16, handle: u64, offset: u64, len: u32) {
            let r = Request { flags, command: Command::from(cmd), handle, offset, len };
            let enc = r.encode();
            prop_assert_eq!(Request::decode(&enc).unwrap(), r);
            prop_assert_eq!(u16::from(r.command), cmd);
        }

        #[test]
        fn simple_reply_roundtrip(error: u32, handle: u64) {
            let r = SimpleReply { error, handle };
            prop_assert_eq!(SimpleReply::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn option_roundtrip(option: u32, data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let o = OptionRequest { option, data: Bytes::from(data) };
            let enc = o.encode();
            let (dec, used) = OptionRequest::decode(&enc).unwrap();
            prop_assert_eq!(used, enc.len());
            prop_assert_eq!(dec, o);
        }

        #[test]
        fn option_reply_roundtrip(option: u32, reply_type: u32, data in proptest::collection::vec(any::<u8>(), 0..256)) {
            let o = OptionReply::new(option, reply_type, data);
            let enc = o.encode();
            let (dec, used) = OptionReply::decode(&enc).unwrap();
            prop_assert_eq!(used, enc.len());
            prop_assert_eq!(dec, o);
        }

        #[test]
        fn info_request_roundtrip(name in short_string(), requests in proptest::collection::vec(any::<u16>(), 0..16)) {
            let r = InfoRequest { name, requests };
            prop_assert_eq!(InfoRequest::decode(&r.encode()).unwrap(), r);
        }

        #[test]
        fn info_roundtrip(i in info()) {
            prop_assert_eq!(Info::decode(&i.encode()).unwrap(), i);
        }

        #[test]
        fn server_entry_roundtrip(name in short_string(), details in short_string()) {
            let e = ServerEntry { name, details };
            prop_assert_eq!(ServerEntry::decode(&e.encode()).unwrap(), e);
        }

        #[test]
        fn greeting_and_export_reply_roundtrip(hf: u16, size: u64, flags: u16, nz: bool) {
            prop_assert_eq!(decode_greeting(&encode_greeting(hf)).unwrap(), hf);
            let r = ExportNameReply { size, flags };
            let enc = r.encode(nz);
            prop_assert_eq!(enc.len(), if nz { 10 } else { 134 });
            prop_assert_eq!(ExportNameReply::decode(&enc).unwrap(), r);
        }

        #[test]
        fn option_header_roundtrip(option: u32, len: u32) {
            let h = OptionHeader { option, len };
            prop_assert_eq!(OptionHeader::decode(&h.encode()).unwrap(), h);
            let rh = OptionReplyHeader { option, reply_type: len, len: option };
            prop_assert_eq!(OptionReplyHeader::decode(&rh.encode()).unwrap(), rh);
        }

        #[test]
        fn decoders_never_panic(buf in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = decode_greeting(&buf);
            let _ = ExportNameReply::decode(&buf);
            let _ = OptionHeader::decode(&buf);
            let _ = OptionRequest::decode(&buf);
            let _ = InfoRequest::decode(&buf);
            let _ = OptionReplyHeader::decode(&buf);
            let _ = OptionReply::decode(&buf);
            let _ = ServerEntry::decode(&buf);
            let _ = Info::decode(&buf);
            let _ = Request::decode(&buf);
            let _ = SimpleReply::decode(&buf);
        }

        #[test]
        fn decoders_never_panic_with_valid_magic(tail in proptest::collection::vec(any::<u8>(), 0..64)) {
            // Prefix valid magics so the decoders get past the magic checks.
            for magic in [NBD_IHAVEOPT.to_be_bytes().to_vec(), NBD_OPT_REPLY_MAGIC.to_be_bytes().to_vec(),
                          NBD_REQUEST_MAGIC.to_be_bytes().to_vec(), NBD_SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec()] {
                let mut buf = magic;
                buf.extend_from_slice(&tail);
                let _ = OptionHeader::decode(&buf);
                let _ = OptionRequest::decode(&buf);
                let _ = OptionReplyHeader::decode(&buf);
                let _ = OptionReply::decode(&buf);
                let _ = Request::decode(&buf);
                let _ = SimpleReply::decode(&buf);
            }
        }
    }

    #[test]
    fn constants_match_spec() {
        assert_eq!(&NBD_MAGIC.to_be_bytes(), b"NBDMAGIC");
        assert_eq!(&NBD_IHAVEOPT.to_be_bytes(), b"IHAVEOPT");
        assert_eq!(NBD_REP_ERR_UNKNOWN, 0x8000_0006);
        assert_eq!(NBD_REP_ERR_TOO_BIG, 0x8000_0009);
    }

    #[test]
    fn info_request_rejects_bad_lengths() {
        // name length larger than the data
        let mut d = InfoRequest {
            name: "abc".into(),
            requests: vec![1],
        }
        .encode();
        d[3] = 200;
        assert_eq!(InfoRequest::decode(&d), Err(DecodeError::BadLength));
        // trailing garbage
        let mut d = InfoRequest {
            name: "abc".into(),
            requests: vec![],
        }
        .encode();
        d.push(0);
        assert_eq!(InfoRequest::decode(&d), Err(DecodeError::BadLength));
    }

    #[test]
    fn clamp_string_respects_char_boundaries() {
        let s = "é".repeat(3000); // 6000 bytes
        let c = clamp_string(&s);
        assert!(c.len() <= MAX_STRING_LEN);
        assert!(c.len() >= MAX_STRING_LEN - 1);
    }
}
