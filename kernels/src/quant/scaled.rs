//! Weights in 8-bit floats or 4-bit integers with scales of their own, as the model
//! hub's FP8 and AWQ/GPTQ checkpoints hold them, in the one layout each that the
//! backends read: the loader (worker/src/loader) converts every checkpoint's packing to
//! these. The CPU decodes them to f32 on upload; the GPU keeps them as they are here
//! and decodes them as its kernels read them.

/// One E4M3 ("fn") byte: bias 7, three mantissa bits, subnormals below 2⁻⁶, and
/// S.1111.111 the only NaN (no infinities).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((b >> 3) & 0x0f);
    let mantissa = f32::from(b & 0x07);
    match exponent {
        0 => sign * mantissa / 8.0 * (-6f32).exp2(),
        15 if b & 0x07 == 0x07 => f32::NAN,
        e => sign * (1.0 + mantissa / 8.0) * ((e - 7) as f32).exp2(),
    }
}

/// One E5M2 byte: the upper half of an IEEE half float.
pub fn e5m2_to_f32(b: u8) -> f32 {
    half::f16::from_bits(u16::from(b) << 8).to_f32()
}

/// A `[rows, cols]` matrix of E4M3 bytes, row-major, times f32 scales, one for each
/// block of `block = [block_rows, block_cols]`: element (r, c) is
/// `e4m3(bytes[r·cols + c]) · scales[(r / block_rows) · ⌈cols / block_cols⌉ + c / block_cols]`
/// (edge blocks partial). A per-tensor or per-channel scale is blocks of one row.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8Weight {
    pub bytes: Vec<u8>,
    pub scales: Vec<f32>,
    pub block: [usize; 2],
}

impl Fp8Weight {
    /// Scales a row of blocks holds.
    pub fn scale_cols(&self, cols: usize) -> usize {
        cols.div_ceil(self.block[1].max(1))
    }

    /// Whether the parts fit a `[rows, cols]` matrix.
    pub fn fits(&self, rows: usize, cols: usize) -> bool {
        let [br, bc] = self.block;
        br > 0
            && bc > 0
            && self.bytes.len() == rows * cols
            && self.scales.len() == rows.div_ceil(br) * cols.div_ceil(bc)
    }

    /// The scales as blocks of one row: each row of blocks' scales repeated for the
    /// rows it covers, so that weights whose blocks differ in height stack.
    pub fn row_scales(&self, rows: usize, cols: usize) -> Vec<f32> {
        let (br, sc) = (self.block[0].max(1), self.scale_cols(cols));
        (0..rows).flat_map(|r| self.scales[r / br * sc..][..sc].iter().copied()).collect()
    }

    pub fn dequantize(&self, cols: usize) -> Vec<f32> {
        let (br, bc, sc) = (self.block[0].max(1), self.block[1].max(1), self.scale_cols(cols));
        let mut out = Vec::with_capacity(self.bytes.len());
        for (r, row) in self.bytes.chunks_exact(cols.max(1)).enumerate() {
            let scales = &self.scales[r / br * sc..][..sc];
            out.extend(row.iter().enumerate().map(|(c, &b)| e4m3_to_f32(b) * scales[c / bc]));
        }
        out
    }
}

/// A `[rows, cols]` matrix of 4-bit integers with a scale and a zero point for each
/// row's groups of `group` columns: element (r, c) is `(q − zero) · scale` for the
/// group `(r, c / group)`. Row r's values for columns 2i and 2i + 1 are the low and
/// high nibble of byte `r · cols / 2 + i`; scales and zeros are `[rows, ⌈cols / group⌉]`.
/// Zeros go to 16: GPTQ's original format stores 15 for a zero of 16.
#[derive(Debug, Clone, PartialEq)]
pub struct Int4Weight {
    pub nibbles: Vec<u8>,
    pub scales: Vec<f32>,
    pub zeros: Vec<u8>,
    pub group: usize,
}

impl Int4Weight {
    /// Groups in a row.
    pub fn groups(&self, cols: usize) -> usize {
        cols.div_ceil(self.group.max(1))
    }

