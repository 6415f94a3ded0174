//! The column arithmetic and whole-stripe encoding of every geometry:
//! each slot uses every column once, each block lands where `block_at`
//! says, every data unit starts with the stripe's summary, the parity
//! verifies, and any row loses up to `m` columns and is rebuilt.

use super::*;
use proptest::prelude::*;
use shoal_erasure::{Codec, Geometry};

fn geometries() -> impl Strategy<Value = Geometry> {
    prop_oneof![
        Just(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap()),
        Just(Geometry::of(shoal_model::StripeGeometry::RAID5_WIDE).unwrap()),
        Just(Geometry::of(shoal_model::StripeGeometry::RAID6).unwrap()),
    ]
}

/// A block whose every byte says which block it is and where.
fn block(seed: u64, i: usize) -> Vec<u8> {
    (0..BLOCK_BYTES)
        .map(|b| (seed as usize).wrapping_mul(31).wrapping_add(i * 7 + b) as u8)
        .collect()
}

#[test]
fn each_slot_puts_every_unit_on_its_own_column_and_rotates_parity() {
    for g in [
        Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap(),
        Geometry::of(shoal_model::StripeGeometry::RAID5_WIDE).unwrap(),
        Geometry::of(shoal_model::StripeGeometry::RAID6).unwrap(),
    ] {
        let c = Columns::new(g);
        let mut parity_on = vec![0usize; c.width()];
        for slot in 0..(3 * c.width() as u64) {
            let mut seen = vec![false; c.width()];
            for pos in 0..c.width() {
                let u = c.unit_at(slot, pos);
                assert_eq!(c.position_of(slot, u), pos);
                assert!(!std::mem::replace(&mut seen[pos], true));
                if let Unit::Parity(_) = u {
                    parity_on[pos] += 1;
                }
            }
        }
        // Three rounds of rotation: parity three times per parity unit on
        // every column.
        assert!(
            parity_on.iter().all(|&n| n == 3 * g.parity),
            "{parity_on:?}"
        );
    }
}

#[test]
fn columns_are_sized_for_the_data_twice_and_spares() {
    let c = Columns::new(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap());
    // 1 GiB: 262144 blocks, 4229 stripes of 62.
    let stripes = (1u64 << 30).div_ceil(4096).div_ceil(62);
    assert_eq!(c.column_bytes(1 << 30), (2 * stripes + 16) * UNIT_BYTES);
    assert_eq!(c.column_bytes(4096), 18 * UNIT_BYTES);
}

