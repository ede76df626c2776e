//! The gRPC service: open a dataset, stream one consumer's batches, report status.
//!
//! Each stream is produced by its own task that builds batches on the blocking pool and sends
//! them through a small bounded channel: a slow client fills its own channel and waits, never
//! anyone else; a client that disconnects makes the next send fail, and the task stops at once.

mod outbox;
mod projected;
mod stage;
pub mod status;
pub mod uses;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::time::Instant;

use shardstream_proto::shardstream_server::Shardstream;
use shardstream_proto::{
    ArrowBatch, CacheStatus, Collate, ConsumerStatus, DatasetInfo, DatasetStatus, FieldColumn, OpenRequest,
    PackedBatch, PrefetchProgress, PrefetchRequest, RdmaBatch, ShmBatch, StatusReply, StatusRequest, StreamHeader,
    StreamMessage, StreamRequest, Transport, stream_message,
};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::format::parquet::dataset::BatchAssembler;
use crate::index::{CacheMode, Dataset, LargestSample, Registry, Working};
use crate::metrics::{ActiveStream, Metrics};
use crate::plan::{self, EpochParams, WorkerParams};
use crate::prefetch::{ConsumerGuard, Prefetcher};
use crate::storage::append::{Append, Fixed};
use crate::transport;
use crate::transport::inline::{self, InlineBatchBuilder};
use crate::transport::packed;
use crate::transport::shm::{Session, ShmHub};
use crate::{Error, Result};
pub use status::to_status;

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
/// of 40 bytes (bench/PARQUET_PROFILE.md).
const MAX_BATCHES_PER_MESSAGE: u32 = 8;

/// Batches share a message only while their rows' stored bytes stay under this: past it the
/// fixed cost is small beside the rows', and a larger slot only delays the batches in it.
const MESSAGE_ROWS_BYTES: u64 = 256 << 10;

/// Packed batches gathered at once per stream. The gather is bound by memory latency per record;
/// each batch is also shared with the daemon's gather helper (`packed::GATHER_HELPERS`), but a
/// parked helper starts ~220 us late on a waking vCPU here, so the second batch in flight is what
/// keeps both cores busy. Measured on 4 KiB records, best of five epochs (before the persistent
/// helper): 2.9 GB/s with one batch in flight, 3.3-3.8 GB/s with two, no better with three.
const PACKED_PIPELINE: usize = 2;

/// Most sample ids a stream takes from its plan in one trip to the blocking pool (8 bytes each:
/// 256 KiB). A batch of 256 small rows is built in ~100 us; a hand-off to the pool and back per
/// batch only for its ids was a visible share of that (bench/PARQUET_PROFILE.md). At least one
/// batch is taken per trip, however large.
const IDS_AHEAD: u64 = 32 * 1024;

/// Largest batch accepted. Bigger batches than this are a unit mistake (samples vs bytes).
pub const MAX_BATCH_SIZE: u32 = 1 << 20;

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
    /// The config file's `allow` list; `None`: every dataset is allowed.
    access: Option<Arc<crate::access::AllowList>>,
    /// `serve --rdma`: the rdma data plane.
    rdma: Option<Arc<transport::rdma::RdmaHub>>,
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
        Self { registry, metrics, shutdown, cache_dir, shm, prefetch, uses: Arc::default(), access: None, rdma: None }
    }

    /// Serves `transport="rdma"` streams through `hub`.
    pub fn with_rdma(mut self, hub: Option<Arc<transport::rdma::RdmaHub>>) -> Self {
        self.rdma = hub;
        self
    }

    /// Restricts the datasets each peer may open to its roots in `allow`.
    pub fn with_access(mut self, allow: Option<Arc<crate::access::AllowList>>) -> Self {
        self.access = allow;
        self
    }

    /// Refuses (`PermissionDenied`, naming the URL) a dataset outside the peer's allowed roots.
    fn authorize<T>(&self, request: &Request<T>, url: &str) -> Result<(), Status> {
        let Some(allow) = &self.access else { return Ok(()) };
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
        allow.check_requester(&who, url).map_err(|e| {
            tracing::warn!(%who, %url, "dataset refused by the allow list");
            to_status(e)
        })
    }

    async fn open(&self, url: String, cache: String) -> Result<Arc<Dataset>> {
        let registry = self.registry.clone();
        blocking(move || registry.open(&url, &cache)).await
    }
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

/// A validated stream request.
struct StreamPlan {
    dataset: Arc<Dataset>,
    fields: Vec<String>,
    all_fields: bool,
    /// The rank's sequence, produced on demand and already positioned at this worker's first
    /// batch: O(window + batch) ids held, not the rank's whole share.
    sequence: plan::RankStream,
    batches: plan::WorkerBatches,
    batch_size: u64,
    header: StreamHeader,
    session: Option<Arc<Session>>,
    /// Shared-memory batches are gathered into ring slots (collate = stack).
    packed: bool,
    /// The prefetcher follows this stream while it lives (datasets read through the cache).
    consumer: Option<ConsumerGuard>,
    /// Parquet datasets: how this stream's Arrow batches are made (its columns, checked against
    /// every file when the stream is planned).
    arrow: Option<Arc<BatchAssembler>>,
    /// S3 Parquet streams that read only their columns' chunks.
    projected: Option<Arc<projected::ProjectedReads>>,
    /// TRANSPORT_RDMA: the sender writing into the client's ring.
    rdma: Option<transport::rdma::RdmaStream>,
    /// Arrow streams: most batches one message may carry (the client's limit and the daemon's).
    batches_per_message: usize,
}

