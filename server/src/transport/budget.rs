//! The daemon-wide budget of packed-ring memory (`serve --packed-budget`). Every packed stream's
//! ring is a populated shared-memory segment of `ring_slots` whole batches; without a bound, 64
//! streams of 64 MiB batches would pin 32 GiB. A ring reserves its bytes here before it is made
//! and gives them back when the last mapping in the daemon goes ([`Reservation`] lives in the
//! ring).
//!
//! A stream whose ring does not fit waits up to [`BUDGET_WAIT`] for other streams to give ring
//! memory back (a job's streams start together and end together, so a short wait absorbs a
//! restart), then fails with [`Error::CacheFull`], gRPC `RESOURCE_EXHAUSTED`, whose message starts
//! with "packed ring budget exhausted". A ring larger than the whole budget fails at once.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// How long a stream waits for ring memory before it fails.
pub const BUDGET_WAIT: Duration = Duration::from_secs(10);

/// How often a waiting stream checks whether it was cancelled or no longer needs the memory.
const POLL: Duration = Duration::from_millis(20);

/// Fraction of physical memory packed rings may use by default: a quarter leaves the rest to the
/// trainers that map them and to the page cache the shards are read through.
const DEFAULT_FRACTION: u64 = 4;

/// Budget when physical memory cannot be read.
const FALLBACK_BUDGET: u64 = 8 << 30;

/// The default `--packed-budget`: a quarter of the memory the daemon may use, the smaller of
/// physical memory and its cgroup's limit (a container's memory limit: a quarter of the node's
/// memory could exceed it, and the kernel would kill the daemon instead of refusing a ring).
pub fn default_budget() -> u64 {
    let physical = physical_memory();
    let cgroup = std::fs::read_to_string("/sys/fs/cgroup/memory.max").ok().and_then(|s| parse_memory_max(&s));
    let memory = match (physical, cgroup) {
        (Some(p), Some(c)) => Some(p.min(c)),
        (p, c) => p.or(c),
    };
    memory.map_or(FALLBACK_BUDGET, |m| (m / DEFAULT_FRACTION).max(1 << 20))
}

/// cgroup v2 `memory.max`: a byte count, or `max` (no limit).
fn parse_memory_max(s: &str) -> Option<u64> {
    s.trim().parse().ok()
}

fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The packed-ring memory of the whole daemon.
#[derive(Debug)]
pub struct PackedBudget {
    limit: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl PackedBudget {
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self { limit, used: Mutex::new(0), freed: Condvar::new() })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes reserved right now.
    pub fn used(&self) -> u64 {
        *self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reserves `bytes`, waiting up to `wait` for room; `None` when `unneeded` turns true
    /// meanwhile (the stream got its memory another way). `cancelled` and `unneeded` are called
    /// without the budget's lock held, so they may take other locks.
    pub fn reserve(
        self: &Arc<Self>,
        bytes: u64,
        wait: Duration,
        cancelled: &dyn Fn() -> bool,
        unneeded: &dyn Fn() -> bool,
    ) -> Result<Option<Reservation>> {
        if bytes > self.limit {
            return Err(self.exhausted(bytes, None));
        }
        let deadline = Instant::now() + wait;
        loop {
            {
                let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
                if self.limit - *used < bytes {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(self.exhausted(bytes, Some(*used)));
                    }
                    // Woken by every release; the short step lets the checks below run.
                    let step = (deadline - now).min(POLL);
                    used = self.freed.wait_timeout(used, step).unwrap_or_else(|p| p.into_inner()).0;
                }
                if self.limit - *used >= bytes {
                    *used += bytes;
                    crate::metrics::packed_budget_bytes(*used);
                    return Ok(Some(Reservation { budget: self.clone(), bytes }));
                }
            }
            if cancelled() {
                return Err(Error::Unavailable("stream cancelled".into()));
            }
            if unneeded() {
                return Ok(None);
            }
        }
    }

