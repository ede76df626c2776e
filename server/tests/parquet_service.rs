//! Parquet datasets through the gRPC service in-process (inline transport, raw messages: the
//! client crate's Arrow reader is another work stream): OpenDataset describes the dataset with its
//! Arrow schema, streams of 2 ranks x 2 workers deliver every row exactly once as Arrow IPC record
//! batches whose rows are the rows their ids name, a resumed worker continues where it stopped,
//! and bad requests and files get the documented status codes.

#[path = "../src/format/parquet/testdata.rs"]
mod testdata;

use std::io::Cursor;
use std::path::Path;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use shardstream::daemon::{BoundDaemon, DaemonConfig, ShutdownToken};
use shardstream_client::{Address, Client};
use shardstream_proto::{
    ArrowBatch, BatchFormat, StreamHeader, StreamMessage, StreamRequest, Transport, stream_message,
};
use tonic::Code;

struct Fixture {
    tmp: tempfile::TempDir,
    addr: Address,
    shutdown: ShutdownToken,
    server: tokio::task::JoinHandle<shardstream::Result<()>>,
}

async fn start() -> Fixture {
    let tmp = tempfile::tempdir().unwrap();
    let config = DaemonConfig::new(Address::Unix(tmp.path().join("run/sock")), tmp.path().join("cache"));
    let bound = BoundDaemon::bind(config).await.unwrap();
    let addr = bound.address();
    let shutdown = ShutdownToken::new();
    let server = tokio::spawn(bound.run(shutdown.clone()));
    Fixture { tmp, addr, shutdown, server }
}

impl Fixture {
    async fn stop(self) {
        self.shutdown.cancel();
        self.server.await.unwrap().unwrap();
    }
}

/// A daemon, the dataset of [`write_dataset`] in its temporary directory, and a client.
async fn with_dataset() -> (Fixture, std::path::PathBuf, Client) {
    let fx = start().await;
    let dir = fx.tmp.path().join("pq");
    write_dataset(&dir);
    let client = shardstream_client::connect(&fx.addr).await.unwrap();
    (fx, dir, client)
}

/// ids 0..130 (snappy, row groups of 17), 130..210 (zstd, one row group), 210..400 (plain, 25).
fn write_dataset(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("a.parquet"), testdata::mixed_from(0, 130, 17, testdata::Codec::Snappy)).unwrap();
    std::fs::write(dir.join("b.parquet"), testdata::mixed_from(130, 80, 80, testdata::Codec::Zstd)).unwrap();
    std::fs::write(dir.join("c.parquet"), testdata::mixed_from(210, 190, 25, testdata::Codec::None)).unwrap();
}

fn request(dir: &Path, rank: u32, worker: u32, fields: &[&str]) -> StreamRequest {
    StreamRequest {
        url: dir.display().to_string(),
        fields: fields.iter().map(|f| f.to_string()).collect(),
        batch_size: 16,
        shuffle: true,
        seed: 3,
        world_size: 2,
        rank,
        num_workers: 2,
        worker,
        transport: Transport::Inline as i32,
        ..Default::default()
    }
}

/// The stream's (row ids, decoded batch) pairs.
async fn arrow_batches(client: &mut Client, req: StreamRequest) -> Result<Vec<(Vec<u64>, RecordBatch)>, tonic::Status> {
    let mut s = client.stream_batches(req).await?.into_inner();
    let mut out = Vec::new();
    let mut header = None;
    while let Some(m) = s.message().await? {
        match m.kind {
            Some(stream_message::Kind::Header(h)) => header = Some(h),
            Some(stream_message::Kind::ArrowBatch(b)) => {
                assert_eq!(b.length, b.data.len() as u64);
                let mut r = arrow_ipc::reader::StreamReader::try_new(Cursor::new(b.data), None).unwrap();
                let batch = r.next().unwrap().unwrap();
                assert!(r.next().is_none(), "one record batch per message");
                out.push((b.row_ids, batch));
            }
            other => panic!("expected Arrow batches, got {other:?}"),
        }
    }
    let h = header.expect("a stream header");
    assert_eq!(h.batch_format, BatchFormat::Arrow as i32);
    assert_eq!(h.batches_in_stream, out.len() as u64);
    Ok(out)
}

fn ids(b: &RecordBatch) -> Vec<u64> {
    b.column_by_name("id").unwrap().as_primitive::<Int64Type>().values().iter().map(|&i| i as u64).collect()
}

