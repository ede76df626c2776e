//! Rings kept between the streams of one client process. Making a ring is the largest fixed cost
//! of a packed or Arrow stream over shared memory: its pages are allocated and zeroed when it is
//! made (8 slots of 512 records of 4 KiB, 16 MiB: 7-8.5 ms here, ~2 us a page, most of it the
//! kernel's shared-memory page allocation), and a trainer opens a new stream every epoch. When a
//! stream's side channel closes, its current ring waits here for the same process's next stream.
//!
//! A ring is only ever handed back to the process that used it: its slots still hold that
//! process's earlier batches, which no other process has any business reading. The process is
//! known by its peer credentials on the side channel ([`Owner::of`]) and held by a pidfd, so a pid
//! taken over by a new process never matches: the old process's pidfd reads as exited, and its
//! rings are dropped. The side channel closing means the process dropped its last handle on the
//! stream (every array over the ring with it) or died, so no slot of the ring is read any more;
//! forked children that kept a parent's arrays are as exposed as within a stream, where a released
//! slot is rewritten too.
//!
//! Kept rings stay charged to the packed budget and counted in the daemon's ring bytes; a stream
//! that finds the budget spent has them dropped first ([`RingPool::clear`]). A sweeper thread
//! drops rings kept longer than [`KEEP_FOR`] or whose process exited.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use super::ring::Ring;

/// How long a ring waits for its process's next stream. A trainer opens its next epoch's stream
/// at once; an evaluation pass between epochs longer than this pays for a new ring.
pub const KEEP_FOR: Duration = Duration::from_secs(30);

/// Rings kept per process: a trainer with a few loaders open at once (train, evaluation) keeps
/// one for each; more would only hold memory.
pub const KEEP_PER_PROCESS: usize = 4;

/// How often the sweeper looks for expired rings and exited processes while any ring is kept.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// The client process at the other end of a side channel.
#[derive(Debug, Clone)]
pub struct Owner {
    pid: u32,
    uid: u32,
    /// Readable once the process has exited; never refers to another process.
    pidfd: Arc<OwnedFd>,
}

impl Owner {
    /// The peer of a connected Unix socket; None when the kernel cannot say (a peer in a pid
    /// namespace the daemon cannot see has pid 0) or pidfds are missing (Linux < 5.3): such a
    /// client's rings are simply not kept. Called right after the peer's HELLO: its pid could
    /// only name another process if the peer exited and the pid was reused in between.
    pub fn of(sock: &impl std::os::fd::AsFd) -> Option<Self> {
        let (pid, uid) = peer_credentials(sock)?;
        let raw = rustix::process::Pid::from_raw(i32::try_from(pid).ok()?)?;
        let pidfd = rustix::process::pidfd_open(raw, rustix::process::PidfdFlags::empty()).ok()?;
        Some(Self { pid, uid, pidfd: Arc::new(pidfd) })
    }

    /// Whether the process still runs.
    pub fn alive(&self) -> bool {
        let mut fds = [rustix::event::PollFd::new(&*self.pidfd, rustix::event::PollFlags::IN)];
        let now = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        // A pidfd polls readable when its process exits; an error says nothing good either.
        matches!(rustix::event::poll(&mut fds, Some(&now)), Ok(0))
    }

    /// The same running process (both sides' pidfds refer to live processes with the same pid).
    fn same_process(&self, other: &Owner) -> bool {
        self.pid == other.pid && self.uid == other.uid && self.alive() && other.alive()
    }
}

