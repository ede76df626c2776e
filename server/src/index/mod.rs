//! The dataset index: which shards a dataset has, how many samples each holds, and — only for
//! the shards in use — their member tables.
//!
//! Memory is kept compact on purpose. The dataset-wide part is one prefix sum of sample counts
//! (8 bytes per shard), so a sample id maps to its shard by binary search. A shard's member table
//! (8 bytes per sample: the byte offset where each sample starts, plus its layout of
//! `4 x (2 + 2 x fields)` bytes: where its key and fields lie) is loaded when a stream first
//! needs the shard — from its sidecar, or by scanning the shard's headers — and dropped again when
//! more than [`MAX_RESIDENT_TABLES`] tables or [`MAX_RESIDENT_TABLE_BYTES`] are resident. Sample
//! keys are never held: the layout says where they are in the shard.
//!
//! Shards listed in a manifest are verified (size and CRC-32C) the first time they are used, before
//! any of their bytes is served: the whole file's CRC, or for a Parquet manifest written by
//! `shardstream index` (`"checksum": "crc32c-footer"`) the CRC of the file's footer, read again
//! from the file or its node-cache copy (see `manifest`).
//!
//! Where the bytes are read from depends on the dataset's [`CacheMode`]: in place (`direct`, the
//! default for local and parallel file systems) or from a copy in the node cache (`copy`, always
//! for S3). A cached shard in use is pinned ([`ResidentShard`] holds the pin), so the cache never
//! evicts what a stream is reading. Open shards are shared between streams through weak
//! references: a shard closes (and unpins) when the last stream that uses it moves on; each
//! stream keeps its own working set alive with a [`Working`] set.

pub mod build;
pub mod manifest;
pub mod registry;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::cache::download::{self, FetchSpec};
use crate::cache::{NodeCache, Pin, Want};
use crate::format::{Format, ShardTable};
use crate::storage::local::{self, ShardFile};
use crate::storage::s3::{S3Options, S3Store};
use crate::storage::{DatasetUrl, ShardSource};
use crate::{Error, Result};
use manifest::Manifest;
pub use registry::{Registry, RegistryLimits};

/// Member tables kept resident at most, per dataset. A consumer needs about `window + 1` shards at
/// a time; 8 ranks x 8 workers with a window of 8 shards need ~600, so 4096 leaves room for many
/// jobs while bounding memory (4096 shards x 1000 samples x 8 bytes = 32 MiB).
pub const MAX_RESIDENT_TABLES: usize = 4096;

/// Bytes of member tables kept resident at most, per dataset (tables in use by a stream stay
/// alive through it beyond this). 4096 shards x 1000 samples x 32 bytes (boundary + two-field
/// layout) is 128 MiB: this keeps the largest case at half that, and the common one (hundreds of
/// shards in use) unaffected.
pub const MAX_RESIDENT_TABLE_BYTES: usize = 64 << 20;

/// Threads that scan shard headers when a dataset without manifest is opened. Header scans are
/// latency-bound on a parallel file system (one small read per member), so a few in parallel help
/// even on 2 cores.
const SCAN_THREADS: usize = 8;

/// How a dataset's shards reach the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// Read in place (local and parallel file systems).
    Direct,
    /// Read from a verified copy in the node cache (always for S3; on request for a PFS whose
    /// metadata or bandwidth is the bottleneck).
    Copy,
}

impl CacheMode {
    /// Parses the mode a client asked for ("", "auto", "direct", "copy") for `url`.
    pub fn resolve(requested: &str, url: &DatasetUrl) -> Result<Self> {
        match (requested, url) {
            ("" | "auto" | "copy", DatasetUrl::S3 { .. }) => Ok(CacheMode::Copy),
            ("direct", DatasetUrl::S3 { .. }) => Err(Error::invalid(format!(
                "cache=\"direct\" needs a file system path; {} is read through the node cache",
                url.base()
            ))),
            ("" | "auto" | "direct", DatasetUrl::Local { .. }) => Ok(CacheMode::Direct),
            ("copy", DatasetUrl::Local { .. }) => Ok(CacheMode::Copy),
            (other, _) => Err(Error::invalid(format!("cache mode {other:?} must be \"direct\", \"copy\" or \"auto\""))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::Direct => "direct",
            CacheMode::Copy => "copy",
        }
    }
}

/// One shard as the dataset knows it.
#[derive(Debug, Clone)]
pub struct ShardMeta {
    pub name: String,
    pub source: ShardSource,
    pub len: u64,
    pub samples: u64,
    /// CRC-32C of the whole file from the manifest; checked before first use.
    pub crc32c: Option<u32>,
    /// CRC-32C of a Parquet file's footer from a `crc32c-footer` manifest
    /// ([`footer_crc32c`](crate::format::parquet::footer::footer_crc32c)); checked before first
    /// use, like `crc32c`.
    pub footer_crc32c: Option<u32>,
    pub mtime_ns: Option<i64>,
    /// Sidecar path named by the manifest, if any.
    pub sidecar: Option<PathBuf>,
    /// Content digest of a local shard opened without manifest ([`content_digest`]): stands in
    /// for the mtime in the fingerprint, so a copy of the dataset keeps its fingerprint.
    pub content: Option<u64>,
    /// The shard's largest sample as its manifest entry records it (None without manifest, or
    /// from a manifest written before it was recorded).
    pub largest: Option<manifest::LargestInShard>,
}

impl ShardMeta {
    /// Identity the sidecar and the cache copy of this shard are keyed by: nothing made from
    /// other bytes is ever used for it.
    pub fn identity(&self) -> Vec<u8> {
        let etag = match &self.source {
            ShardSource::S3 { etag: Some(e), .. } => Some(e.as_str()),
            _ => None,
        };
        if let (None, Some(crc)) = (self.crc32c, self.footer_crc32c) {
            return format!("len={};footer_crc32c={crc:08x}", self.len).into_bytes();
        }
        match (self.crc32c, etag, self.mtime_ns) {
            (Some(crc), _, _) => format!("len={};crc32c={crc:08x}", self.len).into_bytes(),
            (None, Some(e), _) => format!("len={};etag={e}", self.len).into_bytes(),
            (None, None, Some(m)) => format!("len={};mtime_ns={m}", self.len).into_bytes(),
            (None, None, None) => format!("len={}", self.len).into_bytes(),
        }
    }

    /// The identity the dataset fingerprint uses: [`identity`](Self::identity), except that a
    /// content digest replaces the mtime (which a copy does not keep).
    pub fn content_identity(&self) -> Vec<u8> {
        match (self.crc32c.or(self.footer_crc32c), self.content) {
            (None, Some(d)) => format!("len={};content={d:016x}", self.len).into_bytes(),
            _ => self.identity(),
        }
    }

