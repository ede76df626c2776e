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
mod column_copies;
mod discover;
mod integrity;
pub mod manifest;
pub mod opening;
mod page_probe;
pub mod registry;
pub mod sidecar_cache;
mod tables;
mod working;

use foldhash::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use crate::cache::download::{self, FetchSpec};
use crate::cache::key::{CacheKey, KeyRef};
use crate::cache::{Ended, NodeCache, Pin, Want};
use crate::format::{Format, ShardTable};
use crate::storage::local::ShardFile;
use crate::storage::s3::{S3Options, S3Store};
use crate::storage::{DatasetUrl, ShardSource};
use crate::{Error, Result};
pub use column_copies::PROJECTED_GET;
pub use registry::{Registry, RegistryLimits};
pub use working::{Waits, Working};

use discover::Discovered;
use integrity::{fingerprint, footer_mismatch, verify_copy_footer, verify_source};
use tables::{load_table, parquet_dataset, scan_all};

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

/// What a local shard that manifest.json lists but the disk no longer has is, in its
/// `NotFound` ("... not found: PATH"): the manifest is what to mend (restore the file, or
/// `shardstream index` again), where a listed dataset's next open lists it as it is.
const MANIFEST_SHARD_GONE: &str = "shard listed in manifest.json (restore it, or run `shardstream index` again)";

/// Threads that read S3 Parquet footers when a dataset without a footers bundle is opened. Each
/// footer is one small ranged GET whose time is the round trip (~30 ms on S3), not bandwidth or
/// CPU: at that, 10,000 files cost ~40 s of round trips 8 at a time and ~10 s 32 at a time (3,000
/// measured in bench/S3_RESULTS.md), within the daemon's 64 GETs in flight
/// (`storage::s3::MAX_GETS_IN_FLIGHT`). `shardstream index` reads them as many at a time, and
/// makes every later open 2 GETs.
pub(crate) const FOOTER_THREADS: usize = 32;

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
    /// A local file's mtime; an S3 object's LastModified from the listing (which names its
    /// version where the store lists no ETag). None from a manifest.
    pub mtime_ns: Option<i64>,
    /// Sidecar path named by the manifest, if any.
    pub sidecar: Option<PathBuf>,
    /// Content digest of a local shard opened without manifest ([`content_digest`]): stands in
    /// for the mtime in the fingerprint, so a copy of the dataset keeps its fingerprint.
    pub content: Option<u64>,
    /// The shard's largest sample as its manifest entry records it (None without manifest, or
    /// from a manifest written before it was recorded).
    pub largest: Option<manifest::LargestInShard>,
    /// How a row group's copy of this S3 Parquet file is checked, as its manifest entry records
    /// it (`page_checksums`, `etag_md5`; None without them): no GET of its first page header.
    pub row_group_check: Option<page_probe::RowGroupCheck>,
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
        match self.content {
            Some(d) if !self.named_by_crc() => format!("len={};content={d:016x}", self.len).into_bytes(),
            _ => self.identity(),
        }
    }

    /// Whether a manifest records the shard's CRC-32C (of the file, or of a Parquet footer): that
    /// names it in the fingerprint, and a content digest would go unused.
    pub fn named_by_crc(&self) -> bool {
        self.crc32c.or(self.footer_crc32c).is_some()
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
    /// The node-cache copy this shard is read from, None for a shard read in place: a copy
    /// never changes (see [`Self::cached_bytes`]), so a reader may map it.
    pub fn cache_copy(&self) -> Option<&ShardFile> {
        self.pin.as_ref().map(|_| &self.file)
    }

    pub fn cached_bytes(&self) -> Option<&[u8]> {
        self.pin.as_ref()?;
        self.mapped.get_or_init(|| map_pinned(&self.file, true)).as_deref()
    }
}

