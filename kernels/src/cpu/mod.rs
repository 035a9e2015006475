//! The CPU backend: rayon for threads, matrix products in register tiles over weights
//! kept quantised where the file had them so. By default products with quantised
//! weights round their inputs to 8 bits and the KV cache holds half floats
//! (`Activations`), as llama.cpp does.
//! It is the reference the CUDA backend is checked against, so clarity wins over
//! cleverness except in `linear` and `paged_attention`, where the time goes.

mod attention;
mod dense_attention;
mod elementwise;
mod huge_pages;
mod int8;
mod key_scores;
mod kv_store;
mod matmul;
mod quant_rows;
mod repack;
mod simd;
mod tiles;
mod weight;

pub use quant_rows::QuantRows;
#[cfg(test)]
pub(crate) use quant_rows::tests::{FORMATS as QUANT_ROWS_FORMATS, random_blocks as quant_rows_test_blocks};
pub use simd::dispatched_path;
pub use weight::CpuWeight;

use crate::error::expect_len;
use crate::quant;
use crate::{AttentionShape, Backend, Gelu, HostWeight, KernelError, PagedBatch, Result, RopeStyle, WeightData};
use kv_store::KvStore;

/// The CPU backend. `Default` serves: integer products for quantised weights.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend {
    pub activations: Activations,
}

/// What products with quantised weights multiply them by.
///
/// `Int8` rounds each block of 32 inputs to bytes and multiplies in integers
/// (`int8`): 2–4× faster than dequantising the weights to f32, and the error is that
/// of llama.cpp on the same files — each input moves by at most half its block's scale.
/// It serves by default because on the CPU a quantised model's speed is these
/// products. `F32` keeps the inputs exact (the weights dequantised in registers): the
/// reference that tests compare other backends and other implementations with.
/// Products with f32 weights are f32 in both.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Activations {
    #[default]
    Int8,
    F32,
}

impl CpuBackend {
    /// Inputs kept exact: the reference path.
    pub const fn exact() -> Self {
        Self { activations: Activations::F32 }
    }

