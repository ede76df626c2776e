//! The rdma transport, client side: the ring this process registers for one stream, the offer
//! that goes into the request, and the join of each `RdmaBatch` (gRPC) with the RDMA write of its
//! bytes, turned into an ordinary inline batch for the layers above (an `ArrowBatch` naming a
//! slot likewise becomes an inline Arrow batch).
//!
//! The ring is created when the stream starts, in the process that iterates it: a DataLoader
//! worker creates its own after fork, never inheriting one. The receiver blocks in libfabric
//! (`fi_cq_sread`), so every call runs on tokio's blocking pool.

use std::mem::ManuallyDrop;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use shardstream_fabric::handoff::Progressed;
use shardstream_fabric::stream::{MAX_SLOT_BYTES, RingReceiver, open_endpoint_toward};
use shardstream_proto::{ArrowBatch, InlineBatch, RdmaBatch, RdmaOffer};

use crate::ClientError;

/// Ring slots per stream (credits): the client's read-ahead plus the batch in use.
pub const RDMA_SLOTS: u32 = 4;
/// Bytes per slot unless SHARDSTREAM_RDMA_SLOT_BYTES says otherwise: a slot holds one batch.
pub const DEFAULT_SLOT_BYTES: u64 = 32 << 20;
/// The least SHARDSTREAM_RDMA_SLOT_BYTES taken.
pub const MIN_SLOT_BYTES: u64 = 64 << 10;
/// How long a batch's bytes may lag its metadata before the stream fails.
const ARRIVAL_TIMEOUT: Duration = Duration::from_secs(60);

fn err(e: impl std::fmt::Display) -> ClientError {
    ClientError::Rdma(e.to_string())
}

/// An endpoint that cannot be opened: no route to the daemon's host is the network's state (a
/// link down, a route not there yet), as a TCP connect that cannot be made is: a lost
/// connection, which reconnect logic waits out; the rest are rdma errors.
fn open_err(e: shardstream_fabric::Error) -> ClientError {
    match e {
        e @ shardstream_fabric::Error::NoRoute { .. } => ClientError::Disconnected(format!("rdma transport: {e}")),
        e => err(e),
    }
}

/// The daemon's end failing (killed, connection reset) is a lost connection, like gRPC's: the
/// same stream may be resumed against a restarted daemon. Everything else is an rdma error.
fn stream_err(e: shardstream_fabric::stream::StreamError) -> ClientError {
    use shardstream_fabric::stream::StreamError;
    match e {
        StreamError::PeerFailed(_) | StreamError::Stalled(_) | StreamError::CreditNotSent(_) => {
            ClientError::Disconnected(format!("rdma: {e}"))
        }
        e => err(e),
    }
}

/// A batch's bytes in place in the ring, as the owner of the batch's `Bytes`. It keeps the ring
/// (endpoint and progress thread) alive, so the slot's credit can still be returned when the
/// last view goes, even after the stream itself has ended.
struct SlotView {
    lent: Option<shardstream_fabric::stream::Lent>,
    ring: Arc<RdmaRing>,
}

impl AsRef<[u8]> for SlotView {
    fn as_ref(&self) -> &[u8] {
        self.lent.as_ref().map_or(&[], |l| l.as_slice())
    }
}

impl Drop for SlotView {
    fn drop(&mut self) {
        // Queues the credit and wakes whoever is in libfabric for this ring.
        drop(self.lent.take());
        // The last holder of the ring sends the credit itself: with the ring gone nobody would.
        if Arc::strong_count(&self.ring) == 1 {
            let _ = self.ring.lock().progress(Duration::ZERO);
        }
    }
}

/// Loads libfabric and initialises its providers in this process (see
/// [`shardstream_fabric::warm_up`]): called where a trainer is about to fork DataLoader workers
/// that will each open an rdma stream, so they inherit the ~0.3 s start-up instead of paying it.
pub fn warm_up() -> Result<(), ClientError> {
    shardstream_fabric::warm_up().map_err(err)
}

