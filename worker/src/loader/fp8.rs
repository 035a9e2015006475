//! FP8 weights as the model hub's FP8 checkpoints store them: each matrix in 8-bit
//! floats (E4M3 as `F8_E4M3`, the OCP "fn" variant with no infinities and a maximum of
//! 448; or E5M2) beside its scales in a tensor of its own:
//!
//! - `NAME_scale` (compressed-tensors, fbgemm): one scale per tensor (`[]` or `[1]`),
//!   per output row (`[rows, 1]`), per group of columns (`[rows, cols / group]`), or,
//!   where the config's `config_groups` give the weights a `block_structure`, one per
//!   block of it (compressed-tensors' block strategy);
//! - `NAME_scale_inv` (DeepSeek-V3, Qwen3's FP8 releases): one per block of
//!   `weight_block_size` (from `config.json`'s `quantization_config`, 128 × 128 if it
//!   says none), edge blocks partial. Despite its name it multiplies, as in those
//!   models' own dequantisation.
//!
//! Here they are decoded to f32 and scaled; kernels that read FP8 directly are the GPU's.

use super::LoadError;
use std::path::Path;

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

/// How a tensor's scales divide it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleLayout {
    /// One scale for the tensor, or for each row, or for each of a row's equal groups of
    /// columns: any other split of the rows would be a guess at a block size, refused.
    Exact,
    /// Blocks of this many rows and columns, the last ones partial.
    Blocks([usize; 2]),
}

/// Multiplies `data` (a `shape` matrix, or a vector as one row) by `scales` (of
/// `scale_shape`) laid out as `layout` says; an error names the tensor when they do not fit.
pub fn apply_scales(
    file: &Path,
    tensor: &str,
    shape: &[usize],
    data: &mut [f32],
    scale_shape: &[usize],
    scales: &[f32],
    layout: ScaleLayout,
) -> Result<(), LoadError> {
    let (rows, cols) = match shape {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => return Err(mismatch(file, tensor, shape, scale_shape)),
    };
    let (scale_rows, scale_cols) = match scale_shape {
        [] => (1, 1),
        [n] if *n == 1 || rows == 1 => (1, *n),
        [n] => (*n, 1),
        [r, c] => (*r, *c),
        _ => return Err(mismatch(file, tensor, shape, scale_shape)),
    };
    let (block_rows, block_cols) = match layout {
        ScaleLayout::Exact => {
            let fits =
                (scale_rows == 1 || scale_rows == rows) && scale_rows > 0 && scale_cols > 0 && cols % scale_cols == 0;
            if !fits {
                return Err(mismatch(file, tensor, shape, scale_shape));
            }
            (rows / scale_rows, cols / scale_cols)
        }
        ScaleLayout::Blocks([br, bc]) => {
            if br == 0 || bc == 0 || rows.div_ceil(br) != scale_rows || cols.div_ceil(bc) != scale_cols {
                return Err(mismatch(file, tensor, shape, scale_shape));
            }
            (br, bc)
        }
    };
    if scales.len() != scale_rows * scale_cols || data.len() != rows * cols {
        return Err(mismatch(file, tensor, shape, scale_shape));
    }
    for (r, row) in data.chunks_exact_mut(cols.max(1)).enumerate() {
        let scale_row = &scales[r / block_rows * scale_cols..][..scale_cols];
        for (c, v) in row.iter_mut().enumerate() {
            *v *= scale_row[c / block_cols];
        }
    }
    Ok(())
}

fn mismatch(file: &Path, tensor: &str, shape: &[usize], scale_shape: &[usize]) -> LoadError {
    LoadError::BadTensor {
        file: file.into(),
        tensor: tensor.into(),
        detail: format!("scales of shape {scale_shape:?} do not divide a tensor of shape {shape:?}"),
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

    fn scaled(
        shape: &[usize],
        scale_shape: &[usize],
        scales: &[f32],
        layout: ScaleLayout,
    ) -> Result<Vec<f32>, LoadError> {
        let mut data = vec![1.0; shape.iter().product()];
        apply_scales(Path::new("m"), "w", shape, &mut data, scale_shape, scales, layout).map(|()| data)
    }

    #[test]
    fn scales_apply_per_tensor_row_group_and_block() {
        let exact = ScaleLayout::Exact;
        assert_eq!(scaled(&[2, 3], &[], &[2.0], exact).unwrap(), [2.0; 6]);
        assert_eq!(scaled(&[2, 3], &[1], &[2.0], exact).unwrap(), [2.0; 6]);
        assert_eq!(scaled(&[2, 3], &[2, 1], &[2.0, 3.0], exact).unwrap(), [2.0, 2.0, 2.0, 3.0, 3.0, 3.0]);
        assert_eq!(scaled(&[2, 3], &[2], &[2.0, 3.0], exact).unwrap(), [2.0, 2.0, 2.0, 3.0, 3.0, 3.0]);
        assert_eq!(scaled(&[1, 4], &[1, 2], &[2.0, 3.0], exact).unwrap(), [2.0, 2.0, 3.0, 3.0]);
        // Blocks of 2 × 2 over 3 × 3: the last row and column form partial blocks.
        let blocks = scaled(&[3, 3], &[2, 2], &[1.0, 2.0, 3.0, 4.0], ScaleLayout::Blocks([2, 2])).unwrap();
        assert_eq!(blocks, [1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 3.0, 3.0, 4.0]);
        // Scales that do not divide the tensor are an error naming it, never a guess.
        assert!(scaled(&[2, 3], &[2, 2], &[1.0; 4], exact).is_err());
        assert!(scaled(&[3, 3], &[1, 2], &[1.0; 2], ScaleLayout::Blocks([2, 2])).is_err());
        assert!(scaled(&[2, 3], &[3, 1], &[1.0; 3], exact).is_err());
        // 2 scale rows over 4 rows would be blocks of 2 rows: only a config may say so.
        assert!(scaled(&[4, 3], &[2, 1], &[1.0; 2], exact).is_err());
        assert!(scaled(&[4, 3], &[2, 1], &[1.0; 2], ScaleLayout::Blocks([2, 3])).is_ok());
    }
}
