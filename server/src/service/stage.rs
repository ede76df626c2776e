//! `Prefetch`: stages a dataset into the node cache before training starts (SLURM prologs,
//! Kubernetes init containers), in the order an epoch will first use its shards, so that even a
//! partial staging (`max_shards`, or a cache smaller than the dataset) holds what is needed first.
//! Staging evicts nobody else's data: when the cache has no free room it makes room only from the
//! dataset's own idle copies needed later in the order (opening a dataset without a manifest
//! indexes every shard through the cache, which keeps whichever fit, and reports how far it has
//! come while it does: [`crate::index::opening`]), and stops, saying so, when
//! those do not make enough. With `fields` (Parquet), it stages what a stream selecting those
//! columns reads: on S3, each file's copy of their column chunks ([`super::projected`]), or each
//! row group's, in the order the epoch first reads them, when the node cache cannot hold every
//! file's; else whole files as without. Without `fields`, whole files, or the row groups' copies
//! of every column where a stream reads them so ([`ProjectedReads::plan`]).

use std::sync::Arc;

use shardstream_proto::{PrefetchProgress, PrefetchRequest};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::projected::{CopyPlans, ProjectedReads};
use super::{DEFAULT_SHUFFLE_WINDOW, blocking, to_status};
use crate::cache::Want;
use crate::index::{CacheMode, Dataset, Registry};
use crate::plan::{self, EpochParams};
use crate::{Error, Result};

/// Shards staged at once: each is itself fetched with parallel ranged GETs, so a few in flight
/// keep the link busy between one shard's last part and the next shard's first.
const STAGE_PARALLEL: usize = 4;

/// Times a shard's staging makes room and fetches into it before it takes the cache as full.
const STAGE_ATTEMPTS: usize = 3;

/// What an epoch (one consumer, the whole dataset) uses, in order of first use: its shards, or
/// with `by_unit` its plan's units (a Parquet dataset's row groups).
fn epoch_order(ds: &Dataset, req: &PrefetchRequest, by_unit: bool) -> Result<Vec<usize>> {
    let params = EpochParams {
        seed: req.seed,
        epoch: req.epoch,
        shuffle: req.shuffle,
        window_shards: if req.shuffle_window == 0 { DEFAULT_SHUFFLE_WINDOW } else { req.shuffle_window },
        world_size: 1,
        rank: 0,
        batch_size: 1,
        drop_last: false,
    };
    let units = ds.plan_units();
    // Streamed: the whole dataset's order would be O(N) ids held at once.
    let mut seq = plan::RankStream::bounded(&units, &params, super::MAX_PLAN_IDS)?;
    // By first use; a Parquet file has a stretch of use per group of its row groups, and is
    // staged at its first.
    let count = if by_unit { units.len() } else { ds.shards.len() };
    let mut seen = vec![false; count];
    let mut order: Vec<usize> = Vec::with_capacity(count);
    for u in crate::prefetch::uses_streamed(ds, &mut seq, 0, by_unit)? {
        let i = u.shard as usize;
        if seen.get(i).is_some_and(|s| !s) {
            seen[i] = true;
            order.push(i);
        }
    }
    // Shards without samples never appear in an order; stage them last all the same.
    order.extend((0..count).filter(|&i| !seen[i]));
    Ok(order)
}

/// What staging puts in the node cache, item by item (the progress counts items).
enum Staging {
    /// Whole shards, as streams without a column selection (and every TAR stream) read them.
    /// An item is a shard.
    Whole,
    /// The copies of the selected column chunks a stream selecting them reads: an item is a
    /// copy, each file's or, in a node cache too small for those, each row group's.
    Columns(ProjectedReads),
}

impl Staging {
    /// What a stream selecting `fields` (empty: all) of `ds` reads. Staging builds its plan of
    /// copies for itself (`CopyPlans::default()`): it runs once, before the streams that share
    /// theirs, and the copies' keys are the same either way.
    fn of(ds: &Arc<Dataset>, fields: &[String]) -> Result<Self> {
        if fields.is_empty() {
            // Every column of a Parquet dataset: whole files, unless the node cache is too small
            // for them and they are read a row group at a time (see `ProjectedReads::plan`).
            let Some(pq) = ds.parquet.as_ref().filter(|_| ProjectedReads::remote(ds)) else {
                return Ok(Staging::Whole);
            };
            let asm = super::stream_plan::assembler(ds, pq, &[])?;
            return Ok(match ProjectedReads::plan(ds, &asm, &CopyPlans::default())? {
                Some(reads) if reads.per_row_group() => Staging::Columns(reads),
                _ => Staging::Whole,
            });
        }
        let Some(pq) = &ds.parquet else {
            return Err(Error::invalid(format!(
                "fields select the columns of a Parquet dataset; {} is a {:?} dataset, whose shards are staged \
                 whole (leave the fields out)",
                ds.url, ds.format
            )));
        };
        // A stream's assembler, for the same copies' keys (a stream drops repeated names too).
        let mut seen = std::collections::HashSet::new();
        let fields: Vec<String> = fields.iter().filter(|f| seen.insert(*f)).cloned().collect();
        let asm = super::stream_plan::assembler(ds, pq, &fields)?;
        Ok(ProjectedReads::plan(ds, &asm, &CopyPlans::default())?.map_or(Staging::Whole, Staging::Columns))
    }

