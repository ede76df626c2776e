//! Buffers for column-chunk reads that go back to a pool when the row group decoded over them is
//! dropped, so that the next read lands in memory the process has already touched.
//!
//! A cold epoch reads every selected column chunk into a new buffer, and the decoded row group
//! keeps it (arrow-rs decodes uncompressed binary values as views into the page bytes). When a
//! projection outgrows the decoded budget, row groups are let go of all epoch long and new ones
//! read in their place. Each new buffer was fresh memory: the kernel zeroed and faulted in every
//! page of it under `pread`, 10-12% of a fresh daemon's time on the image set
//! (bench/PARQUET_PROFILE.md). Handing the buffer of a dropped row group to the next read
//! instead makes that a plain copy. The client's joined-message buffers (`frames::Spare` in the
//! client crate, private to it) follow the same idea per stream; this pool is daemon-wide.
//!
//! The pool keeps at most [`KEEP_FREE`] bytes of free buffers; the rest go back to the allocator.
//! A free buffer is taken only for a read it fits with at most half as much again to spare: the
//! decoded budget counts the bytes read, not the room around them.

use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock};

use bytes::Bytes;

/// Bytes of free buffers the pool keeps at most: a window's worth of large row groups.
pub const KEEP_FREE: usize = 64 << 20;

/// Reads shorter than this take a new buffer: the allocator reuses small blocks well by itself.
const SMALLEST: usize = 256 << 10;

/// Free read buffers, empty, with room.
#[derive(Debug, Default)]
pub struct Pool {
    free: Mutex<Free>,
    keep: usize,
}

#[derive(Debug, Default)]
struct Free {
    /// Oldest first.
    bufs: VecDeque<Vec<u8>>,
    bytes: usize,
}

impl Pool {
    /// A pool that keeps at most `keep` bytes of free buffers.
    pub const fn new(keep: usize) -> Self {
        Self { free: Mutex::new(Free { bufs: VecDeque::new(), bytes: 0 }), keep }
    }

    /// An empty buffer with room for `len` bytes: the smallest free one that has room and is not
    /// more than half as large again, or a new one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        if len >= SMALLEST {
            let mut free = self.lock();
            let best = free
                .bufs
                .iter()
                .enumerate()
                .filter(|(_, b)| b.capacity() >= len && b.capacity() - len <= len / 2)
                .min_by_key(|(_, b)| b.capacity())
                .map(|(i, _)| i);
            if let Some(buf) = best.and_then(|i| free.bufs.remove(i)) {
                free.bytes -= buf.capacity();
                return buf;
            }
        }
        Vec::with_capacity(len)
    }

    /// `buf`'s bytes as [`Bytes`] that hand `buf` back to this pool once the last of them is
    /// dropped.
    pub fn share(&'static self, buf: Vec<u8>) -> Bytes {
        if buf.capacity() < SMALLEST {
            return Bytes::from(buf);
        }
        Bytes::from_owner(Lent { buf, pool: self })
    }

    /// Keeps `buf` for a later read when there is room, else frees it. The oldest free buffers
    /// go first: the sizes of recent reads are the likeliest to come again.
    fn give(&self, mut buf: Vec<u8>) {
        let cap = buf.capacity();
        if cap > self.keep {
            return;
        }
        buf.clear();
        let mut free = self.lock();
        while free.bytes + cap > self.keep
            && let Some(old) = free.bufs.pop_front()
        {
            free.bytes -= old.capacity();
        }
        free.bytes += cap;
        free.bufs.push_back(buf);
    }

    /// Bytes of the free buffers kept.
    pub fn free_bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        // A panic while holding the lock leaves a consistent list (every update is one push or
        // one remove with its count), so a poisoned lock is used as it is.
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The daemon's pool of column-chunk read buffers.
pub fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(KEEP_FREE))
}

