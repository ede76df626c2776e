//! The daemon-wide bound on inline batch bytes waiting for their clients (`serve --inline-budget`).
//!
//! An inline stream's messages carry its samples' bytes, and each stream keeps a few of them
//! ahead of its client (its outbox, [`super::outbox`], and the batch being queued): a client that
//! stops reading (a long step, a trainer stopped with Ctrl-Z) leaves them all in the daemon. Eight
//! such streams of 8 MiB batches held ~510 MiB of the daemon's memory, and `--max-streams` allows
//! 768 streams. The budget counts each inline message's bytes from when it is queued until the
//! connection takes it. While the budget is spent, a stream whose messages still wait builds
//! nothing more until they are taken or the budget has room again; a stream with nothing waiting
//! always builds its next batch, so clients that stop reading cannot stop the others, which keep
//! one batch at a time. The bound is thus the budget plus about a batch per stream.
//!
//! Shared-memory and rdma streams queue descriptors, not bytes, and are not counted: their
//! memory has budgets of its own (`--packed-budget`, `--rdma-budget`, the client's ring).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// How often a blocked stream checks whether it must stop (its client left, a shutdown) between
/// the wake-ups every release gives it.
const POLL: Duration = Duration::from_millis(50);

/// One daemon's inline bytes queued, against its limit.
#[derive(Debug)]
pub struct InlineBudget {
    limit: u64,
    used: Mutex<u64>,
    /// Wakes streams waiting on a blocking thread.
    freed: Condvar,
    /// Wakes streams waiting on the runtime.
    freed_async: tokio::sync::Notify,
}

impl InlineBudget {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self { limit, used: Mutex::new(0), freed: Condvar::new(), freed_async: tokio::sync::Notify::new() })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes of inline messages queued right now, every stream's.
    pub fn used(&self) -> u64 {
        *self.lock()
    }

    /// A new stream's account.
    pub fn account(self: &Arc<Self>) -> StreamBytes {
        StreamBytes { budget: self.clone(), mine: Mutex::new(Mine::default()) }
    }

    fn lock(&self) -> MutexGuard<'_, u64> {
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, bytes: u64) {
        let mut used = self.lock();
        *used += bytes;
        crate::metrics::inline_queued_bytes(*used);
    }

    fn sub(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let mut used = self.lock();
        *used = used.saturating_sub(bytes);
        crate::metrics::inline_queued_bytes(*used);
        drop(used);
        self.freed.notify_all();
        self.freed_async.notify_waiters();
    }

    fn has_room(&self) -> bool {
        *self.lock() < self.limit
    }
}

/// One stream's share of the budget: what it has queued, until the connection takes it.
#[derive(Debug)]
pub struct StreamBytes {
    budget: Arc<InlineBudget>,
    mine: Mutex<Mine>,
}

#[derive(Debug, Default)]
struct Mine {
    queued: u64,
    /// The connection's end is gone: nothing is counted any more.
    closed: bool,
}

impl StreamBytes {
    fn mine(&self) -> MutexGuard<'_, Mine> {
        self.mine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts `bytes` about to be queued; false once the connection's end is gone (nothing is
    /// counted then, and nothing should be queued).
    pub fn charge(&self, bytes: u64) -> bool {
        let mut mine = self.mine();
        if mine.closed {
            return false;
        }
        mine.queued += bytes;
        self.budget.add(bytes);
        true
    }

    /// The connection took `bytes` of what was counted (or they were never queued).
    pub fn release(&self, bytes: u64) {
        let mut mine = self.mine();
        let n = bytes.min(mine.queued);
        mine.queued -= n;
        self.budget.sub(n);
    }

    /// The connection's end is gone, and with it whatever was queued.
    pub fn close(&self) {
        let mut mine = self.mine();
        mine.closed = true;
        let n = std::mem::take(&mut mine.queued);
        self.budget.sub(n);
    }

    /// Whether the stream may build its next batch now: it has nothing queued, or the budget is
    /// not spent.
    pub fn may_build(&self) -> bool {
        let mine = self.mine();
        mine.closed || mine.queued == 0 || self.budget.has_room()
    }

    /// Waits on a blocking thread until the stream may build, or `stop` turns true; returns
    /// whether it may build.
    pub fn wait_blocking(&self, stop: &dyn Fn() -> bool) -> bool {
        loop {
            if self.may_build() {
                return true;
            }
            if stop() {
                return false;
            }
            let used = self.budget.lock();
            // A release between the check above and this wait is caught at the next POLL.
            let _woken = self.budget.freed.wait_timeout(used, POLL).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Resolves once the stream may build (the caller selects it with its client leaving and
    /// the shutdown).
    pub async fn room(&self) {
        loop {
            let freed = self.budget.freed_async.notified();
            tokio::pin!(freed);
            // Registered before the check: a release after it wakes this wait.
            freed.as_mut().enable();
            if self.may_build() {
                return;
            }
            freed.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    #[test]
    fn a_stream_with_nothing_queued_always_builds_others_wait_for_room() {
        let budget = InlineBudget::new(100);
        let (a, b) = (budget.account(), budget.account());
        assert!(a.charge(150), "a charge is never refused: the batch exists already");
        assert_eq!(budget.used(), 150);
        assert!(!a.may_build(), "over the budget with bytes queued");
        assert!(b.may_build(), "nothing queued: one batch at a time whatever the others hold");
        assert!(b.charge(10));
        assert!(!b.may_build());
        a.release(100);
        assert_eq!(budget.used(), 60);
        assert!(a.may_build() && b.may_build(), "under the budget again");
        // Released more than it holds: only what it holds counts.
        b.release(1000);
        assert_eq!(budget.used(), 50);
    }

    #[test]
    fn a_closed_stream_gives_everything_back_and_counts_nothing_more() {
        let budget = InlineBudget::new(100);
        let a = budget.account();
        assert!(a.charge(70) && a.charge(70));
        a.close();
        assert_eq!(budget.used(), 0);
        assert!(!a.charge(5), "nothing is queued once the connection's end is gone");
        assert_eq!(budget.used(), 0);
        assert!(a.may_build(), "a closed stream never waits: it stops at its next check");
    }

    #[test]
    fn a_blocked_stream_wakes_at_a_release_and_at_its_stop() {
        let budget = InlineBudget::new(100);
        let (a, b) = (Arc::new(budget.account()), budget.account());
        assert!(a.charge(60) && b.charge(60));
        let waiter = {
            let a = a.clone();
            std::thread::spawn(move || {
                let t = std::time::Instant::now();
                (a.wait_blocking(&|| false), t.elapsed())
            })
        };
        std::thread::sleep(Duration::from_millis(300));
        b.release(60);
        let (may, waited) = waiter.join().unwrap();
        assert!(may && waited >= Duration::from_millis(250), "{waited:?}");
        assert!(b.charge(60));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let w = s.spawn(|| a.wait_blocking(&|| stop.load(Ordering::Relaxed)));
            std::thread::sleep(Duration::from_millis(100));
            stop.store(true, Ordering::Relaxed);
            assert!(!w.join().unwrap(), "stopped, not let through");
        });
    }

    #[tokio::test]
    async fn an_async_wait_ends_at_the_release() {
        let budget = InlineBudget::new(100);
        let (a, b) = (Arc::new(budget.account()), budget.account());
        assert!(a.charge(60) && b.charge(60));
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.room().await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!waiting.is_finished());
        b.release(60);
        tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
    }
}
