//! The gRPC service: open a dataset, stream one consumer's batches, report status.
//!
//! Each stream is produced by its own task that builds batches on the blocking pool and sends
//! them through a small bounded channel: a slow client fills its own channel and waits, never
//! anyone else; a client that disconnects makes the next send fail, and the task stops at once.

mod arrow_stream;
mod batches;
mod inline_budget;
mod kept;
mod kept_writer;
mod outbox;
mod projected;
mod quota;
mod sample_stream;
mod stage;
pub mod status;
mod stream_core;
mod stream_plan;
pub mod uses;

use std::sync::Arc;
use std::time::Instant;

use shardstream_proto::shardstream_server::Shardstream;
use shardstream_proto::{
    CacheStatus, ConsumerStatus, DatasetInfo, DatasetStatus, OpenRequest, PrefetchProgress, PrefetchRequest,
    StatusReply, StatusRequest, StreamMessage, StreamRequest, stream_message,
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::index::{Dataset, Registry, Working};
use crate::metrics::{ActiveStream, Metrics};
use crate::plan;
use crate::prefetch::Prefetcher;
use crate::transport;
use crate::transport::shm::{Session, ShmHub};
use crate::{Error, Result};
pub use status::to_status;

use arrow_stream::{SmallArrowStream, build_arrow_batch, small_batches};
use batches::{build_packed_batch, build_rdma_batch};
use sample_stream::SampleStream;
use stream_core::{StreamCore, run_on_own_thread};
use stream_plan::{StreamPlan, plan_stream};

/// The message of the `Unavailable` status a request ended by the daemon's shutdown gets.
pub const SHUTTING_DOWN: &str = "daemon is shutting down";

/// Batches (groups of batches, see [`outbox`]) queued per stream ahead of the client: two keeps
/// the socket busy while the next batch is read, and bounds a slow client's footprint to two.
const STREAM_QUEUE: usize = 2;

/// Most batches of small rows a stream queues at once ([`SmallArrowStream`]): one wake-up of the
/// connection's task and one socket write for them. Four, as the client returns slots four at a
/// time (the client's `shm::RELEASES_HELD`).
const SMALL_GROUP: usize = 4;

/// Most batches of small rows one Arrow message carries (over shared memory, for a client that
/// accepts several: `StreamRequest.max_batches_per_message`), one record batch in one ring slot
/// that the client cuts. Every message costs both sides a fixed amount (a slot, an IPC header, a
/// protobuf message, a `read_record_batch` and a release at the client) that outweighed 256 rows
/// of 40 bytes. Sixteen rather than eight: warm tab epochs 14% faster at 12% less CPU in one
/// interleaved run, thirty-two no faster (bench/PARQUET_PROFILE.md, "sixteen batches to a message").
const MAX_BATCHES_PER_MESSAGE: u32 = 16;

/// Batches share a message only while their rows' stored bytes stay under this: past it the
/// fixed cost is small beside the rows', and a larger slot only delays the batches in it.
const MESSAGE_ROWS_BYTES: u64 = 256 << 10;

/// Packed batches (and Arrow batches too large for a [`SmallArrowStream`], over shm) built at
/// once per stream. The gather is bound by memory latency per record, and batches in flight are
/// what keep both cores busy. Measured on 4 KiB records, batch 512, epochs 3-6 of a process, 3
/// interleaved rounds per setting (bench/PROFILES.md section 3, with a gather helper that has
/// since gone): 0.40x memcpy (median) with one batch in flight, 0.50-0.51x with two, 0.53-0.54x
/// with three, no better with four. A thread of its own for the stream, building one batch after
/// another, was no faster.
const PACKED_PIPELINE: usize = 3;

/// Most sample ids a stream takes from its plan in one trip to the blocking pool (8 bytes each:
/// 256 KiB). A batch of 256 small rows is built in ~100 us; a hand-off to the pool and back per
/// batch only for its ids was a visible share of that (bench/PARQUET_PROFILE.md). At least one
/// batch is taken per trip, however large.
const IDS_AHEAD: u64 = 32 * 1024;

pub use shardstream_proto::MAX_BATCH_SIZE;

/// Most sample ids a stream's plan holds at once (8 bytes each: 256 MiB). Only a shuffle window
/// about as large as a rank's share of a dataset of tens of millions of samples comes near it.
pub const MAX_PLAN_IDS: u64 = 1 << 25;

/// Largest worker count per rank (DataLoader workers).
pub const MAX_WORKERS: u32 = 1024;

/// Shuffle window, in shards, when the client does not choose one: a consumer then needs about
/// nine shards at a time, and the shuffle mixes samples of eight shards.
pub const DEFAULT_SHUFFLE_WINDOW: u32 = 8;

pub struct Service {
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    cache_dir: String,
    /// The shared-memory side channel, when the daemon listens on a Unix socket.
    shm: Option<Arc<ShmHub>>,
    prefetch: Option<Arc<Prefetcher>>,
    /// Rank plans' shard futures, shared by the rank's worker streams.
    uses: Arc<uses::UsesCache>,
    /// Projections' column-chunk copies, shared by the streams reading them.
    copy_plans: Arc<projected::CopyPlans>,
    /// The config file's `allow` list; `None`: every dataset is allowed.
    access: Option<Arc<crate::access::AllowList>>,
    /// `serve --rdma`: the rdma data plane.
    rdma: Option<Arc<transport::rdma::RdmaHub>>,
    /// One permit per stream served at once (`--max-streams`).
    streams: Arc<tokio::sync::Semaphore>,
    max_streams: usize,
    /// Streams per client (`--max-streams-per-client`).
    per_client: Arc<quota::StreamQuota>,
    /// Inline batch bytes queued for clients (`--inline-budget`).
    inline: Arc<inline_budget::InlineBudget>,
    /// The allow list's refusals' warning: a client may ask for refused datasets at will.
    refused_warn: Arc<crate::accept::Throttle>,
}

/// Streams a daemon serves at once by default: eight ranks of 64 DataLoader workers each, with
/// room to spare.
pub const DEFAULT_MAX_STREAMS: usize = 768;

/// The blocking pool for a daemon of `max_streams`: a thread for each stream (one waiting on its
/// client holds one), and as many again for what every client needs (opening a dataset, planning
/// a stream, fetching, decoding), which streams must never be able to take all of.
pub fn blocking_threads(max_streams: usize) -> usize {
    max_streams.saturating_mul(2).max(512)
}

impl Service {
    pub fn new(
        registry: Arc<Registry>,
        metrics: Arc<Metrics>,
        shutdown: CancellationToken,
        cache_dir: String,
        shm: Option<Arc<ShmHub>>,
        prefetch: Option<Arc<Prefetcher>>,
    ) -> Self {
        Self {
            registry,
            metrics,
            shutdown,
            cache_dir,
            shm,
            prefetch,
            uses: Arc::default(),
            copy_plans: Arc::default(),
            access: None,
            rdma: None,
            streams: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_STREAMS)),
            max_streams: DEFAULT_MAX_STREAMS,
            per_client: Arc::default(),
            // Unbounded until the daemon sets its --inline-budget (`with_inline_budget`).
            inline: inline_budget::InlineBudget::new(u64::MAX),
            refused_warn: Arc::default(),
        }
    }

    /// Bounds the inline batch bytes queued for clients at `bytes` (`--inline-budget`).
    pub fn with_inline_budget(mut self, bytes: u64) -> Self {
        self.inline = inline_budget::InlineBudget::new(bytes);
        self
    }

    /// Serves `transport="rdma"` streams through `hub`.
    pub fn with_rdma(mut self, hub: Option<Arc<transport::rdma::RdmaHub>>) -> Self {
        self.rdma = hub;
        self
    }

    /// Serves at most `max` streams at once (`--max-streams`).
    pub fn with_max_streams(mut self, max: usize) -> Self {
        self.streams = Arc::new(tokio::sync::Semaphore::new(max));
        self.max_streams = max;
        self
    }

    /// Serves each client at most `max` streams at once (`--max-streams-per-client`; `None`: as
    /// many as `--max-streams`).
    pub fn with_max_streams_per_client(mut self, max: Option<usize>) -> Self {
        self.per_client = Arc::new(quota::StreamQuota::new(max));
        self
    }

    /// Who a stream of `request` counts against (see [`quota`]).
    fn client_key<T>(request: &Request<T>) -> quota::ClientKey {
        if let Some(cred) =
            request.extensions().get::<tonic::transport::server::UdsConnectInfo>().and_then(|c| c.peer_cred)
        {
            return quota::ClientKey::Uid(cred.uid());
        }
        if let Some(name) = request.extensions().get::<crate::remote::RemoteClient>().and_then(|r| r.name.clone()) {
            return quota::ClientKey::Named(name);
        }
        request.remote_addr().map_or(quota::ClientKey::Unknown, |a| quota::ClientKey::Ip(a.ip()))
    }

    /// Restricts the datasets each peer may open to its roots in `allow`.
    pub fn with_access(mut self, allow: Option<Arc<crate::access::AllowList>>) -> Self {
        self.access = allow;
        self
    }

    /// Refuses (`PermissionDenied`, naming the URL) a dataset outside the peer's allowed roots.
    /// Returns what then admits the dataset's shards where they lie ([`Admission`]). The check
    /// touches the file system (a pattern's every name), so it runs on the blocking pool.
    async fn authorize<T>(&self, request: &Request<T>, url: &str) -> Result<Admission, Status> {
        let Some((allow, who)) = self.requester(request) else { return Ok(Admission(None)) };
        let (list, asking, named) = (allow.clone(), who.clone(), url.to_owned());
        blocking(move || list.check_requester(&asking, &named)).await.map_err(|e| {
            // At most a URL's first 256 characters: the request may carry megabytes of one.
            let shown: String = url.chars().take(256).collect();
            let cut = (shown.len() < url.len()).then_some(url.len());
            crate::accept::throttled_warn!(self.refused_warn, %who, url = ?shown, url_bytes = cut, "dataset refused by the allow list");
            to_status(e)
        })?;
        Ok(Admission(Some((allow, who))))
    }

    /// The allow list and who sent `request`, when the daemon has an allow list.
    fn requester<T>(&self, request: &Request<T>) -> Option<(Arc<crate::access::AllowList>, crate::access::Requester)> {
        let allow = self.access.as_ref()?;
        let local = request
            .extensions()
            .get::<tonic::transport::server::UdsConnectInfo>()
            .and_then(|c| c.peer_cred)
            .map(|c| crate::access::Peer { uid: c.uid(), gid: c.gid() });
        // A TCP request carries the identity the authenticator gave it (its token's name).
        let who = match (local, request.extensions().get::<crate::remote::RemoteClient>()) {
            (Some(p), _) => crate::access::Requester::Local(p),
            (None, Some(r)) => crate::access::Requester::Remote { client: r.name.clone() },
            (None, None) => crate::access::Requester::Remote { client: None },
        };
        Some((allow.clone(), who))
    }

    /// Which dataset URLs a status reply may name to `request`'s sender: with an allow list, only
    /// those it may open (every shard where it lies included); `None`: all of them. A peer
    /// learns nothing of the datasets others read.
    async fn visible_to<T>(
        &self,
        request: &Request<T>,
        datasets: &[Arc<Dataset>],
        consumers: &[String],
    ) -> Result<Option<std::collections::HashSet<String>>, Status> {
        let Some((allow, who)) = self.requester(request) else { return Ok(None) };
        let (datasets, urls) = (datasets.to_vec(), consumers.to_vec());
        blocking(move || {
            let mut seen = std::collections::HashSet::new();
            for ds in &datasets {
                if allow.check_requester(&who, &ds.url).is_ok() && allow.check_shards(&who, &ds.url, &ds.shards).is_ok()
                {
                    seen.insert(ds.url.clone());
                }
            }
            for url in urls {
                if !seen.contains(&url) && allow.check_requester(&who, &url).is_ok() {
                    seen.insert(url);
                }
            }
            Ok(Some(seen))
        })
        .await
        .map_err(to_status)
    }

    async fn open(&self, url: String, cache: String, admission: Admission) -> Result<Arc<Dataset>> {
        let registry = self.registry.clone();
        blocking(move || admission.open(&registry, &url, &cache)).await
    }
}

