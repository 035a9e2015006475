//! ggml's block formats: their ids in GGUF files, their layouts, and decoding them.

mod dequant;
mod scaled;
mod synthetic;
mod widen;

pub use dequant::dequantize;
pub(crate) use dequant::{f16_at, q5_0_values, q6_k_values, scale_min_k4};
pub use scaled::{Fp8Weight, Int4Weight, e4m3_to_f32, e5m2_to_f32};
pub use synthetic::random_blocks;
pub use widen::widen_to_q8_0;

/// The element types we can read. Other ids in a file are reported by number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
    BF16,
}

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            30 => Self::BF16,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        match self {
            Self::F32 => 0,
            Self::F16 => 1,
            Self::Q4_0 => 2,
            Self::Q4_1 => 3,
            Self::Q5_0 => 6,
            Self::Q8_0 => 8,
            Self::Q4K => 12,
            Self::Q5K => 13,
            Self::Q6K => 14,
            Self::BF16 => 30,
        }
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q8_0 => 32,
            Self::Q4K | Self::Q5K | Self::Q6K => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bytes for `elems` elements, or None when they do not fill whole blocks.
    pub fn bytes_for(self, elems: usize) -> Option<usize> {
        elems.is_multiple_of(self.block_elems()).then(|| elems / self.block_elems() * self.block_bytes())
    }
}

/// A name for a type id, known to us or not, for error messages.
pub fn type_name(id: u32) -> String {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
        "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16",
        "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    match NAMES.get(id as usize) {
        Some(n) => format!("{n} (id {id})"),
        None => format!("unknown (id {id})"),
    }
}
