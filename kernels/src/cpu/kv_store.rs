//! How the CPU's KV cache holds its elements: f32 (the exact path), or IEEE half floats
//! as llama.cpp keeps them (the served path): half the bytes, and attention over a
//! batch of long contexts is the time those bytes take to stream from memory. A buffer
//! of `n` halves is a `Vec<f32>` of `⌈n/2⌉` (the backend's one buffer type), viewed as
//! `u16`s here. Writes round to nearest even; the attention kernels read halves
//! directly and widen them exactly in registers, so attention over half-float K/V is
//! attention over the f32 values they hold (tested against the f32 path on rounded
//! inputs, on every build).

/// How a KV cache buffer holds its elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum KvStore {
    F32,
    /// IEEE halves, two to an f32 of the buffer.
    F16,
}

impl KvStore {
    /// Bytes an element takes.
    pub(super) fn element_bytes(self) -> usize {
        match self {
            KvStore::F32 => 4,
            KvStore::F16 => 2,
        }
    }

    /// Floats of the backend's buffer that hold `len` elements.
    pub(super) fn buffer_floats(self, len: usize) -> usize {
        match self {
            KvStore::F32 => len,
            KvStore::F16 => len.div_ceil(2),
        }
    }
}

/// Floats of the backend's buffer one block of `block_elems` elements takes; a block
/// that does not fill whole floats (an odd count of halves) is refused.
pub(super) fn block_floats(store: KvStore, block_elems: usize, op: &'static str) -> crate::Result<usize> {
    if store == KvStore::F16 && block_elems % 2 == 1 {
        return Err(crate::KernelError::shape(op, "a block of an odd count of halves"));
    }
    Ok(store.buffer_floats(block_elems))
}

/// The floats of block `id` in a buffer of `len` floats, or why not.
pub(super) fn block_range(
    len: usize,
    floats: usize,
    id: u32,
    op: &'static str,
) -> crate::Result<std::ops::Range<usize>> {
    let start = id as usize * floats;
    if start + floats > len {
        return Err(crate::KernelError::shape(op, "a block past the cache's end"));
    }
    Ok(start..start + floats)
}

/// A cache buffer's elements as stored.
#[derive(Clone, Copy)]
pub(super) enum Cache<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
}

impl<'a> Cache<'a> {
    pub(super) fn new(buf: &'a [f32], store: KvStore) -> Self {
        match store {
            KvStore::F32 => Cache::F32(buf),
            KvStore::F16 => Cache::F16(as_halves(buf)),
        }
    }

    /// Elements held.
    pub(super) fn len(&self) -> usize {
        match self {
            Cache::F32(c) => c.len(),
            Cache::F16(c) => c.len(),
        }
    }
}

/// An element type a cache stores, as the attention kernels read it: widened to f32,
/// exactly, one at a time or eight and sixteen to a register.
pub(super) trait Stored: Copy {
    fn widen(self) -> f32;

    /// Eight elements from `p`, widened.
    ///
    /// # Safety
    /// The CPU has AVX and F16C; `p` points at 8 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen elements from `p`, widened.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `p` points at 16 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl Stored for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx")]
    #[inline]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: by the caller's promise.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: by the caller's promise.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

/// An IEEE half's bits.
impl Stored for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        half::f16::from_bits(self).to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx,f16c")]
    #[inline]
    unsafe fn load8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: by the caller's promise (16 bytes).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(p: *const u16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: by the caller's promise (32 bytes).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// `buf` as the halves it stores.
pub(super) fn as_halves(buf: &[f32]) -> &[u16] {
    // SAFETY: u16 has a smaller alignment than f32 and every bit pattern is a valid u16;
    // the view covers exactly the buffer's bytes.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u16>(), buf.len() * 2) }
}

pub(super) fn as_halves_mut(buf: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `as_halves`, and the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u16>(), buf.len() * 2) }
}