/// Refuses a URL holding a control character (it is logged and echoed in errors as given: a
/// newline would forge a line of the daemon's log), and a relative local path: the daemon would
/// resolve it in its own working directory, not the client's, and serve whatever dataset has
/// that name there. Clients make paths absolute.
fn check_url(url: &str) -> Result<(), Status> {
    // Through `to_status`, which bounds the message: the URL may be a pattern of thousands of names.
    if let Some(c) = url.chars().find(|c| c.is_control()) {
        return Err(to_status(Error::invalid(format!(
            "dataset URL {url:?} holds a control character ({c:?}); no dataset is named so"
        ))));
    }
    if !crate::storage::is_relative_path(url) {
        return Ok(());
    }
    Err(to_status(Error::invalid(format!(
        "dataset path {url:?} is relative: a daemon resolves paths in its own working directory, not \
         the client's; give an absolute path (the Python client and the shardstream command make \
         one from theirs)"
    ))))
}

/// Runs blocking work (disk reads, scans, plan computation) on the blocking pool.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Error::Internal(format!("worker task failed: {e}")))?
}

fn dataset_info(ds: &Dataset) -> DatasetInfo {
    DatasetInfo {
        fingerprint: ds.fingerprint.clone(),
        num_samples: ds.num_samples(),
        num_shards: ds.shards.len() as u64,
        total_bytes: ds.total_bytes(),
        fields: ds.fields.clone(),
        format: ds.format.name().into(),
        from_manifest: ds.from_manifest,
        arrow_schema: arrow_schema(ds),
    }
}