    /// The items in the order an epoch first reads them.
    fn order(&self, ds: &Dataset, req: &PrefetchRequest) -> Result<Vec<usize>> {
        match self {
            Staging::Whole => epoch_order(ds, req, false),
            // Each use (a file, or a row group) names a copy; a file copied whole a row group
            // at a time is named by each of its row groups, and staged once.
            Staging::Columns(reads) => {
                let mut seen = std::collections::HashSet::new();
                Ok(epoch_order(ds, req, reads.per_row_group())?
                    .into_iter()
                    .filter_map(|n| reads.copy_of_use(n))
                    .filter(|&c| seen.insert(c))
                    .collect())
            }
        }
    }

    /// What the progress counts, as `PrefetchProgress.unit` says it: empty for shards.
    fn unit(&self) -> &'static str {
        match self {
            Staging::Columns(reads) if reads.copies_whole_files() => "row groups and files",
            Staging::Columns(reads) if reads.per_row_group() => "row groups",
            _ => "",
        }
    }

    fn len(&self, ds: &Dataset, i: usize) -> u64 {
        match self {
            Staging::Whole => ds.shards[i].len,
            Staging::Columns(reads) => reads.copy_len(i),
        }
    }

    /// The node-cache key of item `i`.
    fn key<'a>(&'a self, ds: &'a Dataset, i: usize) -> Option<&'a str> {
        match self {
            Staging::Whole => ds.cache_key(i),
            Staging::Columns(reads) => reads.copy_key(i),
        }
    }

    /// The name of the shard item `i` is (of).
    fn name<'a>(&self, ds: &'a Dataset, i: usize) -> &'a str {
        let shard = match self {
            Staging::Whole => Some(i),
            Staging::Columns(reads) => reads.shard_of(i),
        };
        shard.and_then(|s| ds.shards.get(s)).map_or("", |m| m.name.as_str())
    }

    fn is_cached(&self, ds: &Dataset, i: usize) -> bool {
        match self {
            Staging::Whole => ds.is_local(i),
            Staging::Columns(reads) => reads.copy_ready(i),
        }
    }

    /// Fetches item `i` into free room only ([`Want::FREE_ROOM`]): false when another fill took
    /// that room first.
    fn fetch(&self, ds: &Dataset, i: usize) -> Result<bool> {
        match self {
            Staging::Whole => ds.fetch(i, Want::FREE_ROOM).map(|pin| pin.is_some()),
            Staging::Columns(reads) => reads.fetch_copy(i, Want::FREE_ROOM),
        }
    }

    /// Stages item `i`, at `at` in `order`: into free room, or room made from the dataset's own
    /// idle copies needed after it (the last needed first). `Ok(None)`: not enough of either.
    fn stage_one(&self, ds: &Dataset, order: &[usize], at: usize) -> Result<Option<bool>> {
        let i = order[at];
        if self.is_cached(ds, i) {
            return Ok(Some(true));
        }
        let len = self.len(ds, i);
        // Fetched first: another caller may be filling it already (waited for, not made room
        // for). A fill elsewhere (a stream, the prefetcher, another staging) may take the room
        // made before the fetch begins: then again, a few times.
        for attempt in 1..=STAGE_ATTEMPTS {
            if self.fetch(ds, i)? {
                return Ok(Some(false));
            }
            if attempt == STAGE_ATTEMPTS {
                break; // no room made that no fetch would use
            }
            let later: Vec<&str> = order[at + 1..].iter().rev().filter_map(|&j| self.key(ds, j)).collect();
            if !ds.make_room_from(len, &later) {
                return Ok(None);
            }
        }
        Ok(None)
    }
}

/// How often the progress of an open that indexes the dataset is sent.
const OPENING_TICK: std::time::Duration = std::time::Duration::from_millis(500);

