//! The rdma transport, daemon side: per stream, an RDM endpoint and a [`RingSender`] writing each
//! batch's bytes (laid out as an inline batch's `data`) into the ring the client registered, with
//! the batch's metadata sent as an `RdmaBatch` on the gRPC stream. The libfabric code and the
//! credit rules live in the `shardstream-fabric` crate; this module only negotiates.
//!
//! Writes are pipelined: a batch's write is posted and its metadata sent at once, up to
//! [`RDMA_WINDOW`] writes (and the client's credits) in flight, while the next batch is built. A
//! progress thread per stream ([`RdmaPipe`]) keeps the endpoint moving between batches, since
//! under manual progress (tcp) a posted write advances only while this side is inside libfabric.
//!
//! Enabled by `serve --rdma` (the daemon checks at start-up that libfabric loads and a provider
//! opens). A stream asking for rdma from a daemon without it, or with a provider the daemon cannot
//! open, is refused with the reason; never a silent fallback.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::Duration;

use shardstream_fabric::handoff::Progressed;
use shardstream_fabric::stream::{Offer, RingSender, open_endpoint_toward};
use shardstream_proto::RdmaOffer;

use super::budget::{BUDGET_WAIT, MemoryBudget, Pool, Reservation};
use crate::{Error, Result};

/// Writes one stream may have in flight.
pub const RDMA_WINDOW: usize = 4;
/// Largest ring slot a client may offer: the daemon stages [`RDMA_WINDOW`] batches of that size
/// in registered (pinned) memory per stream, 4 GiB at most, and all streams together within
/// `--rdma-budget` ([`RdmaHub::staging`]). A batch is one slot; larger batches
/// go over shared memory or inline, which splits them.
/// The fabric crate's, which clients check too.
pub const MAX_SLOT_BYTES: u64 = shardstream_fabric::stream::MAX_SLOT_BYTES;

/// The most ring slots a client may offer. The daemon posts a receive per slot (and a few more)
/// for the slots' releases, and a provider's receive queue is bounded (2,044 with tcp;ofi_rxm,
/// less on some NICs); the client uses 4 (its read-ahead and the batch in use).
pub const MAX_SLOTS: u32 = 256;
/// libfabric's `sockets` provider: the daemon's receives for the client's releases never complete
/// over it (libfabric 1.17), so a stream deadlocks once its first [`RDMA_WINDOW`] writes are out.
const UNSUPPORTED_PROVIDER: &str = "sockets";
/// How long the progress thread waits in libfabric at a time; a sender that wants the stream
/// wakes it sooner ([`shardstream_fabric::CompletionQueue::signal`]).
const PROGRESS_WAIT: Duration = Duration::from_millis(20);

/// The daemon's rdma settings and counters.
#[derive(Debug)]
pub struct RdmaHub {
    /// The provider asked for at start (`--rdma-provider`, SHARDSTREAM_FI_PROVIDER or
    /// FI_PROVIDER); None: libfabric's first, and streams open [`Self::opened`].
    provider: Option<String>,
    /// The provider the start-up check opened.
    pub opened: String,
    pub streams: AtomicU64,
    pub ring_bytes: AtomicU64,
    /// Every stream's staging buffers (`--rdma-budget`).
    pub staging: Arc<MemoryBudget>,
}

impl RdmaHub {
    /// Checks that libfabric loads and `provider` (or the default) opens: `serve --rdma` fails
    /// at start-up otherwise, with the reason. Streams' staging buffers together stay within
    /// `staging_budget` bytes.
    pub fn start(provider: Option<String>, staging_budget: u64) -> Result<Self> {
        let provider = provider.or_else(shardstream_fabric::forced_provider);
        let fabric = shardstream_fabric::Fabric::open(provider.as_deref())
            .map_err(|e| Error::invalid(format!("--rdma: {e}")))?;
        if shardstream_fabric::core_provider(fabric.provider()) == UNSUPPORTED_PROVIDER {
            return Err(Error::invalid(format!(
                "--rdma: provider {:?} is not supported: the client's credits (its slot releases) never \
                 arrive over it, so every stream stalls after {RDMA_WINDOW} batches; use tcp, verbs or efa",
                fabric.provider()
            )));
        }
        Ok(Self {
            provider,
            opened: fabric.provider().to_owned(),
            streams: AtomicU64::new(0),
            ring_bytes: AtomicU64::new(0),
            staging: MemoryBudget::new(Pool::RdmaStaging, staging_budget),
        })
    }