    /// The shard as errors name it (path or `s3://` URL).
    pub fn url(&self) -> String {
        self.source.url()
    }
}

/// A shard in use: its open file and member table, and (for a cached shard) the pin that keeps
/// the cache from evicting it.
#[derive(Debug)]
pub struct ResidentShard {
    pub file: ShardFile,
    pub table: Arc<ShardTable>,
    pin: Option<Pin>,
    mapped: std::sync::OnceLock<Option<memmap2::Mmap>>,
}

impl ResidentShard {
    /// The shard's bytes mapped read-only, for a node-cache copy only (made on first use, shared
    /// by every stream that holds this shard open). Safety of the mapping: a published cache file
    /// is immutable (filled under a temporary name and renamed; evicted by unlink, never
    /// truncated or rewritten in place) and pinned while this object lives, so its pages cannot
    /// go away under the mapping. A shard read in place (`direct`) belongs to someone else, who
    /// may truncate it: a mapping would then kill the daemon with SIGBUS, so those are read with
    /// `pread` and this returns None (as it does if mapping fails: reads work the same, slower).
    pub fn cached_bytes(&self) -> Option<&[u8]> {
        self.pin.as_ref()?;
        self.mapped.get_or_init(|| map_pinned(&self.file, true)).as_deref()
    }
}

/// `file` mapped read-only; only for a node-cache copy held by a [`Pin`] for as long as the
/// mapping lives (see [`ResidentShard::cached_bytes`]). `populate`: fault every page in now (for
/// serving, which reads them all); without it only the pages touched are (a header scan, which
/// must not read a whole shard that has left the page cache). None if the mapping fails.
fn map_pinned(file: &ShardFile, populate: bool) -> Option<memmap2::Mmap> {
    let mut options = memmap2::MmapOptions::new();
    if populate {
        options.populate();
    }
    // SAFETY: callers pass a published node-cache file they hold pinned: it is immutable (filled
    // under a temporary name and renamed; evicted by unlink, never truncated or rewritten in
    // place), so no page of the mapping can go away or change while it lives.
    let map = unsafe { options.map(&file.file) };
    map.inspect_err(|e| tracing::debug!(shard = %file.name, error = %e, "cannot map a cached shard")).ok()
}

/// What the daemon's datasets share: the node cache and the S3 connection (made on first use).
#[derive(Debug)]
pub struct Backends {
    pub cache: Option<Arc<NodeCache>>,
    s3_options: S3Options,
    s3: OnceLock<S3Store>,
    /// The runtime S3 requests run on (blocking callers enter it with `block_on`).
    rt: Option<tokio::runtime::Handle>,
}

impl Backends {
    pub fn new(cache: Option<Arc<NodeCache>>, s3_options: S3Options, rt: Option<tokio::runtime::Handle>) -> Self {
        Self { cache, s3_options, s3: OnceLock::new(), rt }
    }

    /// Local datasets only (tools and tests without a runtime or a cache).
    pub fn local() -> Self {
        Self::new(None, S3Options::default(), None)
    }

    /// The S3 connection, made on first use. Blocking.
    pub fn s3(&self) -> Result<&S3Store> {
        if let Some(s) = self.s3.get() {
            return Ok(s);
        }
        let rt = self.rt.as_ref().ok_or_else(|| Error::invalid("S3 datasets need the daemon (no runtime here)"))?;
        let store = rt.block_on(S3Store::connect(self.s3_options.clone()))?;
        Ok(self.s3.get_or_init(|| store))
    }
}

/// A stream's working set: the shards it used in its last batches, kept open (and pinned) so a
/// windowed shuffle that hops between a dozen shards per batch opens each once, not per sample.
#[derive(Debug, Default)]
pub struct Working {
    shards: HashMap<usize, (Arc<ResidentShard>, u64)>,
    batch: u64,
    /// Time spent waiting for shards to be fetched (cache misses), since the last `take_wait`.
    waited: Duration,
}

/// Largest ranged GET of a column-chunk copy: a piece larger than this (one column of a huge row
/// group) is fetched in parts, so no GET holds more than this in memory.
pub const PROJECTED_GET: u64 = 8 << 20;

/// Shards of one batch fetched at once when none of them is cached yet (a cold start): each is
/// itself a set of parallel ranged GETs, bounded daemon-wide.
const PRELOAD_THREADS: usize = 8;

/// Batches a shard stays in a working set after its last use: the shuffle window makes a shard
/// reappear within a batch or two, or not at all.
const WORKING_BATCHES: u64 = 2;

impl Working {
    pub fn get(&mut self, ds: &Dataset, i: usize) -> Result<&Arc<ResidentShard>> {
        let batch = self.batch;
        if !self.shards.contains_key(&i) {
            let started = Instant::now();
            let (s, fetched) = ds.shard_fetched(i)?;
            if fetched {
                self.waited += started.elapsed();
            }
            self.shards.insert(i, (s, batch));
        }
        let entry = self.shards.get_mut(&i).ok_or_else(|| Error::Internal("working set lost a shard".into()))?;
        entry.1 = batch;
        Ok(&entry.0)
    }

    /// Fetches, in parallel, the shards of a batch (`ids`: its sample ids) that are neither in
    /// the working set nor ready locally: a batch drawing on a dozen shards then waits for the
    /// slowest download, not for the sum of them. Datasets read in place skip this.
    pub fn preload(&mut self, ds: &Dataset, ids: &[u64]) -> Result<()> {
        if ds.mode == CacheMode::Direct {
            return Ok(());
        }
        let mut missing: Vec<usize> = ids
            .iter()
            .filter_map(|&id| ds.locate(id).map(|(s, _)| s))
            .filter(|s| !self.shards.contains_key(s))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        missing.retain(|&s| !ds.is_local(s));
        if missing.len() < 2 {
            return Ok(());
        }
        let started = Instant::now();
        let got = crate::parallel::try_map(&missing, PRELOAD_THREADS, |&s| ds.shard_fetched(s))?;
        self.waited += started.elapsed();
        for (s, (shard, _)) in missing.into_iter().zip(got) {
            self.shards.insert(s, (shard, self.batch));
        }
        Ok(())
    }

    /// Ends a batch: shards unused for [`WORKING_BATCHES`] batches are let go.
    pub fn end_batch(&mut self) {
        self.batch += 1;
        let keep_from = self.batch.saturating_sub(WORKING_BATCHES);
        self.shards.retain(|_, (_, used)| *used >= keep_from);
    }

