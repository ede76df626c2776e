//! Clairvoyant prefetch: every consumer's sample order is a pure function of its parameters, so
//! the daemon knows, for every shard, when each active consumer will next need it. The
//! prefetcher merges those futures and
//!
//! - fetches shards into the node cache in order of first future use, as far ahead as a horizon
//!   measured in *seconds of consumption* (each consumer's measured samples/s turns its sample
//!   positions into time, so a fast consumer is served further ahead than a slow one);
//! - tells the cache, when it must evict, how far away each shard's next use is, so it evicts
//!   the one needed farthest in the future (Belady's rule) and never one needed sooner than the
//!   shard it is making room for;
//! - looks one epoch beyond the current one (a trainer that finishes epoch `e` asks for `e + 1`
//!   with the same parameters), which is what keeps the right half of a too-small cache across
//!   the epoch boundary.
//!
//! With the LRU policy (kept for comparison) the prefetcher only reads ahead each consumer's next
//! [`MIN_AHEAD`] shards, like a streaming loader without knowledge of the future would.
//!
//! One thread runs the loop; fetches run on up to `parallel` threads of their own. Lock order:
//! consumers -> (released) -> node cache table; the snapshot lock is never held with another.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, Weak};
use std::time::{Duration, Instant};

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

/// How often the plan is recomputed without an event (new consumer, fetch done, progress).
const TICK: Duration = Duration::from_millis(100);

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
                        None => ds.locate(id).map(|(s, local)| (s, id - local, ds.shards[s].samples)),
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
    fn key(&self, n: usize) -> Option<String>;
    /// True when the copy is in the cache; false when the cache gave up (no room, or another fill
    /// of it under way).
    fn fetch(&self, n: usize, want: Want) -> crate::Result<bool>;
    /// The shard `n` is of (for messages).
    fn shard(&self, n: usize) -> Option<usize>;
    /// The bytes of what `n` names in the cache.
    fn len(&self, n: usize) -> u64;
}

/// One active stream as the prefetcher sees it.
#[derive(Debug)]
pub struct Consumer {
    dataset: Arc<Dataset>,
    /// Set when the stream caches column chunks instead of whole shards.
    projected: Option<Arc<dyn ProjectedFetch>>,
    uses: Vec<ShardUse>,
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
    /// Cache key -> seconds until its next use by any consumer (as of the last tick).
    next_use: RwLock<HashMap<String, f64>>,
    inflight: Mutex<HashSet<String>>,
    /// Shards whose prefetch failed, and when they may be tried again ([`FAILED_RETRY`]).
    failed: Mutex<HashMap<String, Instant>>,
    wake: (Mutex<bool>, Condvar),
    horizon_s: Mutex<f64>,
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
        p.next_use.read().unwrap_or_else(|e| e.into_inner()).get(key).copied()
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
            next_use: RwLock::default(),
            inflight: Mutex::default(),
            failed: Mutex::default(),
            wake: (Mutex::new(false), Condvar::new()),
            horizon_s: Mutex::new(0.0),
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

    pub fn wake(&self) {
        *self.wake.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.wake.1.notify_one();
    }

