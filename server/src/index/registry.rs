//! The daemon's open datasets, keyed by URL and cache mode: bounded, single-flight, and cheap to
//! reopen.
//!
//! - **Single flight.** Every rank and DataLoader worker opens the dataset at the start of every
//!   epoch, all at once. The first open of a key does the work (discovery, and the index build
//!   that scans every shard's headers when there is no manifest); concurrent opens of the same key
//!   wait for it and share its result (`shardstream_dataset_opens_coalesced_total`).
//! - **Cheap revalidation.** A local dataset is trusted again without listing or stat-ing its
//!   shards when its directory (and manifest) carry the same mtime as when it was last checked,
//!   for up to [`LOCAL_REVALIDATE`]: two `stat` calls per open instead of one per shard (the
//!   metadata storm this daemon exists to prevent). A replaced or added shard goes through a
//!   rename or a new directory entry, which moves the directory's mtime (a partitioned dataset's
//!   partition directories are stat'ed too: one `stat` each); a shard rewritten in
//!   place (pyarrow, tarfile) fails the length or mtime check when it is opened (served from a
//!   node-cache copy, when the copy is first used after such an open: one `stat` of the
//!   source), which marks the dataset changed ([`Dataset::changed`]), and the next open lists it
//!   again.
//!   An S3 dataset is trusted for [`super::REMOTE_REDISCOVERY`].
//! - **Bounds.** At most `max_datasets` entries and `max_index_bytes` of shard tables; the least
//!   recently opened entries that no stream holds are evicted first. A dataset in use is never
//!   evicted (a stream holds it), so the bound can be exceeded by datasets in use only.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{Backends, CacheMode, Dataset, Discovered, REMOTE_REDISCOVERY};
use crate::storage::DatasetUrl;
use crate::storage::local;
use crate::{Error, Result};

/// How long a local dataset whose directory did not change is trusted without a full listing.
pub const LOCAL_REVALIDATE: Duration = Duration::from_secs(60);

/// Shards `stat`'ed by an open that reuses a local listing ([`Dataset::spot_changed`]): a dataset
/// rewritten in place (which leaves its directory's time as it was) is listed again at once. A
/// burst of opens (every rank and worker of a job) costs this many each, not a listing each.
const SPOT_CHECKS: usize = 8;

/// Datasets kept open at most when no stream uses them (default).
pub const DEFAULT_MAX_DATASETS: usize = 64;

/// Bytes of dataset-wide index (shard lists, prefix sums) kept at most (default): ~1e7 shards.
pub const DEFAULT_MAX_INDEX_BYTES: u64 = 2 << 30;

/// Bounds of a [`Registry`].
#[derive(Debug, Clone, Copy)]
pub struct RegistryLimits {
    pub max_datasets: usize,
    pub max_index_bytes: u64,
}

impl Default for RegistryLimits {
    fn default() -> Self {
        Self { max_datasets: DEFAULT_MAX_DATASETS, max_index_bytes: DEFAULT_MAX_INDEX_BYTES }
    }
}

/// Counters of the registry (also exported as `shardstream_dataset_*`).
#[derive(Debug, Default)]
pub struct RegistryStats {
    /// Opens asked for.
    pub opens: AtomicU64,
    /// Opens that waited for another open of the same dataset instead of doing the work.
    pub coalesced: AtomicU64,
    /// Datasets built (discovery + index), i.e. opens that were not served from the registry.
    pub builds: AtomicU64,
    /// Entries dropped to stay within the bounds.
    pub evictions: AtomicU64,
}

type Key = (String, CacheMode);

/// What tells a local dataset's directory has not changed since it was checked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DirStamp {
    dir_mtime_ns: i64,
    manifest_mtime_ns: Option<i64>,
    /// A partitioned dataset's partition directories (paths below `dir`) and their mtimes: a
    /// file added to `year=2020/` moves that directory's mtime, not the dataset's.
    parts: Vec<(String, Option<i64>)>,
}

impl DirStamp {
    /// Two `stat` calls, the directory and its manifest (absent is a valid state), and one per
    /// partition directory in `parts` (paths below `dir`).
    fn read<'a>(dir: &Path, parts: impl Iterator<Item = &'a str>) -> Option<Self> {
        let meta = std::fs::metadata(dir).ok()?;
        crate::metrics::local_stat(1);
        let manifest = dir.join(super::manifest::MANIFEST_FILE);
        crate::metrics::local_stat(1);
        let manifest_mtime_ns = std::fs::metadata(manifest).ok().map(|m| local::mtime_ns(&m));
        let parts = parts
            .map(|p| {
                crate::metrics::local_stat(1);
                (p.to_owned(), std::fs::metadata(dir.join(p)).ok().map(|m| local::mtime_ns(&m)))
            })
            .collect();
        Some(Self { dir_mtime_ns: local::mtime_ns(&meta), manifest_mtime_ns, parts })
    }

    /// The partition directories this stamp covers.
    fn part_names(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().map(|(p, _)| p.as_str())
    }
}