/// Stages `req`'s dataset, its progress sent on the stream returned; a shutdown ends it with
/// "daemon is shutting down" (fetches under way finish on their blocking threads).
pub(crate) fn stage(
    registry: Arc<Registry>,
    req: PrefetchRequest,
    admission: super::Admission,
    shutdown: CancellationToken,
) -> ReceiverStream<Result<PrefetchProgress, Status>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let staging = async {
            let staged = open_and_plan(registry, req, admission, &tx).await;
            match staged {
                Ok(Some((ds, staging, order, limit))) => {
                    run(ds, Arc::new(staging), Arc::new(order), limit, tx.clone()).await
                }
                Ok(None) => {} // the client left
                Err(e) => {
                    let _ = tx.send(Err(to_status(e))).await;
                }
            }
        };
        tokio::select! {
            () = staging => {}
            // Sent after the progress already queued; a client that stopped reading is ended by the
            // drain's timeout.
            () = shutdown.cancelled() => {
                let _ = tx.send(Err(super::outbox::shutting_down())).await;
            }
        }
    });
    ReceiverStream::new(rx)
}

/// What staging needs: the opened dataset, what to stage of each file, the epoch's order and
/// how much of it to stage. An open that indexes the dataset (no manifest) reports how far it
/// has come meanwhile (`indexing` messages). `None` when the client left.
async fn open_and_plan(
    registry: Arc<Registry>,
    req: PrefetchRequest,
    admission: super::Admission,
    tx: &mpsc::Sender<Result<PrefetchProgress, Status>>,
) -> Result<Option<(Arc<Dataset>, Staging, Vec<usize>, usize)>> {
    let (url, mode) = (req.url.clone(), req.cache.clone());
    let opened = blocking(move || admission.open(&registry, &url, &mode));
    tokio::pin!(opened);
    let ds = loop {
        tokio::select! {
            ds = &mut opened => break ds?,
            () = tokio::time::sleep(OPENING_TICK) => {
                if let Some((done, total)) = crate::index::opening::progress(&req.url) {
                    let p = PrefetchProgress { indexing: true, shards_done: done, shards_total: total, ..Default::default() };
                    if tx.send(Ok(p)).await.is_err() {
                        return Ok(None);
                    }
                }
            }
        }
    };
    if ds.mode != CacheMode::Copy {
        return Err(Error::invalid(format!(
            "{} is read in place (cache=\"direct\"); nothing to stage. Stage it with \
             `shardstream prefetch --cache copy` if trainers read it with cache=\"copy\" too",
            ds.url
        )));
    }
    let job = ds.clone();
    let max_shards = req.max_shards;
    let (order, staging) = blocking(move || {
        let staging = Staging::of(&job, &req.fields)?;
        Ok((staging.order(&job, &req)?, staging))
    })
    .await?;
    let limit = match usize::try_from(max_shards) {
        Ok(n) if n > 0 => n.min(order.len()),
        _ => order.len(),
    };
    Ok(Some((ds, staging, order, limit)))
}

/// Stages the first `limit` files of `order` (the whole epoch's order, whose later files are
/// the ones whose copies may make room for earlier ones).
async fn run(
    ds: Arc<Dataset>,
    staging: Arc<Staging>,
    order: Arc<Vec<usize>>,
    limit: usize,
    tx: mpsc::Sender<Result<PrefetchProgress, Status>>,
) {
    let head = &order[..limit];
    let mut progress = PrefetchProgress {
        unit: staging.unit().to_owned(),
        shards_total: head.len() as u64,
        bytes_total: head.iter().map(|&i| staging.len(&ds, i)).fold(0, u64::saturating_add),
        ..Default::default()
    };
    // Several files at a time when what is missing fits in the free room; otherwise one at a
    // time, so that no fetch in flight takes the room another one made.
    let missing =
        head.iter().filter(|&&i| !staging.is_cached(&ds, i)).map(|&i| staging.len(&ds, i)).fold(0, u64::saturating_add);
    let parallel = if ds.has_room(missing) { STAGE_PARALLEL } else { 1 };
    let mut tasks = tokio::task::JoinSet::new();
    let mut next = 0..limit;
    let mut full = false;
    loop {
        while !full && tasks.len() < parallel {
            let Some(at) = next.next() else { break };
            let (job, staging, order) = (ds.clone(), staging.clone(), order.clone());
            let i = order[at];
            let started = blocking(move || staging.stage_one(&job, &order, at));
            tasks.spawn(async move { (i, started.await) });
        }
        let Some(done) = tasks.join_next().await else { break };
        let (i, outcome) = match done {
            Ok(v) => v,
            Err(e) => (usize::MAX, Err(Error::Internal(format!("staging task failed: {e}")))),
        };
        match outcome {
            Ok(Some(cached)) => {
                progress.shards_done += 1;
                progress.bytes_done += staging.len(&ds, i);
                progress.already_cached += u64::from(cached);
                progress.shard = staging.name(&ds, i).to_owned();
                if tx.send(Ok(progress.clone())).await.is_err() {
                    return; // the client left: stop staging
                }
            }
            Ok(None) => full = true,
            Err(e) => {
                let _ = tx.send(Err(to_status(e))).await;
                return;
            }
        }
    }
    if full {
        progress.cache_full = true;
        progress.shard.clear();
        let _ = tx.send(Ok(progress)).await;
    }
}
