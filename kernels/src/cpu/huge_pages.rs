//! Packed weights on transparent huge pages.
//!
//! A decode step streams every weight once (about 100 MB for SmolLM2-135M): on 4 KiB
//! pages that is a TLB miss every 64 cache lines, for every matrix of every layer.
//! Debian and most distributions set THP to `madvise`, so nothing gets huge pages
//! unless it asks, and a small model's matrices (0.2-0.6 MB each for SmolLM2) are too
//! small to ask alone: a huge page is 2 MiB. So packed weights are carved, one after
//! another, from 2 MiB-aligned regions of their own, advised `MADV_HUGEPAGE` before
//! any page is touched. Advising the huge pages around each `Vec` instead (measured:
//! the same 5-10 % off a decode step) would mark the allocator's neighbouring memory
//! too, whose later faults could stall on compaction.
//!
//! Weights live as long as their model: a region is unmapped when the last buffer in
//! it is dropped, so unloading a model gives its memory back once nothing else shares
//! its regions. Large buffers (KV caches, f32 weights) stay `Vec`s; `advise_filled` and
//! `advise_untouched` ask for the huge pages that lie wholly inside them.
//!
//! Best effort: where the kernel refuses (THP `never`, another OS) pages stay small,
//! and results never change: only where memory lies does.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Huge-page size on x86-64 and most arm64 kernels.
const HUGE_PAGE: usize = 2 << 20;

/// A region's size: a few matrices of a large model, many of a small one.
const REGION: usize = 32 << 20;

/// Buffers above this get a region of their own rather than most of a shared one.
const OWN_REGION: usize = REGION / 4;

/// Where each buffer starts within a region: a cache line, so no two share one.
const ALIGN: usize = 64;

/// Plain numbers: any bit pattern is a value, all zeros is zero.
pub(crate) trait Plain: Copy + Default + 'static {}
impl Plain for u8 {}
impl Plain for f32 {}

/// `len` values in a huge-page region, zeroed when made; `Deref`s to a slice.
pub(crate) struct Pinned<T: Plain> {
    /// None when empty.
    region: Option<Arc<Region>>,
    offset: usize,
    len: usize,
    _values: PhantomData<T>,
}

impl<T: Plain> Pinned<T> {
    pub(crate) fn zeroed(len: usize) -> Self {
        let bytes = len.checked_mul(size_of::<T>()).expect("a buffer larger than memory");
        if bytes == 0 {
            return Self { region: None, offset: 0, len: 0, _values: PhantomData };
        }
        let (region, offset) = if bytes > OWN_REGION { (Arc::new(Region::map(bytes)), 0) } else { carve(bytes) };
        Self { region: Some(region), offset, len, _values: PhantomData }
    }
}

/// The next `bytes` of the current shared region, a new one when they do not fit.
fn carve(bytes: usize) -> (Arc<Region>, usize) {
    static CURRENT: Mutex<Option<(Arc<Region>, usize)>> = Mutex::new(None);
    let mut current = CURRENT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((region, used)) = current.as_mut() {
        let offset = used.next_multiple_of(ALIGN);
        if offset + bytes <= region.len {
            *used = offset + bytes;
            return (region.clone(), offset);
        }
    }
    let region = Arc::new(Region::map(REGION));
    *current = Some((region.clone(), bytes));
    (region, 0)
}

impl<T: Plain> std::ops::Deref for Pinned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match &self.region {
            // SAFETY: `offset..offset + len · size_of::<T>()` lies in the region (as
            // carved), is aligned for T (regions are page-aligned, offsets multiples of
            // 64), was zeroed by the mapping (a valid T), and belongs to this buffer alone.
            Some(r) => unsafe { std::slice::from_raw_parts(r.ptr.add(self.offset).cast(), self.len) },
            None => &[],
        }
    }
}

impl<T: Plain> std::ops::DerefMut for Pinned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &self.region {
            // SAFETY: as for `deref`; `&mut self` is the only way to this range.
            Some(r) => unsafe { std::slice::from_raw_parts_mut(r.ptr.add(self.offset).cast(), self.len) },
            None => &mut [],
        }
    }
}

impl<T: Plain> Clone for Pinned<T> {
    fn clone(&self) -> Self {
        let mut copy = Self::zeroed(self.len);
        copy.copy_from_slice(self);
        copy
    }
}

impl<T: Plain> std::fmt::Debug for Pinned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pinned<{}>[{}]", std::any::type_name::<T>(), self.len)
    }
}

/// An anonymous mapping, 2 MiB-aligned, advised for huge pages before first touch.
struct Region {
    ptr: *mut u8,
    len: usize,
    /// The mapping as made (aligning takes up to a huge page more), for `munmap`.
    mapped: (*mut u8, usize),
}

