//! The ring protocol on real endpoints: [`RingReceiver`] (the client: registers the ring, joins
//! immediates with metadata, returns credits) and [`RingSender`] (the daemon: stages a batch in
//! registered memory, writes it into a free slot of the client's ring, takes credits back).
//!
//! Metadata and the exchange of addresses are the caller's (gRPC in shardstream, a socket in the
//! bench); this module moves bytes and enforces [`crate::credits`]. Each side drives its own
//! completion queue from the thread calling it, blocking in `fi_cq_sread`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::credits::{Arrivals, Immediate, ProtocolError, Ready, SenderSlots};
use crate::ffi;
use crate::objects::{Completion, CompletionQueue, Domain, Endpoint, Fabric, MemoryRegion, PeerAddr, RemoteRegion};

/// RELEASE(slot, batch): 4 bytes slot, 4 zero, 8 bytes batch, little-endian.
pub const RELEASE_BYTES: usize = 16;
/// The slot of a FINISHED message (batch `u64::MAX`): the client has every batch of the stream
/// and sends nothing more, so the daemon may close without waiting for the credits it holds.
pub const FINISHED_SLOT: u32 = u32::MAX;
/// Sends the client may have in flight (RELEASE messages).
const SEND_CONTEXTS: usize = 16;
/// How long returning a credit may wait for a free send buffer or a provider that accepts the
/// send; past it the daemon is taken as gone ([`StreamError::CreditNotSent`]).
pub const RELEASE_WAIT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Fabric(#[from] crate::Error),
    #[error("rdma protocol violation: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("rdma peer failed: {0}")]
    PeerFailed(String),
    #[error("rdma peer returned no credit for {0:?}: it stalled or is gone")]
    Stalled(Duration),
    #[error("rdma peer took no credit back for {0:?}: it stalled or is gone")]
    CreditNotSent(Duration),
    #[error("batch of {len} bytes does not fit a {slot_bytes}-byte ring slot")]
    TooLarge { len: usize, slot_bytes: usize },
    #[error("malformed RELEASE message of {0} bytes")]
    BadRelease(usize),
    #[error(
        "the daemon could not reach the client's rdma endpoint at {address}: nothing completed in {waited:?} \
         (a firewall, or an address the daemon has no route to)"
    )]
    Unreachable { address: String, waited: Duration },
    #[error("a staged batch was posted to a sender that did not lend it, or twice")]
    NotStaged,
    #[error("a wait (for a credit, room in the queue or the client's last releases) was given up: the stream ended")]
    Stopped,
}

pub type StreamResult<T> = std::result::Result<T, StreamError>;

/// Largest ring slot a daemon stages (it keeps a few batches of a slot's size in registered
/// memory per stream): a client refuses a larger SHARDSTREAM_RDMA_SLOT_BYTES before it registers
/// anything, and the daemon refuses a larger offer.
pub const MAX_SLOT_BYTES: u64 = 1 << 30;

/// How long a daemon waits for the first completion of a stream (a write landing, a release
/// arriving) before it gives up on reaching the client's endpoint: an address refused or
/// blackholed otherwise left the provider's queue full for as long as the client's gRPC stream
/// stayed open, the stream hung for good. A reachable client completes its first write in
/// milliseconds; later stalls (a trainer holding its batches) are the caller's to judge.
pub const FIRST_COMPLETION_WAIT: Duration = Duration::from_secs(30);

/// An endpoint name for messages: `ip:port` for socket-address providers, else its length.
pub fn describe_name(name: &[u8]) -> String {
    match crate::objects::name_ip(name) {
        // sockaddr_in and sockaddr_in6 both keep the port, big-endian, at bytes 2..4.
        Some(ip) if name.len() >= 4 => {
            std::net::SocketAddr::new(ip, u16::from_be_bytes([name[2], name[3]])).to_string()
        }
        _ => format!("a {}-byte provider address", name.len()),
    }
}

/// Opens fabric, domain, completion queue and endpoint for one side.
pub fn open_endpoint(provider: Option<&str>, contexts: usize) -> crate::Result<Endpoint> {
    open_endpoint_toward(provider, contexts, None)
}

