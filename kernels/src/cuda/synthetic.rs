//! Device-made data for benchmarks: random bf16 weights and buffers written by a kernel
//! (an 8B-parameter model is never built on the host), and the copy bandwidth that
//! memory-bound kernels are judged against.

use super::{CudaBackend, CudaBuffer, CudaWeight, Data, WeightStore, device_err, flat, launch};
use crate::Result;
use cudarc::driver::{CudaSlice, PushKernelArg};
use half::bf16;
use std::time::Instant;

impl CudaBackend {
    fn fill_random(&self, s: &mut CudaSlice<bf16>, seed: u64, scale: f32) -> Result<()> {
        if s.is_empty() {
            return Ok(());
        }
        let (len, n) = (s.len(), s.len() as u64);
        let mut l = self.stream.launch_builder(&self.k.fill_random_bf16);
        l.arg(&mut *s).arg(&n).arg(&seed).arg(&scale);
        launch(&mut l, flat(len), "fill_random")
    }

    /// A `[rows, cols]` weight of uniform values in `[-scale, scale)`.
    pub fn random_weight(&self, rows: usize, cols: usize, seed: u64, scale: f32) -> Result<CudaWeight> {
        let mut data = self.alloc("random_weight", rows * cols)?;
        self.fill_random(&mut data, seed, scale)?;
        Ok(CudaWeight { rows, cols, data: WeightStore::Bf16(data) })
    }

    /// A bf16 buffer of uniform values in `[-scale, scale)`.
    pub fn random_buffer(&self, len: usize, seed: u64, scale: f32) -> Result<CudaBuffer> {
        let mut data = self.alloc("random_buffer", len)?;
        self.fill_random(&mut data, seed, scale)?;
        Ok(CudaBuffer(Data::Bf16(data)))
    }

    /// Device memory bandwidth in bytes/s, counting bytes read plus bytes written, from
    /// the median of `reps` device-to-device copies of `bytes`.
    pub fn copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<f64> {
        let n = bytes / 2;
        let src = self.random_buffer(n, 1, 1.0)?;
        let Data::Bf16(src) = &src.0 else { unreachable!("random buffers are bf16") };
        let mut dst = self.alloc("copy_bandwidth", n)?;
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps + 2 {
            self.synchronize()?;
            let t = Instant::now();
            self.stream.memcpy_dtod(src, &mut dst).map_err(device_err("copy_bandwidth"))?;
            self.synchronize()?;
            times.push(t.elapsed().as_secs_f64());
        }
        let mut times = times[2..].to_vec();
        times.sort_by(f64::total_cmp);
        Ok(2.0 * (n * 2) as f64 / times[times.len() / 2])
    }

    /// The bus's bandwidth in bytes/s to the device and back from it, from the medians
    /// of `reps` copies of `bytes` between page-locked host memory and the device: what
    /// a second KV tier's copies are judged against.
    pub fn host_copy_bandwidth(&self, bytes: usize, reps: usize) -> Result<HostCopyBandwidth> {
        const OP: &str = "host_copy_bandwidth";
        let n = bytes / 2;
        let mut dev = self.random_buffer(n, 2, 1.0)?;
        let Data::Bf16(dev) = &mut dev.0 else { unreachable!("random buffers are bf16") };
        // Not write-combined, as the KV staging buffer is not.
        // SAFETY: the first copy below writes every element before the host could read one.
        let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<bf16>(n, 0) }.map_err(device_err(OP))?;
        let mut median = |to_device: bool| -> Result<f64> {
            let mut times = Vec::with_capacity(reps);
            for _ in 0..reps.max(1) + 2 {
                self.synchronize()?;
                let t = Instant::now();
                if to_device {
                    self.stream.memcpy_htod(&host, dev).map_err(device_err(OP))?;
                } else {
                    self.stream.memcpy_dtoh(&*dev, &mut host).map_err(device_err(OP))?;
                }
                self.synchronize()?;
                times.push(t.elapsed().as_secs_f64());
            }
            let mut times = times[2..].to_vec();
            times.sort_by(f64::total_cmp);
            Ok((n * 2) as f64 / times[times.len() / 2])
        };
        let to_host = median(false)?;
        let to_device = median(true)?;
        Ok(HostCopyBandwidth { to_device, to_host })
    }
}

/// Bytes/s each way between page-locked host memory and the device.
#[derive(Clone, Copy, Debug)]
pub struct HostCopyBandwidth {
    pub to_device: f64,
    pub to_host: f64,
}
