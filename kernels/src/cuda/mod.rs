//! The CUDA backend: bf16 activations on one GPU, weights in bf16 or as their checkpoint
//! stores them (ggml blocks, FP8, 4-bit: `packed`), kernels from `kernels/cuda/*.cu` compiled at
//! start-up by NVRTC, bf16 matrix products through cuBLAS.
//! cudarc loads the driver, NVRTC and cuBLAS at run time, so this builds everywhere;
//! `CudaBackend::new` fails with one clear line where they or a GPU are missing.
//!
//! Buffers hold bf16 except those uploaded from the host, which stay f32: the model
//! uploads only its small parameters that way (norm weights, biases, RoPE frequencies),
//! whose precision matters more than their size. Each op takes either kind and
//! converts on the device where it must.

pub mod compile;
mod nccl;
mod packed;
mod sampling;
mod synthetic;
pub use synthetic::HostCopyBandwidth;
#[cfg(test)]
mod tests;

use crate::error::expect_len;
use crate::paged::HostBatch;
use crate::{AttentionShape, Backend, Gelu, HostWeight, KernelError, PagedBatch, Result, RopeStyle};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use half::bf16;
use std::ops::Deref;
use std::sync::{Arc, Mutex};

pub use crate::pick::{MAX_TOP_LOGPROBS, PickRow, Picked};
pub use nccl::NcclRank;

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    k: Kernels,
    /// Multiprocessors: how many blocks a launch needs to fill the GPU.
    sm_count: usize,
    /// Tests set this to fill every new output with NaN, so an element a kernel
    /// forgets to write cannot pass for a right one.
    poison: bool,
    /// Decode products (up to 8 tokens) with bf16 weights through quant.cu's
    /// gemv_bf16 rather than cuBLAS: off until a device's measurement says otherwise
    /// (`tessera-bench gpu` runs both).
    bf16_gemv: bool,
    /// cuBLASLt (its heuristic's first algorithm, a 32 MiB workspace on Hopper), where
    /// its library loads, and whether bf16 products of more tokens go through it rather
    /// than cublasGemmEx: off until measured, as `bf16_gemv`.
    lt: Option<CudaBlasLT>,
    use_lt: bool,
    /// KV blocks leave and enter the cache on a stream of their own (the second tier,
    /// handoffs), staged through `staging`: a load is queued there and the compute
    /// stream waits for it on the device, so the host goes on at once.
    copies: Arc<CudaStream>,
    staging: Mutex<KvStaging>,
}

/// A device buffer KV blocks are gathered into (or scattered from) and page-locked host
/// memory they cross to the host through, grown as needed; used on the copy stream.
#[derive(Default)]
struct KvStaging {
    device: Option<CudaSlice<bf16>>,
    host: Option<PinnedHostSlice<bf16>>,
}

impl KvStaging {
    /// Both buffers (`CudaBackend::staging` has made them).
    fn buffers(&mut self, op: &'static str) -> Result<(&mut CudaSlice<bf16>, &mut PinnedHostSlice<bf16>)> {
        match (&mut self.device, &mut self.host) {
            (Some(device), Some(host)) => Ok((device, host)),
            _ => Err(KernelError::shape(op, "no staging buffers")),
        }
    }
}

/// A device buffer: bf16 activations, or f32 as uploaded.
pub struct CudaBuffer(Data);

enum Data {
    Bf16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
}

impl CudaBuffer {
    pub fn len(&self) -> usize {
        match &self.0 {
            Data::Bf16(s) => s.len(),
            Data::F32(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Indices on the device, with the host copy they came from: every check of ids, slots
/// and block tables happens on the host before a kernel reads them.
pub struct CudaIndex {
    host: Vec<u32>,
    dev: CudaSlice<u32>,
}

/// A captured CUDA graph. cudarc's graph is not thread-safe; the mutex makes each
/// replay exclusive, and the graph is only ever touched through it.
pub struct CudaGraphHandle(Mutex<GraphExec>);

struct GraphExec(CudaGraph);
// SAFETY: the graph's handles may be used from any thread as long as no two use them
// at once, which the mutex around it guarantees.
unsafe impl Send for GraphExec {}

/// A `[rows, cols]` weight, row-major: bf16, or as its checkpoint stored it, decoded by
/// the kernels that read it (`packed`).
pub struct CudaWeight {
    pub rows: usize,
    pub cols: usize,
    data: WeightStore,
}

enum WeightStore {
    Bf16(CudaSlice<bf16>),
    Packed(packed::Packed),
}

impl CudaWeight {
    /// Bytes the weight takes on the device: what a product streams.
    pub fn device_bytes(&self) -> usize {
        match &self.data {
            WeightStore::Bf16(s) => 2 * s.len(),
            WeightStore::Packed(p) => p.device_bytes(),
        }
    }
}

/// A device slice borrowed as it is or converted for the op.
enum Slice<'a, T> {
    Borrowed(&'a CudaSlice<T>),
    Owned(CudaSlice<T>),
}

impl<T> Deref for Slice<'_, T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        match self {
            Slice::Borrowed(s) => s,
            Slice::Owned(s) => s,
        }
    }
}

struct Kernels {
    f32_to_bf16: CudaFunction,
    bf16_to_f32: CudaFunction,
    fill_random_bf16: CudaFunction,
    embedding: CudaFunction,
    rms_norm: CudaFunction,
    add_rms_norm: CudaFunction,
    add_assign: CudaFunction,
    add_bias: CudaFunction,
    rope: CudaFunction,
    silu_mul: CudaFunction,
    softmax: CudaFunction,
    copy_columns: CudaFunction,
    gather_rows: CudaFunction,
    layer_norm: CudaFunction,
    gelu: CudaFunction,
    scatter_rows: CudaFunction,
    dense_attention: CudaFunction,
    write_kv: CudaFunction,
    qkv_to_cache: CudaFunction,
    paged_attention: CudaFunction,
    /// The grouped, split fast path by (head size, query heads per KV head), with how
    /// many of its blocks a multiprocessor holds at once, and its merge.
    paged_attention_fast: Vec<((usize, usize), CudaFunction, usize)>,
    paged_attention_merge: CudaFunction,
    /// The tiled prefill kernel by head size.
    prefill_attention: Vec<(usize, CudaFunction)>,
    apply_penalties: CudaFunction,
    add_at: CudaFunction,
    gemv_bf16: CudaFunction,
    gemv_bf16_glu: CudaFunction,
    /// Greedy and drawn picks, per logit type.
    pick: sampling::PickSet,
    gather_f32: CudaFunction,
    /// Products and lookups with block-format weights, per format.
    packed: Vec<packed::FormatKernels>,
    /// FP8 weights' W8A8 products, where the GPU has FP8 tensor cores (8.9 and up).
    fp8_tensor_cores: Option<packed::Fp8TensorCores>,
}

/// Threads per block of the elementwise and row kernels.
const THREADS: u32 = 256;
/// The attention kernel's block: 4 warps (ATTN_WARPS in attention.cu).
const ATTN_THREADS: u32 = 128;
/// Largest head size the attention kernel keeps in registers (32 × ATTN_MAX_R).
const MAX_HEAD_DIM: usize = 256;
/// Dynamic shared memory `dense_attention` may take (the default limit of a block).
const DENSE_ATTENTION_SHARED_BYTES: usize = 48 * 1024;
/// GEMV_MAX_T and GEMV_WARPS in quant.cu: tokens of a decode product, rows a block.
const GEMV_MAX_TOKENS: usize = 8;
const GEMV_WARPS: u32 = 4;

/// The launch of a decode product kernel (quant.cu's gemv*): a warp per output row.
fn gemv_config(rows: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(GEMV_WARPS), 1, 1),
        block_dim: (GEMV_WARPS * 32, 1, 1),
        shared_mem_bytes: 0,
    }
}
/// Fewest keys a split of the fast attention path takes.
const MIN_SPLIT_KEYS: usize = 128;
/// Query rows of a sequence from which the tiled prefill kernel takes it (it reads
/// each key once per query head and tile of rows, where the row kernels read it once
/// per row), the rows of its tiles and its block (FA_ROWS and 4 warps in prefill.cu).
const PREFILL_TILE_MIN_ROWS: usize = 8;
const PREFILL_TILE_ROWS: usize = 64;
const PREFILL_THREADS: u32 = 128;

