//! Tensor parallelism, Megatron style: rank r of n holds heads r·H/n .. (r+1)·H/n of
//! the attention (their Q, K and V rows and the matching columns of the output
//! projection) and the same slice of the MLP's columns (gate and up rows, down
//! columns). The output and down projections are row-parallel: each rank's product is
//! a partial sum, added across ranks by an all-reduce. Embeddings, norms and the LM
//! head are replicated.

use super::ModelError;
use super::config::ModelConfig;
use std::ops::Range;
use tessera_kernels::quant::{self, Fp8Weight, GgmlType, Int4Weight};
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
        WeightData::Fp8(f) => match fp8_rows(&f, cols, &rows) {
            Some(f) => WeightData::Fp8(f),
            None => {
                let all = HostWeight { rows: w.rows, cols, data: WeightData::Fp8(f) }.into_f32();
                WeightData::F32(all[rows.start * cols..rows.end * cols].to_vec())
            }
        },
        WeightData::Int4(q) => {
            let (half, g) = (cols / 2, q.groups(cols));
            WeightData::Int4(Int4Weight {
                nibbles: q.nibbles[rows.start * half..rows.end * half].to_vec(),
                scales: q.scales[rows.start * g..rows.end * g].to_vec(),
                zeros: q.zeros[rows.start * g..rows.end * g].to_vec(),
                group: q.group,
            })
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

/// Rows `rows` of an FP8 matrix, when they start and end on its scale blocks' rows.
fn fp8_rows(f: &Fp8Weight, cols: usize, rows: &Range<usize>) -> Option<Fp8Weight> {
    let (br, sc) = (f.block[0], f.scale_cols(cols));
    let end_rows = f.bytes.len() / cols.max(1);
    if !rows.start.is_multiple_of(br) || !(rows.end.is_multiple_of(br) || rows.end == end_rows) {
        return None;
    }
    Some(Fp8Weight {
        bytes: f.bytes[rows.start * cols..rows.end * cols].to_vec(),
        scales: f.scales[rows.start / br * sc..rows.end.div_ceil(br) * sc].to_vec(),
        block: f.block,
    })
}

/// Every row's columns `range` of a matrix `width` wide stored as `per_row` items a row.
fn row_slices<T: Copy>(data: &[T], per_row: usize, range: Range<usize>) -> Vec<T> {
    data.chunks_exact(per_row.max(1)).flat_map(|row| row[range.clone()].iter().copied()).collect()
}

/// Columns `cols` of `w`; block rows, FP8 scale blocks and 4-bit groups are cut at their
/// boundaries when the range falls on them, else dequantised first.
pub(super) fn columns(w: HostWeight, cols: Range<usize>) -> HostWeight {
    let HostWeight { rows, cols: width, data } = w;
    // On the blocks' or groups' boundaries; one that spans the row is cut with it.
    let on = |unit: usize| {
        unit >= width || cols.start.is_multiple_of(unit) && (cols.end.is_multiple_of(unit) || cols.end == width)
    };
    let data = match data {
        WeightData::Fp8(f) if on(f.block[1]) => {
            let (bc, sc) = (f.block[1], f.scale_cols(width));
            let data = WeightData::Fp8(Fp8Weight {
                bytes: row_slices(&f.bytes, width, cols.clone()),
                scales: row_slices(&f.scales, sc, cols.start / bc..cols.end.div_ceil(bc)),
                block: f.block,
            });
            return HostWeight { rows, cols: cols.len(), data };
        }
        WeightData::Int4(q) if on(q.group) && cols.start.is_multiple_of(2) && cols.len().is_multiple_of(2) => {
            let (g, groups) = (q.group, q.groups(width));
            let data = WeightData::Int4(Int4Weight {
                nibbles: row_slices(&q.nibbles, width / 2, cols.start / 2..cols.end / 2),
                scales: row_slices(&q.scales, groups, cols.start / g..cols.end.div_ceil(g)),
                zeros: row_slices(&q.zeros, groups, cols.start / g..cols.end.div_ceil(g)),
                group: g,
            });
            return HostWeight { rows, cols: cols.len(), data };
        }
        data @ (WeightData::Fp8(_) | WeightData::Int4(_)) => HostWeight { rows, cols: width, data }.into_f32(),
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
    if let Some(data) = stack_fp8(&parts).or_else(|| stack_int4(&parts)) {
        return HostWeight { rows, cols, data };
    }
    let blocks = all_parts(&parts, |d| match d {
        WeightData::Blocks { ty, bytes } => Some((*ty, bytes.as_slice())),
        _ => None,
    });
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

/// Each part's data in one form, or None where a part has another.
fn all_parts<'a, T>(parts: &'a [HostWeight], form: impl Fn(&'a WeightData) -> Option<T>) -> Option<Vec<T>> {
    parts.iter().map(|p| form(&p.data)).collect()
}

/// FP8 parts with blocks of one width, as one: their scales as they are where the
/// blocks have one height and each part but the last is whole blocks of rows, else
/// repeated as blocks of one row (K's 128 rows beside Q's 128 × 128 blocks).
fn stack_fp8(parts: &[HostWeight]) -> Option<WeightData> {
    let fp8 = all_parts(parts, |d| match d {
        WeightData::Fp8(f) => Some(f),
        _ => None,
    })?;
    let block = fp8[0].block;
    if fp8.iter().any(|f| f.block[1] != block[1]) {
        return None;
    }
    let aligned = fp8.iter().all(|f| f.block == block)
        && parts[..parts.len() - 1].iter().all(|p| p.rows.is_multiple_of(block[0]));
    let (scales, block) = match aligned {
        true => (fp8.iter().flat_map(|f| f.scales.iter().copied()).collect(), block),
        false => (parts.iter().zip(&fp8).flat_map(|(p, f)| f.row_scales(p.rows, p.cols)).collect(), [1, block[1]]),
    };
    Some(WeightData::Fp8(Fp8Weight {
        bytes: fp8.iter().flat_map(|f| f.bytes.iter().copied()).collect(),
        scales,
        block,
    }))
}

/// 4-bit parts with one group size, as one.
fn stack_int4(parts: &[HostWeight]) -> Option<WeightData> {
    let q = all_parts(parts, |d| match d {
        WeightData::Int4(q) => Some(q),
        _ => None,
    })?;
    let group = q[0].group;
    if q.iter().any(|q| q.group != group) {
        return None;
    }
    Some(WeightData::Int4(Int4Weight {
        nibbles: q.iter().flat_map(|q| q.nibbles.iter().copied()).collect(),
        scales: q.iter().flat_map(|q| q.scales.iter().copied()).collect(),
        zeros: q.iter().flat_map(|q| q.zeros.iter().copied()).collect(),
        group,
    }))
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

    /// FP8 and 4-bit matrices keep their form through row and column slices and
    /// stacks that fall on their scale blocks and groups, and read as the same values
    /// when they are decoded because a cut does not.
    #[test]
    fn fp8_and_int4_slice_and_stack_on_their_blocks() {
        let (r, c) = (6, 64);
        let bytes: Vec<u8> = (0..r * c).map(|i| (i * 7 % 120) as u8).collect();
        let fp8 = |block: [usize; 2], scales: usize| HostWeight {
            rows: r,
            cols: c,
            data: WeightData::Fp8(Fp8Weight {
                bytes: bytes.clone(),
                scales: (0..scales).map(|i| 0.5 + i as f32).collect(),
                block,
            }),
        };
        let int4 = HostWeight {
            rows: r,
            cols: c,
            data: WeightData::Int4(Int4Weight {
                nibbles: bytes[..r * c / 2].to_vec(),
                scales: (0..r * 2).map(|i| 0.25 * i as f32).collect(),
                zeros: (0..r * 2).map(|i| (i % 17) as u8).collect(),
                group: 32,
            }),
        };
        for w in [fp8([2, 32], 3 * 2), fp8([1, 32], 6 * 2), int4] {
            let all = f32s(&w);
            let kept = |x: &HostWeight| matches!(x.data, WeightData::Fp8(_) | WeightData::Int4(_));
            let top = rows(w.clone(), 2..6);
            assert!(kept(&top));
            assert_eq!(f32s(&top), all[2 * c..].to_vec());
            let right = columns(w.clone(), 32..64);
            assert!(kept(&right));
            assert_eq!(f32s(&right), (0..r).flat_map(|i| all[i * c + 32..(i + 1) * c].to_vec()).collect::<Vec<_>>());
            let both = stack(vec![rows(w.clone(), 0..2), rows(w.clone(), 4..6)]);
            assert!(kept(&both));
            assert_eq!(f32s(&both), [&all[..2 * c], &all[4 * c..]].concat());
            // Off the blocks: decoded, the same values.
            let odd = columns(w.clone(), 8..16);
            assert_eq!(f32s(&odd), (0..r).flat_map(|i| all[i * c + 8..i * c + 16].to_vec()).collect::<Vec<_>>());
        }
        // Blocks or groups as wide as the row go with every column cut.
        let per_row = fp8([1, c], 6);
        let right = columns(per_row.clone(), 32..64);
        assert!(matches!(right.data, WeightData::Fp8(_)));
        let all = f32s(&per_row);
        assert_eq!(f32s(&right), (0..r).flat_map(|i| all[i * c + 32..(i + 1) * c].to_vec()).collect::<Vec<_>>());
        // Blocks of different heights stack as blocks of one row.
        let (tall, flat) = (fp8([2, 32], 6), fp8([1, 32], 12));
        let both = stack(vec![rows(tall.clone(), 0..2), rows(flat.clone(), 2..5)]);
        assert!(matches!(&both.data, WeightData::Fp8(f) if f.block == [1, 32]));
        assert_eq!(f32s(&both), [&f32s(&tall)[..2 * c], &f32s(&flat)[2 * c..5 * c]].concat());
        // Row cuts inside a block of two rows read decoded.
        let inside = rows(fp8([2, 32], 6), 1..3);
        assert!(matches!(inside.data, WeightData::F32(_)));
        assert_eq!(f32s(&inside), f32s(&fp8([2, 32], 6))[c..3 * c].to_vec());
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