/// One stream's registered ring.
pub struct RdmaRing {
    /// Taken by `Drop`, which hands it to a thread that quiesces it before it closes.
    rx: ManuallyDrop<Progressed<RingReceiver<()>>>,
    pub provider: String,
    /// What the progress thread met, for the next `receive` to report.
    failed: Mutex<Option<shardstream_fabric::stream::StreamError>>,
    /// Batches of this stream still to arrive (set from the header): FINISHED goes to the
    /// daemon when the last arrives.
    remaining: std::sync::atomic::AtomicU64,
    /// The stream was dropped (a loop left with `break`, or its end): a receive waiting for
    /// bytes that will not come gives up instead of holding the ring for [`ARRIVAL_TIMEOUT`], and
    /// the receiver drops the credits of batches let go of later instead of sending them (the
    /// flag is the receiver's, [`RingReceiver::abandoned`]).
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

/// Keeps the endpoint moving between batches (see [`RingReceiver::progress`]); ends with the
/// ring. It goes straight back into libfabric after each wait, and stands back while a caller
/// asks for the receiver ([`Progressed`]).
fn progress_loop(ring: std::sync::Weak<RdmaRing>) {
    while let Some(r) = ring.upgrade() {
        let Some(res) = r.rx.lock_for_progress().map(|mut rx| rx.progress(Duration::from_millis(20))) else {
            drop(r);
            std::thread::yield_now();
            continue;
        };
        if let Err(e) = res {
            *r.failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            return;
        }
    }
}

/// Held while an endpoint opens or closes: libfabric 1.17 crashed (SIGSEGV in `fi_close`) when
/// one stream's endpoint closed while the next stream's opened.
static ENDPOINT_LIFECYCLE: Mutex<()> = Mutex::new(());

/// How long a closing ring's endpoint is kept moving once nothing more arrives, and at most.
const QUIET_BEFORE_CLOSE: Duration = Duration::from_millis(300);
const CLOSE_DRAIN_MAX: Duration = Duration::from_secs(2);

impl Drop for RdmaRing {
    fn drop(&mut self) {
        // SAFETY: `rx` is taken once, here, and `self` is never used after `drop`.
        let rx = unsafe { ManuallyDrop::take(&mut self.rx) };
        // A stream left early (a `break`) closes while the daemon's writes may still be arriving:
        // closing the endpoint then crashed libfabric 1.17's tcp;ofi_rxm in about one run of two
        // (SIGSEGV inside fi_close). The endpoint is kept moving until nothing has arrived for a
        // while, on a thread of its own: the last holder may be the trainer's thread.
        // No credit is wanted any more.
        self.abandoned.store(true, Ordering::Relaxed);
        let quiesce = move || {
            let mut r = rx.lock();
            let (started, mut quiet) = (Instant::now(), Instant::now());
            // Errors too are waited out: the daemon's end closing is one, and what it had in
            // flight may still be arriving.
            while started.elapsed() < CLOSE_DRAIN_MAX && quiet.elapsed() < QUIET_BEFORE_CLOSE {
                if matches!(r.progress(Duration::from_millis(20)), Ok(true)) {
                    quiet = Instant::now();
                }
            }
            drop(r);
            let _alone = ENDPOINT_LIFECYCLE.lock().unwrap_or_else(PoisonError::into_inner);
            drop(rx);
        };
        // Handed over once the thread exists: a closure given to a spawn that fails is lost.
        let (tx, job) = std::sync::mpsc::channel::<Box<dyn FnOnce() + Send>>();
        let spawned = std::thread::Builder::new().name("shardstream-rdma-close".into()).spawn(move || {
            if let Ok(quiesce) = job.recv() {
                quiesce();
            }
        });
        match spawned {
            Ok(_) => {
                let _ = tx.send(Box::new(quiesce));
            }
            // No thread to be had: here, then.
            Err(_) => quiesce(),
        }
    }
}

impl RdmaRing {
    /// Opens an endpoint (`provider`, else the one SHARDSTREAM_FI_PROVIDER / FI_PROVIDER force,
    /// else libfabric's first that can) on the interface that routes to `daemon` when known, and
    /// registers the ring; returns it with the offer for the request.
    pub fn open(
        first_batch: u64,
        daemon: Option<std::net::IpAddr>,
        provider: Option<&str>,
    ) -> Result<(Arc<Self>, RdmaOffer), ClientError> {
        // A setting of this process: what cannot be used is a ValueError (ClientError::Credentials).
        let setting = |e: String| ClientError::Credentials(format!("SHARDSTREAM_RDMA_SLOT_BYTES: {e}"));
        let slot_bytes = std::env::var("SHARDSTREAM_RDMA_SLOT_BYTES")
            .ok()
            .map(|v| shardstream_proto::size::parse_size(&v).map_err(|e| setting(e.to_string())))
            .transpose()?
            .unwrap_or(DEFAULT_SLOT_BYTES);
        // Refused here, before a ring of 4 such slots is registered (a huge value overflowed the
        // ring's size and panicked): no daemon would stage slots past this anyway. Below the
        // least, a value was rounded up to a page without a word.
        if slot_bytes > MAX_SLOT_BYTES {
            return Err(ClientError::Credentials(format!(
                "SHARDSTREAM_RDMA_SLOT_BYTES={slot_bytes} is larger than a daemon stages ({MAX_SLOT_BYTES} bytes \
                 at most): set it to 1GiB or less"
            )));
        }
        if slot_bytes < MIN_SLOT_BYTES {
            return Err(ClientError::Credentials(format!(
                "SHARDSTREAM_RDMA_SLOT_BYTES={slot_bytes} is smaller than a ring slot may be ({MIN_SLOT_BYTES} bytes \
                 at least): a slot holds a whole batch"
            )));
        }
        let alone = ENDPOINT_LIFECYCLE.lock().unwrap_or_else(PoisonError::into_inner);
        let ep = open_endpoint_toward(provider, 64, daemon).map_err(open_err)?;
        let rx =
            RingReceiver::new(ep, RDMA_SLOTS, usize::try_from(slot_bytes).map_err(err)?, first_batch).map_err(err)?;
        drop(alone);
        let o = rx.offer().map_err(err)?;
        let wake = rx.waker();
        let abandoned = rx.abandoned();
        let offer = RdmaOffer {
            address: o.name,
            ring_base: o.ring.base,
            ring_key: o.ring.key,
            ring_bytes: o.ring.len,
            slots: o.slots,
            slot_bytes: o.slot_bytes,
            provider: o.provider.clone(),
            fabric_settings: shardstream_fabric::settings().into_iter().collect(),
        };
        let ring = Arc::new(Self {
            rx: ManuallyDrop::new(Progressed::new(rx, move || wake.signal())),
            provider: o.provider,
            failed: Mutex::new(None),
            remaining: std::sync::atomic::AtomicU64::new(u64::MAX),
            abandoned,
        });
        let weak = Arc::downgrade(&ring);
        std::thread::Builder::new()
            .name("shardstream-rdma-progress".into())
            .spawn(move || progress_loop(weak))
            .map_err(|e| err(format!("cannot start the progress thread: {e}")))?;
        Ok((ring, offer))
    }

