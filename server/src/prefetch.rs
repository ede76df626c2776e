//! Clairvoyant prefetch: every consumer's sample order is a pure function of its parameters, so
//! the daemon knows, for every shard, when each active consumer will next need it. The
//! prefetcher merges those futures and
//!
//! - fetches shards into the node cache in order of first future use, as far ahead as a horizon
//!   measured in *seconds of consumption* (each consumer's measured samples/s turns its sample
//!   positions into time, so a fast consumer is served further ahead than a slow one);
//! - tells the cache how far away each cached shard's next use is (pushed after each walk:
//!   `NodeCache::set_next_uses`), so that when it must evict it evicts the one needed farthest in
//!   the future (Belady's rule) and never one needed sooner than the shard it is making room for;
//! - looks one epoch beyond the current one (a trainer that finishes epoch `e` asks for `e + 1`
//!   with the same parameters), which is what keeps the right half of a too-small cache across
//!   the epoch boundary.
//!
//! With the LRU policy (kept for comparison) the prefetcher only reads ahead each consumer's next
//! [`MIN_AHEAD`] shards, like a streaming loader without knowledge of the future would.
//!
//! A tick walks each consumer's horizon; once a [`FULL_WALK`] it walks every future whole for
//! the next use of everything cached. Consumers with one future and the same keys (a rank's
//! workers) are walked as one. A tick keeps the fetches it chose ([`Plan`]): a fetch done fills
//! its slot from them, and the horizons are walked again at the next [`TICK`] or when a consumer
//! comes or goes.
//!
//! One thread runs the loop; fetches run on up to `parallel` threads of their own. Lock order:
//! consumers -> (released) -> node cache table; the snapshot lock is never held with another.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant};

use foldhash::{HashMap as FoldMap, HashSet as FoldSet};

use crate::cache::key::{KeyMap, KeyRef};
use crate::cache::table::{Eviction, Policy};
use crate::cache::{NodeCache, Want};
use crate::index::Dataset;
use crate::transport::shm::ShmHub;

/// Shards (or row groups, for a stream caching a row group at a time) each consumer always has
/// fetched ahead, whatever its rate: the shuffle window draws on a few at once, so the next two
/// must be there before the window reaches them. Unless the cache cannot hold them with what is
/// needed sooner ([`soonest_that_fit`]).
pub const MIN_AHEAD: usize = 2;

/// Assumed consumption rate before a consumer's first batches are measured (samples/s): only
/// orders consumers against each other until real figures arrive.
const DEFAULT_RATE: f64 = 1000.0;

/// How often the plan is recomputed without an event (a consumer come or gone); the fetches
/// done meanwhile start the next of the plan made last ([`Plan`]).
const TICK: Duration = Duration::from_millis(100);

/// How often a tick walks every consumer's whole future: the next use of everything cached (the
/// order Belady's rule evicts in) and the horizon reported. The ticks between walk each
/// consumer's horizon only, and refresh the next uses of what lies in it: a second's staleness
/// shifts every later use alike, and a use that passed meanwhile leaves its key looking needed
/// for a second at most. (A key one consumer needs only past its horizon and another within
/// its own, later, reads the later use until the next whole walk: eviction may keep it a little
/// less.) Walking everything every tick kept most of a core busy with 16 streams
/// over 32,000 row groups (bench/S3_RESULTS.md, "What a stream costs").
const FULL_WALK: Duration = Duration::from_secs(1);

/// How long a shard whose prefetch failed is left to the streams before it is prefetched again: a
/// changed or damaged object fails every try (each up to three downloads), and retrying it every
/// tick would spend the network and the server on it while the consumers are elsewhere.
const FAILED_RETRY: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct PrefetchConfig {
    /// How far ahead of each consumer to fetch, in seconds of its consumption.
    pub horizon: Duration,
    /// Shards fetched at once (each with its own parallel ranged GETs).
    pub parallel: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        // 60 s covers S3's worst first-byte latencies and a restart of the store several times
        // over. 8 shards at once: shards smaller than a part are one GET each, so parallelism
        // across shards is what keeps the connections busy (4 left a cold epoch at 0.78x of a
        // plain 16-way client, 8 reached 0.94x: bench/PROFILES.md); 8 x 8 ranged GETs of large
        // shards are the daemon's 64-GET cap.
        Self { horizon: Duration::from_secs(60), parallel: 8 }
    }
}

/// One stretch of a shard's use in a consumer's order: the positions (in samples of its rank
/// sequence) of its first and last sample there. A TAR shard has one; a Parquet file one per
/// stretch of its row groups' uses (see [`shard_uses_streamed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardUse {
    pub shard: u32,
    pub first: u64,
    pub last: u64,
}

/// The spans of the shards a rank sequence draws on, ordered by first use; positions are offset
/// by `offset`. The plan is walked once, a step at a time, so the memory is the plan's window
/// plus one entry per shard, never the sequence.
pub fn shard_uses_streamed(
    ds: &Dataset,
    seq: &mut crate::plan::RankStream,
    offset: u64,
) -> crate::Result<Vec<ShardUse>> {
    uses_streamed(ds, seq, offset, false)
}

/// [`shard_uses_streamed`], or with `by_unit` the uses of the plan's units (a Parquet dataset's
/// row groups, whose `shard` field then names the unit): what a stream that caches a row group at
/// a time fetches by (`service::projected`).
pub fn uses_streamed(
    ds: &Dataset,
    seq: &mut crate::plan::RankStream,
    offset: u64,
    by_unit: bool,
) -> crate::Result<Vec<ShardUse>> {
    const STEP: u64 = 1 << 16;
    // A Parquet file's row groups are plan units of their own, spread over the whole order: one
    // span from its first use to its last would say "needed now" for most of the epoch. Its uses
    // are cut into stretches wherever two lie further apart than a window's reach (a sample
    // moves less than a window, and any window of outputs draws on at most three of input).
    // A TAR shard is one unit: its uses are one stretch.
    let gap = match ds.format {
        crate::format::Format::Parquet => seq.most_held().saturating_mul(2),
        crate::format::Format::WebDataset => u64::MAX,
    };
    let units = if by_unit { ds.parquet.clone() } else { None };
    let mut spans = UseSpans { gap, units, ..UseSpans::default() };
    loop {
        let at = offset + seq.position();
        let part = seq.take(STEP)?;
        if part.is_empty() {
            break;
        }
        spans.add(ds, &part, at);
    }
    Ok(spans.finish())
}

/// Shard spans accumulated over consecutive parts of a sequence: a shard's current stretch of
/// use in `by_shard`, its earlier ones (ended by more than `gap` positions without it) in `ended`.
#[derive(Default)]
pub(crate) struct UseSpans {
    by_shard: HashMap<u32, ShardUse>,
    ended: Vec<ShardUse>,
    gap: u64,
    /// Set when the spans are of the plan's units (row groups), not shards.
    units: Option<Arc<crate::format::parquet::dataset::ParquetDataset>>,
    last_shard: Option<(usize, u64, u64)>,
}