/// The S3 object of shard `meta` (with its ETag when known, which every GET then sends as
/// `If-Match`).
fn s3_object(meta: &ShardMeta) -> Result<crate::storage::s3::ObjectRef> {
    let ShardSource::S3 { bucket, key, etag } = &meta.source else {
        return Err(Error::Internal(format!("{} is not an S3 object", meta.url())));
    };
    Ok(crate::storage::s3::ObjectRef {
        bucket: bucket.clone(),
        key: key.clone(),
        len: meta.len,
        etag: etag.clone(),
        modified_ns: meta.mtime_ns,
    })
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

    /// Stops S3 requests from being retried ([`S3Store::close`]): the daemon is stopping.
    pub fn close(&self) {
        if let Some(s) = self.s3.get() {
            s.close();
        }
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
    keys: Vec<CacheKey>,
    tables: Mutex<TableCache>,
    /// One lock per shard so that a shard needed by many streams at once is loaded (and verified)
    /// once, while loads of different shards proceed in parallel.
    load_locks: Vec<Mutex<()>>,
    verified: Vec<AtomicBool>,
    /// Per S3 Parquet file: whether a row group's copy is checked as well as a whole one, once
    /// read (`page_probe`).
    row_group_checked: Vec<std::sync::OnceLock<page_probe::RowGroupCheck>>,
    /// Per file: pages without a checksum were reported (`page_probe`).
    unchecked_warned: Vec<AtomicBool>,
    /// Held while files' first page headers are read: two plans built at once read each once.
    probing: Mutex<()>,
    /// Per shard read in place: 1 + the modification time (ns) of the file verified against the
    /// manifest; 0 before it was.
    verified_mtime: Vec<AtomicU64>,
    /// Per shard (`copy` mode, local sources): its node-cache copy is known to hold its source's
    /// bytes, checked by this dataset ([`Self::current_copy`]) or fetched by it.
    copy_current: Vec<AtomicBool>,
    /// A local shard was found changed (another length or mtime) or gone since the dataset was
    /// listed: the registry lists it again at the next open instead of trusting its directory.
    changed: AtomicBool,
    /// How many times the registry handed the dataset out again without listing it
    /// ([`Self::reopened_unlisted`]).
    unlisted_opens: AtomicU64,
    /// When the registry last handed the dataset out without listing it (wall clock, ns since the
    /// epoch, as file times are; 0: never): a shard found changed whose file's time is earlier
    /// changed before that open, which could not see it ([`Self::stale_listing_if`]).
    reused_at_ns: std::sync::atomic::AtomicI64,
    /// Per shard, the value of `unlisted_opens` when its local source was last known to be as
    /// listed (`copy` mode): a node-cache copy stands in for its source for the open that listed
    /// it; after an open that listed nothing (every stream's, within a minute of a listing), the
    /// source is stat'ed once before its copy is used again, so a file changed or gone is refused
    /// as a shard read in place is. A shard in use keeps the copy it opened.
    source_checked: Vec<AtomicU64>,
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
        let sidecar_cache = cache_dir.map(|c| c.join(sidecar_cache::DIR));
        let Discovered { url, base, format, mut shards, manifest_fields, footers } = found;
        format.check_served(&url)?;
        if mode == CacheMode::Copy && backends.cache.is_none() {
            return Err(Error::invalid(format!("{url} is read through the node cache, and this server has none")));
        }
        let keys: Vec<CacheKey> = match mode {
            CacheMode::Direct => Vec::new(),
            CacheMode::Copy => {
                shards.iter().map(|m| CacheKey::new(crate::cache::key_for(&m.url(), &m.identity(), &m.name))).collect()
            }
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
        // Every table in one read when `shardstream index` bundled them (else a tail read or a
        // sidecar per file).
        let bundled = match (&footers, format) {
            (Some(at), Format::Parquet) => tables::bundled_tables(at, &shards, &backends),
            _ => Vec::new(),
        };
        let opening = opening::Opening::begin(&url, shards.len());
        let scanned = scan_all(format, &shards, &keys, &backends, sidecar_cache.as_deref(), &bundled, &opening)?;
        drop(opening);
        let mut fields = std::collections::BTreeSet::new();
        let mut tables = Vec::with_capacity(scanned.len());
        // S3 Parquet files whose footer was just read from the object itself, and matches the
        // manifest if there is one: already verified for column-chunk reads.
        let mut footer_checked = Vec::with_capacity(scanned.len());
        let mut from_tails = Vec::with_capacity(scanned.len());
        for (meta, tables::Scanned { table, content, fresh, from_tail }) in shards.iter_mut().zip(scanned) {
            let matches = match (&table, meta.footer_crc32c) {
                (ShardTable::Parquet(t), expected) => expected.is_none_or(|e| e == t.footer_crc32c()),
                (ShardTable::Tar(_), _) => false,
            };
            footer_checked.push(fresh && matches && meta.crc32c.is_none());
            // A footer that does not match the manifest is another version of the file: its
            // answer is not this one's.
            from_tails.push(from_tail.filter(|_| matches));
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
        let parquet = match format {
            Format::Parquet => Some(Arc::new(parquet_dataset(&base, &shards, &tables)?)),
            Format::WebDataset => None,
        };
        let fields: Vec<String> = match &parquet {
            // The dataset's columns are its first file's, in file order, then its partition keys
            // (as pyarrow.dataset shows them).
            Some(pq) => {
                let mut columns =
                    tables.iter().find(|t| t.num_samples() > 0).map(|t| t.fields().to_vec()).unwrap_or_default();
                columns.extend(pq.keys().iter().map(|k| k.name().clone()));
                columns
            }
            None => fields.into_iter().collect(),
        };
        let mut ds =
            Self::assemble(&url, format, mode, base, shards, fields, from_manifest, sidecar_cache, backends, keys);
        ds.largest_sample = largest_sample;
        ds.parquet = parquet;
        // What the footers' tails said of how row groups' copies are checked (`page_probe`):
        // kept for the next daemon on this cache, which may open the dataset from its sidecars
        // without reading the tails (over TLS nothing asks: `service::projected`); else what a
        // manifest recorded from the same tails (read with it at every open: not kept).
        let keep = from_tails.iter().any(Option::is_some) && !ds.answers_over_tls().unwrap_or(true);
        for (i, from_tail) in from_tails.into_iter().enumerate() {
            if let Some(c) = from_tail {
                ds.note_row_group_checked(i, c);
                if keep {
                    ds.keep_answer(i, c);
                }
            } else if let Some(c) = ds.shards.get(i).and_then(|m| m.row_group_check) {
                ds.note_row_group_checked(i, c);
            }
        }
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
        keys: Vec<CacheKey>,
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
            row_group_checked: (0..n).map(|_| std::sync::OnceLock::new()).collect(),
            probing: Mutex::new(()),
            unchecked_warned: (0..n).map(|_| AtomicBool::new(false)).collect(),
            verified_mtime: (0..n).map(|_| AtomicU64::new(0)).collect(),
            copy_current: (0..n).map(|_| AtomicBool::new(false)).collect(),
            changed: AtomicBool::new(false),
            unlisted_opens: AtomicU64::new(0),
            reused_at_ns: std::sync::atomic::AtomicI64::new(0),
            source_checked: (0..n).map(|_| AtomicU64::new(0)).collect(),
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
        let keys: usize = self.keys.iter().map(|k| k.len()).sum();
        (self.shards.len() * per_shard + names + keys) as u64
    }

    pub fn total_bytes(&self) -> u64 {
        // Saturating: sizes from a listing are the store's word (an S3-compatible store may say
        // up to 2^63, a sparse local file too), and a debug build's sum panicked on the overflow.
        self.shards.iter().map(|s| s.len).fold(0, u64::saturating_add)
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

    /// Whether a local shard was found changed or gone since the dataset was listed.
    pub fn changed(&self) -> bool {
        self.changed.load(Ordering::Acquire)
    }

    /// The registry hands the dataset out again without listing it (its directory did not
    /// change): the local sources of node-cache copies are checked again as they are used.
    pub fn reopened_unlisted(&self) {
        self.unlisted_opens.fetch_add(1, Ordering::AcqRel);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        self.reused_at_ns.store(i64::try_from(now.as_nanos()).unwrap_or(i64::MAX), Ordering::Release);
    }

    /// Whether any of up to `most` local shards spread over the dataset (the first, the last, and
    /// evenly between) no longer has the length and time it was listed with: one `stat` each.
    /// An open that reuses the listing asks first, so a dataset regenerated in place (its
    /// directory's time unmoved) is listed again rather than met shard by shard at first use. A
    /// single file rewritten among many may still be (then [`Self::stale_listing_if`] says so).
    /// Shards a manifest names (checked by CRC, without a listed time) are not looked at.
    pub fn spot_changed(&self, most: usize) -> bool {
        let n = self.shards.len();
        let picks = most.min(n);
        (0..picks).map(|k| if picks > 1 { k * (n - 1) / (picks - 1) } else { 0 }).any(|i| {
            let meta = &self.shards[i];
            let (ShardSource::Local(path), Some(listed)) = (&meta.source, meta.mtime_ns) else { return false };
            crate::metrics::local_stat(1);
            std::fs::metadata(path)
                .map_or(true, |now| now.len() != meta.len || crate::storage::local::mtime_ns(&now) != listed)
        })
    }

    /// `e`, a local shard found unlike its listing, saying why a Loader made after the change
    /// met it when the file's time (`mtime_ns` now) is before the latest open that reused the
    /// listing: a file rewritten in place leaves its directory's time as it was, and the daemon
    /// reuses a listing for a minute while that time stands still. Without this the error told
    /// a Loader made just now to make a new Loader.
    fn stale_listing_if(&self, e: Error, mtime_ns: i64) -> Error {
        let reused = self.reused_at_ns.load(Ordering::Acquire);
        match e {
            Error::Shard { shard, offset, reason } if reused > 0 && mtime_ns <= reused => Error::Shard {
                shard,
                offset,
                reason: format!(
                    "{reason} (it changed before the dataset's latest open, which reused the daemon's listing of \
                     it from less than {} s before: a file rewritten in place leaves its directory's time as it \
                     was, so only its own open sees the change; the next open lists the dataset again)",
                    registry::LOCAL_REVALIDATE.as_secs()
                ),
            },
            e => e,
        }
    }

    /// The registry listed the dataset again (it was marked changed) and found the same shards
    /// (a manifest names a shard by CRC, which a rewrite of it need not change): handed out again,
    /// its local sources are checked again as they are used, as after an open without listing,
    /// and the next open need not list it again for the same cause.
    pub fn relisted_unchanged(&self) {
        self.changed.store(false, Ordering::Release);
        self.reopened_unlisted();
    }

    /// Refuses the node-cache copy of local shard `i` (at `path`) when its source is no longer
    /// as listed, the first time it is used after an open that listed nothing: one `stat`, where
    /// a shard read in place costs an open and its `fstat`. Gives that `stat` when it took one,
    /// with the open count to record as checked once the copy is known to be the source's
    /// ([`Self::current_copy`]).
    fn check_copy_source(&self, i: usize, path: &Path, meta: &ShardMeta) -> Result<Option<(std::fs::Metadata, u64)>> {
        let opens = self.unlisted_opens.load(Ordering::Acquire);
        if self.source_checked[i].load(Ordering::Acquire) >= opens {
            return Ok(None);
        }
        crate::metrics::local_stat(1);
        let now = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound { what: "shard", path: path.display().to_string() },
            _ => Error::io("cannot stat shard", path, e),
        });
        let now = now
            .and_then(|now| {
                let mtime_ns = crate::storage::local::mtime_ns(&now);
                crate::storage::local::check_listed(path, &now, meta.len, meta.mtime_ns)
                    .map_err(|e| self.stale_listing_if(e, mtime_ns))
                    .map(|()| now)
            })
            .map_err(|e| self.changed_if(e))?;
        Ok(Some((now, opens)))
    }

    /// Shard `i`'s copy, fetched now if it is not in the cache; `asked`: when the caller began
    /// asking for it (a fetch of it that fails after that is the caller's failure too).
    fn fetch_now(&self, i: usize, asked: Instant, ended: Option<Ended<'_>>) -> Result<Pin> {
        let want = Want { since: Some(asked), ended, ..Want::NOW };
        self.fetch(i, want)?.ok_or_else(|| Error::Internal("a waiting fetch gave up".into()))
    }

    /// `pin`, the node-cache copy of local shard `i` made before this dataset was opened, once
    /// its source (`path`) is known to hold the bytes the manifest names. A manifest names a
    /// shard by its length and CRC, which a rewrite need not change in the manifest: the copy's
    /// key stays, and the old bytes were served for good, where a shard read in place is checked
    /// against its CRC once (`cache="direct"`). A copy takes its source's modification time when
    /// it is made: the same time on both, one `stat` each, says the source is what was copied
    /// (whatever the clocks of the host that wrote it); another time has the source checked
    /// against the manifest as a shard read in place is (a `ShardError` when it no longer matches),
    /// and so is the copy, whose time moves when another hand writes it in place (bytes changed
    /// at its size were served as they were); then the source's time is recorded on the copy.
    /// `stat`: the source's, when the caller just took it.
    fn current_copy(&self, i: usize, path: &Path, stat: Option<std::fs::Metadata>, pin: Pin) -> Result<Current> {
        let meta = &self.shards[i];
        if meta.mtime_ns.is_some() || (meta.crc32c.is_none() && meta.footer_crc32c.is_none()) {
            // Listed with its time, the copy's key holds it; without a checksum nothing to check.
            return Ok(Current::Yes(pin));
        }
        let source = match stat {
            Some(m) => m.modified(),
            None => std::fs::metadata(path).and_then(|m| m.modified()),
        };
        let source = source.map_err(|e| self.changed_if(Error::io("cannot stat shard", path, e)))?;
        let copied = std::fs::File::open(pin.path()).map_err(|e| Error::io("cannot open", pin.path(), e))?;
        let recorded =
            copied.metadata().and_then(|m| m.modified()).map_err(|e| Error::io("cannot stat", pin.path(), e))?;
        if same_time(source, recorded) {
            return Ok(Current::Yes(pin));
        }
        verify_source(path, meta, None).map_err(|e| self.changed_if(e))?;
        match verify_source(pin.path(), meta, None) {
            Ok(()) => {}
            Err(e @ Error::Shard { .. }) => return Ok(Current::Unlike(pin, e)),
            Err(e) => return Err(e),
        }
        if let Err(e) = copied.set_modified(source) {
            tracing::warn!(copy = %pin.path().display(), error = %e, "cannot record its source's time on a node-cache copy");
        }
        Ok(Current::Yes(pin))
    }

    /// Shard `i`'s copy again, for `pin`, a copy made before that opening found gone or not its
    /// size (`e`). The daemon never changes a published copy: another hand did (a clean-up of
    /// the cache directory, a truncation), and a copy kept in the table would fail every later
    /// stream. Dropped and fetched once more; a copy another stream still pins (it holds the file
    /// open) cannot be dropped, and `e` is the answer until it is let go of.
    fn fetch_lost_copy(&self, i: usize, pin: Pin, e: Error, asked: Instant, ended: Option<Ended<'_>>) -> Result<Pin> {
        // Cut short: the trainers that had it mapped (zero-copy), and a daemon serving a Parquet
        // copy from its mapping, were killed by SIGBUS when they touched a page past the cut.
        let hint = match e {
            Error::Shard { .. } => {
                "; a copy cut short while mapped kills the processes reading it (trainers, with zero-copy views; \
                 this daemon, for a Parquet copy) with SIGBUS: clean a node cache up by deleting copies, never by \
                 truncating them"
            }
            _ => "",
        };
        let why = format!("opening it failed: {e}{hint}");
        self.fetch_copy_again(i, pin, e, &why, asked, ended)
    }

    /// Shard `i`'s copy again, for `pin`, a copy found not to be the shard (`e`, said as `why`):
    /// dropped, and fetched once more; one another stream pins cannot be, and `e` is the answer.
    fn fetch_copy_again(
        &self,
        i: usize,
        pin: Pin,
        e: Error,
        why: &str,
        asked: Instant,
        ended: Option<Ended<'_>>,
    ) -> Result<Pin> {
        let Some(cache) = &self.backends.cache else { return Err(e) };
        let key = pin.key().to_owned();
        drop(pin);
        if !cache.drop_copy(&key, why) {
            return Err(e);
        }
        self.fetch_now(i, asked, ended)
    }

    fn drop_bad_copy(&self, pin: Option<Pin>, e: Error) -> Error {
        match (pin, &self.backends.cache) {
            (Some(pin), Some(cache)) => dropping_bad_copy(cache, pin, e),
            _ => e,
        }
    }

    /// A stream of this dataset failed with `e` (every stream kind ends through here). For an S3
    /// dataset, a shard found gone or not as listed or indexed (by a whole-copy or column-chunk
    /// fetch: a changed ETag, size or checksum; or by the decoder: a Parquet file replaced under
    /// the listing, whose chunks no longer match the footer read at open) marks the dataset
    /// [`changed`](Self::changed): the next open lists it (or reads its manifest) again instead of
    /// reusing this listing for a minute. Damage a new listing cannot mend costs one listing. A
    /// local dataset is marked by [`Self::changed_if`], where its shards are checked.
    pub fn note_stream_failure(&self, e: &Error) {
        // A dataset's shards are all in one place: the first says where.
        let s3 = self.shards.first().is_some_and(|s| matches!(s.source, ShardSource::S3 { .. }));
        if s3 && matches!(e, Error::Shard { .. } | Error::NotFound { .. }) {
            self.changed.store(true, Ordering::Release);
        }
    }

    /// `e`, from opening a local shard or checking it against its listing; a file changed or
    /// gone marks the dataset [`changed`](Self::changed), and the error says what to do. A
    /// transient failure (EMFILE, EIO) does not: it would cost every later open a full listing.
    /// A dataset opened from its manifest is opened from it again, which still describes the
    /// shard as it was: the way out is the manifest's, not a new Loader's.
    fn changed_if(&self, e: Error) -> Error {
        match e {
            Error::Shard { shard, offset, reason } => {
                self.changed.store(true, Ordering::Release);
                let reason = if self.from_manifest {
                    format!(
                        "{reason}; manifest.json describes it as it was: restore it, or describe it as it is now \
                         with `shardstream index` and open the dataset again"
                    )
                } else {
                    format!("{reason}; open the dataset again (a new Loader) to read it as it is now")
                };
                Error::Shard { shard, offset, reason }
            }
            Error::NotFound { what, path } => {
                self.changed.store(true, Ordering::Release);
                let what = if self.from_manifest { MANIFEST_SHARD_GONE } else { what };
                Error::NotFound { what, path }
            }
            e => e,
        }
    }

    /// Refuses shard `r` when it is read in place and changed since it was opened
    /// ([`ShardFile::check_unchanged`]); the dataset is then marked changed, so the next open
    /// lists it again. A node-cache copy never changes: nothing to check.
    pub fn check_in_place(&self, r: &ResidentShard) -> Result<()> {
        if r.pin.is_some() {
            return Ok(());
        }
        r.file.check_unchanged().map_err(|e| self.changed_if(e))
    }

    /// (resident tables, their bytes).
    pub fn resident(&self) -> (usize, usize) {
        let t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        (t.resident.len(), t.bytes)
    }

    /// The shard's open file and member table, loading (and verifying, or fetching into the node
    /// cache) it on first use. Blocking: call from a blocking thread.
    pub fn shard(&self, i: usize) -> Result<Arc<ResidentShard>> {
        self.shard_fetched(i, None).map(|(s, _)| s)
    }

    /// As [`shard`](Self::shard), and whether this call had to fetch or wait for the bytes; a
    /// wait for room in the node cache gives up once `ended` says the caller's stream ended.
    pub fn shard_fetched(&self, i: usize, ended: Option<Ended<'_>>) -> Result<(Arc<ResidentShard>, bool)> {
        if let Some(s) = self.open_shard(i) {
            return Ok((s, false));
        }
        // Another stream (or this stream's batch before) may be loading it: a fetch that fails
        // while this one waits for the lock fails this one too, not a second round of retries.
        let asked = Instant::now();
        let lock = self.load_locks.get(i).ok_or_else(|| Error::Internal(format!("shard {i} out of range")))?;
        let _loading = lock.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = self.open_shard(i) {
            return Ok((s, false));
        }
        let meta = &self.shards[i];
        let (file, pin) = match (&meta.source, self.mode) {
            (ShardSource::Local(path), CacheMode::Direct) => {
                // A file rewritten in place keeps its directory's mtime, which the registry trusts:
                // marked, the next open lists the dataset again.
                let opened = ShardFile::open(path.clone(), meta.len);
                let file = opened
                    .and_then(|f| match f.check_mtime(meta.mtime_ns) {
                        Ok(()) => Ok(f),
                        Err(e) => Err(self.stale_listing_if(e, f.mtime_ns)),
                    })
                    .map_err(|e| self.changed_if(e))?;
                // Checked against the manifest's CRC at its first use, and again whenever the
                // file's time is not the one it had then (a manifest names a file by CRC alone:
                // a rewrite keeps its entry).
                let at = (file.mtime_ns as u64).wrapping_add(1);
                if self.verified_mtime[i].load(Ordering::Acquire) != at {
                    verify_source(path, meta, Some(&file)).map_err(|e| self.changed_if(e))?;
                    self.verified[i].store(true, Ordering::Release);
                    self.verified_mtime[i].store(at, Ordering::Release);
                }
                (file, None)
            }
            (source, _) => {
                let checked = match source {
                    ShardSource::Local(path) => self.check_copy_source(i, path, meta)?,
                    ShardSource::S3 { .. } => None,
                };
                let mut pin = self.fetch_now(i, asked, ended)?;
                // Opened first: checking a local copy's source below opens the copy too, and a
                // copy gone would fail there without being fetched again.
                let mut file = match ShardFile::open_as(pin.path().to_owned(), meta.len, meta.url()) {
                    Ok(file) => file,
                    Err(e)
                        if !pin.filled
                            && (matches!(e, Error::NotFound { .. } | Error::Shard { .. }) || is_a_directory(&e)) =>
                    {
                        pin = self.fetch_lost_copy(i, pin, e, asked, ended)?;
                        ShardFile::open_as(pin.path().to_owned(), meta.len, meta.url())?
                    }
                    Err(e) => return Err(e),
                };
                if let ShardSource::Local(path) = source {
                    // Once for this dataset, and again after each open that trusted its listing;
                    // recorded only once the copy is known current, so a refusal is said again.
                    let (stat, opens) = checked.map_or((None, None), |(m, o)| (Some(m), Some(o)));
                    if !pin.filled && (stat.is_some() || !self.copy_current[i].load(Ordering::Acquire)) {
                        self.copy_current[i].store(false, Ordering::Release);
                        pin = match self.current_copy(i, path, stat, pin)? {
                            Current::Yes(pin) => pin,
                            Current::Unlike(pin, e) => {
                                let why = format!(
                                    "its bytes are not the shard's (written in place by another hand since it was \
                                     copied): {e}"
                                );
                                let pin = self.fetch_copy_again(i, pin, e, &why, asked, ended)?;
                                file = ShardFile::open_as(pin.path().to_owned(), meta.len, meta.url())?;
                                pin
                            }
                        };
                    }
                    self.copy_current[i].store(true, Ordering::Release);
                    if let Some(opens) = opens {
                        self.source_checked[i].fetch_max(opens, Ordering::AcqRel);
                    }
                }
                (file, Some(pin))
            }
        };
        let fetched = pin.as_ref().is_some_and(|p| p.filled);
        let table = match self.checked_table(i, meta, &file, pin.as_ref()) {
            Ok(t) => t,
            Err(e) => return Err(self.drop_bad_copy(pin, e)),
        };
        let resident = Arc::new(ResidentShard { file, table, pin, mapped: std::sync::OnceLock::new() });
        let mut t = self.tables.lock().unwrap_or_else(|p| p.into_inner());
        if t.open.len() > 2 * MAX_RESIDENT_TABLES {
            t.open.retain(|_, w| w.strong_count() > 0);
        }
        t.open.insert(i, Arc::downgrade(&resident));
        Ok((resident, fetched))
    }

    /// Shard `i`'s member table (resident, or loaded from a sidecar or a scan of `file`), checked
    /// against the footer its copy ends in and against the manifest.
    fn checked_table(
        &self,
        i: usize,
        meta: &ShardMeta,
        file: &ShardFile,
        pin: Option<&Pin>,
    ) -> Result<Arc<ShardTable>> {
        let table = match self.table(i) {
            Some(t) => t,
            None => {
                // A node-cache copy is scanned through a mapping (dropped before `pin`); a shard
                // read in place is not the daemon's to map (see `cached_bytes`).
                let scan = pin.and_then(|_| map_pinned(file, false));
                let t = Arc::new(load_table(self.format, meta, file, scan.as_deref(), self.sidecar_cache.as_deref())?);
                self.insert_table(i, t.clone());
                t
            }
        };
        // A Parquet dataset's tables come from footers read before any copy was made (S3 tails,
        // local files): a copy decoded with one must end in that footer, or its chunk offsets
        // point at other bytes (the file changed in between).
        if let (Some(_), ShardTable::Parquet(t)) = (pin, table.as_ref()) {
            verify_copy_footer(file, meta, t.footer_crc32c())?;
        }
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
        Ok(table)
    }

    /// Node-cache key of the compact copy of Parquet file `i`'s column chunks for projection
    /// `proj_id` (see `service::projected`): of the whole file, or of row group `rg` alone when
    /// a small node cache holds copies a row group at a time.
    pub fn projected_key(&self, i: usize, proj_id: u64, rg: Option<usize>) -> String {
        let m = &self.shards[i];
        let (part, name) = match rg {
            Some(rg) => (format!(";row_group={rg}"), format!("{}.rg{rg}.cols", m.name)),
            None => (String::new(), format!("{}.cols", m.name)),
        };
        crate::cache::key_for(&format!("{}#columns={proj_id:016x}{part}", m.url()), &m.identity(), &name)
    }

    /// Node-cache key of a whole copy of S3 Parquet file `i` made as its column chunks' copies
    /// are (see `service::projected`): the same bytes for every projection, and never the key
    /// of a copy of some chunks (a file of one row group has both kinds; a whole copy was keyed
    /// as its chunks', so a cache kept across a change of choice met a copy of other bytes).
    pub fn whole_copy_key(&self, i: usize) -> Option<String> {
        let m = self.shards.get(i)?;
        Some(crate::cache::key_for(&format!("{}#whole", m.url()), &m.identity(), &format!("{}.whole", m.name)))
    }

    /// The daemon's node cache, when it has one.
    pub fn node_cache(&self) -> Option<&Arc<NodeCache>> {
        self.backends.cache.as_ref()
    }

    /// Node-cache key of row group `rg` of Parquet file `i` as decoded for the assembler
    /// projection `proj_id` (see `format::parquet::kept`): a derived entry.
    pub fn decoded_key(&self, i: usize, proj_id: u64, rg: usize) -> String {
        let m = &self.shards[i];
        let key = crate::cache::key_for(
            // The layout of the kept file, so that a daemon writing another never reads this one.
            &format!("{}#decoded=arrow-ipc-1;projection={proj_id:016x};row_group={rg}", m.url()),
            &m.identity(),
            &format!("{}.rg{rg}.arrow", m.name),
        );
        format!("{}{key}", crate::cache::DERIVED_PREFIX)
    }

    /// Node-cache key of shard `i` (`copy` mode).
    pub fn cache_key(&self, i: usize) -> Option<&str> {
        self.keys.get(i).map(CacheKey::as_str)
    }

    /// Node-cache key of shard `i` with its hash (`copy` mode; what the prefetcher's walks use).
    pub fn cache_key_ref(&self, i: usize) -> Option<KeyRef<'_>> {
        self.keys.get(i).map(CacheKey::key_ref)
    }

    /// True when the node cache holds entry `key` ready to read (false without a node cache).
    pub fn is_cached(&self, key: &str) -> bool {
        self.backends.cache.as_ref().is_some_and(|c| c.is_ready(key))
    }

    /// True when S3 Parquet file `i`'s footer was checked ([`Self::verify_remote_footer`]).
    pub fn footer_verified(&self, i: usize) -> bool {
        self.verified.get(i).is_some_and(|v| v.load(Ordering::Acquire))
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
        self.has_room(self.shards[i].len)
    }

    /// Frees `bytes` of room in the node cache by evicting idle entries among `keys` only
    /// ([`NodeCache::make_room_from`](crate::cache::NodeCache::make_room_from)); false without
    /// a node cache.
    pub fn make_room_from(&self, bytes: u64, keys: &[&str]) -> bool {
        self.backends.cache.as_ref().is_some_and(|c| c.make_room_from(bytes, keys))
    }

    /// True when the node cache has `bytes` of free room without evicting anything.
    pub fn has_room(&self, bytes: u64) -> bool {
        self.backends.cache.as_ref().is_some_and(|c| {
            let s = c.stats();
            s.capacity.saturating_sub(s.used) >= bytes
        })
    }

    /// Fetches shard `i` into the node cache (or pins it there). `Ok(None)`: a prefetch that did
    /// not wait (someone else is fetching it, or it does not fit without evicting sooner-needed
    /// shards). Blocking.
    pub fn fetch(&self, i: usize, want: Want) -> Result<Option<Pin>> {
        let (Some(key), Some(cache)) = (self.keys.get(i), &self.backends.cache) else {
            return Err(Error::Internal(format!("{}: shard {i} is not read through the cache", self.url)));
        };
        let local = matches!(self.shards[i].source, ShardSource::Local(_));
        fetch_into(cache, &self.backends, &self.shards[i], self.format, key.key_ref(), want)
            // A local source gone or not as indexed, found by its copy: as when read in place.
            .map_err(|e| if local { self.changed_if(e) } else { e })
            .map_err(|e| self.how_row_groups_could_go_apart(i, e))
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

/// Whether a copy's recorded modification time is its source's `source` as the cache's file
/// system keeps it: equal; equal but for the sub-second part (whole-second times: ext4 with small
/// inodes); or the even second at or before it (FAT, which keeps times to two seconds). Without
/// the last, half the copies on a FAT cache looked changed, and each open read their sources
/// whole to check them.
fn same_time(source: std::time::SystemTime, recorded: std::time::SystemTime) -> bool {
    let secs =
        |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).map(|d| (d.as_secs(), d.subsec_nanos()));
    match (secs(source), secs(recorded)) {
        (Ok((s, _)), Ok((r, 0))) => s == r || (r % 2 == 0 && s == r + 1),
        (Ok(s), Ok(r)) => s == r,
        _ => source == recorded,
    }
}

/// `e`, an error reading shard copy `pin` as its shard (its headers, its footer, its sample
/// count): a shard error drops the copy, so that the next use fetches it again rather than failing
/// on the same bytes for good (a copy damaged on disk after it was verified and published).
/// Whether `e` says a directory is where a file was asked for.
fn is_a_directory(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.kind() == std::io::ErrorKind::IsADirectory)
}

