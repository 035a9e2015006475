//! Hot loops compiled three times — with AVX-512, with AVX2 and FMA, and for any CPU —
//! and chosen at run time, so the binary stays portable while the loops use wide
//! vectors where the CPU has them. Rust never reassociates or contracts float
//! arithmetic, so the three builds compute the same bits.

/// Defines `fn NAME(args) -> R` that runs BODY compiled with AVX-512 or AVX2+FMA when
/// the CPU supports them, and compiled for the baseline target otherwise.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn portable($($arg: $ty),*) -> $ret $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            fn avx2($($arg: $ty),*) -> $ret {
                portable($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
            fn avx512($($arg: $ty),*) -> $ret {
                portable($($arg),*)
            }

            #[cfg(target_arch = "x86_64")]
            if $crate::cpu::simd::has_avx512() {
                // SAFETY: the CPU has the features `avx512` is compiled for.
                return unsafe { avx512($($arg),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::cpu::simd::has_avx2_fma() {
                // SAFETY: the CPU has the features `avx2` is compiled for.
                return unsafe { avx2($($arg),*) };
            }
            portable($($arg),*)
        }
    };
}

pub(crate) use multiversion;

/// The builds of a hot loop, lowest first.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Isa {
    Portable,
    Avx2,
    Avx512,
}

#[cfg(test)]
thread_local! {
    /// The highest build this thread's dispatch may pick: tests lower it to compare
    /// the builds end to end. (Work handed to rayon's threads is not capped.)
    static CAP: std::cell::Cell<Isa> = const { std::cell::Cell::new(Isa::Avx512) };
}

/// Runs `f` with this thread's dispatch capped at `cap`.
#[cfg(test)]
pub(crate) fn capped<R>(cap: Isa, f: impl FnOnce() -> R) -> R {
    let old = CAP.replace(cap);
    let out = f();
    CAP.set(old);
    out
}

#[cfg(test)]
fn allowed(isa: Isa) -> bool {
    CAP.get() >= isa
}

/// The widest path this CPU's kernels dispatch to, as benchmarks report it (figures
/// from different paths are not compared).
pub fn dispatched_path() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx512_vnni() {
            return "avx512-vnni";
        }
        if has_avx512() {
            return "avx512";
        }
        if has_avx2_fma() {
            return "avx2";
        }
    }
    "portable"
}

/// Whether the CPU runs the AVX2+FMA paths (which may also convert half floats: every
/// CPU with AVX2 has F16C).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(test)]
    if !allowed(Isa::Avx2) {
        return false;
    }
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// Whether the CPU runs the AVX-512 paths (F and DQ, with AVX2, FMA and F16C).
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512() -> bool {
    #[cfg(test)]
    if !allowed(Isa::Avx512) {
        return false;
    }
    has_avx2_fma() && std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512dq")
}

/// Whether the CPU runs the AVX-512 integer dot products (`int8`): F, BW, VL, DQ and
/// VNNI, with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx512_vnni() -> bool {
    has_avx512()
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Eight floats from `lo` in the low half of a register and eight from `hi` in the high
/// half: the two rows (or keys) the AVX-512 paths pair in each register.
///
/// # Safety
/// The CPU has AVX-512 F and DQ; `lo` and `hi` each point at 8 readable floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
#[inline]
pub(crate) unsafe fn halves(lo: *const f32, hi: *const f32) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // SAFETY: by the caller's promise.
    unsafe { _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(hi), 1) }
}

/// Whether the AVX-512 paths can be compared with the AVX2 ones here; says so when not.
#[cfg(all(test, target_arch = "x86_64"))]
pub(crate) fn avx512_to_compare() -> bool {
    let has = has_avx512();
    if !has {
        eprintln!("this CPU has no AVX-512: nothing to compare");
    }
    has
}

/// e^x within about 1 ulp for x ≤ 88 (Cephes' single-precision polynomial), written in
/// plain arithmetic so loops over it vectorise — libm's `expf` is one call per element.
/// Below −87.3 it returns 2⁻¹²⁶·e^r, a tiny normal, where e^x would underflow; above 88
/// it saturates at e^88. Each step is a fused or exact operation, so the AVX2 and the
/// portable builds agree bit for bit.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.33, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    // x − n·ln 2, with ln 2 split in two so the product loses nothing.
    let r = n.mul_add(-0.693_359_4, x);
    let r = n.mul_add(2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5] {
        p = p.mul_add(r, c);
    }
    let y = (p * r).mul_add(r, r) + 1.0;
    // 2ⁿ built from n's bits: n + 127 + 1.5·2²³ holds n + 127 (1..=254) in its low
    // mantissa bits, exactly, and shifting them into the exponent field is what
    // `(n as i32 + 127) << 23` gives — without the saturating cast, which does not
    // vectorise. A NaN n makes 0 here, and y is NaN then anyway.
    y * f32::from_bits((n + 12_583_039.0).to_bits() << 23)
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_within_two_ulp_of_libm_over_its_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (super::exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(f32::NEG_INFINITY) < 1e-37 && super::exp(-1e30) >= 0.0);
        assert!(super::exp(f32::NAN).is_nan());
        assert!(super::exp(1000.0).is_finite());
        // 2ⁿ from the mantissa trick is the shift of the integer, at every n reachable.
        for n in -126..=127i32 {
            assert_eq!((n as f32 + 12_583_039.0).to_bits() << 23, ((n + 127) << 23) as u32, "n = {n}");
        }
    }
}