/// A Parquet dataset's Arrow schema (its first file's) as an IPC schema message; empty for other
/// formats.
fn arrow_schema(ds: &Dataset) -> Vec<u8> {
    let first = ds.parquet.as_ref().and_then(|p| p.files().first().map(|f| f.table.clone()));
    first.and_then(|t| crate::format::parquet::ipc::schema_message(t.schema()).ok()).unwrap_or_default()
}

/// A batch whose ids were taken from the plan: its range in the rank's order, its ids.
type ReadyBatch = (std::ops::Range<u64>, Vec<u64>);

/// The ids of batches `take` (ranges in the plan's order: it only moves forward).
fn ids_of(sequence: &mut plan::RankStream, take: Vec<std::ops::Range<u64>>) -> Result<Vec<ReadyBatch>> {
    take.into_iter()
        .map(|r| {
            let ids = sequence.range(r.clone())?;
            if ids.len() as u64 != r.end - r.start {
                return Err(Error::Internal(format!("batch {r:?} outside the rank sequence")));
            }
            Ok((r, ids))
        })
        .collect()
}

/// The next batches of `ranges` whose ids add up to at most `limit` (always at least one batch,
/// however large, while any is left).
fn next_ranges(
    ranges: &mut std::iter::Peekable<impl Iterator<Item = std::ops::Range<u64>>>,
    limit: u64,
) -> Vec<std::ops::Range<u64>> {
    let mut take = Vec::new();
    let mut ids = 0;
    while let Some(r) = ranges.peek() {
        let n = r.end - r.start;
        if !take.is_empty() && ids + n > limit {
            break;
        }
        ids += n;
        take.extend(ranges.next());
    }
    take
}