/// The `__row__` column the daemon appends to every batch: the rows' ids.
fn row_column(b: &RecordBatch) -> Vec<u64> {
    let last = b.schema().fields().last().map(|f| (f.name().clone(), f.data_type().clone()));
    assert_eq!(last, Some(("__row__".to_owned(), arrow_schema::DataType::UInt64)), "the last column holds the row ids");
    b.column(b.num_columns() - 1).as_primitive::<arrow_array::types::UInt64Type>().values().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_once_over_two_ranks_and_two_workers_as_arrow_batches() {
    let (fx, dir, mut client) = with_dataset().await;
    let info = shardstream_client::open(&mut client, &dir.display().to_string(), "").await.unwrap();
    assert_eq!((info.format.as_str(), info.num_samples, info.num_shards), ("parquet", 400, 3));
    assert_eq!(info.fields, ["id", "label", "caption", "image", "blob", "text", "tokens"]);
    let schema = arrow_ipc::reader::StreamReader::try_new(Cursor::new(info.arrow_schema), None).unwrap().schema();
    assert_eq!(schema, testdata::mixed_schema());

    let full = testdata::mixed_batch(0..400);
    let mut seen = Vec::new();
    let mut first_order = Vec::new();
    for rank in 0..2 {
        for worker in 0..2 {
            let got = arrow_batches(&mut client, request(&dir, rank, worker, &["image", "id"])).await.unwrap();
            for (row_ids, batch) in &got {
                assert_eq!(
                    batch.schema().fields().iter().map(|f| f.name().as_str()).collect::<Vec<_>>(),
                    ["image", "id", "__row__"]
                );
                assert_eq!(&ids(batch), row_ids);
                assert_eq!(&row_column(batch), row_ids);
                for (k, &id) in row_ids.iter().enumerate() {
                    assert_eq!(batch.column(0).as_binary::<i32>().value(k), testdata::image(id as i64), "row {id}");
                }
                seen.extend(row_ids.iter().copied());
            }
            if rank == 0 && worker == 0 {
                first_order = got.iter().flat_map(|(r, _)| r.clone()).collect();
            }
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..400).collect::<Vec<u64>>(), "every row exactly once");
    assert_ne!(first_order, (0..first_order.len() as u64).collect::<Vec<_>>(), "shuffled");

    // All columns, and the values of every column equal what was written.
    let got = arrow_batches(&mut client, request(&dir, 1, 1, &[])).await.unwrap();
    for (row_ids, batch) in &got {
        assert_eq!(&row_column(batch), row_ids);
        let columns = batch.project(&(0..full.num_columns()).collect::<Vec<_>>()).unwrap();
        // The schema names the columns the rows written hold nulls in, and only those.
        let named = batch.schema().metadata().get("shardstream.nulls").cloned();
        assert_eq!(named.as_deref(), Some(r#"["label","caption","tokens"]"#));
        assert_eq!(columns.schema().fields(), full.schema().fields());
        for (k, &id) in row_ids.iter().enumerate() {
            assert_eq!(columns.slice(k, 1).columns(), full.slice(id as usize, 1).columns(), "row {id}");
        }
    }

    // Resume: worker 0 of rank 0 from batch 2 continues the same order.
    let mut resumed = request(&dir, 0, 0, &["id"]);
    resumed.start_batch = 2;
    let again = arrow_batches(&mut client, resumed).await.unwrap();
    let again: Vec<u64> = again.iter().flat_map(|(r, _)| r.clone()).collect();
    assert_eq!(again, first_order[first_order.len() - again.len()..]);
    fx.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_columns_and_bad_files_get_their_status_codes() {
    let fx = start().await;
    let mut client = shardstream_client::connect(&fx.addr).await.unwrap();
    // A column one file lacks: InvalidArgument naming the file and the column, before any batch.
    let dir = fx.tmp.path().join("mixed");
    write_dataset(&dir);
    std::fs::write(dir.join("d.parquet"), testdata::wide(10, 5, 2)).unwrap();
    let err = arrow_batches(&mut client, request(&dir, 0, 0, &["caption"])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("d.parquet") && err.message().contains("\"caption\""), "{err:?}");
    // A field no file has at all.
    let err = arrow_batches(&mut client, request(&dir, 0, 0, &["nope"])).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // A corrupt page: DataLoss naming the file, and no batch with garbage before it.
    let dir = fx.tmp.path().join("corrupt");
    std::fs::create_dir_all(&dir).unwrap();
    let mut bytes = testdata::mixed(64, 64, testdata::Codec::Snappy);
    let n = bytes.len();
    // The data region of the only row group, well before the footer.
    for b in &mut bytes[200..n / 2] {
        *b = 0xee;
    }
    std::fs::write(dir.join("bad.parquet"), bytes).unwrap();
    let err = arrow_batches(&mut client, request(&dir, 0, 0, &[])).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(err.message().contains("bad.parquet"), "{err:?}");
    fx.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_indexed_dataset_serves_and_a_crc_mismatch_is_data_loss_before_any_row() {
    let fx = start().await;
    let dir = fx.tmp.path().join("indexed");
    write_dataset(&dir);
    let url = dir.display().to_string();
    let summary = tokio::task::spawn_blocking({
        let url = url.clone();
        move || shardstream::index::build::index_dataset(&url, Some(2), None, &())
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(summary.manifest.shard_format, "parquet");
    assert_eq!(summary.manifest.shards.iter().map(|s| s.samples).sum::<u64>(), 400);
    let mut client = shardstream_client::connect(&fx.addr).await.unwrap();
    let info = shardstream_client::open(&mut client, &url, "").await.unwrap();
    assert!(info.from_manifest);
    assert_eq!(info.num_samples, 400);
    let mut all = Vec::new();
    for worker in 0..2 {
        for (rows, _) in arrow_batches(&mut client, request(&dir, 0, worker, &["id"])).await.unwrap() {
            all.extend(rows);
        }
    }
    assert_eq!(all.len(), 200);

    // `shardstream index` reads footers only, and its manifest's CRCs cover them.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["checksum"], "crc32c-footer");
    let reads = summary.footer_reads.expect("a Parquet index counts its reads");
    assert_eq!(reads.reads, 3, "one tail read per file: {reads:?}");

    // The same bytes count, one footer byte changed (the writer's name, so the footer still
    // decodes; its sidecar, copied along, still describes the old footer): the manifest's CRC
    // catches it at first use.
    let copy = fx.tmp.path().join("tampered");
    std::fs::create_dir_all(copy.join("_shardstream")).unwrap();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, copy.join(p.file_name().unwrap())).unwrap();
        }
    }
    for e in std::fs::read_dir(dir.join("_shardstream")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, copy.join("_shardstream").join(p.file_name().unwrap())).unwrap();
    }
    let target = copy.join("b.parquet");
    let mut bytes = std::fs::read(&target).unwrap();
    let at = bytes.windows(10).rposition(|w| w == b"parquet-rs").expect("the writer's name in the footer");
    bytes[at] = b'P';
    std::fs::write(&target, bytes).unwrap();
    let mut req = request(&copy, 0, 0, &["id"]);
    req.world_size = 1;
    req.num_workers = 1;
    req.shuffle = false;
    let mut s = client.stream_batches(req).await.unwrap().into_inner();
    let mut served = 0;
    let err = loop {
        match s.message().await {
            Ok(Some(m)) => {
                if let Some(stream_message::Kind::ArrowBatch(b)) = m.kind {
                    // Rows of a.parquet (ids 0..130) may come first; never one of b.parquet.
                    assert!(
                        b.row_ids.iter().all(|&r| r < 130),
                        "a row of the tampered file was served: {:?}",
                        b.row_ids
                    );
                    served += b.row_ids.len();
                }
            }
            Ok(None) => panic!("the stream ended without an error"),
            Err(e) => break e,
        }
    };
    assert!(served <= 130);
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(err.message().contains("b.parquet"), "{err:?}");
    fx.stop().await;
}

/// Over shared memory: each ArrowBatch names a slot of the stream's packed ring, whose header
/// says n_fields 0, the batch's rows and the stream length, and whose bytes from
/// ARROW_DATA_OFFSET are the IPC stream; releasing batches lets a stream longer than the ring's
/// slots finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_shared_memory_each_batch_is_an_ipc_stream_in_a_ring_slot() {
    let (fx, dir, mut client) = with_dataset().await;
    // Flat columns are written straight from the decoded row groups into the slot; a list
    // column makes the batch go through a gathered record batch: both must read the same.
    for fields in [&["id", "text", "label", "image"][..], &["id", "text", "tokens"][..]] {
        over_shared_memory(&mut client, &dir, fields).await;
    }
    fx.stop().await;
}

/// One rank, one worker, `fields` over shared memory in batches of `batch_size`: the stream, its
/// header (checked to be a packed Arrow stream) and the attached side channel.
async fn shm_stream(
    client: &mut Client,
    dir: &Path,
    fields: &[&str],
    batch_size: u32,
) -> (tonic::Streaming<StreamMessage>, StreamHeader, std::sync::Arc<shardstream_client::shm::ShmSession>) {
    let mut req = request(dir, 0, 0, fields);
    (req.world_size, req.num_workers, req.batch_size, req.transport) = (1, 1, batch_size, Transport::Shm as i32);
    shm_stream_of(client, req).await
}

/// As [`shm_stream`], for any shm request.
async fn shm_stream_of(
    client: &mut Client,
    req: StreamRequest,
) -> (tonic::Streaming<StreamMessage>, StreamHeader, std::sync::Arc<shardstream_client::shm::ShmSession>) {
    let mut s = client.stream_batches(req).await.unwrap().into_inner();
    let Some(stream_message::Kind::Header(h)) = s.message().await.unwrap().unwrap().kind else { panic!("no header") };
    assert_eq!(h.transport, Transport::Shm as i32);
    assert_eq!(h.batch_format, BatchFormat::Arrow as i32);
    assert!(h.packed);
    let session = shardstream_client::shm::ShmSession::attach(Path::new(&h.shm_socket), &h.shm_token).unwrap();
    (s, h, session)
}

/// The record batch of the IPC stream an Arrow message names in its ring slot.
fn slot_batch(session: &shardstream_client::shm::ShmSession, b: &ArrowBatch) -> RecordBatch {
    let ring = session.ring(b.ring).unwrap();
    let slot = ring.slot(b.slot).unwrap();
    let start = shardstream_proto::ring::ARROW_DATA_OFFSET as usize;
    let stream = slot[start..start + b.length as usize].to_vec();
    let mut r = arrow_ipc::reader::StreamReader::try_new(Cursor::new(stream), None).unwrap();
    let batch = r.next().unwrap().unwrap();
    assert!(r.next().is_none(), "one record batch per message");
    batch
}

async fn over_shared_memory(client: &mut Client, dir: &Path, fields: &[&str]) {
    use shardstream_proto::ring::{SLOT_HEADER_BYTES, SlotHeader};
    let (mut s, _, session) = shm_stream(client, dir, fields, 10).await;
    let mut seen = Vec::new();
    while let Some(m) = s.message().await.unwrap() {
        let Some(stream_message::Kind::ArrowBatch(b)) = m.kind else { panic!("expected Arrow batches") };
        assert!(b.data.is_empty(), "shm batches carry no bytes inline");
        let ring = session.ring(b.ring).unwrap();
        let slot = ring.slot(b.slot).unwrap();
        let head = SlotHeader::decode(slot[..SLOT_HEADER_BYTES].try_into().unwrap());
        assert_eq!(
            (head.n_fields, head.batch_index, head.n_samples, head.payload_bytes),
            (0, b.batch_index, b.row_ids.len() as u64, b.length)
        );
        let batch = slot_batch(&session, &b);
        assert_eq!(ids(&batch), b.row_ids);
        assert_eq!(row_column(&batch), b.row_ids);
        // Each batch is what the gather makes of the same rows, then their ids.
        let batch = batch.project(&(0..fields.len()).collect::<Vec<_>>()).unwrap();
        let want = arrow_select::concat::concat_batches(
            &batch.schema(),
            &b.row_ids
                .iter()
                .map(|&id| testdata::mixed_batch(id as i64..id as i64 + 1).project(&projection(fields)).unwrap())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert_eq!(batch, want, "fields {fields:?}, batch {}", b.batch_index);
        for (k, &id) in b.row_ids.iter().enumerate() {
            assert_eq!(batch.column(1).as_string::<i64>().value(k), format!("row-{id:06}"));
        }
        seen.extend(b.row_ids);
        session.release(b.batch_index);
    }
    assert!(seen.len() / 10 > 8, "more batches than ring slots");
    seen.sort_unstable();
    assert_eq!(seen, (0..400).collect::<Vec<u64>>());
}

/// A client that releases nothing until it holds every slot the stream has (then all at once)
/// still gets each batch: a daemon that queues batches in groups sends what it has before it
/// waits for a slot (the client can only release batches it received).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_holds_every_slot_gets_every_batch_it_waits_for() {
    let (fx, dir, mut client) = with_dataset().await;
    let (mut s, h, session) = shm_stream(&mut client, &dir, &["id", "label"], 5).await;
    let credits = h.shm_credits as usize;
    assert!(credits > 1 && 400 / 5 > 3 * credits, "more batches than slots: {credits}");
    let (mut held, mut indices, mut seen) = (Vec::new(), Vec::new(), Vec::new());
    loop {
        let next = tokio::time::timeout(std::time::Duration::from_secs(20), s.message()).await;
        let Ok(next) = next else {
            panic!("no batch after {} while the client holds {} of {credits} slots", indices.len(), held.len())
        };
        let Some(m) = next.unwrap() else { break };
        let Some(stream_message::Kind::ArrowBatch(b)) = m.kind else { panic!("expected Arrow batches") };
        indices.push(b.batch_index);
        seen.extend(b.row_ids);
        held.push(b.batch_index);
        if held.len() == credits {
            for i in held.drain(..) {
                session.release(i);
            }
        }
    }
    assert_eq!(indices, (0..80).collect::<Vec<u64>>(), "every batch once, in order");
    seen.sort_unstable();
    assert_eq!(seen, (0..400).collect::<Vec<u64>>());
    fx.stop().await;
}

/// A client that accepts several batches per message gets runs of its stream's consecutive
/// batches in one record batch (the first batch alone), named by index and row count: the same
/// batches, rows and order as one batch per message, and a client that asks for nothing (an older
/// one) still gets one batch per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_batches_share_a_message_when_the_client_accepts_them() {
    let (fx, dir, mut client) = with_dataset().await;
    // Worker 0 of 2 of rank 0 of 1: its batches are every other one of the rank's (0, 2, 4, ...),
    // the rank's last (400 rows in batches of 6: batch 66) short.
    let mut stream = async |max: u32| {
        let mut req = request(&dir, 0, 0, &["id", "label"]);
        (req.world_size, req.batch_size, req.transport, req.max_batches_per_message) =
            (1, 6, Transport::Shm as i32, max);
        let (mut s, h, session) = shm_stream_of(&mut client, req).await;
        let (mut batches, mut messages) = (Vec::new(), Vec::new());
        while let Some(m) = s.message().await.unwrap() {
            let Some(stream_message::Kind::ArrowBatch(b)) = m.kind else { panic!("expected Arrow batches") };
            let parts = shardstream_client::arrow_parts(&b, max).unwrap();
            let batch = slot_batch(&session, &b);
            assert_eq!((ids(&batch), row_column(&batch)), (b.row_ids.clone(), b.row_ids.clone()));
            let mut at = 0;
            for (index, rows) in &parts {
                batches.push((*index, b.row_ids[at..at + *rows as usize].to_vec()));
                at += *rows as usize;
            }
            messages.push(parts.len());
            session.release(b.batch_index);
        }
        assert_eq!(h.batches_in_stream, batches.len() as u64);
        (batches, messages)
    };
    let (one_each, messages) = stream(0).await;
    assert!(messages.iter().all(|&n| n == 1), "{messages:?}");
    let indices: Vec<u64> = one_each.iter().map(|b| b.0).collect();
    assert_eq!(indices, (0..67).filter(|i| i % 2 == 0).collect::<Vec<u64>>());
    assert_eq!(one_each.last().map(|b| b.1.len()), Some(4), "the rank's last batch is short");
    let (shared, messages) = stream(4).await;
    assert_eq!(shared, one_each, "the same batches, rows and order");
    assert_eq!(messages[0], 1, "the first batch goes alone");
    assert!(messages.iter().all(|&n| n <= 4) && messages.len() < 12, "{messages:?}");
    fx.stop().await;
}

/// Column numbers of `fields` in the test data's schema.
fn projection(fields: &[&str]) -> Vec<usize> {
    let schema = testdata::mixed_schema();
    fields.iter().map(|f| schema.index_of(f).unwrap()).collect()
}

/// The plan's units are row groups, not files: a shuffle window of one unit holds one row group
/// (a batch draws on one or two of them, the decoded rows a window needs stay small), and the
/// epoch mixes the files from its start instead of serving one whole file after the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shuffle_permutes_row_groups_across_files() {
    let fx = start().await;
    let dir = fx.tmp.path().join("rg");
    std::fs::create_dir_all(&dir).unwrap();
    // Two files of 8 row groups of 50 rows: ids 0..400 and 400..800.
    std::fs::write(dir.join("a.parquet"), testdata::mixed_from(0, 400, 50, testdata::Codec::Snappy)).unwrap();
    std::fs::write(dir.join("b.parquet"), testdata::mixed_from(400, 400, 50, testdata::Codec::Snappy)).unwrap();
    let mut client = shardstream_client::connect(&fx.addr).await.unwrap();
    let req = StreamRequest {
        url: dir.display().to_string(),
        fields: vec!["id".into()],
        batch_size: 50,
        shuffle: true,
        seed: 11,
        world_size: 1,
        num_workers: 1,
        shuffle_window: 1,
        transport: Transport::Inline as i32,
        ..Default::default()
    };
    let got = arrow_batches(&mut client, req).await.unwrap();
    let mut seen: Vec<u64> = got.iter().flat_map(|(r, _)| r.clone()).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..800).collect::<Vec<u64>>(), "every row exactly once");
    let row_groups = |rows: &[u64]| {
        let mut g: Vec<u64> = rows.iter().map(|id| id / 50).collect();
        g.sort_unstable();
        g.dedup();
        g
    };
    // A window of one 400-row file would spread each batch over most of that file's 8 row groups.
    let widest = got.iter().map(|(r, _)| row_groups(r).len()).max().unwrap();
    assert!(widest <= 3, "a batch drew on {widest} row groups with a window of one unit");
    // Whole files as units would serve file a's rows, then b's (or the reverse): here the first
    // half of the epoch draws on both files.
    let first_half: Vec<u64> = got[..got.len() / 2].iter().flat_map(|(r, _)| r.clone()).collect();
    assert!(
        first_half.iter().any(|&id| id < 400) && first_half.iter().any(|&id| id >= 400),
        "the first half of the epoch came from one file only"
    );
    fx.stop().await;
}

