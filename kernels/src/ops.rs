//! The `Backend` trait: every op the model needs, and the shapes they share.

use crate::Result;
use crate::pick::{PickRow, Picked};
use crate::quant::{Fp8Weight, GgmlType, Int4Weight};

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Pairs (2i, 2i+1): GGUF llama-arch weights, whose Q/K rows llama.cpp permuted.
    Interleaved,
    /// Pairs (i, i + d/2), "rotate half": Hugging Face checkpoints and GGUF qwen2.
    Neox,
}

/// Head layout shared by the attention ops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// Multiplier on q·k, usually 1/sqrt(head_dim).
    pub scale: f32,
}

impl AttentionShape {
    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Floats in one block of one layer's key (or value) cache.
    pub fn block_floats(&self) -> usize {
        self.block_size * self.kv_width()
    }
}

/// The GELU variants vision towers and projectors use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `x·Φ(x)` with the exact error function (PyTorch's "gelu").
    Erf,
    /// The tanh approximation ("gelu_pytorch_tanh", SigLIP).
    Tanh,
    /// `x·σ(1.702x)` ("quick_gelu", OpenAI's CLIP).
    Quick,
}

/// A weight matrix `[rows, cols]` as a model file holds it.
#[derive(Debug, Clone)]
pub struct HostWeight {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

#[derive(Debug, Clone)]
pub enum WeightData {
    /// Row-major f32.
    F32(Vec<f32>),
    /// Rows of whole ggml blocks, row after row.
    Blocks { ty: GgmlType, bytes: Vec<u8> },
    /// E4M3 bytes with block scales (FP8 checkpoints).
    Fp8(Fp8Weight),
    /// 4-bit integers with group scales and zeros (AWQ and GPTQ checkpoints).
    Int4(Int4Weight),
    /// Groups of rows in order, each in its own format: a fused matrix whose parts the
    /// file stores in formats with no common exact form (Q4_K Q and K beside a Q6_K V).
    Stacked(Vec<HostWeight>),
}

impl HostWeight {
    /// That the data fits `[rows, cols]`: its length, whole blocks, scales and zeros,
    /// and every part of a stack (its columns, the rows they add up to).
    pub fn check(&self, op: &'static str) -> Result<()> {
        let (rows, cols) = (self.rows, self.cols);
        let misfit = |what: &str| Err(crate::KernelError::shape(op, format!("{what} do not fit [{rows}, {cols}]")));
        match &self.data {
            WeightData::F32(v) => crate::error::expect_len(op, "weight", v.len(), rows * cols),
            WeightData::Blocks { ty, bytes } => match ty.bytes_for(cols) {
                Some(row_bytes) => crate::error::expect_len(op, "weight bytes", bytes.len(), rows * row_bytes),
                None => misfit(&format!("rows of whole {ty:?} blocks")),
            },
            WeightData::Fp8(w) if !w.fits(rows, cols) => misfit("FP8 bytes and scales"),
            WeightData::Int4(w) if !w.fits(rows, cols) => misfit("4-bit values, scales and zeros"),
            WeightData::Fp8(_) | WeightData::Int4(_) => Ok(()),
            WeightData::Stacked(parts) => {
                if parts.iter().any(|p| p.cols != cols) || parts.iter().map(|p| p.rows).sum::<usize>() != rows {
                    return misfit("stacked parts");
                }
                parts.iter().try_for_each(|p| p.check(op))
            }
        }
    }

    /// The matrix as row-major f32, blocks decoded.
    pub fn into_f32(self) -> Vec<f32> {
        match self.data {
            WeightData::F32(v) => v,
            WeightData::Blocks { ty, bytes } => crate::quant::dequantize(ty, &bytes),
            WeightData::Fp8(w) => w.dequantize(self.cols),
            WeightData::Int4(w) => w.dequantize(self.cols),
            WeightData::Stacked(parts) => parts.into_iter().flat_map(HostWeight::into_f32).collect(),
        }
    }
}

/// A flattened batch of sequences for paged attention (varlen layout).
///
/// Sequence `s` owns query rows `query_start[s]..query_start[s+1]`; after this step it
/// has `context_lens[s]` tokens in the cache, the new ones last, so query row `i` of it
/// sits at position `context_lens[s] - q_len + i` and attends to positions `0..=that`.
/// Block `b` of sequence `s` is `block_tables[s * max_blocks_per_seq + b]`.
pub struct PagedBatch<'a, B: Backend + ?Sized> {
    pub num_seqs: usize,
    pub query_start: &'a B::Index,
    pub context_lens: &'a B::Index,
    pub block_tables: &'a B::Index,
    pub max_blocks_per_seq: usize,
}

