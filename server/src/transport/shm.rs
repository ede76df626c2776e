//! The shared-memory transport, daemon side: clients on this host map the shards themselves, so
//! per batch only descriptors travel (slot, offset, length per sample) and no payload byte is
//! copied between the page cache and the trainer.
//!
//! Each shm stream has a [`Session`], announced in the stream header by a random 128-bit token.
//! The client attaches to the side-channel socket (`<socket>.shm`, `SOCK_SEQPACKET`, mode 0600)
//! with that token; the daemon then sends each shard's file descriptor once (`SCM_RIGHTS`, frames
//! of `shardstream_proto::shm`) before the first batch that uses it. A batch holds a **lease** on
//! its shards until the client releases it (RELEASE frame) or its side channel closes (a crashed
//! client: the kernel closes the socket at once). Leased shards are never evicted or rewritten
//! ([`ShmHub::is_leased`] is what the cache asks). A client may hold at most `credits` batches
//! unreleased; the producer waits beyond, so a client that never releases cannot make the daemon
//! hold more.
//!
//! Packed streams (`collate="stack"`) lease no shards: their batches are copied into a slot of the
//! session's ring ([`super::ring`]), whose descriptor travels once like a shard's; releasing the
//! batch frees the slot. A session's credits are then its ring's slots.
//!
//! Threads: one accepting the side channel, one reading each attached session's frames (a session
//! sends a frame per batch at most, so this is cheap, and blocking I/O keeps fd passing simple).
//! Lock order: hub sessions -> session state -> hub leases; session state -> ring pool -> packed
//! budget (dropping a kept ring gives its budget back).

use foldhash::HashMap;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use rustix::net::{RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketType};
use shardstream_proto::ring::{PAGE, round_up};
use shardstream_proto::shm::{self as wire, Frame};

use super::budget::{BUDGET_WAIT, MemoryBudget, Pool, Reservation};
use super::ring::{MAX_RING_BYTES, Ring, SlotTable};
use super::ring_pool::{Fit, Owner, RingPool};
use crate::{Error, Result};

/// Unreleased batches a client may hold. Sixteen covers a DataLoader-style prefetch of several
/// batches plus the one being trained on; each costs the daemon only its lease records.
pub const DEFAULT_CREDITS: u32 = 16;

/// Limits of the shared-memory transport (`shardstream serve --shm-credits`, `--ring-slots`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmConfig {
    /// View mode: unreleased batches a client may hold before its stream waits.
    pub credits: u32,
    /// Packed mode: slots per ring, which are also the stream's credits. A ring's memory is this
    /// many batches.
    pub ring_slots: u32,
    /// Packed mode: bytes of ring memory all streams together may hold (`--packed-budget`).
    pub packed_budget: u64,
    /// How long a stream's ring is kept for a next stream (`--ring-keep`; zero keeps none).
    pub ring_keep: Duration,
    /// Sessions of ended streams one uid may keep attached (batches unreleased, or the side
    /// channel left open) before its new shm streams are refused: `--max-streams-per-client`,
    /// else `--max-streams`. Each holds a thread, descriptors, leases and maybe a ring; a client
    /// that cancels its streams and keeps their side channels would otherwise hold without bound.
    pub ended_per_client: usize,
}

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            credits: DEFAULT_CREDITS,
            ring_slots: super::ring::RING_SLOTS,
            packed_budget: super::budget::default_budget(),
            ring_keep: super::ring_pool::DEFAULT_KEEP_FOR,
            ended_per_client: crate::service::DEFAULT_MAX_STREAMS,
        }
    }
}

/// Smallest `--packed-budget` accepted: below it not even a ring of small batches fits.
pub const MIN_PACKED_BUDGET: u64 = 1 << 20;

/// Largest credit or slot count accepted: far past any read-ahead a trainer needs.
pub const MAX_CREDITS: u32 = 1024;

/// How long the producer waits for a client to attach its side channel, and a send on it may
/// block, before the stream is failed: a healthy client attaches within milliseconds.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
const SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Frames of a client that broke the protocol read off its socket at most before it is closed
/// (more than a socket's buffer holds of them).
const DRAIN_AT_CLOSE: usize = 4096;

/// What the side channel's path adds to the gRPC socket's.
pub const SIDE_SUFFIX: &str = ".shm";

/// Side-channel path for a daemon socket.
pub fn side_socket_path(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(SIDE_SUFFIX);
    PathBuf::from(p)
}

/// What an unreleased batch holds.
#[derive(Debug, Default)]
struct Held {
    shards: Vec<PathBuf>,
    /// (ring id, slot) of a packed batch.
    slot: Option<(u64, u32)>,
}

#[derive(Debug)]
struct RingEntry {
    ring: Arc<Ring>,
    slots: SlotTable,
}

#[derive(Debug, Default)]
struct SessionState {
    sock: Option<Arc<OwnedFd>>,
    /// Shard path -> slot number sent to the client.
    sent: HashMap<PathBuf, u32>,
    /// The next slot number: slots are never reused, so a shard sent again after SHARD_FORGET
    /// gets a new one.
    next_slot: u32,
    /// The client's HELLO said it understands SHARD_FORGET.
    forgets: bool,
    /// Outstanding batches holding each shard (the leases this session counts in the hub's).
    holds: HashMap<PathBuf, u32>,
    /// Shards the stream moved past while a batch still held them: forgotten at its release.
    done: std::collections::HashSet<PathBuf>,
    /// Segments the daemon made and sent ([`Session::slot_for_segment`]), and whether it still
    /// holds each.
    segments: HashMap<PathBuf, Weak<dyn std::any::Any + Send + Sync>>,
    /// Segments the daemon let go of while a batch still held them: forgotten (as evicted) at
    /// its release.
    gone: std::collections::HashSet<PathBuf>,
    /// Slots forgotten as done, by shard: the client may still keep their mappings for its next
    /// stream, so an eviction of the shard names them too.
    retired: HashMap<PathBuf, Vec<u32>>,
    /// Batch index -> what it holds.
    outstanding: HashMap<u64, Held>,
    /// Packed mode: the rings sent to the client, oldest first; the last is the one new batches
    /// go to. An older ring is dropped (and retired at the client) once none of its slots is held.
    rings: Vec<RingEntry>,
    /// The client's peer credentials on the side channel: whose kept rings this stream may
    /// reuse, and for whom its own ring is kept when it ends ([`super::ring_pool`]).
    peer: Option<Owner>,
    /// Packed mode: builds hold slots in the order their batches are sent (see
    /// [`Session::take_turn`]); the next turn to grant, and the slots granted but not yet
    /// published or given back.
    next_turn: u64,
    filling: u32,
    closed: bool,
    stream_done: bool,
    /// Counted in the hub's `ended` for the session's uid: the stream is done, the side channel
    /// still attached.
    ended_counted: bool,
    /// Set by STREAM_END: the client will never receive batches from this index on, so the
    /// producer's later batches (already in flight) must not take leases.
    end_from: Option<u64>,
}

impl SessionState {
    /// Slots held by the client or being filled: fewer than `credits` leaves one to take.
    fn slot_free(&self, credits: u32) -> bool {
        (self.outstanding.len() as u64 + u64::from(self.filling)) < u64::from(credits)
    }

    /// Whether a slot of `need` bytes needs a new ring (none yet, or the current one's slots are
    /// smaller).
    fn needs_ring(&self, need: u64) -> bool {
        self.rings.last().is_none_or(|r| r.ring.header.slot_bytes < need)
    }
}

