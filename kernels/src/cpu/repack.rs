//! ggml's blocks in `QuantRows`' layouts: every format becomes blocks of 32 weights
//! with their scales (and offsets) as f32 in arrays of their own, so the hot loop
//! converts no halves and unpacks no bit fields spread over a super-block.
//!
//! - Q4_0, Q4_1 and Q4_K become `Nibbles` (weight d·q + m): Q4_0's d·(q − 8) takes
//!   m = −8d, and each 32-weight sub-block of Q4_K gets d·scale and −dmin·min.
//! - Q8_0 and Q5_0 become `Bytes` (weight d·q, q signed): Q5_0's five bits, q − 16,
//!   fit a byte (9 bits a weight in memory instead of 5.5, but no f32 copy).
//! - Q6_K becomes `BytesHalves`: q − 32 in a byte and d·scale for each 16 weights.

use super::quant_rows::{BLOCK, Layout};
use crate::quant::{GgmlType, f16_at, q5_0_values, q6_k_values, scale_min_k4};

pub(super) struct Packed {
    pub layout: Layout,
    /// `layout.scales()` per block, block after block.
    pub d: Vec<f32>,
    /// One per block for `Nibbles`, else empty.
    pub m: Vec<f32>,
    pub qs: Vec<u8>,
}

/// `bytes` (whole blocks of `ty`) repacked, or None for formats we keep as f32.
pub(super) fn repack(ty: GgmlType, bytes: &[u8]) -> Option<Packed> {
    let layout = match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4K => Layout::Nibbles,
        GgmlType::Q5_0 | GgmlType::Q8_0 => Layout::Bytes,
        GgmlType::Q6K => Layout::BytesHalves,
        _ => return None,
    };
    let blocks = bytes.chunks_exact(ty.block_bytes());
    let weights = blocks.len() * ty.block_elems();
    let per_block = weights / BLOCK;
    let mut p = Packed {
        layout,
        d: Vec::with_capacity(per_block * layout.scales()),
        m: Vec::with_capacity(if layout == Layout::Nibbles { per_block } else { 0 }),
        qs: Vec::with_capacity(per_block * layout.q_len()),
    };
    for b in blocks {
        match ty {
            GgmlType::Q4_0 => {
                let d = f16_at(b, 0);
                p.d.push(d);
                p.m.push(-8.0 * d);
                p.qs.extend_from_slice(&b[2..18]);
            }
            GgmlType::Q4_1 => {
                p.d.push(f16_at(b, 0));
                p.m.push(f16_at(b, 2));
                p.qs.extend_from_slice(&b[4..20]);
            }
            GgmlType::Q4K => q4_k(b, &mut p),
            GgmlType::Q8_0 => {
                p.d.push(f16_at(b, 0));
                p.qs.extend_from_slice(&b[2..34]);
            }
            GgmlType::Q5_0 => {
                p.d.push(f16_at(b, 0));
                p.qs.extend(q5_0_values(b).iter().map(|&q| q as u8));
            }
            GgmlType::Q6K => {
                let d = f16_at(b, 208);
                p.d.extend(b[192..208].iter().map(|&s| d * (s as i8 as f32)));
                p.qs.extend(q6_k_values(b).iter().map(|&q| q as u8));
            }
            _ => unreachable!("layout chosen above"),
        }
    }
    Some(p)
}

/// Q4_K's 256 weights: 32 bytes hold two sub-blocks (low nibbles, then high), each
/// with a 6-bit scale and min; re-laid as Q4_1's blocks (low nibbles elements 0..16).
fn q4_k(b: &[u8], p: &mut Packed) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for (chunk, qs) in b[16..144].chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let (sc, min) = scale_min_k4(2 * chunk + half, scales);
            p.d.push(d * sc as f32);
            p.m.push(-(dmin * min as f32));
            let q = |i: usize| (qs[i] >> shift) & 0xF;
            p.qs.extend((0..16).map(|i| q(i) | (q(i + 16) << 4)));
        }
    }
}
