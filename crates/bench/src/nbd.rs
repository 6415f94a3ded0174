//! A minimal NBD client handshake: fixed newstyle, `NBD_OPT_GO`, then the
//! caller drives simple requests and replies on the returned stream (see
//! `native.rs`). Uses the constants and codecs of `shoal_nbd::codec`.

use anyhow::{bail, Context, Result};
use shoal_nbd::codec::*;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the server told about the export.
#[derive(Debug, Clone, Copy)]
pub struct Export {
    pub size: u64,
    pub flags: u16,
}

/// Connects to `addr` (`host:port`) and opens export `name`.
pub async fn connect(addr: &str, name: &str) -> Result<(TcpStream, Export)> {
    let mut s = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(addr))
        .await
        .with_context(|| format!("connecting to {addr}: timed out"))?
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    let export = tokio::time::timeout(Duration::from_secs(10), handshake(&mut s, name))
        .await
        .with_context(|| format!("NBD handshake with {addr}: timed out"))?
        .with_context(|| format!("NBD handshake with {addr} for export {name:?}"))?;
    Ok((s, export))
}

async fn handshake(s: &mut TcpStream, name: &str) -> Result<Export> {
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).await.context("reading the greeting")?;
    let hs = decode_greeting(&g).context("not a newstyle NBD server")?;
    if hs & NBD_FLAG_FIXED_NEWSTYLE == 0 {
        bail!("the server does not speak fixed newstyle NBD");
    }
    let mut cflags = NBD_FLAG_C_FIXED_NEWSTYLE;
    if hs & NBD_FLAG_NO_ZEROES != 0 {
        cflags |= NBD_FLAG_C_NO_ZEROES;
    }
    s.write_all(&cflags.to_be_bytes()).await?;
    let go = OptionRequest {
        option: NBD_OPT_GO,
        data: InfoRequest {
            name: name.to_string(),
            requests: vec![NBD_INFO_BLOCK_SIZE],
        }
        .encode()
        .into(),
    };
    s.write_all(&go.encode()).await?;
    let mut export = None;
    loop {
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        s.read_exact(&mut h)
            .await
            .context("reading an option reply")?;
        let h = OptionReplyHeader::decode(&h)?;
        if h.len as usize > 1 << 20 {
            bail!("option reply of {} bytes", h.len);
        }
        let mut data = vec![0u8; h.len as usize];
        s.read_exact(&mut data).await?;
        if h.reply_type & NBD_REP_FLAG_ERROR != 0 {
            let msg = String::from_utf8_lossy(&data);
            bail!(
                "the server refused export {name:?} (reply {:#x}){}{}",
                h.reply_type,
                if msg.is_empty() { "" } else { ": " },
                msg
            );
        }
        match h.reply_type {
            NBD_REP_INFO => {
                if let Ok(Info::Export { size, flags }) = Info::decode(&data) {
                    export = Some(Export { size, flags });
                }
            }
            NBD_REP_ACK => break,
            _ => {}
        }
    }
    export.context("the server sent no export information")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against shoal-nbd's own server would need a dev-dependency; a
    /// scripted server checks the handshake bytes instead.
    #[tokio::test]
    async fn handshake_with_a_scripted_server() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let server = tokio::spawn(async move {
            let (mut c, _) = l.accept().await.unwrap();
            c.write_all(&encode_greeting(
                NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES,
            ))
            .await
            .unwrap();
            let mut f = [0u8; 4];
            c.read_exact(&mut f).await.unwrap();
            assert_eq!(
                u32::from_be_bytes(f),
                NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES
            );
            let mut h = [0u8; OPTION_HEADER_LEN];
            c.read_exact(&mut h).await.unwrap();
            let h = OptionHeader::decode(&h).unwrap();
            assert_eq!(h.option, NBD_OPT_GO);
            let mut d = vec![0u8; h.len as usize];
            c.read_exact(&mut d).await.unwrap();
            assert_eq!(InfoRequest::decode(&d).unwrap().name, "vol");
            let info = Info::Export {
                size: 1 << 20,
                flags: NBD_FLAG_HAS_FLAGS,
            };
            c.write_all(&OptionReply::new(NBD_OPT_GO, NBD_REP_INFO, info.encode()).encode())
                .await
                .unwrap();
            c.write_all(&OptionReply::new(NBD_OPT_GO, NBD_REP_ACK, Vec::new()).encode())
                .await
                .unwrap();
        });
        let (_s, e) = connect(&addr, "vol").await.unwrap();
        assert_eq!(e.size, 1 << 20);
        server.await.unwrap();
    }
}
