//! The daemon-wide packed-ring budget (`--packed-budget`) with real packed streams on a real
//! daemon: concurrent streams beyond the budget wait for ring memory and all finish, the memory
//! alive never exceeds the budget, and a ring larger than the whole budget fails at once with
//! RESOURCE_EXHAUSTED naming the budget.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use shardstream::daemon::{BoundDaemon, DaemonConfig, ShutdownToken};
use shardstream_client::{Address, Client};
use shardstream_proto::{Collate, StreamRequest, Transport};
use tonic::Code;

/// Bytes of the fixed-size field: four samples make a ~240 KB batch, a ring of 8 slots ~1.9 MiB.
const RECORD: usize = 60_000;

fn write_shards(dir: &Path, shards: usize, per_shard: usize) -> usize {
    std::fs::create_dir_all(dir).unwrap();
    for s in 0..shards {
        let f = std::fs::File::create(dir.join(format!("part-{s:04}.tar"))).unwrap();
        let mut b = tar::Builder::new(f);
        for i in 0..per_shard {
            let data: Vec<u8> = (0..RECORD).map(|j| (j + i + s) as u8).collect();
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("k{s:02}_{i:04}.bin"), data.as_slice()).unwrap();
        }
        b.finish().unwrap();
    }
    shards * per_shard
}

struct Daemon {
    _tmp: tempfile::TempDir,
    data: std::path::PathBuf,
    addr: Address,
    shutdown: ShutdownToken,
    server: tokio::task::JoinHandle<shardstream::Result<()>>,
}

async fn start(budget: u64) -> (Daemon, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let n = write_shards(&data, 4, 12);
    let mut config = DaemonConfig::new(Address::Unix(tmp.path().join("run/sock")), tmp.path().join("cache"));
    config.shm.packed_budget = budget;
    let bound = BoundDaemon::bind(config).await.unwrap();
    let addr = bound.address();
    let shutdown = ShutdownToken::new();
    let server = tokio::spawn(bound.run(shutdown.clone()));
    (Daemon { _tmp: tmp, data, addr, shutdown, server }, n)
}

fn packed(url: &Path, seed: u64) -> StreamRequest {
    StreamRequest {
        url: url.display().to_string(),
        batch_size: 4,
        shuffle: true,
        seed,
        world_size: 1,
        num_workers: 1,
        transport: Transport::Auto as i32,
        collate: Collate::Stack as i32,
        fields: vec!["bin".into()],
        ..Default::default()
    }
}

fn status(e: shardstream_client::ClientError) -> tonic::Status {
    match e {
        shardstream_client::ClientError::Status(s) => s,
        other => tonic::Status::unknown(other.to_string()),
    }
}

/// Reads a packed stream to its end, releasing each batch after a short "training step"; the
/// keys delivered (in the form the request asked for).
async fn consume(mut client: Client, req: StreamRequest) -> Result<Vec<String>, tonic::Status> {
    let joined = req.packed_keys_joined;
    let mut s = shardstream_client::stream(&mut client, req).await.map_err(status)?;
    let session = s.shm.clone().expect("shm session");
    let mut keys = Vec::new();
    while let Some(b) = s.next().await {
        let shardstream_client::Batch::Packed(b) = b.map_err(status)? else { panic!("expected packed batches") };
        assert_eq!((b.keys.is_empty(), b.key_ends.is_empty()), (joined, !joined), "the keys' form");
        keys.extend(b.key_strs().expect("well-formed keys").into_iter().map(String::from));
        tokio::time::sleep(Duration::from_millis(5)).await;
        session.release(b.batch_index);
    }
    Ok(keys)
}

/// Ring memory alive: rings streams use and rings kept for a user's next stream.
async fn ring_bytes(client: &mut Client) -> u64 {
    let s = client.status(shardstream_proto::StatusRequest {}).await.unwrap().into_inner();
    s.ring_bytes + s.kept_ring_bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn joined_keys_are_the_same_keys_in_the_same_order_as_strings() {
    let (d, n) = start(64 << 20).await;
    let client = shardstream_client::connect(&d.addr).await.unwrap();
    let strings = consume(client.clone(), packed(&d.data, 3)).await.unwrap();
    let joined =
        consume(client.clone(), StreamRequest { packed_keys_joined: true, ..packed(&d.data, 3) }).await.unwrap();
    assert_eq!(strings.len(), n);
    assert_eq!(joined, strings);
    d.shutdown.cancel();
    d.server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_packed_streams_share_the_budget_and_all_finish() {
    // Room for two rings (~1.9 MiB each), not three: four streams at once must take turns.
    let budget = 9 << 19; // 4.5 MiB
    let (d, n) = start(budget).await;
    let client = shardstream_client::connect(&d.addr).await.unwrap();
    let streams: Vec<_> = (0..4).map(|i| tokio::spawn(consume(client.clone(), packed(&d.data, i)))).collect();
    // Sample the rings alive while the streams run: never above the budget.
    let mut watcher = client.clone();
    let mut most = 0;
    let mut done = 0;
    while done < streams.len() {
        most = most.max(ring_bytes(&mut watcher).await);
        done = streams.iter().filter(|s| s.is_finished()).count();
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for s in streams {
        let keys = s.await.unwrap().expect("every stream finishes within the budget");
        assert_eq!(keys.len(), n);
        assert_eq!(keys.iter().collect::<HashSet<_>>().len(), n, "each sample once");
    }
    assert!(most > 0, "the watcher saw rings alive");
    assert!(most <= budget, "{most} bytes of rings alive with a budget of {budget}");
    d.shutdown.cancel();
    d.server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_waits_for_ring_memory_another_gives_back() {
    let budget = 9 << 19;
    let (d, n) = start(budget).await;
    let mut client = shardstream_client::connect(&d.addr).await.unwrap();
    // Two streams hold one batch each (so their rings stay), filling the budget.
    let mut holders = Vec::new();
    for seed in 0..2 {
        let mut s = shardstream_client::stream(&mut client, packed(&d.data, seed)).await.unwrap();
        s.next().await.unwrap().unwrap();
        holders.push(s);
    }
    let third = tokio::spawn(consume(client.clone(), packed(&d.data, 7)));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!third.is_finished(), "the third stream must wait: no ring memory is free");
    assert!(ring_bytes(&mut client).await <= budget);
    // One holder leaves: its ring goes, and the waiting stream gets the memory.
    drop(holders.remove(0));
    let keys = tokio::time::timeout(Duration::from_secs(30), third).await.unwrap().unwrap().unwrap();
    assert_eq!(keys.len(), n);
    drop(holders);
    d.shutdown.cancel();
    d.server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_larger_than_the_budget_fails_at_once_with_resource_exhausted() {
    let budget = 1 << 20; // the smallest accepted; one ring of these batches is ~1.9 MiB
    let (d, _) = start(budget).await;
    let client = shardstream_client::connect(&d.addr).await.unwrap();
    let started = std::time::Instant::now();
    let err = consume(client.clone(), packed(&d.data, 1)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("packed ring budget exhausted"), "{}", err.message());
    assert!(err.message().contains("--packed-budget"), "{}", err.message());
    assert!(started.elapsed() < Duration::from_secs(5), "no wait for what can never fit");
    // The daemon keeps serving: a view stream (collate none) of the same data works.
    let view = StreamRequest { collate: Collate::None as i32, ..packed(&d.data, 1) };
    let mut c = client.clone();
    let mut s = shardstream_client::stream(&mut c, view).await.unwrap();
    assert!(s.next().await.unwrap().is_ok());
    drop(s);
    d.shutdown.cancel();
    d.server.await.unwrap().unwrap();
}
