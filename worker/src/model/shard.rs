//! Tensor parallelism, Megatron style: rank r of n holds heads r·H/n .. (r+1)·H/n of
//! the attention (their Q, K and V rows and the matching columns of the output
//! projection) and the same slice of the MLP's columns (gate and up rows, down
//! columns). The output and down projections are row-parallel: each rank's product is
//! a partial sum, added across ranks by an all-reduce. Embeddings, norms and the LM
//! head are replicated.

use super::ModelError;
use super::config::ModelConfig;
use std::ops::Range;
use tessera_kernels::quant::{self, GgmlType};
use tessera_kernels::{HostWeight, WeightData};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };

    /// This rank's part of `n` items split evenly.
    pub fn range(&self, n: usize) -> Range<usize> {
        let per = n / self.size;
        self.rank * per..(self.rank + 1) * per
    }
}

impl ModelConfig {
    /// The shape one rank of `size` runs: its heads and its MLP columns.
    pub fn shard(&self, size: usize) -> Result<ModelConfig, ModelError> {
        let even = |what: &str, n: usize| {
            if size == 0 || !n.is_multiple_of(size) {
                Err(ModelError::Input(format!("{n} {what} do not split over {size} tensor-parallel ranks")))
            } else {
                Ok(n / size)
            }
        };
        Ok(ModelConfig {
            num_heads: even("attention heads", self.num_heads)?,
            num_kv_heads: even("KV heads", self.num_kv_heads)?,
            intermediate_size: even("MLP columns", self.intermediate_size)?,
            ..self.clone()
        })
    }
}

/// Rows `rows` of `w`.
pub(super) fn rows(w: HostWeight, rows: Range<usize>) -> HostWeight {
    let cols = w.cols;
    let data = match w.data {
        WeightData::F32(v) => WeightData::F32(v[rows.start * cols..rows.end * cols].to_vec()),
        WeightData::Blocks { ty, bytes } => {
            let rb = ty.bytes_for(cols).expect("a block weight's rows are whole blocks");
            WeightData::Blocks { ty, bytes: bytes[rows.start * rb..rows.end * rb].to_vec() }
        }
        WeightData::Stacked(parts) => {
            let mut start = 0;
            let mut taken = Vec::new();
            for p in parts {
                let (lo, hi) = (start.max(rows.start), (start + p.rows).min(rows.end));
                let part_start = start;
                start += p.rows;
                if lo < hi {
                    taken.push(self::rows(p, lo - part_start..hi - part_start));
                }
            }
            return stack(taken);
        }
    };
    HostWeight { rows: rows.len(), cols, data }
}

/// Columns `cols` of `w`; block rows are cut at block boundaries when the range falls
/// on them, else dequantised first.
pub(super) fn columns(w: HostWeight, cols: Range<usize>) -> HostWeight {
    let HostWeight { rows, cols: width, data } = w;
    let data = match data {
        WeightData::Stacked(parts) => return stack(parts.into_iter().map(|p| columns(p, cols.clone())).collect()),
        WeightData::Blocks { ty, bytes } => match (ty.bytes_for(cols.start), ty.bytes_for(cols.len())) {
            (Some(skip), Some(take)) => {
                let rb = ty.bytes_for(width).expect("a block weight's rows are whole blocks");
                let bytes =
                    (0..rows).flat_map(|r| bytes[r * rb + skip..r * rb + skip + take].iter().copied()).collect();
                return HostWeight { rows, cols: cols.len(), data: WeightData::Blocks { ty, bytes } };
            }
            _ => quant::dequantize(ty, &bytes),
        },
        WeightData::F32(v) => v,
    };
    let out = (0..rows).flat_map(|r| data[r * width + cols.start..r * width + cols.end].iter().copied()).collect();
    HostWeight { rows, cols: cols.len(), data: WeightData::F32(out) }
}

