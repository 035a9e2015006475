//! Hot loops compiled twice — once with AVX2 and FMA enabled, once for any CPU — and
//! chosen at run time, so the binary stays portable while the loops use wide vectors
//! where the CPU has them.

/// Defines `fn NAME(args) -> R` that runs BODY compiled with AVX2+FMA when the CPU
/// supports them, and compiled for the baseline target otherwise.
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn portable($($arg: $ty),*) -> $ret $body

            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            fn avx2($($arg: $ty),*) -> $ret {
                portable($($arg),*)
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

/// Whether the CPU runs the AVX2+FMA paths.
#[cfg(target_arch = "x86_64")]
pub(crate) fn has_avx2_fma() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}
