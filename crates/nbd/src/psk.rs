//! TLS with pre-shared keys (TLS-PSK, RFC 8446 external PSKs) for NBD
//! clients that have a key instead of a certificate: qemu's
//! `tls-creds-psk` and libnbd's `tls-psk-file`, both GnuTLS.
//!
//! rustls has no external pre-shared keys, so this side of the server
//! runs on the system's OpenSSL 3.
//!
//! * [`PskKeys`]: the keys of a key file in GnuTLS psktool's format, one
//!   `identity:hexkey` a line, read once and checked strictly.
//! * [`PskConfig`]: the OpenSSL server context that accepts exactly those
//!   identities with their keys (TLS 1.3, (EC)DHE with the PSK, so a
//!   stolen key does not open recorded sessions).
//! * The handshake on an accepted connection, which names the client's
//!   identity on success, or says which identity failed.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use openssl::ssl::{
    Ssl, SslAcceptor, SslContext, SslMethod, SslOptions, SslSessionCacheMode, SslVerifyMode,
    SslVersion,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;
use zeroize::Zeroizing;

use crate::NbdError;

/// Largest key file read, bytes: thousands of identities.
pub const MAX_FILE_LEN: u64 = 1 << 20;
/// Shortest key accepted, bytes (128 bits; psktool makes 32 bytes).
pub const MIN_KEY_LEN: usize = 16;
/// Longest key accepted, bytes (OpenSSL's PSK_MAX_PSK_LEN).
pub const MAX_KEY_LEN: usize = 512;
/// Longest identity accepted, bytes (OpenSSL's PSK_MAX_IDENTITY_LEN).
pub const MAX_IDENTITY_LEN: usize = 256;

/// TLS 1.3 suites offered: the legacy PSK callback's key is bound to
/// SHA-256 (OpenSSL gives it to TLS_AES_128_GCM_SHA256), so a suite of
/// another hash could not use it.
const CIPHERSUITES: &str = "TLS_AES_128_GCM_SHA256:TLS_CHACHA20_POLY1305_SHA256";

/// Why a key file was refused.
#[derive(Debug, thiserror::Error)]
pub enum PskError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a regular file")]
    NotAFile { path: PathBuf },
    /// Like ssh with a private key: a key file others may read (or
    /// change) is refused, not used.
    #[error(
        "{path}: mode {mode:04o} lets group or others at the pre-shared keys; \
         it must be readable by its owner only (chmod 600 {path})"
    )]
    Mode { path: PathBuf, mode: u32 },
    #[error("{path}: larger than {MAX_FILE_LEN} bytes: not a key file")]
    TooLarge { path: PathBuf },
    /// `line` counts from 1.
    #[error("{path}: line {line}: {problem}")]
    Line {
        path: PathBuf,
        line: usize,
        problem: LineProblem,
    },
    #[error("{path}: no key in the file (a line is IDENTITY:HEXKEY, as psktool writes)")]
    Empty { path: PathBuf },
    /// OpenSSL refused the server settings (it should not).
    #[error("TLS-PSK server settings: {0}")]
    Tls(String),
}

/// What is wrong with one line of a key file. Never shows a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineProblem {
    #[error("expected IDENTITY:HEXKEY (no ':' on the line)")]
    NoColon,
    #[error("the identity is empty")]
    EmptyIdentity,
    #[error("the identity is longer than {MAX_IDENTITY_LEN} bytes")]
    IdentityTooLong,
    #[error("the identity has a control character (or, as #HEX, a zero byte)")]
    IdentityControl,
    #[error("the identity starts or ends with a space")]
    IdentitySpace,
    #[error("the identity {0:?}, as #HEX, is not hexadecimal")]
    IdentityHex(String),
    #[error("the identity {0:?} is given twice")]
    Duplicate(String),
    #[error("the key is empty")]
    EmptyKey,
    #[error("the key has an odd number of hex digits")]
    OddKey,
    #[error("the key is not hexadecimal")]
    KeyNotHex,
    #[error("the key is {0} bytes; at least {MIN_KEY_LEN} are needed (psktool makes 32)")]
    KeyTooShort(usize),
    #[error("the key is {0} bytes; at most {MAX_KEY_LEN} are taken")]
    KeyTooLong(usize),
}

/// Identities and their keys, from a key file in GnuTLS psktool's format.
///
/// The format: one `IDENTITY:HEXKEY` a line; the identity is everything
/// before the first `:`, or, written `#HEX`, the bytes of those hex
/// digits (GnuTLS's form for identities with odd characters). Blank lines
/// are skipped, a `\r` before the newline is dropped; anything else that
/// is not a well-formed line refuses the whole file. Keys are kept in
/// memory that is wiped when dropped.
#[derive(Clone, Default)]
pub struct PskKeys {
    keys: BTreeMap<Vec<u8>, Zeroizing<Vec<u8>>>,
}