fn plan_stream(
    ds: Arc<Dataset>,
    req: &StreamRequest,
    shm: Option<&ShmHub>,
    rdma_hub: Option<&Arc<transport::rdma::RdmaHub>>,
    prefetch: Option<&Arc<Prefetcher>>,
    uses_cache: &uses::UsesCache,
) -> Result<StreamPlan> {
    if req.batch_size == 0 || req.batch_size > MAX_BATCH_SIZE {
        return Err(Error::invalid(format!("batch_size {} must be between 1 and {MAX_BATCH_SIZE}", req.batch_size)));
    }
    if req.num_workers > MAX_WORKERS {
        return Err(Error::invalid(format!("num_workers {} exceeds {MAX_WORKERS}", req.num_workers)));
    }
    if !req.expected_fingerprint.is_empty() && req.expected_fingerprint != ds.fingerprint {
        return Err(Error::invalid(format!(
            "dataset {} changed since the resume state was saved (fingerprint {} vs {}); \
             a resume is only exact on the same shards",
            ds.url, ds.fingerprint, req.expected_fingerprint
        )));
    }
    let fields = if req.fields.is_empty() {
        ds.fields.clone()
    } else {
        for f in &req.fields {
            if !ds.fields.contains(f) {
                return Err(Error::invalid(format!(
                    "field {f:?} is not in dataset {} (fields: {})",
                    ds.url,
                    ds.fields.join(", ")
                )));
            }
        }
        let mut seen = std::collections::HashSet::new();
        req.fields.iter().filter(|f| seen.insert(*f)).cloned().collect()
    };
    let all_fields = fields.len() == ds.fields.len();
    let params = EpochParams {
        seed: req.seed,
        epoch: req.epoch,
        shuffle: req.shuffle,
        window_shards: if req.shuffle_window == 0 { DEFAULT_SHUFFLE_WINDOW } else { req.shuffle_window },
        world_size: req.world_size,
        rank: req.rank,
        batch_size: req.batch_size,
        drop_last: req.drop_last,
    };
    let plan_units = ds.plan_units();
    let summary = plan::summarize(&plan_units, &params)?;
    let mut sequence = plan::RankStream::bounded(&plan_units, &params, MAX_PLAN_IDS)?;
    let worker = WorkerParams { num_workers: req.num_workers.max(1), worker: req.worker, start_batch: req.start_batch };
    let batches = plan::WorkerBatches::new(sequence.len(), req.batch_size, &worker)?;
    let start = batches.peek().map_or(sequence.len(), |b| b.start);
    let arrow = match &ds.parquet {
        Some(pq) => {
            let selection = (!req.fields.is_empty()).then_some(&fields[..]);
            let projection = pq.projection(selection)?;
            let cache = crate::format::parquet::decoded::shared();
            // The URL too: two copies of a dataset share a fingerprint, not their bytes' checks.
            let id = format!("{}@{}", ds.fingerprint, ds.url);
            Some(Arc::new(BatchAssembler::new(pq.clone(), projection, cache, &id)?))
        }
        None => None,
    };
    // An S3 Parquet stream that selects a fraction of the columns caches and fetches only their
    // column chunks (see `projected`); the others read whole files through the node cache.
    let projected = match &arrow {
        Some(asm) => projected::ProjectedReads::plan(&ds, asm)?.map(Arc::new),
        None => None,
    };
    let consumer = match prefetch {
        Some(p) if ds.mode == CacheMode::Copy => {
            // This epoch's future, then the next epoch's (a trainer moves on with the same
            // parameters), so eviction at the end of this epoch keeps what the next one needs first.
            // Each is one streamed walk of its plan (O(window + shards) memory), done once per
            // rank and epoch and shared by the rank's workers.
            let next = EpochParams { epoch: params.epoch.wrapping_add(1), ..params };
            let (this_epoch, next_epoch) =
                (uses_cache.uses(&ds, &plan_units, &params)?, uses_cache.uses(&ds, &plan_units, &next)?);
            let len = sequence.len();
            let mut uses = Vec::with_capacity(this_epoch.len() + next_epoch.len());
            uses.extend_from_slice(&this_epoch);
            uses.extend(next_epoch.iter().map(|u| crate::prefetch::ShardUse {
                first: u.first + len,
                last: u.last + len,
                ..*u
            }));
            let fetch = projected.clone().map(|p| p as Arc<dyn crate::prefetch::ProjectedFetch>);
            Some(p.register(ds.clone(), uses, start, req.rank, req.worker, fetch))
        }
        _ => None,
    };
    // A resumed stream skips the batches already delivered (and the other workers') here, on the
    // blocking pool, so its first batch is not held up in the stream task.
    sequence.skip_to(start)?;
    let transport = transport::negotiate(req.transport, shm.is_some())?;
    let rdma = if transport == Transport::Rdma {
        let hub = rdma_hub.ok_or_else(|| {
            Error::invalid(
                "transport \"rdma\": this daemon does not serve rdma (start it with `shardstream serve --rdma`); \
                 use transport=\"inline\" or \"auto\"",
            )
        })?;
        let offer = req.rdma_offer.as_ref().ok_or_else(|| Error::invalid("transport \"rdma\" needs an rdma_offer"))?;
        // A batch is one ring slot: refuse a stream whose batches cannot fit before it starts.
        let avg = ds.total_bytes().checked_div(ds.num_samples()).unwrap_or(0);
        let batch = u64::from(req.batch_size).min(summary.samples_per_rank);
        if let Some(l) = ds.largest_sample
            && l.bytes > offer.slot_bytes
        {
            return Err(Error::invalid(format!(
                "transport \"rdma\": a sample of {} bytes does not fit the client's {}-byte ring slots",
                l.bytes, offer.slot_bytes
            )));
        }
        if batch.saturating_mul(avg) > offer.slot_bytes / 2 {
            return Err(Error::invalid(format!(
                "transport \"rdma\": batches of {batch} x ~{avg} bytes need ring slots larger than the client's {} bytes \
                 (rdma_slot_bytes)",
                offer.slot_bytes
            )));
        }
        Some(hub.open_stream(offer)?)
    } else {
        None
    };
    if transport == Transport::Inline {
        // Over shared memory no sample byte enters a message: only inline streams are limited.
        check_inline_fits(&ds)?;
    }
    let collate =
        Collate::try_from(req.collate).map_err(|_| Error::invalid(format!("unknown collate mode {}", req.collate)))?;
    let packed = transport == Transport::Shm && (collate == Collate::Stack || arrow.is_some());
    let session = match (transport, shm) {
        (Transport::Shm, Some(hub)) => {
            Some(hub.new_session(if packed { hub.config.ring_slots } else { hub.config.credits })?)
        }
        _ => None,
    };
    let header = StreamHeader {
        transport: transport as i32,
        shm_socket: shm.filter(|_| session.is_some()).map(|h| h.socket.display().to_string()).unwrap_or_default(),
        shm_token: session.as_ref().map(|s| s.token.to_vec()).unwrap_or_default(),
        shm_credits: session.as_ref().map_or(0, |s| s.credits),
        fingerprint: ds.fingerprint.clone(),
        samples_per_rank: summary.samples_per_rank,
        batches_per_rank: summary.batches_per_rank,
        batches_in_stream: batches.len() as u64,
        padded_samples: summary.padded_samples,
        dropped_samples: summary.dropped_samples,
        fields: fields.clone(),
        packed,
        batch_format: ds.format.batch_format() as i32,
        rdma_address: rdma.as_ref().map(|r| r.address.clone()).unwrap_or_default(),
        rdma_provider: rdma.as_ref().map(|r| r.provider.clone()).unwrap_or_default(),
    };
    Ok(StreamPlan {
        dataset: ds,
        fields,
        all_fields,
        sequence,
        batches,
        batch_size: req.batch_size.into(),
        header,
        session,
        packed,
        consumer,
        arrow,
        projected,
        rdma,
        batches_per_message: req.max_batches_per_message.clamp(1, MAX_BATCHES_PER_MESSAGE) as usize,
    })
}