#[tonic::async_trait]
impl Shardstream for Service {
    async fn open_dataset(&self, request: Request<OpenRequest>) -> Result<Response<DatasetInfo>, Status> {
        crate::limits::check_request("OpenDataset", request.get_ref())?;
        check_url(&request.get_ref().url)?;
        let admission = self.authorize(&request, &request.get_ref().url).await?;
        let req = request.into_inner();
        check_protocol(req.protocol_version)?;
        // An open may take long (indexing a dataset without a manifest, a store that retries): at a
        // shutdown its client is told so, not cut off by the drain's end.
        let ds = tokio::select! {
            opened = self.open(req.url, req.cache, admission) => opened.map_err(to_status)?,
            () = self.shutdown.cancelled() => return Err(outbox::shutting_down()),
        };
        if ds.num_samples() == 0 {
            // Every stream of it would be refused: refused here, when the loader is made, not at
            // its first batch (in a DataLoader worker, an epoch later).
            return Err(to_status(stream_plan::no_samples(&ds)));
        }
        Ok(Response::new(dataset_info(&ds)))
    }

    type StreamBatchesStream = outbox::Messages;

    async fn stream_batches(
        &self,
        request: Request<StreamRequest>,
    ) -> Result<Response<Self::StreamBatchesStream>, Status> {
        // Only a client on the Unix socket can be on this host and reach the side channel.
        let same_host = request.extensions().get::<tonic::transport::server::UdsConnectInfo>().is_some();
        crate::limits::check_request("StreamBatches", request.get_ref())?;
        check_url(&request.get_ref().url)?;
        let admission = self.authorize(&request, &request.get_ref().url).await?;
        let slot = self.streams.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "the daemon serves at most {} streams at once (--max-streams), and as many are open: end \
                 unused loaders (close(), or DataLoader workers of finished epochs), use fewer workers, or raise \
                 --max-streams",
                self.max_streams
            ))
        })?;
        let client = Self::client_key(&request);
        let uid = match client {
            quota::ClientKey::Uid(uid) => Some(uid),
            _ => None,
        };
        let client_slot = self.per_client.acquire(client.clone()).map_err(|most| {
            Status::resource_exhausted(format!(
                "the daemon serves one client at most {most} streams at once (--max-streams-per-client), and \
                 {client} holds as many: end unused loaders (close(), or DataLoader workers of finished epochs), \
                 use fewer workers, or raise --max-streams-per-client"
            ))
        })?;
        // The daemon connects to the endpoint an rdma offer names (whichever transport the request
        // asks for, "auto" may become rdma): only the asking client's own.
        let peer = match request.remote_addr() {
            Some(a) => transport::rdma::RequestPeer::Ip(a.ip()),
            None if same_host => transport::rdma::RequestPeer::ThisHost,
            None => transport::rdma::RequestPeer::Unknown,
        };
        let req = request.into_inner();
        if let Some(offer) = &req.rdma_offer {
            transport::rdma::check_offer_peer(offer, peer).map_err(Status::permission_denied)?;
        }
        let ds = self.open(req.url.clone(), req.cache.clone(), admission).await.map_err(to_status)?;
        let hub = self.shm.clone().filter(|_| same_host);
        let rdma = self.rdma.clone();
        let prefetch = self.prefetch.clone();
        let (uses, copy_plans) = (self.uses.clone(), self.copy_plans.clone());
        // The plan may wait (an rdma stream for staging room) on a blocking thread, which
        // outlives this future: a client that leaves meanwhile drops it, and the guard tells
        // the wait.
        let left = CancellationToken::new();
        let _left_when_dropped = left.clone().drop_guard();
        let stopping = self.shutdown.clone();
        let cancelled = move || left.is_cancelled() || stopping.is_cancelled();
        let plan = blocking(move || {
            let shared = stream_plan::Shared { uses: &uses, copies: &copy_plans, uid };
            plan_stream(ds, &req, hub.as_deref(), rdma.as_ref(), prefetch.as_ref(), shared, &cancelled)
        })
        .await
        .map_err(to_status)?;
        // Shared-memory and rdma messages are descriptors; inline ones carry the batch's bytes.
        let inline = plan.session.is_none() && plan.rdma.is_none();
        let (tx, mut rx) = outbox::channel(STREAM_QUEUE, inline.then(|| self.inline.account()));
        // Held by the messages and by the producer: let go of when both are gone (a client that
        // leaves drops its messages at once, while a fetch in progress keeps the producer).
        let admission = Arc::new((slot, client_slot));
        rx.hold(admission.clone());
        let header = StreamMessage { kind: Some(stream_message::Kind::Header(plan.header.clone())) };
        tx.send(Ok(header)).await.map_err(|_| Status::cancelled("client went away"))?;
        let metrics = self.metrics.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let _admission = admission;
            produce(plan, tx, metrics, shutdown).await
        });
        Ok(Response::new(rx))
    }

    async fn status(&self, request: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        crate::limits::check_request("Status", request.get_ref())?;
        let m = &self.metrics;
        let prefetch = self.prefetch.as_ref().map(|p| p.status()).unwrap_or_default();
        let all = self.registry.all();
        let consumer_urls: Vec<String> = prefetch.consumers.iter().map(|c| c.dataset.clone()).collect();
        let visible = self.visible_to(&request, &all, &consumer_urls).await?;
        let shown = |url: &String| visible.as_ref().is_none_or(|v| v.contains(url));
        let datasets = all
            .iter()
            .filter(|ds| shown(&ds.url))
            .map(|ds| {
                let (tables, bytes) = ds.resident();
                DatasetStatus {
                    url: ds.url.clone(),
                    num_samples: ds.num_samples(),
                    num_shards: ds.shards.len() as u64,
                    total_bytes: ds.total_bytes(),
                    resident_shard_tables: tables as u64,
                    resident_index_bytes: bytes as u64,
                }
            })
            .collect();
        let decoded = crate::format::parquet::decoded::shared().stats();
        Ok(Response::new(StatusReply {
            version: crate::VERSION.into(),
            uptime_ms: m.uptime_ms(),
            active_streams: Metrics::get(&m.streams_active) as u32,
            streams_total: Metrics::get(&m.streams_total),
            samples_served: Metrics::get(&m.samples_served),
            bytes_served: Metrics::get(&m.bytes_served),
            datasets,
            cache_dir: self.cache_dir.clone(),
            read_wait_ms: Metrics::get(&m.read_wait_us) / 1000,
            shm_sessions: self.shm.as_ref().map_or(0, |h| h.counts().0 as u32),
            leased_shards: self.shm.as_ref().map_or(0, |h| h.counts().1 as u64),
            ring_bytes: self.shm.as_ref().map_or(0, |h| h.ring_bytes()),
            kept_rings: self.shm.as_ref().map_or(0, |h| h.kept_rings().0 as u32),
            kept_ring_bytes: self.shm.as_ref().map_or(0, |h| h.kept_rings().1),
            rings_made: self.shm.as_ref().map_or(0, |h| h.ring_counts().0),
            rings_reused: self.shm.as_ref().map_or(0, |h| h.ring_counts().1),
            rdma_provider: self.rdma.as_ref().map(|h| h.opened.clone()).unwrap_or_default(),
            rdma_streams: self.rdma.as_ref().map_or(0, |h| h.streams.load(std::sync::atomic::Ordering::Relaxed)),
            rdma_ring_bytes: self.rdma.as_ref().map_or(0, |h| h.ring_bytes.load(std::sync::atomic::Ordering::Relaxed)),
            rdma_staging_bytes: self.rdma.as_ref().map_or(0, |h| h.staging.used()),
            rdma_budget_bytes: self.rdma.as_ref().map_or(0, |h| h.staging.limit()),
            inline_queued_bytes: self.inline.used(),
            inline_budget_bytes: self.inline.limit(),
            decoded_memory_bytes: decoded.bytes,
            decoded_budget_bytes: decoded.budget,
            cache: self.registry.backends().cache.as_ref().map(|c| {
                let s = c.stats();
                CacheStatus {
                    capacity_bytes: s.capacity,
                    configured_capacity_bytes: s.configured,
                    used_bytes: s.used,
                    shards: s.shards,
                    hits: s.hits,
                    misses: s.misses,
                    evictions: s.evictions,
                    filled_bytes: s.filled_bytes,
                    high_water_bytes: s.high_water,
                    decoded_row_groups: s.derived,
                    decoded_bytes: s.derived_bytes,
                    policy: match c.policy() {
                        crate::cache::table::Policy::Belady => "belady".into(),
                        crate::cache::table::Policy::Lru => "lru".into(),
                    },
                }
            }),
            storage_bytes: crate::metrics::STORAGE_BYTES.load(std::sync::atomic::Ordering::Relaxed),
            storage_requests: crate::metrics::STORAGE_REQUESTS.load(std::sync::atomic::Ordering::Relaxed),
            storage_retries: crate::metrics::STORAGE_RETRIES.load(std::sync::atomic::Ordering::Relaxed),
            consumers: prefetch
                .consumers
                .iter()
                .filter(|c| shown(&c.dataset))
                .map(|c| ConsumerStatus {
                    url: c.dataset.clone(),
                    rank: c.rank,
                    worker: c.worker,
                    position: c.position,
                    samples_per_s: c.samples_per_s,
                    wait_s: c.waited_s,
                })
                .collect(),
            prefetch_horizon_s: prefetch.horizon_s,
            prefetches_in_flight: prefetch.inflight as u32,
        }))
    }

    type PrefetchStream = ReceiverStream<Result<PrefetchProgress, Status>>;

    async fn prefetch(&self, request: Request<PrefetchRequest>) -> Result<Response<Self::PrefetchStream>, Status> {
        crate::limits::check_request("Prefetch", request.get_ref())?;
        check_url(&request.get_ref().url)?;
        let admission = self.authorize(&request, &request.get_ref().url).await?;
        let req = request.into_inner();
        check_protocol(req.protocol_version)?;
        Ok(Response::new(stage::stage(self.registry.clone(), req, admission, self.shutdown.clone())))
    }
}

