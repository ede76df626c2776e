//! Shards' member tables: read from a sidecar (the manifest's or the daemon's sidecar cache) or
//! scanned by the shard's format, one shard at first use or every shard in parallel when a
//! dataset without a manifest is opened; an S3 Parquet file's table from its footer alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::integrity::content_digest;
use super::page_probe::{RowGroupCheck, read_table_noting_tail};
use super::{Backends, FOOTER_THREADS, SCAN_THREADS, ShardMeta, fetch_into, map_pinned};
use crate::cache::Want;
use crate::cache::key::CacheKey;
use crate::format::parquet::ParquetTable;
use crate::format::{Format, ShardTable};
use crate::storage::ShardSource;
use crate::storage::local::ShardFile;
use crate::storage::s3::S3Store;
use crate::{Error, Result};

pub(super) fn cache_sidecar_path(cache: &Path, meta: &ShardMeta) -> PathBuf {
    // Keyed by the shard's location (path or URL); the identity inside the file guards against
    // reuse for other bytes. A partitioned dataset's shard names are paths: flattened, the hash
    // tells them apart.
    let h = crate::stable_hash::hash(meta.url().as_bytes());
    cache.join(format!("{h:016x}-{}.idx", meta.name.replace('/', "_")))
}

/// The shard's member table: from the manifest's sidecar, the daemon's sidecar cache, or a
/// scan by its format (of `mapped`, the file's bytes, when given; whose result is then saved in
/// the sidecar cache).
pub(super) fn load_table(
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

/// The Parquet view of a scanned dataset at `base` (its URL prefix): its files (shard `i` of the
/// dataset is file index `i`) with their footer tables, and the keys of a partitioned one.
pub(super) fn parquet_dataset(
    base: &str,
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
    let names: Vec<&str> = shards.iter().map(|m| m.name.as_str()).collect();
    let partitions = crate::format::parquet::partitions::Partitions::of(&names, base)?;
    Ok(ParquetDataset::new(files)?.0.with_partitions(partitions))
}

/// A shard's table as opening the dataset found it.
pub(super) struct Scanned {
    pub table: ShardTable,
    /// A local shard's content digest (S3 shards keep their ETag as identity).
    pub content: Option<u64>,
    /// The table was just read from the object itself (an S3 Parquet footer).
    pub fresh: bool,
    /// What that read's tail told of how the file's row groups' copies are checked.
    pub from_tail: Option<RowGroupCheck>,
}

/// Loads every shard's table, in parallel (a dataset opened without manifest), and the content
/// digest of each local shard. Shards read through the node cache are fetched first, unless the
/// daemon's sidecar cache already knows them: a restarted daemon reopens an S3 dataset without
/// downloading it again.
///
/// `bundled`: tables known already (from the manifest's footers bundle), by shard; those shards
/// are not read (a manifest names them by CRC, so no content digest either).
pub(super) fn scan_all(
    format: Format,
    shards: &[ShardMeta],
    keys: &[CacheKey],
    backends: &Backends,
    cache: Option<&Path>,
    bundled: &[Option<Arc<ParquetTable>>],
    opening: &super::opening::Opening,
) -> Result<Vec<Scanned>> {
    let indexed: Vec<usize> = (0..shards.len()).collect();
    // S3 Parquet files give their tables from their footers alone: latency-bound ranged GETs.
    let footers_only = format == Format::Parquet && shards.iter().all(|s| matches!(s.source, ShardSource::S3 { .. }));
    let threads = if footers_only { FOOTER_THREADS } else { SCAN_THREADS };
    crate::parallel::try_map(&indexed, threads, |&i| {
        let scanned = scan_one(format, &shards[i], keys.get(i), backends, cache, bundled.get(i).cloned().flatten());
        opening.shard_done();
        scanned
    })
}

/// The tables a manifest's footers bundle at `at` holds for `shards` (None for a shard it does
/// not describe as it is now: missing or stale). A bundle that cannot be read or does not load
/// gives none, with a warning: each file's footer is then read, as without a bundle.
pub(super) fn bundled_tables(
    at: &ShardSource,
    shards: &[ShardMeta],
    backends: &Backends,
) -> Vec<Option<Arc<ParquetTable>>> {
    let shown = match at {
        ShardSource::Local(path) => path.display().to_string(),
        ShardSource::S3 { bucket, key, .. } => format!("s3://{bucket}/{key}"),
    };
    let bytes: Result<Option<bytes::Bytes>> = match at {
        ShardSource::Local(path) => crate::storage::local::read_metadata(path)
            .map(|b| Some(b.into()))
            .map_err(|e| Error::io("cannot read", path, e)),
        ShardSource::S3 { bucket, key, .. } => {
            backends.s3().and_then(|store| store.block_on(store.get_small(bucket, key)))
        }
    };
    let decoded = match &bytes {
        Ok(Some(b)) => crate::format::parquet::footers::decode(b).map_err(|e| e.to_string()),
        Ok(None) => Err("it does not exist".to_owned()),
        Err(e) => Err(e.to_string()),
    };
    let entries = match decoded {
        Ok(entries) => entries,
        Err(why) => {
            tracing::warn!(footers = %shown, error = %why, "cannot use the manifest's footers bundle: reading each file's footer instead");
            return Vec::new();
        }
    };
    let tables: Vec<Option<Arc<ParquetTable>>> = shards
        .iter()
        .map(|meta| {
            let sidecar = entries.get(meta.name.as_str())?;
            match crate::format::parquet::pqidx::load(sidecar, &meta.identity()) {
                Ok(Some(t)) if t.file_len() == meta.len => Some(Arc::new(t)),
                Ok(_) => None,
                Err(e) => {
                    tracing::warn!(footers = %shown, file = %meta.name, error = %e, "a damaged entry in the footers bundle");
                    None
                }
            }
        })
        .collect();
    let missing = tables.iter().filter(|t| t.is_none()).count();
    if missing > 0 {
        tracing::warn!(footers = %shown, files = missing, "the footers bundle does not describe these files as they are now (indexed before they changed?): reading their footers");
    }
    tables
}

/// One shard's table and, for a local shard, its content digest (S3 shards keep their ETag as
/// identity: digesting them would download them).
fn scan_one(
    format: Format,
    meta: &ShardMeta,
    key: Option<&CacheKey>,
    backends: &Backends,
    cache: Option<&Path>,
    bundled: Option<Arc<ParquetTable>>,
) -> Result<Scanned> {
    let digest = |table: &ShardTable, file: Option<&ShardFile>| -> Result<Option<u64>> {
        // A manifest's CRC names the file in the fingerprint (`ShardMeta::content_identity`): a
        // digest would be read for nothing, and a dataset opened from its manifest and footers
        // bundle touches none of its files before a stream uses them.
        if meta.named_by_crc() {
            return Ok(None);
        }
        match (&meta.source, file) {
            (ShardSource::Local(_), Some(f)) => content_digest(f, table).map(Some),
            (ShardSource::Local(path), None) => {
                content_digest(&ShardFile::open(path.clone(), meta.len)?, table).map(Some)
            }
            (ShardSource::S3 { .. }, _) => Ok(None),
        }
    };
    if let Some(table) = bundled.map(ShardTable::Parquet) {
        let content = digest(&table, None)?;
        return Ok(Scanned { table, content, fresh: false, from_tail: None });
    }
    // A local Parquet file's table is its footer, read from the file itself also when its rows go
    // through the node cache: copying every file to read its footer cost the first batch the
    // whole dataset's copy (2.7 s for 2 GB, bench/PARQUET_RESULTS.md). The copy is made when the
    // plan needs it, and checked against this footer then (`Dataset::shard_fetched`).
    let footer_in_place = format == Format::Parquet && matches!(meta.source, ShardSource::Local(_));
    match (key, &backends.cache) {
        (Some(key), Some(node)) if !footer_in_place => {
            let (mut fresh, mut from_tail) = (false, None);
            let table = match cache.and_then(|c| {
                format.read_sidecar(&cache_sidecar_path(c, meta), &meta.identity(), meta.len).ok().flatten()
            }) {
                Some(table) => table,
                // A Parquet file's table is its footer: one ranged GET, not the whole object (which
                // is fetched, and verified, when a stream first needs its rows).
                None if format == Format::Parquet && matches!(meta.source, ShardSource::S3 { .. }) => {
                    let (table, checked) = remote_parquet_table(backends.s3()?, meta)?;
                    from_tail = checked;
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
                    let pin = fetch_into(node, backends, meta, format, key.key_ref(), Want::NOW)?
                        .ok_or_else(|| Error::Internal("a waiting fetch gave up".into()))?;
                    let file = ShardFile::open_as(pin.path().to_owned(), meta.len, meta.url())?;
                    // Dropped before `pin`, which keeps the copy immutable while it is mapped.
                    let mapped = map_pinned(&file, false);
                    let table = load_table(format, meta, &file, mapped.as_deref(), cache);
                    drop(mapped);
                    table.map_err(|e| super::dropping_bad_copy(node, pin, e))?
                }
            };
            let content = digest(&table, None)?;
            Ok(Scanned { table, content, fresh, from_tail })
        }
        _ => {
            let ShardSource::Local(path) = &meta.source else {
                return Err(Error::Internal(format!("{} needs the node cache", meta.url())));
            };
            let file = ShardFile::open(path.clone(), meta.len)?;
            let table = load_table(format, meta, &file, None, cache)?;
            let content = digest(&table, Some(&file))?;
            Ok(Scanned { table, content, fresh: false, from_tail: None })
        }
    }
}

/// The footer table of an S3 Parquet file, read with one ranged GET of its tail (two for a footer
/// larger than the tail), and what that tail tells of how a row group's copy is checked
/// ([`RowGroupCheck::from_facts`]).
fn remote_parquet_table(store: &S3Store, meta: &ShardMeta) -> Result<(ShardTable, Option<RowGroupCheck>)> {
    let obj = super::s3_object(meta)?;
    let mut read = 0;
    loop {
        read += 1;
        let table = read_table_noting_tail(&meta.url(), meta.len, |off, buf| {
            let (got, _, md5) = store.block_on(store.get_range_etag_md5(&obj, off..off + buf.len() as u64))?;
            buf.copy_from_slice(&got);
            Ok(Some(md5))
        });
        match table {
            Ok((table, tail)) => {
                let checked = RowGroupCheck::from_facts(tail.page_crc, tail.etag_md5);
                return Ok((ShardTable::Parquet(Arc::new(table)), checked));
            }
            // Nothing checks a ranged GET but the footer's own form: a spoilt one may read
            // well the next time, a damaged file fails every time.
            Err(e @ Error::Shard { .. }) if read < FOOTER_READS => {
                tracing::warn!(shard = %meta.url(), read, error = %e, "a footer did not decode; reading it again");
            }
            Err(e) => return Err(e),
        }
    }
}

/// Reads of a footer that does not decode before the file is refused: as many as a shard's
/// downloads on a checksum mismatch.
const FOOTER_READS: u32 = 3;
