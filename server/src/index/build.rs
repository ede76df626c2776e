//! `shardstream index`: writes `manifest.json` and the per-shard sidecars for shards made
//! elsewhere (by the `webdataset` library, `tar`, another pipeline), so the daemon opens the
//! dataset with one read and verifies every shard before serving it.
//!
//! Each shard is read once in full (for its CRC-32C) and its headers once more (for the member
//! table; by then they are in the page cache). Shards are processed in parallel. The manifest is
//! written last, atomically: an interrupted run leaves no manifest that lists unverified shards.
//!
//! For an `s3://` dataset each shard is downloaded once into a scratch file (ranged GETs, the
//! CRC-32C computed as the bytes arrive), indexed there and deleted; sidecars and the manifest are
//! uploaded next to the shards, the manifest last.
//!
//! Parquet files are never read whole: everything the manifest and the sidecar hold is in the
//! footer, so each file costs one tail read of [`TAIL_READ`](crate::format::parquet::footer::TAIL_READ) bytes (a ranged GET on S3),
//! and a second read of exactly the footer only when the footer is larger. The manifest then says
//! `"checksum": "crc32c-footer"`: each `crc32c` covers the file's footer (see `manifest`), and an
//! S3 file's entry records the ETag the listing gave. [`IndexSummary::footer_reads`] counts the
//! reads and bytes, so a caller (and the tests) can see that no file was read in full. Every
//! file's sidecar also goes into one object, the footers bundle (`format::parquet::footers`),
//! which the manifest names: a daemon opens the dataset with two reads whatever its file count.
//! On S3 that bundle replaces the per-file sidecar objects.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use bytes::Bytes;

use crate::format::parquet::{ParquetTable, footers};
use crate::format::{Format, ShardTable};
use crate::index::FOOTER_THREADS;
use crate::index::manifest::{ChecksumScope, MANIFEST_FILE, Manifest, ManifestShard, SIDECAR_DIR};
use crate::index::page_probe::read_table_noting_tail;
use crate::storage::local::{self, ShardFile};
use crate::storage::s3::{ObjectRef, S3Store};
use crate::storage::{DatasetUrl, Pick};
use crate::{Error, Result};

/// Progress of an index run, reported after each shard.
pub trait Progress: Sync {
    fn shard_done(&self, name: &str, bytes: u64);
}

impl Progress for () {
    fn shard_done(&self, _: &str, _: u64) {}
}

#[derive(Debug)]
pub struct IndexSummary {
    pub manifest: Manifest,
    /// Where the manifest was written (path or `s3://` URL).
    pub location: String,
    /// Parquet datasets: the reads of file bytes the run made (footers only).
    pub footer_reads: Option<FooterReads>,
    /// A partitioned Parquet dataset's keys (columns its directories give), in order.
    pub partition_keys: Vec<String>,
    /// TAR shards whose samples' files are not together (name, samples, what was found).
    pub split_keys: Vec<SplitShard>,
}

/// Reads of Parquet file bytes made by an index run: every one is a footer (tail) read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FooterReads {
    /// Positioned reads (local) or ranged GETs (S3) of file bytes.
    pub reads: u64,
    /// Bytes they returned.
    pub bytes: u64,
}

#[derive(Default)]
struct ReadCounter {
    reads: AtomicU64,
    bytes: AtomicU64,
}

impl ReadCounter {
    fn count(&self, n: usize) {
        self.reads.fetch_add(1, Relaxed);
        self.bytes.fetch_add(n as u64, Relaxed);
    }

    fn total(&self) -> FooterReads {
        FooterReads { reads: self.reads.load(Relaxed), bytes: self.bytes.load(Relaxed) }
    }
}

/// The shards an index run will read: (name, bytes).
pub fn list(url: &str, s3: Option<&S3Store>) -> Result<Vec<(String, u64)>> {
    Ok(list_with_format(url, s3)?.1.into_iter().map(|s| (s.name, s.len)).collect())
}

/// A shard as listed.
struct Listed {
    name: String,
    len: u64,
    /// The S3 object's ETag, when the listing gave one.
    etag: Option<String>,
}

/// The dataset's shard format (from the shards' extensions) and its shards.
fn list_with_format(url: &str, s3: Option<&S3Store>) -> Result<(Format, Vec<Listed>)> {
    let shards = list_shards(url, s3)?;
    let format = Format::of_shards(shards.iter().map(|s| s.name.as_str()), url)?;
    Ok((format, shards))
}

