//! Weights kept on the device as their checkpoint stores them, decoded by the kernels
//! that read them (`kernels/cuda/quant.cu`): ggml blocks from GGUF files, E4M3 bytes
//! with block scales from FP8 checkpoints, 4-bit integers with group scales and zeros
//! from AWQ/GPTQ ones. A Q4_1 model takes its 0.625 bytes a weight on the GPU, not a
//! bf16 copy's 2, and a decode step streams that much less. Products of up to
//! `GEMV_MAX_TOKENS` tokens (decode) run one warp per weight row; more (prefill, large
//! decode batches) run a tiled kernel that decodes each 64-row tile once for 64 tokens
//! and multiplies on the tensor cores; FP8 weights there, on GPUs that have them, on the
//! FP8 tensor cores as they are, with the activations scaled to E4M3 per token (W8A8).

use super::{CudaBackend, CudaIndex, GEMV_MAX_TOKENS, gemv_config, launch, u32_of};
use crate::quant::GgmlType;
use crate::{HostWeight, KernelError, Result, WeightData};
use cudarc::driver::{CudaFunction, CudaSlice, CudaViewMut, LaunchArgs, LaunchConfig, PushKernelArg};
use half::bf16;

/// TILE and TILE_THREADS in quant.cu.
const TILE: usize = 64;
const TILE_THREADS: u32 = 128;
/// Weights a kernel decodes at a time: scale blocks and groups must be multiples.
const UNIT: usize = 32;
/// Zero bytes after a weight's ggml blocks: quant.cu's `load_words` reads whole aligned
/// words, and the last block of a weight of 18-, 22- or 34-byte blocks can end 2 bytes
/// into one.
const BLOCK_PADDING: usize = 4;

/// A weight's format as the kernels know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    Blocks(GgmlType),
    Fp8,
    Int4,
}

/// Every format quant.cu reads, with its kernels' name.
const FORMATS: [(Format, &str); 9] = [
    (Format::Blocks(GgmlType::Q4_0), "q4_0"),
    (Format::Blocks(GgmlType::Q4_1), "q4_1"),
    (Format::Blocks(GgmlType::Q5_0), "q5_0"),
    (Format::Blocks(GgmlType::Q8_0), "q8_0"),
    (Format::Blocks(GgmlType::Q4K), "q4_k"),
    (Format::Blocks(GgmlType::Q5K), "q5_k"),
    (Format::Blocks(GgmlType::Q6K), "q6_k"),
    (Format::Fp8, "fp8"),
    (Format::Int4, "int4"),
];

/// One format's kernels.
pub(super) struct FormatKernels {
    format: Format,
    gemv: CudaFunction,
    /// gemv over an MLP's [gate; up] halves to silu(gate) · up.
    gemv_glu: CudaFunction,
    gemm: CudaFunction,
    embedding: CudaFunction,
}

/// FP8 weights' products on FP8 tensor cores: activations to E4M3 per token, then the
/// W8A8 tile kernel (compute capability 8.9 and up).
pub(super) struct Fp8TensorCores {
    quantise: CudaFunction,
    gemm: CudaFunction,
}

impl Fp8TensorCores {
    pub(super) fn load(find: &dyn Fn(&str) -> Result<CudaFunction>) -> Result<Self> {
        Ok(Self { quantise: find("quantise_e4m3")?, gemm: find("gemm_fp8_tc")? })
    }
}

/// A token's activations as E4M3 bytes, and each token's scale.
struct Quantised {
    bytes: CudaSlice<u8>,
    scales: CudaSlice<f32>,
}

pub(super) fn load(find: &dyn Fn(&str) -> Result<CudaFunction>) -> Result<Vec<FormatKernels>> {
    FORMATS
        .iter()
        .map(|&(format, name)| {
            Ok(FormatKernels {
                format,
                gemv: find(&format!("gemv_{name}"))?,
                gemv_glu: find(&format!("gemv_glu_{name}"))?,
                gemm: find(&format!("gemm_{name}"))?,
                embedding: find(&format!("embedding_{name}"))?,
            })
        })
        .collect()
}

/// A weight on the device in its checkpoint's format.
pub(super) enum Packed {
    /// Rows of whole ggml blocks, `row_bytes` each.
    Blocks { ty: GgmlType, row_bytes: u64, bytes: CudaSlice<u8> },
    /// `quant::Fp8Weight`'s parts.
    Fp8 { bytes: CudaSlice<u8>, scales: CudaSlice<f32>, block_rows: u32, block_cols: u32 },
    /// `quant::Int4Weight`'s parts.
    Int4 { nibbles: CudaSlice<u8>, scales: CudaSlice<f32>, zeros: CudaSlice<u8>, group: u32 },
    /// Groups of rows in order, each packed its own way (`WeightData::Stacked`: a fused
    /// Q/K/V whose V a Q4_K_M file keeps in Q6_K); each part's product writes its rows
    /// among the others'.
    Stacked(Vec<(usize, Packed)>),
}