/// What a request that passed the allow list needs for the dataset's shards: the list and the
/// requester, whose roots every shard must lie under too; nothing without an allow list.
pub(crate) struct Admission(Option<(Arc<crate::access::AllowList>, crate::access::Requester)>);

impl Admission {
    /// Opens `url` for this requester ([`Registry::open_admitted`]). Blocking.
    pub(crate) fn open(&self, registry: &Registry, url: &str, cache: &str) -> Result<Arc<Dataset>> {
        match &self.0 {
            None => registry.open(url, cache),
            Some((allow, who)) => registry.open_admitted(url, cache, &|shards| {
                allow.check_shards(who, url, shards).inspect_err(|_| {
                    tracing::warn!(%who, url = ?url, "dataset refused by the allow list: a shard lies outside the roots");
                })
            }),
        }
    }
}

fn check_protocol(v: u32) -> Result<(), Status> {
    if v > shardstream_proto::PROTOCOL_VERSION {
        return Err(Status::failed_precondition(format!(
            "client speaks protocol {v}, this daemon only {}; upgrade the daemon",
            shardstream_proto::PROTOCOL_VERSION
        )));
    }
    Ok(())
}

/// Builds and sends one stream's batches until done, the client leaves, or shutdown.
async fn produce(plan: StreamPlan, tx: outbox::Outbox, metrics: Arc<Metrics>, shutdown: CancellationToken) {
    let _active = ActiveStream::new(&metrics);
    let StreamPlan {
        dataset,
        fields,
        all_fields,
        sequence,
        batches,
        batch_size,
        session,
        packed,
        consumer,
        arrow,
        projected,
        rdma,
        batches_per_message,
        joined_keys,
        split_inline,
        ..
    } = plan;
    let rdma = match rdma.map(transport::rdma::RdmaPipe::start).transpose() {
        Ok(r) => r,
        Err(e) => {
            let _ = tx.send(Err(to_status(e))).await;
            return;
        }
    };
    // However this function ends, the session learns the stream is over (its leases stay until
    // the client releases them or goes away).
    struct Done(Option<Arc<Session>>);
    impl Drop for Done {
        fn drop(&mut self) {
            if let Some(s) = &self.0 {
                s.stream_done();
            }
        }
    }
    let _done = Done(session.clone());
    let stopping = shutdown.clone();
    let core = StreamCore { dataset, session, sequence, batch_size, tx, metrics: metrics.clone(), consumer, shutdown };
    if let Some(asm) = arrow.clone().filter(|_| small_batches(&core.dataset, batch_size)) {
        let stream =
            SmallArrowStream { core, rdma: rdma.clone(), asm, projected, parts: batches_per_message, split_inline };
        run_on_own_thread(move || stream.run(batches)).await;
        return linger_for_credits(rdma, stopping);
    }
    if arrow.is_none() && !packed && rdma.is_none() {
        let stream = SampleStream { core, fields, all_fields };
        run_on_own_thread(move || stream.run(batches)).await;
        return;
    }
    let working = Working::until(core.ended_by());
    let StreamCore { dataset, session, sequence, tx, consumer, shutdown, .. } = core;
    // Read without the set's lock, which a build ahead of a failed one may hold for as long as
    // storage keeps it waiting.
    let waits = working.waits();
    let shared = Arc::new((dataset, fields, session, std::sync::Mutex::new(working), arrow, projected));
    let sequence = Arc::new(std::sync::Mutex::new(sequence));
    let spawn_build = |turn: u64, range: std::ops::Range<u64>, ids: Vec<u64>| {
        // Every batch but the rank's last is full, so its index in the rank's order is this.
        let index = range.start / batch_size;
        let end = range.end;
        let job = shared.clone();
        let (closed, stop) = (tx.clone(), shutdown.clone());
        let rdma = rdma.clone();
        let handle = tokio::task::spawn_blocking(move || {
            let (ds, fields, session, working, arrow, projected) = &*job;
            let cancelled = || closed.is_closed() || stop.is_cancelled();
            if let Some(asm) = arrow {
                let projected = projected.as_deref();
                return build_arrow_batch(
                    ds,
                    working,
                    session.as_deref(),
                    rdma.as_deref(),
                    turn,
                    asm,
                    projected,
                    ids,
                    index,
                    &[],
                    split_inline,
                    &cancelled,
                    &mut || Ok(()),
                )
                .and_then(arrow_stream::one_batch_sent);
            }
            let ids = &ids[..];
            if let (Some(s), true) = (session, packed) {
                let credit = s.take_turn(turn, &cancelled)?;
                return build_packed_batch(ds, working, s, credit, fields, ids, index, joined_keys, &cancelled)
                    .map(|((msg, bytes), waited)| ((vec![msg], bytes), waited));
            }
            // Not Arrow nor packed, so rdma: the other TAR streams are a `SampleStream`. A build
            // here may wait for a credit of the client's ring, for as long as the stream lasts.
            let Some(r) = &rdma else {
                return Err(Error::Internal("a stream of TAR batches outside a SampleStream without rdma".into()));
            };
            let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
            let built = build_rdma_batch(ds, &mut working, fields, all_fields, ids, index, r, &cancelled)
                .map(|(m, b)| (vec![m], b));
            working.end_batch();
            built.map(|b| (b, working.take_wait()))
        });
        (end, handle)
    };
    let depth = if packed { PACKED_PIPELINE } else { 1 };
    let mut pending = std::collections::VecDeque::with_capacity(depth);
    let mut ranges = batches.peekable();
    // Builds take their shm slots in this order (see `Session::take_turn`): the batches' order.
    let mut turn = 0u64;
    // Ids of the next batches, taken from the plan several batches at a time.
    let mut ready: std::collections::VecDeque<ReadyBatch> = Default::default();
    loop {
        while pending.len() < depth {
            if ready.is_empty() {
                // The next batches' ids, in turn order (the plan only moves forward), on the
                // blocking pool (a refill shuffles half a window): up to IDS_AHEAD ids per trip,
                // so a stream of small batches does not pay a thread hand-off per batch for them.
                let take = next_ranges(&mut ranges, IDS_AHEAD);
                if take.is_empty() {
                    break;
                }
                let seq = sequence.clone();
                let ids = blocking(move || ids_of(&mut seq.lock().unwrap_or_else(|p| p.into_inner()), take));
                match ids.await {
                    Ok(ids) => ready.extend(ids),
                    Err(e) => {
                        consumer_waited(&consumer, &waits);
                        return fail(&tx, &shared.0, e, &shutdown).await;
                    }
                }
            }
            let Some((range, ids)) = ready.pop_front() else { break };
            // An inline stream whose messages wait while the inline budget is spent builds
            // nothing more until they are taken (`inline_budget`).
            tokio::select! {
                () = tx.room() => {}
                _ = shutdown.cancelled() => {
                    tx.try_send(Err(outbox::shutting_down()));
                    return;
                }
                _ = tx.closed() => return,
            }
            pending.push_back(spawn_build(turn, range, ids));
            turn += 1;
        }
        let Some((end, handle)) = pending.pop_front() else { break };
        // What the stream waits for this batch now: with batches built ahead, not their build time.
        let started = Instant::now();
        let built = tokio::select! {
            r = handle => r.map_err(|e| Error::Internal(format!("worker task failed: {e}"))).and_then(|r| r),
            _ = shutdown.cancelled() => {
                // try_send: a client that stopped reading must not hold up the shutdown. If the
                // queue is full the client still learns, once it has read what was queued
                // (`outbox::Messages`).
                tx.try_send(Err(outbox::shutting_down()));
                return;
            }
            _ = tx.closed() => return,
        };
        match built {
            Ok(((messages, bytes), waited)) => {
                // The stream's stall for this batch, as far as storage made it (a build waiting
                // for the client's credit is the trainer's pace).
                stream_core::count_read_wait(&metrics, started.elapsed().min(waited));
                let mut samples = 0;
                for msg in messages {
                    samples += samples_in(&msg);
                    fail_point!("stream-send", |_| ());
                    if tx.send(Ok(msg)).await.is_err() {
                        tracing::debug!("client left mid-stream");
                        return;
                    }
                }
                metrics.batch_served(samples, bytes);
                if let Some(c) = &consumer {
                    c.consumer.advance(end, waited);
                }
            }
            Err(e) => {
                consumer_waited(&consumer, &waits);
                return fail(&tx, &shared.0, e, &shutdown).await;
            }
        }
    }
    drop(tx);
    linger_for_credits(rdma, stopping);
}