    pub fn take_wait(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }
}

/// An opened dataset.
#[derive(Debug)]
pub struct Dataset {
    pub url: String,
    /// The shard format: every format-specific step (indexing, locating fields, the wire's batch
    /// format) goes through it.
    pub format: Format,
    pub mode: CacheMode,
    pub shards: Vec<ShardMeta>,
    /// prefix[i] = id of shard i's first sample; prefix[len] = total samples.
    prefix: Vec<u64>,
    pub fields: Vec<String>,
    pub fingerprint: String,
    pub from_manifest: bool,
    /// Where the daemon keeps sidecars of shards that came without one.
    sidecar_cache: Option<PathBuf>,
    backends: Arc<Backends>,
    /// Node-cache key of each shard (`copy` mode only).
    keys: Vec<String>,
    tables: Mutex<TableCache>,
    /// One lock per shard so that a shard needed by many streams at once is loaded (and verified)
    /// once, while loads of different shards proceed in parallel.
    load_locks: Vec<Mutex<()>>,
    verified: Vec<AtomicBool>,
    /// The largest sample known when the dataset opens: of every shard when all were scanned, of
    /// the shards whose manifest entry records it (`max_sample`) otherwise. What the inline transport checks
    /// against its message limit before a stream starts. None from an older manifest: the check
    /// then happens as each batch is built (`service::build_batch`).
    pub largest_sample: Option<LargestSample>,
    /// Parquet datasets: every file's footer table and the row numbering (all footers stay
    /// resident: a few KiB per file, and the schema check needs them all).
    pub parquet: Option<Arc<crate::format::parquet::dataset::ParquetDataset>>,
}

/// Where the dataset's largest sample is, and its size in shard bytes (headers included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargestSample {
    pub shard: usize,
    pub local: u64,
    /// Where it starts in the shard; unknown (None) when it came from a manifest.
    pub offset: Option<u64>,
    pub bytes: u64,
}

#[derive(Debug, Default)]
struct TableCache {
    resident: HashMap<usize, (Arc<ShardTable>, u64)>,
    /// Shards some stream has open right now (shared, never kept alive from here).
    open: HashMap<usize, Weak<ResidentShard>>,
    clock: u64,
    bytes: usize,
}

impl Dataset {
    /// Opens a local dataset read in place: one read of `manifest.json`, or one listing plus a
    /// header scan of each shard that has no valid sidecar in `cache_dir`. Blocking.
    pub fn open(url: &str, cache_dir: Option<&Path>) -> Result<Self> {
        let backends = Arc::new(Backends::local());
        Self::build(Discovered::discover(url, &backends)?, CacheMode::Direct, cache_dir, backends)
    }

    fn build(found: Discovered, mode: CacheMode, cache_dir: Option<&Path>, backends: Arc<Backends>) -> Result<Self> {
        let sidecar_cache = cache_dir.map(|c| c.join("index"));
        let Discovered { url, base, format, mut shards, manifest_fields } = found;
        format.check_served(&url)?;
        if mode == CacheMode::Copy && backends.cache.is_none() {
            return Err(Error::invalid(format!("{url} is read through the node cache, and this server has none")));
        }
        let keys: Vec<String> = match mode {
            CacheMode::Direct => Vec::new(),
            CacheMode::Copy => shards.iter().map(|m| crate::cache::key_for(&m.url(), &m.identity(), &m.name)).collect(),
        };
        // Parquet files are always opened by their footers (from sidecars when the daemon or
        // `shardstream index` saved them): the schema agreement and row groups come from there.
        let from_manifest = manifest_fields.is_some();
        let manifest_fields = manifest_fields.filter(|_| format != Format::Parquet);
        if let Some(fields) = manifest_fields {
            // A shard whose entry does not record it (an older manifest, a resumed older pack) may
            // hold a larger one: its samples are then checked as the shard is read.
            let largest_sample = shards
                .iter()
                .enumerate()
                .filter_map(|(shard, m)| {
                    m.largest.map(|l| LargestSample { shard, local: l.local, offset: None, bytes: l.bytes })
                })
                .max_by_key(|s| s.bytes);
            let mut ds = Self::assemble(&url, format, mode, base, shards, fields, true, sidecar_cache, backends, keys);
            ds.largest_sample = largest_sample;
            return Ok(ds);
        }
        let scanned = scan_all(format, &shards, &keys, &backends, sidecar_cache.as_deref())?;
        let mut fields = std::collections::BTreeSet::new();
        let mut tables = Vec::with_capacity(scanned.len());
        // S3 Parquet files whose footer was just read from the object itself, and matches the
        // manifest if there is one: already verified for column-chunk reads.
        let mut footer_checked = Vec::with_capacity(scanned.len());
        for (meta, (table, content, fresh)) in shards.iter_mut().zip(scanned) {
            let matches = match (&table, meta.footer_crc32c) {
                (ShardTable::Parquet(t), expected) => expected.is_none_or(|e| e == t.footer_crc32c()),
                (ShardTable::Tar(_), _) => false,
            };
            footer_checked.push(fresh && matches && meta.crc32c.is_none());
            meta.samples = table.num_samples();
            meta.content = content;
            fields.extend(table.fields().iter().cloned());
            tables.push(table);
        }
        let largest_sample = tables
            .iter()
            .enumerate()
            .filter_map(|(shard, t)| {
                let (local, bytes) = t.largest_sample()?;
                let offset = t.sample_range(local).map(|r| r.start);
                Some(LargestSample { shard, local, offset, bytes })
            })
            .max_by_key(|s| s.bytes);
        let fields: Vec<String> = match format {
            // The dataset's columns are its first file's, in file order (as pyarrow shows them).
            Format::Parquet => {
                tables.iter().find(|t| t.num_samples() > 0).map(|t| t.fields().to_vec()).unwrap_or_default()
            }
            Format::WebDataset => fields.into_iter().collect(),
        };
        let parquet = match format {
            Format::Parquet => Some(Arc::new(parquet_dataset(&shards, &tables)?)),
            Format::WebDataset => None,
        };
        let mut ds =
            Self::assemble(&url, format, mode, base, shards, fields, from_manifest, sidecar_cache, backends, keys);
        ds.largest_sample = largest_sample;
        ds.parquet = parquet;
        for (flag, checked) in ds.verified.iter().zip(footer_checked) {
            if checked {
                flag.store(true, Ordering::Release);
            }
        }
        // The scan just built every table: keep as many resident as the cache allows.
        for (i, table) in tables.into_iter().enumerate().take(MAX_RESIDENT_TABLES) {
            ds.insert_table(i, Arc::new(table));
        }
        Ok(ds)
    }

    /// True when `found` describes exactly the shards this dataset was built from.
    fn same_shards(&self, found: &Discovered) -> bool {
        self.from_manifest == found.manifest_fields.is_some()
            && self.format == found.format
            && self.shards.len() == found.shards.len()
            && self.shards.iter().zip(&found.shards).all(|(a, b)| a.name == b.name && a.identity() == b.identity())
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        url: &str,
        format: Format,
        mode: CacheMode,
        _base: String,
        shards: Vec<ShardMeta>,
        fields: Vec<String>,
        from_manifest: bool,
        sidecar_cache: Option<PathBuf>,
        backends: Arc<Backends>,
        keys: Vec<String>,
    ) -> Self {
        let mut prefix = Vec::with_capacity(shards.len() + 1);
        let mut total = 0u64;
        prefix.push(0);
        for s in &shards {
            total = total.saturating_add(s.samples);
            prefix.push(total);
        }
        let fingerprint = fingerprint(&shards);
        let n = shards.len();
        Self {
            url: url.to_owned(),
            format,
            mode,
            shards,
            prefix,
            fields,
            fingerprint,
            from_manifest,
            sidecar_cache,
            backends,
            keys,
            tables: Mutex::new(TableCache::default()),
            load_locks: (0..n).map(|_| Mutex::new(())).collect(),
            verified: (0..n).map(|_| AtomicBool::new(false)).collect(),
            largest_sample: None,
            parquet: None,
        }
    }