    /// Opens this stream's endpoint and sender for the client's offer (blocking: a few
    /// libfabric calls and one registration of the staging buffers, after their bytes are
    /// reserved in the budget, which may wait up to [`BUDGET_WAIT`] for other streams to end, or
    /// until `cancelled` (the client left, the daemon is stopping).
    pub fn open_stream(self: &Arc<Self>, offer: &RdmaOffer, cancelled: &dyn Fn() -> bool) -> Result<RdmaStream> {
        check_offer(offer)?;
        // Only the provider the start-up check opened (the one status reports), whatever the
        // client names: a daemon that opened the client's choice served providers it had never
        // checked, `sockets` among them, whose streams deadlock.
        if !same_provider(&self.opened, &offer.provider) {
            return Err(Error::invalid(format!(
                "transport \"rdma\": no common provider: the client opened {:?}, this daemon uses {:?} \
                 (set SHARDSTREAM_FI_PROVIDER on the client)",
                offer.provider, self.opened
            )));
        }
        let provider = self.provider.clone().unwrap_or_else(|| self.opened.clone());
        // rxm (under tcp and verbs) stalls every write when the two ends' settings differ:
        // refuse now, by name, instead of a stream that times out.
        if offer.provider.contains("rxm") {
            let peer = offer.fabric_settings.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            if let Some(why) = shardstream_fabric::settings_mismatch(&peer, &shardstream_fabric::settings()) {
                return Err(Error::invalid(format!("transport \"rdma\": {why}")));
            }
        }
        let o = Offer {
            name: offer.address.clone(),
            ring: shardstream_fabric::RemoteRegion {
                base: offer.ring_base,
                key: offer.ring_key,
                len: offer.ring_bytes,
            },
            slots: offer.slots,
            slot_bytes: offer.slot_bytes,
            provider: provider.clone(),
        };
        // On the interface that routes to the client (its endpoint name is its socket address for
        // tcp): an endpoint on another interface, the loopback first of all, would be unreachable.
        // Reserved before anything is opened, and held until the sender (its registration) is
        // gone: `RdmaStream` drops the sender first.
        let staged_bytes = (RDMA_WINDOW as u64).saturating_mul(offer.slot_bytes);
        let reservation = self
            .staging
            .reserve(staged_bytes, BUDGET_WAIT, cancelled, &|| false)
            .inspect_err(|e| {
                if matches!(e, Error::Unavailable(_) | Error::ClientGone(_)) {
                    tracing::info!(
                        bytes = staged_bytes,
                        "rdma stream given up while it waited for staging room: its client left or the daemon is stopping"
                    );
                }
            })?
            .ok_or_else(|| Error::Internal("an rdma staging reservation came back empty".into()))?;
        let toward = shardstream_fabric::objects::name_ip(&offer.address);
        let ep = open_endpoint_toward(Some(&provider), RDMA_WINDOW + offer.slots as usize + 4, toward)
            .map_err(|e| Error::invalid(format!("transport \"rdma\": {e}")))?;
        let sender =
            RingSender::new(ep, &o, RDMA_WINDOW).map_err(|e| Error::invalid(format!("transport \"rdma\": {e}")))?;
        let address = sender.name().map_err(|e| Error::Internal(format!("rdma endpoint address: {e}")))?;
        let provider = sender.provider().to_owned();
        self.streams.fetch_add(1, Ordering::Relaxed);
        let written = written_bytes(offer);
        self.ring_bytes.fetch_add(written, Ordering::Relaxed);
        Ok(RdmaStream {
            sender,
            _trim: TrimAfterEndpoint,
            hub: self.clone(),
            address,
            provider,
            ring_bytes: written,
            _staging: reservation,
        })
    }
}

/// Where a stream's gRPC request came from, for [`check_offer_peer`].
#[derive(Debug, Clone, Copy)]
pub enum RequestPeer {
    /// A TCP (or TLS) client at this address.
    Ip(std::net::IpAddr),
    /// A client on the Unix socket: on this host.
    ThisHost,
    /// Neither is known.
    Unknown,
}