/// The partition directories of a dataset's shards (every directory on their paths below the
/// dataset's, each once, sorted); none for a dataset that is not partitioned.
fn partition_dirs(ds: &Dataset) -> Vec<String> {
    let mut dirs = std::collections::BTreeSet::new();
    for s in &ds.shards {
        let mut at = s.name.as_str();
        while let Some((parent, _)) = at.rsplit_once('/') {
            if !dirs.insert(parent.to_owned()) {
                break;
            }
            at = parent;
        }
    }
    dirs.into_iter().collect()
}

#[derive(Debug)]
struct Entry {
    ds: Arc<Dataset>,
    last_used: u64,
    checked: Instant,
    stamp: Option<DirStamp>,
    index_bytes: u64,
}

/// One open in progress; the others wait on it.
#[derive(Debug, Default)]
struct Flight {
    /// Set once the leader is done: its result, or `None` when it was refused.
    done: Mutex<Option<Option<Outcome>>>,
    cond: Condvar,
}

/// A requester's check of the shards of a dataset it opens ([`Registry::open_admitted`]).
pub type Admit<'a> = dyn Fn(&[super::ShardMeta]) -> Result<()> + 'a;

/// Why an open it led failed, for the leader: the requester's own refusal, which its waiters
/// must not take for theirs, or anything else, which they share.
enum Failed {
    Refused(Error),
    Other(Error),
}

impl From<Error> for Failed {
    fn from(e: Error) -> Self {
        Failed::Other(e)
    }
}

/// An error as every waiter of a flight receives it (the crate's error is not `Clone`).
type Shared = Arc<Error>;

/// A finished open, as a flight hands it to every waiter.
type Outcome = std::result::Result<Arc<Dataset>, Shared>;

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<Key, Entry>,
    flights: HashMap<Key, Arc<Flight>>,
    clock: u64,
}

#[derive(Debug)]
pub struct Registry {
    inner: Mutex<Inner>,
    cache_dir: Option<PathBuf>,
    backends: Arc<Backends>,
    limits: RegistryLimits,
    pub stats: RegistryStats,
}

impl Registry {
    pub fn new(cache_dir: Option<PathBuf>, backends: Arc<Backends>) -> Self {
        Self::with_limits(cache_dir, backends, RegistryLimits::default())
    }

    pub fn with_limits(cache_dir: Option<PathBuf>, backends: Arc<Backends>, limits: RegistryLimits) -> Self {
        Self { inner: Mutex::default(), cache_dir, backends, limits, stats: RegistryStats::default() }
    }