impl UseSpans {
    fn add(&mut self, ds: &Dataset, seq: &[u64], offset: u64) {
        for (p, &id) in seq.iter().enumerate() {
            let pos = offset + p as u64;
            // Consecutive samples often share a shard: skip the binary search then.
            let shard = match self.last_shard {
                Some((s, lo, hi)) if id >= lo && id < hi => s,
                _ => {
                    let found = match &self.units {
                        Some(pq) => pq.locate(id).and_then(|(u, row)| {
                            let rows = pq.unit_rows().get(u)?;
                            Some((u, id - row as u64, *rows))
                        }),
                        None => ds.locate(id).and_then(|(s, local)| Some((s, id - local, ds.shards.get(s)?.samples))),
                    };
                    let Some((s, lo, n)) = found else { continue };
                    self.last_shard = Some((s, lo, lo + n));
                    s
                }
            };
            let fresh = ShardUse { shard: shard as u32, first: pos, last: pos };
            let e = self.by_shard.entry(shard as u32).or_insert(fresh);
            if pos - e.last > self.gap {
                self.ended.push(std::mem::replace(e, fresh));
            }
            e.last = pos;
        }
    }

    /// The stretches of `ids` (positions from 0) with `gap`, of shards or with `by_unit` of plan
    /// units (tests of the cut).
    #[cfg(test)]
    pub(crate) fn of(ds: &Dataset, ids: &[u64], gap: u64, by_unit: bool) -> Vec<ShardUse> {
        let units = if by_unit { ds.parquet.clone() } else { None };
        let mut spans = UseSpans { gap, units, ..UseSpans::default() };
        spans.add(ds, ids, 0);
        spans.finish()
    }

    fn finish(self) -> Vec<ShardUse> {
        let mut uses: Vec<ShardUse> = self.ended;
        uses.extend(self.by_shard.into_values());
        uses.sort_by_key(|u| (u.first, u.shard));
        uses
    }
}

/// What a stream caches instead of whole shards (the column chunks of S3 Parquet files it
/// selects, `service::projected`): the prefetcher asks it for the cache key and the fetch of
/// what a use names, a shard or, for a stream that caches a row group at a time, a plan unit (a
/// Parquet row group: the consumer's uses are then [`uses_streamed`]'s `by_unit`).
pub trait ProjectedFetch: Send + Sync + std::fmt::Debug {
    fn key(&self, n: usize) -> Option<KeyRef<'_>>;
    /// True when the copy is in the cache; false when the cache gave up (no room, or another fill
    /// of it under way).
    fn fetch(&self, n: usize, want: Want) -> crate::Result<bool>;
    /// The shard `n` is of (for messages).
    fn shard(&self, n: usize) -> Option<usize>;
    /// The bytes of what `n` names in the cache.
    fn len(&self, n: usize) -> u64;
    /// Equal for two fetchers that name the same keys for the same uses (streams sharing one
    /// plan of copies): the tick walks consumers with the same future and keys once.
    fn keys_id(&self) -> usize;
}

/// A consumer's future: its uses this epoch, then the next epoch's (positions offset by this
/// epoch's length), ordered by first use. Both halves are shared by a rank's workers and
/// streams (`service::uses`), not copied per stream: a plan of a million row groups is tens of
/// megabytes of uses.
#[derive(Debug, Clone)]
pub struct Future {
    this: Arc<[ShardUse]>,
    next: Arc<[ShardUse]>,
    /// Where the next epoch's positions start.
    len: u64,
}

impl Future {
    /// `this` epoch's uses, then `next`'s from position `len` on.
    pub fn new(this: Arc<[ShardUse]>, next: Arc<[ShardUse]>, len: u64) -> Self {
        Self { this, next, len }
    }

    /// The uses from the `i`-th on.
    fn iter_from(&self, i: usize) -> impl Iterator<Item = ShardUse> + '_ {
        let len = self.len;
        let (this, next) = (self.this.get(i..).unwrap_or(&[]), self.next.get(i.saturating_sub(self.this.len())..));
        let next = next.unwrap_or(&[]).iter().map(move |u| ShardUse { first: u.first + len, last: u.last + len, ..*u });
        this.iter().copied().chain(next)
    }

    /// The `i`-th use.
    fn get(&self, i: usize) -> Option<ShardUse> {
        match self.this.get(i) {
            Some(u) => Some(*u),
            None => {
                let u = self.next.get(i - self.this.len())?;
                Some(ShardUse { first: u.first + self.len, last: u.last + self.len, ..*u })
            }
        }
    }

    fn last(&self) -> Option<ShardUse> {
        match self.next.last() {
            Some(u) => Some(ShardUse { first: u.first + self.len, last: u.last + self.len, ..*u }),
            None => self.this.last().copied(),
        }
    }
}

/// A single epoch's uses, owned by one consumer.
impl From<Vec<ShardUse>> for Future {
    fn from(uses: Vec<ShardUse>) -> Self {
        Self { this: uses.into(), next: Arc::new([]), len: 0 }
    }
}

/// One active stream as the prefetcher sees it.
#[derive(Debug)]
pub struct Consumer {
    dataset: Arc<Dataset>,
    /// Set when the stream caches column chunks instead of whole shards.
    projected: Option<Arc<dyn ProjectedFetch>>,
    uses: Future,
    /// Uses before this index end before `position` (the tick skips them; positions only grow).
    done: AtomicUsize,
    /// Samples of its rank sequence consumed so far (where its next batch starts).
    position: AtomicU64,
    rate: Mutex<Rate>,
    pub rank: u32,
    pub worker: u32,
    /// Time this stream waited for shards to arrive (microseconds).
    pub waited_us: AtomicU64,
}

/// A consumer's pace, in samples per second of its stream's deliveries. Batches are built in
/// bursts (a client releases slots several at a time; small batches are grouped), microseconds
/// apart and then a pause, so the pace is measured over spans of at least [`RATE_SPAN`]: one
/// batch to the next would count a burst as the pace (100-1000x the trainer's) and the
/// prefetcher would take its horizon for a fraction of a second.
#[derive(Debug)]
struct Rate {
    samples_per_s: f64,
    /// Where the current span began.
    span: Option<(Instant, u64)>,
    /// A full span has been measured. Before that, the pace since the stream began stands in:
    /// it errs high while the first batches are built ahead, so the prefetcher fetches more,
    /// never less.
    measured: bool,
}

/// The shortest span a pace is measured over.
const RATE_SPAN: Duration = Duration::from_secs(1);

