//! Parity throughput of the codec on this machine, per geometry: bytes of
//! data encoded per second, and a rebuild of one lost data shard (two for
//! RAID-6), with stripe units of 128 KiB as the design note lays them out.
//!
//! `cargo run --release -p shoal-erasure --example throughput [SECONDS]`

use shoal_erasure::{Codec, Geometry};
use std::time::{Duration, Instant};

/// Bytes of a stripe unit (`docs/erasure-coding.md`).
const UNIT_BYTES: usize = 128 << 10;

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(1.0);
    let budget = Duration::from_secs_f64(secs);
    println!("geometry  encode MiB/s (data)  rebuild MiB/s (data)");
    for g in [
        Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap(),
        Geometry::of(shoal_model::StripeGeometry::RAID5_WIDE).unwrap(),
        Geometry::of(shoal_model::StripeGeometry::RAID6).unwrap(),
    ] {
        let codec = Codec::new(g).expect("geometry");
        let data: Vec<Vec<u8>> = (0..g.data)
            .map(|i| (0..UNIT_BYTES).map(|b| (b * 31 + i * 7) as u8).collect())
            .collect();
        let mut parity = vec![vec![0u8; UNIT_BYTES]; g.parity];
        let d: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let (mut n, start) = (0u64, Instant::now());
        while start.elapsed() < budget {
            let mut p: Vec<&mut [u8]> = parity.iter_mut().map(Vec::as_mut_slice).collect();
            codec.encode(&d, &mut p).expect("encode");
            n += 1;
        }
        let enc = rate(n * (g.data * UNIT_BYTES) as u64, start.elapsed());
        let whole: Vec<Vec<u8>> = data.iter().chain(&parity).cloned().collect();
        let (mut n, start) = (0u64, Instant::now());
        while start.elapsed() < budget {
            let mut shards: Vec<Option<Vec<u8>>> = whole.iter().cloned().map(Some).collect();
            for s in shards.iter_mut().take(g.parity) {
                *s = None;
            }
            codec.reconstruct(&mut shards).expect("rebuild");
            n += 1;
        }
        let reb = rate(n * (g.data * UNIT_BYTES) as u64, start.elapsed());
        println!("{:<9} {enc:>20.0} {reb:>21.0}", g.to_string());
    }
}

fn rate(bytes: u64, t: Duration) -> f64 {
    bytes as f64 / (1 << 20) as f64 / t.as_secs_f64()
}
