//! The S3 sink: `shardstream pack SRC --output s3://bucket/prefix/`. It owns getting each
//! completed shard from the local scratch directory into the bucket while packing goes on, and
//! the bucket-side end of a pack (stale shards removed, journal, manifest last), so that the
//! prefix ends up holding exactly what a local pack leaves in its directory and the daemon opens
//! it with one manifest GET, as after `shardstream index s3://...`.
//!
//! ```text
//!  writer ──► scratch/.shard-000007.tar.tmp ──► put_shard ──► upload task (store's runtime)
//!                                                  │           PUT, or multipart: parts read
//!                                                  │           with positioned reads, in parallel
//!                                                  ▼           then the sidecar PUT, then the
//!                                   waits while more than       scratch file is deleted
//!                                   SHARD_UPLOADS are in flight
//! ```
//!
//! Bounds: at most [`SHARD_UPLOADS`] shards uploading (plus the one being written and the one in
//! the channel, so ~4 shards of scratch space), and [`BUFFERS_IN_FLIGHT`] part buffers across
//! all of them, so memory is `BUFFERS_IN_FLIGHT x part size` (256 MiB by default; a shard below
//! the multipart threshold is one buffer), never a whole shard. Uploads finish in any order but
//! are reported durable oldest first, so the journal only ever lists a prefix of shards that are
//! in the bucket. `publish` and `put_manifest` run after [`Sink::flush`]: nothing is reported
//! done before every upload is.
//!
//! Each object appears whole or not at all (a PUT and a completed multipart upload are atomic in
//! S3), so `has_shard` is a HEAD and a size comparison. A failed multipart upload is aborted; a
//! killed pack's unfinished ones are aborted by the next run on the same machine, which finds them
//! in the pack's [`UploadLedger`]; a bucket lifecycle rule (AbortIncompleteMultipartUpload)
//! reclaims those of a pack never run again there.

use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::journal::{JOURNAL_FILE, ShardRecord};
use super::sink::{Sink, is_ours};
use super::writer::FinishedShard;
use crate::format::sidecar;
use crate::index::manifest::{MANIFEST_FILE, Manifest, SIDECAR_DIR};
use crate::storage::s3::S3Store;
use crate::storage::s3_write::{UploadLedger, UploadOptions};
use crate::{Error, Result};

/// Scratch directory for shards awaiting upload, inside the pack's local state directory.
pub const SCRATCH_DIR: &str = "scratch";

/// The file, beside [`SCRATCH_DIR`], of the multipart uploads the pack started
/// ([`UploadLedger`]).
pub const UPLOAD_LEDGER: &str = "multipart-uploads.jsonl";

/// S3 rejects parts smaller than 5 MiB (all but the last) when the upload completes.
pub const MIN_PART_SIZE: u64 = 5 << 20;

/// S3's largest single PUT.
pub const MAX_PUT_SIZE: u64 = 5 << 30;

/// Bytes per part of a multipart upload: at ~80 MB/s per S3 connection a 16 MiB part takes
/// ~200 ms, so the ~20 ms per request stay near 10%, and a 1 GiB shard spreads over 64 parts.
pub const DEFAULT_PART_SIZE: u64 = 16 << 20;

/// Shards up to this size go up as one PUT: a shard that fits in one part gains nothing from a
/// multipart upload but two extra requests.
pub const DEFAULT_MULTIPART_THRESHOLD: u64 = DEFAULT_PART_SIZE;

/// Part buffers in flight across all uploads: 16 x ~80 MB/s per connection uploads faster than a
/// pack reads small files, and 16 x 16 MiB = 256 MiB bounds the memory.
pub const BUFFERS_IN_FLIGHT: usize = 16;

/// Shards uploading at once; handed one more, `put_shard` waits for the oldest to finish. Two keep
/// the network busy across the tail of one upload (its last parts, the sidecar) while bounding the
/// scratch space.
pub const SHARD_UPLOADS: usize = 2;

impl Default for UploadOptions {
    fn default() -> Self {
        Self { multipart_threshold: DEFAULT_MULTIPART_THRESHOLD, part_size: DEFAULT_PART_SIZE }
    }
}

/// What every upload task needs.
struct Target {
    store: S3Store,
    bucket: String,
    /// Empty or ending with `/`.
    prefix: String,
    upload: UploadOptions,
    buffers: Arc<Semaphore>,
    ledger: UploadLedger,
}

impl Target {
    fn key(&self, rel: &str) -> String {
        format!("{}{rel}", self.prefix)
    }

    fn url(&self, rel: &str) -> String {
        format!("s3://{}/{}{rel}", self.bucket, self.prefix)
    }

