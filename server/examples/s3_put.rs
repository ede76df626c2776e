//! The pack bench's "plain client" for uploads: PUTs the bytes of every `.tar` file in a local
//! directory to an S3 prefix, cut into objects of PART_BYTES with N PUTs in flight (the request
//! size and concurrency `shardstream pack` uses for its multipart uploads), straight from
//! aws-sdk-s3, deletes them again, and prints
//! `{"bytes": .., "seconds": .., "mb_per_s": .., "requests": ..}`: what the server accepts from one
//! client, so pack-to-S3 is quoted as a share of it.
//!
//! Usage: `s3_put DIR BUCKET PREFIX [CONCURRENCY] [PART_BYTES]` with `AWS_ENDPOINT_URL` and
//! credentials in the environment.

mod plain_s3;

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

use aws_sdk_s3::primitives::ByteStream;
use tokio::sync::Semaphore;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (dir, bucket, prefix) = match (args.get(1), args.get(2), args.get(3)) {
        (Some(d), Some(b), Some(p)) => (d.clone(), b.clone(), p.clone()),
        _ => anyhow::bail!("usage: s3_put DIR BUCKET PREFIX [CONCURRENCY] [PART_BYTES]"),
    };
    let concurrency: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(16);
    let part: u64 = args.get(5).map(|s| s.parse()).transpose()?.unwrap_or(16 << 20);
    let client = plain_s3::client().await;

    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "tar") {
            files.push(path);
        }
    }
    files.sort();
    let started = Instant::now();
    let limit = Arc::new(Semaphore::new(concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    let mut keys = Vec::new();
    for path in files {
        let file = Arc::new(std::fs::File::open(&path)?);
        let size = file.metadata()?.len();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("shard").to_owned();
        let mut at = 0;
        while at < size {
            let len = part.min(size - at);
            let key = format!("{prefix}{name}.{at}");
            keys.push(key.clone());
            // Taken before reading, as pack does, so buffers in flight stay bounded.
            let slot = limit.clone().acquire_owned().await?;
            let (client, bucket, file) = (client.clone(), bucket.clone(), file.clone());
            tasks.spawn(async move {
                let _slot = slot;
                let body = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0u8; len as usize];
                    file.read_exact_at(&mut buf, at).map(|()| buf)
                })
                .await??;
                client.put_object().bucket(bucket).key(key).body(ByteStream::from(body)).send().await?;
                anyhow::Ok(len)
            });
            at += len;
        }
    }
    let (mut bytes, mut requests) = (0u64, 0u64);
    while let Some(r) = tasks.join_next().await {
        bytes += r??;
        requests += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    for key in keys {
        client.delete_object().bucket(&bucket).key(key).send().await?;
    }
    println!(
        "{}",
        serde_json::json!({"bytes": bytes, "seconds": seconds, "mb_per_s": bytes as f64 / 1e6 / seconds, "requests": requests})
    );
    Ok(())
}
