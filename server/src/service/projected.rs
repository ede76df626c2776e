//! Column-chunk reads for S3 Parquet streams: when a stream selects a fraction of a dataset's
//! columns, each file reaches the node cache as one compact copy of the selected column chunks
//! ([`ProjectedFile`]: every row group's chunks, adjacent ones merged into large ranged GETs),
//! never as the whole object. The copy is an ordinary node-cache entry (keyed by the file's
//! identity and the projection, so streams with the same columns share it), fetched by the
//! prefetcher in plan order ([`ProjectedFetch`]) like whole shards, and read by the row-group
//! decoder through [`ProjectedReader`]. Each file's footer is checked once against the manifest
//! (or against the footer the dataset was opened with) before any of its rows is served: from the
//! GETs that fetch its copy when they fetch it (`Dataset::fetch_projected`), else by a GET of
//! exactly the footer.
//!
//! A node cache smaller than every file's copy together holds **a copy per row group** instead:
//! the shuffle spreads a file's row groups over the whole epoch, so a whole file's copy was
//! evicted between two of them and fetched again (1.75x the chunks' bytes in a first epoch at a
//! cache of 3/4 of them). The prefetcher then follows the plan's units (row groups) rather than
//! files. A cache that holds them all keeps one copy per file: the chunks of neighbouring row
//! groups merge into fewer GETs.
//!
//! Used when the selected chunks are under [`MAX_SHARE`] of the dataset's bytes (or, copied a row
//! group at a time, when some file's ETag is no MD5 or its pages carry checksums; each
//! other file, whose ETag may be its MD5, is then copied whole, checked by it: see
//! [`ProjectedReads::plan`]) and every file is
//! an S3 object whose manifest (if any) checksums its footer: a whole-file CRC (as `pack` writes)
//! can only be checked on the whole file, which then goes through the cache as before. Nor when
//! the node cache already holds the files whole (`shardstream prefetch`, an epoch of every
//! column), so that the stream would download less reading those than fetching its copies.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::cache::key::{CacheKey, KeyRef};
use crate::cache::{EndedBy, Pin, Want};
use crate::format::parquet::dataset::{BatchAssembler, CachedCopy, FileReader};
use crate::format::parquet::projected::ProjectedFile;
use crate::index::{CacheMode, Dataset};
use crate::storage::ShardSource;
use crate::storage::s3::etag_md5;
use crate::{Error, Result};

/// Column-chunk reads are used when the selected chunks are at most this share of the files'
/// bytes; above it, one GET of the whole file is as good.
pub const MAX_SHARE: f64 = 0.9;

/// One compact copy: some row groups' selected chunks of one file, or the whole file.
#[derive(Debug)]
struct ChunkCopy {
    /// The file's shard index.
    shard: usize,
    pf: Arc<ProjectedFile>,
    key: CacheKey,
    /// `pf`'s bytes, beside the key: the prefetcher asks both of every use it walks, and a
    /// reach into `pf` was a cache miss each.
    len: u64,
}

/// The compact copies of one projection of one dataset version: O(row groups) of pieces and
/// keys (about 600 bytes a row group, copied a row group at a time), built once and shared by
/// the streams that read those columns ([`CopyPlans`]; staging builds its own).
#[derive(Debug)]
struct CopyPlan {
    copies: Vec<ChunkCopy>,
    /// Shard index -> its copies in row-group order (one for the whole file, or one per row
    /// group: see [`ProjectedReads::per_row_group`]).
    by_file: HashMap<usize, Vec<usize>>,
    /// Plan unit -> its copy.
    by_unit: Vec<usize>,
    per_row_group: bool,
    /// Some copy is a whole file ([`ProjectedFile::whole`]).
    whole_files: bool,
}

/// (dataset URL, its fingerprint, the projection's id): with the node cache's configured
/// capacity, fixed for the daemon's life, all a plan depends on.
type PlanKey = (String, String, u64);

/// The copy plans streams use now, one per dataset version and projection: each stream of a
/// node's ranks and workers held one of its own, 16 MiB a stream over 32,000 row groups
/// (bench/S3_RESULTS.md, "What a stream costs"). Held weakly: a plan lives while a stream (or
/// staging) reads by it.
#[derive(Debug, Default)]
pub struct CopyPlans {
    plans: Mutex<HashMap<PlanKey, std::sync::Weak<CopyPlan>>>,
    /// Plans built (a test checks that streams share them).
    pub built: std::sync::atomic::AtomicU64,
}