/// A read buffer lent out as [`Bytes`]: back to its pool when dropped.
struct Lent {
    buf: Vec<u8>,
    pool: &'static Pool,
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        &self.buf
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.pool.give(std::mem::take(&mut self.buf));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaked(keep: usize) -> &'static Pool {
        Box::leak(Box::new(Pool::new(keep)))
    }

    fn filled(pool: &Pool, len: usize, byte: u8) -> Vec<u8> {
        let mut buf = pool.take(len);
        buf.resize(len, byte);
        buf
    }

    #[test]
    fn a_dropped_buffer_is_reused_by_the_next_read_it_fits() {
        let pool = leaked(8 << 20);
        let first = filled(pool, 1 << 20, 7);
        let at = first.as_ptr();
        let shared = pool.share(first);
        let slice = shared.slice(10..20);
        drop(shared);
        // Still lent: a slice of it lives.
        assert_eq!(pool.free_bytes(), 0);
        assert_eq!(&slice[..], &[7; 10]);
        drop(slice);
        assert!(pool.free_bytes() >= 1 << 20);
        let again = pool.take(900 << 10);
        assert_eq!(again.as_ptr(), at, "the freed buffer is taken again");
        assert!(again.is_empty());
        assert_eq!(pool.free_bytes(), 0);
    }

    #[test]
    fn a_buffer_far_larger_than_the_read_is_left_for_another() {
        let pool = leaked(8 << 20);
        drop(pool.share(filled(pool, 4 << 20, 1)));
        let small = pool.take(1 << 20);
        assert!(small.capacity() < 4 << 20);
        assert!(pool.free_bytes() >= 4 << 20, "the large buffer is still free");
        let larger = pool.take(5 << 20);
        assert!(larger.capacity() >= 5 << 20);
        assert!(pool.free_bytes() >= 4 << 20, "too small for 5 MiB, so still free");
    }

    #[test]
    fn the_pool_keeps_at_most_its_bound_oldest_first() {
        let pool = leaked(3 << 20);
        let bufs: Vec<Vec<u8>> = (0..5).map(|i| filled(pool, 1 << 20, i)).collect();
        let ptrs: Vec<*const u8> = bufs.iter().map(|b| b.as_ptr()).collect();
        for b in bufs {
            drop(pool.share(b));
        }
        assert!(pool.free_bytes() <= 3 << 20);
        // The newest buffers are the ones kept.
        let kept: Vec<Vec<u8>> = (0..3).map(|_| pool.take(1 << 20)).collect();
        let kept: Vec<*const u8> = kept.iter().map(|b| b.as_ptr()).collect();
        for p in &ptrs[..2] {
            assert!(!kept.contains(p), "an older buffer was kept over a newer one");
        }
        for p in &ptrs[2..] {
            assert!(kept.contains(p), "a newer buffer was not kept");
        }
        assert_eq!(pool.free_bytes(), 0);
    }

    #[test]
    fn a_take_from_the_middle_keeps_the_others_in_age_order() {
        const M: usize = 1 << 20;
        let pool = leaked(4 * M);
        let a = filled(pool, M, 1);
        let b = filled(pool, 2 * M, 2);
        let (c, d) = (filled(pool, M, 3), filled(pool, M, 4));
        let (pc, pd) = (c.as_ptr(), d.as_ptr());
        for buf in [a, b, c, d] {
            drop(pool.share(buf));
        }
        // Four free buffers of 5 MiB would not fit a 4 MiB pool: the oldest went.
        assert_eq!(pool.free_bytes(), 4 * M);
        assert_eq!(pool.take(2 * M).capacity(), 2 * M);
        // C and D are left, C the older: the next buffers given push C out before D.
        for byte in 5..8 {
            drop(pool.share(vec![byte; M]));
        }
        let kept: Vec<Vec<u8>> = (0..4).map(|_| pool.take(M)).collect();
        let kept: Vec<*const u8> = kept.iter().map(|b| b.as_ptr()).collect();
        assert!(!kept.contains(&pc), "the older buffer outlived a newer one");
        assert!(kept.contains(&pd), "the newer buffer was dropped first");
    }

    #[test]
    fn small_reads_bypass_the_pool() {
        let pool = leaked(8 << 20);
        drop(pool.share(filled(pool, 1000, 3)));
        assert_eq!(pool.free_bytes(), 0);
    }
}