    /// Uploads a shard, then its sidecar, then deletes its scratch file.
    async fn upload_shard(&self, job: Job) -> Result<()> {
        let key = self.key(&job.name);
        let ledger = Some(&self.ledger);
        self.store.upload_file(&self.bucket, &key, &job.scratch, job.len, self.upload, &self.buffers, ledger).await?;
        if let Some(bytes) = job.sidecar {
            let key = self.key(&sidecar_rel(&job.name));
            self.store.put(&self.bucket, &key, bytes).await?;
        }
        match tokio::fs::remove_file(&job.scratch).await {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io("cannot remove", &job.scratch, e)),
            _ => Ok(()),
        }
    }
}

/// One shard to upload.
struct Job {
    name: String,
    scratch: PathBuf,
    len: u64,
    sidecar: Option<Bytes>,
}

fn sidecar_rel(name: &str) -> String {
    format!("{SIDECAR_DIR}/{name}.idx")
}

/// The objects among `present` (names relative to the prefix) that are shards named like ours
/// (`<prefix>-NNNNNN.<ext>`) or their sidecars, but not among `names`: left from an earlier run.
fn stale<'a>(present: impl IntoIterator<Item = &'a str>, names: &[String], prefix: &str, ext: &str) -> Vec<&'a str> {
    let keep: HashSet<&str> = names.iter().map(String::as_str).collect();
    let idx_ext = format!("{ext}.idx");
    let sidecar_dir = format!("{SIDECAR_DIR}/");
    present
        .into_iter()
        .filter(|rel| {
            let (name, ext) = match rel.strip_prefix(sidecar_dir.as_str()) {
                Some(idx) => (idx, idx_ext.as_str()),
                None if !rel.contains('/') => (*rel, ext),
                None => return false,
            };
            is_ours(name, prefix, ext) && !keep.contains(name.strip_suffix(".idx").unwrap_or(name))
        })
        .collect()
}

/// An S3 prefix as a pack destination.
pub struct S3Sink {
    target: Arc<Target>,
    scratch: PathBuf,
    /// The local journal, uploaded next to the shards by `publish`.
    journal: PathBuf,
    /// Uploads in flight, oldest first.
    uploads: Mutex<VecDeque<JoinHandle<Result<()>>>>,
}

impl S3Sink {
    /// A sink writing under `s3://bucket/prefix` (prefix empty or ending with `/`), with shards
    /// staged in `scratch` (created; leftovers of a killed pack are removed) and the journal at
    /// `journal`.
    pub fn open(
        store: S3Store,
        bucket: String,
        prefix: String,
        scratch: &Path,
        journal: &Path,
        upload: UploadOptions,
    ) -> Result<Self> {
        match std::fs::remove_dir_all(scratch) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io("cannot clear scratch directory", scratch, e));
            }
            _ => {}
        }
        std::fs::create_dir_all(scratch).map_err(|e| Error::io("cannot create scratch directory", scratch, e))?;
        let buffers = Arc::new(Semaphore::new(BUFFERS_IN_FLIGHT));
        // Beside the scratch directory, in the pack's local state: a killed run's unfinished
        // uploads are aborted by the next run here.
        let ledger_path = scratch.with_file_name(UPLOAD_LEDGER);
        let (ledger, aborted) = store.block_on(UploadLedger::open(&store, &ledger_path))?;
        if aborted > 0 {
            tracing::info!(aborted, "aborted the unfinished multipart uploads of an interrupted pack");
        }
        Ok(Self {
            target: Arc::new(Target { store, bucket, prefix, upload, buffers, ledger }),
            scratch: scratch.to_owned(),
            journal: journal.to_owned(),
            uploads: Mutex::new(VecDeque::new()),
        })
    }

    fn store(&self) -> &S3Store {
        &self.target.store
    }

    /// Collects finished uploads from the front of the queue, and waits for the oldest while more
    /// than `keep` are in flight. Returns how many completed. After a failure, waits for the
    /// others to end (each aborts its own multipart upload if it fails) and returns the failure.
    fn reap(&self, keep: usize) -> Result<usize> {
        let mut queue = self.uploads.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = 0;
        while queue.len() > keep || queue.front().is_some_and(JoinHandle::is_finished) {
            let Some(task) = queue.pop_front() else { break };
            let result = self
                .store()
                .block_on(task)
                .unwrap_or_else(|e| Err(Error::Internal(format!("a shard upload task failed: {e}"))));
            if let Err(e) = result {
                for other in queue.drain(..) {
                    let _ = self.store().block_on(other);
                }
                return Err(e);
            }
            done += 1;
        }
        Ok(done)
    }
}

