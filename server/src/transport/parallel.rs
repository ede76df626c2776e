//! A scoped parallel loop on the daemon's persistent helper threads, for the packed gather.
//!
//! `for_each(tasks, body)` calls `body(0..tasks)`, each index once, on the calling thread and on
//! whichever helper picks the loop up meanwhile, and returns when every call has returned. The
//! caller takes task indices itself from the start and never waits for a helper that has not
//! begun: a helper that wakes late (a parked thread on a busy 2-core machine starts ~200 us
//! after it is woken) finds the tasks taken and leaves. This replaces a `thread::scope` spawn
//! per batch, whose thread creation, wake-up and join showed as ~21% of the daemon's profile.
//!
//! Helpers spin briefly for the next loop before parking: a stream gathers batches back to back
//! (two at once), so the next loop usually comes within a batch's time.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper looks for the next loop before it parks.
const SPIN: Duration = Duration::from_micros(50);

type Body = dyn Fn(usize) + Sync;

/// A loop body whose lifetime was erased so a helper can call it.
#[derive(Clone, Copy)]
struct BodyPtr(*const Body);

// SAFETY: the pointee is `Sync` (so calling it from another thread through a shared reference
// is sound), and `for_each` keeps it alive until every helper that took the pointer is done.
unsafe impl Send for BodyPtr {}

struct JobState {
    /// The body, while helpers may still join; None once the caller has closed the loop.
    body: Option<BodyPtr>,
    /// Helpers inside the body.
    running: usize,
    panicked: bool,
}

/// One `for_each` call, shared with the helpers through the queue.
struct Job {
    tasks: usize,
    next: AtomicUsize,
    state: Mutex<JobState>,
    idle: Condvar,
}

impl Job {
    fn lock(&self) -> MutexGuard<'_, JobState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs task indices until none is left.
    fn drain(&self, body: &(dyn Fn(usize) + Sync + '_)) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.tasks {
                return;
            }
            body(i);
        }
    }

    /// What a helper does with a job it dequeued.
    fn help(&self) {
        let body = {
            let mut st = self.lock();
            match st.body {
                Some(b) if self.next.load(Ordering::Relaxed) < self.tasks => {
                    st.running += 1;
                    b
                }
                _ => return,
            }
        };
        // SAFETY: `running` was raised while the body was still published, under the lock the
        // caller takes to withdraw it; the caller then waits for `running` to fall back to zero
        // before its body goes out of scope, so the pointer is valid for this whole call.
        let body = unsafe { &*body.0 };
        let ok = catch_unwind(AssertUnwindSafe(|| self.drain(body))).is_ok();
        let mut st = self.lock();
        st.running -= 1;
        st.panicked |= !ok;
        if st.running == 0 {
            self.idle.notify_all();
        }
    }
}

/// Withdraws a job's body and waits for the helpers inside it; on every exit of `for_each`,
/// unwinding included, so no helper can call a body that is gone.
struct Close<'a>(&'a Job);

impl Drop for Close<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.body = None;
        while st.running > 0 {
            st = self.0.idle.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

struct Pool {
    queue: Mutex<VecDeque<Arc<Job>>>,
    queued: AtomicUsize,
    wake: Condvar,
    /// Helpers parked on `wake` (a submit only signals when one is).
    parked: AtomicUsize,
    started: AtomicBool,
    helpers: usize,
}

impl Pool {
    fn global(helpers: usize) -> &'static Arc<Pool> {
        static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
        POOL.get_or_init(|| {
            Arc::new(Pool {
                queue: Mutex::new(VecDeque::new()),
                queued: AtomicUsize::new(0),
                wake: Condvar::new(),
                parked: AtomicUsize::new(0),
                started: AtomicBool::new(false),
                helpers,
            })
        })
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Arc<Job>>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts the helpers on first use. A helper that cannot be started leaves the caller to do
    /// every task itself, which is correct, only slower.
    fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        for i in 0..self.helpers {
            let pool = self.clone();
            let spawned =
                std::thread::Builder::new().name(format!("shardstream-gather-{i}")).spawn(move || pool.helper());
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start a gather helper thread; gathering on one thread");
            }
        }
    }

    fn submit(&self, job: Arc<Job>) {
        self.lock().push_back(job);
        self.queued.fetch_add(1, Ordering::Release);
        if self.parked.load(Ordering::Acquire) > 0 {
            self.wake.notify_one();
        }
    }

    fn helper(&self) -> ! {
        loop {
            let spin_until = Instant::now() + SPIN;
            while self.queued.load(Ordering::Acquire) == 0 && Instant::now() < spin_until {
                std::hint::spin_loop();
            }
            let job = {
                let mut q = self.lock();
                loop {
                    if let Some(job) = q.pop_front() {
                        self.queued.fetch_sub(1, Ordering::Release);
                        break job;
                    }
                    self.parked.fetch_add(1, Ordering::AcqRel);
                    q = self.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                    self.parked.fetch_sub(1, Ordering::AcqRel);
                }
            };
            job.help();
        }
    }
}