fn list_shards(url: &str, s3: Option<&S3Store>) -> Result<Vec<Listed>> {
    // The manifest describes every shard of the place, whatever its splits: the opens that read
    // it apply their own pick, the split check of a plain directory included.
    let every = |pick: Pick| if pick == Pick::All { Pick::Every } else { pick };
    match DatasetUrl::parse(url)? {
        DatasetUrl::Local { dir, pick } => Ok(local::list_shards(&dir, &every(pick))?
            .into_iter()
            .map(|s| Listed { name: s.name, len: s.len, etag: None })
            .collect()),
        DatasetUrl::S3 { bucket, prefix, pick } => {
            let store = s3.ok_or_else(|| Error::invalid(format!("{url}: no S3 connection")))?;
            Ok(store
                .list_picked(&bucket, &prefix, &every(pick))?
                .into_iter()
                .map(|(name, o)| Listed { name, len: o.size, etag: o.etag })
                .collect())
        }
    }
}

/// TAR shards indexed at a time by default: one a core (at most 16); each is read whole.
fn shard_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).min(16)
}

/// Indexes every shard of `url` with `threads` threads and writes the manifest and sidecars.
/// `threads` None: [`shard_threads`] TAR shards at a time (each read whole: CPU and bandwidth),
/// [`FOOTER_THREADS`] Parquet files (each one small read that waits on the round trip, as when
/// the daemon opens an unindexed dataset). `s3`: the connection for `s3://` URLs (blocking calls
/// enter its runtime).
pub fn index_dataset(
    url: &str,
    threads: Option<usize>,
    s3: Option<&S3Store>,
    progress: &dyn Progress,
) -> Result<IndexSummary> {
    // The manifest is read for every later open of the directory, patterns or not: one written
    // for some of its shards would hide the others from all of them.
    if let pick @ (Pick::Names(_) | Pick::Glob(_)) = DatasetUrl::parse(url)?.pick() {
        let what = match pick {
            Pick::Glob(_) => "a glob",
            Pick::Names(_) if url.contains('{') => "a brace pattern",
            _ => "one of its shards",
        };
        return Err(Error::invalid(format!(
            "{url}: `index` writes one manifest.json for every shard of a directory (or prefix), so it \
             takes the directory, not {what}; trainers then name the files they read (a glob for a split) and \
             the manifest serves those"
        )));
    }
    let (format, listed) = list_with_format(url, s3)?;
    format.check_served(url)?;
    if format == Format::Parquet {
        return index_parquet(url, &listed, threads.unwrap_or(FOOTER_THREADS), s3, progress);
    }
    let threads = threads.unwrap_or_else(shard_threads);
    let shards: Vec<(String, u64)> = listed.into_iter().map(|s| (s.name, s.len)).collect();
    match DatasetUrl::parse(url)? {
        DatasetUrl::Local { dir, .. } => {
            let sidecar_dir = dir.join(SIDECAR_DIR);
            std::fs::create_dir_all(&sidecar_dir).map_err(|e| Error::io("cannot create", &sidecar_dir, e))?;
            let done = crate::parallel::try_map(&shards, threads, |(name, _)| {
                let path = dir.join(name);
                let (len, crc) = local::file_crc32c(&path)?;
                let r = describe(format, &path, name, len, crc, &path.display().to_string(), |sidecar_name, bytes| {
                    let p = sidecar_dir.join(sidecar_name);
                    local::write_atomic(&p, bytes)
                })?;
                progress.shard_done(name, len);
                Ok(r)
            })?;
            let (done, split_keys) = split_apart(done);
            let manifest = assemble(format, done);
            manifest.write_atomic(&dir)?;
            Ok(IndexSummary {
                manifest,
                location: dir.join(MANIFEST_FILE).display().to_string(),
                footer_reads: None,
                partition_keys: Vec::new(),
                split_keys,
            })
        }
        DatasetUrl::S3 { bucket, prefix, .. } => {
            let store = s3.ok_or_else(|| Error::invalid(format!("{url}: no S3 connection")))?;
            let scratch = tempfile_dir()?;
            let done = crate::parallel::try_map(&shards, threads, |(name, len)| {
                let obj = ObjectRef::new(bucket.clone(), format!("{prefix}{name}"), *len);
                let path = scratch.path().join(format!("{}.part", name.replace('/', "_")));
                let file =
                    std::fs::File::create(&path).map_err(|e| Error::io("cannot create scratch file", &path, e))?;
                let crc = store.block_on(store.download(&obj, Arc::new(file), &path, Arc::new(())))?;
                let r = describe(format, &path, name, *len, crc, &obj.url(), |sidecar_name, bytes| {
                    let key = format!("{prefix}{SIDECAR_DIR}/{sidecar_name}");
                    store.block_on(store.put(&bucket, &key, Bytes::copy_from_slice(bytes)))
                });
                let _ = std::fs::remove_file(&path);
                progress.shard_done(name, *len);
                r
            })?;
            let (done, split_keys) = split_apart(done);
            let manifest = assemble(format, done);
            let json = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Internal(e.to_string()))?;
            let key = format!("{prefix}{MANIFEST_FILE}");
            store.block_on(store.put(&bucket, &key, Bytes::from(json)))?;
            Ok(IndexSummary {
                manifest,
                location: format!("s3://{bucket}/{key}"),
                footer_reads: None,
                partition_keys: Vec::new(),
                split_keys,
            })
        }
    }
}

