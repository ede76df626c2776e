//! Daemon-wide budgets of transport memory, one per pool: packed streams' rings
//! (`serve --packed-budget`), each a populated shared-memory segment of `ring_slots` whole
//! batches, and rdma streams' staging buffers (`serve --rdma-budget`), memory registered with the
//! NIC (pinned under verbs and EFA) in sizes the client chooses. Without a bound, 64 streams of
//! 64 MiB batches would pin 32 GiB. A stream reserves its bytes here before its memory is made and
//! gives them back when the memory goes ([`Reservation`] lives with it).
//!
//! A stream that does not fit waits up to [`BUDGET_WAIT`] for other streams to give memory back
//! (a job's streams start together and end together, so a short wait absorbs a restart), then
//! fails with [`Error::CacheFull`], gRPC `RESOURCE_EXHAUSTED`, whose message starts with "packed
//! ring budget exhausted" or "rdma staging budget exhausted". One larger than the whole budget
//! fails at once.

use std::path::Path;
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

/// Budget when physical memory cannot be read (`sysinfo(2)` failed: never seen).
const FALLBACK_BUDGET: u64 = 8 << 30;

/// Where the cgroup file systems are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The default `--packed-budget` and `--rdma-budget`: a quarter of the memory the daemon may use, the smaller of
/// physical memory and its cgroup's limit (a container's memory limit, or a systemd unit's
/// `MemoryMax=`: a quarter of the node's memory could exceed it, and the kernel would kill the
/// daemon instead of refusing a ring).
///
/// Physical memory comes from `sysinfo(2)`, not `/proc/meminfo`, which a unit with
/// `ProcSubset=pid` hides; the cgroup is the daemon's own (`/proc/self/cgroup`, which that unit
/// still shows), and every cgroup above it counts, as the kernel counts them.
///
/// Measured once per process: the three budgets' defaults and the daemon's config all ask, and a
/// machine whose memory cannot be read was warned about once for each.
pub fn default_budget() -> u64 {
    static MEASURED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *MEASURED.get_or_init(measure_default_budget)
}

fn measure_default_budget() -> u64 {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let memory = [physical_memory(), cgroup_limit(Path::new(CGROUP_ROOT), &own)].into_iter().flatten().min();
    match memory {
        Some(m) => (m / DEFAULT_FRACTION).max(1 << 20),
        None => {
            tracing::warn!(
                budget = FALLBACK_BUDGET,
                "cannot tell the machine's memory: the packed-ring, rdma staging and inline budgets are 8 GiB; \
                 set --packed-budget, --rdma-budget and --inline-budget"
            );
            FALLBACK_BUDGET
        }
    }
}

/// cgroup v2 `memory.max` or v1 `memory.limit_in_bytes`: a byte count, or `max` (no limit).
fn parse_memory_max(s: &str) -> Option<u64> {
    s.trim().parse().ok()
}

