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
//! `weight` keeps an E4M3 matrix as its bytes and scales (`quant::Fp8Weight`, which the
//! GPU reads as it is); `apply_scales` scales decoded values (E5M2, vectors).

use super::LoadError;
use std::path::Path;
use tessera_kernels::quant::Fp8Weight;

pub use tessera_kernels::quant::{e4m3_to_f32, e5m2_to_f32};

/// How a tensor's scales divide it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleLayout {
    /// One scale for the tensor, or for each row, or for each of a row's equal groups of
    /// columns: any other split of the rows would be a guess at a block size, refused.
    Exact,
    /// Blocks of this many rows and columns, the last ones partial.
    Blocks([usize; 2]),
}

/// The `[rows, cols]` blocks that `scales` (of `scale_shape`) divide a `shape` tensor
/// into (a vector is one row), laid out as `layout` says; an error names the tensor when
/// they do not fit.
fn scale_blocks(
    file: &Path,
    tensor: &str,
    shape: &[usize],
    scale_shape: &[usize],
    scales: usize,
    layout: ScaleLayout,
) -> Result<[usize; 2], LoadError> {
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
    let block = match layout {
        ScaleLayout::Exact => {
            let fits =
                (scale_rows == 1 || scale_rows == rows) && scale_rows > 0 && scale_cols > 0 && cols % scale_cols == 0;
            if !fits {
                return Err(mismatch(file, tensor, shape, scale_shape));
            }
            [rows / scale_rows, cols / scale_cols]
        }
        ScaleLayout::Blocks([br, bc]) => {
            if br == 0 || bc == 0 || rows.div_ceil(br) != scale_rows || cols.div_ceil(bc) != scale_cols {
                return Err(mismatch(file, tensor, shape, scale_shape));
            }
            [br, bc]
        }
    };
    if scales != scale_rows * scale_cols {
        return Err(mismatch(file, tensor, shape, scale_shape));
    }
    Ok(block)
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
    let [block_rows, block_cols] = scale_blocks(file, tensor, shape, scale_shape, scales.len(), layout)?;
    let cols = shape.last().copied().unwrap_or(0);
    if data.len() != shape.iter().product::<usize>() {
        return Err(mismatch(file, tensor, shape, scale_shape));
    }
    let scale_cols = cols.div_ceil(block_cols);
    for (r, row) in data.chunks_exact_mut(cols.max(1)).enumerate() {
        let scale_row = &scales[r / block_rows * scale_cols..][..scale_cols];
        for (c, v) in row.iter_mut().enumerate() {
            *v *= scale_row[c / block_cols];
        }
    }
    Ok(())
}

/// A `[rows, cols]` E4M3 matrix kept as its bytes with its scales. Scales shared by
/// every row (one per tensor, or per group of columns) are repeated per row, so that
/// the matrices fused into one product (Q, K and V) stack whatever their own scales.
pub fn weight(
    file: &Path,
    tensor: &str,
    [rows, cols]: [usize; 2],
    bytes: Vec<u8>,
    scale_shape: &[usize],
    scales: Vec<f32>,
    layout: ScaleLayout,
) -> Result<Fp8Weight, LoadError> {
    let block = scale_blocks(file, tensor, &[rows, cols], scale_shape, scales.len(), layout)?;
    if bytes.len() != rows * cols {
        return Err(mismatch(file, tensor, &[rows, cols], scale_shape));
    }
    let weight = Fp8Weight { bytes, scales, block };
    if block[0] >= rows && rows > 1 {
        return Ok(Fp8Weight { scales: weight.row_scales(rows, cols), block: [1, block[1]], ..weight });
    }
    Ok(weight)
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