    pub fn num_samples(&self) -> u64 {
        self.prefix.last().copied().unwrap_or(0)
    }

    /// Approximate bytes of the dataset-wide index (shard list, prefix sums, cache keys): what
    /// the registry's byte bound counts. Member tables are bounded separately.
    pub fn index_bytes(&self) -> u64 {
        let per_shard = std::mem::size_of::<ShardMeta>()
            + 2 * std::mem::size_of::<u64>()
            + std::mem::size_of::<Mutex<()>>()
            + std::mem::size_of::<AtomicBool>();
        let names: usize = self.shards.iter().map(|s| 2 * s.name.len() + s.url().len()).sum();
        let keys: usize = self.keys.iter().map(String::len).sum();
        (self.shards.len() * per_shard + names + keys) as u64
    }

    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.len).sum()
    }

    /// Per-shard sample counts, in shard order.
    pub fn shard_samples(&self) -> Vec<u64> {
        self.shards.iter().map(|s| s.samples).collect()
    }

    /// Sample counts of the plan's units, in sample-id order (the plan's input): a TAR dataset's
    /// shards, a Parquet dataset's row groups. Units partition the same id range either way, so
    /// every id still maps to its shard (`locate`); what changes is what the shuffle permutes and
    /// what a shuffle window of `W` units holds. For Parquet, `W` row groups (the decode unit)
    /// instead of `W` whole files: a dataset of a few large files is mixed across all of them,
    /// and the decoded rows a window needs stay bounded. Deterministic from the dataset's
    /// footers, so every daemon of a job makes the same plan.
    pub fn plan_units(&self) -> Vec<u64> {
        match &self.parquet {
            Some(pq) => pq.unit_rows().to_vec(),
            None => self.shard_samples(),
        }
    }

    /// Maps a global sample id to (shard, sample within shard).
    pub fn locate(&self, id: u64) -> Option<(usize, u64)> {
        if id >= self.num_samples() {
            return None;
        }
        // First shard whose end is past `id`; empty shards are skipped naturally.
        let shard = self.prefix.partition_point(|&start| start <= id) - 1;
        Some((shard, id - self.prefix[shard]))
    }

    /// (resident tables, their bytes).
    pub fn resident(&self) -> (usize, usize) {
        let t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        (t.resident.len(), t.bytes)
    }

    /// The shard's open file and member table, loading (and verifying, or fetching into the node
    /// cache) it on first use. Blocking: call from a blocking thread.
    pub fn shard(&self, i: usize) -> Result<Arc<ResidentShard>> {
        self.shard_fetched(i).map(|(s, _)| s)
    }

    /// As [`shard`](Self::shard), and whether this call had to fetch or wait for the bytes.
    pub fn shard_fetched(&self, i: usize) -> Result<(Arc<ResidentShard>, bool)> {
        if let Some(s) = self.open_shard(i) {
            return Ok((s, false));
        }
        let lock = self.load_locks.get(i).ok_or_else(|| Error::Internal(format!("shard {i} out of range")))?;
        let _loading = lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = self.open_shard(i) {
            return Ok((s, false));
        }
        let meta = &self.shards[i];
        let (file, pin) = match (&meta.source, self.mode) {
            (ShardSource::Local(path), CacheMode::Direct) => {
                if !self.verified[i].load(Ordering::Acquire) {
                    if let Some(expected) = meta.crc32c {
                        verify(path, meta, expected)?;
                    } else if let Some(expected) = meta.footer_crc32c {
                        verify_footer(&ShardFile::open(path.clone(), meta.len)?, meta, expected)?;
                    }
                    self.verified[i].store(true, Ordering::Release);
                }
                (ShardFile::open(path.clone(), meta.len)?, None)
            }
            _ => {
                let pin = self.fetch(i, Want::NOW)?.ok_or_else(|| Error::Internal("a waiting fetch gave up".into()))?;
                (ShardFile::open_as(pin.path().to_owned(), meta.len, meta.url())?, Some(pin))
            }
        };
        let fetched = pin.as_ref().is_some_and(|p| p.filled);
        let table = match self.table(i) {
            Some(t) => t,
            None => {
                // A node-cache copy is scanned through a mapping (dropped before `pin`); a shard
                // read in place is not the daemon's to map (see `cached_bytes`).
                let scan = pin.as_ref().and_then(|_| map_pinned(&file, false));
                let t = Arc::new(load_table(self.format, meta, &file, scan.as_deref(), self.sidecar_cache.as_deref())?);
                self.insert_table(i, t.clone());
                t
            }
        };
        // The file's footer was checked above (or as its copy was cached); the table the rows are
        // decoded with came from a sidecar or an earlier read: it must be that same footer.
        if let (Some(expected), ShardTable::Parquet(t)) = (meta.footer_crc32c, table.as_ref())
            && t.footer_crc32c() != expected
        {
            return Err(footer_mismatch(
                &meta.url(),
                t.footer_crc32c(),
                expected,
                "the footer its table was decoded from",
            ));
        }
        if self.from_manifest && table.num_samples() != meta.samples {
            return Err(Error::Shard {
                shard: meta.url(),
                offset: None,
                reason: format!("holds {} samples but manifest.json says {}", table.num_samples(), meta.samples),
            });
        }
        let resident = Arc::new(ResidentShard { file, table, pin, mapped: std::sync::OnceLock::new() });
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        if t.open.len() > 2 * MAX_RESIDENT_TABLES {
            t.open.retain(|_, w| w.strong_count() > 0);
        }
        t.open.insert(i, Arc::downgrade(&resident));
        Ok((resident, fetched))
    }

    /// Node-cache key of the compact copy of Parquet file `i`'s column chunks for projection
    /// `proj_id` (see `service::projected`).
    pub fn projected_key(&self, i: usize, proj_id: u64) -> String {
        let m = &self.shards[i];
        crate::cache::key_for(
            &format!("{}#columns={proj_id:016x}", m.url()),
            &m.identity(),
            &format!("{}.cols", m.name),
        )
    }

    /// Fetches the pieces `pf` of S3 Parquet file `i` into the node cache entry `key` (ranged
    /// GETs of at most [`PROJECTED_GET`] bytes, `If-Match` on the file's ETag when known), or
    /// pins it there. `Ok(None)`: a prefetch that did not wait. Blocking.
    pub fn fetch_projected(
        &self,
        i: usize,
        pf: &crate::format::parquet::projected::ProjectedFile,
        key: &str,
        want: Want,
    ) -> Result<Option<Pin>> {
        use std::os::unix::fs::FileExt;
        let cache =
            self.backends.cache.as_ref().ok_or_else(|| Error::Internal(format!("{}: no node cache", self.url)))?;
        let meta = self.shards.get(i).ok_or_else(|| Error::Internal(format!("no shard {i}")))?;
        let ShardSource::S3 { bucket, key: object, etag } = &meta.source else {
            return Err(Error::Internal(format!("{} is not an S3 object", meta.url())));
        };
        let obj = crate::storage::s3::ObjectRef {
            bucket: bucket.clone(),
            key: object.clone(),
            len: meta.len,
            etag: etag.clone(),
        };
        let store = self.backends.s3()?;
        cache.get(key, pf.len(), want, &mut |tmp, file| {
            for (range, at) in pf.pieces() {
                let mut start = range.start;
                while start < range.end {
                    let end = range.end.min(start + PROJECTED_GET);
                    let (bytes, _) = store.block_on(store.get_range(&obj, start..end))?;
                    file.write_all_at(&bytes, at + (start - range.start))
                        .map_err(|e| Error::io("cannot write", tmp, e))?;
                    start = end;
                }
            }
            Ok(())
        })
    }

    /// Checks S3 Parquet file `i`'s footer once (one ranged GET of its tail) before its rows are
    /// served from column-chunk copies: against the manifest's `crc32c-footer` when there is one,
    /// and in any case against the footer the dataset was opened with (the chunk offsets the
    /// decoder uses come from it).
    pub fn verify_remote_footer(&self, i: usize) -> Result<()> {
        if self.verified.get(i).is_some_and(|v| v.load(Ordering::Acquire)) {
            return Ok(());
        }
        // Streams building batches at once check a file once, not once each.
        let lock = self.load_locks.get(i).ok_or_else(|| Error::Internal(format!("shard {i} out of range")))?;
        let _checking = lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.verified[i].load(Ordering::Acquire) {
            return Ok(());
        }
        let meta = self.shards.get(i).ok_or_else(|| Error::Internal(format!("no shard {i}")))?;
        let (opened, footer_bytes) = self
            .parquet
            .as_ref()
            .and_then(|p| p.files().iter().find(|f| f.index == i))
            .map(|f| (f.table.footer_crc32c(), f.table.footer_bytes()))
            .ok_or_else(|| Error::Internal(format!("{}: no footer table", meta.url())))?;
        // Exactly the footer, its length and magic as the dataset knows them: their CRC is the
        // footer checksum, and a footer of another length changes the length field it covers.
        let ShardSource::S3 { bucket, key, etag } = &meta.source else {
            return Err(Error::Internal(format!("{} is not an S3 object", meta.url())));
        };
        let obj = crate::storage::s3::ObjectRef {
            bucket: bucket.clone(),
            key: key.clone(),
            len: meta.len,
            etag: etag.clone(),
        };
        let tail = meta.len.saturating_sub(footer_bytes + crate::format::parquet::footer::FOOTER_TAIL_BYTES);
        let s3 = self.backends.s3()?;
        let (bytes, _) = s3.block_on(s3.get_range(&obj, tail..meta.len))?;
        let got = crc32c::crc32c(&bytes);
        if let Some(expected) = meta.footer_crc32c {
            if got != expected {
                return Err(footer_mismatch(&meta.url(), got, expected, "its footer"));
            }
            if opened != expected {
                return Err(footer_mismatch(&meta.url(), opened, expected, "the footer its table was decoded from"));
            }
        } else if got != opened {
            return Err(Error::Shard {
                shard: meta.url(),
                offset: None,
                reason: format!(
                    "its footer changed since the dataset was opened (crc32c {got:08x}, was {opened:08x}); \
                     refusing to serve it"
                ),
            });
        }
        self.verified[i].store(true, Ordering::Release);
        Ok(())
    }

    /// Node-cache key of shard `i` (`copy` mode).
    pub fn cache_key(&self, i: usize) -> Option<&str> {
        self.keys.get(i).map(String::as_str)
    }

    /// True when shard `i` can be read without fetching (read in place, or ready in the cache).
    pub fn is_local(&self, i: usize) -> bool {
        match (self.cache_key(i), &self.backends.cache) {
            (Some(k), Some(c)) => c.is_ready(k),
            _ => true,
        }
    }

    /// True when the node cache has free room for shard `i` without evicting anything.
    pub fn has_room_for(&self, i: usize) -> bool {
        self.backends.cache.as_ref().is_some_and(|c| {
            let s = c.stats();
            s.capacity.saturating_sub(s.used) >= self.shards[i].len
        })
    }

    /// Fetches shard `i` into the node cache (or pins it there). `Ok(None)`: a prefetch that did
    /// not wait (someone else is fetching it, or it does not fit without evicting sooner-needed
    /// shards). Blocking.
    pub fn fetch(&self, i: usize, want: Want) -> Result<Option<Pin>> {
        let (Some(key), Some(cache)) = (self.keys.get(i), &self.backends.cache) else {
            return Err(Error::Internal(format!("{}: shard {i} is not read through the cache", self.url)));
        };
        fetch_into(cache, &self.backends, &self.shards[i], key, want)
    }

    fn open_shard(&self, i: usize) -> Option<Arc<ResidentShard>> {
        let t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        t.open.get(&i).and_then(Weak::upgrade)
    }

    fn table(&self, i: usize) -> Option<Arc<ShardTable>> {
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        t.clock += 1;
        let clock = t.clock;
        t.resident.get_mut(&i).map(|(s, used)| {
            *used = clock;
            s.clone()
        })
    }

    fn insert_table(&self, i: usize, table: Arc<ShardTable>) {
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        t.clock += 1;
        let clock = t.clock;
        t.bytes += table.heap_bytes();
        if let Some((old, _)) = t.resident.insert(i, (table, clock)) {
            t.bytes -= old.heap_bytes();
        }
        while t.resident.len() > MAX_RESIDENT_TABLES || (t.bytes > MAX_RESIDENT_TABLE_BYTES && t.resident.len() > 1) {
            // Linear scan: runs only when a table is loaded past the cap, never per sample.
            let Some(victim) = t.resident.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k) else { break };
            if let Some((old, _)) = t.resident.remove(&victim) {
                t.bytes -= old.heap_bytes();
            }
        }
    }
}

