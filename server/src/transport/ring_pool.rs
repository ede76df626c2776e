//! Rings kept between the streams of one user's client processes. Making a ring is the largest
//! fixed cost of a packed or Arrow stream over shared memory: its pages are allocated and zeroed
//! as batches first reach them (8 slots of 512 records of 4 KiB, 16 MiB: 7-8.5 ms here, ~2 us a
//! page, most of it the kernel's shared-memory page allocation), and a trainer opens a new stream
//! every epoch, often from a new process (DataLoader workers that do not persist, a job per
//! epoch). When a stream's side channel closes, its current ring waits here for the next stream
//! of the same user.
//!
//! A ring is only handed to a client with the peer credentials (uid and primary gid, from
//! `SO_PEERCRED`) of the one that used it: its slots still hold that client's earlier batches,
//! and the daemon's access rules (`allow` in the config file) are decided by exactly that pair,
//! so the new client could have asked for those same bytes. The side channel closing means the
//! process dropped its last handle on the stream (every array over the ring with it) or died, so
//! no slot is read any more; forked children that kept a parent's arrays are as exposed as within
//! a stream, where a released slot is rewritten too.
//!
//! Kept rings stay charged to the packed budget and counted in the daemon's ring bytes; a stream
//! that finds the budget spent has them dropped first ([`RingPool::clear`]). A sweeper thread
//! drops rings kept longer than `serve --ring-keep` ([`DEFAULT_KEEP_FOR`]); zero keeps none.

use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use super::ring::Ring;

/// How long a ring waits for the user's next stream by default (`serve --ring-keep`). A trainer
/// opens its next epoch's stream at once; an evaluation pass between epochs longer than this pays
/// for a new ring.
pub const DEFAULT_KEEP_FOR: Duration = Duration::from_secs(30);

/// Rings kept per user: one for each of a trainer's DataLoader workers and loaders (train,
/// evaluation) that end together; more would only hold memory.
pub const KEEP_PER_USER: usize = 8;

/// How often the sweeper looks for expired rings while any ring is kept.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How often the sweeper wakes while nothing is kept (a `keep` wakes it at once).
const IDLE_WAKE: Duration = Duration::from_secs(10);

/// Who is at the other end of a side channel: what decides whose kept rings a stream may reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    uid: u32,
    gid: u32,
}

impl Owner {
    /// The peer of a connected Unix socket; None when the kernel cannot say (such a client's
    /// rings are simply not kept).
    pub fn of(sock: &impl std::os::fd::AsFd) -> Option<Self> {
        let (uid, gid) = peer_credentials(sock)?;
        Some(Self { uid, gid })
    }
}

/// (uid, gid) of a Unix socket's peer, as the kernel recorded them at connect. Read with
/// `getsockopt` directly: rustix's `UCred` holds a non-zero `Pid`, and the kernel reports pid 0
/// for a peer outside the daemon's pid namespace, whose uid and gid it still knows.
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
    (rc == 0).then_some((cred.uid, cred.gid))
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

/// The rings kept for their users' next streams.
pub struct RingPool {
    kept: Mutex<Vec<Kept>>,
    changed: Condvar,
    /// How long a ring is kept; zero keeps none.
    keep_for: Duration,
}

impl std::fmt::Debug for RingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingPool").field("kept", &self.count()).finish()
    }
}