/// One shm stream's state.
#[derive(Debug)]
pub struct Session {
    pub token: [u8; 16],
    pub credits: u32,
    /// Who asked for the stream (the uid on the daemon's socket), when known.
    uid: Option<u32>,
    state: Mutex<SessionState>,
    changed: Condvar,
    hub: Arc<HubShared>,
}

#[derive(Debug)]
struct HubShared {
    sessions: Mutex<HashMap<[u8; 16], Arc<Session>>>,
    leases: Mutex<HashMap<PathBuf, u32>>,
    /// Bytes of packed-mode rings alive.
    ring_bytes: Arc<AtomicU64>,
    /// The daemon-wide bound on those bytes.
    budget: Arc<MemoryBudget>,
    /// Rings kept for their users' next streams.
    pool: Arc<RingPool>,
    /// Ring ids are unique in the daemon, so a kept ring keeps its id (written in its header).
    next_ring: AtomicU64,
    /// Rings made, and rings a stream got back from the pool instead.
    rings_made: AtomicU64,
    rings_reused: AtomicU64,
    /// Sessions with a side channel attached: counted here so that `status` takes no session's
    /// lock (a send under one may wait out [`SEND_TIMEOUT`] for a client that does not read).
    attached: AtomicUsize,
    /// Per uid, sessions whose stream is done while their side channel is still attached.
    ended: Mutex<HashMap<u32, usize>>,
}

/// The daemon's side-channel listener and all shm sessions.
#[derive(Debug)]
pub struct ShmHub {
    pub socket: PathBuf,
    pub config: ShmConfig,
    shared: Arc<HubShared>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ShmHub {
    /// Binds the side-channel socket (with the same access as the daemon's socket) and starts
    /// accepting on a thread. Refuses to replace anything but a stale socket.
    pub fn bind(socket: PathBuf, config: ShmConfig, access: crate::socket_file::SocketAccess) -> Result<Arc<Self>> {
        for (name, n) in [("--shm-credits", config.credits), ("--ring-slots", config.ring_slots)] {
            if n == 0 || n > MAX_CREDITS {
                return Err(Error::invalid(format!("{name} must be from 1 to {MAX_CREDITS}, not {n}")));
            }
        }
        if config.packed_budget < MIN_PACKED_BUDGET {
            return Err(Error::invalid(format!(
                "--packed-budget must be at least {} MiB, not {} bytes",
                MIN_PACKED_BUDGET >> 20,
                config.packed_budget
            )));
        }
        let fd = crate::socket_file::listen(&socket, SocketType::SEQPACKET, &access, 128)?;
        let shared = HubShared {
            sessions: Mutex::default(),
            leases: Mutex::default(),
            ring_bytes: Arc::default(),
            budget: MemoryBudget::new(Pool::PackedRings, config.packed_budget),
            pool: RingPool::start(config.ring_keep),
            next_ring: AtomicU64::new(0),
            rings_made: AtomicU64::new(0),
            rings_reused: AtomicU64::new(0),
            attached: AtomicUsize::new(0),
            ended: Mutex::default(),
        };
        let hub = Arc::new(Self { socket, config, shared: Arc::new(shared) });
        let shared = hub.shared.clone();
        std::thread::Builder::new()
            .name("shm-accept".into())
            .spawn(move || accept_loop(fd, shared))
            .map_err(|e| Error::Unavailable(format!("cannot start the shm listener thread: {e}")))?;
        Ok(hub)
    }

    /// A session for a new stream that `uid` asked for (None: not known). Refused while `uid`
    /// keeps [`ShmConfig::ended_per_client`] sessions of ended streams attached.
    pub fn new_session(&self, credits: u32, uid: Option<u32>) -> Result<Arc<Session>> {
        if let Some(uid) = uid {
            let ended = lock(&self.shared.ended).get(&uid).copied().unwrap_or(0);
            if ended >= self.config.ended_per_client {
                return Err(Error::CacheFull(format!(
                    "uid {uid} keeps {ended} shared-memory streams that ended attached (their batches not \
                     released, or their loaders not closed), the most one client may \
                     (--max-streams-per-client, else --max-streams): drop the batches and loaders of finished \
                     streams (close()) before starting more"
                )));
            }
        }
        let mut token = [0u8; 16];
        rustix::rand::getrandom(&mut token, rustix::rand::GetRandomFlags::empty())
            .map_err(|e| Error::Unavailable(format!("no randomness for a session token: {e}")))?;
        let s = Arc::new(Session {
            token,
            credits: credits.max(1),
            uid,
            state: Mutex::default(),
            changed: Condvar::new(),
            hub: self.shared.clone(),
        });
        lock(&self.shared.sessions).insert(token, s.clone());
        Ok(s)
    }

    /// True while a client holds a batch that uses this shard.
    /// The node cache unlinked `shard`: every session that was sent it forgets its slot, and a
    /// client that understands SHARD_FORGET is told to let go of its mapping (which otherwise
    /// keeps the file's disk space until the stream ends). Never leased at this point: the cache
    /// evicts no leased shard, so no batch a client holds names the slot.
    pub fn forget(&self, shard: &Path) {
        let sessions: Vec<Arc<Session>> = lock(&self.shared.sessions).values().cloned().collect();
        for session in sessions {
            forget_slot(&mut lock(&session.state), shard, wire::FORGET_EVICTED);
        }
    }

    pub fn is_leased(&self, shard: &Path) -> bool {
        lock(&self.shared.leases).get(shard).is_some_and(|&n| n > 0)
    }

    /// Bytes of packed-mode ring segments streams use now (kept rings not counted).
    pub fn ring_bytes(&self) -> u64 {
        self.shared.ring_bytes.load(Ordering::Relaxed).saturating_sub(self.shared.pool.bytes())
    }

    /// (rings kept for their users' next streams, their bytes).
    pub fn kept_rings(&self) -> (usize, u64) {
        (self.shared.pool.count(), self.shared.pool.bytes())
    }

    /// (rings made, rings reused from the pool) since start-up.
    pub fn ring_counts(&self) -> (u64, u64) {
        (self.shared.rings_made.load(Ordering::Relaxed), self.shared.rings_reused.load(Ordering::Relaxed))
    }

    /// (bytes reserved, limit) of the packed-ring budget.
    pub fn packed_budget(&self) -> (u64, u64) {
        (self.shared.budget.used(), self.shared.budget.limit())
    }

    /// (attached sessions, leased shards).
    pub fn counts(&self) -> (usize, usize) {
        let attached = self.shared.attached.load(Ordering::Relaxed);
        (attached, lock(&self.shared.leases).values().filter(|&&n| n > 0).count())
    }
}

impl Drop for ShmHub {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Connections accepted that have not said HELLO yet, at most: each holds a thread for up to
/// [`ATTACH_TIMEOUT`]. Clients attach right after their stream starts, so more than this at once
/// is a flood, not trainers; the newest are closed.
const UNATTACHED_MAX: usize = 256;

/// How long accepting pauses after a failure that passes (out of descriptors or memory).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How often the same accept failure is logged, at most.
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

fn accept_loop(listener: OwnedFd, shared: Arc<HubShared>) {
    use rustix::io::Errno;
    let unattached = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut logged: Option<Instant> = None;
    let mut log_once_in_a_while = |what: &str, error: &dyn std::fmt::Display| {
        if logged.is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY) {
            logged = Some(Instant::now());
            tracing::warn!(%error, "shm side channel: {what}");
        }
    };
    loop {
        let conn = match rustix::net::accept_with(&listener, rustix::net::SocketFlags::CLOEXEC) {
            Ok(c) => c,
            Err(Errno::INTR | Errno::CONNABORTED) => continue,
            // The process or the system is out of descriptors or memory for a moment (a burst of
            // connections, or streams holding many shards): the connections wait in the backlog.
            // Ending the loop would close the side channel until the daemon restarts.
            Err(e @ (Errno::MFILE | Errno::NFILE | Errno::NOBUFS | Errno::NOMEM | Errno::PROTO | Errno::PERM)) => {
                log_once_in_a_while("cannot accept a connection now; retrying", &e);
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
            Err(e) => {
                tracing::error!(error = %e, "shm side channel stopped accepting");
                return;
            }
        };
        if unattached.load(std::sync::atomic::Ordering::Acquire) >= UNATTACHED_MAX {
            log_once_in_a_while(
                "too many connections waiting to attach; closing new ones",
                &format!("{UNATTACHED_MAX} waiting"),
            );
            continue;
        }
        unattached.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let (shared, waiting) = (shared.clone(), unattached.clone());
        let spawned =
            std::thread::Builder::new().name("shm-session".into()).spawn(move || serve_conn(conn, shared, &waiting));
        if let Err(e) = spawned {
            unattached.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            log_once_in_a_while("cannot start a session thread", &e);
        }
    }
}

/// A failed send of `what` to the client: the client gone when its end of the channel is closed
/// (it dropped its loader), else the error.
fn to_client(what: &str, e: std::io::Error) -> Error {
    let gone = matches!(e.kind(), std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset);
    let msg = format!("cannot {what} to the client: {e}");
    if gone { Error::ClientGone(msg) } else { Error::Unavailable(msg) }
}

fn send_frame(sock: &impl AsFd, frame: &Frame, fd: Option<BorrowedFd<'_>>) -> std::io::Result<()> {
    fail_point!("shm-send", |a| Err(crate::failpoints::io_error(a)));
    let bytes = frame.encode();
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = fd {
        fds = [fd];
        if !anc.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(std::io::Error::other("ancillary buffer too small"));
        }
    }
    // Sockets with a timeout are never restarted after a signal (a handler, a stop and
    // continue): a datagram interrupted was not sent, so send it again.
    loop {
        match rustix::net::sendmsg(sock, &[IoSlice::new(&bytes)], &mut anc, SendFlags::NOSIGNAL) {
            Err(rustix::io::Errno::INTR) => continue,
            other => return other.map(drop).map_err(Into::into),
        }
    }
}

fn recv_frame(sock: &impl AsFd) -> std::io::Result<Option<Vec<u8>>> {
    let mut buf = [0u8; wire::FRAME_BYTES + 1];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    // As in `send_frame`: nothing was received, so wait again (the timeout starts over).
    let r = loop {
        match rustix::net::recvmsg(sock, &mut [IoSliceMut::new(&mut buf)], &mut anc, RecvFlags::CMSG_CLOEXEC) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other?,
        }
    };
    // Descriptors a client sends are never wanted: close them.
    for msg in anc.drain() {
        if let rustix::net::RecvAncillaryMessage::ScmRights(fds) = msg {
            fds.for_each(drop);
        }
    }
    if r.bytes == 0 {
        return Ok(None);
    }
    Ok(Some(buf[..r.bytes].to_vec()))
}