/// (pid, uid) of a Unix socket's peer, as the kernel recorded them at connect. Read with
/// `getsockopt` directly: rustix's `UCred` holds a non-zero `Pid`, and the kernel reports pid 0
/// for a peer outside the daemon's pid namespace.
fn peer_credentials(sock: &impl std::os::fd::AsFd) -> Option<(u32, u32)> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` and `len` are valid for writes of a `ucred`, which is what SO_PEERCRED
    // writes (and `len` says); the descriptor is borrowed for the call.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &raw mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some((cred.pid as u32, cred.uid))
}

/// What a ring must offer to be reused by a stream.
#[derive(Debug, Clone, Copy)]
pub struct Fit {
    pub slot_count: u32,
    pub min_slot_bytes: u64,
}

struct Kept {
    owner: Owner,
    ring: Ring,
    since: Instant,
}

/// The rings kept for their processes' next streams.
pub struct RingPool {
    kept: Mutex<Vec<Kept>>,
    changed: Condvar,
}

impl std::fmt::Debug for RingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingPool").field("kept", &self.count()).finish()
    }
}

impl RingPool {
    /// A pool and its sweeper thread (which ends with the pool).
    pub fn start() -> Arc<Self> {
        let pool = Arc::new(Self { kept: Mutex::default(), changed: Condvar::new() });
        let weak = Arc::downgrade(&pool);
        let spawned = std::thread::Builder::new().name("ring-pool".into()).spawn(move || sweeper(weak));
        if let Err(e) = spawned {
            // Without it kept rings still expire at the next keep or take; nothing breaks.
            tracing::warn!(error = %e, "cannot start the ring pool's sweeper thread");
        }
        pool
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Kept>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rings kept now.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Bytes of the rings kept now.
    pub fn bytes(&self) -> u64 {
        self.lock().iter().map(|k| k.ring.segment_bytes()).sum()
    }

    /// Keeps `ring` for `owner`'s next stream; the oldest of the process's rings goes when it
    /// already has [`KEEP_PER_PROCESS`], and nothing is kept for a process that has exited.
    pub fn keep(&self, owner: Owner, ring: Ring) {
        if !owner.alive() {
            return;
        }
        let mut kept = self.lock();
        sweep(&mut kept, Instant::now());
        let mine: Vec<usize> = (0..kept.len()).filter(|&i| kept[i].owner.same_process(&owner)).collect();
        if mine.len() >= KEEP_PER_PROCESS {
            let oldest = mine.into_iter().min_by_key(|&i| kept[i].since);
            if let Some(i) = oldest {
                kept.swap_remove(i);
            }
        }
        tracing::debug!(ring = ring.id(), pid = owner.pid, "ring kept for the process's next stream");
        kept.push(Kept { owner, ring, since: Instant::now() });
        drop(kept);
        self.changed.notify_all();
    }

    /// A ring `owner` used before that fits: `slot_count` slots of at least `min_slot_bytes`
    /// (the largest such, so a stream whose batches vary is least likely to outgrow it).
    pub fn take(&self, owner: &Owner, fit: Fit) -> Option<Ring> {
        let mut kept = self.lock();
        sweep(&mut kept, Instant::now());
        let i = (0..kept.len())
            .filter(|&i| {
                let h = &kept[i].ring.header;
                h.slot_count == fit.slot_count && h.slot_bytes >= fit.min_slot_bytes
            })
            .filter(|&i| kept[i].owner.same_process(owner))
            .max_by_key(|&i| kept[i].ring.header.slot_bytes)?;
        Some(kept.swap_remove(i).ring)
    }

    /// Drops every kept ring (their budget goes back); how many there were.
    pub fn clear(&self) -> usize {
        let gone = std::mem::take(&mut *self.lock());
        gone.len()
    }
}

/// Drops rings kept past [`KEEP_FOR`] and those of processes that exited.
fn sweep(kept: &mut Vec<Kept>, now: Instant) {
    kept.retain(|k| now.saturating_duration_since(k.since) < KEEP_FOR && k.owner.alive());
}

fn sweeper(pool: Weak<RingPool>) {
    loop {
        let Some(p) = pool.upgrade() else { return };
        let kept = p.lock();
        // Idle while nothing is kept; the timeout lets the thread notice the pool is gone.
        let wait = if kept.is_empty() { Duration::from_secs(60) } else { SWEEP_EVERY };
        let (mut kept, _) = p.changed.wait_timeout(kept, wait).unwrap_or_else(|e| e.into_inner());
        sweep(&mut kept, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    fn ring(id: u64, slots: u32, slot_bytes: u64) -> Ring {
        Ring::create(id, slots, slot_bytes, Arc::new(AtomicU64::new(0))).unwrap()
    }

    /// The owner of one end of a socketpair: this process.
    fn me() -> (Owner, [OwnedFd; 2]) {
        let (a, b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        (Owner::of(&a).unwrap(), [a, b])
    }

    /// An owner for a child process that has exited (and been reaped): its pidfd reads as exited.
    fn exited() -> Owner {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = rustix::process::Pid::from_raw(child.id() as i32).unwrap();
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
        child.wait().unwrap();
        Owner { pid: child.id(), uid: rustix::process::getuid().as_raw(), pidfd: Arc::new(pidfd) }
    }

    const FIT: Fit = Fit { slot_count: 2, min_slot_bytes: 8192 };

    #[test]
    fn a_ring_goes_back_only_to_the_process_that_kept_it_and_only_if_it_fits() {
        let pool = RingPool::start();
        let (owner, _fds) = me();
        assert_eq!(owner.pid, std::process::id());
        assert!(owner.alive());
        pool.keep(owner.clone(), ring(7, 2, 8192));
        let other = Owner { pid: owner.pid + 1, ..owner.clone() };
        assert!(pool.take(&other, FIT).is_none(), "another pid");
        let other_user = Owner { uid: owner.uid.wrapping_add(1), ..owner.clone() };
        assert!(pool.take(&other_user, FIT).is_none(), "another user");
        assert!(pool.take(&owner, Fit { slot_count: 3, ..FIT }).is_none(), "other slot count");
        assert!(pool.take(&owner, Fit { min_slot_bytes: 3 * 4096, ..FIT }).is_none(), "slots too small");
        assert_eq!(pool.take(&owner, FIT).map(|r| r.id()), Some(7));
        assert!(pool.take(&owner, FIT).is_none(), "taken once");
    }

    #[test]
    fn the_largest_fitting_ring_is_taken_and_a_process_keeps_at_most_a_few() {
        let pool = RingPool::start();
        let (owner, _fds) = me();
        for (id, bytes) in [(1, 8192), (2, 16384), (3, 4096)] {
            pool.keep(owner.clone(), ring(id, 2, bytes));
        }
        assert_eq!(pool.take(&owner, FIT).map(|r| r.id()), Some(2));
        assert_eq!(pool.take(&owner, FIT).map(|r| r.id()), Some(1));
        assert!(pool.take(&owner, FIT).is_none(), "ring 3's slots are too small");
        for id in 10..10 + KEEP_PER_PROCESS as u64 + 2 {
            pool.keep(owner.clone(), ring(id, 2, 8192));
        }
        let mut ids: Vec<u64> =
            std::iter::from_fn(|| pool.take(&owner, Fit { min_slot_bytes: 0, ..FIT })).map(|r| r.id()).collect();
        ids.sort_unstable();
        assert_eq!(ids.len(), KEEP_PER_PROCESS, "{ids:?}");
        assert!(!ids.contains(&3) && !ids.contains(&10) && !ids.contains(&11), "the oldest went: {ids:?}");
    }

    #[test]
    fn rings_of_an_exited_process_are_never_kept_nor_handed_out() {
        let pool = RingPool::start();
        let dead = exited();
        assert!(!dead.alive());
        pool.keep(dead.clone(), ring(1, 2, 8192));
        assert_eq!(pool.count(), 0, "not kept for a process that is gone");
        // A live owner whose pid matches the dead one's (the pid taken over) gets nothing either.
        let (owner, _fds) = me();
        pool.keep(owner.clone(), ring(2, 2, 8192));
        let impostor = Owner { pid: owner.pid, uid: owner.uid, pidfd: dead.pidfd.clone() };
        assert!(pool.take(&impostor, FIT).is_none());
        assert_eq!(pool.clear(), 1);
        assert_eq!(pool.count(), 0);
    }

    #[test]
    fn a_sweep_drops_rings_kept_too_long() {
        let (owner, _fds) = me();
        let now = Instant::now();
        let mut kept = vec![
            Kept { owner: owner.clone(), ring: ring(1, 2, 4096), since: now },
            Kept { owner: owner.clone(), ring: ring(2, 2, 4096), since: now },
        ];
        if let Some(old) = now.checked_sub(KEEP_FOR) {
            kept[1].since = old;
        }
        sweep(&mut kept, now);
        assert_eq!(kept.iter().map(|k| k.ring.id()).collect::<Vec<_>>(), [1]);
        sweep(&mut kept, now + KEEP_FOR);
        assert!(kept.is_empty());
    }
}