impl Drop for S3Sink {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

impl Sink for S3Sink {
    fn rereads_scratch(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        self.target.url("")
    }

    fn scratch_path(&self, name: &str) -> PathBuf {
        crate::atomic_write::temp_path(&self.scratch.join(name))
    }

    fn put_shard(&self, shard: FinishedShard) -> Result<usize> {
        // The writer's handle is write-only (the upload opens its own) and its bytes are in the
        // page cache: no fsync, the scratch copy need not survive a crash.
        let sidecar = shard.tar_index.as_ref().map(|ix| Bytes::from(sidecar::encode(shard.identity().as_bytes(), ix)));
        let job = Job { name: shard.name, scratch: shard.scratch, len: shard.bytes, sidecar };
        let target = self.target.clone();
        let task = self.store().spawn(async move { target.upload_shard(job).await });
        self.uploads.lock().unwrap_or_else(|p| p.into_inner()).push_back(task);
        self.reap(SHARD_UPLOADS)
    }

    fn flush(&self) -> Result<usize> {
        self.reap(0)
    }

    fn has_shard(&self, rec: &ShardRecord, sidecar: bool) -> bool {
        let t = &self.target;
        let size = |rel: &str| t.store.block_on(t.store.object_size(&t.bucket, &t.key(rel))).ok().flatten();
        size(&rec.name) == Some(rec.bytes) && (!sidecar || size(&sidecar_rel(&rec.name)).is_some())
    }

    fn put_file(&self, rel: &str, bytes: &[u8]) -> Result<()> {
        let t = &self.target;
        t.store.block_on(t.store.put(&t.bucket, &t.key(rel), Bytes::copy_from_slice(bytes)))
    }

    fn share_journal(&self, journal: &Path) -> Result<()> {
        let bytes = std::fs::read(journal).map_err(|e| Error::io("cannot read pack journal", journal, e))?;
        self.put_file(&format!("{SIDECAR_DIR}/{JOURNAL_FILE}"), &bytes)
    }

    fn publish(&self, names: &[String], prefix: &str, ext: &str) -> Result<()> {
        self.flush()?;
        let t = &self.target;
        let listed = t.store.block_on(t.store.list(&t.bucket, &t.prefix))?;
        let present: HashSet<&str> = listed.iter().filter_map(|o| o.key.strip_prefix(t.prefix.as_str())).collect();
        if let Some(missing) = names.iter().find(|n| !present.contains(n.as_str())) {
            return Err(Error::NotFound { what: "uploaded shard", path: t.url(missing) });
        }
        for rel in stale(present, names, prefix, ext) {
            t.store.block_on(t.store.delete(&t.bucket, &t.key(rel)))?;
        }
        let journal =
            std::fs::read(&self.journal).map_err(|e| Error::io("cannot read pack journal", &self.journal, e))?;
        self.put_file(&format!("{SIDECAR_DIR}/{JOURNAL_FILE}"), &journal)
    }

    fn put_manifest(&self, manifest: &Manifest) -> Result<()> {
        self.flush()?;
        self.put_file(MANIFEST_FILE, &manifest.to_json()?)
    }

    fn read_published(&self, name: &str, len: u64, offset: u64, buf: &mut [u8]) -> Result<()> {
        let t = &self.target;
        let obj = crate::storage::s3::ObjectRef::new(t.bucket.clone(), t.key(name), len);
        let (got, _) = t.store.block_on(t.store.get_range(&obj, offset..offset + buf.len() as u64))?;
        buf.copy_from_slice(&got);
        Ok(())
    }

    fn remove_manifest(&self) -> Result<()> {
        let t = &self.target;
        let key = t.key(MANIFEST_FILE);
        // Looked up first: some S3-compatible stores answer a DELETE of a missing key with an error.
        if t.store.block_on(t.store.object_size(&t.bucket, &key))?.is_some() {
            t.store.block_on(t.store.delete(&t.bucket, &key))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_objects_are_ours_and_not_kept() {
        let present = [
            "shard-000000.tar",
            "shard-000001.tar",
            "shard-000002.tar",
            "_shardstream/shard-000001.tar.idx",
            "_shardstream/shard-000002.tar.idx",
            "_shardstream/pack-journal.jsonl",
            "train-000009.tar",
            "shard-000003.parquet",
            "manifest.json",
            "sub/shard-000004.tar",
        ];
        let names = vec!["shard-000000.tar".to_string(), "shard-000001.tar".to_string()];
        let mut got = stale(present, &names, "shard", "tar");
        got.sort();
        assert_eq!(got, ["_shardstream/shard-000002.tar.idx", "shard-000002.tar"]);
    }
}