/// Counts what a failing stream waited for storage and never served (the wait that ended in its
/// error) as its consumer's wait: still time the trainer stalled.
fn consumer_waited(consumer: &Option<crate::prefetch::ConsumerGuard>, waits: &crate::index::Waits) {
    if let Some(c) = consumer {
        c.consumer.waited(waits.take());
    }
}

/// Ends a stream with its error `e` ([`outbox::last_word`]).
async fn fail(tx: &outbox::Outbox, dataset: &Dataset, e: Error, shutdown: &CancellationToken) {
    dataset.note_stream_failure(&e);
    match outbox::last_word(&dataset.url, e, shutdown) {
        outbox::Ending::Shutdown(status) => tx.try_send(Err(status)),
        outbox::Ending::Failed(status) => {
            let _ = tx.send(Err(status)).await;
        }
    }
}

/// Samples (rows) a batch message carries, for the served-samples metric.
fn samples_in(msg: &StreamMessage) -> u64 {
    match &msg.kind {
        Some(stream_message::Kind::InlineBatch(b)) => b.keys.len() as u64,
        Some(stream_message::Kind::ShmBatch(b)) => b.slots.len() as u64,
        Some(stream_message::Kind::PackedBatch(b)) => b.key_count() as u64,
        Some(stream_message::Kind::ArrowBatch(b)) => b.row_ids.len() as u64,
        Some(stream_message::Kind::RdmaBatch(b)) => b.keys.len() as u64,
        _ => 0,
    }
}