/// Indexes a Parquet dataset from its files' footers alone (see the module doc).
fn index_parquet(
    url: &str,
    listed: &[Listed],
    threads: usize,
    s3: Option<&S3Store>,
    progress: &dyn Progress,
) -> Result<IndexSummary> {
    let counter = ReadCounter::default();
    // A partitioned dataset's keys, checked before any footer is read (and named in the summary).
    let parsed = DatasetUrl::parse(url)?;
    let names: Vec<&str> = listed.iter().map(|s| s.name.as_str()).collect();
    let partitions = crate::format::parquet::partitions::Partitions::of(&names, &parsed.base())?;
    let partition_keys: Vec<String> = partitions.iter().flat_map(|p| p.fields()).map(|f| f.name().clone()).collect();
    match parsed {
        DatasetUrl::Local { dir, .. } => {
            let sidecar_dir = dir.join(SIDECAR_DIR);
            std::fs::create_dir_all(&sidecar_dir).map_err(|e| Error::io("cannot create", &sidecar_dir, e))?;
            let done = crate::parallel::try_map(listed, threads, |s| {
                let file = ShardFile::open(dir.join(&s.name), s.len)?;
                let (table, tail) = read_table_noting_tail(&file.name, s.len, |off, buf| {
                    counter.count(buf.len());
                    file.read_exact_at(buf, off)?;
                    Ok(None)
                })?;
                let (mut entry, fields, sidecar) = describe_parquet(&s.name, s.len, table, None);
                entry.page_checksums = tail.page_crc;
                // Each file's own sidecar too: what a daemon reads when the bundle is stale.
                let sidecar_name = format!("{}.idx", s.name);
                let sidecar_path = sidecar_dir.join(&sidecar_name);
                // A partitioned dataset's sidecars mirror its directories.
                if let Some(parent) = sidecar_path.parent() {
                    std::fs::create_dir_all(parent).map_err(|e| Error::io("cannot create", parent, e))?;
                }
                local::write_atomic(&sidecar_path, &sidecar)?;
                entry.index = Some(format!("{SIDECAR_DIR}/{sidecar_name}"));
                progress.shard_done(&s.name, s.len);
                Ok((entry, fields, sidecar))
            })?;
            let (manifest, bundle) = assemble_parquet(done)?;
            local::write_atomic(&dir.join(footers::NAME), &bundle)?;
            manifest.write_atomic(&dir)?;
            let location = dir.join(MANIFEST_FILE).display().to_string();
            Ok(IndexSummary {
                manifest,
                location,
                footer_reads: Some(counter.total()),
                partition_keys,
                split_keys: Vec::new(),
            })
        }
        DatasetUrl::S3 { bucket, prefix, .. } => {
            let store = s3.ok_or_else(|| Error::invalid(format!("{url}: no S3 connection")))?;
            let done = crate::parallel::try_map(listed, threads, |s| {
                // If-Match on the listed ETag (else on the one the first GET answered): every read
                // is of the version the manifest will name.
                let mut obj = ObjectRef {
                    etag: s.etag.clone(),
                    ..ObjectRef::new(bucket.clone(), format!("{prefix}{}", s.name), s.len)
                };
                let url = obj.url();
                // The first read is the tail (`footer::read_footer`): what it says of the file's
                // row groups' copies is recorded at no extra read (`page_probe`).
                let (table, tail) = read_table_noting_tail(&url, s.len, |off, buf| {
                    let (got, etag, md5) =
                        store.block_on(store.get_range_etag_md5(&obj, off..off + buf.len() as u64))?;
                    counter.count(got.len());
                    buf.copy_from_slice(&got);
                    obj.etag = obj.etag.take().or(etag);
                    Ok(Some(md5))
                })?;
                // No sidecar object per file: a daemon opens an S3 dataset from the bundle, which
                // holds them all (one PUT here, one GET there, where a sidecar each was as many
                // requests as the files' own tail reads).
                let mut r = describe_parquet(&s.name, s.len, table, obj.etag.clone());
                r.0.page_checksums = tail.page_crc;
                r.0.etag_md5 = tail.etag_md5;
                progress.shard_done(&s.name, s.len);
                Ok(r)
            })?;
            let (manifest, bundle) = assemble_parquet(done)?;
            store.block_on(store.put(&bucket, &format!("{prefix}{}", footers::NAME), Bytes::from(bundle)))?;
            let key = format!("{prefix}{MANIFEST_FILE}");
            store.block_on(store.put(&bucket, &key, Bytes::from(manifest.to_json()?)))?;
            Ok(IndexSummary {
                manifest,
                location: format!("s3://{bucket}/{key}"),
                footer_reads: Some(counter.total()),
                partition_keys,
                split_keys: Vec::new(),
            })
        }
    }
}

