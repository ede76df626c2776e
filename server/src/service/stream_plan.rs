//! A stream request checked and turned into what its producer needs: the fields, the rank's
//! sequence positioned at this worker's first batch, the transport and its session, the Parquet
//! batch assembler, and the prefetcher's view of the epoch.

use std::sync::Arc;

use shardstream_proto::{Collate, StreamHeader, StreamRequest, Transport};

use super::{
    DEFAULT_SHUFFLE_WINDOW, MAX_BATCH_SIZE, MAX_BATCHES_PER_MESSAGE, MAX_PLAN_IDS, MAX_WORKERS, projected, uses,
};
use crate::format::parquet::dataset::BatchAssembler;
use crate::index::{CacheMode, Dataset, LargestSample};
use crate::plan::{self, EpochParams, WorkerParams};
use crate::prefetch::{ConsumerGuard, Prefetcher};
use crate::transport::shm::{Session, ShmHub};
use crate::transport::{self, inline};
use crate::{Error, Result};

/// The most (sample, field) locations a TAR batch may hold: 64 Mi, 1 GiB of them (a million
/// samples of 64 fields).
const MAX_BATCH_LOCATIONS: u64 = 1 << 26;

/// A validated stream request.
pub(super) struct StreamPlan {
    pub(super) dataset: Arc<Dataset>,
    pub(super) fields: Vec<String>,
    pub(super) all_fields: bool,
    /// The rank's sequence, produced on demand and already positioned at this worker's first
    /// batch: O(window + batch) ids held, not the rank's whole share.
    pub(super) sequence: plan::RankStream,
    pub(super) batches: plan::WorkerBatches,
    pub(super) batch_size: u64,
    pub(super) header: StreamHeader,
    pub(super) session: Option<Arc<Session>>,
    /// Shared-memory batches are gathered into ring slots (collate = stack).
    pub(super) packed: bool,
    /// The prefetcher follows this stream while it lives (datasets read through the cache).
    pub(super) consumer: Option<ConsumerGuard>,
    /// Parquet datasets: how this stream's Arrow batches are made (its columns, checked against
    /// every file when the stream is planned).
    pub(super) arrow: Option<Arc<BatchAssembler>>,
    /// S3 Parquet streams that read only their columns' chunks.
    pub(super) projected: Option<Arc<projected::ProjectedReads>>,
    /// TRANSPORT_RDMA: the sender writing into the client's ring.
    pub(super) rdma: Option<transport::rdma::RdmaStream>,
    /// Arrow streams: most batches one message may carry (the client's limit and the daemon's).
    pub(super) batches_per_message: usize,
    /// Packed batches carry their keys joined (`StreamRequest.packed_keys_joined`).
    pub(super) joined_keys: bool,
    /// Inline Arrow batches beyond one message go as parts the client joins
    /// (`StreamRequest.arrow_parts_joined`).
    pub(super) split_inline: bool,
}

/// What streams plan once for all of them: the rank futures the prefetcher follows (shared by a
/// rank's workers), the column-chunk copies of a projection (shared by every stream reading it);
/// and who asks, which shared state counts.
#[derive(Clone, Copy)]
pub(super) struct Shared<'a> {
    pub uses: &'a uses::UsesCache,
    pub copies: &'a projected::CopyPlans,
    /// The uid of a client on the Unix socket (shm sessions are counted per uid).
    pub uid: Option<u32>,
}

