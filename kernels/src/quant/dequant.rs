//! Dequantisation of ggml block formats to f32, following ggml's reference layouts.
//! Inputs are whole blocks; the caller checked the byte count with `GgmlType::bytes_for`.
//! The full formats are checked against the `gguf` Python package's decoder in the
//! worker's tests/dequant.rs.

use super::GgmlType;
use half::{bf16, f16};

/// Decodes `data` (whole blocks of `ty`) into f32 values.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Vec<f32> {
    debug_assert_eq!(data.len() % ty.block_bytes(), 0);
    let blocks = data.chunks_exact(ty.block_bytes());
    let mut out = Vec::with_capacity(data.len() / ty.block_bytes() * ty.block_elems());
    match ty {
        GgmlType::F32 => out.extend(blocks.map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        GgmlType::F16 => out.extend(blocks.map(|b| f16_at(b, 0))),
        GgmlType::BF16 => out.extend(blocks.map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        GgmlType::Q4_0 => blocks.for_each(|b| q4_0(b, &mut out)),
        GgmlType::Q4_1 => blocks.for_each(|b| q4_1(b, &mut out)),
        GgmlType::Q5_0 => blocks.for_each(|b| q5_0(b, &mut out)),
        GgmlType::Q8_0 => blocks.for_each(|b| q8_0(b, &mut out)),
        GgmlType::Q4K => blocks.for_each(|b| q4_k(b, &mut out)),
        GgmlType::Q5K => blocks.for_each(|b| q5_k(b, &mut out)),
        GgmlType::Q6K => blocks.for_each(|b| q6_k(b, &mut out)),
    }
    out
}

pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// d: f16, then 16 bytes of 4-bit quants; low nibbles are elements 0..16, high 16..32.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|q| ((q & 0xF) as i32 - 8) as f32 * d));
    out.extend(qs.iter().map(|q| ((q >> 4) as i32 - 8) as f32 * d));
}

/// d, m: f16, then 16 bytes of unsigned 4-bit quants: x = q·d + m.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|q| (q & 0xF) as f32 * d + m));
    out.extend(qs.iter().map(|q| (q >> 4) as f32 * d + m));
}

/// d: f16, 4 bytes of fifth bits (bit j for element j), 16 bytes of low nibbles laid
/// out as Q4_0's: x = (q − 16)·d.
fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    out.extend(q5_0_values(b).iter().map(|&q| q as f32 * d));
}

/// A Q5_0 block's 32 values q − 16, in −16..16.
pub(crate) fn q5_0_values(b: &[u8]) -> [i8; 32] {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    std::array::from_fn(|j| {
        let low = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
        let high = ((qh >> j) & 1) as u8;
        (low | (high << 4)) as i8 - 16
    })
}

/// d: f16, then 32 signed bytes.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    out.extend(b[2..34].iter().map(|&q| q as i8 as f32 * d));
}

/// The 6-bit scale and min of sub-block `j` (of 8), packed into 12 bytes.
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Super-block of 256: d, dmin (f16), 12 bytes of scales/mins, 128 bytes of 4-bit quants.
/// Each 64 elements share 32 quant bytes: low nibbles with one scale, high with the next.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for (chunk, qs) in b[16..144].chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let (sc, m) = scale_min_k4(2 * chunk + half, scales);
            let (scale, min) = (d * sc as f32, dmin * m as f32);
            out.extend(qs.iter().map(|q| ((q >> shift) & 0xF) as f32 * scale - min));
        }
    }
}

/// As Q4_K, plus a fifth bit per element from 32 bytes of high bits (`qh`).
fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for (chunk, qs) in b[48..176].chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let sub = 2 * chunk + half;
            let (sc, m) = scale_min_k4(sub, scales);
            let (scale, min) = (d * sc as f32, dmin * m as f32);
            out.extend(qs.iter().zip(qh).map(|(q, h)| {
                let high = if h & (1 << sub) != 0 { 16 } else { 0 };
                (((q >> shift) & 0xF) + high) as f32 * scale - min
            }));
        }
    }
}