/// Serves one side-channel connection: HELLO, then RELEASE frames until it closes. `unattached`
/// counts it until its first frame has come (or not).
fn serve_conn(conn: OwnedFd, shared: Arc<HubShared>, unattached: &std::sync::atomic::AtomicUsize) {
    let _ = rustix::net::sockopt::set_socket_timeout(&conn, rustix::net::sockopt::Timeout::Send, Some(SEND_TIMEOUT));
    let _ = rustix::net::sockopt::set_socket_timeout(&conn, rustix::net::sockopt::Timeout::Recv, Some(ATTACH_TIMEOUT));
    let reject = |conn: &OwnedFd, code, msg: &str| {
        let _ = send_frame(conn, &Frame::error(code, msg), None);
    };
    let hello = recv_frame(&conn);
    unattached.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    let hello = match hello {
        Ok(Some(bytes)) => bytes,
        _ => return,
    };
    let frame = match Frame::decode(&hello) {
        Ok(f) if f.kind == wire::KIND_HELLO => f,
        Ok(_) => return reject(&conn, wire::ERR_MALFORMED, "expected a HELLO frame"),
        // The payload holds 40 bytes: say both versions in as few words.
        Err(wire::FrameError::Version { theirs }) => {
            let msg = format!("layout version {theirs} != daemon version {}", wire::LAYOUT_VERSION);
            return reject(&conn, wire::ERR_LAYOUT_VERSION, &msg);
        }
        Err(e) => return reject(&conn, wire::ERR_MALFORMED, &e.to_string()),
    };
    let Some(session) = lock(&shared.sessions).get(&frame.token()).cloned() else {
        return reject(&conn, wire::ERR_UNKNOWN_SESSION, "unknown or expired session token");
    };
    let conn = Arc::new(conn);
    let peer = Owner::of(&*conn);
    {
        let mut st = lock(&session.state);
        if st.sock.is_some() || st.closed {
            drop(st);
            return reject(&conn, wire::ERR_UNKNOWN_SESSION, "session already attached");
        }
        // ATTACHED goes out before the producer can see the socket, so it is the client's first
        // frame (64 bytes on a fresh socket: this send does not block).
        if send_frame(&*conn, &Frame::new(wire::KIND_ATTACHED, 0, 0), None).is_err() {
            drop(st);
            session.close();
            return;
        }
        st.sock = Some(conn.clone());
        shared.attached.fetch_add(1, Ordering::Relaxed);
        st.peer = peer;
        st.forgets = frame.a & wire::HELLO_FORGETS != 0;
    }
    session.changed.notify_all();
    let _ = rustix::net::sockopt::set_socket_timeout(&*conn, rustix::net::sockopt::Timeout::Recv, None);
    // Ends when the socket closes or fails (the client is gone), or at the client's first frame
    // that breaks the protocol: answered once, and the session ends. Answering every bad frame let
    // a client that never reads fill its own socket with answers, and the next send to it (a
    // shard's descriptor, under the session's lock) then waited out SEND_TIMEOUT. The client
    // library records any ERROR frame as its stream's error, so it never goes on past one either.
    while let Ok(Some(bytes)) = recv_frame(&*conn) {
        let (code, msg) = match Frame::decode(&bytes) {
            Ok(f) if f.kind == wire::KIND_STREAM_END => {
                session.release_from(f.a);
                continue;
            }
            Ok(f) if f.kind == wire::KIND_RELEASE => {
                if session.release(f.a) {
                    continue;
                }
                (wire::ERR_NOT_HELD, format!("batch {} is not held by this session", f.a))
            }
            Ok(f) => (wire::ERR_MALFORMED, format!("unexpected frame kind {}", f.kind)),
            Err(e) => (wire::ERR_MALFORMED, e.to_string()),
        };
        tracing::warn!("shm side channel closed: {msg}");
        let _ = send_frame(&*conn, &Frame::error(code, &format!("{msg}; the side channel is closed")), None);
        // Frames left unread at the close would reach the client as ECONNRESET ahead of this
        // answer: the write side ends after it, and what the client sent is drained first (what
        // its socket holds, bounded: a client that keeps sending is not waited for).
        let _ = rustix::net::shutdown(&*conn, rustix::net::Shutdown::Write);
        let mut buf = [0u8; wire::FRAME_BYTES];
        for _ in 0..DRAIN_AT_CLOSE {
            if !matches!(rustix::net::recv(&*conn, &mut buf, RecvFlags::DONTWAIT), Ok((n, _)) if n > 0) {
                break;
            }
        }
        break;
    }
    session.close();
}