impl CopyPlans {
    /// The plan under `key`, built by `build` when no stream holds one; None when `build` says
    /// whole files serve the projection better (not kept: nothing holds it).
    fn get_or_build(
        &self,
        key: PlanKey,
        build: impl FnOnce() -> Result<Option<CopyPlan>>,
    ) -> Result<Option<Arc<CopyPlan>>> {
        let lock = || self.plans.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(plan) = lock().get(&key).and_then(std::sync::Weak::upgrade) {
            return Ok(Some(plan));
        }
        // Built outside the lock (O(row groups)): two streams starting together may both build;
        // the first to return keeps its plan and the other takes it.
        let Some(built) = build()? else { return Ok(None) };
        let built = Arc::new(built);
        self.built.fetch_add(1, Relaxed);
        let mut plans = lock();
        plans.retain(|_, p| p.strong_count() > 0);
        match plans.get(&key).and_then(std::sync::Weak::upgrade) {
            Some(plan) => Ok(Some(plan)),
            None => {
                plans.insert(key, Arc::downgrade(&built));
                Ok(Some(built))
            }
        }
    }
}

/// One stream's projection over an S3 Parquet dataset: the compact copies of its files.
#[derive(Debug)]
pub struct ProjectedReads {
    ds: Arc<Dataset>,
    plan: Arc<CopyPlan>,
}

impl ProjectedReads {
    /// The column-chunk plan of `asm`'s projection over `ds` (shared through `plans` with the
    /// other streams reading those columns), or None when whole files serve it better (or it is
    /// not an S3 dataset checked by footers).
    pub fn plan(ds: &Arc<Dataset>, asm: &BatchAssembler, plans: &CopyPlans) -> Result<Option<Self>> {
        if !Self::remote(ds) {
            return Ok(None);
        }
        // The same chunks whatever the order the columns were asked in: one copy for both.
        let mut names: Vec<&str> = asm.projection().names().collect();
        names.sort_unstable();
        let proj_id = crate::stable_hash::hash_fields(names.iter().map(|n| n.as_bytes()));
        let files = asm.dataset().files();
        // The configured capacity (fixed for the daemon's life, never the one a full disk lowered
        // for a while) decides the copies with the dataset and the projection: streams and
        // staging agree on their keys, and the key below need not name it.
        let capacity = ds.node_cache().map_or(u64::MAX, |c| c.configured_capacity());
        let key = (ds.url.clone(), ds.fingerprint.clone(), proj_id);
        let Some(plan) = plans.get_or_build(key, || Self::build(ds, asm, proj_id, capacity))? else {
            return Ok(None);
        };
        // What each way would still download, given what the node cache holds now.
        let copies_missing =
            plan.copies.iter().filter(|c| !ds.is_cached(&c.key)).map(|c| c.len).fold(0, u64::saturating_add);
        let wholes_missing = files
            .iter()
            .filter(|f| !whole_copy_serves(ds, f.index))
            .map(|f| f.table.file_len())
            .fold(0, u64::saturating_add);
        if wholes_missing < copies_missing {
            return Ok(None);
        }
        Ok(Some(Self { ds: ds.clone(), plan }))
    }

