//! Weights kept on the device in their file's ggml block format (`kernels/cuda/quant.cu`
//! decodes them as it reads): a Q4_1 model takes its 0.625 bytes a weight on the GPU,
//! not a bf16 copy's 2, and a decode step streams that much less. Products of up to
//! `GEMV_MAX_TOKENS` tokens (decode) run one warp per weight row; more (prefill) run a
//! tiled kernel that decodes each 64-row tile once for 64 tokens.

use super::{Blocks, CudaBackend, CudaIndex, launch, u32_of};
use crate::quant::GgmlType;
use crate::{KernelError, Result};
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

/// The block formats quant.cu reads, with the names of their kernels.
const DEVICE_FORMATS: [(GgmlType, &str); 7] = [
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q5K, "q5_k"),
    (GgmlType::Q6K, "q6_k"),
];

/// GEMV_MAX_T in quant.cu.
const GEMV_MAX_TOKENS: usize = 8;
/// GEMV_WARPS in quant.cu: rows per block of the decode kernel.
const GEMV_WARPS: u32 = 4;
/// TILE and TILE_THREADS in quant.cu.
const TILE: usize = 64;
const TILE_THREADS: u32 = 256;

/// One format's kernels.
pub(super) struct QuantKernels {
    ty: GgmlType,
    gemv: CudaFunction,
    gemm: CudaFunction,
    embedding: CudaFunction,
}

/// Whether quant.cu reads `ty`; other formats are widened to bf16 on upload.
pub(super) fn on_device(ty: GgmlType) -> bool {
    DEVICE_FORMATS.iter().any(|&(t, _)| t == ty)
}

pub(super) fn load(find: &dyn Fn(&str) -> Result<CudaFunction>) -> Result<Vec<QuantKernels>> {
    DEVICE_FORMATS
        .iter()
        .map(|&(ty, name)| {
            Ok(QuantKernels {
                ty,
                gemv: find(&format!("gemv_{name}"))?,
                gemm: find(&format!("gemm_{name}"))?,
                embedding: find(&format!("embedding_{name}"))?,
            })
        })
        .collect()
}

impl CudaBackend {
    fn quant_kernels(&self, op: &'static str, ty: GgmlType) -> Result<&QuantKernels> {
        self.k
            .quant
            .iter()
            .find(|k| k.ty == ty)
            .ok_or_else(|| KernelError::Device { op, detail: format!("no kernels for {ty:?} weights") })
    }

    /// `out[tokens, rows] = x[tokens, cols] · wᵀ`; the caller checked `x`'s length.
    pub(super) fn blocks_linear(
        &self,
        op: &'static str,
        x: &CudaSlice<bf16>,
        tokens: usize,
        (rows, cols): (usize, usize),
        w: &Blocks,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let k = self.quant_kernels(op, w.ty)?;
        let (r, c, t, row_bytes) = (u32_of(op, rows)?, u32_of(op, cols)?, u32_of(op, tokens)?, w.row_bytes as u64);
        let (func, cfg) = if tokens <= GEMV_MAX_TOKENS {
            let grid = (r.div_ceil(GEMV_WARPS), 1, 1);
            (&k.gemv, LaunchConfig { grid_dim: grid, block_dim: (GEMV_WARPS * 32, 1, 1), shared_mem_bytes: 0 })
        } else {
            let grid = (u32_of(op, rows.div_ceil(TILE))?, u32_of(op, tokens.div_ceil(TILE))?, 1);
            if grid.1 > 65_535 {
                return Err(KernelError::shape(op, format!("{tokens} tokens in one product")));
            }
            (&k.gemm, LaunchConfig { grid_dim: grid, block_dim: (TILE_THREADS, 1, 1), shared_mem_bytes: 0 })
        };
        let mut l = self.stream.launch_builder(func);
        l.arg(out).arg(&w.bytes).arg(x).arg(&r).arg(&c).arg(&t).arg(&row_bytes);
        launch(&mut l, cfg, op)
    }

    /// Rows `ids` of a block-format table, decoded; the caller checked the ids.
    pub(super) fn blocks_embedding(
        &self,
        op: &'static str,
        ids: &CudaIndex,
        cols: usize,
        table: &Blocks,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let k = self.quant_kernels(op, table.ty)?;
        let (c, row_bytes) = (u32_of(op, cols)?, table.row_bytes as u64);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(op, ids.host.len())?, 1, 1),
            block_dim: (((cols / 32).clamp(1, 256) as u32).next_multiple_of(32), 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&k.embedding);
        l.arg(out).arg(&ids.dev).arg(&table.bytes).arg(&c).arg(&row_bytes);
        launch(&mut l, cfg, op)
    }
}
