//! Which backend a worker runs on: `--device cpu`, `cuda`, or `auto` (the GPU when one
//! can be opened, else the CPU).

use tessera_kernels::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use tessera_kernels::cuda::CudaBackend;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
}

/// A backend, opened.
pub enum Opened {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
}

/// Opens the backend `device` names (on CUDA, GPU `gpu`); `--device cuda` without a
/// usable GPU is an error that says why in one line.
pub fn open(device: Device, gpu: usize) -> anyhow::Result<Opened> {
    match device {
        Device::Cpu => Ok(Opened::Cpu(CpuBackend::default())),
        Device::Cuda => open_cuda(gpu).map_err(|e| anyhow::anyhow!("--device cuda: {e}")),
        Device::Auto => Ok(open_cuda(gpu).unwrap_or(Opened::Cpu(CpuBackend::default()))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(gpu: usize) -> anyhow::Result<Opened> {
    Ok(Opened::Cuda(Box::new(CudaBackend::new(gpu)?)))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_gpu: usize) -> anyhow::Result<Opened> {
    anyhow::bail!("this tessera-worker was built without the `cuda` feature")
}

/// This machine's GPUs (name, memory), for a node to offer; an error says why there
/// are none.
#[cfg(feature = "cuda")]
pub fn gpus() -> anyhow::Result<Vec<(String, u64)>> {
    let found = CudaBackend::inventory()?;
    anyhow::ensure!(!found.is_empty(), "the CUDA driver sees no GPU");
    Ok(found.into_iter().map(|g| (g.name, g.memory_bytes)).collect())
}

#[cfg(not(feature = "cuda"))]
pub fn gpus() -> anyhow::Result<Vec<(String, u64)>> {
    anyhow::bail!("this tessera-worker was built without the `cuda` feature")
}

impl Opened {
    pub fn describe(&self) -> String {
        match self {
            Opened::Cpu(_) => format!("cpu ({} threads)", rayon::current_num_threads()),
            #[cfg(feature = "cuda")]
            Opened::Cuda(b) => format!("cuda ({})", b.device_name()),
        }
    }
}