/// Refuses an inline stream with a sample larger than any message before it starts, naming the
/// sample so it can be found. A batch of many samples beyond the limit is split over several
/// messages instead (see [`build_batch`]).
fn check_inline_fits(ds: &Dataset) -> Result<()> {
    if let Some(l) = ds.largest_sample
        && l.bytes > inline::payload_limit()
    {
        return Err(oversized_sample(ds, l, &format!("the inline message limit of {}", inline::limit_text())));
    }
    Ok(())
}

/// The error for sample `l`, larger than `limit` (an inline message, an rdma ring slot): it
/// names the sample so it can be found, and the ways out.
fn oversized_sample(ds: &Dataset, l: LargestSample, limit: &str) -> Error {
    let shard = ds.shards.get(l.shard).map_or_else(|| format!("#{}", l.shard), |m| m.url());
    let at = l.offset.map(|o| format!(" (at byte {o})")).unwrap_or_default();
    Error::invalid(format!(
        "sample {} of shard {shard}{at} is {} bytes, larger than {limit}; read it over shared memory \
         (transport=\"shm\", same host) or split the sample",
        l.local, l.bytes,
    ))
}

/// The open shard and local index of sample `id`. Consecutive samples of a batch mostly come from
/// the same few shards (the shuffle window): `current` remembers the last shard used, to skip the
/// working set's lookup.
fn sample_of(
    ds: &Dataset,
    working: &mut Working,
    id: u64,
    current: &mut Option<(usize, Arc<crate::index::ResidentShard>)>,
) -> Result<(Arc<crate::index::ResidentShard>, u64)> {
    let (shard, local) = ds.locate(id).ok_or_else(|| Error::Internal(format!("sample id {id} out of range")))?;
    match current {
        Some((s, r)) if *s == shard => Ok((r.clone(), local)),
        _ => {
            let r = working.get(ds, shard)?.clone();
            *current = Some((shard, r.clone()));
            Ok((r, local))
        }
    }
}

/// Reads the samples `ids` into `b`, in order. Before each sample is read, a sample whose stored
/// bytes exceed `limit` is refused by name (`too_large` says what it is larger than), then
/// `before(b, i, region)` sees the builder, the sample's place in `ids` and its stored bytes: to
/// end a part and start the next, or to refuse a batch that outgrows its buffer.
fn gather<B: Append>(
    ds: &Dataset,
    working: &mut Working,
    ids: &[u64],
    b: &mut InlineBatchBuilder<B>,
    limit: u64,
    too_large: &dyn Fn() -> String,
    mut before: impl FnMut(&mut InlineBatchBuilder<B>, usize, u64) -> Result<()>,
) -> Result<()> {
    let mut current = None;
    for (i, &id) in ids.iter().enumerate() {
        let (resident, local) = sample_of(ds, working, id, &mut current)?;
        // The region the sample's read appends (its TAR members).
        let range = resident.table.sample_range(local).unwrap_or_default();
        let region = range.end.saturating_sub(range.start);
        // The open-time check knows only the samples the manifest or the scan described (an older
        // manifest records none): refuse an oversized one by name before reading its bytes.
        if region > limit
            && let Some((shard, _)) = &current
        {
            let l = LargestSample { shard: *shard, local, offset: Some(range.start), bytes: region };
            return Err(oversized_sample(ds, l, &too_large()));
        }
        before(b, i, region)?;
        b.add_sample(&resident, local)?;
    }
    Ok(())
}