/// Fetches one shard into the node cache with its verification.
fn fetch_into(
    cache: &Arc<NodeCache>,
    backends: &Backends,
    meta: &ShardMeta,
    key: &str,
    want: Want,
) -> Result<Option<Pin>> {
    let store = match meta.source {
        ShardSource::S3 { .. } => Some(backends.s3()?),
        ShardSource::Local(_) => None,
    };
    let spec =
        FetchSpec { source: &meta.source, len: meta.len, crc32c: meta.crc32c, footer_crc32c: meta.footer_crc32c };
    cache.get(key, meta.len, want, &mut |tmp, file| download::fill(&spec, store, tmp, file, Arc::new(())))
}

/// A dataset's shard list as found by one manifest read or one listing, before any shard is
/// scanned.
struct Discovered {
    url: String,
    format: Format,
    /// Location prefix a shard name is appended to (a directory or `s3://bucket/prefix/`).
    base: String,
    shards: Vec<ShardMeta>,
    /// Some(fields) when the list came from manifest.json (sample counts are then known).
    manifest_fields: Option<Vec<String>>,
}

/// Where the shards of a dataset are, for building their [`ShardSource`].
enum Place<'a> {
    Dir(&'a Path),
    Bucket { bucket: &'a str, prefix: &'a str },
}

