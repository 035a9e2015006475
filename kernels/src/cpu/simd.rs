//! Running hot loops with AVX2 and FMA where the CPU has them, while the binary stays
//! portable to any x86-64 (or other) CPU: the loop is compiled twice, once inside a
//! function with the features enabled, and the choice is made at run time.

/// Calls `f`, compiled with AVX2+FMA when the CPU supports them. `f` and what it calls
/// must be inlinable (closures and `#[inline]` helpers are) to benefit.
#[inline(always)]
pub fn fast<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { with_avx2(f) };
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
