//! The codec against a second implementation written here from the
//! definitions (P = XOR of the data, Q = Σ 2^j · D_j over GF(2^8)/0x11d),
//! and every loss pattern it must survive rebuilt.

use super::*;
use proptest::prelude::*;

/// a · b in GF(2^8) with the polynomial x^8 + x^4 + x^3 + x^2 + 1 (0x11d),
/// shift and add.
fn gf_mul(mut a: u8, mut b: u8) -> u8 {
    let mut p = 0u8;
    while b != 0 {
        if b & 1 != 0 {
            p ^= a;
        }
        let carry = a & 0x80 != 0;
        a <<= 1;
        if carry {
            a ^= 0x1d;
        }
        b >>= 1;
    }
    p
}

/// 2^j in GF(2^8).
fn gf_pow2(j: usize) -> u8 {
    (0..j).fold(1u8, |x, _| gf_mul(x, 2))
}

/// The parity shards of `data` by the definitions.
fn reference_parity(data: &[Vec<u8>], parity: usize) -> Vec<Vec<u8>> {
    let len = data[0].len();
    let mut p = vec![0u8; len];
    let mut q = vec![0u8; len];
    for (j, d) in data.iter().enumerate() {
        let c = gf_pow2(j);
        for i in 0..len {
            p[i] ^= d[i];
            q[i] ^= gf_mul(c, d[i]);
        }
    }
    [p, q].into_iter().take(parity).collect()
}

fn encoded(codec: &Codec, data: &[Vec<u8>]) -> Vec<Vec<u8>> {
    let g = codec.geometry();
    let mut parity = vec![vec![0u8; data[0].len()]; g.parity];
    let d: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let mut p: Vec<&mut [u8]> = parity.iter_mut().map(Vec::as_mut_slice).collect();
    codec.encode(&d, &mut p).expect("encode");
    parity
}

/// Every subset of `0..n` of at most `most` elements.
fn loss_patterns(n: usize, most: usize) -> Vec<Vec<usize>> {
    (0u32..1 << n)
        .filter(|m| m.count_ones() as usize <= most)
        .map(|m| (0..n).filter(|i| m & (1 << i) != 0).collect())
        .collect()
}