/// The row-wise concatenation of matrices of one width: in their block format when
/// they share one, as Q8_0 when each converts to it exactly (a file's Q5_0 Q and K
/// beside its Q8_0 V), in f32 when all are f32, else as a stack of the parts, each kept
/// as it is.
pub(super) fn stack(parts: Vec<HostWeight>) -> HostWeight {
    // Stacks inside stacks are spliced: the rules apply to the innermost parts.
    let mut parts: Vec<HostWeight> = parts
        .into_iter()
        .flat_map(|p| match p.data {
            WeightData::Stacked(inner) => inner,
            data => vec![HostWeight { data, ..p }],
        })
        .collect();
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    let cols = parts[0].cols;
    let rows = parts.iter().map(|p| p.rows).sum();
    if parts.iter().all(|p| matches!(p.data, WeightData::F32(_))) {
        return HostWeight {
            rows,
            cols,
            data: WeightData::F32(parts.into_iter().flat_map(HostWeight::into_f32).collect()),
        };
    }
    let blocks: Option<Vec<(GgmlType, &[u8])>> = parts
        .iter()
        .map(|p| match &p.data {
            WeightData::Blocks { ty, bytes } => Some((*ty, bytes.as_slice())),
            _ => None,
        })
        .collect();
    let block_data = blocks.and_then(|blocks| {
        if blocks.windows(2).all(|w| w[0].0 == w[1].0) {
            return Some(WeightData::Blocks {
                ty: blocks[0].0,
                bytes: blocks.iter().flat_map(|b| b.1).copied().collect(),
            });
        }
        let wide = blocks.iter().map(|&(ty, bytes)| quant::widen_to_q8_0(ty, bytes)).collect::<Option<Vec<_>>>()?;
        Some(WeightData::Blocks { ty: GgmlType::Q8_0, bytes: wide.concat() })
    });
    HostWeight { rows, cols, data: block_data.unwrap_or(WeightData::Stacked(parts)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(w: &HostWeight) -> Vec<f32> {
        w.clone().into_f32()
    }

    #[test]
    fn slices_of_f32_and_block_weights_agree() {
        let (r, c) = (4, 64);
        let v: Vec<f32> = (0..r * c).map(|i| (i % 17) as f32 - 8.0).collect();
        let w = HostWeight { rows: r, cols: c, data: WeightData::F32(v.clone()) };
        let top = rows(w.clone(), 1..3);
        assert_eq!(f32s(&top), v[c..3 * c].to_vec());
        let right = columns(w.clone(), 32..64);
        assert_eq!(f32s(&right), (0..r).flat_map(|i| v[i * c + 32..(i + 1) * c].to_vec()).collect::<Vec<_>>());
        let odd = columns(w.clone(), 5..9);
        assert_eq!(f32s(&odd)[..4], v[5..9]);
        let both = stack(vec![rows(w.clone(), 0..1), rows(w, 3..4)]);
        assert_eq!(both.rows, 2);
        assert_eq!(f32s(&both), [&v[..c], &v[3 * c..]].concat());
    }

    /// Two rows of 32 in `ty`: scale 0.5, the bytes after it counting up.
    fn block_rows(ty: GgmlType) -> HostWeight {
        let mut bytes = Vec::new();
        for r in 0..2u8 {
            bytes.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
            bytes.extend((0..ty.block_bytes() as u8 - 2).map(|i| i.wrapping_mul(37).wrapping_add(r)));
        }
        HostWeight { rows: 2, cols: 32, data: WeightData::Blocks { ty, bytes } }
    }

    #[test]
    fn stacking_keeps_blocks_widening_to_q8_0_where_exact() {
        let (q5, q8, q41) = (block_rows(GgmlType::Q5_0), block_rows(GgmlType::Q8_0), block_rows(GgmlType::Q4_1));
        let want = [f32s(&q5), f32s(&q8), f32s(&q5)].concat();
        let mixed = stack(vec![q5.clone(), q8.clone(), q5.clone()]);
        assert!(matches!(mixed.data, WeightData::Blocks { ty: GgmlType::Q8_0, .. }));
        assert_eq!((mixed.rows, f32s(&mixed)), (6, want));
        let same = stack(vec![q5.clone(), q5.clone()]);
        assert!(matches!(same.data, WeightData::Blocks { ty: GgmlType::Q5_0, .. }));
        // Q4_1's offset has no Q8_0 form: each part kept as it is.
        let kept = stack(vec![q41.clone(), q8.clone(), q5.clone()]);
        let WeightData::Stacked(parts) = &kept.data else { panic!("{:?}", kept.data) };
        let types: Vec<_> =
            parts.iter().map(|p| matches!(p.data, WeightData::Blocks { ty, .. } if ty == GgmlType::Q4_1)).collect();
        assert_eq!(types, [true, false, false]);
        assert_eq!((kept.rows, f32s(&kept)), (6, [f32s(&q41), f32s(&q8), f32s(&q5)].concat()));
        // Rows and columns of a stack cut through its parts.
        assert_eq!(f32s(&rows(kept.clone(), 1..4)), f32s(&kept)[32..4 * 32].to_vec());
        let right = columns(kept.clone(), 16..32);
        assert_eq!(f32s(&right), f32s(&kept).chunks(32).flat_map(|r| r[16..].to_vec()).collect::<Vec<_>>());
    }

    #[test]
    fn shards_split_heads_and_columns_or_refuse() {
        let s = Shard { rank: 1, size: 4 };
        assert_eq!(s.range(12), 3..6);
        assert_eq!(Shard::WHOLE.range(7), 0..7);
    }
}