/// `src` rounded to halves (nearest, ties to even) into `dst`.
pub(super) fn narrow(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if super::simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and F16C (`has_avx2_fma` checks both).
        unsafe { f16c::narrow(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(*s).to_bits();
    }
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx,f16c")]
    pub(super) fn narrow(src: &[f32], dst: &mut [u16]) {
        let whole = src.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= whole <= both lengths (equal, asserted by the caller).
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
                _mm_storeu_si128(dst.as_mut_ptr().add(i).cast(), h);
            }
        }
        for i in whole..src.len() {
            dst[i] = half::f16::from_f32(src[i]).to_bits();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::simd::{Isa, capped};
    use super::*;

    #[test]
    fn halves_round_to_nearest_even_on_every_build_and_widen_exactly() {
        let src: Vec<f32> = (0..37)
            .map(|i| (i as f32 - 18.0) * 0.37 + 1e-4 * i as f32)
            .chain([65504.0, 1e-8, -0.0, 1.0 + f32::EPSILON * 4096.0])
            .collect();
        let want: Vec<u16> = src.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
        for isa in [Isa::Portable, Isa::Avx2] {
            let mut got = vec![0u16; src.len()];
            capped(isa, || narrow(&src, &mut got));
            assert_eq!(got, want, "{isa:?}");
        }
        for h in &want {
            assert_eq!(h.widen().to_bits(), half::f16::from_bits(*h).to_f32().to_bits());
        }
        let mut buf = vec![0.0f32; 3];
        as_halves_mut(&mut buf)[5] = 0x3c00;
        assert_eq!(Cache::new(&buf, KvStore::F16).len(), 6);
        assert_eq!(as_halves(&buf)[5].widen(), 1.0);
        assert_eq!(KvStore::F16.buffer_floats(7), 4);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_loads_widen_as_one_at_a_time_does() {
        let halves: Vec<u16> = (0..16u16).map(|i| half::f16::from_f32(i as f32 * -1.37 + 0.011).to_bits()).collect();
        let want: Vec<u32> = halves.iter().map(|h| h.widen().to_bits()).collect();
        if super::super::simd::has_avx2_fma() {
            let mut got = [0.0f32; 8];
            // SAFETY: the CPU has AVX2 and F16C; 8 halves and 8 floats.
            unsafe { std::arch::x86_64::_mm256_storeu_ps(got.as_mut_ptr(), u16::load8(halves.as_ptr())) };
            assert_eq!(got.map(f32::to_bits)[..], want[..8]);
        }
        if super::super::simd::has_avx512() {
            let mut got = [0.0f32; 16];
            // SAFETY: the CPU has AVX-512 F; 16 halves and 16 floats.
            unsafe { std::arch::x86_64::_mm512_storeu_ps(got.as_mut_ptr(), u16::load16(halves.as_ptr())) };
            assert_eq!(got.map(f32::to_bits)[..], want[..]);
        }
    }

    #[test]
    fn blocks_are_saved_and_loaded_whole_in_either_store() {
        use crate::Backend;
        use crate::cpu::CpuBackend;
        for backend in [CpuBackend::default(), CpuBackend::exact()] {
            let elems = 6;
            let mut cache = backend.kv_zeros(4 * elems).unwrap();
            for (i, f) in cache.iter_mut().enumerate() {
                *f = i as f32;
            }
            let mut saved = Vec::new();
            backend.kv_save_blocks(&cache, elems, &[2, 0], &mut saved).unwrap();
            assert_eq!(saved.len(), 2 * elems * backend.kv_element_bytes());
            let mut other = backend.kv_zeros(4 * elems).unwrap();
            backend.kv_load_blocks(&mut other, elems, &[1, 3], &saved).unwrap();
            let floats = cache.len() / 4;
            assert_eq!(other[floats..2 * floats], cache[2 * floats..3 * floats], "block 2 into block 1");
            assert_eq!(other[3 * floats..], cache[..floats], "block 0 into block 3");
            assert!(other[..floats].iter().all(|&f| f == 0.0), "block 0 untouched");
            // Past the end, or saved bytes of the wrong size: refused, nothing written.
            assert!(backend.kv_save_blocks(&cache, elems, &[4], &mut saved).is_err());
            assert!(backend.kv_load_blocks(&mut other, elems, &[1], &saved).is_err());
        }
        let halves = CpuBackend::default();
        assert!(halves.kv_save_blocks(&vec![0.0; 8], 3, &[0], &mut Vec::new()).is_err(), "an odd count of halves");
    }
}