fn device_err(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> KernelError {
    move |e| KernelError::Device { op, detail: e.to_string() }
}

fn unavailable(detail: impl Into<String>) -> KernelError {
    KernelError::Device { op: "cuda", detail: detail.into() }
}

/// Queues a built launch; its errors (bad configuration, earlier faults) come back
/// here, those of the kernel itself at the next synchronisation.
fn launch(l: &mut cudarc::driver::LaunchArgs<'_>, cfg: LaunchConfig, op: &'static str) -> Result<()> {
    // SAFETY: every caller checked its buffers' sizes against the kernel's indexing.
    unsafe { l.launch(cfg) }.map(|_| ()).map_err(device_err(op))
}

/// A launch over `n` items with grid-stride loops.
fn flat(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// One block of `threads` per row.
fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// Key splits per query row of the fast attention path, for `blocks` (rows × KV heads)
/// on `sm_count` multiprocessors that hold `slots` blocks at once, each split at least
/// MIN_SPLIT_KEYS keys (`most` splits). Few blocks: split until the grid fills the GPU
/// twice over. Many: blocks run in waves of `slots`, and a last wave a fifth full
/// leaves most of the GPU idle for a whole block's time (2,048 blocks in waves of 660
/// keep it 78 % busy), so the fewest splits (up to 8) whose waves are 90 % full, else
/// the fullest.
fn attention_splits(blocks: usize, sm_count: usize, slots: usize, most: usize) -> usize {
    let most = most.max(1);
    if blocks < 2 * sm_count {
        return (2 * sm_count).div_ceil(blocks.max(1)).min(most);
    }
    let fill = |s: usize| {
        let n = blocks * s;
        n as f64 / (n.div_ceil(slots) * slots) as f64
    };
    let candidates = 1..=most.min(8);
    candidates
        .clone()
        .find(|&s| fill(s) >= 0.9)
        .unwrap_or_else(|| candidates.fold(1, |best, s| if fill(s) > fill(best) { s } else { best }))
}

fn rows_of(op: &'static str, len: usize, cols: usize) -> Result<usize> {
    if cols == 0 || !len.is_multiple_of(cols) {
        return Err(KernelError::shape(op, format!("input of {len} elements is not rows of {cols}")));
    }
    Ok(len / cols)
}

/// Elements of blocks `ids` of a KV cache of `len` elements, each id checked.
fn kv_blocks_in(op: &'static str, len: usize, block_elems: usize, ids: &[u32]) -> Result<usize> {
    let blocks = len / block_elems.max(1);
    if let Some(&id) = ids.iter().find(|&&id| id as usize >= blocks) {
        return Err(KernelError::shape(op, format!("block {id} past the cache's {blocks}")));
    }
    Ok(ids.len() * block_elems)
}

fn u32_of(op: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| KernelError::shape(op, format!("{v} does not fit the kernel's 32-bit sizes")))
}

/// A GPU as a node offers it.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    /// e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    pub memory_bytes: u64,
}