impl Packed {
    /// The format of a part that is not a stack.
    fn format(&self) -> Option<Format> {
        match self {
            Packed::Blocks { ty, .. } => Some(Format::Blocks(*ty)),
            Packed::Fp8 { .. } => Some(Format::Fp8),
            Packed::Int4 { .. } => Some(Format::Int4),
            Packed::Stacked(_) => None,
        }
    }

    fn has_fp8(&self) -> bool {
        match self {
            Packed::Fp8 { .. } => true,
            Packed::Stacked(parts) => parts.iter().any(|(_, p)| p.has_fp8()),
            _ => false,
        }
    }

    /// Bytes the weight takes on the device.
    pub(super) fn device_bytes(&self) -> usize {
        match self {
            Packed::Blocks { bytes, .. } => bytes.len() - BLOCK_PADDING,
            Packed::Fp8 { bytes, scales, .. } => bytes.len() + 4 * scales.len(),
            Packed::Int4 { nibbles, scales, zeros, .. } => nibbles.len() + 4 * scales.len() + zeros.len(),
            Packed::Stacked(parts) => parts.iter().map(|(_, p)| p.device_bytes()).sum(),
        }
    }

    /// The decode kernel that takes this weight as an MLP's [gate; up] to silu(gate) · up:
    /// None for a stack, whose halves may differ in format.
    pub(super) fn glu_kernel<'k>(&self, kernels: &'k [FormatKernels]) -> Option<&'k CudaFunction> {
        let format = self.format()?;
        kernels.iter().find(|k| k.format == format).map(|k| &k.gemv_glu)
    }

    /// The weight's own kernel arguments, after the output (and the ids of a lookup).
    pub(super) fn push<'a>(&'a self, l: &mut LaunchArgs<'a>) {
        match self {
            Packed::Blocks { bytes, row_bytes, .. } => l.arg(bytes).arg(row_bytes),
            Packed::Fp8 { bytes, scales, block_rows, block_cols } => {
                l.arg(bytes).arg(scales).arg(block_rows).arg(block_cols)
            }
            Packed::Int4 { nibbles, scales, zeros, group } => l.arg(nibbles).arg(scales).arg(zeros).arg(group),
            Packed::Stacked(_) => unreachable!("stacks launch part by part"),
        };
    }
}

impl CudaBackend {
    /// `w` kept in its format on the device, or None where the kernels do not read that
    /// format or its scales' layout (the caller widens it to bf16). The caller checked
    /// that its parts fit `[rows, cols]`.
    pub(super) fn upload_packed(&self, w: &HostWeight) -> Result<Option<Packed>> {
        const OP: &str = "upload_weight";
        if let WeightData::Stacked(parts) = &w.data {
            // Kept packed only when every part is.
            let mut packed = Vec::with_capacity(parts.len());
            for part in parts {
                match self.upload_packed(part)? {
                    Some(p) if part.cols == w.cols => packed.push((part.rows, p)),
                    _ => return Ok(None),
                }
            }
            return Ok(Some(Packed::Stacked(packed)));
        }
        let whole_units = |n: usize| n.is_multiple_of(UNIT) && n > 0;
        if !whole_units(w.cols) {
            return Ok(None);
        }
        let (rows, cols) = (w.rows, w.cols);
        Ok(match &w.data {
            WeightData::Blocks { ty, bytes } if FORMATS.iter().any(|f| f.0 == Format::Blocks(*ty)) => {
                // Checked by the caller: rows of whole blocks.
                let row_bytes = ty.bytes_for(cols).unwrap_or(0) as u64;
                Some(Packed::Blocks { ty: *ty, row_bytes, bytes: self.htod_padded(OP, bytes)? })
            }
            WeightData::Fp8(f) if whole_units(f.block[1]) || f.block[1] >= cols => Some(Packed::Fp8 {
                bytes: self.htod(OP, &f.bytes)?,
                scales: self.htod(OP, &f.scales)?,
                block_rows: u32_of(OP, f.block[0].min(rows.max(1)))?,
                // One block over the whole row: as wide as the row, a multiple of 32.
                block_cols: u32_of(OP, f.block[1].min(cols))?,
            }),
            WeightData::Int4(q) if whole_units(q.group) || q.group >= cols => Some(Packed::Int4 {
                nibbles: self.htod(OP, &q.nibbles)?,
                scales: self.htod(OP, &q.scales)?,
                zeros: self.htod(OP, &q.zeros)?,
                group: u32_of(OP, q.group.min(cols))?,
            }),
            _ => None,
        })
    }

    /// `bytes` on the device, followed by BLOCK_PADDING zero bytes (only those zeroed).
    fn htod_padded(&self, op: &'static str, bytes: &[u8]) -> Result<CudaSlice<u8>> {
        let mut dev = self.uninit::<u8>(op, bytes.len() + BLOCK_PADDING)?;
        if !bytes.is_empty() {
            self.stream.memcpy_htod(bytes, &mut dev.slice_mut(..bytes.len())).map_err(super::device_err(op))?;
        }
        self.stream.memset_zeros(&mut dev.slice_mut(bytes.len()..)).map_err(super::device_err(op))?;
        Ok(dev)
    }

