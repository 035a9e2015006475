//! The all-reduce of tensor-parallel ranks on GPUs: NCCL, one communicator per GPU,
//! created together in this process (one rank thread per GPU).

use super::{CudaBackend, CudaBuffer, unavailable};
use crate::collective::AllReduce;
use crate::{KernelError, Result};
use cudarc::nccl::{Comm, ReduceOp};
use std::sync::Mutex;

pub struct NcclRank {
    rank: usize,
    size: usize,
    /// None once aborted.
    comm: Mutex<Option<CommCell>>,
}

struct CommCell(Comm);
// SAFETY: a communicator may be used from any thread, one call at a time; the mutex
// around it sees to that.
unsafe impl Send for CommCell {}

impl NcclRank {
    /// One rank per backend, each on its own GPU, in the backends' order.
    pub fn group(backends: &[&CudaBackend]) -> Result<Vec<NcclRank>> {
        // SAFETY: only probes for the library.
        if !unsafe { cudarc::nccl::sys::is_culib_present() } {
            return Err(unavailable(
                "NCCL (libnccl.so) cannot be loaded: install it (PyPI's nvidia-nccl-cu13) and put its lib folder on LD_LIBRARY_PATH",
            ));
        }
        let streams = backends.iter().map(|b| b.stream.clone()).collect();
        let comms = Comm::from_devices(streams).map_err(|e| unavailable(format!("NCCL: {e:?}")))?;
        let size = comms.len();
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, c)| NcclRank { rank, size, comm: Mutex::new(Some(CommCell(c))) })
            .collect())
    }
}

fn aborted() -> KernelError {
    KernelError::Device { op: "all_reduce", detail: "the NCCL communicator was aborted".into() }
}

impl AllReduce<CudaBackend> for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, backend: &CudaBackend, x: &mut CudaBuffer) -> Result<()> {
        let guard = self.comm.lock().map_err(|_| aborted())?;
        let comm = &guard.as_ref().ok_or_else(aborted)?.0;
        let slice = backend.act_mut("all_reduce", x)?;
        comm.all_reduce_in_place(slice, &ReduceOp::Sum)
            .map(|_| ())
            .map_err(|e| KernelError::Device { op: "all_reduce", detail: format!("NCCL: {e:?}") })
    }

    fn abort(&self) {
        // Dropping the communicator aborts it, which fails the other ranks' pending
        // collectives instead of leaving them waiting for this one.
        if let Ok(mut c) = self.comm.lock() {
            c.take();
        }
    }
}