/// Refuses an offer whose endpoint is not the requesting client's own: the daemon connects to the
/// address in `rdma_offer.address` and writes to it, so an authenticated client could otherwise
/// make it open connections to any host and port it names. For socket-address providers (tcp,
/// verbs over IP, ...) the address's IP must be the gRPC peer's; a Unix-socket client is on this
/// host, so its endpoint must be on one of this host's addresses. Provider-specific names (no IP
/// in them: shm, efa) cannot point past the provider's own fabric and are left to it.
/// The error is the message of the PermissionDenied status the request gets.
pub fn check_offer_peer(offer: &RdmaOffer, peer: RequestPeer) -> std::result::Result<(), String> {
    let Some(ip) = shardstream_fabric::objects::name_ip(&offer.address) else {
        return Ok(());
    };
    let (ok, expected) = match peer {
        RequestPeer::Ip(p) => (same_ip(p, ip), p.to_string()),
        // Binding succeeds only to an address of this host (EADDRNOTAVAIL otherwise): the client
        // opened its endpoint on whichever of them libfabric picked, the loopback or another.
        RequestPeer::ThisHost => (
            ip.is_loopback() || std::net::UdpSocket::bind((ip, 0)).is_ok(),
            "an address of this host (the client is on its Unix socket)".to_owned(),
        ),
        RequestPeer::Unknown => (false, "unknown (no peer address for the request)".to_owned()),
    };
    if ok {
        return Ok(());
    }
    Err(format!(
        "transport \"rdma\": the client's rdma endpoint address {ip} is not the client's own (its gRPC peer \
         address is {expected}): the daemon connects only to the endpoint of the client that asks"
    ))
}