pub(super) fn plan_stream(
    ds: Arc<Dataset>,
    req: &StreamRequest,
    shm: Option<&ShmHub>,
    rdma_hub: Option<&Arc<transport::rdma::RdmaHub>>,
    prefetch: Option<&Arc<Prefetcher>>,
    shared: Shared<'_>,
    cancelled: &dyn Fn() -> bool,
) -> Result<StreamPlan> {
    if req.batch_size == 0 || req.batch_size > MAX_BATCH_SIZE {
        return Err(Error::invalid(format!("batch_size {} must be between 1 and {MAX_BATCH_SIZE}", req.batch_size)));
    }
    if req.num_workers > MAX_WORKERS {
        return Err(Error::invalid(format!("num_workers {} exceeds {MAX_WORKERS}", req.num_workers)));
    }
    if !req.expected_fingerprint.is_empty() && req.expected_fingerprint != ds.fingerprint {
        return Err(Error::invalid(format!(
            "dataset {} changed since the loader opened it or saved its resume state (fingerprint {} now, {} \
             then; writing or removing its manifest.json with `shardstream index` changes it too): every rank \
             of an epoch, and a resume, must stream the same shards; make the loaders (and checkpoints) anew to \
             use the new shards",
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
    let summary = plan::summarize(&plan_units, &params).map_err(|e| match e {
        // The plan counts its units (a Parquet file's row groups, none in an empty file); the
        // user listed files.
        plan::PlanError::EmptyDataset { .. } => no_samples(&ds),
        e => e.into(),
    })?;
    let mut sequence = plan::RankStream::bounded(&plan_units, &params, MAX_PLAN_IDS)?;
    let worker = WorkerParams { num_workers: req.num_workers.max(1), worker: req.worker, start_batch: req.start_batch };
    let batches = plan::WorkerBatches::new(sequence.len(), req.batch_size, &worker)?;
    let start = batches.peek().map_or(sequence.len(), |b| b.start);
    let arrow = match &ds.parquet {
        Some(pq) => {
            let selected: &[String] = if req.fields.is_empty() { &[] } else { &fields };
            let asm = assembler(&ds, pq, selected)?.with_window(params.window_shards);
            let asm = if req.arrow_binary_views { asm.with_binary_views()? } else { asm };
            // Row groups decoded for views, and others decoded a second time, are kept on the
            // node's disk, for this daemon and the next one (see `format::parquet::kept`).
            let asm = match ds.node_cache() {
                Some(nc) if nc.keeps_derived() => {
                    let kept = super::kept::NodeKept::new(nc.clone(), ds.clone(), asm.projection_id());
                    asm.with_kept(Arc::new(kept))
                }
                _ => asm,
            };
            Some(Arc::new(asm))
        }
        None if req.arrow_binary_views => {
            return Err(Error::invalid(format!(
                "binary_views is for Parquet datasets; {} is a {:?} dataset",
                ds.url, ds.format
            )));
        }
        None => None,
    };
    // An S3 Parquet stream that selects a fraction of the columns caches and fetches only their
    // column chunks (see `projected`); the others read whole files through the node cache.
    let projected = match &arrow {
        Some(asm) => projected::ProjectedReads::plan(&ds, asm, shared.copies)?.map(Arc::new),
        None => None,
    };
    let consumer = match prefetch {
        Some(p) if ds.mode == CacheMode::Copy => {
            // This epoch's future, then the next epoch's (a trainer moves on with the same
            // parameters), so eviction at the end of this epoch keeps what the next one needs first.
            // Each is one streamed walk of its plan (O(window + shards) memory), done once per
            // rank and epoch and shared by the rank's workers.
            let next = EpochParams { epoch: params.epoch.wrapping_add(1), ..params };
            // A stream caching a row group at a time is fetched for by its row groups' uses.
            let by_unit = projected.as_ref().is_some_and(|p| p.per_row_group());
            let (this_epoch, next_epoch) = (
                shared.uses.uses(&ds, &plan_units, &params, by_unit)?,
                shared.uses.uses(&ds, &plan_units, &next, by_unit)?,
            );
            let uses = crate::prefetch::Future::new(this_epoch, next_epoch, sequence.len());
            let fetch = projected.clone().map(|p| p as Arc<dyn crate::prefetch::ProjectedFetch>);
            Some(p.register(ds.clone(), uses, start, req.rank, req.worker, fetch))
        }
        _ => None,
    };
    // A resumed stream skips the batches already delivered (and the other workers') here, on the
    // blocking pool, so its first batch is not held up in the stream task.
    sequence.skip_to(start)?;
    let transport = transport::negotiate(req.transport, shm.is_some())?;
    if req.arrow_binary_views && transport != Transport::Shm {
        // Views point into memory the client maps: no other transport can carry them.
        return Err(Error::invalid(format!(
            "binary_views needs the shared-memory transport (same host); this stream's transport is {}",
            format!("{transport:?}").to_lowercase()
        )));
    }
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
            let shard = ds.shards.get(l.shard).map_or("?", |s| s.name.as_str());
            return Err(Error::invalid(format!(
                "transport \"rdma\": sample {} of shard {shard} ({} bytes) does not fit the client's {}-byte ring \
                 slots: set SHARDSTREAM_RDMA_SLOT_BYTES on the trainer to at least that (1 GiB at most), or use \
                 transport=\"inline\"",
                l.local, l.bytes, offer.slot_bytes
            )));
        }
        if batch.saturating_mul(avg) > offer.slot_bytes / 2 {
            return Err(Error::invalid(format!(
                "transport \"rdma\": batches of {batch} x ~{avg} bytes need ring slots larger than the client's {} bytes: \
                 raise SHARDSTREAM_RDMA_SLOT_BYTES on the trainer (twice a batch, 1 GiB at most) or lower batch_size",
                offer.slot_bytes
            )));
        }
        Some(hub.open_stream(offer, cancelled)?)
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
    // A TAR batch that is not packed records where each of its samples' fields lies (16 bytes a
    // sample and field, built whole before it is sent): a dataset of many distinct fields, read
    // whole with a large batch_size, would have had the daemon allocate that at once (and abort).
    let per_batch = u64::from(req.batch_size).min(sequence.len());
    let locations = (fields.len() as u64).saturating_mul(per_batch);
    if ds.parquet.is_none() && !packed && locations > MAX_BATCH_LOCATIONS {
        return Err(Error::invalid(format!(
            "batch_size {} with {} fields of dataset {} is {locations} field locations a batch, more than the \
             {MAX_BATCH_LOCATIONS} one may hold: select fields (fields=[...]) or a smaller batch_size",
            req.batch_size,
            fields.len(),
            ds.url
        )));
    }
    let session = match (transport, shm) {
        (Transport::Shm, Some(hub)) => {
            Some(hub.new_session(if packed { hub.config.ring_slots } else { hub.config.credits }, shared.uid)?)
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
        arrow_binary_views: arrow.as_ref().is_some_and(|a| a.binary_views()),
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
        joined_keys: req.packed_keys_joined,
        split_inline: req.arrow_parts_joined,
    })
}

/// The assembler of the Parquet dataset `ds` (`pq`) for the columns `fields` (empty: all of
/// them), before any stream's options: its projection is what streams and `Prefetch` key their
/// column-chunk copies by.
pub(super) fn assembler(
    ds: &Dataset,
    pq: &Arc<crate::format::parquet::dataset::ParquetDataset>,
    fields: &[String],
) -> Result<BatchAssembler> {
    let projection = pq.projection((!fields.is_empty()).then_some(fields))?;
    let cache = crate::format::parquet::decoded::shared();
    // The URL too: two copies of a dataset share a fingerprint, not their bytes' checks.
    let id = format!("{}@{}", ds.fingerprint, ds.url);
    BatchAssembler::new(pq.clone(), projection, cache, &id)
}

/// Refuses an inline stream with a sample larger than any message before it starts, naming the
/// sample so it can be found. A batch of many samples beyond the limit is split over several
/// messages instead (see [`build_batch`](super::batches::build_batch)).
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
pub(super) fn oversized_sample(ds: &Dataset, l: LargestSample, limit: &str) -> Error {
    let shard = ds.shards.get(l.shard).map_or_else(|| format!("#{}", l.shard), |m| m.url());
    let at = l.offset.map(|o| format!(" (at byte {o})")).unwrap_or_default();
    Error::invalid(format!(
        "sample {} of shard {shard}{at} is {} bytes, larger than {limit}; read it over shared memory \
         (transport=\"shm\", same host) or split the sample",
        l.local, l.bytes,
    ))
}

/// "No samples", naming the files that hold none (the first few).
pub(super) fn no_samples(ds: &Dataset) -> Error {
    let n = ds.shards.len();
    let mut named: Vec<&str> = ds.shards.iter().take(3).map(|s| s.name.as_str()).collect();
    if n > named.len() {
        named.push("...");
    }
    let what = if n == 1 { "1 file holds".to_owned() } else { format!("{n} files hold") };
    Error::invalid(format!("the dataset has no samples: its {what} none ({})", named.join(", ")))
}