impl Place<'_> {
    fn source(&self, name: &str, etag: Option<String>) -> ShardSource {
        match self {
            Place::Dir(dir) => ShardSource::Local(dir.join(name)),
            Place::Bucket { bucket, prefix } => {
                ShardSource::S3 { bucket: (*bucket).to_owned(), key: format!("{prefix}{name}"), etag }
            }
        }
    }
}

impl Discovered {
    fn discover(url: &str, backends: &Backends) -> Result<Self> {
        let parsed = DatasetUrl::parse(url)?;
        let base = parsed.base();
        match &parsed {
            DatasetUrl::Local { dir, names } => {
                let place = Place::Dir(dir);
                if let Some(manifest) = Manifest::read(dir)? {
                    return Self::from_manifest(url, base, &place, names.as_deref(), manifest);
                }
                let listed = local::list_shards(dir, names.as_deref())?;
                let format = Format::of_shards(listed.iter().map(|l| l.name.as_str()), &base)?;
                let shards = listed
                    .into_iter()
                    .map(|l| ShardMeta {
                        source: place.source(&l.name, None),
                        name: l.name,
                        len: l.len,
                        samples: 0,
                        crc32c: None,
                        footer_crc32c: None,
                        mtime_ns: Some(l.mtime_ns),
                        sidecar: None,
                        content: None,
                        largest: None,
                    })
                    .collect();
                Ok(Self { url: url.to_owned(), base, format, shards, manifest_fields: None })
            }
            DatasetUrl::S3 { bucket, prefix, names } => {
                let store = backends.s3()?;
                let place = Place::Bucket { bucket, prefix };
                let manifest_key = format!("{prefix}{}", manifest::MANIFEST_FILE);
                if let Some(bytes) = store.block_on(store.get_small(bucket, &manifest_key))? {
                    let m = Manifest::parse(&bytes, &format!("s3://{bucket}/{manifest_key}"))?;
                    return Self::from_manifest(url, base, &place, names.as_deref(), m);
                }
                let listed = crate::storage::s3::shards_in_listing(
                    store.block_on(store.list(bucket, prefix))?,
                    bucket,
                    prefix,
                    names.as_deref(),
                )?;
                let format = Format::of_shards(listed.iter().map(|(n, _)| n.as_str()), &base)?;
                let shards = listed
                    .into_iter()
                    .map(|(name, o)| ShardMeta {
                        source: place.source(&name, o.etag.clone()),
                        name,
                        len: o.size,
                        samples: 0,
                        crc32c: None,
                        footer_crc32c: None,
                        mtime_ns: None,
                        sidecar: None,
                        content: None,
                        largest: None,
                    })
                    .collect();
                Ok(Self { url: url.to_owned(), base, format, shards, manifest_fields: None })
            }
        }
    }

    fn from_manifest(
        url: &str,
        base: String,
        place: &Place<'_>,
        names: Option<&[String]>,
        m: Manifest,
    ) -> Result<Self> {
        let format = m.format()?;
        let footer_scope = m.checksum_scope() == manifest::ChecksumScope::Footer;
        let to_meta = |s: &manifest::ManifestShard| ShardMeta {
            name: s.name.clone(),
            // A recorded ETag makes every GET of the object conditional on it (If-Match).
            source: place.source(&s.name, s.etag.clone()),
            len: s.bytes,
            samples: s.samples,
            crc32c: s.crc().filter(|_| !footer_scope),
            footer_crc32c: s.crc().filter(|_| footer_scope),
            mtime_ns: None,
            // Sidecars named by the manifest are read in place; an S3 shard's table is scanned
            // from its cache copy (headers only, already in the page cache).
            sidecar: match place {
                Place::Dir(dir) => s.index.as_ref().map(|i| dir.join(i)),
                Place::Bucket { .. } => None,
            },
            content: None,
            largest: s.largest(),
        };
        let shards: Vec<ShardMeta> = match names {
            None => m.shards.iter().map(to_meta).collect(),
            Some(names) => {
                let by_name: HashMap<&str, &manifest::ManifestShard> =
                    m.shards.iter().map(|s| (s.name.as_str(), s)).collect();
                names
                    .iter()
                    .map(|n| {
                        by_name.get(n.as_str()).map(|s| to_meta(s)).ok_or_else(|| Error::NotFound {
                            what: "shard (in manifest.json)",
                            path: format!("{base}{n}"),
                        })
                    })
                    .collect::<Result<_>>()?
            }
        };
        if shards.is_empty() {
            return Err(Error::NotFound { what: "shards", path: format!("{base} (manifest.json lists none)") });
        }
        Ok(Self { url: url.to_owned(), base, format, shards, manifest_fields: Some(m.fields) })
    }
}

/// Hash of the shards' names, sample counts and content identities (see ARCHITECTURE.md,
/// "Dataset fingerprint"); persisted in trainers' state_dicts.
fn fingerprint(shards: &[ShardMeta]) -> String {
    let mut h = crate::stable_hash::Fnv1a::new();
    for s in shards {
        h.bytes(s.name.as_bytes()).bytes(&[0]).bytes(&s.content_identity()).bytes(&s.samples.to_le_bytes());
    }
    format!("{:016x}", h.finish())
}

/// Bytes at each end of a local shard that its content digest covers.
const DIGEST_EDGE: u64 = 64 << 10;

/// A digest of a local shard's content, for shards without a manifest checksum: its length,
/// member table (every sample's byte range and the field names) and the CRC-32C of its first and
/// last [`DIGEST_EDGE`] bytes. Two positioned reads; what it does not cover is in ARCHITECTURE.md.
fn content_digest(file: &ShardFile, table: &ShardTable) -> Result<u64> {
    let mut h = crate::stable_hash::Fnv1a::new();
    h.field(b"shardstream-content-1").field(&file.len.to_le_bytes());
    table.digest_into(&mut h);
    let head = file.len.min(DIGEST_EDGE);
    let tail_start = file.len.saturating_sub(DIGEST_EDGE).max(head);
    let mut buf = vec![0u8; DIGEST_EDGE as usize];
    for range in [0..head, tail_start..file.len] {
        let chunk = &mut buf[..(range.end - range.start) as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file.file, chunk, range.start)
            .map_err(|e| Error::io("cannot read shard", &file.path, e))?;
        // The bytes through CRC-32C (hardware speed) rather than byte-wise FNV: this runs for
        // every shard at every open.
        h.field(&crc32c::crc32c(chunk).to_le_bytes());
    }
    Ok(h.finish())
}

