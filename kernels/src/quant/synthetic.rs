//! Random blocks of a format, for tests and benchmarks that need quantised weights
//! without a model file: the quants are uniform random bits, the f16 scales finite.

use super::GgmlType;

/// Blocks of `ty` for `n` weights (a multiple of the block size), reproducible from
/// `seed`; every f16 field is a finite value in [-0.1, 0.1).
pub fn random_blocks(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed;
    // SplitMix64: fast, and enough for weights that only need to look random.
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let f16_fields: &[usize] = match ty {
        GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        _ => &[0],
    };
    let mut bytes: Vec<u8> = (0..n / ty.block_elems() * ty.block_bytes()).map(|_| next() as u8).collect();
    for b in bytes.chunks_exact_mut(ty.block_bytes()) {
        for &at in f16_fields {
            let unit = (next() >> 40) as f32 / (1u64 << 24) as f32;
            b[at..at + 2].copy_from_slice(&half::f16::from_f32(0.2 * unit - 0.1).to_le_bytes());
        }
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_blocks_and_finite_scales() {
        let a = random_blocks(GgmlType::Q6K, 512, 7);
        assert_eq!(a, random_blocks(GgmlType::Q6K, 512, 7));
        assert_ne!(a, random_blocks(GgmlType::Q6K, 512, 8));
        assert_eq!(a.len(), 2 * 210);
        for x in super::super::dequantize(GgmlType::Q6K, &a) {
            assert!(x.is_finite() && x.abs() <= 0.1 * 128.0 * 32.0, "{x}");
        }
    }
}