/// Reads one batch (blocking): one message, or several when the batch's bytes exceed
/// [`inline::payload_limit`] (each part a run of whole samples; `InlineBatch.more` on all but the
/// last).
fn build_batch(
    ds: &Dataset,
    working: &mut Working,
    fields: &[String],
    all_fields: bool,
    ids: &[u64],
    index: u64,
) -> Result<(Vec<StreamMessage>, u64)> {
    let limit = inline::payload_limit();
    let avg = ds.total_bytes().checked_div(ds.num_samples()).unwrap_or(0) as usize;
    let capacity = |n: usize| avg.saturating_mul(n).saturating_add(4096).min(limit as usize);
    working.preload(ds, ids)?;
    let mut b = InlineBatchBuilder::new(fields, all_fields, ids.len(), capacity(ids.len()));
    let (mut parts, mut bytes) = (Vec::new(), 0);
    let too_large = || format!("the inline message limit of {}", inline::limit_text());
    gather(ds, working, ids, &mut b, limit, &too_large, |b, i, region| {
        if !b.is_empty() && b.data_len() as u64 + region > limit {
            let left = ids.len() - i;
            let full = std::mem::replace(b, InlineBatchBuilder::new(fields, all_fields, left, capacity(left)));
            bytes += full.payload_bytes();
            parts.push(full.finish(index, true));
        }
        Ok(())
    })?;
    bytes += b.payload_bytes();
    parts.push(b.finish(index, false));
    let messages = parts.into_iter().map(|p| StreamMessage { kind: Some(stream_message::Kind::InlineBatch(p)) });
    Ok((messages.collect(), bytes))
}

/// Reserves a staging buffer of the stream's rdma sender for batch `index` (blocking: may wait
/// for a credit), lets `fill` write the batch at its start, returning its length and whatever else
/// it made, and posts the RDMA write of those bytes into a slot of the client's ring. Returns the
/// slot and what `fill` made. The sender is held only to reserve and to post, so its progress
/// thread keeps earlier writes moving while `fill` runs; a `fill` that fails gives the buffer and
/// the credit back.
fn rdma_post<T>(
    rdma: &transport::rdma::RdmaPipe,
    index: u64,
    fill: impl FnOnce(&mut [u8]) -> Result<(usize, T)>,
) -> Result<(u32, usize, T)> {
    let failed = |e: shardstream_fabric::stream::StreamError| {
        Error::Unavailable(format!("rdma stream to the client failed: {e}"))
    };
    let mut staged = rdma.lock()?.sender.reserve(index).map_err(failed)?;
    let filled = fill(staged.buffer());
    let mut r = rdma.lock()?;
    let (len, made) = match filled {
        Ok(f) => f,
        Err(e) => {
            r.sender.cancel(staged);
            return Err(e);
        }
    };
    // Posted, not waited for: the metadata may overtake the bytes (the client joins the two in
    // either order) and the progress thread moves the write while the next batch is read.
    let slot = r.sender.post(staged, len).map_err(failed)?;
    Ok((slot, len, made))
}

/// Reads one batch straight into a staging buffer of the stream's rdma sender (registered
/// memory, laid out as an inline batch's `data`), posts it ([`rdma_post`]) and describes it as
/// an `RdmaBatch`.
fn build_rdma_batch(
    ds: &Dataset,
    working: &mut Working,
    fields: &[String],
    all_fields: bool,
    ids: &[u64],
    index: u64,
    rdma: &transport::rdma::RdmaPipe,
) -> Result<(StreamMessage, u64)> {
    working.preload(ds, ids)?;
    let (slot, len, (bytes, keys, columns)) = rdma_post(rdma, index, |buf| {
        let slot_bytes = buf.len() as u64;
        let mut b = InlineBatchBuilder::with_buffer(fields, all_fields, ids.len(), Fixed::new(buf));
        let too_large = || format!("the client's rdma ring slots of {slot_bytes} bytes (SHARDSTREAM_RDMA_SLOT_BYTES)");
        gather(ds, working, ids, &mut b, slot_bytes, &too_large, |b, _, region| {
            if b.data_len() as u64 + region > slot_bytes {
                return Err(Error::invalid(format!(
                    "transport \"rdma\": batch {index} of {} samples outgrows the client's {slot_bytes}-byte ring \
                     slots (its samples are larger than the dataset's average); raise SHARDSTREAM_RDMA_SLOT_BYTES \
                     or lower batch_size",
                    ids.len()
                )));
            }
            Ok(())
        })?;
        let bytes = b.payload_bytes();
        let (keys, columns, len) = b.into_parts();
        Ok((len, (bytes, keys, columns)))
    })?;
    let batch = RdmaBatch { batch_index: index, slot, keys, fields: columns, data_bytes: len as u64 };
    Ok((StreamMessage { kind: Some(stream_message::Kind::RdmaBatch(batch)) }, bytes))
}

/// Describes one batch for a shm client (blocking: may wait for the client's credits). No sample
/// byte is read: the client parses the samples in its own mapping.
fn build_shm_batch(
    ds: &Dataset,
    working: &mut Working,
    session: &Session,
    fields: &[String],
    ids: &[u64],
    index: u64,
    cancelled: &dyn Fn() -> bool,
) -> Result<(StreamMessage, u64)> {
    session.wait_ready(cancelled)?;
    working.preload(ds, ids)?;
    let mut b = ShmBatch {
        batch_index: index,
        slots: Vec::with_capacity(ids.len()),
        starts: Vec::with_capacity(ids.len()),
        lengths: Vec::with_capacity(ids.len()),
        ..Default::default()
    };
    let mut located = Located::new(fields, ids.len());
    // The batch's shards, by shard index: a shuffled batch switches shard at almost every sample,
    // so the session (a lock and a path lookup) is asked once per shard, not once per sample.
    let mut shards: HashMap<usize, (u32, Arc<crate::index::ResidentShard>)> = HashMap::new();
    let mut bytes = 0u64;
    for &id in ids {
        let (shard, local) = ds.locate(id).ok_or_else(|| Error::Internal(format!("sample id {id} out of range")))?;
        let (slot, resident) = match shards.entry(shard) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let r = working.get(ds, shard)?.clone();
                // A shard read in place may be truncated by others while the client holds it:
                // the client then reads it rather than maps it (SIGBUS otherwise).
                let mutable = ds.mode == CacheMode::Direct
                    && matches!(ds.shards.get(shard).map(|m| &m.source), Some(crate::storage::ShardSource::Local(_)));
                let slot = session.slot_for(&r.file.path, &r.file.file, r.file.len, mutable)?;
                e.insert((slot, r))
            }
        };
        let slot = *slot;
        let range = resident.table.sample_range(local).ok_or_else(|| {
            Error::Internal(format!("sample {local} out of range in {}", resident.file.path.display()))
        })?;
        b.slots.push(slot);
        b.starts.push(range.start);
        b.lengths.push(range.end - range.start);
        bytes += range.end - range.start;
        located.add(&resident.table, shard, local);
    }
    located.finish(&mut b);
    session.lease(index, shards.into_values().map(|(_, r)| r.file.path.clone()).collect());
    Ok((StreamMessage { kind: Some(stream_message::Kind::ShmBatch(b)) }, bytes))
}