    /// The receiver, taken ahead of the progress thread.
    fn lock(&self) -> std::sync::MutexGuard<'_, RingReceiver<()>> {
        self.rx.lock()
    }

    /// (slots held by batches of this process not released yet, slots of the ring).
    pub fn held(&self) -> (usize, u32) {
        let rx = self.lock();
        (rx.held(), rx.slots())
    }

    /// The stream is gone: receives waiting on it end.
    pub fn abandon(&self) {
        self.abandoned.store(true, Ordering::Relaxed);
    }

    /// The daemon's endpoint and the stream's batch count, from the stream header.
    pub fn connect(&self, daemon: &[u8], batches: u64) -> Result<(), ClientError> {
        self.remaining.store(batches, Ordering::Relaxed);
        self.lock().connect(daemon).map_err(err)
    }

    /// Waits for `b`'s bytes and returns the batch with its data read in place in the ring: the
    /// slot stays this client's until every view of the data is dropped (Python's memoryviews
    /// hold it, as shm leases hold theirs), and its credit goes back to the daemon then.
    pub fn receive(self: &Arc<Self>, b: RdmaBatch) -> Result<InlineBatch, ClientError> {
        let data = self.receive_bytes(b.batch_index, b.slot, b.data_bytes, 1)?;
        Ok(InlineBatch { batch_index: b.batch_index, keys: b.keys, fields: b.fields, data, more: false })
    }