impl Session {
    /// Ends the session: every lease is returned and the producer (if waiting) wakes up.
    pub fn close(&self) {
        let mut st = lock(&self.state);
        st.closed = true;
        if st.sock.take().is_some() {
            self.hub.attached.fetch_sub(1, Ordering::Relaxed);
        }
        let held: Vec<PathBuf> = st.outstanding.drain().flat_map(|(_, v)| v.shards).collect();
        // The daemon's mappings and descriptors go now; the memory itself when the client's
        // mapping goes too (at once for a dead client). The current ring is kept for the same
        // user's next stream, unless a build still fills one of its slots.
        let rings = std::mem::take(&mut st.rings);
        let peer = st.peer.take();
        let counted = std::mem::take(&mut st.ended_counted);
        drop(st);
        if let (true, Some(uid)) = (counted, self.uid) {
            let mut ended = lock(&self.hub.ended);
            if let Some(n) = ended.get_mut(&uid) {
                *n -= 1;
                if *n == 0 {
                    ended.remove(&uid);
                }
            }
        }
        if let (Some(owner), Some(last)) = (peer, rings.into_iter().next_back())
            && let Ok(ring) = Arc::try_unwrap(last.ring)
        {
            self.hub.pool.keep(owner, ring);
        }
        self.unlease(&held);
        lock(&self.hub.sessions).remove(&self.token);
        self.changed.notify_all();
    }

    /// The producer is done; the session lives on until the client has released everything.
    pub fn stream_done(&self) {
        let mut st = lock(&self.state);
        st.stream_done = true;
        let attached = st.sock.is_some();
        if attached
            && !st.ended_counted
            && let Some(uid) = self.uid
        {
            // Under the session's lock, as `close` takes it back: counted once, uncounted once.
            st.ended_counted = true;
            *lock(&self.hub.ended).entry(uid).or_default() += 1;
        }
        drop(st);
        if !attached {
            self.close();
        }
    }

    fn release(&self, batch: u64) -> bool {
        let mut st = lock(&self.state);
        let Some(held) = st.outstanding.remove(&batch) else { return false };
        if let Some((ring, slot)) = held.slot {
            free_slot(&mut st, ring, slot, Some(batch));
        }
        let_go(&mut st, &held.shards);
        drop(st);
        self.unlease(&held.shards);
        self.changed.notify_all();
        true
    }

    /// Releases every outstanding batch with index >= `first`: the client closed its stream
    /// before receiving them.
    fn release_from(&self, first: u64) {
        let mut st = lock(&self.state);
        st.end_from = Some(st.end_from.map_or(first, |f| f.min(first)));
        let gone: Vec<u64> = st.outstanding.keys().copied().filter(|&b| b >= first).collect();
        let mut held = Vec::new();
        for b in gone {
            let Some(h) = st.outstanding.remove(&b) else { continue };
            if let Some((ring, slot)) = h.slot {
                free_slot(&mut st, ring, slot, Some(b));
            }
            held.extend(h.shards);
        }
        let_go(&mut st, &held);
        drop(st);
        self.unlease(&held);
        self.changed.notify_all();
    }