/// The per-sample key and field locations of a shm batch (`ShmBatch.key_offsets` and
/// `fields`), from the member tables' layouts: a client that gets them parses no TAR header. A
/// batch with any sample of a shard without a layout carries none (the client parses them all).
struct Located<'a> {
    fields: &'a [String],
    ok: bool,
    key_offsets: Vec<u32>,
    key_lengths: Vec<u32>,
    columns: Vec<FieldColumn>,
    /// The shard field index of each stream field, for the shard last seen (a lookup by name per
    /// shard switch, not per sample and field).
    map: (Option<usize>, Vec<Option<usize>>),
}

impl<'a> Located<'a> {
    fn new(fields: &'a [String], n: usize) -> Self {
        let column = |name: &String| FieldColumn {
            name: name.clone(),
            starts: Vec::with_capacity(n),
            lengths: Vec::with_capacity(n),
            missing: Vec::new(),
        };
        Self {
            fields,
            ok: true,
            key_offsets: Vec::with_capacity(n),
            key_lengths: Vec::with_capacity(n),
            columns: fields.iter().map(column).collect(),
            map: (None, Vec::new()),
        }
    }

    fn add(&mut self, table: &crate::format::ShardTable, shard: usize, local: u64) {
        if !self.ok {
            return;
        }
        if self.map.0 != Some(shard) {
            let names = table.fields();
            self.map = (Some(shard), self.fields.iter().map(|f| names.iter().position(|n| n == f)).collect());
        }
        let i = self.key_offsets.len() as u32;
        let to_u32 = |r: &std::ops::Range<usize>| Some((u32::try_from(r.start).ok()?, u32::try_from(r.len()).ok()?));
        let Some((ko, kl)) = table.key_at(local).as_ref().and_then(to_u32) else {
            self.ok = false;
            return;
        };
        self.key_offsets.push(ko);
        self.key_lengths.push(kl);
        for (col, f) in self.columns.iter_mut().zip(&self.map.1) {
            let at = match f {
                Some(f) => match table.field_at(local, *f) {
                    Some(at) => at,
                    None => {
                        self.ok = false;
                        return;
                    }
                },
                None => None,
            };
            match at {
                Some(r) => {
                    col.starts.push(r.start as u64);
                    col.lengths.push(r.len() as u64);
                }
                None => {
                    col.starts.push(0);
                    col.lengths.push(0);
                    col.missing.push(i);
                }
            }
        }
    }

    fn finish(self, b: &mut ShmBatch) {
        if self.ok && self.key_offsets.len() == b.slots.len() {
            b.key_offsets = self.key_offsets;
            b.key_lengths = self.key_lengths;
            b.fields = self.columns;
        }
    }
}

/// Gathers one batch into a ring slot for a packed shm client (blocking), with the `credit` its
/// turn took ([`Session::take_turn`]). The stream's working set is locked only to find the
/// samples' shards, so the next batch can be gathered meanwhile.
#[allow(clippy::too_many_arguments)]
fn build_packed_batch<'s>(
    ds: &Dataset,
    working: &std::sync::Mutex<Working>,
    session: &'s Session,
    credit: transport::shm::Credit<'s>,
    fields: &[String],
    ids: &[u64],
    index: u64,
    cancelled: &dyn Fn() -> bool,
) -> Result<((StreamMessage, u64), std::time::Duration)> {
    let (samples, waited) = {
        let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
        working.preload(ds, ids)?;
        let mut current = None;
        let samples = ids.iter().map(|&id| sample_of(ds, &mut working, id, &mut current)).collect::<Result<Vec<_>>>();
        working.end_batch();
        (samples?, working.take_wait())
    };
    let g = packed::gather(fields, &samples, index, |need| session.acquire_slot(credit, need, cancelled))?;
    let batch = PackedBatch { batch_index: index, ring: g.guard.ring(), slot: g.guard.slot(), keys: g.keys };
    let payload = g.payload_bytes;
    g.guard.publish(index);
    Ok(((StreamMessage { kind: Some(stream_message::Kind::PackedBatch(batch)) }, payload), waited))
}

/// Reads a Parquet dataset's files through a stream's working set (opened, verified against the
/// manifest's CRC and pinned on first use, like TAR shards).
struct WorkingFiles<'a> {
    ds: &'a Dataset,
    working: std::sync::Mutex<&'a mut Working>,
}

impl crate::format::parquet::dataset::FileReader for WorkingFiles<'_> {
    fn read_at(&self, file: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let mut working = self.working.lock().unwrap_or_else(|p| p.into_inner());
        working.get(self.ds, file)?.file.read_exact_at(buf, offset)
    }
}