/// rdma: the endpoint must outlive the last batch until the client has taken it (closing it
/// earlier can reset the connection under the last write). The client returns the last credits
/// only once its consumer drops those batches, which it may do only after the stream ended: so
/// the stream ends (its sender of messages already dropped) and the endpoint lives on in the
/// background until every credit is back or the client is gone (bounded by the stall time), or
/// the daemon shuts down: a client holding its last batches must not hold the exit.
fn linger_for_credits(rdma: Option<Arc<transport::rdma::RdmaPipe>>, shutdown: CancellationToken) {
    if let Some(r) = rdma {
        tokio::task::spawn_blocking(move || {
            let waiting = || !shutdown.is_cancelled();
            let drained = r
                .lock()
                .and_then(|mut s| s.sender.drain_while(&waiting).map_err(|e| Error::Unavailable(e.to_string())));
            if let Err(e) = drained {
                tracing::debug!(error = %e, "rdma stream ended without every credit back");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::next_ranges;

    #[test]
    fn ids_are_taken_several_batches_at_a_time_within_the_limit() {
        let batches = |sizes: &[u64]| {
            let mut start = 0;
            let v: Vec<_> = sizes
                .iter()
                .map(|&n| {
                    start += n;
                    start - n..start
                })
                .collect();
            v.into_iter().peekable()
        };
        let mut r = batches(&[256, 256, 256, 100]);
        assert_eq!(next_ranges(&mut r, 512), vec![0..256, 256..512]);
        assert_eq!(next_ranges(&mut r, 512), vec![512..768, 768..868]);
        assert!(next_ranges(&mut r, 512).is_empty());
        // A batch larger than the limit still goes, alone.
        let mut r = batches(&[1000, 1]);
        assert_eq!(next_ranges(&mut r, 512), vec![0..1000]);
        assert_eq!(next_ranges(&mut r, 512), vec![1000..1001]);
    }
}