    /// The stream's working set moved past `shards`: each is forgotten (SHARD_FORGET, so the
    /// client drops its descriptor or mapping) now, or when the last batch holding it is
    /// released. Nothing for a client that cannot be told: it keeps its slots, as before.
    pub fn done_with<'p>(&self, shards: impl Iterator<Item = &'p Path>) {
        let mut st = lock(&self.state);
        if !st.forgets {
            return;
        }
        for path in shards {
            if !st.sent.contains_key(path) {
                continue;
            }
            if st.holds.get(path).is_some_and(|&n| n > 0) {
                st.done.insert(path.to_owned());
            } else {
                forget_slot(&mut st, path, wire::FORGET_DONE);
            }
        }
    }

    fn unlease(&self, shards: &[PathBuf]) {
        let mut leases = lock(&self.hub.leases);
        for s in shards {
            if let Some(n) = leases.get_mut(s) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    leases.remove(s);
                }
            }
        }
    }

    /// Waits (blocking) until the client has attached and holds fewer than `credits` batches.
    pub fn wait_ready(&self, cancelled: &dyn Fn() -> bool) -> Result<()> {
        self.wait_until(cancelled, |st| (st.outstanding.len() as u32) < self.credits).map(drop)
    }

    /// Whether [`Self::wait_ready`] would return now, without waiting for the client to release a
    /// batch (a producer holding batches it has not sent yet sends them first when not: the
    /// client can only release what it has).
    pub fn ready_now(&self) -> bool {
        let st = lock(&self.state);
        st.sock.is_some() && (st.outstanding.len() as u32) < self.credits
    }

    /// Packed mode: waits for turn `turn` (0, 1, 2, ... in the order the producer sends its
    /// batches) and a free slot, and takes the slot's credit. Taking slots in send order is what
    /// lets two batches be gathered at once: were the later batch to take the last slot, the
    /// earlier one would wait for a release the client can only make after receiving it.
    pub fn take_turn(&self, turn: u64, cancelled: &dyn Fn() -> bool) -> Result<Credit<'_>> {
        let mut st = self.wait_until(cancelled, |st| st.next_turn == turn && st.slot_free(self.credits))?;
        st.next_turn += 1;
        st.filling += 1;
        drop(st);
        self.changed.notify_all();
        Ok(Credit { session: self, used: false })
    }

    /// Whether a turn would get a slot's credit now, without waiting for the client to release
    /// one (a producer holding batches it has not sent yet sends them first when not: the client
    /// can only release what it has).
    pub fn credit_free(&self) -> bool {
        let st = lock(&self.state);
        st.sock.is_some() && st.slot_free(self.credits)
    }

    /// Whether a slot of `need` bytes needs a new ring, which [`Self::acquire_slot`] may wait to
    /// fit in the daemon's budget (until this stream's own older rings are given back, say).
    pub fn needs_ring(&self, need: u64) -> bool {
        lock(&self.state).needs_ring(need)
    }

    /// Waits (blocking) until the client has attached and `ready` holds; returns the state
    /// locked.
    fn wait_until(
        &self,
        cancelled: &dyn Fn() -> bool,
        ready: impl Fn(&SessionState) -> bool,
    ) -> Result<MutexGuard<'_, SessionState>> {
        let deadline = Instant::now() + ATTACH_TIMEOUT;
        let mut st = lock(&self.state);
        loop {
            if st.closed {
                return Err(Error::ClientGone("the client closed its shared-memory side channel".into()));
            }
            if cancelled() {
                return Err(Error::ClientGone("stream cancelled".into()));
            }
            if st.sock.is_some() && ready(&st) {
                return Ok(st);
            }
            if st.sock.is_none() && Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "the client did not attach to the shared-memory side channel within {} s",
                    ATTACH_TIMEOUT.as_secs()
                )));
            }
            // Bounded waits so a cancelled stream is noticed even without a notification.
            st = self
                .changed
                .wait_timeout(st, Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// The slot of `shard` for this client, sending its descriptor first if needed.
    /// `in_place`: the file is read in place and may change under the client (see
    /// [`wire::SHARD_MUTABLE`]): the client reads it instead of mapping it, and refuses it once
    /// it no longer has `len` bytes and this modification time ([`wire::SHARD_MTIME`]).
    pub fn slot_for(&self, path: &Path, file: &std::fs::File, len: u64, in_place: Option<i64>) -> Result<u32> {
        let mut st = lock(&self.state);
        if let Some(&slot) = st.sent.get(path) {
            st.done.remove(path); // used again: not done after all
            return Ok(slot);
        }
        let sock = st.sock.clone().ok_or_else(|| Error::ClientGone("shared-memory client detached".into()))?;
        let slot = st.next_slot;
        let fd = file.try_clone().map_err(|e| Error::io("cannot duplicate descriptor of", path, e))?;
        let fd: OwnedFd = fd.into();
        send_frame(&*sock, &Frame::shard_fd(u64::from(slot), len, in_place), Some(fd.as_fd()))
            .map_err(|e| to_client("pass shard descriptor", e))?;
        st.sent.insert(path.to_owned(), slot);
        st.next_slot += 1;
        Ok(slot)
    }

    /// The slot of a segment the daemon made (a decoded row group's arena, keyed by `path`, which
    /// names no file): sent once, as a SHARD_ARENA descriptor the client maps and never keeps
    /// past its SHARD_FORGET. `alive` says when the daemon lets go of the segment; see
    /// [`Self::sweep_segments`].
    pub fn slot_for_segment(
        &self,
        path: &Path,
        file: &std::fs::File,
        len: u64,
        alive: Weak<dyn std::any::Any + Send + Sync>,
    ) -> Result<u32> {
        let mut st = lock(&self.state);
        if let Some(&slot) = st.sent.get(path) {
            return Ok(slot);
        }
        let sock = st.sock.clone().ok_or_else(|| Error::ClientGone("shared-memory client detached".into()))?;
        let slot = st.next_slot;
        send_frame(&*sock, &Frame::arena_fd(u64::from(slot), len), Some(file.as_fd()))
            .map_err(|e| to_client("pass a decoded row group", e))?;
        st.sent.insert(path.to_owned(), slot);
        st.segments.insert(path.to_owned(), alive);
        st.next_slot += 1;
        Ok(slot)
    }

    /// Forgets the segments the daemon no longer holds (their row groups left the decoded
    /// cache): at once when no batch holds one, else at the release of the last batch that does,
    /// so a client never finds a batch naming a slot it was told to forget. The client keeps no
    /// mapping of a forgotten segment, and the segment's memory goes once no array of it is left.
    pub fn sweep_segments(&self) {
        let mut st = lock(&self.state);
        let dead: Vec<PathBuf> =
            st.segments.iter().filter(|(_, alive)| alive.strong_count() == 0).map(|(p, _)| p.clone()).collect();
        for path in dead {
            st.segments.remove(&path);
            if st.holds.get(&path).is_some_and(|&n| n > 0) {
                st.gone.insert(path);
            } else {
                forget_slot(&mut st, &path, wire::FORGET_EVICTED);
            }
        }
    }

    /// Records that `batch` leases `shards` (called before the batch is sent).
    pub fn lease(&self, batch: u64, shards: Vec<PathBuf>) {
        // Check and record under one lock, so a STREAM_END arriving meanwhile either sees this
        // batch (and releases it) or is seen here (lock order: session state -> hub leases).
        let mut st = lock(&self.state);
        if st.end_from.is_some_and(|f| batch >= f) || st.closed {
            return; // the client will never use this batch
        }
        {
            let mut leases = lock(&self.hub.leases);
            for s in &shards {
                *leases.entry(s.clone()).or_default() += 1;
            }
        }
        for s in &shards {
            *st.holds.entry(s.clone()).or_default() += 1;
        }
        // An Arrow batch with views holds its ring slot (published first) and its segments.
        st.outstanding.entry(batch).or_insert(Held { shards: Vec::new(), slot: None }).shards.extend(shards);
    }

    /// A ring slot of at least `need` bytes to gather a packed batch into, for the `credit` of
    /// [`Self::take_turn`]; exclusively the caller's until it publishes or drops the guard. The
    /// credit guarantees a free slot: held and filling slots are fewer than the ring's. The first
    /// call, and one whose batch outgrows the ring's slots, makes a new ring (slots at least twice
    /// as large, so a stream makes only a few) and passes its descriptor to the client.
    ///
    /// A new ring is charged to the daemon's packed budget first; when the budget is spent, the
    /// build waits (without the session's lock, so this stream's own releases go on) up to
    /// [`BUDGET_WAIT`] or until `cancelled`, then fails (see [`super::budget`]).
    pub fn acquire_slot<'s>(
        &'s self,
        mut credit: Credit<'s>,
        need: u64,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<SlotGuard<'s>> {
        let max_slot = ((MAX_RING_BYTES - PAGE) / u64::from(self.credits)) & !(PAGE - 1);
        let mut st = lock(&self.state);
        let mut reserved: Option<Reservation> = None;
        while st.needs_ring(need) {
            let sock = st.sock.clone().ok_or_else(|| Error::ClientGone("shared-memory client detached".into()))?;
            let want = round_up(need, PAGE).filter(|&b| b <= max_slot).ok_or_else(|| {
                Error::invalid(format!(
                    "a packed batch of {need} bytes exceeds the largest ring slot ({} MiB); use smaller batches",
                    max_slot >> 20
                ))
            })?;
            let previous = st.rings.last().map_or(0, |r| r.ring.header.slot_bytes);
            let slot_bytes = want.max(previous.saturating_mul(2)).min(max_slot);
            let fit = Fit { slot_count: self.credits, min_slot_bytes: slot_bytes };
            if let Some(ring) = st.peer.as_ref().and_then(|owner| self.hub.pool.take(owner, fit)) {
                self.hub.rings_reused.fetch_add(1, Ordering::Relaxed);
                self.adopt_ring(&mut st, &sock, Arc::new(ring))?;
                continue;
            }
            let segment = shardstream_proto::ring::RingHeader::new(0, self.credits, slot_bytes)
                .segment_bytes()
                .ok_or_else(|| Error::Internal(format!("ring of {} x {slot_bytes} bytes", self.credits)))?;
            let never = || false;
            let reservation = match reserved.take() {
                Some(r) if r.bytes() == segment => r,
                _ => match self.hub.budget.reserve(segment, Duration::ZERO, &never, &never) {
                    Ok(Some(r)) => r,
                    _ if self.hub.pool.clear() > 0 => continue, // kept rings give way to streams
                    _ => {
                        // Wait for room without the lock (this stream's own releases go on),
                        // and stop waiting if another build of this stream made a large enough
                        // ring meanwhile; then look again. Meanwhile no ring stays kept: one
                        // kept by a stream that ended since would hold the memory waited for.
                        drop(st);
                        let made = || {
                            self.hub.pool.clear();
                            lock(&self.state).rings.last().is_some_and(|r| r.ring.header.slot_bytes >= need)
                        };
                        reserved = self.hub.budget.reserve(segment, BUDGET_WAIT, cancelled, &made)?;
                        st = lock(&self.state);
                        continue;
                    }
                },
            };
            let id = self.hub.next_ring.fetch_add(1, Ordering::Relaxed);
            let ring = Ring::create(id, self.credits, slot_bytes, self.hub.ring_bytes.clone())?.charged(reservation);
            self.hub.rings_made.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(ring = id, slot_bytes, slots = self.credits, "new packed-mode ring");
            self.adopt_ring(&mut st, &sock, Arc::new(ring))?;
        }
        drop(reserved);
        let Some(current) = st.rings.last_mut() else {
            return Err(Error::Internal("packed session without a ring".into()));
        };
        let slot = current
            .slots
            .acquire()
            .ok_or_else(|| Error::Internal("no free ring slot although a credit was taken".into()))?;
        let ring = current.ring.clone();
        // From here the slot guard gives the credit back (publish or abandon).
        credit.used = true;
        drop(st);
        ring.prepare(slot, need);
        Ok(SlotGuard { session: self, ring, slot, done: false })
    }

    /// Passes `ring` to the client and makes it the one new batches go to.
    fn adopt_ring(&self, st: &mut SessionState, sock: &OwnedFd, ring: Arc<Ring>) -> Result<()> {
        send_frame(sock, &Frame::new(wire::KIND_RING_FD, ring.id(), ring.segment_bytes()), Some(ring.fd()))
            .map_err(|e| to_client("pass a ring", e))?;
        st.rings.push(RingEntry { ring, slots: SlotTable::new(self.credits) });
        retire_idle(st);
        Ok(())
    }

    /// Records that packed `batch` holds `slot` (called before the batch is sent); a batch the
    /// client will never receive frees its slot at once.
    fn publish_slot(&self, ring: u64, slot: u32, batch: u64) {
        let mut st = lock(&self.state);
        st.filling = st.filling.saturating_sub(1);
        if st.end_from.is_some_and(|f| batch >= f) || st.closed {
            free_slot(&mut st, ring, slot, None);
            return;
        }
        let published = st.rings.iter_mut().find(|r| r.ring.id() == ring).is_some_and(|r| r.slots.publish(slot, batch));
        if published {
            st.outstanding.entry(batch).or_insert(Held { shards: Vec::new(), slot: None }).slot = Some((ring, slot));
        } else {
            // Only a guard for a slot the table does not show as filling gets here: a bug, but
            // the slot must not stay taken for the rest of the stream.
            tracing::warn!(ring, slot, batch, "published a ring slot that was not being filled");
            free_slot(&mut st, ring, slot, None);
        }
    }

    fn abandon_slot(&self, ring: u64, slot: u32) {
        let mut st = lock(&self.state);
        st.filling = st.filling.saturating_sub(1);
        free_slot(&mut st, ring, slot, None);
        drop(st);
        self.changed.notify_all();
    }
}

