//! Lossless re-encoding of symmetric 32-element formats (Q4_0, Q5_0) as Q8_0: the same
//! f16 scale and the same integers, one byte each. Lets tensors that a file stores in
//! different formats (Q5_0 Q and K beside a Q8_0 V) be stacked into one matrix without
//! an f32 copy.

use super::{GgmlType, q5_0_values};

/// `bytes` (whole blocks of `ty`) as Q8_0 blocks with exactly the same values, or None
/// when `ty` is not a format Q8_0 holds exactly.
pub fn widen_to_q8_0(ty: GgmlType, bytes: &[u8]) -> Option<Vec<u8>> {
    let values: fn(&[u8]) -> [i8; 32] = match ty {
        GgmlType::Q8_0 => return Some(bytes.to_vec()),
        GgmlType::Q4_0 => {
            |b| std::array::from_fn(|j| (if j < 16 { b[2 + j] & 0xF } else { b[2 + j - 16] >> 4 }) as i8 - 8)
        }
        GgmlType::Q5_0 => q5_0_values,
        _ => return None,
    };
    let blocks = bytes.chunks_exact(ty.block_bytes());
    let mut out = Vec::with_capacity(blocks.len() * GgmlType::Q8_0.block_bytes());
    for b in blocks {
        out.extend_from_slice(&b[0..2]);
        out.extend(values(b).iter().map(|&q| q as u8));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize;

    #[test]
    fn widened_blocks_decode_to_the_same_bits() {
        // Every byte pattern position varies; the scales are finite f16 values.
        let mut state = 12345u32;
        let mut next = move || {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
            (state >> 16) as u8
        };
        for ty in [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0] {
            let mut bytes: Vec<u8> = (0..7 * ty.block_bytes()).map(|_| next()).collect();
            for (i, b) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
                b[0..2].copy_from_slice(&half::f16::from_f32(0.01 * (i as f32 - 3.0)).to_le_bytes());
            }
            let wide = widen_to_q8_0(ty, &bytes).unwrap();
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert_eq!(bits(dequantize(GgmlType::Q8_0, &wide)), bits(dequantize(ty, &bytes)), "{ty:?}");
        }
        assert!(widen_to_q8_0(GgmlType::Q4_1, &[0; 20]).is_none());
    }
}