impl RingPool {
    /// A pool keeping rings for `keep_for` (zero: none), and its sweeper thread (which ends with
    /// the pool).
    pub fn start(keep_for: Duration) -> Arc<Self> {
        let pool = Arc::new(Self { kept: Mutex::default(), changed: Condvar::new(), keep_for });
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

    /// Keeps `ring` for `owner`'s next stream; the oldest of the user's rings goes when it
    /// already has [`KEEP_PER_USER`].
    pub fn keep(&self, owner: Owner, ring: Ring) {
        if self.keep_for.is_zero() {
            return;
        }
        let mut kept = self.lock();
        sweep(&mut kept, Instant::now(), self.keep_for);
        let mine = kept.iter().enumerate().filter(|(_, k)| k.owner == owner);
        if mine.clone().count() >= KEEP_PER_USER
            && let Some(oldest) = mine.min_by_key(|(_, k)| k.since).map(|(i, _)| i)
        {
            kept.swap_remove(oldest);
        }
        tracing::debug!(ring = ring.id(), uid = owner.uid, "ring kept for the user's next stream");
        kept.push(Kept { owner, ring, since: Instant::now() });
        drop(kept);
        self.changed.notify_all();
    }

    /// A ring a client with `owner`'s credentials used before that fits: `slot_count` slots of
    /// at least `min_slot_bytes` (the largest such, so a stream whose batches vary is least
    /// likely to outgrow it).
    pub fn take(&self, owner: &Owner, fit: Fit) -> Option<Ring> {
        let mut kept = self.lock();
        sweep(&mut kept, Instant::now(), self.keep_for);
        let i = (0..kept.len())
            .filter(|&i| {
                let h = &kept[i].ring.header;
                h.slot_count == fit.slot_count && h.slot_bytes >= fit.min_slot_bytes
            })
            .filter(|&i| kept[i].owner == *owner)
            .max_by_key(|&i| kept[i].ring.header.slot_bytes)?;
        Some(kept.swap_remove(i).ring)
    }

    /// Drops every kept ring (their budget goes back); how many there were.
    pub fn clear(&self) -> usize {
        let gone = std::mem::take(&mut *self.lock());
        gone.len()
    }
}

/// Drops rings kept for `keep_for` or longer.
fn sweep(kept: &mut Vec<Kept>, now: Instant, keep_for: Duration) {
    kept.retain(|k| now.saturating_duration_since(k.since) < keep_for);
}

fn sweeper(pool: Weak<RingPool>) {
    loop {
        let Some(p) = pool.upgrade() else { return };
        let kept = p.lock();
        // Seldom while nothing is kept. The thread holds the pool while it waits, so the timeout
        // also bounds how long the pool (and what it keeps) outlives its last other owner.
        let wait = if kept.is_empty() { IDLE_WAKE } else { SWEEP_EVERY };
        let (mut kept, _) = p.changed.wait_timeout(kept, wait).unwrap_or_else(|e| e.into_inner());
        sweep(&mut kept, Instant::now(), p.keep_for);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    fn ring(id: u64, slots: u32, slot_bytes: u64) -> Ring {
        Ring::create(id, slots, slot_bytes, Arc::new(AtomicU64::new(0))).unwrap()
    }

    /// The owner of one end of a socketpair: this process's credentials.
    fn me() -> Owner {
        let (a, _b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        Owner::of(&a).unwrap()
    }

    const FIT: Fit = Fit { slot_count: 2, min_slot_bytes: 8192 };

    #[test]
    fn a_ring_goes_back_only_to_the_same_user_and_group_and_only_if_it_fits() {
        let pool = RingPool::start(DEFAULT_KEEP_FOR);
        let owner = me();
        assert_eq!((owner.uid, owner.gid), (rustix::process::getuid().as_raw(), rustix::process::getgid().as_raw()));
        pool.keep(owner, ring(7, 2, 8192));
        assert!(pool.take(&Owner { uid: owner.uid.wrapping_add(1), ..owner }, FIT).is_none(), "another user");
        assert!(pool.take(&Owner { gid: owner.gid.wrapping_add(1), ..owner }, FIT).is_none(), "another group");
        assert!(pool.take(&owner, Fit { slot_count: 3, ..FIT }).is_none(), "other slot count");
        assert!(pool.take(&owner, Fit { min_slot_bytes: 3 * 4096, ..FIT }).is_none(), "slots too small");
        assert_eq!(pool.take(&owner, FIT).map(|r| r.id()), Some(7));
        assert!(pool.take(&owner, FIT).is_none(), "taken once");
    }

    #[test]
    fn the_largest_fitting_ring_is_taken_and_a_user_keeps_at_most_a_few() {
        let pool = RingPool::start(DEFAULT_KEEP_FOR);
        let owner = me();
        for (id, bytes) in [(1, 8192), (2, 16384), (3, 4096)] {
            pool.keep(owner, ring(id, 2, bytes));
        }
        assert_eq!(pool.take(&owner, FIT).map(|r| r.id()), Some(2));
        assert_eq!(pool.take(&owner, FIT).map(|r| r.id()), Some(1));
        assert!(pool.take(&owner, FIT).is_none(), "ring 3's slots are too small");
        for id in 10..10 + KEEP_PER_USER as u64 + 2 {
            pool.keep(owner, ring(id, 2, 8192));
        }
        let other = Owner { uid: owner.uid.wrapping_add(1), ..owner };
        pool.keep(other, ring(99, 2, 8192));
        let mut ids: Vec<u64> =
            std::iter::from_fn(|| pool.take(&owner, Fit { min_slot_bytes: 0, ..FIT })).map(|r| r.id()).collect();
        ids.sort_unstable();
        assert_eq!(ids.len(), KEEP_PER_USER, "{ids:?}");
        assert!(!ids.contains(&3) && !ids.contains(&10) && !ids.contains(&11), "the oldest went: {ids:?}");
        assert_eq!(pool.count(), 1, "another user's ring is not one of this user's");
        assert_eq!(pool.clear(), 1);
        assert_eq!((pool.count(), pool.bytes()), (0, 0));
    }

    #[test]
    fn a_sweep_drops_rings_kept_too_long() {
        let owner = me();
        let now = Instant::now();
        let mut kept = vec![
            Kept { owner, ring: ring(1, 2, 4096), since: now },
            Kept { owner, ring: ring(2, 2, 4096), since: now },
        ];
        let keep_for = Duration::from_secs(5);
        if let Some(old) = now.checked_sub(keep_for) {
            kept[1].since = old;
        }
        sweep(&mut kept, now, keep_for);
        assert_eq!(kept.iter().map(|k| k.ring.id()).collect::<Vec<_>>(), [1]);
        sweep(&mut kept, now + keep_for, keep_for);
        assert!(kept.is_empty());
    }

    #[test]
    fn a_pool_that_keeps_for_zero_keeps_nothing() {
        let pool = RingPool::start(Duration::ZERO);
        pool.keep(me(), ring(1, 2, 8192));
        assert_eq!(pool.count(), 0);
        assert!(pool.take(&me(), FIT).is_none());
    }
}