/// The manifest entry (`crc32c-footer` meaning, no sidecar named), columns and sidecar bytes of a
/// Parquet file.
fn describe_parquet(
    name: &str,
    len: u64,
    table: ParquetTable,
    etag: Option<String>,
) -> (ManifestShard, Vec<String>, Vec<u8>) {
    let crc = table.footer_crc32c();
    // What `ShardMeta::identity` gives the entry back: the daemon uses the sidecar only for it.
    let identity = format!("len={len};footer_crc32c={crc:08x}");
    let table = ShardTable::Parquet(Arc::new(table));
    let sidecar = table.encode_sidecar(identity.as_bytes());
    let entry = entry(name, len, crc, table.num_samples(), None, etag);
    (entry, table.fields().to_vec(), sidecar)
}

/// The manifest of an indexed Parquet dataset, naming its footers bundle, and the bundle.
fn assemble_parquet(done: Vec<(ManifestShard, Vec<String>, Vec<u8>)>) -> Result<(Manifest, Vec<u8>)> {
    let bundle = footers::encode(done.iter().map(|(e, _, sidecar)| (e.name.as_str(), sidecar.as_slice())))
        .map_err(|e| Error::invalid(format!("cannot bundle the footers: {e}")))?;
    let mut manifest = assemble(Format::Parquet, done.into_iter().map(|(e, f, _)| (e, f)).collect())
        .with_checksum(ChecksumScope::Footer);
    manifest.footers = Some(footers::NAME.to_owned());
    Ok((manifest, bundle))
}

/// A scratch directory for downloads, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tempfile_dir() -> Result<Scratch> {
    let base = std::env::var_os("TMPDIR").map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("shardstream-index-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create scratch directory", &dir, e))?;
    Ok(Scratch(dir))
}

/// Indexes the local copy at `path` of shard `name` (`len` bytes, CRC-32C `crc`), stores its
/// sidecar with `put_sidecar(file name, bytes)`, and returns its manifest entry and fields.
fn describe(
    format: Format,
    path: &Path,
    name: &str,
    len: u64,
    crc: u32,
    shown_as: &str,
    put_sidecar: impl FnOnce(&str, &[u8]) -> Result<()>,
) -> Result<Described> {
    let file = ShardFile::open_as(path.to_owned(), len, shown_as.to_owned())?;
    let table = format.index_shard(&file)?;
    let identity = format!("len={len};crc32c={crc:08x}");
    let sidecar_name = format!("{name}.idx");
    put_sidecar(&sidecar_name, &table.encode_sidecar(identity.as_bytes()))?;
    let entry =
        entry(name, len, crc, table.num_samples(), Some(&sidecar_name), None).with_largest(table.largest_sample());
    Ok((entry, table.fields().to_vec(), table.split_keys().cloned()))
}