/// Frees `slot` of ring `ring` (held by `batch`, or still filling when None), then drops rings
/// that are no longer current and no longer used.
/// Counts `shards` as no longer held by a released batch, forgetting those the stream is done
/// with once nothing holds them.
fn let_go(st: &mut SessionState, shards: &[PathBuf]) {
    for s in shards {
        let Some(n) = st.holds.get_mut(s) else { continue };
        *n = n.saturating_sub(1);
        if *n == 0 {
            st.holds.remove(s);
            if st.gone.remove(s) {
                forget_slot(st, s, wire::FORGET_EVICTED);
            } else if st.done.remove(s) {
                forget_slot(st, s, wire::FORGET_DONE);
            }
        }
    }
}

/// Drops `path`'s slot (a later use gets a new one) and tells the client, if it understands.
/// An eviction also names the slots the stream already forgot as done: the client may have kept
/// their mappings, which would hold the unlinked file's disk space.
fn forget_slot(st: &mut SessionState, path: &Path, reason: u64) {
    st.done.remove(path);
    let current = st.sent.remove(path);
    let slots: Vec<u32> = if reason == wire::FORGET_EVICTED {
        current.into_iter().chain(st.retired.remove(path).unwrap_or_default()).collect()
    } else {
        let Some(slot) = current else { return };
        st.retired.entry(path.to_owned()).or_default().push(slot);
        vec![slot]
    };
    if let Some(sock) = st.sock.clone().filter(|_| st.forgets) {
        for slot in slots {
            // A client that cannot be told keeps the slot's mapping until its stream ends, as
            // before; the stream itself is not failed for it.
            let _ = send_frame(&*sock, &Frame::new(wire::KIND_SHARD_FORGET, u64::from(slot), reason), None);
        }
    }
}

fn free_slot(st: &mut SessionState, ring: u64, slot: u32, batch: Option<u64>) {
    if let Some(r) = st.rings.iter_mut().find(|r| r.ring.id() == ring) {
        match batch {
            Some(b) => r.slots.release(slot, b),
            None => r.slots.abandon(slot),
        };
    }
    retire_idle(st);
}

fn retire_idle(st: &mut SessionState) {
    let Some(current) = st.rings.last().map(|r| r.ring.id()) else { return };
    let sock = st.sock.clone();
    st.rings.retain(|r| {
        let keep = r.ring.id() == current || !r.slots.is_idle();
        if !keep && let Some(sock) = &sock {
            // The client may unmap it once its arrays are gone; if this frame is lost the client
            // only keeps a mapping longer.
            let _ = send_frame(&**sock, &Frame::new(wire::KIND_RING_RETIRE, r.ring.id(), 0), None);
        }
        keep
    });
}

/// A packed build's claim on one slot, taken in send order by [`Session::take_turn`]; given back
/// when dropped unused (the build failed before it took a slot).
pub struct Credit<'a> {
    session: &'a Session,
    used: bool,
}

impl Drop for Credit<'_> {
    fn drop(&mut self) {
        if !self.used {
            let mut st = lock(&self.session.state);
            st.filling = st.filling.saturating_sub(1);
            drop(st);
            self.session.changed.notify_all();
        }
    }
}

/// A ring slot being filled by the producer. Dropped without [`SlotGuard::publish`] (the batch
/// failed), the slot is free again.
pub struct SlotGuard<'a> {
    session: &'a Session,
    ring: Arc<Ring>,
    slot: u32,
    done: bool,
}

