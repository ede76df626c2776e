//! The bench's "plain client": downloads every `.tar` or `.parquet` object under an S3 prefix with N concurrent
//! ranged GETs straight from aws-sdk-s3, discarding the bytes, and prints
//! `{"bytes": .., "seconds": .., "mb_per_s": .., "requests": ..}`. What the server can deliver
//! to one client, so shardstream's cold epoch is quoted as a share of it.
//!
//! With `WRITE_DIR` it keeps the bytes instead, as any node cache must: each object goes into a
//! file of that directory, written a MiB per `pwrite` off the async workers and fsynced once
//! whole, the way the daemon writes its copies (`storage::s3`), without its CRC, index or
//! trainer. What storing costs on its own, so the cold epoch's gap to the discarding client can
//! be split into storing and the rest (bench/PROFILES.md).
//!
//! Usage: `s3_fetch BUCKET PREFIX [CONCURRENCY] [PART_BYTES] [WRITE_DIR [WRITE_BYTES]]` with
//! `AWS_ENDPOINT_URL` and credentials in the environment; `WRITE_BYTES` (default: the daemon's
//! MiB) is how much is gathered for each write. `WRITE_BYTES` 0 writes around the page cache
//! instead (`O_DIRECT`, as `shardstream pack` writes its shards): each part is copied into an
//! aligned buffer, reused from a pool, and written whole; the object is cut to its length before
//! its fsync. What a node cache that kept its copies out of the page cache would pay.

mod plain_s3;

