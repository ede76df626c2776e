//! The lock a stream's progress thread shares with the threads that use the stream.
//!
//! Under manual progress (the `tcp` provider) bytes move only while some thread of the process is
//! inside libfabric, so each end of an rdma stream keeps a progress thread waiting in libfabric
//! whenever nobody else is: it goes straight back in after each wait, since any pause stalled
//! every transfer in flight for that long (1 ms on the client, 200 us on the daemon, measured).
//! std's mutex is not fair, though: a thread that gives the lock up and asks again at once gets
//! it back ahead of a waiting caller (measured: rdma 7x slower). So a caller first says it wants
//! the lock and wakes the progress thread out of its wait; the progress thread stands back while
//! anyone wants it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// `T` (a stream end) behind a mutex that callers take ahead of its progress thread.
pub struct Progressed<T> {
    inner: Mutex<T>,
    /// Callers asking for the lock right now.
    wanted: AtomicUsize,
    /// Wakes the progress thread out of its wait in libfabric (the stream's completion queue).
    wake: Box<dyn Fn() + Send + Sync>,
}

impl<T> Progressed<T> {
    pub fn new(value: T, wake: impl Fn() + Send + Sync + 'static) -> Self {
        Self { inner: Mutex::new(value), wanted: AtomicUsize::new(0), wake: Box::new(wake) }
    }

    /// For the stream's users: wakes the progress thread and takes the lock ahead of it.
    pub fn lock(&self) -> MutexGuard<'_, T> {
        self.wanted.fetch_add(1, Ordering::SeqCst);
        (self.wake)();
        let guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        self.wanted.fetch_sub(1, Ordering::SeqCst);
        guard
    }

    /// For the progress thread: the lock, or None while a user asks for it (the progress
    /// thread then yields, drops what keeps the stream alive, and comes back).
    pub fn lock_for_progress(&self) -> Option<MutexGuard<'_, T>> {
        if self.wanted.load(Ordering::SeqCst) > 0 {
            return None;
        }
        Some(self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use super::*;

    fn counted() -> (Arc<Progressed<u64>>, Arc<AtomicUsize>) {
        let woken = Arc::new(AtomicUsize::new(0));
        let w = woken.clone();
        let p = Arc::new(Progressed::new(0u64, move || {
            w.fetch_add(1, Ordering::SeqCst);
        }));
        (p, woken)
    }

    #[test]
    fn while_a_user_waits_the_progress_thread_is_refused_the_lock() {
        let (p, woken) = counted();
        // The progress thread holds the lock, as it does while it waits in libfabric.
        let held = p.lock_for_progress().expect("nobody wants it yet");
        let user = {
            let p = p.clone();
            std::thread::spawn(move || *p.lock() += 1)
        };
        // `lock()` says it wants the lock before it wakes the progress thread, so once the wake
        // has come the progress thread must be refused until the user has had its turn.
        while woken.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        // Asked from another thread, so a progress thread let in would block there, not here.
        let (tx, rx) = std::sync::mpsc::channel();
        let progress = {
            let p = p.clone();
            std::thread::spawn(move || {
                let _ = tx.send(p.lock_for_progress().is_none());
            })
        };
        let refused = rx.recv_timeout(Duration::from_secs(5));
        assert_eq!(refused, Ok(true), "a user is waiting, yet the progress thread was let in");
        drop(held);
        user.join().expect("user thread");
        progress.join().expect("progress thread");
        assert_eq!(*p.lock_for_progress().expect("nobody wants it now"), 1);
    }

    #[test]
    fn a_progress_thread_that_takes_the_lock_again_at_once_never_starves_a_user() {
        let (p, woken) = counted();
        // A progress thread that takes the lock again the moment it lets go, as the real one does.
        // How often it stands back is up to the scheduler (a woken user may run all its turns
        // before the progress thread runs again), so only the users' waits are checked.
        let stop = Arc::new(AtomicBool::new(false));
        let progress = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    match p.lock_for_progress() {
                        Some(mut n) => {
                            *n += 1;
                            std::thread::sleep(Duration::from_micros(200));
                        }
                        None => std::thread::yield_now(),
                    }
                }
            })
        };
        while *p.lock() == 0 {
            std::thread::yield_now();
        }
        for _ in 0..50 {
            let t = Instant::now();
            drop(p.lock());
            assert!(t.elapsed() < Duration::from_millis(100), "a user waited {:?}", t.elapsed());
        }
        stop.store(true, Ordering::SeqCst);
        progress.join().expect("progress thread");
        assert!(woken.load(Ordering::SeqCst) >= 51, "every lock() wakes the progress thread");
    }
}