    /// The copies of projection `proj_id` (`asm`'s) over `ds` through a node cache of
    /// `capacity`, or None when whole files serve it better.
    fn build(ds: &Dataset, asm: &BatchAssembler, proj_id: u64, capacity: u64) -> Result<Option<CopyPlan>> {
        let files = asm.dataset().files();
        let (mut selected, mut total) = (0u64, 0u64);
        let mut whole: Vec<ProjectedFile> = Vec::with_capacity(files.len());
        for (f, per_file) in files.iter().zip(asm.per_file()) {
            let pf = ProjectedFile::new(&f.table, per_file);
            selected += pf.len();
            total += f.table.file_len();
            whole.push(pf);
        }
        let per_row_group = selected > capacity;
        // Most of the bytes: one GET of a whole file is as good, and its ETag's MD5 checks it
        // whole. Unless the node cache is too small for the files: a whole copy is then evicted
        // between its row groups and fetched again (1.5x the files in a first epoch), or, when
        // the whole files a stream's window holds fill the cache, the stream fails after a
        // minute's wait for room. A row group's copy is checked by its pages, so a file goes a
        // row group at a time when nothing checks it whole anyway (its listed ETag says it has
        // no MD5: a multipart upload's, as large files get from `aws s3 cp`; or its GET says so,
        // as SSE-KMS does) or when its pages carry checksums (both read from its first page
        // header). The others, one-part uploads whose pages carry none (pyarrow's default), are
        // copied whole, checked by their MD5 (a store that lists no ETag may still answer a GET
        // with one); with no file of the first kinds, whole files go through the cache as before.
        // Over TLS every file goes a row group at a time, unasked: TLS checks each GET's bytes in
        // transit, the check a whole copy's MD5 adds there, and the cache-full failure goes.
        let no_md5 = |i: usize| {
            ds.shards
                .get(i)
                .is_some_and(|s| matches!(&s.source, ShardSource::S3 { etag: Some(e), .. } if etag_md5(e).is_none()))
        };
        let most = selected as f64 > MAX_SHARE * total as f64;
        let by_row_groups: HashSet<usize> = if most && per_row_group && ds.answers_over_tls()? {
            tracing::info!(
                dataset = %ds.url,
                files = files.len(),
                "every column through a node cache smaller than the files: copied a row group at a time, \
                 checked in transit by TLS (and by page checksums where the files carry them)"
            );
            files.iter().map(|f| f.index).collect()
        } else if most && per_row_group {
            let maybe_md5: Vec<usize> = files.iter().map(|f| f.index).filter(|&i| !no_md5(i)).collect();
            let checked = ds.row_group_copies_checked(&maybe_md5)?;
            let checked = maybe_md5.iter().zip(checked).filter_map(|(&i, c)| c.then_some(i));
            files.iter().map(|f| f.index).filter(|&i| no_md5(i)).chain(checked).collect()
        } else {
            HashSet::new()
        };
        if total == 0 || (most && by_row_groups.is_empty()) {
            return Ok(None);
        }
        let (mut copies, mut by_file) = (Vec::new(), HashMap::new());
        for ((f, per_file), pf) in files.iter().zip(asm.per_file()).zip(whole) {
            let groups = f.table.num_row_groups();
            let mut add = |key: String, pf: ProjectedFile| {
                copies.push(ChunkCopy { shard: f.index, len: pf.len(), pf: Arc::new(pf), key: CacheKey::new(key) });
                copies.len() - 1
            };
            let chunks = |rg: Option<usize>| ds.projected_key(f.index, proj_id, rg);
            // A file of one row group keeps its file's copy (and key) either way.
            let mine: Vec<usize> = if most && !by_row_groups.contains(&f.index) {
                let key = ds
                    .whole_copy_key(f.index)
                    .ok_or_else(|| Error::Internal(format!("{}: no shard {}", f.name, f.index)))?;
                vec![add(key, ProjectedFile::whole(&f.table))]
            } else if per_row_group && groups > 1 {
                (0..groups)
                    .map(|rg| add(chunks(Some(rg)), ProjectedFile::of_row_groups(&f.table, per_file, rg..rg + 1)))
                    .collect()
            } else {
                vec![add(chunks(None), pf)]
            };
            by_file.insert(f.index, mine);
        }
        let pq = asm.dataset();
        let by_unit = (0..pq.unit_rows().len())
            .map(|u| {
                let (fi, rg) = pq.unit(u).ok_or_else(|| Error::Internal(format!("no plan unit {u}")))?;
                let file = files.get(fi).ok_or_else(|| Error::Internal(format!("no file {fi} of plan unit {u}")))?;
                let mine = by_file.get(&file.index).map_or(&[][..], Vec::as_slice);
                copy_in(mine, rg)
                    .ok_or_else(|| Error::Internal(format!("{}: no column-chunk copy of row group {rg}", file.name)))
            })
            .collect::<Result<Vec<usize>>>()?;
        let whole_files = copies.iter().any(|c| c.pf.is_whole());
        Ok(Some(CopyPlan { copies, by_file, by_unit, per_row_group, whole_files }))
    }

