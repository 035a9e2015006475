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

/// Opens the backend `device` names; `--device cuda` without a usable GPU is an error
/// that says why in one line.
pub fn open(device: Device) -> anyhow::Result<Opened> {
    match device {
        Device::Cpu => Ok(Opened::Cpu(CpuBackend)),
        Device::Cuda => open_cuda().map_err(|e| anyhow::anyhow!("--device cuda: {e}")),
        Device::Auto => Ok(open_cuda().unwrap_or(Opened::Cpu(CpuBackend))),
    }
}

#[cfg(feature = "cuda")]
fn open_cuda() -> Result<Opened, String> {
    CudaBackend::new(0).map(|b| Opened::Cuda(Box::new(b))).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<Opened, String> {
    Err("this tessera-worker was built without the `cuda` feature".into())
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