/// Calls `body(i)` for every `i` in `0..tasks`, on this thread and on up to `helpers` helper
/// threads (started once per process, shared by every caller; the first call fixes their
/// number). Returns when every call has returned. False if a call panicked on a helper (a panic
/// on this thread unwinds as usual, after the helpers have left the body).
pub fn for_each(tasks: usize, helpers: usize, body: &(dyn Fn(usize) + Sync)) -> bool {
    if tasks <= 1 || helpers == 0 {
        (0..tasks).for_each(body);
        return true;
    }
    let pool = Pool::global(helpers);
    pool.start();
    // SAFETY: only the lifetime changes (same type, same layout). The erased reference is
    // withdrawn by `Close` before this function returns or unwinds, and `Close` waits for every
    // helper that took it (see `Job::help`), so no use outlives `body`.
    let erased: *const Body = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Body>(body) };
    let job = Arc::new(Job {
        tasks,
        next: AtomicUsize::new(0),
        state: Mutex::new(JobState { body: Some(BodyPtr(erased)), running: 0, panicked: false }),
        idle: Condvar::new(),
    });
    pool.submit(job.clone());
    let close = Close(&job);
    job.drain(body);
    drop(close);
    !job.lock().panicked
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_exactly_once_and_borrows_stay_valid() {
        for round in 0..200 {
            let tasks = 1 + round % 17;
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            let local = vec![round; tasks];
            assert!(for_each(tasks, 1, &|i| {
                assert_eq!(local[i], round);
                hits[i].fetch_add(1, Ordering::Relaxed);
            }));
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
        }
    }

    #[test]
    fn a_slow_body_is_shared_with_a_helper() {
        // Tasks that each take 2 ms: some must run on another thread than the caller's. The one
        // helper is shared with the other tests of this process, so it may be busy elsewhere
        // during one loop, not during all of them.
        let me = std::thread::current().id();
        let shared = (0..50).any(|_| {
            let elsewhere = AtomicUsize::new(0);
            assert!(for_each(16, 1, &|_| {
                std::thread::sleep(Duration::from_millis(2));
                if std::thread::current().id() != me {
                    elsewhere.fetch_add(1, Ordering::Relaxed);
                }
            }));
            elsewhere.load(Ordering::Relaxed) > 0
        });
        assert!(shared, "no task ran on a helper in 50 loops");
    }

    #[test]
    fn concurrent_callers_each_get_all_their_tasks() {
        std::thread::scope(|s| {
            for t in 0..4 {
                s.spawn(move || {
                    for _ in 0..100 {
                        let sum = AtomicUsize::new(0);
                        assert!(for_each(8, 1, &|i| {
                            sum.fetch_add(i + t, Ordering::Relaxed);
                        }));
                        assert_eq!(sum.load(Ordering::Relaxed), 28 + 8 * t);
                    }
                });
            }
        });
    }

    #[test]
    fn a_panic_on_a_helper_is_reported_and_the_pool_survives() {
        let me = std::thread::current().id();
        let reported = (0..50).any(|_| {
            !for_each(64, 1, &|_| {
                std::thread::sleep(Duration::from_millis(1));
                if std::thread::current().id() != me {
                    panic!("helper task fails");
                }
            })
        });
        assert!(reported, "a helper's panic was never reported");
        let n = AtomicUsize::new(0);
        assert!(for_each(4, 1, &|_| {
            n.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(n.load(Ordering::Relaxed), 4);
    }
}