// SAFETY: a region is plain memory; `Pinned` hands out disjoint ranges of it, each
// reached through its own buffer's `&`/`&mut`.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    fn map(bytes: usize) -> Self {
        let len = bytes.next_multiple_of(HUGE_PAGE);
        let mapped_len = len + HUGE_PAGE;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let mapped = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mapped == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(len, HUGE_PAGE).expect("a valid layout"),
            );
        }
        let mapped = mapped.cast::<u8>();
        let ptr = mapped.wrapping_add(mapped.align_offset(HUGE_PAGE));
        let region = Self { ptr, len, mapped: (mapped, mapped_len) };
        advise_range(ptr as usize, len, &[MADV_HUGEPAGE]);
        region
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once: no `Pinned` in it is left.
        unsafe { libc::munmap(self.mapped.0.cast(), self.mapped.1) };
    }
}

/// Asks for the huge pages lying wholly inside `data`, already written (f32 weights):
/// those pages alone, so nothing beside it is marked. `MADV_COLLAPSE` (Linux 6.1)
/// collapses them now rather than whenever khugepaged's scan comes round.
pub(crate) fn advise_filled<T>(data: &[T]) {
    if let Some((start, len)) = inside(data) {
        advise_range(start, len, &[MADV_HUGEPAGE, MADV_COLLAPSE]);
    }
}

/// As `advise_filled`, for memory not yet touched (a KV cache just made): its pages
/// fault in huge as they are first written; collapsing them now would only commit
/// them early.
pub(crate) fn advise_untouched<T>(data: &[T]) {
    if let Some((start, len)) = inside(data) {
        advise_range(start, len, &[MADV_HUGEPAGE]);
    }
}

/// The huge pages wholly inside `data`: where they start, and their bytes.
fn inside<T>(data: &[T]) -> Option<(usize, usize)> {
    let start = (data.as_ptr() as usize).next_multiple_of(HUGE_PAGE);
    let end = (data.as_ptr() as usize + size_of_val(data)) & !(HUGE_PAGE - 1);
    (end > start).then(|| (start, end - start))
}

/// Each advice over the range. They never change its contents, only its mapping;
/// any error (an older kernel, THP off, another OS) leaves the pages as they were.
fn advise_range(start: usize, len: usize, advices: &[libc::c_int]) {
    #[cfg(target_os = "linux")]
    for &advice in advices {
        // SAFETY: madvise with these advices reads and writes no memory.
        unsafe { libc::madvise(start as *mut libc::c_void, len, advice) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, len, advices);
}

/// Linux's advice values (`MADV_COLLAPSE`, 6.1, is not in every version of the libc
/// crate); named here so that the callers build on any OS, where they go unused.
const MADV_HUGEPAGE: libc::c_int = 14;
const MADV_COLLAPSE: libc::c_int = 25;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_disjoint_and_copied_on_clone() {
        let mut bufs: Vec<Pinned<f32>> = (0..40).map(|i| Pinned::zeroed(1000 + 37 * i)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            assert!(b.iter().all(|&v| v == 0.0) && (b.as_ptr() as usize).is_multiple_of(ALIGN));
            b.iter_mut().enumerate().for_each(|(j, v)| *v = (i * 100_000 + j) as f32);
        }
        let copy = bufs[3].clone();
        bufs[3].fill(-1.0);
        for (i, b) in bufs.iter().enumerate().filter(|(i, _)| *i != 3) {
            assert!(b.iter().enumerate().all(|(j, &v)| v == (i * 100_000 + j) as f32), "buffer {i} was overwritten");
        }
        assert!(copy.iter().enumerate().all(|(j, &v)| v == (300_000 + j) as f32) && copy.len() == bufs[3].len());
        // A buffer too large to share gets a region of its own; empty ones none.
        let big = Pinned::<u8>::zeroed(OWN_REGION + 1);
        assert!(
            big.len() == OWN_REGION + 1
                && (big.as_ptr() as usize).is_multiple_of(HUGE_PAGE)
                && big.iter().all(|&b| b == 0)
        );
        assert!(Pinned::<u8>::zeroed(0).is_empty());
    }

    /// The VmFlags line of the mapping holding `addr`, from /proc/self/smaps.
    #[cfg(target_os = "linux")]
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

    #[cfg(target_os = "linux")]
    #[test]
    fn regions_and_large_buffers_are_marked_for_huge_pages() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if thp.is_empty() || thp.contains("[never]") {
            eprintln!("transparent huge pages are off on this kernel: nothing to check");
            return;
        }
        let marked = |addr| vm_flags(addr).split(' ').any(|f| f == "hg");
        let small = Pinned::<u8>::zeroed(300 << 10);
        assert!(marked(small.as_ptr() as usize), "a shared region: {}", vm_flags(small.as_ptr() as usize));

        // Past glibc's largest mmap threshold (32 MiB): a mapping of its own.
        let big: Vec<u8> = (0..40 << 20).map(|i: usize| (i % 251) as u8).collect();
        let middle = big.as_ptr() as usize + (20 << 20);
        assert!(!marked(middle), "marked before advice");
        advise_filled(&big[20 << 20..(21 << 20)]);
        assert!(!marked(middle), "a slice holding no whole huge page was advised");
        advise_filled(&big);
        assert!(marked(middle), "not marked: {}", vm_flags(middle));
        assert!(big.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "the contents changed");
    }
}