impl Rate {
    fn new() -> Self {
        Self { samples_per_s: DEFAULT_RATE, span: None, measured: false }
    }

    /// Notes that the stream had delivered everything before `position` at `now`.
    fn note(&mut self, now: Instant, position: u64) {
        let Some((at, pos)) = self.span else {
            self.span = Some((now, position));
            return;
        };
        let dt = now.duration_since(at);
        if position <= pos || dt.is_zero() {
            return;
        }
        let pace = (position - pos) as f64 / dt.as_secs_f64();
        if dt >= RATE_SPAN {
            // EWMA over spans: follows a change of pace within a few seconds, and a single slow
            // step (a checkpoint) moves it by half a span's worth at most.
            self.samples_per_s = if self.measured { 0.5 * self.samples_per_s + 0.5 * pace } else { pace };
            self.measured = true;
            self.span = Some((now, position));
        } else if !self.measured {
            self.samples_per_s = pace;
        }
    }
}

impl Consumer {
    /// Records that the stream delivered everything before `position` and waited `waited` for
    /// data while producing it.
    pub fn advance(&self, position: u64, waited: Duration) {
        self.position.store(position, Relaxed);
        self.waited(waited);
        self.rate.lock().unwrap_or_else(|p| p.into_inner()).note(Instant::now(), position);
    }

    /// Records that the stream waited `waited` for data without delivering it (a wait that
    /// ended in an error): still time the trainer stalled.
    pub fn waited(&self, waited: Duration) {
        if !waited.is_zero() {
            self.waited_us.fetch_add(waited.as_micros() as u64, Relaxed);
            crate::metrics::consumer_wait(self.rank, self.worker, waited.as_secs_f64());
        }
    }

    fn rate(&self) -> f64 {
        self.rate.lock().unwrap_or_else(|p| p.into_inner()).samples_per_s.max(1.0)
    }

    /// The index of its first use that does not end before `pos`, the uses before it skipped
    /// for good.
    fn skip_done(&self, pos: u64) -> usize {
        let mut i = self.done.load(Relaxed);
        while self.uses.get(i).is_some_and(|u| u.last < pos) {
            i += 1;
        }
        self.done.fetch_max(i, Relaxed).max(i)
    }

    /// The cache key of what use `n` names.
    fn key(&self, n: usize) -> Option<KeyRef<'_>> {
        match &self.projected {
            Some(p) => p.key(n),
            None => self.dataset.cache_key_ref(n),
        }
    }

    /// Equal for consumers with the same future and keys (a rank's workers).
    fn walk_id(&self) -> (usize, usize, u64, usize) {
        let keys = self.projected.as_ref().map_or(Arc::as_ptr(&self.dataset) as usize, |p| p.keys_id());
        (
            Arc::as_ptr(&self.uses.this).cast::<()>() as usize,
            Arc::as_ptr(&self.uses.next).cast::<()>() as usize,
            self.uses.len,
            keys,
        )
    }
}

/// Unregisters its consumer when the stream ends, however it ends.
#[derive(Debug)]
pub struct ConsumerGuard {
    prefetcher: Weak<Prefetcher>,
    id: u64,
    pub consumer: Arc<Consumer>,
}

impl Drop for ConsumerGuard {
    fn drop(&mut self) {
        if let Some(p) = self.prefetcher.upgrade() {
            p.lock_consumers().remove(&self.id);
            p.generation.fetch_add(1, SeqCst);
            p.wake();
        }
    }
}

/// What `status` reports about prefetching.
#[derive(Debug, Clone, Default)]
pub struct PrefetchStatus {
    pub consumers: Vec<ConsumerStatus>,
    /// Seconds of data ready ahead of the least-served consumer.
    pub horizon_s: f64,
    pub inflight: usize,
}

#[derive(Debug, Clone)]
pub struct ConsumerStatus {
    pub dataset: String,
    pub rank: u32,
    pub worker: u32,
    pub position: u64,
    pub samples_per_s: f64,
    pub waited_s: f64,
}

pub struct Prefetcher {
    cache: Arc<NodeCache>,
    shm: Option<Arc<ShmHub>>,
    config: PrefetchConfig,
    consumers: Mutex<HashMap<u64, Arc<Consumer>>>,
    next_id: AtomicU64,
    /// Bumped when a consumer comes or goes: the next tick walks every future whole.
    generation: AtomicU64,
    /// When the last whole walk ran, and the generation it saw.
    walked: Mutex<Option<(Instant, u64)>>,
    /// Cache key -> seconds until its next use by any consumer: as of the last whole walk, those
    /// within a consumer's horizon as of the last tick ([`FULL_WALK`]).
    next_use: RwLock<KeyMap<f64>>,
    inflight: Mutex<HashSet<String>>,
    /// Shards whose prefetch failed, and when they may be tried again ([`FAILED_RETRY`]).
    failed: Mutex<HashMap<String, Instant>>,
    wake: (Mutex<Woken>, Condvar),
    /// The last tick's plan of fetches, for the slots freed until the next ([`Plan`]).
    plan: Mutex<Option<Plan>>,
    horizon_s: Mutex<f64>,
    /// Keys the last tick's horizon walk found: the next walk's maps start that large, not
    /// growing (and rehashing) from empty every tick.
    near_hint: AtomicUsize,
    stopped: AtomicBool,
}

impl std::fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher").field("config", &self.config).finish_non_exhaustive()
    }
}

/// The cache asks the prefetcher about the future and about leases.
struct Oracle(Weak<Prefetcher>);

impl Eviction for Oracle {
    fn next_use(&self, key: &str) -> Option<f64> {
        let p = self.0.upgrade()?;
        p.next_use.read().unwrap_or_else(|e| e.into_inner()).get(&KeyRef::from(key)).copied()
    }

    fn leased(&self, key: &str) -> bool {
        let Some(p) = self.0.upgrade() else { return false };
        p.shm.as_ref().is_some_and(|hub| hub.is_leased(&p.cache.path_of(key)))
    }

    fn evicted(&self, key: &str) {
        if let Some(p) = self.0.upgrade()
            && let Some(hub) = &p.shm
        {
            hub.forget(&p.cache.path_of(key));
        }
    }
}

