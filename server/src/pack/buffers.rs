//! Recycled sample buffers: readers take a buffer here for each sample they lay out, and the
//! writer gives it back once the buffer has reached the shard file.
//!
//! Without recycling every sample was a fresh allocation of ~20 KB in a reader thread, freed in
//! the writer thread; glibc handed those pages back to the kernel and took new zeroed ones for the
//! next samples, ~3.5 page faults per packed file (68,000-77,000 for 20,000 files, where GNU tar
//! takes 130), and the faults were most of the sys time by which `pack` trailed `tar cf`
//! (bench/PROFILES.md). A pool bounded in bytes keeps the same pages in use instead.

use std::sync::Mutex;

/// Most bytes of capacity the pool holds: a few thousand samples of ~20 KB, small next to the
/// reorder window's [`super::read::MAX_BUFFERED_BYTES`].
const MAX_POOLED_BYTES: usize = 64 << 20;
/// Capacity of a new buffer: an image-sized sample with its headers fits without the buffer
/// growing (each growth was a `realloc` that copied the sample so far into new pages).
const NEW_CAPACITY: usize = 32 << 10;
/// Buffers larger than this are freed, not pooled: a rare large sample should not pin its memory.
const MAX_POOLED_BUFFER: usize = 1 << 20;

struct Pool {
    free: Vec<Vec<u8>>,
    bytes: usize,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { free: Vec::new(), bytes: 0 });

fn pool() -> std::sync::MutexGuard<'static, Pool> {
    // The pool holds no invariant a panicking holder could break: recover it.
    POOL.lock().unwrap_or_else(|p| p.into_inner())
}

/// An empty buffer, with the capacity of a recycled one when there is one.
pub fn take() -> Vec<u8> {
    let mut p = pool();
    match p.free.pop() {
        Some(buf) => {
            p.bytes -= buf.capacity();
            buf
        }
        None => Vec::with_capacity(NEW_CAPACITY),
    }
}

/// Returns a buffer whose bytes are no longer needed.
pub fn give_back(mut buf: Vec<u8>) {
    let cap = buf.capacity();
    if cap == 0 || cap > MAX_POOLED_BUFFER {
        return;
    }
    buf.clear();
    let mut p = pool();
    if p.bytes + cap <= MAX_POOLED_BYTES {
        p.bytes += cap;
        p.free.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_empty_with_their_capacity_and_the_pool_stays_bounded() {
        give_back(Vec::with_capacity(4096));
        let got = take();
        assert!(got.is_empty());
        // Other tests of the crate share the pool: any recycled buffer has some capacity.
        assert!(got.capacity() > 0);
        give_back(vec![0u8; MAX_POOLED_BUFFER + 1]);
        for _ in 0..(MAX_POOLED_BYTES / 4096 + 10) {
            give_back(Vec::with_capacity(4096));
        }
        assert!(pool().bytes <= MAX_POOLED_BYTES);
        assert!(pool().free.iter().all(|b| b.is_empty() && b.capacity() <= MAX_POOLED_BUFFER));
    }
}