    /// True when `ds` may be read by column-chunk copies: S3 objects through the node cache,
    /// checked by their footers (a manifest's whole-file CRC is checked on whole files only).
    pub fn remote(ds: &Dataset) -> bool {
        ds.mode == CacheMode::Copy
            && ds.shards.iter().all(|s| matches!(s.source, ShardSource::S3 { .. }) && s.crc32c.is_none())
    }

    /// True when the copies are one per row group (the node cache is smaller than every file's
    /// copy together): the prefetcher then follows the plan's units, not its files.
    pub fn per_row_group(&self) -> bool {
        self.plan.per_row_group
    }

    /// True when some file is copied whole ([`ProjectedFile::whole`]: one its ETag's MD5 checks,
    /// among files copied a row group at a time).
    pub fn copies_whole_files(&self) -> bool {
        self.plan.whole_files
    }

    fn copy(&self, c: usize) -> Result<&ChunkCopy> {
        self.plan.copies.get(c).ok_or_else(|| Error::Internal(format!("no column-chunk copy {c}")))
    }

    fn file_copies(&self, shard: usize) -> &[usize] {
        self.plan.by_file.get(&shard).map_or(&[], Vec::as_slice)
    }

    /// The copy holding row group `rg` of file `shard`.
    fn copy_of(&self, shard: usize, rg: usize) -> Result<usize> {
        copy_in(self.file_copies(shard), rg).ok_or_else(|| {
            let url = self.ds.shards.get(shard).map(|m| m.url()).unwrap_or_else(|| format!("file {shard}"));
            Error::Internal(format!("{url}: no column-chunk copy of row group {rg}"))
        })
    }

    /// The copies plan units `units` read, each once, in the order first read.
    pub fn copies_of_units(&self, units: &[usize]) -> Vec<usize> {
        let mut seen = std::collections::HashSet::new();
        units.iter().filter_map(|&u| self.plan.by_unit.get(u).copied()).filter(|&c| seen.insert(c)).collect()
    }

    /// The file (shard index) copy `c` is of.
    pub fn shard_of(&self, c: usize) -> Option<usize> {
        self.plan.copies.get(c).map(|c| c.shard)
    }

    /// True when copy `c` is in the node cache, ready to read.
    pub fn copy_ready(&self, c: usize) -> bool {
        self.plan.copies.get(c).is_some_and(|c| self.ds.is_cached(&c.key))
    }

    /// The copy a prefetcher's or staging's use `n` names: file `n`'s copy or, a copy per row
    /// group, plan unit `n`'s.
    pub fn copy_of_use(&self, n: usize) -> Option<usize> {
        if self.plan.per_row_group { self.plan.by_unit.get(n).copied() } else { self.file_copies(n).first().copied() }
    }

    /// The bytes of copy `c` (0 for no such copy).
    pub fn copy_len(&self, c: usize) -> u64 {
        self.plan.copies.get(c).map_or(0, |c| c.len)
    }

    /// The node-cache key of copy `c`.
    pub fn copy_key(&self, c: usize) -> Option<&str> {
        self.plan.copies.get(c).map(|c| c.key.as_str())
    }

    /// Fetches (or pins) copy `c`. False when the cache gave up (no room without evicting what
    /// is needed sooner, or another fill of it under way).
    pub fn fetch_copy(&self, c: usize, want: Want) -> Result<bool> {
        let copy = self.copy(c)?;
        self.ds.fetch_projected(copy.shard, &copy.pf, copy.key.key_ref(), want).map(|pin| pin.is_some())
    }

    /// A reader for one batch of a stream that `ended` says has ended once its client is gone.
    pub fn reader(&self, ended: Option<EndedBy>) -> ProjectedReader<'_> {
        ProjectedReader { reads: self, open: Mutex::new(HashMap::new()), fetched: AtomicBool::new(false), ended }
    }
}

/// Among a file's copies (one, or one per row group), the one holding row group `rg`.
fn copy_in(mine: &[usize], rg: usize) -> Option<usize> {
    if mine.len() > 1 { mine.get(rg) } else { mine.first() }.copied()
}

