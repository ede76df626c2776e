//! CPU cache hints for loops that read memory in an order the hardware cannot guess (a shuffled
//! batch touches another shard's index entries and bytes for every sample): start a line's load
//! a few iterations before it is needed, so the misses overlap instead of queueing one by one.

/// Starts loading the cache line holding `value`'s first byte. A hint only: it never faults,
/// never changes memory, and does nothing on targets without one.
#[inline(always)]
pub fn prefetch<T: ?Sized>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch never faults and never writes, and the pointer comes from a live
        // reference anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(std::ptr::from_ref(value).cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}