    /// The served path keeps keys and values as half floats, as llama.cpp does (half
    /// the bytes attention streams); the exact path keeps them f32.
    fn kv_store(&self) -> KvStore {
        match self.activations {
            Activations::Int8 => KvStore::F16,
            Activations::F32 => KvStore::F32,
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type Index = Vec<u32>;
    type Weight = CpuWeight;
    type Graph = ();

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, data: &[f32]) -> Result<Vec<f32>> {
        Ok(data.to_vec())
    }

    fn upload_index(&self, data: &[u32]) -> Result<Vec<u32>> {
        Ok(data.to_vec())
    }

    fn zeros(&self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn download(&self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }

    fn upload_weight(&self, w: HostWeight) -> Result<CpuWeight> {
        w.check("upload_weight")?;
        let (rows, cols) = (w.rows, w.cols);
        Ok(match w.data {
            WeightData::F32(data) => CpuWeight::f32(data, rows, cols),
            WeightData::Blocks { ty, bytes } => match QuantRows::from_blocks(ty, &bytes, cols) {
                Some(q) => CpuWeight::quantized(q, rows, cols),
                None => CpuWeight::f32(quant::dequantize(ty, &bytes), rows, cols),
            },
            data @ (WeightData::Fp8(_) | WeightData::Int4(_)) => {
                CpuWeight::f32(HostWeight { rows, cols, data }.into_f32(), rows, cols)
            }
            WeightData::Stacked(parts) => {
                let parts = parts.into_iter().map(|p| self.upload_weight(p)).collect::<Result<Vec<_>>>()?;
                CpuWeight::stacked(parts, rows, cols)
            }
        })
    }

    fn write_index(&self, dst: &mut Vec<u32>, data: &[u32]) -> Result<()> {
        expect_len("write_index", "data", data.len(), dst.len())?;
        dst.copy_from_slice(data);
        Ok(())
    }

    fn copy_into(&self, src: &Vec<f32>, dst: &mut Vec<f32>) -> Result<()> {
        expect_len("copy_into", "source", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn replay(&self, _graph: &()) -> Result<()> {
        Err(KernelError::shape("replay", "the CPU backend records no graphs"))
    }

    fn step<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        rayon::scope(|_| f())
    }

    fn embedding(&self, ids: &Vec<u32>, table: &CpuWeight) -> Result<Vec<f32>> {
        elementwise::embedding(ids, table)
    }

    fn linear(&self, x: &Vec<f32>, tokens: usize, w: &CpuWeight, bias: Option<&Vec<f32>>) -> Result<Vec<f32>> {
        expect_len("linear", "input", x.len(), tokens * w.cols)?;
        if let Some(b) = bias {
            expect_len("linear", "bias", b.len(), w.rows)?;
        }
        Ok(matmul::linear(x, tokens, w, bias.map(|b| b.as_slice()), self.activations))
    }

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32) -> Result<Vec<f32>> {
        elementwise::rms_norm(x, weight, eps)
    }

    fn add_assign(&self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        expect_len("add_assign", "y", y.len(), x.len())?;
        x.iter_mut().zip(y.iter()).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        positions: &Vec<u32>,
        heads: usize,
        head_dim: usize,
        inv_freq: &Vec<f32>,
        style: RopeStyle,
    ) -> Result<()> {
        elementwise::rope(x, positions, heads, head_dim, inv_freq, style)
    }

    fn silu_mul(&self, gate_up: &Vec<f32>, width: usize) -> Result<Vec<f32>> {
        elementwise::silu_mul(gate_up, width)
    }

    fn softmax(&self, x: &mut Vec<f32>, cols: usize) -> Result<()> {
        elementwise::softmax(x, cols)
    }

    fn split_columns(&self, x: &Vec<f32>, widths: &[usize]) -> Result<Vec<Vec<f32>>> {
        elementwise::split_columns(x, widths)
    }

    fn gather_rows(&self, x: &Vec<f32>, cols: usize, rows: &Vec<u32>) -> Result<Vec<f32>> {
        elementwise::gather_rows(x, cols, rows)
    }

    fn layer_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, bias: &Vec<f32>, eps: f32) -> Result<Vec<f32>> {
        elementwise::layer_norm(x, weight, bias, eps)
    }

    fn gelu(&self, x: &mut Vec<f32>, kind: Gelu) -> Result<()> {
        elementwise::gelu(x, kind);
        Ok(())
    }

    fn scatter_rows(&self, x: &mut Vec<f32>, cols: usize, rows: &Vec<u32>, src: &Vec<f32>) -> Result<()> {
        elementwise::scatter_rows(x, cols, rows, src)
    }

    fn dense_attention(
        &self,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        seqs: usize,
        heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Result<Vec<f32>> {
        dense_attention::dense_attention(q, k, v, &dense_attention::Dims { seqs, heads, head_dim, scale })
    }

    fn write_kv(
        &self,
        k: &Vec<f32>,
        v: &Vec<f32>,
        slots: &Vec<u32>,
        shape: &AttentionShape,
        k_cache: &mut Vec<f32>,
        v_cache: &mut Vec<f32>,
    ) -> Result<()> {
        attention::write_kv(k, v, slots, shape, (k_cache, v_cache), self.kv_store())
    }

    fn kv_element_bytes(&self) -> usize {
        self.kv_store().element_bytes()
    }

    fn kv_save_blocks(&self, cache: &Vec<f32>, block_elems: usize, ids: &[u32], out: &mut Vec<u8>) -> Result<()> {
        let floats = kv_store::block_floats(self.kv_store(), block_elems, "kv_save_blocks")?;
        for &id in ids {
            let block = kv_store::block_range(cache.len(), floats, id, "kv_save_blocks")?;
            out.extend_from_slice(bytemuck::cast_slice(&cache[block]));
        }
        Ok(())
    }

    fn kv_load_blocks(&self, cache: &mut Vec<f32>, block_elems: usize, ids: &[u32], data: &[u8]) -> Result<()> {
        let floats = kv_store::block_floats(self.kv_store(), block_elems, "kv_load_blocks")?;
        expect_len("kv_load_blocks", "saved blocks", data.len(), ids.len() * floats * 4)?;
        for (&id, saved) in ids.iter().zip(data.chunks_exact(floats * 4)) {
            let block = kv_store::block_range(cache.len(), floats, id, "kv_load_blocks")?;
            bytemuck::cast_slice_mut::<f32, u8>(&mut cache[block]).copy_from_slice(saved);
        }
        Ok(())
    }

    fn kv_zeros(&self, len: usize) -> Result<Vec<f32>> {
        // Zeroed pages not yet touched: advised first, they fault in huge.
        let cache = vec![0.0; self.kv_store().buffer_floats(len)];
        huge_pages::advise_untouched(&cache);
        Ok(cache)
    }

    fn paged_attention(
        &self,
        q: &Vec<f32>,
        k_cache: &Vec<f32>,
        v_cache: &Vec<f32>,
        batch: &PagedBatch<'_, Self>,
        shape: &AttentionShape,
    ) -> Result<Vec<f32>> {
        attention::paged_attention(q, (k_cache, v_cache), self.kv_store(), batch, shape)
    }
}
