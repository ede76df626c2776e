//! `serve`'s allocator settings (`shardstream::malloc`), in a process of their own: after they
//! are applied, a batch-sized buffer freed and allocated again reuses the same pages instead of
//! faulting fresh ones in, which is what they are for.

/// Minor page faults of this thread so far.
fn minor_faults() -> i64 {
    // SAFETY: getrusage writes one `rusage` into the zeroed value it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is Linux's per-thread figure.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    assert_eq!(rc, 0, "getrusage: {}", std::io::Error::last_os_error());
    usage.ru_minflt
}

/// Allocates `n` bytes, writes every page and frees them; returns the minor faults it took.
fn touch_fresh(n: usize) -> i64 {
    let before = minor_faults();
    let mut v: Vec<u8> = Vec::with_capacity(n);
    v.extend((0..n).map(|i| i as u8));
    std::hint::black_box(&v);
    drop(v);
    minor_faults() - before
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn a_freed_batch_buffer_is_reused_without_page_faults() {
    assert_eq!(shardstream::malloc::tune_for_serving(&[]), shardstream::malloc::Tuning::Applied);
    const BATCH: usize = 6 << 20; // a batch of 256 images of ~20 KiB
    touch_fresh(BATCH); // the heap grows to hold it once
    let pages = BATCH / 4096;
    let again: Vec<i64> = (0..5).map(|_| touch_fresh(BATCH)).collect();
    assert!(
        again.iter().all(|&f| (f as usize) < pages / 20),
        "each later batch faulted pages in again ({again:?} faults; {pages} pages a batch)"
    );
}