impl Prefetcher {
    /// Starts the prefetch thread and installs itself as the cache's eviction oracle.
    pub fn start(cache: Arc<NodeCache>, shm: Option<Arc<ShmHub>>, config: PrefetchConfig) -> crate::Result<Arc<Self>> {
        let p = Arc::new(Self {
            cache: cache.clone(),
            shm,
            config,
            consumers: Mutex::default(),
            next_id: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            walked: Mutex::new(None),
            next_use: RwLock::default(),
            inflight: Mutex::default(),
            failed: Mutex::default(),
            wake: (Mutex::default(), Condvar::new()),
            plan: Mutex::new(None),
            horizon_s: Mutex::new(0.0),
            near_hint: AtomicUsize::new(0),
            stopped: AtomicBool::new(false),
        });
        cache.set_eviction(Arc::new(Oracle(Arc::downgrade(&p))));
        let weak = Arc::downgrade(&p);
        std::thread::Builder::new()
            .name("prefetch".into())
            .spawn(move || run(weak))
            .map_err(|e| crate::Error::Unavailable(format!("cannot start the prefetch thread: {e}")))?;
        Ok(p)
    }

    pub fn stop(&self) {
        self.stopped.store(true, Relaxed);
        self.wake();
    }

    fn lock_consumers(&self) -> MutexGuard<'_, HashMap<u64, Arc<Consumer>>> {
        self.consumers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Something changed that the plan depends on (a consumer came or went, the daemon stops):
    /// the prefetch thread ticks now.
    pub fn wake(&self) {
        self.wake.0.lock().unwrap_or_else(|p| p.into_inner()).changed = true;
        self.wake.1.notify_one();
    }

    /// A prefetch brought its shard in: the prefetch thread starts the next of the last plan.
    fn slot_freed(&self) {
        self.wake.0.lock().unwrap_or_else(|p| p.into_inner()).slot_freed = true;
        self.wake.1.notify_one();
    }

    /// Registers a stream's future. `uses`: its shard spans from the rank sequence's start, this
    /// epoch and (offset by this epoch's length) the next; `position`: where it starts.
    pub fn register(
        self: &Arc<Self>,
        dataset: Arc<Dataset>,
        uses: impl Into<Future>,
        position: u64,
        rank: u32,
        worker: u32,
        projected: Option<Arc<dyn ProjectedFetch>>,
    ) -> ConsumerGuard {
        let consumer = Arc::new(Consumer {
            dataset,
            projected,
            uses: uses.into(),
            done: AtomicUsize::new(0),
            position: AtomicU64::new(position),
            rate: Mutex::new(Rate::new()),
            rank,
            worker,
            waited_us: AtomicU64::new(0),
        });
        let id = self.next_id.fetch_add(1, Relaxed);
        self.lock_consumers().insert(id, consumer.clone());
        self.generation.fetch_add(1, SeqCst);
        // Plan at once, so the first shards are on their way before the first batch asks.
        self.tick();
        self.wake();
        ConsumerGuard { prefetcher: Arc::downgrade(self), id, consumer }
    }

    pub fn status(&self) -> PrefetchStatus {
        let consumers = self
            .lock_consumers()
            .values()
            .map(|c| ConsumerStatus {
                dataset: c.dataset.url.clone(),
                rank: c.rank,
                worker: c.worker,
                position: c.position.load(Relaxed),
                samples_per_s: c.rate(),
                waited_s: c.waited_us.load(Relaxed) as f64 / 1e6,
            })
            .collect();
        PrefetchStatus {
            consumers,
            horizon_s: *self.horizon_s.lock().unwrap_or_else(|p| p.into_inner()),
            inflight: self.inflight.lock().unwrap_or_else(|p| p.into_inner()).len(),
        }
    }

    /// One planning round: start fetches for what each consumer needs within its horizon and,
    /// once a [`FULL_WALK`], recompute every cached shard's next use and measure the horizon.
    /// Keys are borrowed from the consumers' plans with the hash they were made with
    /// ([`KeyRef`]): never allocated, nor their bytes hashed again, per use.
    fn tick(self: &Arc<Self>) {
        // Read before the consumers: a consumer registered after it bumps the generation again,
        // so its own tick walks everything even when this one records a walk without it.
        let generation = self.generation.load(SeqCst);
        let consumers: Vec<Arc<Consumer>> = self.lock_consumers().values().cloned().collect();
        let clairvoyant = self.cache.policy() == Policy::Belady;
        let horizon = self.config.horizon.as_secs_f64();
        let whole = {
            let mut walked = self.walked.lock().unwrap_or_else(|p| p.into_inner());
            let due = walked.is_none_or(|(at, g)| g != generation || at.elapsed() >= FULL_WALK);
            if due {
                *walked = Some((Instant::now(), generation));
            }
            due
        };
        let groups = walk_groups(&consumers);
        let (next, mut wanted) =
            within_horizon(&consumers, &groups, clairvoyant, horizon, self.near_hint.load(Relaxed));
        self.near_hint.store(next.len(), Relaxed);
        if whole {
            self.walk_whole(&consumers, &groups);
        } else {
            let near = || next.iter().map(|(k, (secs, _, _))| (*k, *secs));
            refresh(&mut self.next_use.write().unwrap_or_else(|p| p.into_inner()), near());
            // Not under the map's lock: the cache asks the map under its own.
            self.cache.set_next_uses(near(), false);
        }

        wanted.sort_by(|a, b| a.0.total_cmp(&b.0));
        soonest_that_fit(&mut wanted, self.cache.capacity());
        wanted.dedup_by(|a, b| a.1 == b.1);
        let fetches = wanted
            .iter()
            .filter_map(|&(secs, key, _)| {
                let &(_, ci, unit) = next.get(&key)?;
                Some(Planned { secs, consumer: consumers.get(ci)?.clone(), unit })
            })
            .collect();
        let mut plan = Plan { at: Instant::now(), generation, fetches, started: 0 };
        self.start_fetches(&mut plan);
        *self.plan.lock().unwrap_or_else(|p| p.into_inner()) = Some(plan);
    }

    /// Fills the slot a fetch done freed from the last tick's plan while it is fresh (younger
    /// than a [`TICK`], with the same consumers); else ticks.
    fn refill(self: &Arc<Self>) {
        let generation = self.generation.load(SeqCst);
        let mut kept = self.plan.lock().unwrap_or_else(|p| p.into_inner());
        match kept.as_mut() {
            Some(plan) if plan.generation == generation && plan.at.elapsed() < TICK => self.start_fetches(plan),
            _ => {
                drop(kept);
                self.tick();
            }
        }
    }