    /// As [`Self::receive`] for an Arrow message (Parquet datasets) carrying `batches` batches of
    /// the stream (its parts, checked by the caller): its IPC stream, read in place in the ring
    /// slot the message names, becomes the message's `data`, as if it had come inline.
    pub fn receive_arrow(self: &Arc<Self>, mut b: ArrowBatch, batches: u64) -> Result<ArrowBatch, ClientError> {
        if !b.data.is_empty() || b.ring != 0 {
            return Err(ClientError::Protocol(format!(
                "rdma: Arrow batch {} names no slot of this client's ring",
                b.batch_index
            )));
        }
        b.data = self.receive_bytes(b.batch_index, b.slot, b.length, batches)?;
        Ok(b)
    }

    /// The `len` bytes of the message of batch `batch` (and the `batches - 1` after it that it
    /// carries), which the daemon says it wrote into `slot`, read in place: joined with the
    /// write's immediate, waiting for it as long as [`ARRIVAL_TIMEOUT`]. FINISHED goes to the
    /// daemon with the stream's last batch.
    fn receive_bytes(
        self: &Arc<Self>,
        batch: u64,
        slot: u32,
        len: u64,
        batches: u64,
    ) -> Result<bytes::Bytes, ClientError> {
        if let Some(e) = self.failed.lock().unwrap_or_else(PoisonError::into_inner).take() {
            return Err(stream_err(e));
        }
        let len = usize::try_from(len).map_err(err)?;
        let mut rx = self.lock();
        rx.on_meta(batch, slot, ()).map_err(err)?;
        let started = Instant::now();
        let ready = loop {
            if let Some(r) = rx.next(Duration::from_millis(200)).map_err(stream_err)? {
                break r;
            }
            if self.abandoned.load(Ordering::Relaxed) {
                return Err(ClientError::Disconnected(format!("rdma: the stream was closed before batch {batch}")));
            }
            if started.elapsed() > ARRIVAL_TIMEOUT {
                return Err(ClientError::Disconnected(format!(
                    "rdma: the bytes of batch {batch} never arrived ({ARRIVAL_TIMEOUT:?})"
                )));
            }
            // Let go of the lock between waits: a dropped batch's view returns its credit
            // through the progress thread, and the daemon may be waiting for exactly that one.
            drop(rx);
            rx = self.lock();
        };
        if ready.batch != batch {
            return Err(ClientError::Protocol(format!(
                "rdma: expected batch {batch}, the ring delivered {}",
                ready.batch
            )));
        }
        let lent = rx.lend(ready, len).map_err(err)?;
        let sub = |r: u64| Some(r.saturating_sub(batches));
        let left = self.remaining.fetch_update(Ordering::Relaxed, Ordering::Relaxed, sub).unwrap_or(0);
        if left > 0 && left <= batches {
            rx.finish().map_err(stream_err)?;
        }
        if lent.as_slice().len() != len {
            return Err(ClientError::Protocol(format!("rdma: batch {batch} of {len} bytes exceeds a slot")));
        }
        drop(rx);
        Ok(bytes::Bytes::from_owner(SlotView { lent: Some(lent), ring: self.clone() }))
    }
}

/// Whether `transport="auto"` would take rdma toward a daemon serving it over `provider` (its
/// status; empty when it does not serve rdma), by the name alone: a provider `auto` picks
/// ([`shardstream_fabric::auto_picks`] with this process's `SHARDSTREAM_RDMA_AUTO_PROVIDERS`),
/// and no other one forced on this side. Whether this host opens it, opening the ring finds out.
pub fn auto_picks(provider: &str) -> bool {
    let allowed = std::env::var(shardstream_fabric::AUTO_PROVIDERS_ENV).ok();
    let core = shardstream_fabric::core_provider(provider);
    shardstream_fabric::auto_picks(provider, allowed.as_deref())
        && shardstream_fabric::forced_provider().is_none_or(|f| shardstream_fabric::core_provider(&f) == core)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_route_to_the_daemon_is_a_lost_connection() {
        let no_route = shardstream_fabric::Error::NoRoute {
            peer: std::net::Ipv4Addr::new(10, 231, 9, 1).into(),
            source: std::io::Error::from_raw_os_error(libc::ENETUNREACH),
        };
        let e = open_err(no_route);
        assert!(matches!(e, ClientError::Disconnected(_)), "{e:?}");
        assert!(e.to_string().contains("no route from this host to 10.231.9.1"), "{e}");
        let other = open_err(shardstream_fabric::Error::Unavailable("gone".into()));
        assert!(matches!(other, ClientError::Rdma(_)), "{other:?}");
    }
}
