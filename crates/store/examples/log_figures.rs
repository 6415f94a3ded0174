//! Measures the log store's figures: index memory per TiB of data (random
//! and sequential 4 KiB blocks) and the cleaner's write amplification under
//! random 4 KiB overwrites at several fill levels (uniform and 90/10
//! hot/cold, inline cleaning against the background cleaner).
//!
//!     cargo run --release -p shoal-store --example log_figures

use shoal_store::log::index::BlockIndex;
use shoal_store::log::{FaultyDevice, SimRng};
use shoal_store::{LogConfig, LogStore};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

struct Counting;
static BYTES: AtomicIsize = AtomicIsize::new(0);
static ALLOCS: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        BYTES.fetch_add(l.size() as isize, Ordering::Relaxed);
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        BYTES.fetch_sub(l.size() as isize, Ordering::Relaxed);
        ALLOCS.fetch_sub(1, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        BYTES.fetch_add(n as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Heap bytes held (plus 16 B of allocator header per allocation).
fn held() -> isize {
    BYTES.load(Ordering::Relaxed) + 16 * ALLOCS.load(Ordering::Relaxed)
}

const TIB_BLOCKS: f64 = (1u64 << 28) as f64;
const GIB: f64 = (1u64 << 30) as f64;

fn report(what: &str, n: u64, bytes: isize) {
    let per = bytes as f64 / n as f64;
    println!(
        "  {what:<46} {per:6.3} B/block  = {:6.3} GiB per TiB of data",
        per * TIB_BLOCKS / GIB
    );
}

fn index_memory(n: u64) {
    println!(
        "index memory, {} blocks ({} GiB of data):",
        n,
        (n * 4096) >> 30
    );
    let mut rng = SimRng::new(1);
    // Random order over a component exactly as large as the data.
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let base = held();
    let mut ix = BlockIndex::new();
    for (k, &b) in order.iter().enumerate() {
        ix.set(b as u64, 1000 + k as u32);
    }
    report("random 4K, component fully written", n, held() - base);
    drop(ix);
    drop(order);
    for (label, space) in [
        ("random 4K, 50% of a 2x larger component", 2 * n),
        ("random 4K, 10% of a 10x larger component", 10 * n),
        ("random 4K, 1% of a 100x larger component", 100 * n),
    ] {
        let base = held();
        let mut ix = BlockIndex::new();
        let mut k = 0u32;
        while ix.mapped() < n {
            ix.set(rng.below(space), 1000 + k);
            k += 1;
        }
        report(label, n, held() - base);
    }
    let base = held();
    let mut ix = BlockIndex::new();
    for b in 0..n {
        ix.set(b * 256, 1000 + b as u32);
    }
    report("one block per 1 MiB region (worst case)", n, held() - base);
    drop(ix);
    let base = held();
    let mut ix = BlockIndex::new();
    let mut phys = 1000u32;
    for b in 0..n {
        if b % 167 == 0 {
            phys += 1; // a batch header every 167 blocks
        }
        ix.set(b, phys);
        phys += 1;
    }
    report("sequential (full batches)", n, held() - base);
}

fn write_amplification() {
    println!("write amplification, random 4 KiB overwrites (sync every 32 writes):");
    for hot in [false, true] {
        for fill in [0.5, 0.7, 0.8, 0.9, 0.95, 1.0] {
            for background in [false, true] {
                overwrites(fill, hot, background);
            }
        }
    }
}

/// Fills `fill` of a 256 MiB device, then overwrites random blocks (90%
/// of them in a tenth of the data with `hot`), cleaning inline only or
/// with the background cleaner.
fn overwrites(fill: f64, hot: bool, background: bool) {
    let dev = Arc::new(FaultyDevice::new(256 << 20));
    let cfg = LogConfig {
        min_capacity: 0,
        ..LogConfig::default()
    };
    let s = Arc::new(LogStore::format_device(dev, "wa", &cfg).unwrap());
    if background {
        s.start_background().unwrap();
    }
    let cap = s.capacity() / 4096;
    let n = (cap as f64 * fill) as u64;
    s.create_component(1, 1, n * 4096).unwrap();
    let data = vec![7u8; 1 << 20];
    let mut off = 0;
    while off < n * 4096 {
        let len = (n * 4096 - off).min(1 << 20);
        s.write(1, off, &data[..len as usize]).unwrap();
        off += len;
    }
    s.sync().unwrap();
    let seq = s.stats();
    let mut rng = SimRng::new(7);
    let block = [9u8; 4096];
    for k in 0..6 * cap {
        let b = if hot && rng.chance(9, 10) {
            rng.below(n / 10)
        } else {
            rng.below(n)
        };
        s.write(1, b * 4096, &block).unwrap();
        if k % 32 == 31 {
            s.sync().unwrap();
        }
    }
    s.sync().unwrap();
    s.stop_background();
    let st = s.stats();
    let client = (st.client_bytes - seq.client_bytes) as f64;
    let data_blocks = st.data_blocks - seq.data_blocks;
    let cleaner = st.cleaner_blocks - seq.cleaner_blocks;
    let dev = (data_blocks + st.header_blocks - seq.header_blocks + st.checkpoint_blocks
        - seq.checkpoint_blocks) as f64
        * 4096.0;
    let cleaned = st.cleaned_segments - seq.cleaned_segments;
    let in_bg = st.cleaned_segments_background - seq.cleaned_segments_background;
    println!(
        "  {} live data {:>4.0}%, {}: total {:5.2} (cleaner {:5.2}); segments cleaned {} ({} inline)",
        if hot { "90/10 hot/cold" } else { "uniform       " },
        fill * 100.0,
        if background { "background cleaner" } else { "inline cleaning   " },
        dev / client,
        data_blocks as f64 / (data_blocks - cleaner) as f64,
        cleaned,
        cleaned - in_bg,
    );
}

fn main() {
    index_memory(1 << 24);
    write_amplification();
}