    fn exhausted(&self, bytes: u64, used: Option<u64>) -> Error {
        let mib = |b: u64| b.div_ceil(1 << 20);
        let why = match used {
            Some(u) => {
                format!("{} MiB in use by other packed streams, waited {} s for them", mib(u), BUDGET_WAIT.as_secs())
            }
            None => "more than the whole budget".into(),
        };
        Error::CacheFull(format!(
            "packed ring budget exhausted: this stream needs a {} MiB ring, --packed-budget is {} MiB ({why}); \
             use smaller batches, fewer --ring-slots, a larger --packed-budget, or collate=None (views)",
            mib(bytes),
            mib(self.limit)
        ))
    }

    fn release(&self, bytes: u64) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(bytes);
        crate::metrics::packed_budget_bytes(*used);
        drop(used);
        self.freed.notify_all();
    }
}

/// Ring memory held against the budget; given back on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<PackedBudget>,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.release(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_limit_is_read_and_max_means_none() {
        assert_eq!(parse_memory_max("8589934592\n"), Some(8 << 30));
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max(""), None);
        assert!(default_budget() >= 1 << 20);
    }

    fn never() -> bool {
        false
    }
    const NEVER: &dyn Fn() -> bool = &never;

    #[test]
    fn reservations_add_up_to_the_limit_and_are_given_back() {
        let b = PackedBudget::new(100);
        let a = b.reserve(60, Duration::ZERO, NEVER, NEVER).unwrap().unwrap();
        let c = b.reserve(40, Duration::ZERO, NEVER, NEVER).unwrap().unwrap();
        assert_eq!(b.used(), 100);
        let e = b.reserve(1, Duration::from_millis(50), NEVER, NEVER).unwrap_err().to_string();
        assert!(e.starts_with("packed ring budget exhausted"), "{e}");
        drop(a);
        assert_eq!(b.used(), 40);
        let d = b.reserve(60, Duration::ZERO, NEVER, NEVER).unwrap().unwrap();
        assert_eq!(d.bytes(), 60);
        drop((c, d));
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_waiting_stream_gets_memory_another_gives_back() {
        let b = PackedBudget::new(100);
        let held = b.reserve(100, Duration::ZERO, NEVER, NEVER).unwrap();
        let waiter = {
            let b = b.clone();
            std::thread::spawn(move || {
                b.reserve(70, Duration::from_secs(5), NEVER, NEVER).map(|r| r.map(|r| r.bytes()))
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        drop(held);
        assert_eq!(waiter.join().unwrap().unwrap(), Some(70));
    }

    #[test]
    fn a_waiter_that_no_longer_needs_the_memory_stops_waiting() {
        let b = PackedBudget::new(100);
        let _held = b.reserve(100, Duration::ZERO, NEVER, NEVER).unwrap();
        let started = Instant::now();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(50));
                done.store(true, std::sync::atomic::Ordering::Relaxed);
            });
            let got = b.reserve(10, Duration::from_secs(5), NEVER, &|| done.load(std::sync::atomic::Ordering::Relaxed));
            assert!(got.unwrap().is_none());
        });
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(b.used(), 100);
    }

    #[test]
    fn too_large_fails_at_once_and_cancel_stops_the_wait() {
        let b = PackedBudget::new(100);
        let started = Instant::now();
        let e = b.reserve(101, Duration::from_secs(5), NEVER, NEVER).unwrap_err();
        assert!(matches!(e, Error::CacheFull(_)) && e.to_string().contains("more than the whole budget"), "{e}");
        let _held = b.reserve(100, Duration::ZERO, NEVER, NEVER).unwrap();
        assert!(b.reserve(1, Duration::from_secs(5), &|| true, NEVER).is_err());
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn the_default_is_a_fraction_of_memory() {
        let d = default_budget();
        assert!(d >= 1 << 20);
        if let Some(m) = physical_memory() {
            assert!(d <= m / 2, "{d} of {m}");
        }
    }
}