    /// Starts the fetches of `plan` in its order, from where the last call stopped, until
    /// [`PrefetchConfig::parallel`] are in flight: those already cached (or being filled), in
    /// flight or backed off after a failure are passed over.
    fn start_fetches(self: &Arc<Self>, plan: &mut Plan) {
        let now = Instant::now();
        let backed_off: HashSet<String> = {
            let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.retain(|_, retry| *retry > now);
            failed.keys().cloned().collect()
        };
        while let Some(f) = plan.fetches.get(plan.started) {
            let (secs, c, shard) = (f.secs, f.consumer.clone(), f.unit);
            let Some(key) = c.key(shard).map(|k| k.as_str()) else {
                plan.started += 1;
                continue;
            };
            // Backed off after its own failure, or after a stream's (the prefetch gave the fill
            // to a stream, which then failed it).
            if self.cache.is_present(key) || backed_off.contains(key) || self.cache.failed_recently(key, FAILED_RETRY) {
                plan.started += 1;
                continue;
            }
            {
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                if inflight.len() >= self.config.parallel.max(1) {
                    break;
                }
                plan.started += 1;
                if inflight.contains(key) {
                    continue;
                }
                inflight.insert(key.to_owned());
            }
            let key = key.to_owned();
            let ds = c.dataset.clone();
            let me = self.clone();
            let fetching = key.clone();
            let spawned = spawn_fetch(move || {
                // A prefetch never waits and never evicts a shard needed sooner than this one.
                let want = Want { urgency: secs, wait: false, since: None, evict: true, ended: None };
                let fetched = match &c.projected {
                    Some(p) => p.fetch(shard, want),
                    None => ds.fetch(shard, want).map(|pin| pin.is_some()),
                };
                let brought_in = match fetched {
                    Ok(done) => done,
                    Err(e) => {
                        let of = match &c.projected {
                            Some(p) => p.shard(shard),
                            None => Some(shard),
                        };
                        let name = of.and_then(|i| ds.shards.get(i)).map_or("?", |m| m.name.as_str());
                        if me.stopped.load(Relaxed) {
                            // The daemon is stopping: the store refuses requests from now on.
                            tracing::debug!(dataset = %ds.url, shard = %name, error = %e, "prefetch ended by the stop");
                        } else {
                            tracing::warn!(dataset = %ds.url, shard = %name, error = %e, "prefetch failed");
                        }
                        me.failed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .insert(fetching.clone(), Instant::now() + FAILED_RETRY);
                        false
                    }
                };
                me.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&fetching);
                // Only a shard brought in frees the way for the next one at once. A prefetch that
                // gave up (no room: everything cached is needed sooner) or failed is tried again
                // at the next tick: waking now would start the same refusals back to back.
                if brought_in {
                    me.slot_freed();
                }
            });
            if let Err(e) = spawned {
                // It never started, so it is not in flight; counted so, it would hold its slot for
                // the daemon's life. The shard is fetched when a stream needs it, or prefetched
                // on a later tick.
                self.inflight.lock().unwrap_or_else(|p| p.into_inner()).remove(&key);
                tracing::warn!(shard = %key, error = %e, "cannot start a prefetch thread");
                break;
            }
        }
    }
}

/// The fetches a tick chose (the soonest needed that fit, soonest first), kept for the fetches
/// done until the next tick: each frees a slot, and walking every horizon again to fill it
/// (after every fetch done, hundreds a second over row-group copies of a few hundred bytes)
/// took most of the daemon's CPU (bench/S3_RESULTS.md, "Choosing what to evict").
struct Plan {
    at: Instant,
    /// The consumers' generation it was made for.
    generation: u64,
    fetches: Vec<Planned>,
    /// The fetches before it are started, cached or passed over.
    started: usize,
}

/// A fetch of a plan: `consumer`'s use `unit`, needed in `secs`.
struct Planned {
    secs: f64,
    consumer: Arc<Consumer>,
    unit: usize,
}

/// Key -> (seconds until its next use, the consumer's index, what the use names).
type Near<'a> = FoldMap<KeyRef<'a>, (f64, usize, usize)>;
/// (seconds until next use, key, bytes), a use at a time.
type Wanted<'a> = Vec<(f64, KeyRef<'a>, u64)>;

/// What each consumer needs within its horizon (and the first [`MIN_AHEAD`] shards it has
/// ahead, whatever the horizon): key -> (seconds until its next use there, the consumer's index,
/// what the use names: a shard, or a plan unit for a stream caching a row group at a time), and
/// the (seconds, key, bytes) of every such use, a group's (see [`walk_groups`]) at the soonest
/// of its members. `hint`: how many keys it is likely to find (the last walk's).
fn within_horizon<'a>(
    consumers: &'a [Arc<Consumer>],
    groups: &[Vec<usize>],
    clairvoyant: bool,
    horizon: f64,
    hint: usize,
) -> (Near<'a>, Wanted<'a>) {
    let mut next = Near::with_capacity_and_hasher(hint, Default::default());
    let mut wanted = Wanted::with_capacity(hint);
    for members in groups {
        let Some(lead) = members.first().and_then(|&ci| consumers.get(ci)) else { continue };
        let mut start = usize::MAX;
        let mut at: Vec<Ahead> = members
            .iter()
            .filter_map(|&ci| consumers.get(ci).map(|c| (ci, c)))
            .map(|(ci, c)| {
                let pos = c.position.load(Relaxed);
                start = start.min(c.skip_done(pos));
                Ahead { ci, pos, rate: c.rate(), shards: Vec::new(), done: false }
            })
            .collect();
        for u in lead.uses.iter_from(start) {
            if at.iter().all(|a| a.done) {
                break;
            }
            let shard = u.shard as usize;
            let Some(key) = lead.key(shard) else { continue };
            // The soonest of the members that want it: (seconds, consumer).
            let mut soonest: Option<(f64, usize)> = None;
            for a in at.iter_mut().filter(|a| !a.done && u.last >= a.pos) {
                let secs = secs_until(&u, a.pos, a.rate);
                // Uses are in order of first use: past the horizon (and the first shards
                // every consumer has ahead) all the rest are too.
                let ahead = a.shards.len();
                let within = if clairvoyant { secs <= horizon || ahead < MIN_AHEAD } else { ahead < MIN_AHEAD };
                if !within {
                    a.done = true;
                    continue;
                }
                if soonest.is_none_or(|(s, _)| secs < s) {
                    soonest = Some((secs, a.ci));
                }
                // A shard's later stretches (Parquet) are not more shards ahead.
                if ahead < MIN_AHEAD && !a.shards.contains(&u.shard) {
                    a.shards.push(u.shard);
                }
            }
            let Some((secs, ci)) = soonest else { continue };
            let e = next.entry(key).or_insert((secs, ci, shard));
            if secs < e.0 {
                *e = (secs, ci, shard);
            }
            let bytes = match &lead.projected {
                Some(p) => p.len(shard),
                None => lead.dataset.shards.get(shard).map_or(0, |m| m.len),
            };
            wanted.push((secs, key, bytes));
        }
    }
    (next, wanted)
}

/// One consumer of a group as a tick walks its horizon.
struct Ahead {
    /// Its index among the tick's consumers.
    ci: usize,
    pos: u64,
    rate: f64,
    /// The first [`MIN_AHEAD`] distinct shards it has ahead.
    shards: Vec<u32>,
    /// Past its horizon: the rest of its uses are not wanted now.
    done: bool,
}