    fn format_kernels(&self, op: &'static str, w: &Packed) -> Result<&FormatKernels> {
        let format = w.format();
        self.k.packed.iter().find(|k| Some(k.format) == format).ok_or_else(|| {
            let what = format.map_or_else(|| "stacked".to_string(), |f| format!("{f:?}"));
            KernelError::Device { op, detail: format!("no kernels for {what} weights") }
        })
    }

    /// `out[tokens, rows] = x[tokens, cols] · wᵀ`; the caller checked `x`'s length.
    pub(super) fn packed_linear(
        &self,
        op: &'static str,
        x: &CudaSlice<bf16>,
        tokens: usize,
        (rows, cols): (usize, usize),
        w: &Packed,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        let stride = u32_of(op, rows)?;
        // FP8 parts of a product of many tokens take the activations in E4M3, once.
        let xq = match self.k.fp8_tensor_cores.as_ref() {
            Some(tc) if tokens > GEMV_MAX_TOKENS && w.has_fp8() => Some(self.quantise_e4m3(op, tc, x, tokens, cols)?),
            _ => None,
        };
        let Packed::Stacked(parts) = w else {
            return self.part_linear(x, xq.as_ref(), tokens, (rows, cols), w, &mut out.slice_mut(..), stride);
        };
        let mut first = 0;
        for (part_rows, part) in parts {
            let mut view = out.slice_mut(first..);
            self.part_linear(x, xq.as_ref(), tokens, (*part_rows, cols), part, &mut view, stride)?;
            first += part_rows;
        }
        Ok(())
    }

    fn quantise_e4m3(
        &self,
        op: &'static str,
        tc: &Fp8TensorCores,
        x: &CudaSlice<bf16>,
        tokens: usize,
        cols: usize,
    ) -> Result<Quantised> {
        // SAFETY: the kernel writes every byte and scale.
        let mut bytes = unsafe { self.stream.alloc::<u8>(tokens * cols) }.map_err(super::device_err(op))?;
        let mut scales = unsafe { self.stream.alloc::<f32>(tokens) }.map_err(super::device_err(op))?;
        let c = u32_of(op, cols)?;
        let mut l = self.stream.launch_builder(&tc.quantise);
        l.arg(&mut bytes).arg(&mut scales).arg(x).arg(&c);
        launch(&mut l, super::per_row(tokens, 256), op)?;
        Ok(Quantised { bytes, scales })
    }

    /// One packed part's rows of the product, into `out` (its first row's column of the
    /// first token), rows of the output `stride` apart.
    #[allow(clippy::too_many_arguments)]
    fn part_linear(
        &self,
        x: &CudaSlice<bf16>,
        xq: Option<&Quantised>,
        tokens: usize,
        (rows, cols): (usize, usize),
        w: &Packed,
        out: &mut CudaViewMut<'_, bf16>,
        stride: u32,
    ) -> Result<()> {
        let op = "linear";
        let k = self.format_kernels(op, w)?;
        let (r, c, t) = (u32_of(op, rows)?, u32_of(op, cols)?, u32_of(op, tokens)?);
        let (func, cfg) = if tokens <= GEMV_MAX_TOKENS {
            (&k.gemv, gemv_config(r))
        } else {
            let grid = (u32_of(op, rows.div_ceil(TILE))?, u32_of(op, tokens.div_ceil(TILE))?, 1);
            if grid.1 > 65_535 {
                return Err(KernelError::shape(op, format!("{tokens} tokens in one product")));
            }
            (&k.gemm, LaunchConfig { grid_dim: grid, block_dim: (TILE_THREADS, 1, 1), shared_mem_bytes: 0 })
        };
        if let (Some(q), Some(tc), Packed::Fp8 { bytes, scales, block_rows, block_cols }) =
            (xq, self.k.fp8_tensor_cores.as_ref(), w)
        {
            // The tiled kernel's grid, on the FP8 tensor cores.
            let mut l = self.stream.launch_builder(&tc.gemm);
            l.arg(out).arg(bytes).arg(scales).arg(block_rows).arg(block_cols).arg(&q.bytes).arg(&q.scales);
            l.arg(&r).arg(&c).arg(&t).arg(&stride);
            return launch(&mut l, cfg, op);
        }
        let mut l = self.stream.launch_builder(func);
        l.arg(out);
        w.push(&mut l);
        l.arg(x).arg(&r).arg(&c).arg(&t).arg(&stride);
        launch(&mut l, cfg, op)
    }

    /// Rows `ids` of a packed table, decoded; the caller checked the ids.
    pub(super) fn packed_embedding(
        &self,
        op: &'static str,
        ids: &CudaIndex,
        cols: usize,
        table: &Packed,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        // Tables are one tensor: a stack (fused projections) is never looked up.
        let k = self.format_kernels(op, table)?;
        let c = u32_of(op, cols)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(op, ids.host.len())?, 1, 1),
            block_dim: (((cols / UNIT).clamp(1, 256) as u32).next_multiple_of(32), 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&k.embedding);
        l.arg(out).arg(&ids.dev);
        table.push(&mut l);
        l.arg(&c);
        launch(&mut l, cfg, op)
    }
}
