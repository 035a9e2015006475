//! Keys and values kept as IEEE half floats, as llama.cpp keeps them: half the bytes of
//! f32, and on the CPU attention over a batch of long contexts is the memory those
//! bytes take to stream. A buffer of `n` halves is a `Vec<f32>` of `⌈n/2⌉` (the
//! backend's one buffer type), viewed as `u16`s here. Writes round to nearest even;
//! reads widen exactly, so attention over half-float K/V is attention over the f32
//! values they hold (tested against the f32 path on rounded inputs).

/// `buf` as the halves it stores.
pub(super) fn halves(buf: &[f32]) -> &[u16] {
    // SAFETY: u16 has a smaller alignment than f32 and every bit pattern is a valid u16;
    // the view covers exactly the buffer's bytes.
    unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u16>(), buf.len() * 2) }
}

pub(super) fn halves_mut(buf: &mut [f32]) -> &mut [u16] {
    // SAFETY: as in `halves`, and the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u16>(), buf.len() * 2) }
}

/// `src` rounded to halves (nearest, ties to even) into `dst`.
pub(super) fn narrow(src: &[f32], dst: &mut [u16]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has AVX and F16C.
        unsafe { f16c::narrow(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_f32(*s).to_bits();
    }
}

/// `src`'s halves as f32 into `dst` (exact).
pub(super) fn widen(src: &[u16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has AVX and F16C.
        unsafe { f16c::widen(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = half::f16::from_bits(*s).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
fn has_f16c() -> bool {
    super::simd::has_avx2_fma() && std::arch::is_x86_feature_detected!("f16c")
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

    #[target_feature(enable = "avx,f16c")]
    pub(super) fn widen(src: &[u16], dst: &mut [f32]) {
        let whole = src.len() / 8 * 8;
        for i in (0..whole).step_by(8) {
            // SAFETY: i + 8 <= whole <= both lengths (equal, asserted by the caller).
            unsafe {
                let f = _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().add(i).cast()));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), f);
            }
        }
        for i in whole..src.len() {
            dst[i] = half::f16::from_bits(src[i]).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halves_round_to_nearest_even_and_widen_exactly_on_every_path() {
        let src: Vec<f32> =
            (0..37).map(|i| (i as f32 - 18.0) * 0.37 + 1e-4 * i as f32).chain([65504.0, 1e-8, -0.0]).collect();
        let mut fast = vec![0u16; src.len()];
        narrow(&src, &mut fast);
        let slow: Vec<u16> = src.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
        assert_eq!(fast, slow);
        let mut back = vec![0.0f32; src.len()];
        widen(&fast, &mut back);
        let want: Vec<f32> = slow.iter().map(|h| half::f16::from_bits(*h).to_f32()).collect();
        assert_eq!(
            back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let mut buf = vec![0.0f32; 3];
        halves_mut(&mut buf)[5] = 0x3c00;
        assert_eq!(halves(&buf).len(), 6);
        assert_eq!(halves(&buf)[5], 0x3c00);
    }
}