/// Builds one Arrow batch of a Parquet dataset (blocking): the rows `ids`, decoded through the
/// daemon's shared row-group cache, as an IPC stream inline, in a ring slot (shm), or written
/// into a slot of the client's ring (rdma).
#[allow(clippy::too_many_arguments)]
fn build_arrow_batch(
    ds: &Dataset,
    working: &std::sync::Mutex<Working>,
    session: Option<&Session>,
    rdma: Option<&transport::rdma::RdmaPipe>,
    turn: u64,
    asm: &BatchAssembler,
    projected: Option<&projected::ProjectedReads>,
    ids: Vec<u64>,
    index: u64,
    parts: &[(u64, u32)],
    cancelled: &dyn Fn() -> bool,
    before_new_ring: &mut dyn FnMut() -> Result<()>,
) -> Result<((StreamMessage, u64), std::time::Duration)> {
    // The turn first: shm batches are published in order.
    let credit = session.map(|s| s.take_turn(turn, cancelled)).transpose()?;
    let places = asm.places(&ids)?;
    // One row id per file the batch draws on, from the row groups it draws on (not per row).
    let touched = asm.first_row_per_file(&places);
    let (rows, waited) = if let Some(pr) = projected {
        // Only the selected column chunks: no whole file is opened. Every file the batch draws
        // on is verified first (its footer, once), as below.
        let started = Instant::now();
        for &id in &touched {
            if let Some((shard, _)) = ds.locate(id) {
                ds.verify_remote_footer(shard)?;
            }
        }
        let reader = pr.reader();
        let rows = asm.rows_at(places, &ids, &reader)?;
        let waited = if reader.fetched() { started.elapsed() } else { std::time::Duration::ZERO };
        (rows, waited)
    } else {
        let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
        working.preload(ds, &touched)?;
        // Every file the batch draws on is opened (and verified against the manifest) even when
        // its row groups are already decoded: a decoded row group never stands in for a check.
        for &id in &touched {
            if let Some((shard, _)) = ds.locate(id) {
                working.get(ds, shard)?;
            }
        }
        let rows = asm.rows_at(places, &ids, &WorkingFiles { ds, working: std::sync::Mutex::new(&mut working) });
        working.end_batch();
        (rows?, working.take_wait())
    };
    let mut msg = match (session, credit) {
        (None, _) if let Some(pipe) = rdma => {
            let (slot, length, ()) =
                rdma_post(pipe, index, |buf| Ok((transport::arrow::write_rows(asm, &rows, buf)?, ())))?;
            ArrowBatch { batch_index: index, row_ids: ids, slot, length: length as u64, ..Default::default() }
        }
        (Some(s), Some(credit)) => {
            let (guard, msg) = transport::arrow::shm_rows(index, ids, asm, &rows, |need| {
                if s.needs_ring(need) {
                    before_new_ring()?;
                }
                s.acquire_slot(credit, need, cancelled)
            })?;
            guard.publish(index);
            msg
        }
        _ => {
            let msg = transport::arrow::inline_rows(index, ids, asm, &rows)?;
            if msg.data.len() as u64 > inline::payload_limit() {
                return Err(Error::invalid(format!(
                    "an Arrow batch of {} bytes does not fit an inline message ({}); use a smaller batch_size \
                     or fewer fields",
                    msg.data.len(),
                    inline::limit_text()
                )));
            }
            msg
        }
    };
    if parts.len() > 1 {
        (msg.part_indices, msg.part_rows) = parts.iter().copied().unzip();
    }
    // The IPC stream's length: what crosses to the client, shm or inline.
    let bytes = msg.length;
    Ok(((StreamMessage { kind: Some(stream_message::Kind::ArrowBatch(msg)) }, bytes), waited))
}

/// Largest estimated batch (rows x the dataset's stored bytes per row) served by
/// [`SmallArrowStream`]: such a batch is built in about 100 us, where each thread hand-off costs
/// tens. Larger batches keep the two-batch pipeline, which puts both cores on their copies.
const SMALL_ARROW_BATCH_BYTES: u64 = 1 << 20;

/// A dataset's stored bytes per row (per sample), what batch sizes are judged by.
fn stored_bytes_per_row(ds: &Dataset) -> u64 {
    ds.total_bytes().checked_div(ds.num_samples()).unwrap_or(0)
}

fn small_batches(ds: &Dataset, batch_size: u64) -> bool {
    stored_bytes_per_row(ds).saturating_mul(batch_size) <= SMALL_ARROW_BATCH_BYTES
}

/// An Arrow (Parquet) stream of small batches, served by one blocking thread that takes the ids,
/// builds each message and queues it in turn, up to [`SMALL_GROUP`] messages at once. Over shared
/// memory or rdma a message carries up to [`MAX_BATCHES_PER_MESSAGE`] consecutive batches of the
/// stream (as many as the client accepts), one record batch in one ring slot, which the client
/// cuts by the part counts.
///
/// The general loop of [`produce`] hands every batch to the blocking pool and back (plus a trip
/// for its ids): with 256 rows of 40 bytes those hand-offs were the largest share of the daemon's
/// time, larger than the gather itself (bench/PARQUET_PROFILE.md). Here a batch costs one
/// hand-off, to the connection's task that writes the message, and batches built back to back
/// share it ([`outbox`]). The first batch goes alone (time to first batch), and a group is sent
/// before anything that would wait on the client: a turn without a free slot, or a new ring
/// (its budget may wait for this stream's own slots); over rdma, where every batch holds a credit
/// of the client's ring, each message goes at once. Behaviour is the general loop's otherwise:
/// batches in order, the client leaving or a shutdown ends the stream before the next batch, an
/// error is sent to the client after the batches before it and ends the stream.
struct SmallArrowStream {
    dataset: Arc<Dataset>,
    session: Option<Arc<Session>>,
    /// The stream's rdma sender, when the batches go into the client's registered ring.
    rdma: Option<Arc<transport::rdma::RdmaPipe>>,
    asm: Arc<BatchAssembler>,
    projected: Option<Arc<projected::ProjectedReads>>,
    sequence: plan::RankStream,
    batch_size: u64,
    tx: outbox::Outbox,
    metrics: Arc<Metrics>,
    /// The prefetcher follows the stream while this lives.
    consumer: Option<ConsumerGuard>,
    shutdown: CancellationToken,
    /// Most batches one message carries ([`MAX_BATCHES_PER_MESSAGE`]).
    parts: usize,
}