impl SlotGuard<'_> {
    pub fn ring(&self) -> u64 {
        self.ring.id()
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }

    /// The slot's bytes.
    pub fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: this guard exists only while its slot is `Filling` in the session's table
        // (acquire made it so; publish or drop ends it), which no other guard can be for the
        // same slot, and the daemon makes no other reference to a slot's bytes.
        unsafe { self.ring.slot_mut(self.slot) }.unwrap_or_default()
    }

    /// The batch is about to be sent: the slot is held until the client releases `batch`.
    pub fn publish(mut self, batch: u64) {
        self.done = true;
        self.session.publish_slot(self.ring.id(), self.slot, batch);
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.session.abandon_slot(self.ring.id(), self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardstream_proto::ring::RingHeader;

    /// A client's end of the side channel, attached to `session`; `flags` go in its HELLO.
    fn attach(hub: &ShmHub, session: &Session, flags: u64) -> OwnedFd {
        let sock = rustix::net::socket_with(
            rustix::net::AddressFamily::UNIX,
            SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::connect(&sock, &rustix::net::SocketAddrUnix::new(&hub.socket).unwrap()).unwrap();
        let mut hello = Frame::hello(&session.token);
        hello.a = flags;
        send_frame(&sock, &hello, None).unwrap();
        assert_eq!(next_frame(&sock).kind, wire::KIND_ATTACHED);
        // The session sees its socket just after ATTACHED is sent.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while lock(&session.state).sock.is_none() {
            assert!(std::time::Instant::now() < deadline, "the session never saw its socket");
            std::thread::sleep(Duration::from_millis(1));
        }
        sock
    }

    /// A hub of the default configuration listening in `dir`.
    fn default_hub(dir: &Path) -> Arc<ShmHub> {
        ShmHub::bind(dir.join("sock.shm"), ShmConfig::default(), Default::default()).unwrap()
    }

    fn next_frame(sock: &OwnedFd) -> Frame {
        Frame::decode(&recv_frame(sock).unwrap().unwrap()).unwrap()
    }

    /// Frames waiting on `sock` now, without waiting for more.
    fn pending(sock: &OwnedFd) -> Vec<Frame> {
        let mut out = Vec::new();
        let mut buf = [0u8; wire::FRAME_BYTES];
        while let Ok(n) = rustix::net::recv(sock, &mut buf, rustix::net::RecvFlags::DONTWAIT) {
            out.push(Frame::decode(&buf[..n.0]).unwrap());
        }
        out
    }

    /// Takes a slot of `need` bytes as a packed build would, publishes it as `batch`, and returns
    /// the ring it lies in.
    fn fill_one(session: &Session, batch: u64, need: u64) -> u64 {
        let never = || false;
        let credit = session.take_turn(batch, &never).unwrap();
        let guard = session.acquire_slot(credit, need, &never).unwrap();
        let ring = guard.ring();
        guard.publish(batch);
        ring
    }

    /// Waits until `cond` holds (the session thread sees a close a moment after the client).
    fn eventually(cond: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "condition never held");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    extern "C" fn ignore_signal(_: libc::c_int) {}

    /// A side-channel read with a timeout (the HELLO's) fails with EINTR when a signal handler
    /// runs on its thread or the daemon is stopped and continued, SA_RESTART or not: the attach
    /// must go on waiting for the frame, not refuse the client.
    #[test]
    fn a_side_channel_read_interrupted_by_a_signal_goes_on() {
        // SAFETY: a handler that does nothing, installed without SA_RESTART; SIGUSR2 is sent to
        // the reading thread only.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = ignore_signal as extern "C" fn(libc::c_int) as usize;
            libc::sigemptyset(&mut action.sa_mask);
            assert_eq!(libc::sigaction(libc::SIGUSR2, &action, std::ptr::null_mut()), 0);
        }
        let (daemon, client) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::sockopt::set_socket_timeout(&daemon, rustix::net::sockopt::Timeout::Recv, Some(ATTACH_TIMEOUT))
            .unwrap();
        let (id_tx, id_rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            // SAFETY: pthread_self has no preconditions.
            id_tx.send(unsafe { libc::pthread_self() }).unwrap();
            recv_frame(&daemon).map(|f| f.map(|b| Frame::decode(&b).map(|f| f.kind)))
        });
        let id = id_rx.recv().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        // SAFETY: the reader is blocked in its read until the frame below is sent.
        assert_eq!(unsafe { libc::pthread_kill(id, libc::SIGUSR2) }, 0);
        std::thread::sleep(Duration::from_millis(100));
        let sent = send_frame(&client, &Frame::hello(&[7; 16]), None);
        let got = reader.join().unwrap();
        assert!(matches!(got, Ok(Some(Ok(wire::KIND_HELLO)))), "{got:?}");
        sent.unwrap();
    }

    #[test]
    fn ended_streams_kept_attached_bound_a_uids_new_sessions() {
        // A client that cancels each stream and keeps its side channel held a session (a
        // thread, descriptors, leases) per stream without bound; thousands took every descriptor
        // of the daemon.
        let dir = tempfile::tempdir().unwrap();
        let config = ShmConfig { ended_per_client: 2, ..ShmConfig::default() };
        let hub = ShmHub::bind(dir.path().join("sock.shm"), config, Default::default()).unwrap();
        let mut kept = Vec::new();
        for _ in 0..2 {
            let s = hub.new_session(2, Some(1000)).unwrap();
            let sock = attach(&hub, &s, wire::HELLO_FORGETS);
            s.stream_done();
            kept.push(sock);
        }
        let err = hub.new_session(2, Some(1000)).unwrap_err();
        assert!(matches!(err, Error::CacheFull(_)), "{err}");
        assert!(err.to_string().contains("uid 1000 keeps 2 shared-memory streams that ended attached"), "{err}");
        // Another uid's are counted apart.
        hub.new_session(2, Some(1001)).unwrap();
        // The client lets one go: room again.
        drop(kept.pop());
        eventually(|| hub.new_session(2, Some(1000)).is_ok());
    }

    #[test]
    fn the_next_stream_of_a_process_gets_its_ring_back_and_kept_rings_give_way_to_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let (small, large) = (75 * PAGE, 100 * PAGE);
        let ring_bytes = RingHeader::new(0, 2, small).segment_bytes().unwrap();
        // Room for one ring of 2 slots of 300 or 400 KiB, not two.
        let config = ShmConfig { packed_budget: MIN_PACKED_BUDGET, ..ShmConfig::default() };
        let hub = ShmHub::bind(dir.path().join("sock.shm"), config, Default::default()).unwrap();

        let first = hub.new_session(2, None).unwrap();
        let sock = attach(&hub, &first, wire::HELLO_FORGETS);
        let id = fill_one(&first, 0, small - 100);
        assert_eq!(next_frame(&sock).kind, wire::KIND_RING_FD);
        // The client goes (its side channel closes) still holding batch 0: the ring is kept.
        drop(sock);
        eventually(|| hub.kept_rings().0 == 1);
        assert_eq!(hub.kept_rings().1, ring_bytes);
        assert_eq!(hub.ring_bytes(), 0, "kept rings are not counted as in use");

        let second = hub.new_session(2, None).unwrap();
        let sock = attach(&hub, &second, wire::HELLO_FORGETS);
        assert_eq!(fill_one(&second, 0, small), id, "the same ring, under its id");
        let f = next_frame(&sock);
        assert_eq!((f.kind, f.a, f.b), (wire::KIND_RING_FD, id, ring_bytes));
        assert_eq!(fill_one(&second, 1, small - 5000), id);
        assert_eq!(hub.ring_counts(), (1, 1));
        assert_eq!(hub.kept_rings().0, 0);
        drop(sock);
        eventually(|| hub.kept_rings().0 == 1);

        // A stream whose slots the kept ring cannot hold makes its own; the budget has room for
        // one ring only, so the kept one is dropped for it.
        let third = hub.new_session(2, None).unwrap();
        let _sock = attach(&hub, &third, wire::HELLO_FORGETS);
        let bigger = fill_one(&third, 0, large);
        assert_ne!(bigger, id);
        assert_eq!(hub.ring_counts(), (2, 1));
        assert_eq!(hub.kept_rings(), (0, 0));
        assert_eq!(hub.packed_budget().0, RingHeader::new(0, 2, large).segment_bytes().unwrap());
    }

    #[test]
    fn a_bad_frame_is_answered_once_and_ends_the_session_and_counts_take_no_session_lock() {
        let dir = tempfile::tempdir().unwrap();
        let hub = default_hub(dir.path());
        let session = hub.new_session(2, None).unwrap();
        let sock = attach(&hub, &session, wire::HELLO_FORGETS);
        assert_eq!(hub.counts().0, 1);
        // A send under the session's lock (to a client that does not read) holds it: counting
        // the attached sessions does not wait for it.
        let held = lock(&session.state);
        let (tx, rx) = std::sync::mpsc::channel();
        let hub2 = hub.clone();
        std::thread::spawn(move || tx.send(hub2.counts()).unwrap());
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), (1, 0));
        drop(held);
        // A client that sent junk and never read got an answer per frame, until its socket was
        // full and the daemon's next send to it waited 10 s under the session lock.
        send_frame(&sock, &Frame::new(99, 0, 0), None).unwrap();
        let answer = next_frame(&sock);
        assert_eq!(answer.kind, wire::KIND_ERROR);
        assert!(answer.message().contains("unexpected frame kind 99"), "{}", answer.message());
        assert_eq!(recv_frame(&sock).unwrap(), None, "then the side channel closes");
        eventually(|| hub.counts().0 == 0);
        assert!(lock(&session.state).closed);
    }

    #[test]
    fn ready_now_says_whether_wait_ready_would_wait_for_the_client() {
        let dir = tempfile::tempdir().unwrap();
        let hub = default_hub(dir.path());
        let session = hub.new_session(2, None).unwrap();
        assert!(!session.ready_now(), "not attached yet");
        let _sock = attach(&hub, &session, wire::HELLO_FORGETS);
        assert!(session.ready_now());
        session.lease(0, Vec::new());
        assert!(session.ready_now(), "one of two credits taken");
        session.lease(1, Vec::new());
        assert!(!session.ready_now(), "both taken: the next batch waits for a release");
        let never = || false;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|s| {
            s.spawn(|| tx.send(session.wait_ready(&never).is_ok()).unwrap());
            assert!(rx.recv_timeout(Duration::from_millis(100)).is_err(), "wait_ready waits as ready_now says");
            assert!(session.release(0));
            assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap());
        });
        assert!(session.ready_now());
    }

    #[test]
    fn an_evicted_shard_is_forgotten_by_the_sessions_that_were_sent_it() {
        let dir = tempfile::tempdir().unwrap();
        let hub = default_hub(dir.path());
        let shard = dir.path().join("copy.tar");
        std::fs::write(&shard, b"shard bytes").unwrap();
        let file = std::fs::File::open(&shard).unwrap();
        let (told, untold) = (hub.new_session(4, None).unwrap(), hub.new_session(4, None).unwrap());
        let (told_sock, untold_sock) = (attach(&hub, &told, wire::HELLO_FORGETS), attach(&hub, &untold, 0));
        for (s, sock) in [(&told, &told_sock), (&untold, &untold_sock)] {
            assert_eq!(s.slot_for(&shard, &file, 11, None).unwrap(), 0);
            assert_eq!(next_frame(sock).kind, wire::KIND_SHARD_FD);
        }

        hub.forget(&shard);
        let told_frames = pending(&told_sock);
        assert_eq!(told_frames.len(), 1);
        let f = told_frames[0];
        assert_eq!((f.kind, f.a, f.b), (wire::KIND_SHARD_FORGET, 0, wire::FORGET_EVICTED));
        assert!(pending(&untold_sock).is_empty(), "a client without the flag would refuse the frame");

        // Needed again (a new copy at the same path): a new slot and descriptor, never slot 0.
        for (s, sock) in [(&told, &told_sock), (&untold, &untold_sock)] {
            assert_eq!(s.slot_for(&shard, &file, 11, None).unwrap(), 1);
            let f = next_frame(sock);
            assert_eq!((f.kind, f.a), (wire::KIND_SHARD_FD, 1));
        }
        hub.forget(&dir.path().join("never-sent.tar"));
        assert!(pending(&told_sock).is_empty());
    }

    #[test]
    fn a_shard_the_stream_moved_past_is_forgotten_once_no_batch_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let hub = default_hub(dir.path());
        let [a, b] = ["a.tar", "b.tar"].map(|n| dir.path().join(n));
        for p in [&a, &b] {
            std::fs::write(p, b"shard").unwrap();
        }
        let session = hub.new_session(4, None).unwrap();
        let sock = attach(&hub, &session, wire::HELLO_FORGETS);
        for p in [&a, &b] {
            session.slot_for(p, &std::fs::File::open(p).unwrap(), 5, Some(0)).unwrap();
        }
        assert_eq!(pending(&sock).len(), 2);
        session.lease(7, vec![a.clone()]);
        session.lease(8, vec![a.clone()]);

        session.done_with([a.as_path(), b.as_path()].into_iter());
        let f = pending(&sock);
        assert_eq!(f.len(), 1, "b is held by no batch: forgotten at once; a is held");
        assert_eq!((f[0].kind, f[0].a, f[0].b), (wire::KIND_SHARD_FORGET, 1, wire::FORGET_DONE));
        assert!(session.release(7));
        assert!(pending(&sock).is_empty(), "batch 8 still holds a");
        assert!(session.release(8));
        let f = pending(&sock);
        assert_eq!((f.len(), f[0].a, f[0].b), (1, 0, wire::FORGET_DONE));

        // Used again before its last batch was released: not forgotten.
        let slot = session.slot_for(&a, &std::fs::File::open(&a).unwrap(), 5, Some(0)).unwrap();
        assert_eq!(slot, 2);
        let _ = pending(&sock);
        session.lease(9, vec![a.clone()]);
        session.done_with(std::iter::once(a.as_path()));
        assert_eq!(session.slot_for(&a, &std::fs::File::open(&a).unwrap(), 5, Some(0)).unwrap(), 2);
        assert!(session.release(9));
        assert!(pending(&sock).is_empty(), "a was used again after the working set let it go");

        // Evicted after the stream forgot it as done: the old slots are named (the client may
        // keep their mappings), and the current one.
        hub.forget(&a);
        let f = pending(&sock);
        let mut named: Vec<(u64, u64)> = f.iter().map(|f| (f.a, f.b)).collect();
        named.sort_unstable();
        assert_eq!(named, [(0, wire::FORGET_EVICTED), (2, wire::FORGET_EVICTED)]);

        // A client that cannot be told keeps its slots.
        let old = hub.new_session(4, None).unwrap();
        let old_sock = attach(&hub, &old, 0);
        assert_eq!(old.slot_for(&b, &std::fs::File::open(&b).unwrap(), 5, Some(0)).unwrap(), 0);
        let _ = pending(&old_sock);
        old.done_with(std::iter::once(b.as_path()));
        assert!(pending(&old_sock).is_empty());
        assert_eq!(old.slot_for(&b, &std::fs::File::open(&b).unwrap(), 5, Some(0)).unwrap(), 0);
    }

    #[test]
    fn a_segment_is_sent_once_and_forgotten_as_evicted_once_let_go_and_released() {
        let dir = tempfile::tempdir().unwrap();
        let hub = default_hub(dir.path());
        let session = hub.new_session(4, None).unwrap();
        let sock = attach(&hub, &session, wire::HELLO_FORGETS);
        let file = tempfile::tempfile().unwrap();
        file.set_len(10).unwrap();
        let (a, b) = (PathBuf::from("/segment/a"), PathBuf::from("/segment/b"));
        let held_a: Arc<dyn std::any::Any + Send + Sync> = Arc::new(1u8);
        let held_b: Arc<dyn std::any::Any + Send + Sync> = Arc::new(2u8);
        assert_eq!(session.slot_for_segment(&a, &file, 10, Arc::downgrade(&held_a)).unwrap(), 0);
        assert_eq!(session.slot_for_segment(&b, &file, 10, Arc::downgrade(&held_b)).unwrap(), 1);
        assert_eq!(session.slot_for_segment(&a, &file, 10, Arc::downgrade(&held_a)).unwrap(), 0, "sent once");
        let sent = pending(&sock);
        assert_eq!(sent.len(), 2);
        assert!(sent.iter().all(|f| f.kind == wire::KIND_SHARD_FD && f.shard_arena() && !f.shard_mutable()));

        // Batch 0 holds a ring slot and segment a (leased first, then published).
        session.lease(0, vec![a.clone()]);
        let ring = fill_one(&session, 0, 100);
        let _ = pending(&sock);
        session.sweep_segments();
        assert!(pending(&sock).is_empty(), "the daemon still holds both");

        drop(held_a);
        drop(held_b);
        session.sweep_segments();
        let f = pending(&sock);
        assert_eq!((f.len(), f[0].kind, f[0].a, f[0].b), (1, wire::KIND_SHARD_FORGET, 1, wire::FORGET_EVICTED));
        assert!(session.release(0));
        let f = pending(&sock);
        let forgets: Vec<(u64, u64)> =
            f.iter().filter(|f| f.kind == wire::KIND_SHARD_FORGET).map(|f| (f.a, f.b)).collect();
        assert_eq!(forgets, [(0, wire::FORGET_EVICTED)], "a is forgotten at the release of the batch that held it");
        // The release freed the batch's ring slot as well: both leases were one batch's.
        assert!(lock(&session.state).outstanding.is_empty());
        assert!(lock(&session.state).rings.iter().all(|r| r.ring.id() != ring || r.slots.is_idle()));
    }
}