/// As [`open_endpoint`], on the interface that routes to `peer` ([`Fabric::open_toward`]): what
/// a side whose peer is on another host must use, or it may offer that peer a loopback address.
pub fn open_endpoint_toward(
    provider: Option<&str>,
    contexts: usize,
    peer: Option<std::net::IpAddr>,
) -> crate::Result<Endpoint> {
    let fabric = Fabric::open_toward(provider, peer)?;
    let domain = Domain::open(&fabric)?;
    let cq = CompletionQueue::open(&domain, 1024)?;
    Endpoint::open(&domain, &cq, contexts)
}

/// What a client offers the daemon (sent over gRPC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub name: Vec<u8>,
    pub ring: RemoteRegion,
    pub slots: u32,
    pub slot_bytes: u64,
    pub provider: String,
}

/// The client side of one stream.
pub struct RingReceiver<M> {
    ep: Endpoint,
    ring: Arc<MemoryRegion>,
    /// Send buffers for RELEASE (first SEND_CONTEXTS * 16 bytes) and receive buffers for
    /// providers that consume one per immediate (after).
    msgs: Arc<MemoryRegion>,
    slots: u32,
    slot_bytes: usize,
    arrivals: Arrivals<M>,
    daemon: Option<PeerAddr>,
    sends_busy: [bool; SEND_CONTEXTS],
    /// Slots whose [`Lent`] view was dropped, (slot, batch): their credits go back on the next
    /// call into this receiver.
    returned: Arc<Mutex<Vec<(u32, u64)>>>,
    /// Completions read while a receive waited for room in the queue, handled by the next pump.
    backlog: Vec<Completion>,
    /// Set (from any thread, [`Self::abandoned`]) once the stream is gone on this side: credits
    /// are then dropped, not sent, as nobody waits for them. Sending them to a daemon that has
    /// ended the stream waited out [`RELEASE_WAIT`] a credit, holding the ring all along.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

/// A delivered batch's bytes, read in place in the ring (no copy): the slot stays the client's
/// until this is dropped, and dropping it queues the slot's credit for the receiver to return
/// (waking a thread blocked on the receiver's completion queue, which sends it).
pub struct Lent {
    ring: Arc<MemoryRegion>,
    offset: usize,
    len: usize,
    slot: u32,
    batch: u64,
    returned: Arc<Mutex<Vec<(u32, u64)>>>,
    cq: Arc<crate::CompletionQueue>,
}

impl Lent {
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: range checked when lent (`RingReceiver::lend`). Nothing writes it while this
        // lives: the slot was delivered (its write complete) and its credit goes back to the
        // daemon only from `Drop` below, through `returned`; under the credit protocol the
        // daemon writes only slots it holds a credit for. (A daemon breaking the protocol could
        // race this read: the daemon is the trusted node service and the key covers only the
        // ring.) The region is mapped as long as this Arc lives.
        unsafe { self.ring.slice(self.offset, self.len) }.unwrap_or(&[])
    }

    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.returned.lock().unwrap_or_else(PoisonError::into_inner).push((self.slot, self.batch));
        self.cq.signal();
    }
}

impl<M> RingReceiver<M> {
    /// Registers a ring of `slots` x `slot_bytes` (bytes rounded up to pages).
    pub fn new(ep: Endpoint, slots: u32, slot_bytes: usize, first_batch: u64) -> StreamResult<Self> {
        // Checked: the size comes from the environment (SHARDSTREAM_RDMA_SLOT_BYTES), and a huge one
        // overflowed here (a panic in the client) instead of being refused.
        let too_large = || StreamError::TooLarge { len: slot_bytes, slot_bytes: MAX_SLOT_BYTES as usize };
        let slot_bytes = slot_bytes.max(1).div_ceil(4096).checked_mul(4096).ok_or_else(too_large)?;
        let ring_bytes = (slots as usize).checked_mul(slot_bytes).ok_or_else(too_large)?;
        let arrivals = Arrivals::new(slots, first_batch).ok_or(StreamError::Protocol(ProtocolError::NoSuchSlot {
            imm: 0,
            slot: slots,
            slots,
        }))?;
        let ring = MemoryRegion::new(&ep, ring_bytes, ffi::FI_REMOTE_WRITE)?;
        // Receives stay posted on every provider, not only where FI_RX_CQ_DATA says so: shm
        // (1.17) reports remote CQ data only against a posted receive, without asking for it.
        let rx_posts = slots as usize;
        let msgs = MemoryRegion::new(&ep, (SEND_CONTEXTS + rx_posts) * RELEASE_BYTES, ffi::FI_SEND | ffi::FI_RECV)?;
        let mut me = Self {
            ep,
            ring,
            msgs,
            slots,
            slot_bytes,
            arrivals,
            daemon: None,
            sends_busy: [false; SEND_CONTEXTS],
            returned: Arc::default(),
            backlog: Vec::new(),
            abandoned: Arc::default(),
        };
        for i in 0..rx_posts {
            me.post_rx(i)?;
        }
        Ok(me)
    }