/// Equal IPs, an IPv4 address and its IPv6-mapped form alike (a dual-stack listener reports the
/// peer as ::ffff:a.b.c.d).
fn same_ip(a: std::net::IpAddr, b: std::net::IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

/// Refuses an offer the daemon cannot or will not serve before anything is opened or registered
/// for it: the client chooses these sizes, and the daemon's staging memory follows them.
fn check_offer(offer: &RdmaOffer) -> Result<()> {
    if offer.slots == 0 || offer.slot_bytes == 0 || offer.address.is_empty() {
        return Err(Error::invalid("transport \"rdma\": the request carries no usable rdma_offer"));
    }
    if offer.slots > MAX_SLOTS {
        return Err(Error::invalid(format!(
            "transport \"rdma\": the client's ring has {} slots, more than the daemon takes ({MAX_SLOTS}: a \
             receive is posted per slot)",
            offer.slots
        )));
    }
    // A write's immediate data names its slot: the fabric crate says how many it can.
    if shardstream_fabric::credits::Immediate::for_slots(offer.slots).is_none() {
        return Err(Error::invalid(format!(
            "transport \"rdma\": the client's ring has {} slots, more than a write can name",
            offer.slots
        )));
    }
    if offer.slot_bytes > MAX_SLOT_BYTES {
        return Err(Error::invalid(format!(
            "transport \"rdma\": the client's ring slots of {} bytes are larger than the daemon stages ({MAX_SLOT_BYTES} \
             bytes at most; SHARDSTREAM_RDMA_SLOT_BYTES); use smaller batches, or transport=\"shm\" on the same host",
            offer.slot_bytes
        )));
    }
    if offer.ring_bytes < u64::from(offer.slots).saturating_mul(offer.slot_bytes) {
        return Err(Error::invalid(format!(
            "transport \"rdma\": the client's ring of {} bytes cannot hold {} slots of {} bytes",
            offer.ring_bytes, offer.slots, offer.slot_bytes
        )));
    }
    Ok(())
}

/// The bytes of a client's ring a stream writes into (status `rdma_ring_bytes`): its slots. The
/// client's word for its whole ring is bounded only from below ([`check_offer`]), and summed
/// unbounded it could wrap the figure.
fn written_bytes(offer: &RdmaOffer) -> u64 {
    offer.ring_bytes.min(u64::from(offer.slots).saturating_mul(offer.slot_bytes))
}

/// "tcp" names the same provider stack as "tcp;ofi_rxm" (what libfabric reports for it).
fn same_provider(a: &str, b: &str) -> bool {
    shardstream_fabric::core_provider(a) == shardstream_fabric::core_provider(b)
}

/// One stream's sender; counted in the hub while it lives.
pub struct RdmaStream {
    /// First, so it is dropped (its staging buffers deregistered and freed) before the
    /// reservation below gives their bytes back.
    pub sender: RingSender,
    /// Declared right after the sender, so dropped right after it: gives the endpoint's memory back.
    _trim: TrimAfterEndpoint,
    hub: Arc<RdmaHub>,
    pub address: Vec<u8>,
    pub provider: String,
    ring_bytes: u64,
    _staging: Reservation,
}

impl Drop for RdmaStream {
    fn drop(&mut self) {
        self.hub.streams.fetch_sub(1, Ordering::Relaxed);
        self.hub.ring_bytes.fetch_sub(self.ring_bytes, Ordering::Relaxed);
    }
}

/// Returns the heap's free memory to the kernel once a stream's endpoint is closed. libfabric
/// (rxm's buffer pools under tcp and verbs) mallocs tens of MiB per endpoint, and `serve` keeps
/// freed heap memory for reuse (`crate::malloc`): without this, every stream's pools stayed in
/// glibc's arenas after the stream ended and the daemon's RSS grew to ~0.5 GB, never shrinking.
struct TrimAfterEndpoint;

impl Drop for TrimAfterEndpoint {
    fn drop(&mut self) {
        // A trim walks every arena (a few ms over a large heap): on a thread of its own, since the
        // stream may end on an async worker. Without a thread (the process is at its limit), here.
        let spawned = std::thread::Builder::new().name("shardstream-rdma-trim".into()).spawn(crate::malloc::trim);
        if spawned.is_err() {
            crate::malloc::trim();
        }
    }
}

/// One stream's sender shared by the batch builders and its progress thread.
pub struct RdmaPipe {
    stream: Progressed<RdmaStream>,
    /// What the progress thread met; the next send reports it.
    failed: Mutex<Option<String>>,
}

impl RdmaPipe {
    /// Wraps `stream` and starts its progress thread (which ends with the pipe).
    pub fn start(stream: RdmaStream) -> Result<Arc<Self>> {
        let wake = stream.sender.waker();
        let pipe = Arc::new(Self { stream: Progressed::new(stream, move || wake.signal()), failed: Mutex::new(None) });
        let weak = Arc::downgrade(&pipe);
        std::thread::Builder::new()
            .name("shardstream-rdma-progress".into())
            .spawn(move || progress_loop(weak))
            .map_err(|e| Error::Internal(format!("cannot start the rdma progress thread: {e}")))?;
        Ok(pipe)
    }

    /// The stream, taken ahead of the progress thread.
    pub fn lock(&self) -> Result<MutexGuard<'_, RdmaStream>> {
        if let Some(e) = self.failed.lock().unwrap_or_else(PoisonError::into_inner).clone() {
            return Err(Error::Unavailable(format!("rdma stream to the client failed: {e}")));
        }
        Ok(self.stream.lock())
    }
}

