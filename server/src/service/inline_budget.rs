//! The daemon-wide bound on inline batch bytes waiting for their clients (`serve --inline-budget`).
//!
//! An inline stream's messages carry its samples' bytes, and each stream keeps a few of them
//! ahead of its client (its outbox, [`super::outbox`], and the batch being queued): a client that
//! stops reading (a long step, a trainer stopped with Ctrl-Z) leaves them all in the daemon. Eight
//! such streams of 8 MiB batches held ~510 MiB of the daemon's memory, and `--max-streams` allows
//! 768 streams. The budget counts each inline message's bytes from when it is queued until the
//! connection takes it. While the budget is spent, a stream with more than [`ALLOWANCE`] still
//! waiting builds nothing more until they are taken or the budget has room again; a stream under
//! it always builds its next batch, so clients that stop reading cannot stop the others, and
//! streams of small batches go on as before (queueing and grouping their messages). The bound is
//! thus the budget plus about the allowance and a batch per stream.
//!
//! A blocked stream is woken when its own bytes being taken lets it go on (under its allowance,
//! or the budget no longer spent); room that other streams' bytes make it notices at its next
//! [`POLL`], up to 100 ms later, when its client may have emptied its queue meanwhile: a delay
//! only while the budget is spent, which stopped clients cause. Waking every blocked stream at
//! every release (the first form) made each batch of the streams still served pay for every
//! stopped one: 0.2 ms a batch with 64 of them, 0.7 ms with 256, in a review's model; with the
//! wake-ups a stream's own, 8 us whatever the number blocked.
//!
//! Shared-memory and rdma streams queue descriptors, not bytes, and are not counted: their
//! memory has budgets of its own (`--packed-budget`, `--rdma-budget`, the client's ring).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Bytes a stream may always keep queued, whatever the budget: small batches go on being grouped
/// (one wake-up of the connection's task for several, [`super::outbox`]) and built ahead.
pub const ALLOWANCE: u64 = 1 << 20;

/// How often a blocked stream looks at the budget again, and checks whether it must stop (its
/// client left, a shutdown). 256 blocked streams cost the daemon 3% of a core in these looks.
const POLL: Duration = Duration::from_millis(100);

/// One daemon's inline bytes queued, against its limit.
#[derive(Debug)]
pub struct InlineBudget {
    limit: u64,
    used: Mutex<u64>,
    /// [`POLL`], but in tests.
    poll: Duration,
}