fn verify(path: &Path, meta: &ShardMeta, expected: u32) -> Result<()> {
    let (len, crc) = local::file_crc32c(path).map_err(|e| match e {
        Error::NotFound { .. } => Error::NotFound { what: "shard", path: path.display().to_string() },
        other => other,
    })?;
    if len != meta.len || crc != expected {
        return Err(Error::Shard {
            shard: path.display().to_string(),
            offset: None,
            reason: format!(
                "does not match manifest.json (size {len} vs {}, crc32c {crc:08x} vs {expected:08x}); refusing to serve it",
                meta.len
            ),
        });
    }
    Ok(())
}

/// Checks a Parquet file's footer against the CRC a `crc32c-footer` manifest records (its length
/// was checked when `file` was opened): one tail read, never the whole file.
fn verify_footer(file: &ShardFile, meta: &ShardMeta, expected: u32) -> Result<()> {
    let footer = crate::format::parquet::dataset::read_local_footer(file)?;
    let got = crate::format::parquet::footer::footer_crc32c(&footer);
    if got != expected {
        return Err(footer_mismatch(&meta.url(), got, expected, "its footer"));
    }
    Ok(())
}

fn footer_mismatch(shard: &str, got: u32, expected: u32, what: &str) -> Error {
    Error::Shard {
        shard: shard.to_owned(),
        offset: None,
        reason: format!(
            "does not match manifest.json: the crc32c of {what} is {got:08x}, the manifest says {expected:08x} \
             (the file changed after it was indexed); refusing to serve it"
        ),
    }
}

fn cache_sidecar_path(cache: &Path, meta: &ShardMeta) -> PathBuf {
    // Keyed by the shard's location (path or URL); the identity inside the file guards against
    // reuse for other bytes.
    let h = crate::stable_hash::hash(meta.url().as_bytes());
    cache.join(format!("{h:016x}-{}.idx", meta.name))
}

/// The shard's member table: from the manifest's sidecar, the daemon's sidecar cache, or a
/// scan by its format (of `mapped`, the file's bytes, when given; whose result is then saved in
/// the sidecar cache).
fn load_table(
    format: Format,
    meta: &ShardMeta,
    file: &ShardFile,
    mapped: Option<&[u8]>,
    cache: Option<&Path>,
) -> Result<ShardTable> {
    let identity = meta.identity();
    let candidates = meta.sidecar.clone().into_iter().chain(cache.map(|c| cache_sidecar_path(c, meta)));
    for path in candidates {
        match format.read_sidecar(&path, &identity, meta.len) {
            Ok(Some(table)) => return Ok(table),
            Ok(None) => {}
            Err(e) => tracing::warn!(sidecar = %path.display(), error = %e, "ignoring the sidecar, rescanning"),
        }
    }
    let table = match mapped {
        Some(bytes) => format.index_mapped(file, bytes)?,
        None => format.index_shard(file)?,
    };
    if let Some(cache) = cache {
        let path = cache_sidecar_path(cache, meta);
        let saved = std::fs::create_dir_all(cache).and_then(|()| table.write_sidecar(&path, &identity));
        if let Err(e) = saved {
            tracing::warn!(sidecar = %path.display(), error = %e, "cannot save shard index sidecar");
        }
    }
    Ok(table)
}

/// The Parquet view of a scanned dataset: its files (shard `i` of the dataset is file index `i`)
/// with their footer tables.
fn parquet_dataset(
    shards: &[ShardMeta],
    tables: &[ShardTable],
) -> Result<crate::format::parquet::dataset::ParquetDataset> {
    use crate::format::parquet::dataset::{DatasetFile, ParquetDataset};
    let files = shards
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(index, (meta, table))| match table {
            ShardTable::Parquet(t) => Ok(DatasetFile { name: meta.url(), table: t.clone(), index }),
            ShardTable::Tar(_) => Err(Error::Internal(format!("{} is not a Parquet table", meta.url()))),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ParquetDataset::new(files)?.0)
}

/// Loads every shard's table, in parallel (a dataset opened without manifest), and the content
/// digest of each local shard. Shards read through the node cache are fetched first, unless the
/// daemon's sidecar cache already knows them: a restarted daemon reopens an S3 dataset without
/// downloading it again.
fn scan_all(
    format: Format,
    shards: &[ShardMeta],
    keys: &[String],
    backends: &Backends,
    cache: Option<&Path>,
) -> Result<Vec<(ShardTable, Option<u64>, bool)>> {
    let indexed: Vec<usize> = (0..shards.len()).collect();
    crate::parallel::try_map(&indexed, SCAN_THREADS, |&i| scan_one(format, &shards[i], keys.get(i), backends, cache))
}

/// One shard's table and, for a local shard, its content digest (S3 shards keep their ETag as
/// identity: digesting them would download them).
fn scan_one(
    format: Format,
    meta: &ShardMeta,
    key: Option<&String>,
    backends: &Backends,
    cache: Option<&Path>,
) -> Result<(ShardTable, Option<u64>, bool)> {
    let digest = |table: &ShardTable, file: Option<&ShardFile>| -> Result<Option<u64>> {
        match (&meta.source, file) {
            (ShardSource::Local(_), Some(f)) => content_digest(f, table).map(Some),
            (ShardSource::Local(path), None) => {
                content_digest(&ShardFile::open(path.clone(), meta.len)?, table).map(Some)
            }
            (ShardSource::S3 { .. }, _) => Ok(None),
        }
    };
    match (key, &backends.cache) {
        (Some(key), Some(node)) => {
            let mut fresh = false;
            let table = match cache.and_then(|c| {
                format.read_sidecar(&cache_sidecar_path(c, meta), &meta.identity(), meta.len).ok().flatten()
            }) {
                Some(table) => table,
                // A Parquet file's table is its footer: one ranged GET, not the whole object (which
                // is fetched, and verified, when a stream first needs its rows).
                None if format == Format::Parquet && matches!(meta.source, ShardSource::S3 { .. }) => {
                    let table = remote_parquet_table(backends.s3()?, meta)?;
                    fresh = true;
                    if let Some(c) = cache {
                        let path = cache_sidecar_path(c, meta);
                        let saved =
                            std::fs::create_dir_all(c).and_then(|()| table.write_sidecar(&path, &meta.identity()));
                        if let Err(e) = saved {
                            tracing::warn!(sidecar = %path.display(), error = %e, "cannot save shard index sidecar");
                        }
                    }
                    table
                }
                None => {
                    let pin = fetch_into(node, backends, meta, key, Want::NOW)?
                        .ok_or_else(|| Error::Internal("a waiting fetch gave up".into()))?;
                    let file = ShardFile::open_as(pin.path().to_owned(), meta.len, meta.url())?;
                    // Dropped before `pin` (declared after it), which keeps the copy immutable.
                    let mapped = map_pinned(&file, false);
                    load_table(format, meta, &file, mapped.as_deref(), cache)?
                }
            };
            let content = digest(&table, None)?;
            Ok((table, content, fresh))
        }
        _ => {
            let ShardSource::Local(path) = &meta.source else {
                return Err(Error::Internal(format!("{} needs the node cache", meta.url())));
            };
            let file = ShardFile::open(path.clone(), meta.len)?;
            let table = load_table(format, meta, &file, None, cache)?;
            let content = digest(&table, Some(&file))?;
            Ok((table, content, false))
        }
    }
}