/// Whether the node cache's whole copy of S3 file `i` may serve a projection in place of its
/// compact copy. A compact copy's fetch checks the object's footer on S3 (a changed object is
/// refused); a whole copy is checked against what keys it: the manifest's footer CRC, or the
/// ETag the listing gave. Without either (a store that lists no ETags, no manifest), only a
/// footer this daemon has checked on S3 vouches for the object behind the copy.
fn whole_copy_serves(ds: &Dataset, i: usize) -> bool {
    let keyed = ds
        .shards
        .get(i)
        .is_some_and(|m| m.footer_crc32c.is_some() || matches!(m.source, ShardSource::S3 { etag: Some(_), .. }));
    ds.is_local(i) && (keyed || ds.footer_verified(i))
}

/// The prefetcher's uses name files (one copy each) or, a copy per row group, plan units.
impl crate::prefetch::ProjectedFetch for ProjectedReads {
    fn key(&self, n: usize) -> Option<KeyRef<'_>> {
        self.copy_of_use(n).and_then(|c| self.plan.copies.get(c)).map(|c| c.key.key_ref())
    }

    fn fetch(&self, n: usize, want: Want) -> Result<bool> {
        let c = self.copy_of_use(n).ok_or_else(|| Error::Internal(format!("no column-chunk copy for use {n}")))?;
        self.fetch_copy(c, want)
    }

    fn shard(&self, n: usize) -> Option<usize> {
        self.copy_of_use(n).and_then(|c| self.shard_of(c))
    }

    fn len(&self, n: usize) -> u64 {
        self.copy_of_use(n).map_or(0, |c| self.copy_len(c))
    }

    fn keys_id(&self) -> usize {
        Arc::as_ptr(&self.plan) as usize
    }
}

/// Reads file bytes from the compact copies, fetching (and pinning) a copy on first use.
pub struct ProjectedReader<'a> {
    reads: &'a ProjectedReads,
    /// Copy -> its pin and the copy opened.
    open: Mutex<HashMap<usize, (Pin, File)>>,
    fetched: AtomicBool,
    ended: Option<EndedBy>,
}

impl ProjectedReader<'_> {
    /// True when a copy had to be fetched (the stream waited for storage).
    pub fn fetched(&self) -> bool {
        self.fetched.load(Relaxed)
    }

    /// Fetches (if need be), pins and opens copy `c` for this batch, so that the decoder finds
    /// it at hand. Called for several copies at once, from several threads: the fetch runs
    /// outside the reader's lock.
    pub fn open_copy(&self, c: usize) -> Result<()> {
        self.with_copy(c, |_, _, _| Ok(()))
    }

    /// Runs `f` on copy `c` (fetched and pinned on first use) and its pieces.
    fn with_copy<R>(&self, c: usize, then: impl FnOnce(&Arc<ProjectedFile>, &Pin, &File) -> Result<R>) -> Result<R> {
        let copy = self.reads.copy(c)?;
        let ended = self.ended.as_ref().map(EndedBy::as_ended);
        {
            let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((pin, file)) = open.get(&c) {
                return then(&copy.pf, pin, file);
            }
        }
        let pin = self
            .reads
            .ds
            .fetch_projected(copy.shard, &copy.pf, copy.key.key_ref(), Want { ended, ..Want::NOW })?
            .ok_or_else(|| Error::Internal("a waiting fetch gave up".into()))?;
        if pin.filled {
            self.fetched.store(true, Relaxed);
        }
        let opened =
            File::open(pin.path()).map_err(|e| Error::io("cannot open cached column chunks", pin.path(), e))?;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        // Another thread of the batch may have opened it meanwhile: its copy is as good.
        let (pin, file) = open.entry(c).or_insert((pin, opened));
        then(&copy.pf, pin, file)
    }
}