fn geometries() -> impl Strategy<Value = Geometry> {
    prop_oneof![
        Just(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap()),
        Just(Geometry::of(shoal_model::StripeGeometry::RAID5_WIDE).unwrap()),
        Just(Geometry::of(shoal_model::StripeGeometry::RAID6).unwrap()),
        (1usize..=MAX_DATA_SHARDS, 1usize..=MAX_PARITY_SHARDS)
            .prop_map(|(d, p)| Geometry::new(d, p).unwrap()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Parity as the definitions give it, verified, and every pattern of
    /// up to `m` lost shards rebuilt byte for byte.
    #[test]
    fn parity_matches_the_definitions_and_rebuilds_every_loss(
        g in geometries(),
        len in 1usize..600,
        seed in any::<u64>(),
    ) {
        let codec = Codec::new(g).unwrap();
        let mut x = seed | 1;
        let data: Vec<Vec<u8>> = (0..g.data)
            .map(|_| (0..len).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect())
            .collect();
        let parity = encoded(&codec, &data);
        prop_assert_eq!(&parity, &reference_parity(&data, g.parity));
        // The engine's scalar kernel gives the same bytes.
        let mut by_engine = vec![vec![0u8; len]; g.parity];
        {
            let d: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
            let mut p: Vec<&mut [u8]> = by_engine.iter_mut().map(Vec::as_mut_slice).collect();
            codec.encode_by_engine(&d, &mut p).unwrap();
        }
        prop_assert_eq!(&parity, &by_engine);
        let d: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let p: Vec<&[u8]> = parity.iter().map(Vec::as_slice).collect();
        prop_assert!(codec.verify(&d, &p).unwrap());

        let whole: Vec<Vec<u8>> = data.iter().chain(&parity).cloned().collect();
        // Wide stripes: the patterns of one geometry are many; a sample.
        let patterns = loss_patterns(g.width(), g.parity);
        let step = patterns.len().div_ceil(64).max(1);
        for lost in patterns.iter().step_by(step) {
            let mut shards: Vec<Option<Vec<u8>>> = whole.iter().cloned().map(Some).collect();
            for &i in lost {
                shards[i] = None;
            }
            codec.reconstruct(&mut shards).unwrap();
            let back: Vec<Vec<u8>> = shards.into_iter().map(Option::unwrap).collect();
            prop_assert_eq!(&back, &whole, "lost {:?}", lost);
        }
    }

    /// One byte changed anywhere: the parity no longer verifies.
    #[test]
    fn a_flipped_bit_fails_verification(
        g in geometries(),
        len in 1usize..100,
        shard in any::<prop::sample::Index>(),
        at in any::<prop::sample::Index>(),
        bit in 0u8..8,
    ) {
        let codec = Codec::new(g).unwrap();
        let mut data: Vec<Vec<u8>> = (0..g.data).map(|i| vec![i as u8; len]).collect();
        let parity = encoded(&codec, &data);
        let s = shard.index(g.data);
        let i = at.index(len);
        data[s][i] ^= 1 << bit;
        let d: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        let p: Vec<&[u8]> = parity.iter().map(Vec::as_slice).collect();
        prop_assert!(!codec.verify(&d, &p).unwrap());
    }
}

#[test]
fn every_loss_of_raid6_is_rebuilt_exhaustively() {
    let codec = Codec::new(Geometry::of(shoal_model::StripeGeometry::RAID6).unwrap()).unwrap();
    let data: Vec<Vec<u8>> = (0..4)
        .map(|i| (0..=255u8).map(|b| b ^ (i * 37)).collect())
        .collect();
    let whole: Vec<Vec<u8>> = data.iter().cloned().chain(encoded(&codec, &data)).collect();
    let patterns = loss_patterns(6, 2);
    assert_eq!(patterns.len(), 1 + 6 + 15);
    for lost in patterns {
        let mut shards: Vec<Option<Vec<u8>>> = whole.iter().cloned().map(Some).collect();
        for &i in &lost {
            shards[i] = None;
        }
        codec.reconstruct(&mut shards).unwrap();
        assert!(
            shards
                .iter()
                .zip(&whole)
                .all(|(s, w)| s.as_ref() == Some(w)),
            "{lost:?}"
        );
    }
}

#[test]
fn too_many_losses_and_bad_shapes_are_refused_changing_nothing() {
    let codec =
        Codec::new(Geometry::of(shoal_model::StripeGeometry::RAID5_NARROW).unwrap()).unwrap();
    let mut shards = vec![None, None, Some(vec![1u8; 8])];
    let before = shards.clone();
    assert_eq!(
        codec.reconstruct(&mut shards),
        Err(ErasureError::TooManyMissing {
            missing: 2,
            parity: 1
        })
    );
    assert_eq!(shards, before);
    let mut short = vec![Some(vec![0u8; 8]), None, Some(vec![0u8; 7])];
    assert!(matches!(
        codec.reconstruct(&mut short),
        Err(ErasureError::ShardLength { .. })
    ));
    let mut wrong = vec![Some(vec![0u8; 8]); 4];
    assert!(matches!(
        codec.reconstruct(&mut wrong),
        Err(ErasureError::ShardCount {
            expected: 3,
            got: 4,
            ..
        })
    ));
    let (a, b) = (vec![1u8; 8], vec![2u8; 9]);
    let mut p = vec![0u8; 8];
    assert!(matches!(
        codec.encode(&[&a, &b], &mut [&mut p]),
        Err(ErasureError::ShardLength { index: 1, .. })
    ));
    assert!(matches!(
        codec.encode(&[&a], &mut [&mut p]),
        Err(ErasureError::ShardCount { .. })
    ));
    for (d, p) in [(0, 1), (17, 1), (4, 0), (4, 3)] {
        assert_eq!(
            Geometry::new(d, p),
            Err(ErasureError::Geometry { data: d, parity: p })
        );
    }
}

#[test]
fn a_volume_s_geometry_is_a_codec_s() {
    use shoal_model::StripeGeometry;
    let g = |s| Geometry::of(s).unwrap();
    assert_eq!(g(StripeGeometry::RAID5_NARROW).overhead(), 1.5);
    assert_eq!(g(StripeGeometry::RAID5_WIDE).overhead(), 1.25);
    assert_eq!(g(StripeGeometry::RAID6).to_string(), "4+2");
    let none = StripeGeometry { data: 0, parity: 1 };
    assert!(Geometry::of(none).is_err());
}
