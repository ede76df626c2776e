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
//! Used when the selected chunks are under [`MAX_SHARE`] of the dataset's bytes and every file is
//! an S3 object whose manifest (if any) checksums its footer: a whole-file CRC (as `pack` writes)
//! can only be checked on the whole file, which then goes through the cache as before. Nor when
//! the node cache already holds the files whole (`shardstream prefetch`, an epoch of every
//! column), so that the stream would download less reading those than fetching its copies.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::cache::{Pin, Want};
use crate::format::parquet::dataset::{BatchAssembler, CachedCopy, FileReader};
use crate::format::parquet::projected::ProjectedFile;
use crate::index::{CacheMode, Dataset};
use crate::storage::ShardSource;
use crate::{Error, Result};

/// Column-chunk reads are used when the selected chunks are at most this share of the files'
/// bytes; above it, one GET of the whole file is as good.
pub const MAX_SHARE: f64 = 0.9;

/// One stream's projection over an S3 Parquet dataset: the compact copy of each file.
#[derive(Debug)]
pub struct ProjectedReads {
    ds: Arc<Dataset>,
    /// Shard index -> (its pieces, its node-cache key).
    files: HashMap<usize, (Arc<ProjectedFile>, String)>,
}

impl ProjectedReads {
    /// The column-chunk plan of `asm`'s projection over `ds`, or None when whole files serve it
    /// better (or it is not an S3 dataset checked by footers).
    pub fn plan(ds: &Arc<Dataset>, asm: &BatchAssembler) -> Result<Option<Self>> {
        let remote = ds.mode == CacheMode::Copy
            && ds.shards.iter().all(|s| matches!(s.source, ShardSource::S3 { .. }) && s.crc32c.is_none());
        if !remote {
            return Ok(None);
        }
        // The same chunks whatever the order the columns were asked in: one copy for both.
        let mut names: Vec<&str> = asm.projection().names().collect();
        names.sort_unstable();
        let proj_id = crate::stable_hash::hash_fields(names.iter().map(|n| n.as_bytes()));
        let mut files = HashMap::new();
        let (mut selected, mut total) = (0u64, 0u64);
        // What each way would still download, given what the node cache holds now.
        let (mut copies_missing, mut wholes_missing) = (0u64, 0u64);
        for (f, per_file) in asm.dataset().files().iter().zip(asm.per_file()) {
            let pf = ProjectedFile::new(&f.table, per_file);
            let key = ds.projected_key(f.index, proj_id);
            selected += pf.len();
            total += f.table.file_len();
            if !ds.is_cached(&key) {
                copies_missing += pf.len();
            }
            if !whole_copy_serves(ds, f.index) {
                wholes_missing += f.table.file_len();
            }
            files.insert(f.index, (Arc::new(pf), key));
        }
        if total == 0 || selected as f64 > MAX_SHARE * total as f64 || wholes_missing < copies_missing {
            return Ok(None);
        }
        Ok(Some(Self { ds: ds.clone(), files }))
    }

    fn file(&self, shard: usize) -> Result<&(Arc<ProjectedFile>, String)> {
        self.files.get(&shard).ok_or_else(|| Error::Internal(format!("no column-chunk plan for file {shard}")))
    }

    /// The bytes of file `shard`'s compact copy (0 for a file this plan does not know).
    pub fn copy_len(&self, shard: usize) -> u64 {
        self.files.get(&shard).map_or(0, |(pf, _)| pf.len())
    }

    /// The node-cache key of file `shard`'s compact copy.
    pub fn copy_key(&self, shard: usize) -> Option<&str> {
        self.files.get(&shard).map(|(_, key)| key.as_str())
    }

    /// True when file `shard`'s compact copy is in the node cache, ready to read.
    pub fn is_ready(&self, shard: usize) -> bool {
        self.files.get(&shard).is_some_and(|(_, key)| self.ds.is_cached(key))
    }

    /// A reader for one batch.
    pub fn reader(&self) -> ProjectedReader<'_> {
        ProjectedReader { reads: self, open: Mutex::new(HashMap::new()), fetched: AtomicBool::new(false) }
    }
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

impl crate::prefetch::ProjectedFetch for ProjectedReads {
    fn key(&self, shard: usize) -> Option<String> {
        self.files.get(&shard).map(|(_, k)| k.clone())
    }

    fn fetch(&self, shard: usize, want: Want) -> Result<bool> {
        let (pf, key) = self.file(shard)?;
        self.ds.fetch_projected(shard, pf, key, want).map(|pin| pin.is_some())
    }
}

/// Reads file bytes from the compact copies, fetching (and pinning) a copy on first use.
pub struct ProjectedReader<'a> {
    reads: &'a ProjectedReads,
    open: Mutex<HashMap<usize, (Pin, File)>>,
    fetched: AtomicBool,
}

impl ProjectedReader<'_> {
    /// True when a copy had to be fetched (the stream waited for storage).
    pub fn fetched(&self) -> bool {
        self.fetched.load(Relaxed)
    }
}

impl ProjectedReader<'_> {
    /// Fetches (if need be), pins and opens file `file`'s compact copy for this batch, so that
    /// the decoder finds it at hand. Called for several files at once, from several threads: the
    /// fetch runs outside the reader's lock.
    pub fn open_copy(&self, file: usize) -> Result<()> {
        self.with_copy(file, |_, _, _| Ok(()))
    }

    /// Runs `f` on file `file`'s compact copy (fetched and pinned on first use) and its pieces.
    fn with_copy<R>(&self, file: usize, then: impl FnOnce(&Arc<ProjectedFile>, &Pin, &File) -> Result<R>) -> Result<R> {
        let (pf, key) = self.reads.file(file)?;
        {
            let open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((pin, copy)) = open.get(&file) {
                return then(pf, pin, copy);
            }
        }
        let pin = self
            .reads
            .ds
            .fetch_projected(file, pf, key, Want::NOW)?
            .ok_or_else(|| Error::Internal("a waiting fetch gave up".into()))?;
        if pin.filled {
            self.fetched.store(true, Relaxed);
        }
        let opened =
            File::open(pin.path()).map_err(|e| Error::io("cannot open cached column chunks", pin.path(), e))?;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        // Another thread of the batch may have opened it meanwhile: its copy is as good.
        let (pin, copy) = open.entry(file).or_insert((pin, opened));
        then(pf, pin, copy)
    }
}

impl FileReader for ProjectedReader<'_> {
    fn read_bytes(&self, file: usize, offset: u64, len: usize) -> Result<bytes::Bytes> {
        // Rarely taken: the decoder maps these copies (`cached_copy`), so a zero fill is no cost.
        self.with_copy(file, |pf, pin, copy| {
            let at = pf.locate(offset..offset + len as u64).ok_or_else(|| {
                let url = self.reads.ds.shards.get(file).map(|m| m.url()).unwrap_or_default();
                Error::Internal(format!("{url}: read of bytes {offset}+{len} outside the selected column chunks"))
            })?;
            let mut buf = vec![0; len];
            copy.read_exact_at(&mut buf, at)
                .map_err(|e| Error::io("cannot read cached column chunks", pin.path(), e))?;
            Ok(buf.into())
        })
    }

    fn cached_copy(&self, file: usize) -> Result<Option<CachedCopy>> {
        self.with_copy(file, |pf, pin, copy| {
            let dup = copy.try_clone().map_err(|e| Error::io("cannot open cached column chunks", pin.path(), e))?;
            let copy = CachedCopy::new(dup, Some(pf.clone()))
                .map_err(|e| Error::io("cannot stat cached column chunks", pin.path(), e))?;
            Ok(Some(copy))
        })
    }
}