impl CudaBackend {
    /// Opens GPU `ordinal` and compiles the kernels for it (or reads them from the
    /// disk cache). Fails with a one-line reason where there is no driver, no GPU,
    /// no NVRTC or no cuBLAS.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: these only probe for the shared libraries; calling into a missing
        // one would panic instead.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable(
                "no CUDA driver on this machine (libcuda.so cannot be loaded): no NVIDIA GPU here",
            ));
        }
        let count = CudaContext::device_count().map_err(device_err("cuda"))?;
        if ordinal >= count.max(0) as usize {
            return Err(unavailable(format!("no CUDA device {ordinal}: this machine has {count}")));
        }
        if !compile::nvrtc_present() {
            return Err(unavailable(
                "NVRTC (libnvrtc.so) cannot be loaded: install the CUDA toolkit or PyPI's nvidia-cuda-nvrtc and put its lib folder on LD_LIBRARY_PATH",
            ));
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(unavailable(
                "cuBLAS (libcublas.so) cannot be loaded: install the CUDA toolkit or PyPI's nvidia-cublas and put its lib folder on LD_LIBRARY_PATH",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(device_err("cuda"))?;
        // One stream: cudarc's per-buffer events would only add work.
        // SAFETY: nothing here uses a second stream.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own: the legacy default stream cannot be captured as a graph.
        let stream = ctx.new_stream().map_err(device_err("cuda"))?;
        let (major, minor) = ctx.compute_capability().map_err(device_err("cuda"))?;
        let arch = format!("sm_{major}{minor}");
        if major < 8 {
            return Err(unavailable(format!(
                "{arch}: the CUDA backend needs compute capability 8.0 or newer (bf16 and its tensor cores)"
            )));
        }
        let mut modules = Vec::new();
        for source in &compile::SOURCES {
            let ptx = compile::ptx_cached(source, &arch).map_err(|e| unavailable(e.to_string()))?;
            modules.push(ctx.load_module(Ptx::from_src(ptx)).map_err(device_err("load_module"))?);
        }
        let find = |name: &str| -> Result<CudaFunction> {
            for m in &modules {
                if let Ok(f) = m.load_function(name) {
                    return Ok(f);
                }
            }
            Err(unavailable(format!("kernel {name} is in no CUDA source")))
        };
        let k = Kernels {
            f32_to_bf16: find("f32_to_bf16")?,
            bf16_to_f32: find("bf16_to_f32")?,
            fill_random_bf16: find("fill_random_bf16")?,
            embedding: find("embedding")?,
            rms_norm: find("rms_norm")?,
            add_rms_norm: find("add_rms_norm")?,
            add_assign: find("add_assign")?,
            add_bias: find("add_bias")?,
            rope: find("rope")?,
            silu_mul: find("silu_mul")?,
            softmax: find("softmax")?,
            copy_columns: find("copy_columns")?,
            gather_rows: find("gather_rows")?,
            layer_norm: find("layer_norm")?,
            gelu: find("gelu")?,
            scatter_rows: find("scatter_rows")?,
            dense_attention: find("dense_attention")?,
            write_kv: find("write_kv")?,
            qkv_to_cache: find("qkv_to_cache")?,
            paged_attention: find("paged_attention")?,
            paged_attention_fast: [64, 128, 256]
                .iter()
                .flat_map(|&hd| [1, 2, 4, 8].map(|g| (hd, g)))
                .map(|(hd, g)| {
                    let f = find(&format!("paged_attention_hd{hd}_g{g}"))?;
                    let resident = f.occupancy_max_active_blocks_per_multiprocessor(ATTN_THREADS, 0, None);
                    Ok(((hd, g), f, resident.map_err(device_err("occupancy"))?.max(1) as usize))
                })
                .collect::<Result<_>>()?,
            paged_attention_merge: find("paged_attention_merge")?,
            prefill_attention: [64, 128]
                .iter()
                .map(|&hd| Ok((hd, find(&format!("prefill_attention_hd{hd}"))?)))
                .collect::<Result<_>>()?,
            apply_penalties: find("apply_penalties")?,
            add_at: find("add_at")?,
            gemv_bf16: find("gemv_bf16")?,
            gemv_bf16_glu: find("gemv_bf16_glu")?,
            pick: sampling::PickSet::load(&find)?,
            gather_f32: find("gather_f32")?,
            packed: packed::load(&find)?,
            fp8_tensor_cores: match (major, minor) >= (8, 9) {
                true => Some(packed::Fp8TensorCores::load(&find)?),
                false => None,
            },
        };
        let sm_count = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(device_err("cuda"))? as usize;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| unavailable(format!("cuBLAS: {e:?}")))?;
        // SAFETY: only probes for the library.
        let lt = match unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            true => CudaBlasLT::new(stream.clone()).ok(),
            false => None,
        };
        let copies = ctx.new_stream().map_err(device_err("cuda"))?;
        Ok(Self {
            ctx,
            stream,
            blas,
            k,
            sm_count,
            poison: false,
            bf16_gemv: false,
            lt,
            use_lt: false,
            copies,
            staging: Mutex::default(),
        })
    }

    /// GPU 0 for a test, or None, with the reason printed, where it cannot be opened;
    /// `TESSERA_GPU_TESTS=1` makes that a failure (the documented GPU test command).
    pub fn for_tests() -> Option<Self> {
        match Self::new(0) {
            Ok(b) => Some(b),
            Err(e) => {
                assert!(std::env::var("TESSERA_GPU_TESTS").as_deref() != Ok("1"), "TESSERA_GPU_TESTS=1 but {e}");
                eprintln!("skipped: {e}");
                None
            }
        }
    }

    /// CUDA devices on this machine (0 without a driver).
    pub fn device_count() -> usize {
        // SAFETY: only probes for the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
    }

    /// Each GPU of this machine: its name and memory, by ordinal (for a node to offer
    /// them; no context is created). An error says why there are none to offer.
    pub fn inventory() -> Result<Vec<GpuInfo>> {
        // SAFETY: only probes for the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable("no CUDA driver on this machine (libcuda.so cannot be loaded)"));
        }
        cudarc::driver::result::init().map_err(device_err("cuInit"))?;
        let count = cudarc::driver::result::device::get_count().map_err(device_err("cuda"))?;
        (0..count)
            .map(|ordinal| {
                let dev = cudarc::driver::result::device::get(ordinal).map_err(device_err("cuda"))?;
                let name = cudarc::driver::result::device::get_name(dev).map_err(device_err("cuda"))?;
                // SAFETY: `dev` came from `device::get`.
                let memory = unsafe { cudarc::driver::result::device::total_mem(dev) }.map_err(device_err("cuda"))?;
                Ok(GpuInfo { name, memory_bytes: memory as u64 })
            })
            .collect()
    }

    /// Every new output buffer starts as NaN (for tests).
    pub fn poisoned(mut self) -> Self {
        self.poison = true;
        self
    }

    /// The GPU's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn device_name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown CUDA device".into())
    }

    /// (free, total) device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(device_err("memory_info"))
    }

    /// Waits for all queued work; device faults surface here.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(device_err("synchronize"))
    }

    /// The KV staging buffers, holding `n` elements at least (grown once the copies
    /// through the old ones have ended).
    fn staging(&self, op: &'static str, n: usize) -> Result<std::sync::MutexGuard<'_, KvStaging>> {
        let mut staging = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        if staging.device.as_ref().is_none_or(|d| d.len() < n) {
            self.copies.synchronize().map_err(device_err(op))?;
            *staging = KvStaging::default();
            let device = self.copies.alloc_zeros::<bf16>(n).map_err(device_err(op))?;
            // Not write-combined: the host reads saved blocks back from it.
            // SAFETY: every element read is first written by a copy or by the host.
            let host = unsafe { self.ctx.alloc_pinned_with_flags::<bf16>(n, 0) }.map_err(device_err(op))?;
            *staging = KvStaging { device: Some(device), host: Some(host) };
        }
        Ok(staging)
    }

    /// `data` copied to a new device slice (an empty one where `data` is empty, which
    /// the driver cannot allocate).
    fn htod<T: cudarc::driver::DeviceRepr>(&self, op: &'static str, data: &[T]) -> Result<CudaSlice<T>> {
        if data.is_empty() {
            self.stream.null().map_err(device_err(op))
        } else {
            self.stream.clone_htod(data).map_err(device_err(op))
        }
    }

    /// A new bf16 buffer of `len` elements, its contents undefined (NaN when poisoned).
    fn alloc(&self, op: &'static str, len: usize) -> Result<CudaSlice<bf16>> {
        if len == 0 {
            return self.stream.null().map_err(device_err(op));
        }
        self.uninit(op, len)
    }

    /// A buffer of `n` (at least one) elements for a kernel to fill: every caller's
    /// kernel writes each element before anything reads it, so no memset is spent on it,
    /// except in a poisoned backend (the GPU tests), which fills it with all-ones bytes
    /// (NaN as bf16 or f32, token 4294967295 as u32) so that an element left unwritten shows.
    fn uninit<T: DeviceRepr>(&self, op: &'static str, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: as above; the contents are never read before they are written.
        let mut s = unsafe { self.stream.alloc::<T>(n.max(1)) }.map_err(device_err(op))?;
        if self.poison {
            let bytes = s.num_bytes();
            let (ptr, _record) = s.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` is this live allocation of `bytes` bytes, on this stream.
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, self.stream.cu_stream()) }
                .map_err(device_err(op))?;
        }
        Ok(s)
    }

    /// `b` as bf16: borrowed, or converted from f32.
    fn act<'a>(&self, op: &'static str, b: &'a CudaBuffer) -> Result<Slice<'a, bf16>> {
        match &b.0 {
            Data::Bf16(s) => Ok(Slice::Borrowed(s)),
            Data::F32(s) => {
                let mut out = self.alloc(op, s.len())?;
                if !s.is_empty() {
                    let n = s.len() as u64;
                    let mut l = self.stream.launch_builder(&self.k.f32_to_bf16);
                    l.arg(&mut out).arg(s).arg(&n);
                    launch(&mut l, flat(s.len()), op)?;
                }
                Ok(Slice::Owned(out))
            }
        }
    }

    /// `b` as f32: borrowed, or converted from bf16.
    fn param<'a>(&self, op: &'static str, b: &'a CudaBuffer) -> Result<Slice<'a, f32>> {
        match &b.0 {
            Data::F32(s) => Ok(Slice::Borrowed(s)),
            Data::Bf16(s) => {
                if s.is_empty() {
                    return Ok(Slice::Owned(self.stream.null().map_err(device_err(op))?));
                }
                // SAFETY: the conversion below writes every element.
                let mut out = unsafe { self.stream.alloc::<f32>(s.len()) }.map_err(device_err(op))?;
                let n = s.len() as u64;
                let mut l = self.stream.launch_builder(&self.k.bf16_to_f32);
                l.arg(&mut out).arg(s).arg(&n);
                launch(&mut l, flat(s.len()), op)?;
                Ok(Slice::Owned(out))
            }
        }
    }

    /// `b` made bf16 in place, for ops that write into it.
    fn act_mut<'a>(&self, op: &'static str, b: &'a mut CudaBuffer) -> Result<&'a mut CudaSlice<bf16>> {
        if let Data::F32(_) = b.0 {
            let converted = match self.act(op, b)? {
                Slice::Owned(s) => s,
                Slice::Borrowed(_) => unreachable!("an f32 buffer converts to a new one"),
            };
            b.0 = Data::Bf16(converted);
        }
        match &mut b.0 {
            Data::Bf16(s) => Ok(s),
            Data::F32(_) => unreachable!("converted above"),
        }
    }

    /// Whether decode products with bf16 weights run quant.cu's gemv_bf16 (true) or
    /// cuBLAS (false, the default): for measuring one against the other.
    pub fn set_bf16_gemv(&mut self, on: bool) {
        self.bf16_gemv = on;
    }

    /// Whether bf16 products of more than 8 tokens run through cuBLASLt (true) or
    /// cublasGemmEx (false, the default); false where cuBLASLt cannot be loaded.
    pub fn set_cublaslt(&mut self, on: bool) -> bool {
        self.use_lt = on && self.lt.is_some();
        self.use_lt
    }

    /// `out[tokens, rows] = x[tokens, cols] · wᵀ` through cuBLAS, or for up to 8 tokens
    /// gemv_bf16 where `bf16_gemv` is set; the caller checked the sizes.
    fn bf16_linear(
        &self,
        x: &CudaSlice<bf16>,
        tokens: usize,
        (rows, cols): (usize, usize),
        w: &CudaSlice<bf16>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<()> {
        const OP: &str = "linear";
        if self.bf16_gemv && tokens <= GEMV_MAX_TOKENS && cols.is_multiple_of(8) {
            let (r, c, t) = (u32_of(OP, rows)?, u32_of(OP, cols)?, tokens as u32);
            let cfg = gemv_config(r);
            let mut l = self.stream.launch_builder(&self.k.gemv_bf16);
            l.arg(out).arg(w).arg(x).arg(&r).arg(&c).arg(&t).arg(&r);
            return launch(&mut l, cfg, OP);
        }
        // Row-major out[tokens, rows] = x[tokens, cols] · w[rows, cols]ᵀ is, in cuBLAS's
        // column-major terms, out (rows × tokens) = wᵀ-as-stored (op T) · x (op N).
        let cfg = GemmConfig {
            transa: cublasOperation_t::CUBLAS_OP_T,
            transb: cublasOperation_t::CUBLAS_OP_N,
            m: u32_of(OP, rows)? as i32,
            n: u32_of(OP, tokens)? as i32,
            k: u32_of(OP, cols)? as i32,
            alpha: bf16::ONE,
            lda: cols as i32,
            ldb: cols as i32,
            beta: bf16::ZERO,
            ldc: rows as i32,
        };
        let aligned = rows.is_multiple_of(8) && cols.is_multiple_of(8);
        if let Some(lt) = self.lt.as_ref().filter(|_| self.use_lt && tokens > GEMV_MAX_TOKENS && aligned) {
            // The same column-major product: W as stored, transposed, times X (16-byte
            // aligned columns, which cuBLASLt's kernels want; others stay on GemmEx).
            let cfg = MatmulConfig {
                transa: true,
                transb: false,
                transc: false,
                m: rows as u64,
                n: tokens as u64,
                k: cols as u64,
                alpha: 1.0,
                lda: cols as i64,
                ldb: cols as i64,
                beta: 0.0,
                ldc: rows as i64,
                stride_a: None,
                stride_b: None,
                stride_c: None,
                stride_bias: None,
                batch_size: None,
            };
            // SAFETY: the caller checked the sizes against the three buffers.
            return unsafe { lt.matmul(cfg, w, x, out, None, None) }
                .map_err(|e| KernelError::Device { op: OP, detail: format!("cuBLASLt: {e:?}") });
        }
        // SAFETY: the caller checked the sizes against the three buffers.
        unsafe { self.blas.gemm(cfg, w, x, out) }
            .map_err(|e| KernelError::Device { op: OP, detail: format!("cuBLAS: {e:?}") })
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Index = CudaIndex;
    type Weight = CudaWeight;
    const ELEMENT_BYTES: usize = 2;
    type Graph = CudaGraphHandle;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, data: &[f32]) -> Result<CudaBuffer> {
        Ok(CudaBuffer(Data::F32(self.htod("upload", data)?)))
    }

    fn upload_index(&self, data: &[u32]) -> Result<CudaIndex> {
        Ok(CudaIndex { host: data.to_vec(), dev: self.htod("upload_index", data)? })
    }

    fn zeros(&self, len: usize) -> Result<CudaBuffer> {
        if len == 0 {
            return Ok(CudaBuffer(Data::Bf16(self.stream.null().map_err(device_err("zeros"))?)));
        }
        Ok(CudaBuffer(Data::Bf16(self.stream.alloc_zeros(len).map_err(device_err("zeros"))?)))
    }

    fn download(&self, buf: &CudaBuffer) -> Result<Vec<f32>> {
        let out = match &buf.0 {
            _ if buf.is_empty() => Vec::new(),
            Data::F32(s) => self.stream.clone_dtoh(s).map_err(device_err("download"))?,
            Data::Bf16(s) => {
                let v = self.stream.clone_dtoh(s).map_err(device_err("download"))?;
                v.into_iter().map(f32::from).collect()
            }
        };
        self.synchronize()?;
        Ok(out)
    }

    fn upload_weight(&self, w: HostWeight) -> Result<CudaWeight> {
        let (rows, cols) = (w.rows, w.cols);
        // Every part checked before a kernel reads it.
        w.check("upload_weight")?;
        if let Some(p) = self.upload_packed(&w)? {
            return Ok(CudaWeight { rows, cols, data: WeightStore::Packed(p) });
        }
        let host: Vec<bf16> = w.into_f32().into_iter().map(bf16::from_f32).collect();
        Ok(CudaWeight { rows, cols, data: WeightStore::Bf16(self.htod("upload_weight", &host)?) })
    }

    fn write_index(&self, dst: &mut CudaIndex, data: &[u32]) -> Result<()> {
        expect_len("write_index", "data", data.len(), dst.host.len())?;
        if !data.is_empty() {
            self.stream.memcpy_htod(data, &mut dst.dev).map_err(device_err("write_index"))?;
        }
        dst.host.copy_from_slice(data);
        Ok(())
    }

    fn kv_save_blocks(&self, cache: &CudaBuffer, block_elems: usize, ids: &[u32], out: &mut Vec<u8>) -> Result<()> {
        const OP: &str = "kv_save_blocks";
        let Data::Bf16(cache) = &cache.0 else { return Err(KernelError::shape(OP, "a KV cache holds bf16")) };
        let n = kv_blocks_in(OP, cache.len(), block_elems, ids)?;
        if n == 0 {
            return Ok(());
        }
        let mut staging = self.staging(OP, n)?;
        let (device, host) = staging.buffers(OP)?;
        let rows = self.copies.clone_htod(ids).map_err(device_err(OP))?;
        // The copy reads what the compute stream has written.
        self.copies.join(&self.stream).map_err(device_err(OP))?;
        let (count, cols) = (u32_of(OP, ids.len())?, u32_of(OP, block_elems)?);
        {
            let mut l = self.copies.launch_builder(&self.k.gather_rows);
            l.arg(&mut *device).arg(cache).arg(&rows).arg(&count).arg(&cols);
            launch(&mut l, flat(n), OP)?;
        }
        let pinned = &mut host.as_mut_slice().map_err(device_err(OP))?[..n];
        self.copies.memcpy_dtoh(&device.slice(0..n), pinned).map_err(device_err(OP))?;
        self.copies.synchronize().map_err(device_err(OP))?;
        // The block's memory as it is (f16/bf16 bits in the machine's order, as the CPU
        // backend's blocks are): a cast, where converting element by element would cost
        // more than the PCIe transfer itself.
        out.extend_from_slice(bytemuck::cast_slice(pinned));
        Ok(())
    }

    fn kv_load_blocks(&self, cache: &mut CudaBuffer, block_elems: usize, ids: &[u32], data: &[u8]) -> Result<()> {
        const OP: &str = "kv_load_blocks";
        expect_len(OP, "saved blocks", data.len(), ids.len() * block_elems * 2)?;
        let Data::Bf16(cache) = &mut cache.0 else { return Err(KernelError::shape(OP, "a KV cache holds bf16")) };
        let n = kv_blocks_in(OP, cache.len(), block_elems, ids)?;
        if n == 0 {
            return Ok(());
        }
        let mut staging = self.staging(OP, n)?;
        let (device, host) = staging.buffers(OP)?;
        // The last copy through the staging buffers has ended before they are rewritten.
        self.copies.synchronize().map_err(device_err(OP))?;
        let pinned = &mut host.as_mut_slice().map_err(device_err(OP))?[..n];
        bytemuck::cast_slice_mut::<bf16, u8>(pinned).copy_from_slice(data);
        let rows = self.copies.clone_htod(ids).map_err(device_err(OP))?;
        // Earlier compute work on these blocks ends first.
        self.copies.join(&self.stream).map_err(device_err(OP))?;
        self.copies.memcpy_htod(&*pinned, &mut device.slice_mut(0..n)).map_err(device_err(OP))?;
        let (count, cols) = (u32_of(OP, ids.len())?, u32_of(OP, block_elems)?);
        {
            let mut l = self.copies.launch_builder(&self.k.scatter_rows);
            l.arg(cache).arg(&*device).arg(&rows).arg(&count).arg(&cols);
            launch(&mut l, flat(n), OP)?;
        }
        // The next step's reads wait for the blocks on the device; the host does not.
        self.stream.join(&self.copies).map_err(device_err(OP))
    }

    fn copy_into(&self, src: &CudaBuffer, dst: &mut CudaBuffer) -> Result<()> {
        const OP: &str = "copy_into";
        expect_len(OP, "source", src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let s = self.act(OP, src)?;
        let d = self.act_mut(OP, dst)?;
        self.stream.memcpy_dtod(&*s, d).map_err(device_err(OP))
    }

    fn capture(&self, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<CudaGraphHandle>> {
        self.synchronize()?;
        // Thread-local: another thread's CUDA calls neither join nor break the capture.
        self.stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(device_err("capture"))?;
        let recorded = f();
        // The capture ends whatever `f` did, or the stream would stay unusable.
        let graph = self.stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        recorded?;
        let graph = graph.map_err(device_err("capture"))?.ok_or_else(|| unavailable("the capture recorded nothing"))?;
        graph.upload().map_err(device_err("capture"))?;
        Ok(Some(CudaGraphHandle(Mutex::new(GraphExec(graph)))))
    }

    fn device_pick(&self, logits: &CudaBuffer, vocab: usize, rows: &[PickRow]) -> Result<Option<Vec<Picked>>> {
        self.pick_on_device(logits, vocab, rows).map(Some)
    }

    fn replay(&self, graph: &CudaGraphHandle) -> Result<()> {
        let exec = graph.0.lock().map_err(|_| unavailable("a graph replay panicked"))?;
        exec.0.launch().map_err(device_err("replay"))
    }

    fn embedding(&self, ids: &CudaIndex, table: &CudaWeight) -> Result<CudaBuffer> {
        const OP: &str = "embedding";
        if let Some(&id) = ids.host.iter().find(|&&id| id as usize >= table.rows) {
            return Err(KernelError::shape(OP, format!("token id {id} >= vocabulary size {}", table.rows)));
        }
        let n = ids.host.len() * table.cols;
        let mut out = self.alloc(OP, n)?;
        if n > 0 {
            match &table.data {
                WeightStore::Bf16(data) => {
                    let (tokens, dim) = (u32_of(OP, ids.host.len())?, u32_of(OP, table.cols)?);
                    let mut l = self.stream.launch_builder(&self.k.embedding);
                    l.arg(&mut out).arg(&ids.dev).arg(data).arg(&tokens).arg(&dim);
                    launch(&mut l, flat(n), OP)?;
                }
                WeightStore::Packed(p) => self.packed_embedding(OP, ids, table.cols, p, &mut out)?,
            }
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn linear(&self, x: &CudaBuffer, tokens: usize, w: &CudaWeight, bias: Option<&CudaBuffer>) -> Result<CudaBuffer> {
        const OP: &str = "linear";
        expect_len(OP, "input", x.len(), tokens * w.cols)?;
        if let Some(b) = bias {
            expect_len(OP, "bias", b.len(), w.rows)?;
        }
        let mut out = self.alloc(OP, tokens * w.rows)?;
        if tokens == 0 || w.rows == 0 {
            return Ok(CudaBuffer(Data::Bf16(out)));
        }
        let xs = self.act(OP, x)?;
        match &w.data {
            WeightStore::Bf16(data) => self.bf16_linear(&xs, tokens, (w.rows, w.cols), data, &mut out)?,
            WeightStore::Packed(p) => self.packed_linear(OP, &xs, tokens, (w.rows, w.cols), p, &mut out)?,
        }
        if let Some(b) = bias {
            let b = self.param(OP, b)?;
            let (r, c) = (tokens as u32, w.rows as u32);
            let mut l = self.stream.launch_builder(&self.k.add_bias);
            l.arg(&mut out).arg(&*b).arg(&r).arg(&c);
            launch(&mut l, flat(tokens * w.rows), OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn rms_norm(&self, x: &CudaBuffer, weight: &CudaBuffer, eps: f32) -> Result<CudaBuffer> {
        const OP: &str = "rms_norm";
        let rows = rows_of(OP, x.len(), weight.len())?;
        let mut out = self.alloc(OP, x.len())?;
        if rows > 0 {
            let (xs, w) = (self.act(OP, x)?, self.param(OP, weight)?);
            let dim = u32_of(OP, weight.len())?;
            let mut l = self.stream.launch_builder(&self.k.rms_norm);
            l.arg(&mut out).arg(&*xs).arg(&*w).arg(&dim).arg(&eps);
            launch(&mut l, per_row(rows, THREADS), OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn add_assign(&self, x: &mut CudaBuffer, y: &CudaBuffer) -> Result<()> {
        const OP: &str = "add_assign";
        expect_len(OP, "y", y.len(), x.len())?;
        if x.is_empty() {
            return Ok(());
        }
        let ys = self.act(OP, y)?;
        let xs = self.act_mut(OP, x)?;
        let n = xs.len() as u64;
        let mut l = self.stream.launch_builder(&self.k.add_assign);
        l.arg(&mut *xs).arg(&*ys).arg(&n);
        launch(&mut l, flat(n as usize), OP)
    }

    fn add_rms_norm(&self, h: &mut CudaBuffer, y: &CudaBuffer, weight: &CudaBuffer, eps: f32) -> Result<CudaBuffer> {
        const OP: &str = "add_rms_norm";
        expect_len(OP, "y", y.len(), h.len())?;
        let rows = rows_of(OP, h.len(), weight.len())?;
        let mut out = self.alloc(OP, h.len())?;
        if rows > 0 {
            let (ys, w) = (self.act(OP, y)?, self.param(OP, weight)?);
            let hs = self.act_mut(OP, h)?;
            let dim = u32_of(OP, weight.len())?;
            let mut l = self.stream.launch_builder(&self.k.add_rms_norm);
            l.arg(&mut out).arg(&mut *hs).arg(&*ys).arg(&*w).arg(&dim).arg(&eps);
            launch(&mut l, per_row(rows, THREADS), OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn rope(
        &self,
        x: &mut CudaBuffer,
        positions: &CudaIndex,
        heads: usize,
        head_dim: usize,
        inv_freq: &CudaBuffer,
        style: RopeStyle,
    ) -> Result<()> {
        const OP: &str = "rope";
        let tokens = positions.host.len();
        expect_len(OP, "input", x.len(), tokens * heads * head_dim)?;
        let half = inv_freq.len();
        if 2 * half > head_dim {
            return Err(KernelError::shape(OP, format!("{half} frequencies for head_dim {head_dim}")));
        }
        let n = tokens * heads * half;
        if n == 0 {
            return Ok(());
        }
        let freq = self.param(OP, inv_freq)?;
        let xs = self.act_mut(OP, x)?;
        let (t, h, d, hf) = (u32_of(OP, tokens)?, u32_of(OP, heads)?, u32_of(OP, head_dim)?, half as u32);
        let neox = u32::from(style == RopeStyle::Neox);
        let mut l = self.stream.launch_builder(&self.k.rope);
        l.arg(&mut *xs).arg(&positions.dev).arg(&*freq).arg(&t).arg(&h).arg(&d).arg(&hf).arg(&neox);
        launch(&mut l, flat(n), OP)
    }

    fn silu_mul(&self, gate_up: &CudaBuffer, width: usize) -> Result<CudaBuffer> {
        const OP: &str = "silu_mul";
        let rows = rows_of(OP, gate_up.len(), 2 * width)?;
        let mut out = self.alloc(OP, rows * width)?;
        if rows > 0 {
            let g = self.act(OP, gate_up)?;
            let (r, w) = (u32_of(OP, rows)?, u32_of(OP, width)?);
            let mut l = self.stream.launch_builder(&self.k.silu_mul);
            l.arg(&mut out).arg(&*g).arg(&r).arg(&w);
            launch(&mut l, flat(rows * width), OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn linear_silu_mul(&self, x: &CudaBuffer, tokens: usize, w: &CudaWeight, width: usize) -> Result<CudaBuffer> {
        const OP: &str = "linear_silu_mul";
        let decode = (1..=GEMV_MAX_TOKENS).contains(&tokens) && width > 0 && w.rows == 2 * width;
        let fused = match &w.data {
            WeightStore::Bf16(_) => (self.bf16_gemv && w.cols.is_multiple_of(8)).then_some(&self.k.gemv_bf16_glu),
            WeightStore::Packed(p) => p.glu_kernel(&self.k.packed),
        };
        let Some(func) = fused.filter(|_| decode) else {
            let product = self.linear(x, tokens, w, None)?;
            return self.silu_mul(&product, width);
        };
        expect_len(OP, "input", x.len(), tokens * w.cols)?;
        let mut out = self.alloc(OP, tokens * width)?;
        let xs = self.act(OP, x)?;
        let (wd, c, t) = (u32_of(OP, width)?, u32_of(OP, w.cols)?, tokens as u32);
        let cfg = gemv_config(wd);
        let mut l = self.stream.launch_builder(func);
        l.arg(&mut out);
        match &w.data {
            WeightStore::Bf16(data) => {
                l.arg(data);
            }
            WeightStore::Packed(p) => p.push(&mut l),
        }
        l.arg(&*xs).arg(&wd).arg(&c).arg(&t);
        launch(&mut l, cfg, OP)?;
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn softmax(&self, x: &mut CudaBuffer, cols: usize) -> Result<()> {
        const OP: &str = "softmax";
        let rows = rows_of(OP, x.len(), cols)?;
        if rows == 0 {
            return Ok(());
        }
        let xs = self.act_mut(OP, x)?;
        let c = u32_of(OP, cols)?;
        let mut l = self.stream.launch_builder(&self.k.softmax);
        l.arg(&mut *xs).arg(&c);
        launch(&mut l, per_row(rows, THREADS), OP)
    }

    fn split_columns(&self, x: &CudaBuffer, widths: &[usize]) -> Result<Vec<CudaBuffer>> {
        const OP: &str = "split_columns";
        let total: usize = widths.iter().sum();
        let rows = rows_of(OP, x.len(), total)?;
        let xs = self.act(OP, x)?;
        let mut parts = Vec::with_capacity(widths.len());
        let mut offset = 0;
        for &width in widths {
            let mut out = self.alloc(OP, rows * width)?;
            if rows * width > 0 {
                let (r, t, o, w) = (u32_of(OP, rows)?, u32_of(OP, total)?, offset as u32, width as u32);
                let mut l = self.stream.launch_builder(&self.k.copy_columns);
                l.arg(&mut out).arg(&*xs).arg(&r).arg(&t).arg(&o).arg(&w);
                launch(&mut l, flat(rows * width), OP)?;
            }
            parts.push(CudaBuffer(Data::Bf16(out)));
            offset += width;
        }
        Ok(parts)
    }

    fn gather_rows(&self, x: &CudaBuffer, cols: usize, rows: &CudaIndex) -> Result<CudaBuffer> {
        const OP: &str = "gather_rows";
        let n = rows_of(OP, x.len(), cols)?;
        if let Some(&r) = rows.host.iter().find(|&&r| r as usize >= n) {
            return Err(KernelError::shape(OP, format!("row {r} of {n}")));
        }
        let len = rows.host.len() * cols;
        let mut out = self.alloc(OP, len)?;
        if len > 0 {
            let xs = self.act(OP, x)?;
            let (count, c) = (u32_of(OP, rows.host.len())?, u32_of(OP, cols)?);
            let mut l = self.stream.launch_builder(&self.k.gather_rows);
            l.arg(&mut out).arg(&*xs).arg(&rows.dev).arg(&count).arg(&c);
            launch(&mut l, flat(len), OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn layer_norm(&self, x: &CudaBuffer, weight: &CudaBuffer, bias: &CudaBuffer, eps: f32) -> Result<CudaBuffer> {
        const OP: &str = "layer_norm";
        expect_len(OP, "bias", bias.len(), weight.len())?;
        let rows = rows_of(OP, x.len(), weight.len())?;
        let mut out = self.alloc(OP, x.len())?;
        if rows > 0 {
            let (xs, w, b) = (self.act(OP, x)?, self.param(OP, weight)?, self.param(OP, bias)?);
            let dim = u32_of(OP, weight.len())?;
            let mut l = self.stream.launch_builder(&self.k.layer_norm);
            l.arg(&mut out).arg(&*xs).arg(&*w).arg(&*b).arg(&dim).arg(&eps);
            launch(&mut l, per_row(rows, THREADS), OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn gelu(&self, x: &mut CudaBuffer, kind: Gelu) -> Result<()> {
        const OP: &str = "gelu";
        if x.is_empty() {
            return Ok(());
        }
        let xs = self.act_mut(OP, x)?;
        let n = xs.len() as u64;
        let kind: u32 = match kind {
            Gelu::Erf => 0,
            Gelu::Tanh => 1,
            Gelu::Quick => 2,
        };
        let mut l = self.stream.launch_builder(&self.k.gelu);
        l.arg(&mut *xs).arg(&n).arg(&kind);
        launch(&mut l, flat(n as usize), OP)
    }

    fn scatter_rows(&self, x: &mut CudaBuffer, cols: usize, rows: &CudaIndex, src: &CudaBuffer) -> Result<()> {
        const OP: &str = "scatter_rows";
        let n = rows_of(OP, x.len(), cols)?;
        expect_len(OP, "source", src.len(), rows.host.len() * cols)?;
        if let Some(&r) = rows.host.iter().find(|&&r| r as usize >= n) {
            return Err(KernelError::shape(OP, format!("row {r} of {n}")));
        }
        if src.is_empty() {
            return Ok(());
        }
        let ss = self.act(OP, src)?;
        let xs = self.act_mut(OP, x)?;
        let (count, c) = (u32_of(OP, rows.host.len())?, u32_of(OP, cols)?);
        let mut l = self.stream.launch_builder(&self.k.scatter_rows);
        l.arg(&mut *xs).arg(&*ss).arg(&rows.dev).arg(&count).arg(&c);
        launch(&mut l, flat(src.len()), OP)
    }

    fn dense_attention(
        &self,
        q: &CudaBuffer,
        k: &CudaBuffer,
        v: &CudaBuffer,
        seqs: usize,
        heads: usize,
        head_dim: usize,
        scale: f32,
    ) -> Result<CudaBuffer> {
        const OP: &str = "dense_attention";
        let width = heads * head_dim;
        let rows = rows_of(OP, q.len(), width.max(1) * seqs.max(1))?;
        if seqs == 0 || width == 0 {
            return Err(KernelError::shape(OP, format!("{seqs} sequences of {heads} heads of {head_dim}")));
        }
        expect_len(OP, "keys", k.len(), q.len())?;
        expect_len(OP, "values", v.len(), q.len())?;
        let len = rows;
        let shared = (len + head_dim) * 4;
        if shared > DENSE_ATTENTION_SHARED_BYTES {
            return Err(KernelError::shape(OP, format!("sequences of {len} do not fit the kernel's shared memory")));
        }
        let mut out = self.alloc(OP, q.len())?;
        if len == 0 {
            return Ok(CudaBuffer(Data::Bf16(out)));
        }
        let (qs, ks, vs) = (self.act(OP, q)?, self.act(OP, k)?, self.act(OP, v)?);
        let (l32, h32, d32) = (u32_of(OP, len)?, u32_of(OP, heads)?, u32_of(OP, head_dim)?);
        let cfg = LaunchConfig {
            grid_dim: (l32, h32, u32_of(OP, seqs)?),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let mut l = self.stream.launch_builder(&self.k.dense_attention);
        l.arg(&mut out).arg(&*qs).arg(&*ks).arg(&*vs).arg(&l32).arg(&h32).arg(&d32).arg(&scale);
        launch(&mut l, cfg, OP)?;
        Ok(CudaBuffer(Data::Bf16(out)))
    }

    fn write_kv(
        &self,
        k: &CudaBuffer,
        v: &CudaBuffer,
        slots: &CudaIndex,
        shape: &AttentionShape,
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "write_kv";
        let w = shape.kv_width();
        let tokens = slots.host.len();
        expect_len(OP, "keys", k.len(), tokens * w)?;
        expect_len(OP, "values", v.len(), tokens * w)?;
        expect_len(OP, "value cache", v_cache.len(), k_cache.len())?;
        let capacity = k_cache.len() / w.max(1);
        if let Some(&slot) = slots.host.iter().find(|&&s| s as usize >= capacity) {
            return Err(KernelError::shape(OP, format!("slot {slot} outside a cache of {capacity}")));
        }
        if tokens * w == 0 {
            return Ok(());
        }
        let (ks, vs) = (self.act(OP, k)?, self.act(OP, v)?);
        let kc = self.act_mut(OP, k_cache)?;
        let vc = self.act_mut(OP, v_cache)?;
        let (t, width) = (u32_of(OP, tokens)?, u32_of(OP, w)?);
        let mut l = self.stream.launch_builder(&self.k.write_kv);
        l.arg(&mut *kc).arg(&mut *vc).arg(&*ks).arg(&*vs).arg(&slots.dev).arg(&t).arg(&width);
        launch(&mut l, flat(tokens * w), OP)
    }

    fn qkv_to_cache(
        &self,
        qkv: &CudaBuffer,
        positions: &CudaIndex,
        inv_freq: &CudaBuffer,
        style: RopeStyle,
        slots: &CudaIndex,
        shape: &AttentionShape,
        k_cache: &mut CudaBuffer,
        v_cache: &mut CudaBuffer,
    ) -> Result<CudaBuffer> {
        const OP: &str = "qkv_to_cache";
        let (q_width, kv_width, head_dim) = (shape.q_width(), shape.kv_width(), shape.head_dim);
        let tokens = positions.host.len();
        expect_len(OP, "slots", slots.host.len(), tokens)?;
        expect_len(OP, "input", qkv.len(), tokens * (q_width + 2 * kv_width))?;
        expect_len(OP, "value cache", v_cache.len(), k_cache.len())?;
        let half = inv_freq.len();
        if 2 * half > head_dim || head_dim % 2 != 0 {
            return Err(KernelError::shape(OP, format!("{half} frequencies for head_dim {head_dim}")));
        }
        let capacity = k_cache.len() / kv_width.max(1);
        if let Some(&slot) = slots.host.iter().find(|&&s| s as usize >= capacity) {
            return Err(KernelError::shape(OP, format!("slot {slot} outside a cache of {capacity}")));
        }
        let mut q = self.alloc(OP, tokens * q_width)?;
        let n = tokens * (shape.num_heads + 2 * shape.num_kv_heads) * (head_dim / 2);
        if n == 0 {
            return Ok(CudaBuffer(Data::Bf16(q)));
        }
        let (freq, x) = (self.param(OP, inv_freq)?, self.act(OP, qkv)?);
        let kc = self.act_mut(OP, k_cache)?;
        let vc = self.act_mut(OP, v_cache)?;
        let sizes = [tokens, shape.num_heads, shape.num_kv_heads, head_dim, half];
        let [t, h, kvh, d, hf] = sizes.map(|v| v as u32);
        u32_of(OP, n)?; // and so every size below
        let neox = u32::from(style == RopeStyle::Neox);
        let mut l = self.stream.launch_builder(&self.k.qkv_to_cache);
        l.arg(&mut q).arg(&mut *kc).arg(&mut *vc).arg(&*x).arg(&positions.dev).arg(&slots.dev).arg(&*freq);
        l.arg(&t).arg(&h).arg(&kvh).arg(&d).arg(&hf).arg(&neox);
        launch(&mut l, flat(n), OP)?;
        Ok(CudaBuffer(Data::Bf16(q)))
    }

    fn paged_attention(
        &self,
        q: &CudaBuffer,
        k_cache: &CudaBuffer,
        v_cache: &CudaBuffer,
        batch: &PagedBatch<'_, Self>,
        shape: &AttentionShape,
    ) -> Result<CudaBuffer> {
        const OP: &str = "paged_attention";
        let host = HostBatch {
            num_seqs: batch.num_seqs,
            query_start: &batch.query_start.host,
            context_lens: &batch.context_lens.host,
            block_tables: &batch.block_tables.host,
            max_blocks_per_seq: batch.max_blocks_per_seq,
        };
        let rows = host.validate(q.len(), k_cache.len(), v_cache.len(), shape)?;
        let q_len = |seq: usize| (host.query_start[seq + 1] - host.query_start[seq]) as usize;
        // Sequences with many query rows (prefill chunks) go to the tiled kernel, if
        // there is one for this head size; the rest to the row kernels.
        let tiled = self.k.prefill_attention.iter().find(|(hd, _)| *hd == shape.head_dim).map(|(_, f)| f);
        let tiled = tiled.filter(|_| (0..host.num_seqs).any(|s| q_len(s) >= PREFILL_TILE_MIN_ROWS));
        let tiled_from = if tiled.is_some() { PREFILL_TILE_MIN_ROWS as u32 } else { u32::MAX };
        let short = |r: &&crate::paged::Row| q_len(r.seq) < tiled_from as usize;
        let max_keys = rows.iter().filter(short).map(|r| r.keys).max().unwrap_or(0);
        let short_rows = rows.iter().filter(short).count();
        let rows = rows.len();
        if shape.head_dim > MAX_HEAD_DIM {
            return Err(KernelError::shape(OP, format!("head_dim {} above {MAX_HEAD_DIM}", shape.head_dim)));
        }
        let mut out = self.alloc(OP, q.len())?;
        if rows == 0 {
            return Ok(CudaBuffer(Data::Bf16(out)));
        }
        let (qs, kc, vc) = (self.act(OP, q)?, self.act(OP, k_cache)?, self.act(OP, v_cache)?);
        if short_rows > 0 {
            let counts = (rows, short_rows, max_keys);
            self.row_attention(&mut out, (&qs, &kc, &vc), batch, shape, counts, tiled_from)?;
        }
        if let Some(kernel) = tiled {
            // After the row kernels: it overwrites what they merged for its rows.
            let mut tiles = Vec::new();
            for seq in (0..host.num_seqs).filter(|&s| q_len(s) >= PREFILL_TILE_MIN_ROWS) {
                tiles.extend((0..q_len(seq)).step_by(PREFILL_TILE_ROWS).flat_map(|r0| [seq as u32, r0 as u32]));
            }
            let tiles = self.htod(OP, &tiles)?;
            let args = [
                u32_of(OP, batch.max_blocks_per_seq)?,
                u32_of(OP, shape.num_heads)?,
                u32_of(OP, shape.num_kv_heads)?,
                u32_of(OP, shape.block_size)?,
            ];
            let cfg = LaunchConfig {
                grid_dim: (u32_of(OP, tiles.len() / 2)?, args[1], 1),
                block_dim: (PREFILL_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut l = self.stream.launch_builder(kernel);
            l.arg(&mut out).arg(&*qs).arg(&*kc).arg(&*vc).arg(&tiles);
            l.arg(&batch.query_start.dev).arg(&batch.context_lens.dev).arg(&batch.block_tables.dev);
            for a in &args {
                l.arg(a);
            }
            l.arg(&shape.scale);
            launch(&mut l, cfg, OP)?;
        }
        Ok(CudaBuffer(Data::Bf16(out)))
    }
}

impl CudaBackend {
    /// The row kernels of paged attention: the grouped, split fast path where there is
    /// one for the head size and group, else one block per row and head. Rows of
    /// sequences with `tiled_from` query rows or more (all but `short_rows` of `rows`)
    /// are left to the tiled kernel, which both skip. `max_keys`: the most keys a short
    /// row sees.
    fn row_attention(
        &self,
        out: &mut CudaSlice<bf16>,
        (qs, kc, vc): (&CudaSlice<bf16>, &CudaSlice<bf16>, &CudaSlice<bf16>),
        batch: &PagedBatch<'_, Self>,
        shape: &AttentionShape,
        (rows, short_rows, max_keys): (usize, usize, usize),
        tiled_from: u32,
    ) -> Result<()> {
        const OP: &str = "paged_attention";
        let group = shape.num_heads / shape.num_kv_heads;
        let fast = self.k.paged_attention_fast.iter().find(|(key, _, _)| *key == (shape.head_dim, group));
        if let Some((_, kernel, resident)) = fast {
            // Blocks of skipped rows return at once: the split is sized to the others.
            let splits = attention_splits(
                short_rows * shape.num_kv_heads,
                self.sm_count,
                self.sm_count * resident,
                max_keys.div_ceil(MIN_SPLIT_KEYS),
            );
            let parts = if splits > 1 { rows * shape.num_heads * splits } else { 1 };
            // SAFETY: with several splits every entry is written by the split kernel.
            let alloc = |n: usize| unsafe { self.stream.alloc::<f32>(n) }.map_err(device_err(OP));
            let (mut pm, mut pl, mut pa) = (alloc(parts)?, alloc(parts)?, alloc(parts * shape.head_dim)?);
            let args = [
                u32_of(OP, batch.num_seqs)?,
                u32_of(OP, batch.max_blocks_per_seq)?,
                u32_of(OP, shape.num_heads)?,
                u32_of(OP, shape.num_kv_heads)?,
                u32_of(OP, shape.block_size)?,
            ];
            let splits32 = u32_of(OP, splits)?;
            let cfg = LaunchConfig {
                grid_dim: (u32_of(OP, rows)?, u32_of(OP, shape.num_kv_heads)?, splits32),
                block_dim: (ATTN_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut l = self.stream.launch_builder(kernel);
            l.arg(&mut *out).arg(&mut pm).arg(&mut pl).arg(&mut pa).arg(qs).arg(kc).arg(vc);
            l.arg(&batch.query_start.dev).arg(&batch.context_lens.dev).arg(&batch.block_tables.dev);
            for a in &args {
                l.arg(a);
            }
            l.arg(&shape.scale).arg(&splits32).arg(&tiled_from);
            launch(&mut l, cfg, OP)?;
            if splits > 1 {
                let (heads, hd) = (u32_of(OP, shape.num_heads)?, u32_of(OP, shape.head_dim)?);
                let cfg = LaunchConfig {
                    grid_dim: (u32_of(OP, rows)?, heads, 1),
                    block_dim: (shape.head_dim.min(256) as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut l = self.stream.launch_builder(&self.k.paged_attention_merge);
                l.arg(&mut *out).arg(&pm).arg(&pl).arg(&pa).arg(&heads).arg(&hd).arg(&splits32);
                launch(&mut l, cfg, OP)?;
            }
            return Ok(());
        }
        let args = [
            u32_of(OP, batch.num_seqs)?,
            u32_of(OP, batch.max_blocks_per_seq)?,
            u32_of(OP, shape.num_heads)?,
            u32_of(OP, shape.num_kv_heads)?,
            u32_of(OP, shape.head_dim)?,
            u32_of(OP, shape.block_size)?,
        ];
        let cfg = LaunchConfig {
            grid_dim: (u32_of(OP, rows)?, u32_of(OP, shape.num_heads)?, 1),
            block_dim: (ATTN_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut l = self.stream.launch_builder(&self.k.paged_attention);
        l.arg(&mut *out).arg(qs).arg(kc).arg(vc);
        l.arg(&batch.query_start.dev).arg(&batch.context_lens.dev).arg(&batch.block_tables.dev);
        for a in &args {
            l.arg(a);
        }
        l.arg(&shape.scale).arg(&tiled_from);
        launch(&mut l, cfg, OP)
    }
}
