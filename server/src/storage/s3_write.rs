//! Writing to S3 from a local file: the requests `shardstream pack` needs to put shards into a
//! bucket (HEAD for size, single PUT or multipart upload, DELETE). Kept apart from [`super::s3`],
//! which owns the connection, the retry loop and the one mapping of SDK errors, so that the read
//! path the daemon depends on stays small; every request here goes through the same
//! [`S3Store::retrying`] policy and [`classify`].
//!
//! A file is never held in memory whole: a small one (up to the multipart threshold) is one PUT
//! from one buffer, a large one is uploaded in parts, each read from the file with a positioned
//! read just before it is sent. The caller's semaphore bounds the buffers in flight across every
//! upload it runs, so memory is `permits x part size` whatever the number of files. A multipart
//! upload that fails is aborted, so the server drops the parts it holds.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::s3::{Failure, S3Store, classify};
use crate::{Error, Result};

/// S3 accepts at most 10,000 parts per upload; larger files get larger parts.
const MAX_PARTS: u64 = 10_000;

/// How a file is uploaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UploadOptions {
    /// Files larger than this go up as multipart uploads; smaller ones as one PUT.
    pub multipart_threshold: u64,
    /// Bytes per part (S3 requires at least 5 MiB for every part but the last).
    pub part_size: u64,
}

fn closed() -> Error {
    Error::Internal("upload semaphore closed".into())
}

/// Reads `len` bytes at `offset` of `file` off the async workers.
async fn read_at(file: &Arc<File>, path: &Path, offset: u64, len: u64) -> Result<Bytes> {
    let (f, p) = (file.clone(), path.to_owned());
    let n = usize::try_from(len).map_err(|_| Error::Internal(format!("part of {len} bytes")))?;
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; n];
        f.read_exact_at(&mut buf, offset).map(|()| Bytes::from(buf)).map_err(|e| Error::io("cannot read", &p, e))
    })
    .await
    .map_err(|e| Error::Internal(format!("read task failed: {e}")))?
}