#[test]
fn encoding_refuses_what_is_not_a_stripe() {
    let c = Columns::new(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap());
    let codec =
        Codec::new(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap()).unwrap();
    let s = summary_of(&c, 1, (1, 0), &[5]);
    let small = vec![0u8; 512];
    assert_eq!(
        c.encode(&codec, &s, &[&small]),
        Err(StripeError::BlockSize(512))
    );
    let b = block(0, 0);
    let many: Vec<&[u8]> = (0..63).map(|_| b.as_slice()).collect();
    assert!(matches!(
        c.encode(&codec, &s, &many),
        Err(StripeError::TooManyBlocks { max: 62, got: 63 })
    ));
    let short = Summary {
        blocks: vec![5],
        ..s.clone()
    };
    assert!(matches!(
        c.encode(&codec, &short, &[&b]),
        Err(StripeError::SummaryBlocks { want: 62, got: 1 })
    ));
    assert!(matches!(
        c.rebuild_row(&codec, 0, vec![None; 2]),
        Err(StripeError::Rows { want: 3, got: 2 })
    ));
    // More columns lost than the parity covers.
    assert!(c.rebuild_row(&codec, 0, vec![None, None, Some(b)]).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn stripes_encode_whole_and_rows_rebuild_from_any_k_columns(
        g in geometries(),
        slot in 0u64..1000,
        fill in 0.0f64..=1.0,
        seed in any::<u64>(),
        lost_pick in any::<u64>(),
        row in 0usize..=BLOCKS_PER_UNIT,
    ) {
        let c = Columns::new(g);
        let codec = Codec::new(g).unwrap();
        let n = ((c.blocks_per_stripe() as f64 * fill) as usize).max(1);
        let numbers: Vec<u64> = (0..n as u64).map(|i| seed.wrapping_add(i * 3) % (1 << 40)).collect();
        let data: Vec<Vec<u8>> = (0..n).map(|i| block(seed, i)).collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let summary = summary_of(&c, 9, (seed % 1000 + 1, slot), &numbers);
        let units = c.encode(&codec, &summary, &refs).unwrap();
        prop_assert_eq!(units.len(), c.width());
        prop_assert!(units.iter().all(|u| u.len() as u64 == UNIT_BYTES));
        let base = slot * UNIT_BYTES;
        for (i, b) in data.iter().enumerate() {
            let (pos, off) = c.block_at(slot, i);
            let at = (off - base) as usize;
            prop_assert_eq!(&units[pos][at..at + BLOCK_BYTES], b.as_slice());
            prop_assert_eq!(summary.blocks[i], numbers[i]);
        }
        // Every data unit starts with the summary; padding is named so.
        for (pos, unit) in units.iter().enumerate() {
            if let Unit::Data(_) = c.unit_at(slot, pos) {
                let s = Summary::decode(&unit[..BLOCK_BYTES]).unwrap();
                prop_assert_eq!(&s, &summary);
                prop_assert!(s.blocks[n..].iter().all(|&b| b == PAD_BLOCK));
            }
        }
        let shard = |unit| &units[c.position_of(slot, unit)][..];
        let d: Vec<&[u8]> = (0..g.data).map(|j| shard(Unit::Data(j))).collect();
        let p: Vec<&[u8]> = (0..g.parity).map(|i| shard(Unit::Parity(i))).collect();
        prop_assert!(codec.verify(&d, &p).unwrap());
        // One row, up to m columns lost, rebuilt from the rest.
        let at = row * BLOCK_BYTES;
        let whole: Vec<Vec<u8>> = units.iter().map(|u| u[at..at + BLOCK_BYTES].to_vec()).collect();
        let mut rows: Vec<Option<Vec<u8>>> = whole.iter().cloned().map(Some).collect();
        let lost = 1 + (lost_pick % g.parity as u64) as usize;
        for k in 0..lost {
            rows[((lost_pick >> 8) as usize + k * 2) % c.width()] = None;
        }
        prop_assert_eq!(c.rebuild_row(&codec, slot, rows).unwrap(), whole);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// A run of stripes in consecutive slots, by column, is each
    /// stripe's units one after the other, as encoding them one by one
    /// gives them (the last one partly filled).
    #[test]
    fn a_run_of_stripes_is_its_stripes_units_side_by_side_on_each_column(
        g in geometries(),
        first in 0u64..1000,
        stripes in 1usize..5,
        last_fill in 1usize..=BLOCKS_PER_UNIT * 4,
        seed in any::<u64>(),
    ) {
        let c = Columns::new(g);
        let codec = Codec::new(g).unwrap();
        let per = c.blocks_per_stripe();
        let mut summaries = Vec::new();
        let mut data: Vec<Vec<Vec<u8>>> = Vec::new();
        for s in 0..stripes {
            let n = match s + 1 == stripes {
                true => last_fill.min(per),
                false => per,
            };
            let numbers: Vec<u64> = (0..n as u64).map(|i| seed % 1000 + (s * per) as u64 + i).collect();
            summaries.push(summary_of(&c, 9, (s as u64 + 1, first + s as u64), &numbers));
            data.push((0..n).map(|i| block(seed ^ s as u64, i)).collect());
        }
        let refs: Vec<Vec<&[u8]>> = data.iter().map(|d| d.iter().map(Vec::as_slice).collect()).collect();
        let run: Vec<(&Summary, &[&[u8]])> = summaries.iter().zip(&refs).map(|(s, r)| (s, &r[..])).collect();
        let by_column = c.encode_run(&codec, &run).unwrap();
        prop_assert_eq!(by_column.len(), c.width());
        let unit = UNIT_BYTES as usize;
        for (s, (summary, blocks)) in run.iter().enumerate() {
            let alone = c.encode(&codec, summary, blocks).unwrap();
            for (pos, u) in alone.iter().enumerate() {
                prop_assert_eq!(&by_column[pos][s * unit..(s + 1) * unit], u.as_slice());
            }
        }
        prop_assert!(by_column.iter().all(|col| col.len() == stripes * unit));
    }
}

#[test]
#[should_panic(expected = "not consecutive")]
fn a_run_of_stripes_in_slots_apart_is_refused() {
    let g = Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap();
    let (c, codec) = (Columns::new(g), Codec::new(g).unwrap());
    let b = block(1, 0);
    let (s1, s2) = (
        summary_of(&c, 9, (1, 4), &[7]),
        summary_of(&c, 9, (2, 6), &[8]),
    );
    let _ = c.encode_run(&codec, &[(&s1, &[&b[..]]), (&s2, &[&b[..]])]);
}