/// Batches of large rows (over 1 MiB a batch) take the pipelined stream loop, small ones the
/// one-thread loop (`service::SmallArrowStream`): both deliver every row once, with its values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_of_large_rows_also_deliver_every_row_once() {
    use arrow_array::{BinaryArray, Int64Array};
    let fx = start().await;
    let dir = fx.tmp.path().join("big");
    std::fs::create_dir_all(&dir).unwrap();
    const ROW_BYTES: usize = 96 << 10;
    let payload = |i: i64| (0..ROW_BYTES).map(|k| (i as usize * 31 + k * 7 + k / 251) as u8).collect::<Vec<u8>>();
    for (f, ids) in [(0, 0..40i64), (1, 40..96)] {
        let schema = std::sync::Arc::new(arrow_schema::Schema::new(vec![
            arrow_schema::Field::new("id", arrow_schema::DataType::Int64, false),
            arrow_schema::Field::new("payload", arrow_schema::DataType::Binary, false),
        ]));
        let values: Vec<Vec<u8>> = ids.clone().map(payload).collect();
        let batch = RecordBatch::try_new(
            schema,
            vec![
                std::sync::Arc::new(Int64Array::from_iter_values(ids)),
                std::sync::Arc::new(BinaryArray::from_iter_values(values.iter())),
            ],
        )
        .unwrap();
        std::fs::write(dir.join(format!("{f}.parquet")), testdata::with_batch(&batch)).unwrap();
    }
    let mut client = shardstream_client::connect(&fx.addr).await.unwrap();
    let mut seen = Vec::new();
    for rank in 0..2 {
        for worker in 0..2 {
            let req = request(&dir, rank, worker, &[]);
            assert!(req.batch_size as usize * ROW_BYTES > 1 << 20, "the test must take the pipelined loop");
            for (row_ids, batch) in arrow_batches(&mut client, req).await.unwrap() {
                assert_eq!(ids(&batch), row_ids);
                for (k, &id) in row_ids.iter().enumerate() {
                    assert_eq!(batch.column(1).as_binary::<i32>().value(k), payload(id as i64), "row {id}");
                }
                seen.extend(row_ids);
            }
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..96).collect::<Vec<u64>>(), "every row exactly once");
    fx.stop().await;
}