impl SmallArrowStream {
    fn run(mut self, ranges: impl Iterator<Item = std::ops::Range<u64>>) {
        let mut ranges = ranges.peekable();
        let working = std::sync::Mutex::new(Working::default());
        let mut ready: std::collections::VecDeque<ReadyBatch> = std::collections::VecDeque::new();
        let mut group: Vec<outbox::Message> = Vec::with_capacity(SMALL_GROUP);
        let mut sent_any = false;
        let mut turn = 0u64;
        loop {
            if self.tx.is_closed() {
                return;
            }
            if self.shutdown.is_cancelled() {
                // As the general loop: the client learns unless its queue is full, when the
                // stream ends short of its header's batch count.
                group.push(Err(Status::unavailable("daemon is shutting down")));
                self.tx.try_send_all(group);
                return;
            }
            // The first batch goes alone (time to first batch); later ones share a message (one
            // ring slot) over shared memory or rdma, up to the client's and the message's limits.
            // Inline, one a message.
            let most = if sent_any && (self.session.is_some() || self.rdma.is_some()) { self.parts } else { 1 };
            let mut batches = match self.take_batches(&mut ready, &mut ranges, most) {
                Ok(b) if b.is_empty() => break,
                Ok(b) => b,
                Err(e) => return self.fail(group, e),
            };
            let parts: Vec<(u64, u32)> =
                batches.iter().map(|(r, ids)| (r.start / self.batch_size, ids.len() as u32)).collect();
            let end = batches.last().map_or(0, |(r, _)| r.end);
            let ids: Vec<u64> = match batches.len() {
                1 => batches.pop().map(|(_, ids)| ids).unwrap_or_default(),
                _ => batches.into_iter().flat_map(|(_, ids)| ids).collect(),
            };
            let rows = ids.len() as u64;
            let (tx, stop) = (&self.tx, &self.shutdown);
            let cancelled = || tx.is_closed() || stop.is_cancelled();
            let mut send_group = || -> Result<()> {
                tx.blocking_send_all(std::mem::take(&mut group))
                    .map_err(|_| Error::Unavailable("the client went away".into()))
            };
            let started = Instant::now();
            let built = build_arrow_batch(
                &self.dataset,
                &working,
                self.session.as_deref(),
                self.rdma.as_deref(),
                turn,
                &self.asm,
                self.projected.as_deref(),
                ids,
                parts[0].0,
                &parts,
                &cancelled,
                &mut send_group,
            );
            // Turns are this thread's messages, in order (a message may carry several batches).
            turn += 1;
            self.metrics
                .read_wait_us
                .fetch_add(started.elapsed().as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
            match built {
                Ok(((msg, bytes), waited)) => {
                    group.push(Ok(msg));
                    self.metrics.batch_served(rows, bytes);
                    if let Some(c) = &self.consumer {
                        c.consumer.advance(end, waited);
                    }
                }
                Err(e) => return self.fail(group, e),
            }
            // Over rdma every batch holds a credit the client returns only once it has the
            // batch's message: a message held back here could leave the next batch waiting for
            // a credit that cannot come, so each goes at once.
            let next_waits = self.session.as_ref().is_some_and(|s| !s.credit_free()) || self.rdma.is_some();
            if !sent_any || group.len() >= SMALL_GROUP || next_waits {
                if !self.send(std::mem::take(&mut group)) {
                    return;
                }
                sent_any = true;
            }
        }
        self.send(group);
    }

    /// The stream's next batches for one message: at most `most` (at least one), and more than
    /// one only while their rows fit [`MESSAGE_ROWS_BYTES`]. Empty at the end.
    fn take_batches(
        &mut self,
        ready: &mut std::collections::VecDeque<ReadyBatch>,
        ranges: &mut std::iter::Peekable<impl Iterator<Item = std::ops::Range<u64>>>,
        most: usize,
    ) -> Result<Vec<ReadyBatch>> {
        let most = most.max(1);
        let per_row = stored_bytes_per_row(&self.dataset).max(1);
        let mut taken: Vec<ReadyBatch> = Vec::with_capacity(most);
        let mut rows = 0u64;
        while taken.len() < most {
            if ready.is_empty() {
                ready.extend(ids_of(&mut self.sequence, next_ranges(ranges, IDS_AHEAD))?);
            }
            let Some((_, ids)) = ready.front() else { break };
            rows += ids.len() as u64;
            if !taken.is_empty() && rows.saturating_mul(per_row) > MESSAGE_ROWS_BYTES {
                break;
            }
            taken.extend(ready.pop_front());
        }
        Ok(taken)
    }

    /// Queues `group` (blocking); false when the client left.
    fn send(&self, group: Vec<outbox::Message>) -> bool {
        fail_point!("stream-send", |_| false);
        if self.tx.blocking_send_all(group).is_err() {
            tracing::debug!("client left mid-stream");
            return false;
        }
        true
    }

    fn fail(&self, mut group: Vec<outbox::Message>, e: Error) {
        tracing::warn!(dataset = %self.dataset.url, error = %e, "stream failed");
        group.push(Err(to_status(e)));
        let _ = self.tx.blocking_send_all(group);
    }
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
        self.authorize(&request, &request.get_ref().url)?;
        let req = request.into_inner();
        check_protocol(req.protocol_version)?;
        let ds = self.open(req.url, req.cache).await.map_err(to_status)?;
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
        self.authorize(&request, &request.get_ref().url)?;
        let req = request.into_inner();
        let ds = self.open(req.url.clone(), req.cache.clone()).await.map_err(to_status)?;
        let hub = self.shm.clone().filter(|_| same_host);
        let rdma = self.rdma.clone();
        let prefetch = self.prefetch.clone();
        let uses = self.uses.clone();
        let plan = blocking(move || plan_stream(ds, &req, hub.as_deref(), rdma.as_ref(), prefetch.as_ref(), &uses))
            .await
            .map_err(to_status)?;
        let (tx, rx) = outbox::channel(STREAM_QUEUE);
        let header = StreamMessage { kind: Some(stream_message::Kind::Header(plan.header.clone())) };
        tx.send(Ok(header)).await.map_err(|_| Status::cancelled("client went away"))?;
        let metrics = self.metrics.clone();
        let shutdown = self.shutdown.clone();
        tokio::spawn(produce(plan, tx, metrics, shutdown));
        Ok(Response::new(rx))
    }