fn physical_memory() -> Option<u64> {
    let mut info = std::mem::MaybeUninit::<libc::sysinfo>::zeroed();
    // SAFETY: `sysinfo` fills the struct it is given, which lives for the call; on failure it is
    // not read.
    if unsafe { libc::sysinfo(info.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: zero-initialised, then filled by a successful call; every field is plain data.
    let info = unsafe { info.assume_init() };
    // `c_ulong`: 64 bits here, 32 on 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let total = u64::from(info.totalram);
    total.checked_mul(u64::from(info.mem_unit.max(1)))
}

/// The smallest memory limit of the cgroup `own` names (the text of `/proc/self/cgroup`) and
/// every cgroup above it, under `root`: cgroup v2 (`0::/path`, `memory.max`) and v1's memory
/// controller (`N:memory:/path`, `memory.limit_in_bytes`). Inside a container the path is often
/// the host's and missing from the container's view; its ancestors, up to the mount's root (the
/// container's own cgroup), are read all the same.
fn cgroup_limit(root: &Path, own: &str) -> Option<u64> {
    let mut limits = Vec::new();
    for line in own.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else { continue };
        let (base, file) = match controllers {
            "" => (root.to_path_buf(), "memory.max"),
            c if c.split(',').any(|c| c == "memory") => (root.join("memory"), "memory.limit_in_bytes"),
            _ => continue,
        };
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            if let Some(limit) = std::fs::read_to_string(dir.join(file)).ok().and_then(|s| parse_memory_max(&s)) {
                limits.push(limit);
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    limits.into_iter().min()
}

/// What a [`MemoryBudget`] bounds: its flag, its error's words and its gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pool {
    /// Packed streams' rings (`--packed-budget`).
    PackedRings,
    /// rdma streams' registered staging buffers (`--rdma-budget`).
    RdmaStaging,
}

impl Pool {
    fn flag(self) -> &'static str {
        match self {
            Pool::PackedRings => "--packed-budget",
            Pool::RdmaStaging => "--rdma-budget",
        }
    }
}

/// One pool's memory for the whole daemon.
#[derive(Debug)]
pub struct MemoryBudget {
    pool: Pool,
    limit: u64,
    used: Mutex<u64>,
    freed: Condvar,
}

impl MemoryBudget {
    pub fn new(pool: Pool, limit: u64) -> Arc<Self> {
        Arc::new(Self { pool, limit, used: Mutex::new(0), freed: Condvar::new() })
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
                    crate::metrics::budget_bytes(self.pool, *used);
                    return Ok(Some(Reservation { budget: self.clone(), bytes }));
                }
            }
            if cancelled() {
                return Err(Error::ClientGone("stream cancelled".into()));
            }
            if unneeded() {
                return Ok(None);
            }
        }
    }

    fn exhausted(&self, bytes: u64, used: Option<u64>) -> Error {
        let mib = |b: u64| b.div_ceil(1 << 20);
        let (need, others, remedy) = match self.pool {
            Pool::PackedRings => (
                "packed ring budget exhausted: this stream needs a",
                "packed",
                "use smaller batches, fewer --ring-slots, a larger --packed-budget, or collate=None (views)",
            ),
            Pool::RdmaStaging => (
                "rdma staging budget exhausted: this stream stages its batches in a",
                "rdma",
                "use smaller ring slots on the client (SHARDSTREAM_RDMA_SLOT_BYTES, which bound its batches) or a \
                 larger --rdma-budget",
            ),
        };
        let why = match used {
            Some(u) => {
                format!("{} MiB in use by other {others} streams, waited {} s for them", mib(u), BUDGET_WAIT.as_secs())
            }
            None => "more than the whole budget".into(),
        };
        Error::CacheFull(format!(
            "{need} {} MiB buffer, {} is {} MiB ({why}); {remedy}",
            mib(bytes),
            self.pool.flag(),
            mib(self.limit)
        ))
    }

    fn release(&self, bytes: u64) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        *used = used.saturating_sub(bytes);
        crate::metrics::budget_bytes(self.pool, *used);
        drop(used);
        self.freed.notify_all();
    }
}

/// Memory held against a budget; given back on drop.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
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

    #[test]
    fn the_limit_is_the_smallest_of_the_own_cgroup_and_those_above_it() {
        let root = tempfile::tempdir().expect("temp dir");
        let put = |rel: &str, text: &str| {
            let dir = root.path().join(rel);
            std::fs::create_dir_all(&dir).expect("cgroup dir");
            std::fs::write(
                dir.join(if rel.starts_with("memory") { "memory.limit_in_bytes" } else { "memory.max" }),
                text,
            )
            .expect("limit");
        };
        // v2: a unit's MemoryMax= below a slice's, the root's file absent (as on a host).
        put("system.slice", "8589934592\n");
        put("system.slice/shardstream.service", "2147483648\n");
        assert_eq!(cgroup_limit(root.path(), "0::/system.slice/shardstream.service\n"), Some(2 << 30));
        // No limit set anywhere ("max"): none.
        put("user.slice", "max\n");
        assert_eq!(cgroup_limit(root.path(), "0::/user.slice\n"), None);
        // v1, inside a container: the host's path is not in its view, the mount's root is its own.
        put("memory", "4294967296\n");
        let v1 = "4:memory:/kubepods/pod1/abc\n3:cpuset:/\n0::/\n";
        assert_eq!(cgroup_limit(root.path(), v1), Some(4 << 30));
        // Unreadable or empty: none, and physical memory alone decides.
        assert_eq!(cgroup_limit(root.path(), ""), None);
    }

    fn never() -> bool {
        false
    }
    const NEVER: &dyn Fn() -> bool = &never;

    #[test]
    fn reservations_add_up_to_the_limit_and_are_given_back() {
        let b = MemoryBudget::new(Pool::PackedRings, 100);
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
        let b = MemoryBudget::new(Pool::PackedRings, 100);
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
        let b = MemoryBudget::new(Pool::PackedRings, 100);
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
        let b = MemoryBudget::new(Pool::PackedRings, 100);
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