use anyhow::Context;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Semaphore;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (bucket, prefix) = match (args.get(1), args.get(2)) {
        (Some(b), Some(p)) => (b.clone(), p.clone()),
        _ => anyhow::bail!("usage: s3_fetch BUCKET PREFIX [CONCURRENCY] [PART_BYTES] [WRITE_DIR [WRITE_BYTES]]"),
    };
    let concurrency: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let part: u64 = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(8 << 20);
    let write_dir = args.get(5).map(PathBuf::from);
    let write_bytes: usize = args.get(6).map(|s| s.parse()).transpose()?.unwrap_or(WRITE_CHUNK);
    let direct = write_bytes == 0;
    anyhow::ensure!(
        !direct || part.is_multiple_of(ALIGN as u64),
        "direct writes need PART_BYTES a multiple of {ALIGN}"
    );
    let pool = Arc::new(Pool::default());
    let client = plain_s3::client().await;

    let mut objects = Vec::new();
    let mut token = None;
    loop {
        let page =
            client.list_objects_v2().bucket(&bucket).prefix(&prefix).set_continuation_token(token).send().await?;
        for o in page.contents() {
            if let (Some(k), Some(s)) = (o.key(), o.size())
                && (k.ends_with(".tar") || k.ends_with(".parquet"))
            {
                objects.push((k.to_owned(), s as u64));
            }
        }
        token = page.next_continuation_token().map(str::to_owned);
        if token.is_none() {
            break;
        }
    }
    let started = Instant::now();
    let limit = Arc::new(Semaphore::new(concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for (key, size) in objects {
        // Opened inside the timed run, as the daemon opens its copies inside its epoch.
        let file = match &write_dir {
            Some(dir) => {
                let path = dir.join(key.replace('/', "_"));
                let mut open = File::options();
                open.write(true).create(true).truncate(true);
                if direct {
                    open.custom_flags(libc::O_DIRECT);
                }
                let file = open.open(&path).with_context(|| format!("cannot create {}", path.display()))?;
                Some((Arc::new(file), Arc::new(path)))
            }
            None => None,
        };
        let (total_parts, written) = (size.div_ceil(part), Arc::new(AtomicU64::new(0)));
        let mut at = 0;
        while at < size {
            let end = (at + part).min(size);
            let (client, bucket, key, limit) = (client.clone(), bucket.clone(), key.clone(), limit.clone());
            let (file, written, pool) = (file.clone(), written.clone(), pool.clone());
            tasks.spawn(async move {
                let _slot = limit.acquire_owned().await?;
                let resp =
                    client.get_object().bucket(bucket).key(key).range(format!("bytes={at}-{}", end - 1)).send().await?;
                let mut body = resp.body;
                let mut n = 0u64;
                let mut pending: Vec<bytes::Bytes> = Vec::new();
                let mut pending_len = 0usize;
                let mut stage = if direct && file.is_some() { Some(pool.take((end - at) as usize)) } else { None };
                while let Some(chunk) = body.try_next().await? {
                    if let Some(stage) = &mut stage {
                        stage.put(n as usize, &chunk)?;
                        n += chunk.len() as u64;
                        continue;
                    }
                    n += chunk.len() as u64;
                    if let Some(dest) = &file {
                        pending_len += chunk.len();
                        pending.push(chunk);
                        if pending_len >= write_bytes {
                            let pos = at + n - pending_len as u64;
                            write_at(dest, std::mem::take(&mut pending), pos).await?;
                            pending_len = 0;
                        }
                    }
                }
                if let Some(dest) = &file {
                    match stage {
                        Some(stage) => write_stage(dest, stage, n as usize, at, pool.clone()).await?,
                        None => write_at(dest, pending, at + n - pending_len as u64).await?,
                    }
                    // The object is whole once every part is written: the last part to finish
                    // fsyncs it, as the daemon does before it publishes a copy.
                    if written.fetch_add(1, Ordering::AcqRel) + 1 == total_parts {
                        let (f, path) = dest.clone();
                        tokio::task::spawn_blocking(move || {
                            // Direct writes padded the last part to a whole block.
                            f.set_len(size).with_context(|| format!("cannot cut {}", path.display()))?;
                            f.sync_all().with_context(|| format!("cannot fsync {}", path.display()))
                        })
                        .await??;
                    }
                }
                anyhow::Ok(n)
            });
            at = end;
        }
    }
    let (mut bytes, mut requests) = (0u64, 0u64);
    while let Some(r) = tasks.join_next().await {
        bytes += r??;
        requests += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({"bytes": bytes, "seconds": seconds, "mb_per_s": bytes as f64 / 1e6 / seconds, "requests": requests})
    );
    Ok(())
}

/// The daemon's write size (`storage::s3::WRITE_CHUNK`).
const WRITE_CHUNK: usize = 1 << 20;

/// Writes `chunks` back to back at `pos` of `dest` (the file and its path), off the async
/// workers as the daemon does.
async fn write_at(dest: &(Arc<File>, Arc<PathBuf>), chunks: Vec<bytes::Bytes>, mut pos: u64) -> anyhow::Result<()> {
    let (file, path) = dest.clone();
    tokio::task::spawn_blocking(move || {
        for c in &chunks {
            file.write_all_at(c, pos).with_context(|| format!("cannot write {} at {pos}", path.display()))?;
            pos += c.len() as u64;
        }
        anyhow::Ok(())
    })
    .await?
}

/// Alignment of direct writes (buffer, offset and length), as `shardstream pack` uses.
const ALIGN: usize = 4096;

/// A buffer whose `raw[at..]` is aligned to [`ALIGN`].
struct Stage {
    raw: Vec<u8>,
    at: usize,
}

impl Stage {
    fn put(&mut self, offset: usize, bytes: &[u8]) -> anyhow::Result<()> {
        let dst = self.raw.get_mut(self.at + offset..self.at + offset + bytes.len());
        dst.context("the server sent more than the range asked for")?.copy_from_slice(bytes);
        Ok(())
    }
}

/// Stages reused across parts, so that their memory is touched once.
#[derive(Default)]
struct Pool(Mutex<Vec<Stage>>);

impl Pool {
    /// A stage of at least `len` bytes rounded up to [`ALIGN`].
    fn take(&self, len: usize) -> Stage {
        let want = len.next_multiple_of(ALIGN);
        let reused = self.0.lock().ok().and_then(|mut p| p.pop());
        match reused {
            Some(s) if s.raw.len() - s.at >= want => s,
            _ => {
                let raw = vec![0u8; want + ALIGN];
                let at = raw.as_ptr().align_offset(ALIGN);
                Stage { raw, at }
            }
        }
    }

    fn give_back(&self, s: Stage) {
        if let Ok(mut p) = self.0.lock() {
            p.push(s);
        }
    }
}

/// Writes the first `len` bytes of `stage` (padded with zeros to a whole block) at `pos`, around
/// the page cache, and returns the stage to `pool`.
async fn write_stage(
    dest: &(Arc<File>, Arc<PathBuf>),
    mut stage: Stage,
    len: usize,
    pos: u64,
    pool: Arc<Pool>,
) -> anyhow::Result<()> {
    let (file, path) = dest.clone();
    tokio::task::spawn_blocking(move || {
        let padded = len.next_multiple_of(ALIGN);
        let at = stage.at;
        stage.raw[at + len..at + padded].fill(0);
        let r = file
            .write_all_at(&stage.raw[at..at + padded], pos)
            .with_context(|| format!("cannot write {} at {pos} directly", path.display()));
        pool.give_back(stage);
        r
    })
    .await?
}