    pub fn fits(&self, rows: usize, cols: usize) -> bool {
        let g = self.groups(cols);
        self.group > 0
            && cols.is_multiple_of(2)
            && self.nibbles.len() == rows * cols / 2
            && self.scales.len() == rows * g
            && self.zeros.len() == rows * g
    }

    pub fn dequantize(&self, cols: usize) -> Vec<f32> {
        let g = self.groups(cols);
        let mut out = Vec::with_capacity(self.nibbles.len() * 2);
        for (r, row) in self.nibbles.chunks_exact((cols / 2).max(1)).enumerate() {
            for (i, &byte) in row.iter().enumerate() {
                for (c, q) in [(2 * i, byte & 0xF), (2 * i + 1, byte >> 4)] {
                    let at = r * g + c / self.group;
                    out.push((i32::from(q) - i32::from(self.zeros[at])) as f32 * self.scales[at]);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes against the OCP spec's values. All 256 of each format were compared once
    /// with ml_dtypes 0.6.0 (`float8_e4m3fn`, `float8_e5m2`), 2026-11-27: none differed.
    #[test]
    fn fp8_bytes_decode_to_the_specs_values() {
        let e4m3 = [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 / 8.0 * 2f32.powi(-6)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
            (0x3c, 1.5),
            (0x7e, 448.0),
            (0xb8, -1.0),
            (0xfe, -448.0),
        ];
        for (b, want) in e4m3 {
            assert_eq!(e4m3_to_f32(b), want, "e4m3 {b:#04x}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert!(e4m3_to_f32(0x80) == 0.0 && e4m3_to_f32(0x80).is_sign_negative());
        // 0x78..0x7e are finite: E4M3 gives its top exponent to numbers, not infinity.
        assert_eq!(e4m3_to_f32(0x78), 256.0);
        let e5m2 = [(0x3c, 1.0), (0x7b, 57344.0), (0x01, 2f32.powi(-16)), (0xc0, -2.0)];
        for (b, want) in e5m2 {
            assert_eq!(e5m2_to_f32(b), want, "e5m2 {b:#04x}");
        }
        assert!(e5m2_to_f32(0x7c).is_infinite() && e5m2_to_f32(0x7d).is_nan());
        // Order-preserving over the finite positive bytes, as a float format must be.
        let finite: Vec<f32> = (0u8..0x7f).map(e4m3_to_f32).collect();
        assert!(finite.windows(2).all(|w| w[0] < w[1]));
    }

    #[test]
    fn fp8_scales_apply_by_block_with_partial_edges() {
        // 3 × 3 of 1.0 (0x38) in blocks of 2 × 2: scales 1 2 / 3 4.
        let w = Fp8Weight { bytes: vec![0x38; 9], scales: vec![1.0, 2.0, 3.0, 4.0], block: [2, 2] };
        assert!(w.fits(3, 3) && !w.fits(3, 4));
        assert_eq!(w.dequantize(3), [1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 3.0, 3.0, 4.0]);
        // Per channel: blocks of one row and every column.
        let w = Fp8Weight { bytes: vec![0x38, 0x3c, 0xb8, 0x38], scales: vec![2.0, 3.0], block: [1, 2] };
        assert_eq!(w.dequantize(2), [2.0, 3.0, -3.0, 3.0]);
        // Blocks of two rows as blocks of one: the same values.
        let w = Fp8Weight { bytes: vec![0x38; 9], scales: vec![1.0, 2.0, 3.0, 4.0], block: [2, 2] };
        let rows = Fp8Weight { scales: w.row_scales(3, 3), block: [1, 2], ..w.clone() };
        assert_eq!(rows.scales, [1.0, 2.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(rows.dequantize(3), w.dequantize(3));
    }

    #[test]
    fn int4_nibbles_zeros_and_groups() {
        // One row of 4 columns in groups of 2: nibbles 1 2 | 3 15, zeros 1 and 16.
        let w = Int4Weight { nibbles: vec![0x21, 0xF3], scales: vec![0.5, 2.0], zeros: vec![1, 16], group: 2 };
        assert!(w.fits(1, 4) && !w.fits(2, 4));
        assert_eq!(w.dequantize(4), [0.0, 0.5, -26.0, -2.0]);
    }
}