    pub fn backends(&self) -> &Arc<Backends> {
        &self.backends
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Opens (or reuses) a dataset; `mode`: what the client asked for ("", "auto", "direct",
    /// "copy"). Blocking; concurrent opens of the same dataset share one open.
    pub fn open(&self, url: &str, mode: &str) -> Result<Arc<Dataset>> {
        self.open_admitted(url, mode, &|_| Ok(()))
    }

    /// As [`Registry::open`], for a requester whom `admit` must accept every shard of (where it
    /// lies: [`crate::access::AllowList::check_shards`]): checked on the shards found before
    /// any of them is read, and on every dataset handed out, shared or reused. A refusal is this
    /// requester's alone: an open it led is not shared, and the ones waiting on it open anew.
    pub fn open_admitted(&self, url: &str, mode: &str, admit: &Admit<'_>) -> Result<Arc<Dataset>> {
        let admitted = |ds: Arc<Dataset>| admit(&ds.shards).map(|()| ds);
        self.stats.opens.fetch_add(1, Relaxed);
        crate::metrics::dataset_open();
        let requested = mode;
        let parsed = DatasetUrl::parse(url)?;
        let mode = CacheMode::resolve(mode, &parsed)?;
        // Keyed by what the URL names, not how it is spelt: two spellings would hold two
        // listings and indexes of one dataset, and decode its row groups twice.
        let key = (parsed.identity(), mode);
        let (flight, existing) = {
            let mut g = self.lock();
            if let Some(f) = g.flights.get(&key).cloned() {
                drop(g);
                self.stats.coalesced.fetch_add(1, Relaxed);
                crate::metrics::dataset_open_coalesced();
                return match f.wait() {
                    // Its leader was refused: that says nothing of this requester.
                    None => self.open_admitted(url, requested, admit),
                    Some(got) => got.and_then(admitted),
                };
            }
            g.clock += 1;
            let clock = g.clock;
            let existing = g.entries.get_mut(&key).map(|e| {
                e.last_used = clock;
                (e.ds.clone(), e.checked, e.stamp.clone())
            });
            // Every rank and worker opens the dataset at every epoch: for S3 that would be a
            // listing (or manifest GET) each time, so a recent open is reused instead.
            if let Some((ds, checked, _)) = &existing
                && matches!(parsed, DatasetUrl::S3 { .. })
                && checked.elapsed() < REMOTE_REDISCOVERY
                && !ds.changed()
            {
                return admitted(ds.clone());
            }
            let flight = Arc::new(Flight::default());
            g.flights.insert(key.clone(), flight.clone());
            (flight, existing)
        };
        // The leader: whatever happens (a panic included), the waiters get an answer and the
        // flight ends.
        let mut leader = Leader { registry: self, key: Some(key), flight };
        let result = self.open_uncoalesced(url, &parsed, mode, existing, admit);
        let key = leader.key.take().unwrap_or_else(|| (parsed.identity(), mode));
        let flight = leader.flight.clone();
        let shared = {
            let mut g = self.lock();
            g.flights.remove(&key);
            match result {
                Ok((ds, stamp, checked)) => {
                    let clock = g.clock;
                    let index_bytes = ds.index_bytes();
                    g.entries.insert(key, Entry { ds: ds.clone(), last_used: clock, checked, stamp, index_bytes });
                    self.evict(&mut g);
                    Ok(ds)
                }
                Err(Failed::Other(e)) => Err(Arc::new(e)),
                Err(Failed::Refused(e)) => {
                    drop(g);
                    flight.finish(None);
                    return Err(e);
                }
            }
        };
        flight.finish(Some(&shared));
        shared.map_err(|e| e.again()).and_then(admitted)
    }

    /// Discovery and, when the shards changed, the index build; no registry lock held (a scan
    /// can take long, and other datasets must stay available meanwhile).
    fn open_uncoalesced(
        &self,
        url: &str,
        parsed: &DatasetUrl,
        mode: CacheMode,
        existing: Option<(Arc<Dataset>, Instant, Option<DirStamp>)>,
        admit: &Admit<'_>,
    ) -> std::result::Result<(Arc<Dataset>, Option<DirStamp>, Instant), Failed> {
        // The partition directories the last check stat'ed, stat'ed again.
        let old_stamp = existing.as_ref().and_then(|(_, _, old)| old.as_ref());
        let stamp = match parsed {
            DatasetUrl::Local { dir, .. } => DirStamp::read(dir, old_stamp.into_iter().flat_map(DirStamp::part_names)),
            DatasetUrl::S3 { .. } => None,
        };
        // The stamp of a dataset first found partitioned, or partitioned otherwise than before,
        // is taken again for its directories after the listing (a file added in between is seen
        // by the open after LOCAL_REVALIDATE, as a change to an S3 dataset is).
        let restamp = |ds: &Dataset, stamp: Option<DirStamp>| match (parsed, stamp) {
            (DatasetUrl::Local { dir, .. }, Some(stamp)) => {
                let now = partition_dirs(ds);
                if stamp.part_names().eq(now.iter().map(String::as_str)) {
                    Some(stamp)
                } else {
                    DirStamp::read(dir, now.iter().map(String::as_str))
                }
            }
            (_, stamp) => stamp,
        };
        if let Some((ds, checked, old)) = &existing
            && stamp.is_some()
            && stamp == *old
            && checked.elapsed() < LOCAL_REVALIDATE
            && !ds.changed()
            && !ds.spot_changed(SPOT_CHECKS)
        {
            // Nothing was added, removed or renamed since the last full check: no listing.
            ds.reopened_unlisted();
            return Ok((ds.clone(), stamp, *checked));
        }
        let found = Discovered::discover(url, &self.backends)?;
        // Before a byte of a shard is read (a scan's or a footer's error could tell of it).
        admit(&found.shards).map_err(Failed::Refused)?;
        let now = Instant::now();
        if let Some((ds, _, _)) = existing
            && ds.same_shards(&found)
        {
            ds.relisted_unchanged();
            let stamp = restamp(&ds, stamp);
            return Ok((ds, stamp, now));
        }
        self.stats.builds.fetch_add(1, Relaxed);
        crate::metrics::dataset_build();
        let ds = Arc::new(Dataset::build(found, mode, self.cache_dir.as_deref(), self.backends.clone())?);
        let stamp = restamp(&ds, stamp);
        Ok((ds, stamp, now))
    }

    /// Drops the least recently opened entries no stream holds until the bounds hold again.
    fn evict(&self, g: &mut Inner) {
        loop {
            let count = g.entries.len();
            let bytes: u64 = g.entries.values().map(|e| e.index_bytes).sum();
            if count <= self.limits.max_datasets && bytes <= self.limits.max_index_bytes {
                break;
            }
            // Held only by the registry: no stream, prefetch consumer or staging job uses it.
            let victim = g
                .entries
                .iter()
                .filter(|(_, e)| Arc::strong_count(&e.ds) == 1)
                .min_by_key(|(_, e)| e.last_used)
                .map(|(k, _)| k.clone());
            let Some(victim) = victim else { break };
            g.entries.remove(&victim);
            self.stats.evictions.fetch_add(1, Relaxed);
            crate::metrics::dataset_eviction();
            tracing::debug!(url = %victim.0, "dataset evicted from the registry");
        }
        crate::metrics::datasets_registered(g.entries.len() as u64);
    }

    pub fn all(&self) -> Vec<Arc<Dataset>> {
        self.lock().entries.values().map(|e| e.ds.clone()).collect()
    }

    /// Datasets registered right now.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Ends a flight its leader left by unwinding, so that no open waits for it forever.
struct Leader<'a> {
    registry: &'a Registry,
    /// Taken when the leader finishes normally.
    key: Option<Key>,
    flight: Arc<Flight>,
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.registry.lock().flights.remove(&key);
            self.flight.finish(Some(&Err(Arc::new(Error::Internal(format!("opening {} failed unexpectedly", key.0))))));
        }
    }
}