/// What [`Dataset::current_copy`] found of a copy: current, or not the shard (and why).
enum Current {
    Yes(Pin),
    Unlike(Pin, Error),
}

fn dropping_bad_copy(cache: &NodeCache, pin: Pin, e: Error) -> Error {
    if matches!(e, Error::Shard { .. }) {
        let key = pin.key().to_owned();
        drop(pin);
        cache.drop_copy(&key, &format!("reading it failed: {e}"));
    }
    e
}

/// Fetches one shard into the node cache with its verification.
fn fetch_into(
    cache: &Arc<NodeCache>,
    backends: &Backends,
    meta: &ShardMeta,
    format: Format,
    key: KeyRef<'_>,
    want: Want,
) -> Result<Option<Pin>> {
    let store = match meta.source {
        ShardSource::S3 { .. } => Some(backends.s3()?),
        ShardSource::Local(_) => None,
    };
    let spec = FetchSpec {
        source: &meta.source,
        len: meta.len,
        modified_ns: meta.mtime_ns,
        crc32c: meta.crc32c,
        footer_crc32c: meta.footer_crc32c,
        parquet: format == Format::Parquet,
    };
    cache
        .get(key, meta.len, want, &mut |tmp, file| download::fill(&spec, store, tmp, file, Arc::new(())))
        .map_err(|e| named_in_cache(e, meta))
}

