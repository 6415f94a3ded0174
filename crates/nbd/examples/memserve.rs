//! Serve one in-memory export named `mem`.
//!
//! `cargo run -p shoal-nbd --example memserve -- 127.0.0.1:10899 64M`

use std::sync::Arc;

use shoal_nbd::mem::MemExports;
use shoal_nbd::NbdTls;

fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], 1usize << 10),
        (i, 'm' | 'M') => (&s[..i], 1 << 20),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mult)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let addr = args.next().unwrap_or_else(|| "127.0.0.1:10809".to_string());
    let size_arg = args.next().unwrap_or_else(|| "64M".to_string());
    let size = parse_size(&size_arg).ok_or_else(|| format!("bad size {size_arg:?}"))?;

    let mut exports = MemExports::new();
    exports.add("mem", size);
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    tracing::info!(addr = %listener.local_addr()?, size, "serving export \"mem\"");
    let stopped = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    shoal_nbd::serve(listener, Arc::new(exports), stopped, NbdTls::Off).await?;
    Ok(())
}