/// A device that runs the op set. Buffers are f32; weights may be stored in any format
/// the device multiplies fast (the CPU keeps f32).
///
/// Every op checks the sizes it is given and fails with `KernelError::Shape` rather than
/// reading out of bounds.
pub trait Backend: Send + Sync {
    /// A device buffer of f32.
    type Buffer: Send + Sync;
    /// A device buffer of u32 (token ids, positions, slots, block tables).
    type Index: Send + Sync;
    /// A weight matrix `[rows, cols]`, row-major, ready for `linear`.
    type Weight: Send + Sync;
    /// Bytes one element of a `Buffer` made by the ops takes (a KV cache may differ:
    /// `kv_element_bytes`).
    const ELEMENT_BYTES: usize = 4;
    /// A recorded sequence of launches, replayed over the same buffers (a CUDA graph).
    type Graph: Send + Sync;

    fn name(&self) -> &'static str;

    fn upload(&self, data: &[f32]) -> Result<Self::Buffer>;
    fn upload_index(&self, data: &[u32]) -> Result<Self::Index>;
    fn zeros(&self, len: usize) -> Result<Self::Buffer>;
    fn download(&self, buf: &Self::Buffer) -> Result<Vec<f32>>;
    /// Places a weight on the device, in whatever format it multiplies best.
    fn upload_weight(&self, weight: HostWeight) -> Result<Self::Weight>;

    /// Overwrites `dst` with `data` (the same length) in place, so that a graph that
    /// recorded its address reads the new values.
    fn write_index(&self, dst: &mut Self::Index, data: &[u32]) -> Result<()>;
    /// Copies `src` into `dst` (the same length) in place.
    fn copy_into(&self, src: &Self::Buffer, dst: &mut Self::Buffer) -> Result<()>;

    /// Records what `f` launches as a graph instead of running it. Backends that cannot
    /// record (the CPU) return None without calling `f`. Everything `f` allocates it
    /// must also free; what it writes for later must go into buffers made before.
    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>> {
        let _ = f;
        Ok(None)
    }
    /// Runs a captured graph (asynchronously, like any op).
    fn replay(&self, graph: &Self::Graph) -> Result<()>;

    /// Bytes one element of a KV cache takes (`kv_zeros`).
    fn kv_element_bytes(&self) -> usize {
        Self::ELEMENT_BYTES
    }

    /// A zeroed KV cache buffer of `len` elements, in the form `write_kv` and
    /// `paged_attention` read (the CPU's served path packs half floats).
    fn kv_zeros(&self, len: usize) -> Result<Self::Buffer> {
        self.zeros(len)
    }

    /// Appends whole blocks of a KV cache buffer (`kv_zeros`; `[blocks, block_elems]`) to
    /// `out`, in the order of `ids`, as stored (`kv_element_bytes` an element): what a
    /// second KV tier keeps of a block evicted from the device.
    fn kv_save_blocks(&self, cache: &Self::Buffer, block_elems: usize, ids: &[u32], out: &mut Vec<u8>) -> Result<()>;

    /// Writes blocks saved by `kv_save_blocks` (`ids.len()` of them, in order) into
    /// blocks `ids` of a KV cache buffer.
    fn kv_load_blocks(&self, cache: &mut Self::Buffer, block_elems: usize, ids: &[u32], data: &[u8]) -> Result<()>;

    /// Runs `f`, one forward step's ops, where this backend runs them best: the CPU
    /// backend runs the step on its thread pool, so that each of the step's hundreds of
    /// parallel products forks from a pool thread — whose partner is still awake from
    /// the last one — instead of waking the pool from outside and sleeping until it is
    /// done.
    fn step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    /// Each row's token picked from `logits` (`[rows.len(), vocab]`) on the device; None
    /// where the backend leaves sampling to the host (the CPU, whose logits are host
    /// memory).
    fn device_pick(&self, logits: &Self::Buffer, vocab: usize, rows: &[PickRow]) -> Result<Option<Vec<Picked>>> {
        let _ = (logits, vocab, rows);
        Ok(None)
    }

    /// `out[t] = table[ids[t]]`, rows of `table.cols` floats.
    fn embedding(&self, ids: &Self::Index, table: &Self::Weight) -> Result<Self::Buffer>;