/// The footer table of an S3 Parquet file, read with one ranged GET of its tail (two for a footer
/// larger than the tail).
fn remote_parquet_table(store: &S3Store, meta: &ShardMeta) -> Result<ShardTable> {
    let ShardSource::S3 { bucket, key, etag } = &meta.source else {
        return Err(Error::Internal(format!("{} is not an S3 object", meta.url())));
    };
    let obj =
        crate::storage::s3::ObjectRef { bucket: bucket.clone(), key: key.clone(), len: meta.len, etag: etag.clone() };
    let table = crate::format::parquet::dataset::read_table(&meta.url(), meta.len, |off, buf| {
        let (got, _) = store.block_on(store.get_range(&obj, off..off + buf.len() as u64))?;
        buf.copy_from_slice(&got);
        Ok(())
    })?;
    Ok(ShardTable::Parquet(Arc::new(table)))
}

/// How long an S3 dataset's shard list is trusted before the next open lists (or reads the
/// manifest) again: a minute keeps requests per epoch close to the number of shards, whatever
/// the number of ranks and workers, and still notices a replaced dataset between two runs.
pub const REMOTE_REDISCOVERY: Duration = Duration::from_secs(60);

#[cfg(test)]
mod golden {
    //! Pins every hash this module persists or hands out (fingerprints are saved in trainers'
    //! state_dicts; sidecar names are files in the cache directory). Values computed by the
    //! code before the hashes were unified (see `crate::stable_hash`), and for the content
    //! digest (new with it) checked against an independent Python model of the algorithm.
    use super::*;

    fn meta(
        name: &str,
        source: ShardSource,
        len: u64,
        samples: u64,
        crc32c: Option<u32>,
        mtime_ns: Option<i64>,
    ) -> ShardMeta {
        ShardMeta {
            name: name.into(),
            source,
            len,
            samples,
            crc32c,
            footer_crc32c: None,
            mtime_ns,
            sidecar: None,
            content: None,
            largest: None,
        }
    }

    fn shards() -> [ShardMeta; 3] {
        [
            meta(
                "train-000000.tar",
                ShardSource::Local("/data/ds/train-000000.tar".into()),
                10240,
                7,
                Some(0xdead_beef),
                None,
            ),
            meta(
                "train-000001.tar",
                ShardSource::S3 {
                    bucket: "b".into(),
                    key: "ds/train-000001.tar".into(),
                    etag: Some("\"0123abcd\"".into()),
                },
                20480,
                9,
                None,
                None,
            ),
            meta(
                "train-000002.tar",
                ShardSource::Local("/data/ds/train-000002.tar".into()),
                30720,
                11,
                None,
                Some(1_700_000_000_123_456_789),
            ),
        ]
    }

    #[test]
    fn fingerprints_are_pinned() {
        let [crc, etag, mtime] = shards();
        assert_eq!(fingerprint(std::slice::from_ref(&crc)), "319f373faba19431");
        assert_eq!(fingerprint(std::slice::from_ref(&etag)), "6a929f4377d646a8");
        assert_eq!(fingerprint(std::slice::from_ref(&mtime)), "fc7487436db247a5");
        assert_eq!(fingerprint(&shards()), "7454552b089f7cc6");
    }

    #[test]
    fn content_digests_are_pinned() {
        // Part of the fingerprint of every local dataset without manifest.
        let dir = tempfile::tempdir().unwrap();
        let digest = |len: usize, boundaries: Vec<u64>| {
            let path = dir.path().join(format!("s{len}.tar"));
            std::fs::write(&path, (0..len).map(|i| (i * 31 % 251) as u8).collect::<Vec<u8>>()).unwrap();
            let file = ShardFile::open(path, len as u64).unwrap();
            let table = ShardTable::Tar(crate::format::tar::TarIndex {
                boundaries,
                fields: vec!["cls".into(), "jpg".into()],
                layout: None,
            });
            content_digest(&file, &table).unwrap()
        };
        let big = digest(200 << 10, vec![0, 1024, 200 << 10]);
        assert_eq!(big, 0x52b7_a678_3549_34ee);
        assert_eq!(digest(3072, vec![0, 1024, 3072]), 0x68d5_f5fe_5c9e_77de);
        assert_ne!(digest(200 << 10, vec![0, 2048, 200 << 10]), big, "the member table counts");
        let [_, _, mut local] = shards();
        local.content = Some(big);
        assert_eq!(local.content_identity(), format!("len=30720;content={big:016x}").into_bytes());
        assert_eq!(fingerprint(&[local]), "d347d5a04d9724c1");
    }

    #[test]
    fn sidecar_names_are_pinned() {
        let [crc, etag, _] = shards();
        let dir = Path::new("/cache/index");
        assert_eq!(cache_sidecar_path(dir, &crc), dir.join("03756c516561ee27-train-000000.tar.idx"));
        assert_eq!(cache_sidecar_path(dir, &etag), dir.join("5211c79844b2be77-train-000001.tar.idx"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resident_tables_are_bounded_in_bytes() {
        let ds = Dataset::assemble(
            "/d/",
            Format::WebDataset,
            CacheMode::Direct,
            String::new(),
            Vec::new(),
            Vec::new(),
            false,
            None,
            Arc::new(Backends::local()),
            Vec::new(),
        );
        // 1 MiB tables: 100 of them would be 100 MiB.
        let table = || {
            let boundaries: Vec<u64> = (0..(1u64 << 17)).map(|i| i * 512).collect();
            Arc::new(ShardTable::Tar(crate::format::tar::TarIndex { boundaries, fields: Vec::new(), layout: None }))
        };
        for i in 0..100 {
            ds.insert_table(i, table());
        }
        let (count, bytes) = ds.resident();
        assert!(bytes <= MAX_RESIDENT_TABLE_BYTES, "{bytes} bytes resident");
        assert!(((MAX_RESIDENT_TABLE_BYTES >> 20) - 1..=MAX_RESIDENT_TABLE_BYTES >> 20).contains(&count), "{count}");
        assert!(ds.table(99).is_some() && ds.table(0).is_none(), "the least recently used go first");
        // One table larger than the bound is still kept: a stream needs it.
        let huge: Vec<u64> = (0..(MAX_RESIDENT_TABLE_BYTES as u64 / 4)).collect();
        ds.insert_table(
            100,
            Arc::new(ShardTable::Tar(crate::format::tar::TarIndex {
                boundaries: huge,
                fields: Vec::new(),
                layout: None,
            })),
        );
        assert_eq!(ds.resident().0, 1);
        assert!(ds.table(100).is_some());
    }
}