impl FileReader for ProjectedReader<'_> {
    fn read_bytes(&self, file: usize, offset: u64, len: usize) -> Result<bytes::Bytes> {
        // Rarely taken: the decoder maps these copies (`cached_copy`), so a zero fill is no cost.
        let range = offset..offset + len as u64;
        let c = self
            .reads
            .file_copies(file)
            .iter()
            .copied()
            .find(|&c| self.reads.plan.copies.get(c).is_some_and(|copy| copy.pf.locate(range.clone()).is_some()));
        let c = c.ok_or_else(|| {
            let url = self.reads.ds.shards.get(file).map(|m| m.url()).unwrap_or_default();
            Error::Internal(format!("{url}: read of bytes {offset}+{len} outside the selected column chunks"))
        })?;
        self.with_copy(c, |pf, pin, copy| {
            let at =
                pf.locate(range.clone()).ok_or_else(|| Error::Internal(format!("bytes {range:?} left copy {c}")))?;
            let mut buf = vec![0; len];
            copy.read_exact_at(&mut buf, at)
                .map_err(|e| Error::io("cannot read cached column chunks", pin.path(), e))?;
            Ok(buf.into())
        })
    }

    fn fetch_again(&self, file: usize, rg: usize, why: &str) -> Result<Option<CachedCopy>> {
        let c = self.reads.copy_of(file, rg)?;
        let copy = self.reads.copy(c)?;
        let Some(cache) = self.reads.ds.node_cache() else { return Ok(None) };
        // This batch's pin goes first: the cache drops no copy anyone holds.
        self.open.lock().unwrap_or_else(|p| p.into_inner()).remove(&c);
        if cache.drop_copy(copy.key.as_str(), &format!("row group {rg} does not decode: {why}")) {
            return self.cached_copy(file, rg);
        }
        // Held by another read (a batch in flight waiting on this decode, as like as not): a
        // copy of this read's own, and the cached one dropped at a later read that finds it bad.
        let url = self.reads.ds.shards.get(copy.shard).map(|m| m.url()).unwrap_or_default();
        tracing::warn!(shard = %url, row_group = rg, error = %why, "a node-cache copy does not decode and is in use: fetching it again apart");
        let apart = self.reads.ds.fetch_projected_apart(copy.shard, &copy.pf, copy.key.as_str())?;
        self.fetched.store(true, Relaxed);
        let apart = CachedCopy::new(apart, Some(copy.pf.clone()))
            .map_err(|e| Error::Internal(format!("{url}: cannot stat a copy fetched apart: {e}")))?;
        Ok(Some(apart))
    }

    fn cached_copy(&self, file: usize, rg: usize) -> Result<Option<CachedCopy>> {
        let c = self.reads.copy_of(file, rg)?;
        self.with_copy(c, |pf, pin, copy| {
            let dup = copy.try_clone().map_err(|e| Error::io("cannot open cached column chunks", pin.path(), e))?;
            let copy = CachedCopy::new(dup, Some(pf.clone()))
                .map_err(|e| Error::io("cannot stat cached column chunks", pin.path(), e))?;
            Ok(Some(copy))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty() -> Result<Option<CopyPlan>> {
        Ok(Some(CopyPlan {
            copies: Vec::new(),
            by_file: HashMap::new(),
            by_unit: Vec::new(),
            per_row_group: true,
            whole_files: false,
        }))
    }

    #[test]
    fn streams_reading_the_same_columns_share_one_plan_while_any_holds_it() {
        let plans = CopyPlans::default();
        let key = |proj: u64| ("s3://b/d/".to_owned(), "f1".to_owned(), proj);
        let a = plans.get_or_build(key(1), empty).unwrap().unwrap();
        let b = plans.get_or_build(key(1), || panic!("built again while a stream holds it")).unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let other = plans.get_or_build(key(2), empty).unwrap().unwrap();
        assert!(!Arc::ptr_eq(&a, &other), "other columns, another plan");
        assert_eq!(plans.built.load(Relaxed), 2);
        drop((a, b));
        let again = plans.get_or_build(key(1), empty).unwrap().unwrap();
        assert_eq!(plans.built.load(Relaxed), 3, "no stream held it: built anew, not kept");
        assert_eq!(Arc::strong_count(&again), 1);
        // A failed build leaves nothing behind.
        assert!(plans.get_or_build(key(3), || Err(Error::Internal("no".into()))).is_err());
        assert_eq!(plans.built.load(Relaxed), 3);
        // Whole files serve it: nothing built, nothing kept.
        assert!(plans.get_or_build(key(4), || Ok(None)).unwrap().is_none());
        assert_eq!(plans.built.load(Relaxed), 3);
    }
}