impl S3Store {
    /// The size of an object; `Ok(None)` when it does not exist.
    pub async fn object_size(&self, bucket: &str, key: &str) -> Result<Option<u64>> {
        let url = format!("s3://{bucket}/{key}");
        let got = self
            .retrying(&url, "head", || async {
                let head =
                    self.client.head_object().bucket(bucket).key(key).send().await.map_err(|e| classify(&url, e))?;
                Ok(head.content_length().and_then(|n| u64::try_from(n).ok()).unwrap_or(0))
            })
            .await;
        match got {
            Ok(n) => Ok(Some(n)),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Deletes an object (one that does not exist is not an error).
    pub async fn delete(&self, bucket: &str, key: &str) -> Result<()> {
        let url = format!("s3://{bucket}/{key}");
        let done = self
            .retrying(&url, "delete", || async {
                self.client
                    .delete_object()
                    .bucket(bucket)
                    .key(key)
                    .send()
                    .await
                    .map(drop)
                    .map_err(|e| classify(&url, e))
            })
            .await;
        match done {
            Err(Error::NotFound { .. }) => Ok(()),
            other => other,
        }
    }

    /// Uploads the first `len` bytes of the file at `path` as `bucket/key`: one PUT up to the
    /// multipart threshold, else a multipart upload with parts in parallel. Each buffer read from
    /// the file holds a permit of `buffers` until its request is done.
    /// A multipart upload is noted in `ledger` once started.
    #[allow(clippy::too_many_arguments)]
    pub async fn upload_file(
        &self,
        bucket: &str,
        key: &str,
        path: &Path,
        len: u64,
        opts: UploadOptions,
        buffers: &Arc<Semaphore>,
        ledger: Option<&UploadLedger>,
    ) -> Result<()> {
        let file = tokio::fs::File::open(path).await.map_err(|e| Error::io("cannot open", path, e))?;
        let file = Arc::new(file.into_std().await);
        if len <= opts.multipart_threshold {
            let _permit = buffers.clone().acquire_owned().await.map_err(|_| closed())?;
            let body = read_at(&file, path, 0, len).await?;
            return self.put(bucket, key, body).await;
        }
        let url = format!("s3://{bucket}/{key}");
        let upload_id = self
            .retrying(&url, "create multipart upload", || async {
                let out = self
                    .client
                    .create_multipart_upload()
                    .bucket(bucket)
                    .key(key)
                    .send()
                    .await
                    .map_err(|e| classify(&url, e))?;
                out.upload_id().map(str::to_owned).ok_or_else(|| {
                    Failure::Permanent(Error::Unavailable(format!("{url}: multipart upload started without an id")))
                })
            })
            .await?;
        let part_size = opts.part_size.max(len.div_ceil(MAX_PARTS)).max(1);
        let upload =
            Upload { bucket: bucket.to_owned(), key: key.to_owned(), url, upload_id, file, path: path.to_owned() };
        if let Some(ledger) = ledger
            && let Err(e) = ledger.started(&upload)
        {
            self.abort(&upload).await;
            return Err(e);
        }
        let result = match self.upload_parts(&upload, len, part_size, buffers).await {
            Ok(parts) => self.complete(&upload, parts).await,
            Err(e) => Err(e),
        };
        if result.is_err() {
            self.abort(&upload).await;
        }
        // Best effort: an end not noted is one abort that finds nothing, next time.
        if let Some(Err(e)) = ledger.map(|l| l.ended(&upload)) {
            tracing::warn!(object = %upload.url, error = %e, "cannot note the end of a multipart upload");
        }
        result
    }

    /// Sends every part, at most as many at once as `buffers` has permits; returns them in order.
    async fn upload_parts(
        &self,
        up: &Upload,
        len: u64,
        part_size: u64,
        buffers: &Arc<Semaphore>,
    ) -> Result<Vec<CompletedPart>> {
        let count = len.div_ceil(part_size);
        let mut done: Vec<Option<CompletedPart>> = vec![None; count as usize];
        let mut tasks = tokio::task::JoinSet::new();
        let mut collect =
            |joined: std::result::Result<Result<(usize, CompletedPart)>, tokio::task::JoinError>| match joined {
                Ok(Ok((i, part))) => {
                    done[i] = Some(part);
                    Ok(())
                }
                Ok(Err(e)) => Err(e),
                Err(e) => Err(Error::Internal(format!("upload task of {} failed: {e}", up.url))),
            };
        for i in 0..count {
            let permit = buffers.clone().acquire_owned().await.map_err(|_| closed())?;
            // Surface a failed part before reading more of the file.
            while let Some(joined) = tasks.try_join_next() {
                collect(joined)?;
            }
            let offset = i * part_size;
            let part_len = part_size.min(len - offset);
            let (store, up) = (self.clone(), up.clone());
            tasks.spawn(async move {
                let part = store.upload_part(&up, i as i32 + 1, offset, part_len, permit).await?;
                Ok((i as usize, part))
            });
        }
        // An early return drops the set, which cancels the parts still running.
        while let Some(joined) = tasks.join_next().await {
            collect(joined)?;
        }
        done.into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::Internal(format!("{}: a part went missing", up.url)))
    }

    async fn upload_part(
        &self,
        up: &Upload,
        number: i32,
        offset: u64,
        len: u64,
        _permit: OwnedSemaphorePermit,
    ) -> Result<CompletedPart> {
        let body = read_at(&up.file, &up.path, offset, len).await?;
        let url = &up.url;
        let etag = self
            .retrying(url, "upload part", || async {
                let out = self
                    .client
                    .upload_part()
                    .bucket(&up.bucket)
                    .key(&up.key)
                    .upload_id(&up.upload_id)
                    .part_number(number)
                    .body(ByteStream::from(body.clone()))
                    .send()
                    .await
                    .map_err(|e| classify(url, e))?;
                out.e_tag().map(str::to_owned).ok_or_else(|| {
                    Failure::Permanent(Error::Unavailable(format!("{url}: part {number} was stored without an ETag")))
                })
            })
            .await?;
        Ok(CompletedPart::builder().part_number(number).e_tag(etag).build())
    }

    async fn complete(&self, up: &Upload, parts: Vec<CompletedPart>) -> Result<()> {
        let done = CompletedMultipartUpload::builder().set_parts(Some(parts)).build();
        self.retrying(&up.url, "complete multipart upload", || async {
            self.client
                .complete_multipart_upload()
                .bucket(&up.bucket)
                .key(&up.key)
                .upload_id(&up.upload_id)
                .multipart_upload(done.clone())
                .send()
                .await
                .map(drop)
                .map_err(|e| classify(&up.url, e))
        })
        .await
    }

    /// Asks the server to drop the parts of a failed upload. Best effort: the upload already
    /// failed, and that error is the one to report; a lifecycle rule
    /// (AbortIncompleteMultipartUpload) catches what this cannot.
    async fn abort(&self, up: &Upload) {
        if let Err(e) = self.abort_upload(&up.bucket, &up.key, &up.upload_id).await {
            tracing::warn!(object = %up.url, error = %e, "cannot abort the failed multipart upload");
        }
    }

    /// AbortMultipartUpload, retried as every request is; an upload that is no more (completed,
    /// or aborted already) is `Error::NotFound` (NoSuchUpload).
    async fn abort_upload(&self, bucket: &str, key: &str, upload_id: &str) -> Result<()> {
        let url = format!("s3://{bucket}/{key}");
        self.retrying(&url, "abort multipart upload", || async {
            self.client
                .abort_multipart_upload()
                .bucket(bucket)
                .key(key)
                .upload_id(upload_id)
                .send()
                .await
                .map(drop)
                .map_err(|e| classify(&url, e))
        })
        .await
    }
}

/// The multipart uploads a process started, a JSON line each in a local file, so that the next
/// process to open the file (a pack resumed on the same machine) aborts those a kill left
/// unfinished: their parts stay in the bucket, which object listings do not show and the store
/// bills for, until an abort or a lifecycle rule (AbortIncompleteMultipartUpload) drops them.
pub struct UploadLedger {
    path: PathBuf,
    file: std::sync::Mutex<File>,
}

/// A line of an [`UploadLedger`].
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
enum Noted {
    Started {
        bucket: String,
        key: String,
        upload_id: String,
    },
    /// Completed or aborted: nothing left to abort.
    Ended {
        ended: String,
    },
}

impl UploadLedger {
    /// Opens the ledger at `path`: first aborts every upload an earlier process noted there as
    /// started and not as ended, then starts it empty. Returns it and how many uploads were
    /// aborted. Cleaning up is best effort: an abort that fails is logged and left to a
    /// lifecycle rule, and a line that does not parse (a kill mid-write) is passed over.
    pub async fn open(store: &S3Store, path: &Path) -> Result<(Self, usize)> {
        let mut aborted = 0;
        match std::fs::read_to_string(path) {
            Ok(text) => {
                let mut unfinished = Vec::new();
                for noted in text.lines().filter_map(|l| serde_json::from_str::<Noted>(l).ok()) {
                    match noted {
                        Noted::Started { bucket, key, upload_id } => unfinished.push((bucket, key, upload_id)),
                        Noted::Ended { ended } => unfinished.retain(|(_, _, id)| *id != ended),
                    }
                }
                for (bucket, key, upload_id) in unfinished {
                    let url = format!("s3://{bucket}/{key}");
                    let done = store.abort_upload(&bucket, &key, &upload_id).await;
                    match done {
                        Ok(()) => aborted += 1,
                        // NoSuchUpload: it ended after all (the note of its end was not written).
                        Err(Error::NotFound { .. }) => {}
                        Err(e) => tracing::warn!(
                            object = %url, upload_id, error = %e,
                            "cannot abort an interrupted run's multipart upload (a lifecycle rule, \
                             AbortIncompleteMultipartUpload, drops its parts)"
                        ),
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("cannot read", path, e)),
        }
        let file = File::create(path).map_err(|e| Error::io("cannot create", path, e))?;
        Ok((Self { path: path.to_owned(), file: std::sync::Mutex::new(file) }, aborted))
    }

    /// Notes a started upload, before its first part is sent.
    fn started(&self, up: &Upload) -> Result<()> {
        self.note(&Noted::Started { bucket: up.bucket.clone(), key: up.key.clone(), upload_id: up.upload_id.clone() })
    }

    /// Notes an upload completed or aborted.
    fn ended(&self, up: &Upload) -> Result<()> {
        self.note(&Noted::Ended { ended: up.upload_id.clone() })
    }

    fn note(&self, noted: &Noted) -> Result<()> {
        use std::io::Write;
        let line = serde_json::to_string(noted).map_err(|e| Error::Internal(format!("upload ledger line: {e}")))?;
        let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
        // One write a line: a kill leaves whole lines and at most one torn last line.
        file.write_all(format!("{line}\n").as_bytes()).map_err(|e| Error::io("cannot write", &self.path, e))
    }
}

/// One multipart upload in progress.
#[derive(Debug, Clone)]
struct Upload {
    bucket: String,
    key: String,
    url: String,
    upload_id: String,
    file: Arc<File>,
    path: PathBuf,
}
