//! What the stripe map of an erasure-coded volume holds in memory per
//! mapped block (`docs/erasure-coding.md`, The map): counted by a global
//! allocator, so this file is its own test binary.

use shoal_owner::stripes::{MapRecord, StripeMap};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes allocated and not yet freed, by every thread of this binary.
struct Counting;

static HELD_BYTES: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        HELD_BYTES.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HELD_BYTES.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        HELD_BYTES.fetch_sub(l.size(), Ordering::Relaxed);
        HELD_BYTES.fetch_add(new, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Blocks of a 2+1 stripe.
const BLOCKS_PER_STRIPE: u64 = 62;

/// Bytes the map holds per mapped block once block `order[p]` is the
/// `p`-th block destaged (stripe `p / 62`, index `p % 62`), applied as
/// one stripe record per stripe, as the owner does.
fn bytes_per_block(order: &[u64]) -> f64 {
    let before = HELD_BYTES.load(Ordering::Relaxed);
    let mut map = StripeMap::default();
    for (s, blocks) in order.chunks(BLOCKS_PER_STRIPE as usize).enumerate() {
        let s = s as u64;
        let rec = MapRecord::Stripe {
            volume: 1,
            seq: s + 1,
            stripe_seq: s + 1,
            slot: s,
            blocks: blocks.to_vec(),
        };
        map.apply(&rec)
            .expect("stripes in order, each in a free slot");
    }
    assert_eq!(map.len(), order.len());
    let held = HELD_BYTES.load(Ordering::Relaxed) - before;
    held as f64 / order.len() as f64
}

/// Block numbers `0..n` in a fixed pseudo-random order.
fn shuffled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Blocks written in random order over a whole volume, and in order: the
/// map is a few bytes per mapped block either way, not a tree node's
/// share per block. Debug builds check the map after every record, so
/// the maps here are small; the per-block figure does not depend on
/// the size (`bench/RESULTS.md` has 4 million blocks).
#[test]
fn the_map_holds_a_few_bytes_per_mapped_block() {
    let n = 62 * 128;
    let random = bytes_per_block(&shuffled(n));
    let in_order = bytes_per_block(&(0..n).collect::<Vec<_>>());
    // A third of the blocks of a volume three times as large, at
    // random: chunks partly filled.
    let third = bytes_per_block(&shuffled(3 * n)[..n as usize]);
    assert!(third <= 28.0, "{third:.1} bytes per block, a third mapped");
    // One block in 256, each alone in its chunk: the worst case.
    let sparse = bytes_per_block(&(0..n).map(|b| b * 256).collect::<Vec<_>>());
    println!(
        "map bytes per mapped block: random {random:.1}, in order {in_order:.1}, \
         a third at random {third:.1}, one in 256 {sparse:.1}"
    );
    assert!(
        sparse <= 128.0,
        "{sparse:.1} bytes per block alone in its chunk"
    );
    assert!(
        random <= 24.0,
        "{random:.1} bytes per block written at random"
    );
    assert!(
        in_order <= 24.0,
        "{in_order:.1} bytes per block written in order"
    );
}
