//! The bench's "plain client": downloads every `.tar` or `.parquet` object under an S3 prefix with N concurrent
//! ranged GETs straight from aws-sdk-s3, discarding the bytes, and prints
//! `{"bytes": .., "seconds": .., "mb_per_s": .., "requests": ..}`. What the server can deliver
//! to one client, so shardstream's cold epoch is quoted as a share of it.
//!
//! Usage: `s3_fetch BUCKET PREFIX [CONCURRENCY] [PART_BYTES]` with `AWS_ENDPOINT_URL` and
//! credentials in the environment.

mod plain_s3;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (bucket, prefix) = match (args.get(1), args.get(2)) {
        (Some(b), Some(p)) => (b.clone(), p.clone()),
        _ => anyhow::bail!("usage: s3_fetch BUCKET PREFIX [CONCURRENCY] [PART_BYTES]"),
    };
    let concurrency: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let part: u64 = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(8 << 20);
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
        let mut at = 0;
        while at < size {
            let end = (at + part).min(size);
            let (client, bucket, key, limit) = (client.clone(), bucket.clone(), key.clone(), limit.clone());
            tasks.spawn(async move {
                let _slot = limit.acquire_owned().await?;
                let resp =
                    client.get_object().bucket(bucket).key(key).range(format!("bytes={at}-{}", end - 1)).send().await?;
                let mut body = resp.body;
                let mut n = 0u64;
                while let Some(chunk) = body.try_next().await? {
                    n += chunk.len() as u64;
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