/// A shard's manifest entry, its fields, and what its scan found of samples apart.
type Described = (ManifestShard, Vec<String>, Option<crate::format::tar::SplitKeys>);

/// A shard with samples apart: its name, its samples, what its scan found.
type SplitShard = (String, u64, crate::format::tar::SplitKeys);

/// The manifest entries and fields of `done`, and its shards with samples apart, in its order.
fn split_apart(done: Vec<Described>) -> (Vec<(ManifestShard, Vec<String>)>, Vec<SplitShard>) {
    let mut split = Vec::new();
    let done = done
        .into_iter()
        .map(|(entry, fields, apart)| {
            if let Some(apart) = apart {
                split.push((entry.name.clone(), entry.samples, apart));
            }
            (entry, fields)
        })
        .collect();
    (done, split)
}

/// A manifest entry whose sidecar, if any, is `sidecar_name` in the dataset's sidecar directory.
fn entry(
    name: &str,
    len: u64,
    crc: u32,
    samples: u64,
    sidecar_name: Option<&str>,
    etag: Option<String>,
) -> ManifestShard {
    ManifestShard {
        name: name.to_owned(),
        bytes: len,
        samples,
        crc32c: format!("{crc:08x}"),
        index: sidecar_name.map(|s| format!("{SIDECAR_DIR}/{s}")),
        max_sample: None,
        max_sample_bytes: None,
        etag,
        page_checksums: None,
        etag_md5: None,
    }
}