/// The tick's consumers (indices) grouped by future and keys ([`Consumer::walk_id`]): a rank's
/// workers are walked once, each use's next time the soonest among them.
fn walk_groups(consumers: &[Arc<Consumer>]) -> Vec<Vec<usize>> {
    let mut groups: FoldMap<(usize, usize, u64, usize), Vec<usize>> = FoldMap::default();
    for (ci, c) in consumers.iter().enumerate() {
        groups.entry(c.walk_id()).or_default().push(ci);
    }
    groups.into_values().collect()
}

impl Prefetcher {
    /// Walks every consumer's whole future: the next use of every key any of them will read
    /// (the order eviction follows) and the seconds of data ready ahead of the least-served.
    /// Consumers with the same future and keys (a rank's workers) are walked once, each use's
    /// next time the soonest among them.
    fn walk_whole(&self, consumers: &[Arc<Consumer>], groups: &[Vec<usize>]) {
        // As many keys as the last whole walk's, most likely.
        let known = self.next_use.read().unwrap_or_else(|p| p.into_inner()).len();
        let mut next: FoldMap<KeyRef<'_>, f64> = FoldMap::with_capacity_and_hasher(known, Default::default());
        let mut horizon_s = f64::INFINITY;
        for members in groups {
            let members: Vec<&Arc<Consumer>> = members.iter().filter_map(|&ci| consumers.get(ci)).collect();
            let Some(lead) = members.first() else { continue };
            // (position, rate, seconds until its first use not ready)
            let mut at: Vec<(u64, f64, Option<f64>)> =
                members.iter().map(|c| (c.position.load(Relaxed), c.rate(), None)).collect();
            let start = members.iter().zip(&at).map(|(c, a)| c.skip_done(a.0)).min().unwrap_or(0);
            let mut unready = members.len();
            for u in lead.uses.iter_from(start) {
                let secs =
                    at.iter().filter(|a| u.last >= a.0).map(|a| secs_until(&u, a.0, a.1)).fold(f64::INFINITY, f64::min);
                if secs == f64::INFINITY {
                    continue;
                }
                let Some(key) = lead.key(u.shard as usize) else { continue };
                let e = next.entry(key).or_insert(secs);
                *e = e.min(secs);
                if unready > 0 && !self.cache.is_ready(key.as_str()) {
                    for a in at.iter_mut().filter(|a| a.2.is_none() && u.last >= a.0) {
                        a.2 = Some(secs_until(&u, a.0, a.1));
                        unready -= 1;
                    }
                }
            }
            for (pos, rate, ready) in at {
                // All of its future is cached: the horizon is the rest of its order.
                let ready =
                    ready.unwrap_or_else(|| lead.uses.last().map_or(0.0, |u| u.last.saturating_sub(pos) as f64 / rate));
                horizon_s = horizon_s.min(ready);
            }
        }
        let horizon_s = if horizon_s.is_finite() { horizon_s } else { 0.0 };
        *self.horizon_s.lock().unwrap_or_else(|p| p.into_inner()) = horizon_s;
        crate::metrics::prefetch_horizon(horizon_s, consumers.len());
        {
            let mut next_use = self.next_use.write().unwrap_or_else(|p| p.into_inner());
            next_use.retain(|k, _| next.contains_key(&k.key_ref()));
            refresh(&mut next_use, next.iter().map(|(k, s)| (*k, *s)));
        }
        self.cache.set_next_uses(next.iter().map(|(k, s)| (*k, *s)), true);
    }
}

/// Sets the next use of each key, in place: a key still in the future keeps its allocation from
/// tick to tick.
fn refresh<'a>(next_use: &mut KeyMap<f64>, uses: impl Iterator<Item = (KeyRef<'a>, f64)>) {
    for (k, secs) in uses {
        match next_use.get_mut(&k) {
            Some(s) => *s = secs,
            None => {
                next_use.insert(k.into(), secs);
            }
        }
    }
}

/// Seconds until use `u` for a consumer at `pos` consuming `rate` samples a second (0 when
/// it is in use).
fn secs_until(u: &ShardUse, pos: u64, rate: f64) -> f64 {
    u.first.saturating_sub(pos) as f64 / rate
}