impl Flight {
    /// The leader's result; `None` when the leader was refused ([`Failed::Refused`]).
    fn wait(&self) -> Option<Result<Arc<Dataset>>> {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = &*done {
                return r.as_ref().map(|r| r.clone().map_err(|e| e.again()));
            }
            done = self.cond.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn finish(&self, result: Option<&Outcome>) {
        *self.done.lock().unwrap_or_else(|p| p.into_inner()) = Some(result.cloned());
        self.cond.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_shard(dir: &std::path::Path, name: &str) {
        std::fs::create_dir_all(dir).expect("dataset dir");
        let mut b = tar::Builder::new(std::fs::File::create(dir.join(name)).expect("shard"));
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, "k0.bin", &b"ab"[..]).expect("member");
        b.finish().expect("tar end");
    }

    /// A local dataset of one shard (kept while the temp dir lives), its URL, a fresh registry.
    fn one_shard_dataset() -> (tempfile::TempDir, String, Registry) {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dir = tmp.path().join("d");
        write_shard(&dir, "part-0000.tar");
        let url = dir.display().to_string();
        (tmp, url, Registry::new(None, Arc::new(Backends::local())))
    }

    /// What an allow list answers a requester outside it.
    fn not_yours() -> Error {
        Error::PermissionDenied { path: "d".into(), reason: "not yours".into() }
    }

    #[test]
    fn a_refused_open_reads_nothing_keeps_nothing_and_is_that_requesters_alone() {
        let (_tmp, url, reg) = one_shard_dataset();
        let refuse = |_: &[crate::index::ShardMeta]| -> Result<()> { Err(not_yours()) };
        let err = reg.open_admitted(&url, "", &refuse).expect_err("refused");
        assert!(matches!(err, Error::PermissionDenied { .. }), "{err}");
        // Refused before the build: nothing indexed, nothing kept for the next requester.
        assert_eq!(reg.stats.builds.load(Relaxed), 0);
        assert!(reg.all().is_empty());
        let ds = reg.open(&url, "").expect("another requester");
        assert_eq!((ds.num_samples(), reg.stats.builds.load(Relaxed)), (1, 1));
        // A dataset kept in the registry is checked again for each requester.
        assert!(reg.open_admitted(&url, "", &refuse).is_err());
        assert!(reg.open(&url, "").is_ok());
    }

    #[test]
    fn a_requester_waiting_on_a_refused_leader_opens_for_itself() {
        let (_tmp, url, reg) = one_shard_dataset();
        // The leader is refused only once the other requester waits on its flight.
        let refuse_late = |_: &[crate::index::ShardMeta]| -> Result<()> {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while reg.stats.coalesced.load(Relaxed) == 0 && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(not_yours())
        };
        let (led, waited) = std::thread::scope(|s| {
            let leader = s.spawn(|| reg.open_admitted(&url, "", &refuse_late));
            // Starts once the leader holds the flight (its admit check runs before the build).
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while reg.lock().flights.is_empty() {
                assert!(std::time::Instant::now() < deadline, "the leader never took the flight");
                std::thread::yield_now();
            }
            let waited = reg.open(&url, "");
            (leader.join().expect("leader thread"), waited)
        });
        assert_eq!(reg.stats.coalesced.load(Relaxed), 1, "the second open did not wait on the first");
        assert!(matches!(led, Err(Error::PermissionDenied { .. })), "{:?}", led.err());
        let ds = waited.expect("the waiter's own open");
        assert_eq!((ds.num_samples(), reg.stats.builds.load(Relaxed)), (1, 1));
    }
}
