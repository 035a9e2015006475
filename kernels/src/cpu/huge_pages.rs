//! Weights and KV caches on transparent huge pages.
//!
//! A decode step streams every weight once (about 100 MB for SmolLM2-135M) and, per
//! sequence, its keys and values from scattered cache blocks: on 4 KiB pages that is a
//! TLB miss every few cache lines. Debian and most distributions set THP to `madvise`,
//! so nothing gets huge pages unless it asks. Here the backend asks for the buffers a
//! step streams — `MADV_HUGEPAGE` so pages touched later fault in huge, `MADV_COLLAPSE`
//! (Linux 6.1) so those already filled are collapsed now rather than whenever
//! khugepaged's scan comes round. A decode step of SmolLM2-135M on this project's
//! 2-core CPU took about 11 % less at batch 1 and 4 alike (`bench/results/`).
//!
//! Best effort: where the kernel refuses (THP `never`, an older kernel, no huge page
//! free) memory stays as it was, and so do the results: only where pages lie changes.

/// Huge-page size on x86-64 and most arm64 kernels; the advice covers whole ones.
const HUGE_PAGE: usize = 2 << 20;

/// Buffers smaller than this are left alone: they would share their huge page with
/// whatever the allocator put beside them, for little gain.
const WORTH_IT: usize = 256 << 10;

/// Asks for `data`'s memory, widened to the huge pages it overlaps, to be backed by
/// huge pages. Widening is what lets the many sub-2 MiB weights of a small model
/// (each layer's matrices) share huge pages: neighbours in those pages get the same
/// advice, which only changes how their memory is mapped.
pub(crate) fn advise<T>(data: &[T]) {
    let len = std::mem::size_of_val(data);
    if len < WORTH_IT {
        return;
    }
    let start = data.as_ptr() as usize & !(HUGE_PAGE - 1);
    let end = (data.as_ptr() as usize + len).next_multiple_of(HUGE_PAGE);
    #[cfg(target_os = "linux")]
    for advice in [libc::MADV_HUGEPAGE, MADV_COLLAPSE] {
        // SAFETY: madvise with these two advices never changes the contents of the
        // range, only how it is mapped; parts of the widened range that are not mapped
        // make it return ENOMEM, and any error just leaves the pages as they were.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, advice) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, end);
}

/// `MADV_COLLAPSE` (Linux 6.1), not yet in every libc crate version.
#[cfg(target_os = "linux")]
const MADV_COLLAPSE: libc::c_int = 25;

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The VmFlags line of the mapping holding `addr`, from /proc/self/smaps.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ')
                && let Some((lo, hi)) = range.split_once('-')
                && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = (lo..hi).contains(&addr);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.trim().to_string();
            }
        }
        panic!("no mapping holds {addr:#x}");
    }

    #[test]
    fn a_large_buffer_is_marked_for_huge_pages_and_keeps_its_contents() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.is_empty() || thp.contains("[never]") {
            eprintln!("transparent huge pages are off on this kernel: nothing to check");
            return;
        }
        // Past glibc's largest mmap threshold (32 MiB), so a mapping of its own that no
        // other test's advice can have reached.
        let big: Vec<u8> = (0..40 << 20).map(|i: usize| (i % 251) as u8).collect();
        let middle = big.as_ptr() as usize + (20 << 20);
        let marked = |addr| vm_flags(addr).split(' ').any(|f| f == "hg");
        assert!(!marked(middle), "marked before advice");
        advise(&big[20 << 20..(20 << 20) + WORTH_IT - 1]);
        assert!(!marked(middle), "a small slice was advised");
        advise(&big);
        assert!(marked(middle), "not marked: {}", vm_flags(middle));
        assert!(big.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "the contents changed");
    }
}