/// Drives the endpoint whenever no builder holds or wants it: straight back into libfabric after
/// each wait, standing back while a builder asks for the stream ([`Progressed`]).
fn progress_loop(pipe: Weak<RdmaPipe>) {
    while let Some(p) = pipe.upgrade() {
        let Some(res) = p.stream.lock_for_progress().map(|mut s| s.sender.progress(PROGRESS_WAIT)) else {
            drop(p);
            std::thread::yield_now();
            continue;
        };
        if let Err(e) = res {
            *p.failed.lock().unwrap_or_else(PoisonError::into_inner) = Some(e.to_string());
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_the_daemon_would_stage_without_bound_are_refused() {
        let ok = RdmaOffer {
            address: b"127.0.0.1:1".to_vec(),
            slots: 4,
            slot_bytes: 32 << 20,
            ring_bytes: 4 * (32 << 20),
            ..Default::default()
        };
        assert!(check_offer(&ok).is_ok());
        let refused = |o: RdmaOffer, why: &str| {
            let e = check_offer(&o).expect_err(why).to_string();
            assert!(e.contains(why), "{e}");
        };
        refused(RdmaOffer { slot_bytes: 64 << 30, ring_bytes: 64 << 30, slots: 1, ..ok.clone() }, "larger than");
        refused(RdmaOffer { ring_bytes: 1 << 20, ..ok.clone() }, "cannot hold");
        // A receive is posted per slot for its release: past the provider's queue (2,044 with
        // tcp;ofi_rxm) the posting never succeeded, and a daemon thread spun at a core for good.
        refused(RdmaOffer { slots: 4096, slot_bytes: 1 << 16, ring_bytes: 1 << 28, ..ok.clone() }, "slots, more than");
        refused(RdmaOffer { address: Vec::new(), ..ok.clone() }, "no usable");
        // A ring claimed larger than its slots is taken (it can hold them) and counted as them.
        let large = RdmaOffer { ring_bytes: u64::MAX, ..ok.clone() };
        assert!(check_offer(&large).is_ok());
        assert_eq!((written_bytes(&large), written_bytes(&ok)), (4 * (32 << 20), 4 * (32 << 20)));
    }

    #[test]
    fn an_open_waiting_for_staging_room_stops_when_its_client_leaves() {
        // No libfabric here: the wait comes before anything is opened.
        let hub = Arc::new(RdmaHub {
            provider: Some("tcp".into()),
            opened: "tcp;ofi_rxm".into(),
            streams: AtomicU64::new(0),
            ring_bytes: AtomicU64::new(0),
            staging: MemoryBudget::new(Pool::RdmaStaging, 32 << 20),
        });
        let _others = hub.staging.reserve(32 << 20, Duration::ZERO, &|| false, &|| false).unwrap();
        let offer = RdmaOffer {
            address: b"127.0.0.1:1".to_vec(),
            provider: "tcp".into(),
            slots: 4,
            slot_bytes: 4 << 20,
            ring_bytes: 16 << 20,
            ..Default::default()
        };
        let start = std::time::Instant::now();
        let left = start + Duration::from_millis(200);
        let Err(e) = hub.open_stream(&offer, &|| std::time::Instant::now() >= left) else {
            panic!("opened beyond the budget")
        };
        // Not the full wait for room that ends in "exhausted": a client that left meanwhile
        // held a daemon thread (and, once room came, a registration) for nothing.
        assert!(start.elapsed() < Duration::from_secs(5), "waited {:?}", start.elapsed());
        assert!(e.to_string().contains("cancelled"), "{e}");
    }

    #[test]
    fn an_offer_must_name_the_asking_clients_own_address() {
        // A sockaddr_in as libfabric's tcp provider names an endpoint (AF_INET, port, IPv4).
        let name = |ip: [u8; 4]| {
            let mut n = vec![2, 0, 0x1f, 0x90];
            n.extend_from_slice(&ip);
            n.extend_from_slice(&[0; 8]);
            n
        };
        let offer = |ip| RdmaOffer { address: name(ip), ..Default::default() };
        let peer = |s: &str| RequestPeer::Ip(s.parse().expect("an IP"));
        assert!(check_offer_peer(&offer([10, 0, 0, 7]), peer("10.0.0.7")).is_ok());
        // A dual-stack listener reports an IPv4 peer in its IPv6-mapped form.
        assert!(check_offer_peer(&offer([10, 0, 0, 7]), peer("::ffff:10.0.0.7")).is_ok());
        let e = check_offer_peer(&offer([192, 0, 2, 1]), peer("10.0.0.7")).expect_err("another host");
        assert!(e.contains("192.0.2.1") && e.contains("10.0.0.7"), "{e}");
        assert!(check_offer_peer(&offer([127, 0, 0, 1]), RequestPeer::ThisHost).is_ok());
        assert!(check_offer_peer(&offer([192, 0, 2, 1]), RequestPeer::ThisHost).is_err());
        assert!(check_offer_peer(&offer([127, 0, 0, 1]), RequestPeer::Unknown).is_err());
        // No IP in the name (shm, efa): the provider's own fabric, nothing to compare.
        let shm = RdmaOffer { address: b"fi_shm://1234".to_vec(), ..Default::default() };
        assert!(check_offer_peer(&shm, peer("10.0.0.7")).is_ok());
    }

    #[test]
    fn providers_compare_by_their_core() {
        assert!(same_provider("tcp", "tcp;ofi_rxm"));
        assert!(same_provider("verbs;ofi_rxm", "verbs"));
        assert!(!same_provider("tcp", "shm"));
    }
}