/// Cuts `wanted` (seconds until next use, cache key, bytes; sorted by the first) to the soonest
/// needed that the cache can hold together, counting what it holds already: a fetch past that
/// could only evict what is needed after it, which is itself wanted and fetched again a tick
/// later, evicting the next. With a cache smaller than an epoch, the row groups at the edge of
/// what fits chased each other out: a staged cache's first epoch at a trainer's pace fetched
/// 0.79x of the chunks where 0.25x were missing, 0.59x with the cut (bench/S3_RESULTS.md, "The
/// prefetcher's cut"). A key wanted by several consumers counts once.
fn soonest_that_fit(wanted: &mut Vec<(f64, KeyRef<'_>, u64)>, capacity: u64) {
    let fits = {
        let mut seen: FoldSet<KeyRef<'_>> = FoldSet::with_capacity_and_hasher(wanted.len(), Default::default());
        let mut held = 0u64;
        wanted
            .iter()
            .take_while(|(_, key, bytes)| {
                if seen.insert(*key) {
                    held = held.saturating_add(*bytes);
                }
                held <= capacity
            })
            .count()
    };
    wanted.truncate(fits);
}

/// Starts a prefetch's thread; `prefetch-spawn` fails it, as running out of threads would.
fn spawn_fetch(fetch: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    fail_point!("prefetch-spawn", |_| Err(std::io::Error::other("failpoint prefetch-spawn")));
    std::thread::Builder::new().name("prefetch-fetch".into()).spawn(fetch).map(drop)
}

/// Why the prefetch thread woke before its [`TICK`].
#[derive(Debug, Default)]
struct Woken {
    changed: bool,
    slot_freed: bool,
}

fn run(weak: Weak<Prefetcher>) {
    let mut replan = true;
    loop {
        let Some(p) = weak.upgrade() else { return };
        if p.stopped.load(Relaxed) {
            return;
        }
        if replan {
            p.tick()
        } else {
            p.refill()
        }
        let (lock, cv) = &p.wake;
        let mut woken = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !woken.changed && !woken.slot_freed {
            woken = cv.wait_timeout(woken, TICK).unwrap_or_else(|e| e.into_inner()).0;
        }
        // A tick's time (neither flag) or a change: plan again; a slot freed: fill it.
        replan = woken.changed || !woken.slot_freed;
        *woken = Woken::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Backends, Registry};

    /// A local TAR dataset of `shards` shards of 10 samples read through a node cache (copy
    /// mode), the cache, and the directories holding them.
    fn copied(shards: usize) -> (tempfile::TempDir, Arc<NodeCache>, Arc<Dataset>) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d");
        std::fs::create_dir_all(&dir).unwrap();
        for s in 0..shards {
            let mut b = tar::Builder::new(std::fs::File::create(dir.join(format!("p-{s:03}.tar"))).unwrap());
            for i in 0..10 {
                let mut h = tar::Header::new_gnu();
                h.set_size(1);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, format!("k{s:03}_{i:02}.bin"), &[i as u8][..]).unwrap();
            }
            b.finish().unwrap();
        }
        let cache = NodeCache::open(&tmp.path().join("cache"), Some(1 << 30), Policy::Belady).unwrap();
        let backends = Backends::new(Some(cache.clone()), crate::storage::s3::S3Options::default(), None);
        let ds = Registry::new(None, Arc::new(backends)).open(&dir.display().to_string(), "copy").unwrap();
        (tmp, cache, ds)
    }

    fn span(shard: u32, first: u64, last: u64) -> ShardUse {
        ShardUse { shard, first, last }
    }

    #[test]
    fn a_future_reads_on_into_the_next_epoch() {
        let f = Future::new(vec![span(0, 0, 9), span(1, 5, 19)].into(), vec![span(1, 0, 4), span(2, 3, 9)].into(), 20);
        let all: Vec<ShardUse> = f.iter_from(0).collect();
        assert_eq!(all, [span(0, 0, 9), span(1, 5, 19), span(1, 20, 24), span(2, 23, 29)]);
        assert_eq!(f.iter_from(3).collect::<Vec<_>>(), [span(2, 23, 29)]);
        assert_eq!(f.iter_from(9).count(), 0);
        assert_eq!((f.get(2), f.get(4)), (Some(span(1, 20, 24)), None));
        assert_eq!(f.last(), Some(span(2, 23, 29)));
    }

    fn consumer(ds: &Arc<Dataset>, uses: Future, pos: u64) -> Arc<Consumer> {
        Arc::new(Consumer {
            dataset: ds.clone(),
            projected: None,
            uses,
            done: AtomicUsize::new(0),
            position: AtomicU64::new(pos),
            rate: Mutex::new(Rate::new()),
            rank: 0,
            worker: 0,
            waited_us: AtomicU64::new(0),
        })
    }

    /// Stretches of `shards` shards over `len` positions, in order of first use (as
    /// `uses_streamed` gives them), from a seed.
    fn random_uses(seed: &mut u64, shards: u32, len: u64) -> Vec<ShardUse> {
        let mut next = || {
            *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            *seed >> 33
        };
        let mut uses: Vec<ShardUse> = (0..40)
            .map(|_| {
                let first = next() % len;
                span((next() % u64::from(shards)) as u32, first, (first + next() % 30).min(len - 1))
            })
            .collect();
        uses.sort_by_key(|u| (u.first, u.shard));
        uses
    }

    #[test]
    fn a_group_walked_once_wants_what_each_of_its_members_wants() {
        let (_tmp, _cache, ds) = copied(12);
        let mut seed = 7u64;
        for round in 0..50 {
            // Three ranks' futures, each shared by 1-3 workers at their own positions.
            let mut consumers = Vec::new();
            for _ in 0..3 {
                let this: Arc<[ShardUse]> = random_uses(&mut seed, 12, 200).into();
                let next: Arc<[ShardUse]> = random_uses(&mut seed, 12, 200).into();
                for _ in 0..=(seed % 3) {
                    let pos = (seed >> 20) % 260;
                    seed = seed.wrapping_mul(2862933555777941757).wrapping_add(3037000493);
                    consumers.push(consumer(&ds, Future::new(this.clone(), next.clone(), 200), pos));
                }
            }
            for (clairvoyant, horizon) in [(true, 0.02), (true, 0.3), (false, 0.02)] {
                let (near, wanted) = within_horizon(&consumers, &walk_groups(&consumers), clairvoyant, horizon, 0);
                // Each consumer on its own, every use on, as a tick walked them one by one.
                let mut want: HashMap<&str, f64> = HashMap::new();
                for c in &consumers {
                    let (pos, rate) = (c.position.load(Relaxed), c.rate());
                    let mut counted = HashSet::new();
                    for u in c.uses.iter_from(0).filter(|u| u.last >= pos) {
                        let secs = u.first.saturating_sub(pos) as f64 / rate;
                        let ahead = counted.len();
                        if if clairvoyant { secs <= horizon || ahead < MIN_AHEAD } else { ahead < MIN_AHEAD } {
                            let e = want.entry(c.key(u.shard as usize).unwrap().as_str()).or_insert(secs);
                            *e = e.min(secs);
                        }
                        counted.insert(u.shard);
                    }
                }
                let got: HashMap<&str, f64> = near.iter().map(|(k, v)| (k.as_str(), v.0)).collect();
                assert_eq!(got, want, "round {round}, {clairvoyant} {horizon}");
                let mut listed: HashMap<&str, f64> = HashMap::new();
                for (secs, key, bytes) in wanted {
                    let i = (0..ds.shards.len()).find(|&i| ds.cache_key(i) == Some(key.as_str())).unwrap();
                    assert_eq!(bytes, ds.shards[i].len);
                    let e = listed.entry(key.as_str()).or_insert(secs);
                    *e = e.min(secs);
                }
                assert_eq!(listed, want, "round {round}: the wanted list, key by key");
                for (key, (secs, ci, shard)) in near {
                    let c = &consumers[ci];
                    assert_eq!(c.key(shard), Some(key));
                    let pos = c.position.load(Relaxed);
                    assert!(c.uses.iter_from(0).any(|u| u.shard as usize == shard
                        && u.last >= pos
                        && u.first.saturating_sub(pos) as f64 / c.rate() == secs));
                }
            }
        }
    }

    /// A prefetcher whose thread has stopped: ticks from here on are the test's, positions and all.
    fn stopped(cache: Arc<NodeCache>) -> Arc<Prefetcher> {
        let p = Prefetcher::start(cache, None, PrefetchConfig::default()).unwrap();
        p.stop();
        std::thread::sleep(Duration::from_millis(200));
        p
    }

    #[test]
    fn a_whole_walk_finds_each_keys_soonest_use_among_consumers_sharing_a_future() {
        let (_tmp, cache, ds) = copied(6);
        let p = stopped(cache);
        // Two workers of one rank (one future, shared) and another rank's stream.
        let this: Arc<[ShardUse]> = vec![span(0, 0, 9), span(1, 10, 19), span(2, 20, 29), span(0, 30, 39)].into();
        let next: Arc<[ShardUse]> = vec![span(3, 0, 9), span(1, 10, 19)].into();
        let other: Vec<ShardUse> = vec![span(4, 0, 9), span(2, 10, 19), span(5, 20, 29)];
        let a = p.register(ds.clone(), Future::new(this.clone(), next.clone(), 40), 0, 0, 0, None);
        let b = p.register(ds.clone(), Future::new(this, next, 40), 0, 0, 1, None);
        let c = p.register(ds.clone(), other, 0, 1, 0, None);
        a.consumer.advance(12, Duration::ZERO);
        b.consumer.advance(31, Duration::ZERO);
        let consumers = [a.consumer.clone(), b.consumer.clone(), c.consumer.clone()];
        assert_eq!(consumers[0].walk_id(), consumers[1].walk_id());
        assert_ne!(consumers[0].walk_id(), consumers[2].walk_id());
        p.walk_whole(&consumers, &walk_groups(&consumers));
        // Every consumer's every use on, one at a time.
        let mut want: HashMap<String, f64> = HashMap::new();
        for c in &consumers {
            let (pos, rate) = (c.position.load(Relaxed), c.rate());
            for u in c.uses.iter_from(0).filter(|u| u.last >= pos) {
                let secs = u.first.saturating_sub(pos) as f64 / rate;
                let e = want.entry(c.key(u.shard as usize).unwrap().as_str().to_owned()).or_insert(secs);
                *e = e.min(secs);
            }
        }
        let got: HashMap<String, f64> = p.next_use.read().unwrap().iter().map(|(k, v)| (k.to_string(), *v)).collect();
        assert_eq!(got, want);
        // Shard 0: 18 samples ahead of the worker at 12, in use for the one at 31; shard 3 (the
        // next epoch's first): 28 and 9 samples ahead.
        let key = |i: usize| ds.cache_key(i).unwrap().to_owned();
        assert_eq!(got[&key(0)], 0.0);
        assert_eq!(got[&key(3)], (40 - 31) as f64 / DEFAULT_RATE);
    }

    /// Waits (at most 10 s) until `n` of `ds`'s shards are in the cache and nothing is in flight.
    fn until_cached(p: &Prefetcher, ds: &Dataset, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let cached = || (0..ds.shards.len()).filter(|&s| ds.cache_key(s).is_some_and(|k| p.cache.is_ready(k))).count();
        while (cached() < n || !p.inflight.lock().unwrap().is_empty()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(cached(), n);
    }

    #[test]
    fn a_fetch_done_starts_the_next_of_the_last_plan_without_walking_again() {
        let (_tmp, cache, ds) = copied(6);
        let p = stopped(cache);
        let uses: Vec<ShardUse> = (0..6).map(|s| span(s, u64::from(s) * 10, u64::from(s) * 10 + 9)).collect();
        // Registering ticks once: a plan of the six shards, all started.
        let _guard = p.register(ds.clone(), uses, 0, 0, 0, None);
        until_cached(&p, &ds, 6);
        let made = |p: &Prefetcher| p.plan.lock().unwrap().as_ref().map(|plan| (plan.at, plan.started));
        assert_eq!(made(&p).unwrap().1, 6);
        let drop_two = || {
            for s in [1, 4] {
                assert!(p.cache.drop_copy(ds.cache_key(s).unwrap(), "test"));
            }
        };
        // A plan still fresh (as a fetch done finds it within a tick), from its start: the two
        // missing are fetched from it, the others passed over.
        drop_two();
        let at = Instant::now();
        {
            let mut kept = p.plan.lock().unwrap();
            let plan = kept.as_mut().unwrap();
            (plan.at, plan.started) = (at, 0);
        }
        p.refill();
        until_cached(&p, &ds, 6);
        assert_eq!(made(&p), Some((at, 6)), "the same plan, to its end");
        // A tick old, or made for other consumers: planned again.
        drop_two();
        p.plan.lock().unwrap().as_mut().unwrap().at = at - TICK;
        p.refill();
        until_cached(&p, &ds, 6);
        let again = made(&p).unwrap().0;
        assert!(again > at, "planned again");
        p.generation.fetch_add(1, SeqCst);
        p.refill();
        assert!(made(&p).unwrap().0 > again, "planned again");
    }

    #[test]
    fn only_the_soonest_needed_that_fit_together_are_wanted() {
        let w = |secs: f64, key: &'static str, bytes: u64| (secs, KeyRef::from(key), bytes);
        let mut wanted = vec![w(0.0, "a", 40), w(1.0, "b", 30), w(1.5, "a", 40), w(2.0, "c", 30), w(3.0, "d", 10)];
        // a, b and c make 100 (a's second use costs nothing more); d would make 110.
        soonest_that_fit(&mut wanted, 100);
        let keys: Vec<&str> = wanted.iter().map(|(_, k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a", "b", "a", "c"], "d is past what the cache holds with the sooner ones");
        let mut wanted = vec![w(0.0, "a", 40), w(1.0, "b", 30)];
        soonest_that_fit(&mut wanted, 69);
        assert_eq!(wanted.len(), 1);
        let mut wanted = vec![w(0.0, "huge", 200), w(1.0, "b", 30)];
        soonest_that_fit(&mut wanted, 100);
        assert!(wanted.is_empty(), "nothing after what cannot fit");
    }

    /// A trainer taking 64 samples/s whose batches are built in bursts of four (a client
    /// releasing slots together, small batches grouped), microseconds apart: measured from one
    /// batch to the next, the pace read 10,000-500,000 samples/s.
    #[test]
    fn a_pace_of_bursts_is_the_trainer_s_pace_not_the_burst_s() {
        let start = Instant::now();
        let mut rate = Rate::new();
        let mut position = 0u64;
        // Bursts `from..to` of four batches of `batch` samples, a microsecond apart, every half
        // second; the pace read after them.
        let mut bursts = |from: u64, to: u64, batch: u64| {
            for burst in from..to {
                for b in 0..4u64 {
                    position += batch;
                    rate.note(start + Duration::from_millis(500 * burst) + Duration::from_micros(b), position);
                }
            }
            rate.samples_per_s
        };
        let pace = bursts(0, 40, 8);
        assert!((48.0..=90.0).contains(&pace), "measured {pace:.0} samples/s for 64");
        // A change of pace is followed within a few spans.
        let pace = bursts(40, 60, 32);
        assert!((200.0..=320.0).contains(&pace), "measured {pace:.0} samples/s for 256");
    }

    /// Before a whole span, the pace since the start stands in, erring high, never at the
    /// default: a stream's first second must not look slow to the prefetcher.
    #[test]
    fn the_first_span_takes_the_pace_since_the_start() {
        let start = Instant::now();
        let mut rate = Rate::new();
        rate.note(start, 0);
        rate.note(start + Duration::from_millis(100), 500);
        assert!((rate.samples_per_s - 5000.0).abs() < 1.0, "{}", rate.samples_per_s);
    }
}