/// Super-block of 256: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit
/// scales (one per 16 elements), d (f16). Element e is d·scale[e/16]·(q − 32).
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 208);
    let q = q6_k_values(b);
    out.extend(q.iter().enumerate().map(|(e, &q)| d * (b[192 + e / 16] as i8 as f32) * q as f32));
}

/// A Q6_K super-block's 256 values q − 32, in element order.
pub(crate) fn q6_k_values(b: &[u8]) -> [i8; 256] {
    let mut y = [0i8; 256];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let q = [
                (ql[l] & 0xF) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, q) in q.iter().enumerate() {
                y[l + 32 * k] = *q as i8 - 32;
            }
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    // Hand-computed blocks.
    #[test]
    fn q4_0_by_hand() {
        let mut b = vec![0u8; 18];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2] = 0x9F; // element 0: 15-8 = 7 → 3.5; element 16: 9-8 = 1 → 0.5
        b[3] = 0x08; // element 1: 0 → 0; element 17: -8 → -4
        let x = dequantize(GgmlType::Q4_0, &b);
        assert_eq!((x[0], x[16], x[1], x[17]), (3.5, 0.5, 0.0, -4.0));
        assert_eq!(x[2], -4.0); // zero byte: 0-8
    }

    #[test]
    fn q4_1_by_hand() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16_bytes(0.25));
        b[2..4].copy_from_slice(&f16_bytes(-1.0));
        b[4] = 0x3A; // element 0: 10 → 1.5; element 16: 3 → -0.25
        let x = dequantize(GgmlType::Q4_1, &b);
        assert_eq!((x[0], x[16], x[1]), (1.5, -0.25, -1.0));
    }

    #[test]
    fn q5_0_by_hand() {
        let mut b = vec![0u8; 22];
        b[0..2].copy_from_slice(&f16_bytes(0.5));
        b[2..6].copy_from_slice(&(1u32 | 1 << 17).to_le_bytes()); // fifth bit of elements 0 and 17
        b[6] = 0x3F; // element 0: 15 + 16 = 31 → 15 → 7.5; element 16: 3 → -13 → -6.5
        b[7] = 0x20; // element 1: 0 → -16 → -8; element 17: 2 + 16 = 18 → 2 → 1
        let x = dequantize(GgmlType::Q5_0, &b);
        assert_eq!((x[0], x[16], x[1], x[17]), (7.5, -6.5, -8.0, 1.0));
    }

    #[test]
    fn q8_0_by_hand() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16_bytes(2.0));
        b[2] = (-3i8) as u8;
        b[33] = 127;
        let x = dequantize(GgmlType::Q8_0, &b);
        assert_eq!((x[0], x[31], x[1]), (-6.0, 254.0, 0.0));
    }

    #[test]
    fn k_quant_scale_packing() {
        // j < 4 reads the low 6 bits; j ≥ 4 combines a nibble with two high bits.
        let mut q = [0u8; 12];
        q[0] = 0b11_000101; // scale 5 for j=0, high bits 3 for j=4's scale
        q[4] = 0b01_000111; // min 7 for j=0, high bits 1 for j=4's min
        q[8] = 0x9A; // j=4: scale low nibble 0xA, min low nibble 0x9
        assert_eq!(scale_min_k4(0, &q), (5, 7));
        assert_eq!(scale_min_k4(4, &q), (0xA | (3 << 4), 0x9 | (1 << 4)));
    }

    #[test]
    fn f16_and_bf16() {
        let x = dequantize(GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC0]);
        assert_eq!(x, vec![1.0, -2.0]);
        let x = dequantize(GgmlType::BF16, &[0x80, 0x3F, 0x40, 0xC0]);
        assert_eq!(x, vec![1.0, -3.0]);
    }
}