    /// Registers a stream's future. `uses`: its shard spans from the rank sequence's start, this
    /// epoch and (offset by this epoch's length) the next; `position`: where it starts.
    pub fn register(
        self: &Arc<Self>,
        dataset: Arc<Dataset>,
        uses: Vec<ShardUse>,
        position: u64,
        rank: u32,
        worker: u32,
        projected: Option<Arc<dyn ProjectedFetch>>,
    ) -> ConsumerGuard {
        let consumer = Arc::new(Consumer {
            dataset,
            projected,
            uses,
            position: AtomicU64::new(position),
            rate: Mutex::new(Rate::new()),
            rank,
            worker,
            waited_us: AtomicU64::new(0),
        });
        let id = self.next_id.fetch_add(1, Relaxed);
        self.lock_consumers().insert(id, consumer.clone());
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

    /// One planning round: recompute every cached shard's next use, start fetches, measure the
    /// horizon.
    fn tick(self: &Arc<Self>) {
        let consumers: Vec<Arc<Consumer>> = self.lock_consumers().values().cloned().collect();
        let clairvoyant = self.cache.policy() == Policy::Belady;
        let horizon = self.config.horizon.as_secs_f64();
        // key -> (seconds until next use, the consumer, what the use names: a shard, or a plan
        // unit for a stream caching a row group at a time)
        let mut next: HashMap<String, (f64, Arc<Consumer>, usize)> = HashMap::new();
        // (seconds until next use, key, bytes)
        let mut wanted: Vec<(f64, String, u64)> = Vec::new();
        let mut horizon_s = f64::INFINITY;
        for c in &consumers {
            let (pos, rate) = (c.position.load(Relaxed), c.rate());
            let mut ahead = 0usize;
            // A shard's later stretches (Parquet) are not more shards ahead.
            let mut counted: HashSet<u32> = HashSet::new();
            let mut ready_until: Option<f64> = None;
            for u in c.uses.iter().filter(|u| u.last >= pos) {
                let shard = u.shard as usize;
                let key = match &c.projected {
                    Some(p) => p.key(shard),
                    None => c.dataset.cache_key(shard).map(str::to_owned),
                };
                let Some(key) = key else { continue };
                let key = key.as_str();
                let secs = u.first.saturating_sub(pos) as f64 / rate;
                let e = next.entry(key.to_owned()).or_insert((secs, c.clone(), shard));
                if secs < e.0 {
                    *e = (secs, c.clone(), shard);
                }
                if ready_until.is_none() && !self.cache.is_ready(key) {
                    ready_until = Some(secs);
                }
                let within = if clairvoyant { secs <= horizon || ahead < MIN_AHEAD } else { ahead < MIN_AHEAD };
                if within {
                    let bytes = match &c.projected {
                        Some(p) => p.len(shard),
                        None => c.dataset.shards.get(shard).map_or(0, |m| m.len),
                    };
                    wanted.push((secs, key.to_owned(), bytes));
                }
                if counted.insert(u.shard) {
                    ahead += 1;
                }
            }
            // All of its future is cached: the horizon is the rest of its order.
            let ready =
                ready_until.unwrap_or_else(|| c.uses.last().map_or(0.0, |u| u.last.saturating_sub(pos) as f64 / rate));
            horizon_s = horizon_s.min(ready);
        }
        let horizon_s = if horizon_s.is_finite() { horizon_s } else { 0.0 };
        *self.horizon_s.lock().unwrap_or_else(|p| p.into_inner()) = horizon_s;
        crate::metrics::prefetch_horizon(horizon_s);
        *self.next_use.write().unwrap_or_else(|p| p.into_inner()) =
            next.iter().map(|(k, (s, _, _))| (k.clone(), *s)).collect();

        wanted.sort_by(|a, b| a.0.total_cmp(&b.0));
        soonest_that_fit(&mut wanted, self.cache.capacity());
        wanted.dedup_by(|a, b| a.1 == b.1);
        let now = Instant::now();
        let backed_off: HashSet<String> = {
            let mut failed = self.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.retain(|_, retry| *retry > now);
            failed.keys().cloned().collect()
        };
        for (secs, key, _) in wanted {
            // Backed off after its own failure, or after a stream's (the prefetch gave the fill
            // to a stream, which then failed it).
            if self.cache.is_present(&key)
                || backed_off.contains(&key)
                || self.cache.failed_recently(&key, FAILED_RETRY)
            {
                continue;
            }
            {
                let mut inflight = self.inflight.lock().unwrap_or_else(|p| p.into_inner());
                if inflight.len() >= self.config.parallel.max(1) {
                    break;
                }
                if !inflight.insert(key.clone()) {
                    continue;
                }
            }
            let Some((_, c, shard)) = next.get(&key).cloned() else { continue };
            let ds = c.dataset.clone();
            let me = self.clone();
            let fetching = key.clone();
            let spawned = spawn_fetch(move || {
                // A prefetch never waits and never evicts a shard needed sooner than this one.
                let want = Want { urgency: secs, wait: false, since: None };
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
                    me.wake();
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

/// Cuts `wanted` (seconds until next use, cache key, bytes; sorted by the first) to the soonest
/// needed that the cache can hold together, counting what it holds already: a fetch past that
/// could only evict what is needed after it, which is itself wanted and fetched again a tick
/// later, evicting the next. With a cache smaller than an epoch, the row groups at the edge of
/// what fits chased each other out: a staged cache's first epoch at a trainer's pace fetched
/// 0.79x of the chunks where 0.25x were missing, 0.59x with the cut (bench/S3_RESULTS.md, "The
/// prefetcher's cut"). A key wanted by several consumers counts once.
fn soonest_that_fit(wanted: &mut Vec<(f64, String, u64)>, capacity: u64) {
    let fits = {
        let mut seen: HashSet<&str> = HashSet::new();
        let mut held = 0u64;
        wanted
            .iter()
            .take_while(|(_, key, bytes)| {
                if seen.insert(key.as_str()) {
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

fn run(weak: Weak<Prefetcher>) {
    loop {
        let Some(p) = weak.upgrade() else { return };
        if p.stopped.load(Relaxed) {
            return;
        }
        p.tick();
        let (lock, cv) = &p.wake;
        let mut woken = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !*woken {
            woken = cv.wait_timeout(woken, TICK).unwrap_or_else(|e| e.into_inner()).0;
        }
        *woken = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_soonest_needed_that_fit_together_are_wanted() {
        let w = |secs: f64, key: &str, bytes: u64| (secs, key.to_string(), bytes);
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