fn assemble(format: Format, done: Vec<(ManifestShard, Vec<String>)>) -> Manifest {
    let mut entries = Vec::with_capacity(done.len());
    let mut fields = std::collections::BTreeSet::new();
    for (entry, f) in done {
        fields.extend(f);
        entries.push(entry);
    }
    Manifest::new(format.name(), fields.into_iter().collect(), entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::parquet::{footer, testdata};

    /// Files of megabytes, footers of kilobytes: the index reads one tail per file (two for a
    /// footer larger than the tail), writes a `crc32c-footer` manifest the daemon opens, and a
    /// file whose footer changed afterwards is refused at first use.
    #[test]
    fn parquet_is_indexed_from_footers_alone() {
        let dir = tempfile::tempdir().unwrap();
        let files = [
            ("a.parquet", testdata::mixed_from(0, 8000, 2000, testdata::Codec::None)),
            ("b.parquet", testdata::mixed_from(8000, 8000, 8000, testdata::Codec::None)),
            // A footer past the 64 KiB tail: a second read of exactly the footer.
            ("c.parquet", testdata::wide(400, 2, 40)),
        ];
        for (name, bytes) in &files {
            std::fs::write(dir.path().join(name), bytes).unwrap();
        }
        let total: u64 = files.iter().map(|(_, b)| b.len() as u64).sum();
        assert!(files[0].1.len() > 2 << 20, "{} bytes", files[0].1.len());
        let url = dir.path().display().to_string();
        let summary = index_dataset(&url, Some(2), None, &()).unwrap();
        let reads = summary.footer_reads.unwrap();
        assert_eq!(reads.reads, 4, "{reads:?}");
        let big_footer = {
            let c = &files[2].1;
            u64::from(u32::from_le_bytes(c[c.len() - 8..c.len() - 4].try_into().unwrap()))
        };
        assert!(big_footer > footer::TAIL_READ);
        assert_eq!(reads.bytes, 3 * footer::TAIL_READ + big_footer, "{reads:?}");
        // a and b were read for 64 KiB each, of their megabytes.
        assert!(files[..2].iter().all(|(_, b)| b.len() as u64 > 32 * footer::TAIL_READ), "{total} bytes");

        let m = &summary.manifest;
        assert_eq!(m.checksum_scope(), ChecksumScope::Footer);
        assert_eq!(m.total_samples, 16400);
        for (entry, (_, bytes)) in m.shards.iter().zip(&files) {
            let f = u64::from(u32::from_le_bytes(bytes[bytes.len() - 8..bytes.len() - 4].try_into().unwrap()));
            let tail = &bytes[bytes.len() - f as usize - 8..];
            assert_eq!(entry.crc32c, format!("{:08x}", crc32c::crc32c(tail)), "{}", entry.name);
            assert_eq!(entry.bytes, bytes.len() as u64);
        }

        let ds = crate::index::Dataset::open(&url, None).unwrap();
        assert!(ds.from_manifest);
        assert_eq!(ds.num_samples(), 16400);
        for i in 0..3 {
            ds.shard(i).unwrap();
        }
        // The writer's name in b's footer changed, length and sidecar kept: refused, named.
        let b = dir.path().join("b.parquet");
        let mut bytes = files[1].1.clone();
        let at = bytes.windows(10).rposition(|w| w == b"parquet-rs").unwrap();
        bytes[at] = b'P';
        std::fs::write(&b, bytes).unwrap();
        let ds = crate::index::Dataset::open(&url, None).unwrap();
        ds.shard(0).unwrap();
        let err = ds.shard(1).unwrap_err();
        assert!(matches!(err, Error::Shard { .. }), "{err}");
        assert!(err.to_string().contains("b.parquet") && err.to_string().contains("footer"), "{err}");
    }

    /// Two Parquet files of 3,000 rows in `dir`, indexed: the dataset's URL and the summary.
    fn indexed_pair(dir: &Path) -> (String, IndexSummary) {
        for (name, first) in [("a.parquet", 0), ("b.parquet", 3000)] {
            std::fs::write(dir.join(name), testdata::mixed_from(first, 3000, 1000, testdata::Codec::None)).unwrap();
        }
        let url = dir.display().to_string();
        let summary = index_dataset(&url, Some(2), None, &()).unwrap();
        (url, summary)
    }

    /// The bundle the index writes holds every file's table as the manifest describes it; an
    /// entry for another version of its file is not used, and a damaged bundle gives nothing.
    #[test]
    fn the_footers_bundle_holds_every_table_the_manifest_names() {
        use crate::index::discover::Discovered;
        use crate::index::{Backends, tables::bundled_tables};
        let dir = tempfile::tempdir().unwrap();
        let (url, summary) = indexed_pair(dir.path());
        assert_eq!(summary.manifest.footers.as_deref(), Some(footers::NAME));
        let backends = Backends::local();
        let mut found = Discovered::discover(&url, &backends).unwrap();
        let at = found.footers.clone().unwrap();
        let tables = bundled_tables(&at, &found.shards, &backends);
        assert_eq!(tables.len(), 2);
        for (t, entry) in tables.iter().zip(&summary.manifest.shards) {
            let t = t.as_ref().unwrap();
            assert_eq!(format!("{:08x}", t.footer_crc32c()), entry.crc32c);
            assert_eq!((t.num_rows(), t.file_len()), (3000, entry.bytes));
        }
        // The manifest says b has another footer: its entry is stale.
        found.shards[1].footer_crc32c = found.shards[1].footer_crc32c.map(|c| c ^ 1);
        let tables = bundled_tables(&at, &found.shards, &backends);
        assert!(tables[0].is_some() && tables[1].is_none());
        let crate::storage::ShardSource::Local(path) = &at else { panic!("{at:?}") };
        std::fs::write(path, b"SSPQF\0\r\n not a bundle").unwrap();
        assert!(bundled_tables(&at, &found.shards, &backends).is_empty());
        std::fs::remove_file(path).unwrap();
        assert!(bundled_tables(&at, &found.shards, &backends).is_empty());
        // Opened without it, from each file's sidecar.
        assert_eq!(crate::index::Dataset::open(&url, None).unwrap().num_samples(), 6000);
    }

    /// With the bundle, opening an indexed local dataset reads the manifest and the bundle and no
    /// file (on a parallel file system each open and read is a metadata round trip): a file gone
    /// since is an error when a stream first uses it, as for TAR shards listed by a manifest.
    #[test]
    fn an_indexed_local_dataset_opens_without_touching_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let (url, _) = indexed_pair(dir.path());
        std::fs::remove_file(dir.path().join("b.parquet")).unwrap();
        std::fs::remove_file(dir.path().join(SIDECAR_DIR).join("b.parquet.idx")).unwrap();
        let ds = crate::index::Dataset::open(&url, None).unwrap();
        assert_eq!(ds.num_samples(), 6000);
        ds.shard(0).unwrap();
        let err = ds.shard(1).unwrap_err();
        assert!(matches!(err, Error::NotFound { .. }) && err.to_string().contains("b.parquet"), "{err}");
    }
}