    /// `out[t] = x[t] · wᵀ (+ bias)`: x is `[tokens, w.cols]`, out `[tokens, w.rows]`.
    fn linear(
        &self,
        x: &Self::Buffer,
        tokens: usize,
        w: &Self::Weight,
        bias: Option<&Self::Buffer>,
    ) -> Result<Self::Buffer>;

    /// Row-wise RMSNorm of `[rows, weight.len()]`.
    fn rms_norm(&self, x: &Self::Buffer, weight: &Self::Buffer, eps: f32) -> Result<Self::Buffer>;

    /// `x += y`, elementwise (the residual stream).
    fn add_assign(&self, x: &mut Self::Buffer, y: &Self::Buffer) -> Result<()>;

    /// `h += y`, then `rms_norm(h)`: the residual add fused with the norm after it.
    fn add_rms_norm(
        &self,
        h: &mut Self::Buffer,
        y: &Self::Buffer,
        weight: &Self::Buffer,
        eps: f32,
    ) -> Result<Self::Buffer> {
        self.add_assign(h, y)?;
        self.rms_norm(h, weight, eps)
    }

    /// In-place rotary embedding of `x`: `[tokens, heads, head_dim]`, token `t` at
    /// `positions[t]`, rotating the first `2 * inv_freq.len()` dimensions of each head.
    fn rope(
        &self,
        x: &mut Self::Buffer,
        positions: &Self::Index,
        heads: usize,
        head_dim: usize,
        inv_freq: &Self::Buffer,
        style: RopeStyle,
    ) -> Result<()>;

    /// `out = silu(gate) * up`, elementwise; `gate_up` is `[rows, 2 * width]` with the
    /// gate first in each row.
    fn silu_mul(&self, gate_up: &Self::Buffer, width: usize) -> Result<Self::Buffer>;

    /// An MLP's activation from its fused `[gate; up]` projection: `silu_mul(linear(x, w),
    /// width)` with `w` `2 · width` rows. The default composes the two; a GPU takes a
    /// decode batch's in one pass over the weight, the products never written.
    fn linear_silu_mul(
        &self,
        x: &Self::Buffer,
        tokens: usize,
        gate_up: &Self::Weight,
        width: usize,
    ) -> Result<Self::Buffer> {
        let product = self.linear(x, tokens, gate_up, None)?;
        self.silu_mul(&product, width)
    }

    /// In-place softmax of each row of `[rows, cols]`.
    fn softmax(&self, x: &mut Self::Buffer, cols: usize) -> Result<()>;

    /// Splits each row of `[rows, sum(widths)]` into column groups: one buffer
    /// `[rows, width]` per entry of `widths`, in order (Q, K, V out of a fused product).
    fn split_columns(&self, x: &Self::Buffer, widths: &[usize]) -> Result<Vec<Self::Buffer>>;

    /// Rows of `x` (`cols` wide) picked by `rows`, in order.
    fn gather_rows(&self, x: &Self::Buffer, cols: usize, rows: &Self::Index) -> Result<Self::Buffer>;

    /// Row-wise LayerNorm of `[rows, weight.len()]`: `(x - mean) / sqrt(var + eps) * weight + bias`.
    fn layer_norm(
        &self,
        x: &Self::Buffer,
        weight: &Self::Buffer,
        bias: &Self::Buffer,
        eps: f32,
    ) -> Result<Self::Buffer>;

    /// In-place GELU of every element.
    fn gelu(&self, x: &mut Self::Buffer, kind: Gelu) -> Result<()>;

    /// Overwrites row `rows[i]` of `x` (`cols` wide) with row `i` of `src`: image
    /// embeddings put in place of their placeholder tokens.
    fn scatter_rows(&self, x: &mut Self::Buffer, cols: usize, rows: &Self::Index, src: &Self::Buffer) -> Result<()>;

    /// Bidirectional attention within each of `seqs` sequences of equal length (a vision
    /// tower's images): `q`, `k`, `v` are `[seqs * len, heads * head_dim]`, every head
    /// its own K/V head; returns the same shape.
    #[allow(clippy::too_many_arguments)]
    fn dense_attention(
        &self,
        q: &Self::Buffer,
        k: &Self::Buffer,
        v: &Self::Buffer,
        seqs: usize,
        heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Result<Self::Buffer>;

    /// Writes token `t`'s key and value (`[tokens, kv_width]`) into cache slot
    /// `slots[t]` (block `slot / block_size`, offset `slot % block_size`). Caches are
    /// `[blocks, block_size, num_kv_heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn write_kv(
        &self,
        k: &Self::Buffer,
        v: &Self::Buffer,
        slots: &Self::Index,
        shape: &AttentionShape,
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
    ) -> Result<()>;