impl fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PskKeys")
            .field("identities", &self.identities())
            .finish_non_exhaustive()
    }
}

impl PskKeys {
    /// Reads and checks the key file at `path`: a regular file, at most
    /// [`MAX_FILE_LEN`] bytes, no access for group or others, at least one
    /// key and every line well-formed.
    pub fn load(path: impl AsRef<Path>) -> Result<PskKeys, PskError> {
        let path = path.as_ref();
        let io = |source| PskError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // fstat the open file: the mode checked is that of the file read.
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(PskError::NotAFile {
                path: path.to_path_buf(),
            });
        }
        let mode = meta.permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(PskError::Mode {
                path: path.to_path_buf(),
                mode,
            });
        }
        let mut text = Zeroizing::new(Vec::new());
        file.take(MAX_FILE_LEN + 1)
            .read_to_end(&mut text)
            .map_err(io)?;
        if text.len() as u64 > MAX_FILE_LEN {
            return Err(PskError::TooLarge {
                path: path.to_path_buf(),
            });
        }
        let keys = Self::parse(&text).map_err(|(line, problem)| PskError::Line {
            path: path.to_path_buf(),
            line,
            problem,
        })?;
        if keys.is_empty() {
            return Err(PskError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(keys)
    }

    /// Parses a key file's content; Err names the first bad line (from 1).
    /// An empty content gives no keys ([`PskKeys::load`] refuses that).
    pub fn parse(text: &[u8]) -> Result<PskKeys, (usize, LineProblem)> {
        let mut keys = BTreeMap::new();
        for (i, line) in text.split(|&b| b == b'\n').enumerate() {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let (identity, key) = parse_line(line).map_err(|p| (i + 1, p))?;
            if keys.contains_key(&identity) {
                return Err((i + 1, LineProblem::Duplicate(show(&identity))));
            }
            keys.insert(identity, key);
        }
        Ok(PskKeys { keys })
    }

    /// Identities, sorted, as the logs show them.
    pub fn identities(&self) -> Vec<String> {
        self.keys.keys().map(|i| show(i)).collect()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn key(&self, identity: &[u8]) -> Option<&[u8]> {
        self.keys.get(identity).map(|k| k.as_slice())
    }
}

/// One non-blank line: the identity and the key.
fn parse_line(line: &[u8]) -> Result<(Vec<u8>, Zeroizing<Vec<u8>>), LineProblem> {
    let colon = line
        .iter()
        .position(|&b| b == b':')
        .ok_or(LineProblem::NoColon)?;
    let (name, hexkey) = (&line[..colon], &line[colon + 1..]);
    let identity = match name.strip_prefix(b"#") {
        Some(hex) if !hex.is_empty() => {
            let id = unhex(hex).ok_or_else(|| LineProblem::IdentityHex(show(name)))?;
            if id.contains(&0) {
                return Err(LineProblem::IdentityControl);
            }
            id.to_vec()
        }
        _ => {
            if name.iter().any(u8::is_ascii_control) {
                return Err(LineProblem::IdentityControl);
            }
            if name.first() == Some(&b' ') || name.last() == Some(&b' ') {
                return Err(LineProblem::IdentitySpace);
            }
            name.to_vec()
        }
    };
    if identity.is_empty() {
        return Err(LineProblem::EmptyIdentity);
    }
    if identity.len() > MAX_IDENTITY_LEN {
        return Err(LineProblem::IdentityTooLong);
    }
    // A space or tab after the key (GnuTLS drops one trailing space).
    let hexkey = hexkey.trim_ascii_end();
    if hexkey.is_empty() {
        return Err(LineProblem::EmptyKey);
    }
    if !hexkey.len().is_multiple_of(2) {
        return Err(LineProblem::OddKey);
    }
    if hexkey.len() / 2 > MAX_KEY_LEN {
        return Err(LineProblem::KeyTooLong(hexkey.len() / 2));
    }
    let key = unhex(hexkey).ok_or(LineProblem::KeyNotHex)?;
    if key.len() < MIN_KEY_LEN {
        return Err(LineProblem::KeyTooShort(key.len()));
    }
    Ok((identity, key))
}

/// The bytes of an even number of hex digits (either case), or None;
/// in memory wiped when dropped (no copy left by a growing vector).
fn unhex(hex: &[u8]) -> Option<Zeroizing<Vec<u8>>> {
    fn digit(c: u8) -> Option<u8> {
        (c as char).to_digit(16).map(|d| d as u8)
    }
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    let mut out = Zeroizing::new(Vec::with_capacity(hex.len() / 2));
    for p in hex.chunks_exact(2) {
        out.push(digit(p[0])? << 4 | digit(p[1])?);
    }
    Some(out)
}

/// An identity as logs and errors show it: text, with anything odd
/// escaped, at most [`MAX_IDENTITY_LEN`] bytes of it.
fn show(identity: &[u8]) -> String {
    let cut = &identity[..identity.len().min(MAX_IDENTITY_LEN)];
    String::from_utf8_lossy(cut).escape_debug().to_string()
}

/// The identity a client presented on one connection, kept on its
/// `Ssl` by the PSK callback for the logs.
#[derive(Debug, Clone)]
enum Presented {
    Known(String),
    Unknown(String),
}

/// The `Ssl` slot of [`Presented`] (one for the process).
fn presented_index() -> Result<openssl::ex_data::Index<Ssl, Presented>, PskError> {
    static INDEX: OnceLock<Result<openssl::ex_data::Index<Ssl, Presented>, String>> =
        OnceLock::new();
    INDEX
        .get_or_init(|| Ssl::new_ex_index().map_err(|e| e.to_string()))
        .clone()
        .map_err(PskError::Tls)
}

/// A TLS-PSK server: accepts the identities of a [`PskKeys`] with their
/// keys, and nothing else (it has no certificate: a client without a
/// known identity and its key cannot finish the handshake).
#[derive(Clone)]
pub struct PskConfig {
    context: SslContext,
    identities: usize,
}

impl fmt::Debug for PskConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PskConfig")
            .field("identities", &self.identities)
            .finish_non_exhaustive()
    }
}