/// A node-cache refusal (no room) prefixed with the shard it was for: the cache knows only its
/// entry's name, which the user never gave.
fn named_in_cache(e: Error, meta: &ShardMeta) -> Error {
    match e {
        Error::CacheFull(m) => Error::CacheFull(format!("{}: {m}", meta.url())),
        e => e,
    }
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
    use super::integrity::content_digest;
    use super::tables::cache_sidecar_path;
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
            row_group_check: None,
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
                split_keys: Default::default(),
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

    /// A copy's recorded time is its source's as the cache's file system keeps it: exact, whole
    /// seconds (ext4 with small inodes), or even seconds (FAT, which also drops the fraction).
    /// Any other time is a changed source.
    #[test]
    fn a_recorded_time_matches_its_source_at_the_cache_file_systems_grain() {
        let at = |s: u64, ns: u32| std::time::UNIX_EPOCH + std::time::Duration::new(s, ns);
        let source = at(1_764_950_001, 700_000_000);
        assert!(same_time(source, source));
        assert!(same_time(source, at(1_764_950_001, 0)), "whole seconds");
        assert!(same_time(source, at(1_764_950_000, 0)), "FAT: even seconds");
        assert!(same_time(at(1_764_950_000, 300), at(1_764_950_000, 0)));
        assert!(!same_time(source, at(1_764_950_001, 600_000_000)), "another time at the nanosecond");
        assert!(!same_time(source, at(1_764_949_999, 0)), "an odd second is no FAT rounding");
        assert!(!same_time(source, at(1_764_949_998, 0)), "two seconds before");
        assert!(!same_time(source, at(1_764_950_002, 0)), "after the source");
        assert!(!same_time(at(1_764_950_002, 0), at(1_764_950_000, 0)), "a whole-second source two seconds on");
    }

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
            Arc::new(ShardTable::Tar(crate::format::tar::TarIndex {
                boundaries,
                fields: Vec::new(),
                layout: None,
                split_keys: Default::default(),
            }))
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
                split_keys: Default::default(),
            })),
        );
        assert_eq!(ds.resident().0, 1);
        assert!(ds.table(100).is_some());
    }
}
