//! The daemon's one background writer of kept row groups (`format::parquet::kept`) for streams
//! without views: they serve a row group from memory at once and leave its writing to this
//! thread, which runs at the lowest priority (nice 19), so the writing takes mostly CPU that
//! decoding, gathering and the trainers leave unused.
//!
//! Not `SCHED_IDLE`: the writer takes locks the serving threads take too (the allocator's, the
//! node cache's table, the decoded cache's), and an idle-class thread preempted while holding one
//! may wait a long time for a busy CPU, the serving thread behind it (no priority inheritance
//! on those locks). A nice-19 thread still gets its small share and lets go soon.
//!
//! Why not in the batch path: writing a row group costs about what decoding it does (page-cache
//! pages are new memory; bench/PARQUET_PROFILE.md), so an epoch that kept every row group it
//! decoded again ran at a third of the one before. Views streams still keep in the batch path:
//! there the kept file is the memory the batch points into.
//!
//! Jobs wait in a queue bounded in bytes ([`MAX_QUEUED_BYTES`]): each holds its row group until
//! written, outside the decoded budget. A job that does not fit is refused and its caller tries
//! again the next time it uses the row group.
//!
//! Once every row group is kept, the decoded cache holds only file mappings, and the heap that
//! held the decoded copies sits free in the allocator (`crate::malloc` keeps freed blocks for
//! reuse): after [`TRIM_AFTER_IDLE`] without a job, the writer returns it to the kernel, once per
//! idle spell that follows writing.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};

/// Bytes of row groups waiting to be written, at most.
pub const MAX_QUEUED_BYTES: u64 = 256 << 20;

/// Idle time after the last job before the writer trims the heap.
pub const TRIM_AFTER_IDLE: std::time::Duration = std::time::Duration::from_secs(10);

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<(u64, Job)>,
    bytes: u64,
}

pub struct KeptWriter {
    queue: Mutex<Queue>,
    ready: Condvar,
}

impl std::fmt::Debug for KeptWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptWriter").finish_non_exhaustive()
    }
}

/// The writer, its thread started on first use; None when the thread cannot be started (logged
/// once: nothing is then kept in the background).
pub fn shared() -> Option<&'static KeptWriter> {
    static SHARED: OnceLock<Option<&'static KeptWriter>> = OnceLock::new();
    *SHARED.get_or_init(|| {
        let w: &'static KeptWriter =
            Box::leak(Box::new(KeptWriter { queue: Mutex::new(Queue::default()), ready: Condvar::new() }));
        match std::thread::Builder::new().name("kept-writer".into()).spawn(move || w.run()) {
            Ok(_) => Some(w),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the kept row-group writer; row groups of streams without views are not kept");
                None
            }
        }
    })
}

impl KeptWriter {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // Every mutation of the queue is complete before anything that can panic.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `job`, which holds `bytes` until it has run. False (the job dropped unrun) when the
    /// queue has no room for it.
    pub fn submit(&self, bytes: u64, job: Job) -> bool {
        let mut q = self.lock();
        if q.bytes > 0 && q.bytes.saturating_add(bytes) > MAX_QUEUED_BYTES {
            return false;
        }
        q.bytes = q.bytes.saturating_add(bytes);
        q.jobs.push_back((bytes, job));
        drop(q);
        self.ready.notify_one();
        true
    }

    fn run(&self) -> ! {
        low_priority();
        let mut wrote = false;
        loop {
            let (bytes, job) = {
                let mut q = self.lock();
                loop {
                    if let Some(next) = q.jobs.pop_front() {
                        break next;
                    }
                    let (guard, waited) =
                        self.ready.wait_timeout(q, TRIM_AFTER_IDLE).unwrap_or_else(|p| p.into_inner());
                    q = guard;
                    if waited.timed_out() && q.jobs.is_empty() && std::mem::take(&mut wrote) {
                        drop(q);
                        crate::malloc::trim();
                        q = self.lock();
                    }
                }
            };
            wrote = true;
            // A job that panics must not take the writer down with it: the daemon would keep
            // queueing work nobody runs.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                tracing::error!("a kept row-group write panicked; the writer goes on");
            }
            let mut q = self.lock();
            q.bytes = q.bytes.saturating_sub(bytes);
        }
    }
}

/// Gives the calling thread the lowest nice value (per thread on Linux).
fn low_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain system calls on integers; the thread id names the calling thread, and
        // lowering one's own priority needs no privilege.
        let ok = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) } == 0;
        if !ok {
            let e = std::io::Error::last_os_error();
            tracing::warn!(error = %e, "cannot lower the kept row-group writer's priority");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn jobs_run_in_order_and_a_full_queue_refuses() {
        let w = shared().expect("the writer thread starts");
        let ran = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        // The first job holds the writer until the gate opens, so the next ones queue up.
        let g = gate.clone();
        assert!(w.submit(
            1,
            Box::new(move || {
                let (open, cv) = &*g;
                let mut o = open.lock().unwrap();
                while !*o {
                    o = cv.wait(o).unwrap();
                }
            })
        ));
        for i in 0..3u32 {
            let r = ran.clone();
            assert!(w.submit(MAX_QUEUED_BYTES / 4, Box::new(move || r.lock().unwrap().push(i))));
        }
        assert!(!w.submit(MAX_QUEUED_BYTES / 2, Box::new(|| panic!("a refused job never runs"))));
        // A panicking job does not stop the writer.
        assert!(w.submit(1, Box::new(|| panic!("a job that panics"))));
        let after = Arc::new(AtomicU32::new(0));
        let a = after.clone();
        assert!(w.submit(1, Box::new(move || _ = a.fetch_add(1, Ordering::SeqCst))));
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while after.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(after.load(Ordering::SeqCst), 1);
        assert_eq!(*ran.lock().unwrap(), [0, 1, 2]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_writer_runs_at_the_lowest_priority() {
        shared().expect("the writer thread starts");
        let nice = || -> Option<i32> {
            let writer = std::fs::read_dir("/proc/self/task")
                .ok()?
                .filter_map(|t| t.ok())
                .find(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "kept-writer"))?;
            let stat = std::fs::read_to_string(writer.path().join("stat")).ok()?;
            // After the command (in parentheses): state is field 3, nice field 19.
            let after_comm = &stat[stat.rfind(')')? + 2..];
            after_comm.split_whitespace().nth(16)?.parse().ok()
        };
        // The thread names itself and lowers its priority as it starts.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while nice() != Some(19) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(nice(), Some(19));
    }
}