    /// Attention's inputs from a fused Q/K/V product (`[tokens, q_width + 2 · kv_width]`):
    /// queries and keys rotated at `positions` (as `rope`), keys and values written to the
    /// cache at `slots` (as `write_kv`); returns the rotated queries, `[tokens, q_width]`.
    /// The default composes those ops; a GPU does it in one pass over the product.
    #[allow(clippy::too_many_arguments)]
    fn qkv_to_cache(
        &self,
        qkv: &Self::Buffer,
        positions: &Self::Index,
        inv_freq: &Self::Buffer,
        style: RopeStyle,
        slots: &Self::Index,
        shape: &AttentionShape,
        k_cache: &mut Self::Buffer,
        v_cache: &mut Self::Buffer,
    ) -> Result<Self::Buffer> {
        let (q_width, kv_width) = (shape.q_width(), shape.kv_width());
        let parts = self.split_columns(qkv, &[q_width, kv_width, kv_width])?;
        let Ok([mut q, mut k, v]) = <[Self::Buffer; 3]>::try_from(parts) else {
            return Err(crate::KernelError::shape("qkv_to_cache", "split_columns returned another number of parts"));
        };
        self.rope(&mut q, positions, shape.num_heads, shape.head_dim, inv_freq, style)?;
        self.rope(&mut k, positions, shape.num_kv_heads, shape.head_dim, inv_freq, style)?;
        self.write_kv(&k, &v, slots, shape, k_cache, v_cache)?;
        Ok(q)
    }

    /// Causal attention of the batch's query rows (`[tokens, num_heads, head_dim]`) over
    /// keys and values read through each sequence's block table; grouped-query heads
    /// share a KV head. Returns `[tokens, num_heads * head_dim]`.
    fn paged_attention(
        &self,
        q: &Self::Buffer,
        k_cache: &Self::Buffer,
        v_cache: &Self::Buffer,
        batch: &PagedBatch<'_, Self>,
        shape: &AttentionShape,
    ) -> Result<Self::Buffer>;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Fp8Weight, Int4Weight};

    fn w(rows: usize, cols: usize, data: WeightData) -> HostWeight {
        HostWeight { rows, cols, data }
    }

    /// Every form is checked against its shape before a kernel reads it, a stack's
    /// parts included; a misfit is a shape error naming the upload.
    #[test]
    fn weights_that_do_not_fit_their_shape_are_refused() {
        let q8 =
            |rows: usize, bytes: usize| w(rows, 32, WeightData::Blocks { ty: GgmlType::Q8_0, bytes: vec![0; bytes] });
        let fp8 = |scales: usize| {
            w(2, 32, WeightData::Fp8(Fp8Weight { bytes: vec![0; 64], scales: vec![1.0; scales], block: [1, 32] }))
        };
        let int4 = |zeros: usize| {
            let q = Int4Weight { nibbles: vec![0; 32], scales: vec![1.0; 2], zeros: vec![0; zeros], group: 32 };
            w(2, 32, WeightData::Int4(q))
        };
        let good = [w(2, 3, WeightData::F32(vec![0.0; 6])), q8(2, 68), fp8(2), int4(2)];
        for g in &good {
            assert!(g.check("upload_weight").is_ok(), "{g:?}");
        }
        let stack = |parts: Vec<HostWeight>, rows: usize| w(rows, 32, WeightData::Stacked(parts));
        let bad = [
            w(2, 3, WeightData::F32(vec![0.0; 5])),
            q8(2, 67),
            w(1, 30, WeightData::Blocks { ty: GgmlType::Q8_0, bytes: vec![0; 34] }),
            fp8(3),
            int4(1),
            stack(vec![q8(2, 68), fp8(2)], 5),
            stack(vec![q8(2, 68), q8(1, 33)], 3),
            stack(vec![q8(2, 68), w(1, 31, WeightData::F32(vec![0.0; 31]))], 3),
        ];
        for b in &bad {
            let err = b.check("upload_weight").expect_err("refused");
            assert!(err.to_string().contains("upload_weight"), "{err}");
        }
        assert!(stack(vec![q8(2, 68), fp8(2)], 4).check("upload_weight").is_ok());
    }
}