    async fn status(&self, request: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        crate::limits::check_request("Status", request.get_ref())?;
        let m = &self.metrics;
        let prefetch = self.prefetch.as_ref().map(|p| p.status()).unwrap_or_default();
        let datasets = self
            .registry
            .all()
            .iter()
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
            rdma_provider: self.rdma.as_ref().map(|h| h.opened.clone()).unwrap_or_default(),
            rdma_streams: self.rdma.as_ref().map_or(0, |h| h.streams.load(std::sync::atomic::Ordering::Relaxed)),
            rdma_ring_bytes: self.rdma.as_ref().map_or(0, |h| h.ring_bytes.load(std::sync::atomic::Ordering::Relaxed)),
            cache: self.registry.backends().cache.as_ref().map(|c| {
                let s = c.stats();
                CacheStatus {
                    capacity_bytes: s.capacity,
                    used_bytes: s.used,
                    shards: s.shards,
                    hits: s.hits,
                    misses: s.misses,
                    evictions: s.evictions,
                    filled_bytes: s.filled_bytes,
                    high_water_bytes: s.high_water,
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
        self.authorize(&request, &request.get_ref().url)?;
        let req = request.into_inner();
        check_protocol(req.protocol_version)?;
        stage::stage(self.registry.clone(), req).await.map(Response::new)
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
    if let Some(asm) = arrow.clone().filter(|_| small_batches(&dataset, batch_size)) {
        let stream = SmallArrowStream {
            dataset,
            session,
            rdma: rdma.clone(),
            asm,
            projected,
            sequence,
            batch_size,
            tx,
            metrics: metrics.clone(),
            consumer,
            shutdown,
            parts: batches_per_message,
        };
        if let Err(e) = tokio::task::spawn_blocking(move || stream.run(batches)).await {
            tracing::warn!(error = %e, "stream task failed");
        }
        return linger_for_credits(rdma);
    }
    let shared = Arc::new((dataset, fields, session, std::sync::Mutex::new(Working::default()), arrow, projected));
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
                    &cancelled,
                    &mut || Ok(()),
                )
                .map(|((msg, bytes), waited)| ((vec![msg], bytes), waited));
            }
            let ids = &ids[..];
            if let (Some(s), true) = (session, packed) {
                let credit = s.take_turn(turn, &cancelled)?;
                return build_packed_batch(ds, working, s, credit, fields, ids, index, &cancelled)
                    .map(|((msg, bytes), waited)| ((vec![msg], bytes), waited));
            }
            let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
            let built = match (session, &rdma) {
                (Some(s), _) => {
                    build_shm_batch(ds, &mut working, s, fields, ids, index, &cancelled).map(|(m, b)| (vec![m], b))
                }
                (None, Some(r)) => {
                    build_rdma_batch(ds, &mut working, fields, all_fields, ids, index, r).map(|(m, b)| (vec![m], b))
                }
                (None, None) => build_batch(ds, &mut working, fields, all_fields, ids, index),
            };
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
                        tracing::warn!(dataset = %shared.0.url, error = %e, "stream failed");
                        let _ = tx.send(Err(to_status(e))).await;
                        return;
                    }
                }
            }
            let Some((range, ids)) = ready.pop_front() else { break };
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
                // queue is full the client still learns: the stream ends short of its header's
                // batch count.
                tx.try_send(Err(Status::unavailable("daemon is shutting down")));
                return;
            }
            _ = tx.closed() => return,
        };
        metrics.read_wait_us.fetch_add(started.elapsed().as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
        match built {
            Ok(((messages, bytes), waited)) => {
                let mut samples = 0;
                for msg in messages {
                    samples += match &msg.kind {
                        Some(stream_message::Kind::InlineBatch(b)) => b.keys.len() as u64,
                        Some(stream_message::Kind::ShmBatch(b)) => b.slots.len() as u64,
                        Some(stream_message::Kind::PackedBatch(b)) => b.keys.len() as u64,
                        Some(stream_message::Kind::ArrowBatch(b)) => b.row_ids.len() as u64,
                        Some(stream_message::Kind::RdmaBatch(b)) => b.keys.len() as u64,
                        _ => 0,
                    };
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
                tracing::warn!(dataset = %shared.0.url, error = %e, "stream failed");
                let _ = tx.send(Err(to_status(e))).await;
                return;
            }
        }
    }
    drop(tx);
    linger_for_credits(rdma);
}

/// rdma: the endpoint must outlive the last batch until the client has taken it (closing it
/// earlier can reset the connection under the last write). The client returns the last credits
/// only once its consumer drops those batches, which it may do only after the stream ended: so
/// the stream ends (its sender of messages already dropped) and the endpoint lives on in the
/// background until every credit is back or the client is gone (bounded by the stall time).
fn linger_for_credits(rdma: Option<Arc<transport::rdma::RdmaPipe>>) {
    if let Some(r) = rdma {
        tokio::task::spawn_blocking(move || {
            if let Err(e) = r.lock().and_then(|mut s| s.sender.drain().map_err(|e| Error::Unavailable(e.to_string()))) {
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