impl InlineBudget {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self { limit, used: Mutex::new(0), poll: POLL })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes of inline messages queued right now, every stream's.
    pub fn used(&self) -> u64 {
        *self.lock()
    }

    /// A budget whose blocked streams look at it again every `poll` (tests that must tell a
    /// wake-up from the poll).
    #[cfg(test)]
    fn with_poll(limit: u64, poll: Duration) -> Arc<Self> {
        Arc::new(Self { limit, used: Mutex::new(0), poll })
    }

    /// A new stream's account.
    pub fn account(self: &Arc<Self>) -> StreamBytes {
        StreamBytes {
            budget: self.clone(),
            mine: Mutex::new(Mine::default()),
            taken: Condvar::new(),
            taken_async: tokio::sync::Notify::new(),
        }
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
    /// Wakes the stream's producer, waiting on a blocking thread or on the runtime, once what it
    /// queued is all taken.
    taken: Condvar,
    taken_async: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct Mine {
    queued: u64,
    /// The connection's end is gone: nothing is counted any more.
    closed: bool,
    /// The producer waits for room: a release that lets it go on wakes it (a wake-up nobody
    /// waits for is a futex call on every group taken).
    waiting: bool,
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
        if mine.waiting && self.free_to_build(&mine) {
            drop(mine);
            self.wake();
        }
    }

    /// The connection's end is gone, and with it whatever was queued.
    pub fn close(&self) {
        let mut mine = self.mine();
        mine.closed = true;
        let n = std::mem::take(&mut mine.queued);
        self.budget.sub(n);
        let waiting = mine.waiting;
        drop(mine);
        if waiting {
            self.wake();
        }
    }

    /// The connection's end is gone ([`Self::close`]): the producer stops.
    pub fn is_closed(&self) -> bool {
        self.mine().closed
    }

    fn wake(&self) {
        self.taken.notify_all();
        self.taken_async.notify_waiters();
    }

    fn free_to_build(&self, mine: &Mine) -> bool {
        mine.closed || mine.queued < ALLOWANCE || self.budget.has_room()
    }

    /// Whether the stream may build its next batch now: it has less than [`ALLOWANCE`] queued,
    /// or the budget is not spent.
    pub fn may_build(&self) -> bool {
        self.free_to_build(&self.mine())
    }

    /// Waits on a blocking thread until the stream may build, or `stop` turns true; returns
    /// whether it may build.
    pub fn wait_blocking(&self, stop: &dyn Fn() -> bool) -> bool {
        loop {
            if stop() {
                return false;
            }
            let mut mine = self.mine();
            if self.free_to_build(&mine) {
                return true;
            }
            // Under the stream's lock from the check on: a release cannot slip in between.
            mine.waiting = true;
            let (mut mine, _) = self.taken.wait_timeout(mine, self.budget.poll).unwrap_or_else(|p| p.into_inner());
            mine.waiting = false;
        }
    }

    /// Resolves once the stream may build (the caller selects it with its client leaving and
    /// the shutdown; dropped meanwhile, it leaves at most a wake-up nobody waits for).
    pub async fn room(&self) {
        loop {
            let taken = self.taken_async.notified();
            tokio::pin!(taken);
            // Registered before the check: a release after it wakes this wait.
            taken.as_mut().enable();
            {
                let mut mine = self.mine();
                mine.waiting = !self.free_to_build(&mine);
                if !mine.waiting {
                    return;
                }
            }
            let _ = tokio::time::timeout(self.budget.poll, taken).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    use super::*;

    const M: u64 = ALLOWANCE;

    #[test]
    fn a_stream_under_its_allowance_always_builds_others_wait_for_room() {
        let budget = InlineBudget::new(2 * M);
        let (a, b) = (budget.account(), budget.account());
        assert!(a.charge(3 * M), "a charge is never refused: the batch exists already");
        assert_eq!(budget.used(), 3 * M);
        assert!(!a.may_build(), "over the budget with more than the allowance queued");
        assert!(b.may_build(), "nothing queued: one batch at a time whatever the others hold");
        assert!(b.charge(M / 2));
        assert!(b.may_build(), "small batches go on under the allowance");
        assert!(b.charge(M));
        assert!(!b.may_build());
        a.release(3 * M);
        assert_eq!(budget.used(), 3 * M / 2);
        assert!(a.may_build() && b.may_build(), "under the budget again");
        // Released more than it holds: only what it holds counts.
        b.release(10 * M);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn a_closed_stream_gives_everything_back_and_counts_nothing_more() {
        let budget = InlineBudget::new(M);
        let a = budget.account();
        assert!(a.charge(2 * M) && a.charge(2 * M));
        a.close();
        assert_eq!(budget.used(), 0);
        assert!(!a.charge(5), "nothing is queued once the connection's end is gone");
        assert_eq!(budget.used(), 0);
        assert!(a.may_build(), "a closed stream never waits: it stops at its next check");
    }

    /// Waits in `a` on another thread; returns how long until it was let through (or stopped).
    fn wait_in(a: &Arc<StreamBytes>) -> std::thread::JoinHandle<(bool, Duration)> {
        let a = a.clone();
        std::thread::spawn(move || {
            let t = Instant::now();
            (a.wait_blocking(&|| false), t.elapsed())
        })
    }

    /// Blocked streams look at the budget only every ten seconds here: a wait that ends sooner
    /// was ended by a wake-up.
    const NO_POLL: Duration = Duration::from_secs(10);

    #[test]
    fn a_blocked_stream_is_woken_by_its_own_release() {
        let budget = InlineBudget::with_poll(M, NO_POLL);
        let (a, b) = (Arc::new(budget.account()), budget.account());
        assert!(a.charge(2 * M) && b.charge(2 * M));
        let waiter = wait_in(&a);
        std::thread::sleep(Duration::from_millis(150));
        b.release(2 * M); // the budget is still spent by a's own bytes
        std::thread::sleep(Duration::from_millis(150));
        assert!(!waiter.is_finished());
        let released = Instant::now();
        a.release(2 * M);
        let (may, _) = waiter.join().unwrap();
        assert!(may && released.elapsed() < NO_POLL / 4, "{:?}", released.elapsed());
    }

    #[test]
    fn a_release_that_frees_the_budget_wakes_its_stream_though_it_holds_more_than_its_allowance() {
        let budget = InlineBudget::with_poll(3 * M, NO_POLL);
        let (a, b) = (Arc::new(budget.account()), budget.account());
        assert!(a.charge(3 * M) && b.charge(M));
        let waiter = wait_in(&a);
        std::thread::sleep(Duration::from_millis(150));
        assert!(!waiter.is_finished());
        let released = Instant::now();
        a.release(2 * M); // a keeps its allowance's worth; the budget holds 2 of 3
        let (may, _) = waiter.join().unwrap();
        assert!(may && released.elapsed() < NO_POLL / 4, "{:?}", released.elapsed());
    }

    #[test]
    fn a_blocked_stream_notices_the_budgets_room_at_its_poll_and_stops_when_told() {
        let budget = InlineBudget::new(3 * M);
        let (a, b) = (Arc::new(budget.account()), budget.account());
        assert!(a.charge(2 * M) && b.charge(2 * M));
        let waiter = wait_in(&a);
        std::thread::sleep(Duration::from_millis(200));
        b.release(2 * M); // room again; a's bytes are still queued
        let (may, waited) = waiter.join().unwrap();
        assert!(may && waited >= Duration::from_millis(200) && waited < Duration::from_secs(2), "{waited:?}");
        assert!(b.charge(2 * M));
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let w = s.spawn(|| a.wait_blocking(&|| stop.load(Ordering::Relaxed)));
            std::thread::sleep(Duration::from_millis(100));
            stop.store(true, Ordering::Relaxed);
            assert!(!w.join().unwrap(), "stopped, not let through");
        });
    }

    #[tokio::test]
    async fn an_async_wait_ends_at_the_streams_release() {
        let budget = InlineBudget::with_poll(M, NO_POLL);
        let (a, b) = (Arc::new(budget.account()), budget.account());
        assert!(a.charge(2 * M) && b.charge(2 * M));
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.room().await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished());
        let released = Instant::now();
        a.release(2 * M);
        tokio::time::timeout(NO_POLL / 4, waiting).await.unwrap().unwrap();
        assert!(released.elapsed() < NO_POLL / 4, "{:?}", released.elapsed());
    }
}