impl PskConfig {
    /// The server settings for `keys`: TLS 1.3 only, with (EC)DHE (a
    /// recorded session stays closed to whoever later learns the key), no
    /// session tickets (no resumption: every connection proves the key).
    pub fn new(keys: PskKeys) -> Result<PskConfig, PskError> {
        let tls = |e: openssl::error::ErrorStack| PskError::Tls(e.to_string());
        let index = presented_index()?;
        let identities = keys.len();
        // Mozilla's "modern" server settings (TLS 1.3 only; the modes of
        // a non-blocking stream), narrowed below.
        let mut b = SslAcceptor::mozilla_modern_v5(SslMethod::tls_server()).map_err(tls)?;
        b.set_max_proto_version(Some(SslVersion::TLS1_3))
            .map_err(tls)?;
        b.set_ciphersuites(CIPHERSUITES).map_err(tls)?;
        b.set_num_tickets(0).map_err(tls)?;
        b.set_session_cache_mode(SslSessionCacheMode::OFF);
        b.set_options(SslOptions::NO_TICKET | SslOptions::CIPHER_SERVER_PREFERENCE);
        b.set_verify(SslVerifyMode::NONE);
        // Read what the socket holds at once, not a record header then
        // its body (two system calls a record). Nothing but TLS follows
        // on the connection once the handshake starts.
        b.set_read_ahead(true);
        let keys = Arc::new(keys);
        b.set_psk_server_callback(move |ssl, identity, out| {
            let identity = identity.unwrap_or_default();
            match keys.key(identity) {
                Some(key) if key.len() <= out.len() => {
                    out[..key.len()].copy_from_slice(key);
                    ssl.set_ex_data(index, Presented::Known(show(identity)));
                    Ok(key.len())
                }
                _ => {
                    // 0: no key; OpenSSL then fails the handshake (there
                    // is no certificate to fall back to).
                    ssl.set_ex_data(index, Presented::Unknown(show(identity)));
                    Ok(0)
                }
            }
        });
        Ok(PskConfig {
            context: b.build().into_context(),
            identities,
        })
    }

    /// Number of identities accepted.
    pub fn identities(&self) -> usize {
        self.identities
    }

    /// The server handshake on `stream`, after NBD_REP_ACK was sent to
    /// NBD_OPT_STARTTLS: the TLS stream and the client's identity.
    pub(crate) async fn accept<S>(&self, stream: S) -> Result<(SslStream<S>, String), NbdError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let tls = |e: openssl::error::ErrorStack| NbdError::Tls(e.to_string());
        let index = presented_index().map_err(|e| NbdError::Tls(e.to_string()))?;
        let ssl = Ssl::new(&self.context).map_err(tls)?;
        let mut s = SslStream::new(ssl, stream).map_err(tls)?;
        let result = Pin::new(&mut s).accept().await;
        let presented = s.ssl().ex_data(index).cloned();
        match (result, presented) {
            (Ok(()), Some(Presented::Known(identity))) => Ok((s, identity)),
            (Ok(()), _) => Err(NbdError::Tls(
                "TLS-PSK handshake ended without a pre-shared key".to_string(),
            )),
            (Err(e), Some(Presented::Unknown(identity))) => Err(NbdError::Tls(format!(
                "unknown TLS-PSK identity \"{identity}\": {e}"
            ))),
            (Err(e), Some(Presented::Known(identity))) => Err(NbdError::Tls(format!(
                "TLS-PSK identity \"{identity}\" (wrong key?): {e}"
            ))),
            (Err(e), None) => Err(NbdError::Tls(format!("no TLS-PSK identity presented: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests;
