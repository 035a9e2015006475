//! The op set of a llama-family forward pass, as one trait with one implementation per
//! device. The CPU implementation here is the reference the CUDA one is checked against.
//!
//! Ops work on device buffers owned by the backend and take their shapes explicitly,
//! the way a kernel launch does: nothing here allocates behind the caller's back except
//! where an op returns a new buffer, so a GPU backend can map each op to one launch.

pub mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod ops;
mod paged;
pub mod pick;
pub mod quant;

pub use error::KernelError;
pub use ops::{AttentionShape, Backend, Gelu, HostWeight, PagedBatch, RopeStyle, WeightData};

pub type Result<T> = std::result::Result<T, KernelError>;

#[cfg(test)]
mod reference;
