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

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

use crate::format::Format;
use crate::index::manifest::{MANIFEST_FILE, Manifest, ManifestShard, SIDECAR_DIR};
use crate::storage::DatasetUrl;
use crate::storage::local::{self, ShardFile};
use crate::storage::s3::{ObjectRef, S3Store};
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
}

/// The shards an index run will read: (name, bytes).
pub fn list(url: &str, s3: Option<&S3Store>) -> Result<Vec<(String, u64)>> {
    Ok(list_with_format(url, s3)?.1)
}

/// The dataset's shard format (from the shards' extensions) and its shards.
fn list_with_format(url: &str, s3: Option<&S3Store>) -> Result<(Format, Vec<(String, u64)>)> {
    let shards = list_shards(url, s3)?;
    let format = Format::of_shards(shards.iter().map(|(n, _)| n.as_str()), url)?;
    Ok((format, shards))
}

fn list_shards(url: &str, s3: Option<&S3Store>) -> Result<Vec<(String, u64)>> {
    match DatasetUrl::parse(url)? {
        DatasetUrl::Local { dir, names } => {
            Ok(local::list_shards(&dir, names.as_deref())?.into_iter().map(|s| (s.name, s.len)).collect())
        }
        DatasetUrl::S3 { bucket, prefix, names } => {
            let store = s3.ok_or_else(|| Error::invalid(format!("{url}: no S3 connection")))?;
            let listed = store.block_on(store.list(&bucket, &prefix))?;
            Ok(crate::storage::s3::shards_in_listing(listed, &bucket, &prefix, names.as_deref())?
                .into_iter()
                .map(|(n, o)| (n, o.size))
                .collect())
        }
    }
}

/// Indexes every shard of `url` with `threads` threads and writes the manifest and sidecars.
/// `s3`: the connection for `s3://` URLs (blocking calls enter its runtime).
pub fn index_dataset(url: &str, threads: usize, s3: Option<&S3Store>, progress: &dyn Progress) -> Result<IndexSummary> {
    let (format, shards) = list_with_format(url, s3)?;
    format.check_served(url)?;
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
            let manifest = assemble(format, done);
            manifest.write_atomic(&dir)?;
            Ok(IndexSummary { manifest, location: dir.join(MANIFEST_FILE).display().to_string() })
        }
        DatasetUrl::S3 { bucket, prefix, .. } => {
            let store = s3.ok_or_else(|| Error::invalid(format!("{url}: no S3 connection")))?;
            let scratch = tempfile_dir()?;
            let done = crate::parallel::try_map(&shards, threads, |(name, len)| {
                let obj = ObjectRef { bucket: bucket.clone(), key: format!("{prefix}{name}"), len: *len, etag: None };
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
            let manifest = assemble(format, done);
            let json = serde_json::to_vec_pretty(&manifest).map_err(|e| Error::Internal(e.to_string()))?;
            let key = format!("{prefix}{MANIFEST_FILE}");
            store.block_on(store.put(&bucket, &key, Bytes::from(json)))?;
            Ok(IndexSummary { manifest, location: format!("s3://{bucket}/{key}") })
        }
    }
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
) -> Result<(ManifestShard, Vec<String>)> {
    let file = ShardFile::open_as(path.to_owned(), len, shown_as.to_owned())?;
    let table = format.index_shard(&file)?;
    let identity = format!("len={len};crc32c={crc:08x}");
    let sidecar_name = format!("{name}.idx");
    put_sidecar(&sidecar_name, &table.encode_sidecar(identity.as_bytes()))?;
    let entry = ManifestShard {
        name: name.to_owned(),
        bytes: len,
        samples: table.num_samples(),
        crc32c: format!("{crc:08x}"),
        index: Some(format!("{SIDECAR_DIR}/{sidecar_name}")),
        max_sample: None,
        max_sample_bytes: None,
    }
    .with_largest(table.largest_sample());
    Ok((entry, table.fields().to_vec()))
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