    fn post_rx(&mut self, i: usize) -> crate::Result<()> {
        let Self { ep, msgs, backlog, .. } = self;
        let post = || ep.recv(SEND_CONTEXTS + i, msgs, (SEND_CONTEXTS + i) * RELEASE_BYTES, RELEASE_BYTES);
        post_until_queued(ep, post, backlog)
    }

    pub fn offer(&self) -> crate::Result<Offer> {
        Ok(Offer {
            name: self.ep.name()?,
            ring: self.ring.remote(),
            slots: self.slots,
            slot_bytes: self.slot_bytes as u64,
            provider: self.ep.fabric().provider().to_owned(),
        })
    }

    /// The daemon's endpoint address, from its answer.
    pub fn connect(&mut self, daemon_name: &[u8]) -> crate::Result<()> {
        self.daemon = Some(self.ep.insert_peer(daemon_name)?);
        Ok(())
    }

    /// The metadata of `batch`, written into `slot`.
    pub fn on_meta(&mut self, batch: u64, slot: u32, meta: M) -> StreamResult<()> {
        Ok(self.arrivals.on_meta(batch, slot, meta)?)
    }

    /// The next batch in order, waiting up to `wait` for completions; None if none is complete.
    pub fn next(&mut self, wait: Duration) -> StreamResult<Option<Ready<M>>> {
        let deadline = Instant::now() + wait;
        loop {
            self.return_lent()?;
            if let Some(r) = self.arrivals.next_ready()? {
                return Ok(Some(r));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let got = self.pump(Some(left))?;
            if !got && left.is_zero() {
                return Ok(None);
            }
            if !got && Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// Handles available completions (waiting up to `wait` for the first); true if any came.
    fn pump(&mut self, wait: Option<Duration>) -> StreamResult<bool> {
        let done = take_completions(&self.ep, &mut self.backlog, wait)?;
        let any = !done.is_empty();
        for c in done {
            match c {
                Completion::RemoteWrite { data, consumed, .. } => {
                    let imm = u32::try_from(data).map_err(|_| ProtocolError::NoSuchSlot {
                        imm: u32::MAX,
                        slot: u32::MAX,
                        slots: self.slots,
                    })?;
                    self.arrivals.on_write(imm)?;
                    if let Some(op) = consumed {
                        self.post_rx(op - SEND_CONTEXTS)?;
                    }
                }
                Completion::Sent { op } => {
                    if let Some(b) = self.sends_busy.get_mut(op) {
                        *b = false;
                    }
                }
                Completion::Received { op, .. } => {
                    // A message where only immediates are expected: repost and ignore.
                    if op >= SEND_CONTEXTS {
                        self.post_rx(op - SEND_CONTEXTS)?;
                    }
                }
                Completion::Written { .. } => {}
                Completion::Failed { error, .. } => return Err(StreamError::PeerFailed(error)),
            }
        }
        Ok(any)
    }

    /// Drives the endpoint (waiting up to `wait`) without delivering anything: under manual
    /// progress (tcp) the daemon's connection and writes advance only while the client is inside
    /// libfabric, so a client between batches must keep calling this.
    pub fn progress(&mut self, wait: Duration) -> StreamResult<bool> {
        self.return_lent()?;
        let any = self.pump(Some(wait))?;
        self.return_lent()?;
        Ok(any)
    }

    /// Sends the credits of dropped [`Lent`] views.
    fn return_lent(&mut self) -> StreamResult<()> {
        let back = std::mem::take(&mut *self.returned.lock().unwrap_or_else(PoisonError::into_inner));
        for (slot, batch) in back {
            self.release(slot, batch)?;
        }
        Ok(())
    }

    /// Slots lent out and not yet returned (their views are alive), plus those queued to return.
    pub fn lent_pending(&self) -> usize {
        self.returned.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// `ready`'s first `len` bytes, in place: the slot is returned to the daemon when the view is
    /// dropped (and this receiver is next called), never before.
    pub fn lend(&self, ready: Ready<M>, len: usize) -> StreamResult<Lent> {
        let offset = ready.slot as usize * self.slot_bytes;
        let len = len.min(self.slot_bytes);
        // Only the range check: the view reads later, under Lent's own contract.
        // SAFETY: the slice is dropped at once, and the slot is held (delivered, not released).
        unsafe { self.ring.slice(offset, len) }?;
        Ok(Lent {
            ring: self.ring.clone(),
            offset,
            len,
            slot: ready.slot,
            batch: ready.batch,
            returned: self.returned.clone(),
            cq: self.ep.cq().clone(),
        })
    }

    /// The bytes of a batch this receiver delivered and still holds.
    pub fn bytes(&self, ready: &Ready<M>, len: usize) -> StreamResult<&[u8]> {
        let len = len.min(self.slot_bytes);
        // SAFETY: `ready` was delivered by `next` and not yet released (release takes the slot
        // out of the held set, and a held slot is never a write target under the credit
        // protocol: the daemon only writes slots it has a credit for, and this slot's credit is
        // returned only by `release`). A daemon breaking the protocol could race this read; the
        // daemon is the trusted node service and the key covers only this ring.
        Ok(unsafe { self.ring.slice(ready.slot as usize * self.slot_bytes, len) }?)
    }

    /// Hands `slot` (holding `batch`) back to the daemon.
    pub fn release(&mut self, slot: u32, batch: u64) -> StreamResult<()> {
        if !self.arrivals.release(slot) {
            return Ok(());
        }
        self.send_ctl(slot, batch)
    }

    /// Tells the daemon this client has every batch of the stream: it sends nothing after
    /// (credits of batches still held are only booked locally), and the daemon may close its
    /// endpoint at once instead of waiting for them.
    pub fn finish(&mut self) -> StreamResult<()> {
        self.send_ctl(FINISHED_SLOT, u64::MAX)?;
        self.daemon = None;
        Ok(())
    }

    fn send_ctl(&mut self, slot: u32, batch: u64) -> StreamResult<()> {
        let Some(daemon) = self.daemon else { return Ok(()) };
        let gone = |a: &std::sync::atomic::AtomicBool| a.load(std::sync::atomic::Ordering::Relaxed);
        // A daemon that died leaves sends that never complete and a provider that keeps saying
        // EAGAIN: without a deadline this loop would spin for ever instead of failing the stream.
        let deadline = Instant::now() + RELEASE_WAIT;
        let op = loop {
            if gone(&self.abandoned) {
                return Ok(());
            }
            if let Some(i) = self.sends_busy.iter().position(|b| !*b) {
                break i;
            }
            if Instant::now() >= deadline {
                return Err(StreamError::CreditNotSent(RELEASE_WAIT));
            }
            self.pump(Some(Duration::from_millis(100)))?;
        };
        // SAFETY: send buffer `op` is not in flight (sends_busy[op] false: its last send
        // completed), and no receive targets the send half of `msgs`.
        let buf = unsafe { self.msgs.slice_mut(op * RELEASE_BYTES, RELEASE_BYTES) }?;
        buf[..4].copy_from_slice(&slot.to_le_bytes());
        buf[4..8].fill(0);
        buf[8..16].copy_from_slice(&batch.to_le_bytes());
        while !self.ep.send(op, &self.msgs, op * RELEASE_BYTES, RELEASE_BYTES, daemon)? {
            if gone(&self.abandoned) {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(StreamError::CreditNotSent(RELEASE_WAIT));
            }
            self.pump(Some(Duration::from_millis(10)))?;
        }
        self.sends_busy[op] = true;
        Ok(())
    }

    /// The flag that, once set, makes this receiver drop credits instead of sending them (the
    /// stream is gone on this side); shared so that it can be set without the receiver's lock,
    /// which a thread returning a credit may hold for as long as [`RELEASE_WAIT`].
    pub fn abandoned(&self) -> Arc<std::sync::atomic::AtomicBool> {
        self.abandoned.clone()
    }

    /// Slots delivered and not released yet (their views live, or their credits are queued).
    pub fn held(&self) -> usize {
        self.arrivals.held()
    }

    /// Slots of the ring: the stream's credits.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The completion queue, whose [`crate::CompletionQueue::signal`] wakes a thread blocked in
    /// [`Self::progress`] or [`Self::next`].
    pub fn waker(&self) -> Arc<crate::CompletionQueue> {
        self.ep.cq().clone()
    }

    pub fn provider(&self) -> &str {
        self.ep.fabric().provider()
    }

    pub fn ring_bytes(&self) -> usize {
        self.ring.len()
    }
}

/// What a staging buffer is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Free,
    /// Lent out as a [`Staged`] being filled.
    Filling,
    /// Its write into the ring slot is posted, the local completion not yet seen.
    Writing(u32),
}

/// A staging buffer and a ring slot taken for one batch ([`RingSender::reserve`]). The caller
/// fills [`Self::buffer`] without holding the sender (so the progress thread keeps other writes
/// moving meanwhile), then posts it ([`RingSender::post`]) or gives both back
/// ([`RingSender::cancel`]). Dropping it instead keeps the buffer and the credit from the stream
/// until the sender is dropped: only a stream that is failing anyway may do that.
#[must_use = "post or cancel a staged batch, or its buffer and credit stay taken"]
pub struct Staged {
    staging: Arc<MemoryRegion>,
    stage: usize,
    slot_bytes: usize,
    slot: u32,
    batch: u64,
}

impl Staged {
    /// The staging buffer, one ring slot long: the batch's bytes go at its start.
    pub fn buffer(&mut self) -> &mut [u8] {
        // SAFETY: staging buffer `stage` is `Stage::Filling` from `reserve` until `post` or
        // `cancel` consumes this value: the sender lends it to no one else and posts no operation
        // on it meanwhile (it was `Free`, so no write from it was in flight either), and the
        // `&mut self` borrow keeps this the only slice of it. The Arc keeps it mapped.
        unsafe { self.staging.slice_mut(self.stage * self.slot_bytes, self.slot_bytes) }.unwrap_or_default()
    }

    /// The ring slot the batch will be written into (what its metadata must name).
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

/// The daemon side of one stream.
pub struct RingSender {
    ep: Endpoint,
    /// `window` staging buffers of `slot_bytes`; staging buffer i is write context i.
    staging: Arc<MemoryRegion>,
    staging_slot: Vec<Stage>,
    /// RELEASE receive buffers, context `window + i`.
    releases: Arc<MemoryRegion>,
    client: PeerAddr,
    remote: RemoteRegion,
    slot_bytes: usize,
    tx: SenderSlots,
    imm: Immediate,
    /// How long to wait for a credit before declaring the client stalled.
    pub stall: Duration,
    peak_in_use: usize,
    /// The client sent FINISHED: it has every batch and sends nothing more.
    finished: bool,
    /// Completions read while a receive waited for room in the queue, handled by the next pump.
    backlog: Vec<Completion>,
    /// When the first write was attempted, and whether anything has completed since: until
    /// something does, the client's endpoint may be unreachable ([`FIRST_COMPLETION_WAIT`]).
    /// Counted from the first write, not the open: building the first batch may take long (a
    /// cold shard download), and nothing can complete before a write is posted.
    first_post: Option<Instant>,
    reached: bool,
    /// The client's endpoint, for the error when it is never reached.
    client_name: String,
}

impl RingSender {
    /// Accepts a client's offer, with `window` writes in flight at most.
    pub fn new(ep: Endpoint, offer: &Offer, window: usize) -> StreamResult<Self> {
        let slot_bytes = usize::try_from(offer.slot_bytes).unwrap_or(usize::MAX);
        let imm = Immediate::for_slots(offer.slots).ok_or(ProtocolError::NoSuchSlot {
            imm: 0,
            slot: offer.slots,
            slots: offer.slots,
        })?;
        let need = u64::from(offer.slots).checked_mul(offer.slot_bytes);
        if need.is_none_or(|n| n > offer.ring.len) {
            return Err(StreamError::TooLarge { len: usize::MAX, slot_bytes });
        }
        let window = window.max(1);
        let client = ep.insert_peer(&offer.name)?;
        let staging = MemoryRegion::new(&ep, window * slot_bytes, ffi::FI_WRITE)?;
        let release_posts = offer.slots as usize + 4;
        let releases = MemoryRegion::new(&ep, release_posts * RELEASE_BYTES, ffi::FI_RECV)?;
        let mut me = Self {
            ep,
            staging,
            staging_slot: vec![Stage::Free; window],
            releases,
            client,
            remote: offer.ring,
            slot_bytes,
            tx: SenderSlots::new(offer.slots),
            imm,
            stall: Duration::from_secs(30),
            peak_in_use: 0,
            finished: false,
            backlog: Vec::new(),
            first_post: None,
            reached: false,
            client_name: describe_name(&offer.name),
        };
        for i in 0..release_posts {
            me.post_release(i)?;
        }
        Ok(me)
    }

    fn window(&self) -> usize {
        self.staging_slot.len()
    }

    fn post_release(&mut self, i: usize) -> crate::Result<()> {
        let op = self.window() + i;
        let Self { ep, releases, backlog, .. } = self;
        post_until_queued(ep, || ep.recv(op, releases, i * RELEASE_BYTES, RELEASE_BYTES), backlog)
    }

    pub fn name(&self) -> crate::Result<Vec<u8>> {
        self.ep.name()
    }

    /// Handles completions (waiting up to `wait` for the first); true if any came.
    fn pump(&mut self, wait: Option<Duration>) -> StreamResult<bool> {
        let done = take_completions(&self.ep, &mut self.backlog, wait)?;
        let any = !done.is_empty();
        // A failed completion is returned below as the error; any other shows the client's
        // endpoint was reached.
        self.reached |= done.iter().any(|c| !matches!(c, Completion::Failed { .. }));
        for c in done {
            match c {
                Completion::Written { op } => {
                    if let Some(slot) = self.finish_write(Some(op)) {
                        self.tx.written(slot);
                    }
                }
                Completion::Received { op, len } => {
                    let i = op - self.window();
                    if len != RELEASE_BYTES {
                        return Err(StreamError::BadRelease(len));
                    }
                    // SAFETY: receive `i` just completed and is reposted only below, after the
                    // copy: nothing writes this range meanwhile.
                    let msg = unsafe { self.releases.slice(i * RELEASE_BYTES, RELEASE_BYTES) }?;
                    let mut s = [0u8; 4];
                    s.copy_from_slice(&msg[..4]);
                    let mut b = [0u8; 8];
                    b.copy_from_slice(&msg[8..16]);
                    let (slot, batch) = (u32::from_le_bytes(s), u64::from_le_bytes(b));
                    if slot == FINISHED_SLOT && batch == u64::MAX {
                        self.finished = true;
                    } else {
                        // A release for the wrong batch is ignored by the state machine.
                        self.tx.release(slot, batch);
                    }
                    self.post_release(i)?;
                }
                Completion::Failed { op, error } => {
                    if let Some(slot) = self.finish_write(op) {
                        self.tx.failed(slot);
                    }
                    return Err(StreamError::PeerFailed(error));
                }
                Completion::Sent { .. } | Completion::RemoteWrite { .. } => {}
            }
        }
        Ok(any)
    }

    /// The slot of the write posted from staging buffer `op`, which is free again; None if no
    /// write was in flight there (a completion for a reserved or free buffer changes nothing).
    fn finish_write(&mut self, op: Option<usize>) -> Option<u32> {
        let stage = self.staging_slot.get_mut(op?)?;
        let Stage::Writing(slot) = *stage else { return None };
        *stage = Stage::Free;
        Some(slot)
    }

    /// Waits for a free staging buffer and a credit for `batch`, and lends the buffer out: fill
    /// it, then [`Self::post`] it. What [`Self::send`] does in one call, for a caller that fills
    /// the buffer without holding this sender.
    pub fn reserve(&mut self, batch: u64) -> StreamResult<Staged> {
        let (started, stall) = (Instant::now(), self.stall);
        self.reserve_while(batch, &|| started.elapsed() < stall).map_err(|e| match e {
            StreamError::Stopped => StreamError::Stalled(stall),
            e => e,
        })
    }

    /// As [`Self::reserve`], waiting for as long as `waiting` says (asked between progress
    /// drives, at least every 200 ms), not for the stall time: for a caller that knows its peer
    /// is still there (its gRPC stream is open) while it holds every credit, as a trainer does
    /// through an evaluation or a checkpoint. [`StreamError::Stopped`] once `waiting` says no.
    pub fn reserve_while(&mut self, batch: u64, waiting: &dyn Fn() -> bool) -> StreamResult<Staged> {
        let (stage, slot) = loop {
            if let Some(stage) = self.staging_slot.iter().position(|s| *s == Stage::Free)
                && let Some(slot) = self.tx.acquire(batch)
            {
                break (stage, slot);
            }
            if !waiting() {
                return Err(StreamError::Stopped);
            }
            self.check_reached()?;
            self.pump(Some(Duration::from_millis(200)))?;
        };
        self.peak_in_use = self.peak_in_use.max(self.tx.in_use());
        self.staging_slot[stage] = Stage::Filling;
        Ok(Staged { staging: self.staging.clone(), stage, slot_bytes: self.slot_bytes, slot, batch })
    }

    /// Gives a reserved buffer and its credit back, unwritten (the batch failed to build).
    pub fn cancel(&mut self, staged: Staged) {
        if self.owns(&staged) {
            self.staging_slot[staged.stage] = Stage::Free;
            self.tx.failed(staged.slot);
        }
    }

    /// [`StreamError::Unreachable`] once nothing has completed for [`FIRST_COMPLETION_WAIT`]
    /// since the first write was attempted: checked where the sender waits for the provider.
    fn check_reached(&self) -> StreamResult<()> {
        match self.first_post.map(|t| t.elapsed()) {
            Some(waited) if !self.reached && waited >= FIRST_COMPLETION_WAIT => {
                Err(StreamError::Unreachable { address: self.client_name.clone(), waited })
            }
            _ => Ok(()),
        }
    }

    fn owns(&self, staged: &Staged) -> bool {
        Arc::ptr_eq(&staged.staging, &self.staging) && self.staging_slot.get(staged.stage) == Some(&Stage::Filling)
    }

    /// Posts the write of the first `len` bytes of a filled buffer into its ring slot. Returns
    /// the slot, which the metadata of the batch must name. A provider queue that stays full for
    /// the stall time is [`StreamError::Stalled`].
    pub fn post(&mut self, staged: Staged, len: usize) -> StreamResult<u32> {
        let (started, stall) = (Instant::now(), self.stall);
        self.post_while(staged, len, &|| started.elapsed() < stall).map_err(|e| match e {
            StreamError::Stopped => StreamError::Stalled(stall),
            e => e,
        })
    }

    /// As [`Self::post`], waiting for room in the provider's queue for as long as `waiting` says
    /// (asked between progress drives, every millisecond). Under manual progress (tcp) a client
    /// that does not call into libfabric (a trainer evaluating, holding its batches) leaves the
    /// queue full, and so does a client that left: the caller knows which from its gRPC stream.
    /// [`StreamError::Stopped`] once `waiting` says no; the buffer and the credit are given back.
    pub fn post_while(&mut self, staged: Staged, len: usize, waiting: &dyn Fn() -> bool) -> StreamResult<u32> {
        if !self.owns(&staged) {
            return Err(StreamError::NotStaged);
        }
        let (stage, slot, batch) = (staged.stage, staged.slot, staged.batch);
        if len > self.slot_bytes {
            self.cancel(staged);
            return Err(StreamError::TooLarge { len, slot_bytes: self.slot_bytes });
        }
        drop(staged);
        let fail = |me: &mut Self| {
            me.staging_slot[stage] = Stage::Free;
            me.tx.failed(slot);
        };
        self.first_post.get_or_insert_with(Instant::now);
        let data = u64::from(self.imm.encode(batch, slot));
        let remote_offset = u64::from(slot) * self.slot_bytes as u64;
        loop {
            match self.ep.write_data(
                stage,
                &self.staging,
                stage * self.slot_bytes,
                len,
                data,
                self.client,
                self.remote,
                remote_offset,
            ) {
                Ok(true) => break,
                // The provider's queue is full. Under manual progress (tcp) that is also what a
                // client that stopped driving its endpoint looks like.
                Ok(false) => {
                    if !waiting() {
                        fail(self);
                        return Err(StreamError::Stopped);
                    }
                    if let Err(e) = self.check_reached() {
                        fail(self);
                        return Err(e);
                    }
                    if let Err(e) = self.pump(Some(Duration::from_millis(1))) {
                        fail(self);
                        return Err(e);
                    }
                }
                Err(e) => {
                    fail(self);
                    return Err(e.into());
                }
            }
        }
        self.staging_slot[stage] = Stage::Writing(slot);
        Ok(slot)
    }

    /// Waits for a free staging buffer and a credit, lets `fill` write the batch into the
    /// staging buffer (returning its length), and posts the write. Returns the ring slot, which
    /// the metadata for `batch` must name.
    pub fn send(&mut self, batch: u64, fill: impl FnOnce(&mut [u8]) -> usize) -> StreamResult<u32> {
        let mut staged = self.reserve(batch)?;
        let len = fill(staged.buffer());
        self.post(staged, len)
    }

    /// Drives the endpoint (waiting up to `wait`) between batches: under manual progress (tcp)
    /// posted writes advance and credits come back only while this side is inside libfabric.
    pub fn progress(&mut self, wait: Duration) -> StreamResult<bool> {
        self.pump(Some(wait))
    }

    /// The completion queue, whose [`crate::CompletionQueue::signal`] wakes a thread blocked in
    /// [`Self::progress`] (one that wants the sender next).
    pub fn waker(&self) -> Arc<crate::CompletionQueue> {
        self.ep.cq().clone()
    }

    /// Writes posted and not yet complete locally.
    pub fn in_flight(&self) -> usize {
        self.staging_slot.iter().filter(|s| matches!(s, Stage::Writing(_))).count()
    }

    /// Waits until every posted write completed locally.
    pub fn flush(&mut self) -> StreamResult<()> {
        let started = Instant::now();
        while self.in_flight() > 0 {
            if started.elapsed() >= self.stall {
                return Err(StreamError::Stalled(self.stall));
            }
            self.pump(Some(Duration::from_millis(200)))?;
        }
        Ok(())
    }

    /// Waits until the client returned every credit or said it has every batch (FINISHED): the
    /// end of a stream, after which the endpoint may close without resetting the connection
    /// under a write the client has not read.
    pub fn drain(&mut self) -> StreamResult<()> {
        self.drain_while(&|| true)
    }

    /// As [`Self::drain`], and [`StreamError::Stopped`] as soon as `waiting` says no (asked
    /// between progress drives, at least every 200 ms): a daemon shutting down does not wait.
    pub fn drain_while(&mut self, waiting: &dyn Fn() -> bool) -> StreamResult<()> {
        self.flush()?;
        let started = Instant::now();
        while self.tx.in_use() > 0 && !self.finished {
            if started.elapsed() >= self.stall {
                return Err(StreamError::Stalled(self.stall));
            }
            if !waiting() {
                return Err(StreamError::Stopped);
            }
            self.pump(Some(Duration::from_millis(200)))?;
        }
        Ok(())
    }

    pub fn credits_in_use(&self) -> usize {
        self.tx.in_use()
    }

    /// Most credits in use at once so far.
    pub fn peak_in_use(&self) -> usize {
        self.peak_in_use
    }

    pub fn provider(&self) -> &str {
        self.ep.fabric().provider()
    }
}

/// How long posting a receive may find the provider's queue full before it is an error.
const POST_WAIT: Duration = Duration::from_secs(1);

/// Posts with `post` (false: the queue is full), driving progress between tries, for at most
/// [`POST_WAIT`]. The first receives are posted before the stream's first write, when a queue
/// still full never empties (more receives than its depth): retrying for good spun a thread at a
/// core. A repost follows the completion that freed its place in the queue, so it usually finds
/// room at once; the completions a drive reads while it waits (a batch's arrival, a credit) go
/// to `backlog`, for the stream's next pump, never dropped.
fn post_until_queued(
    ep: &Endpoint,
    mut post: impl FnMut() -> crate::Result<bool>,
    backlog: &mut Vec<Completion>,
) -> crate::Result<()> {
    let deadline = Instant::now() + POST_WAIT;
    while !post()? {
        if Instant::now() >= deadline {
            return Err(crate::Error::Call {
                call: "fi_recv",
                code: libc::EAGAIN,
                msg: "the provider's receive queue stays full (more receives posted than it holds)".into(),
            });
        }
        backlog.extend(ep.poll(None)?);
    }
    Ok(())
}

/// The completions a pump handles: those left in `backlog`, then what the queue has (waiting up
/// to `wait` for one only when there were none left).
fn take_completions(
    ep: &Endpoint,
    backlog: &mut Vec<Completion>,
    wait: Option<Duration>,
) -> crate::Result<Vec<Completion>> {
    let mut done = std::mem::take(backlog);
    done.extend(ep.poll(if done.is_empty() { wait } else { None })?);
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreachable_endpoint_is_named_by_its_socket_address() {
        // sockaddr_in: AF_INET, port 8080, 10.0.0.7.
        let mut name = vec![2, 0, 0x1f, 0x90, 10, 0, 0, 7];
        name.extend_from_slice(&[0; 8]);
        assert_eq!(describe_name(&name), "10.0.0.7:8080");
        assert_eq!(describe_name(b"fi_shm://1"), "a 10-byte provider address");
    }
}
