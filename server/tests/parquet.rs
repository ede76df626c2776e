//! Parquet datasets through the daemon's own pieces, on files written by the `parquet` crate's
//! `ArrowWriter`: footers, plan units, the exactly-once plan over 2 ranks x 2 workers, shared
//! row-group decoding, and batches as Arrow IPC read back with the IPC reader; bad files give
//! errors naming them.

#[path = "../src/format/parquet/testdata.rs"]
mod testdata;

use std::collections::HashSet;
use std::io::Cursor;
use std::path::Path;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::Int64Type;
use shardstream::Error;
use shardstream::format::parquet::ParquetError;
use shardstream::format::parquet::dataset::{BatchAssembler, DatasetFile, LocalFiles, ParquetDataset, open_local};
use shardstream::format::parquet::decoded::DecodedCache;
use shardstream::format::parquet::ipc;
use shardstream::format::parquet::kept::KeptRowGroups;
use shardstream::plan::{self, EpochParams, WorkerParams};
use shardstream::storage::local::ShardFile;

/// Writes `files` (name, bytes) into `dir` and opens them as a dataset in that order.
fn open(dir: &Path, files: &[(&str, Vec<u8>)]) -> shardstream::Result<(Arc<ParquetDataset>, LocalFiles, Vec<String>)> {
    let mut opened = Vec::new();
    let mut tables = Vec::new();
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let f = ShardFile::open(path, bytes.len() as u64)?;
        if let Some(t) = open_local(&f)? {
            tables.push(DatasetFile { name: f.name.clone(), table: Arc::new(t), index: opened.len() });
            opened.push(f);
        }
    }
    let (ds, skipped) = ParquetDataset::new(tables)?;
    Ok((Arc::new(ds), LocalFiles(opened), skipped))
}

fn ids(b: &RecordBatch) -> Vec<i64> {
    b.column_by_name("id").unwrap().as_primitive::<Int64Type>().values().to_vec()
}

/// The `__row__` column the daemon appends to every batch: the rows' ids.
fn row_column(b: &RecordBatch) -> Vec<u64> {
    let last = b.schema().fields().last().map(|f| f.name().clone());
    assert_eq!(last.as_deref(), Some("__row__"), "the last column holds the row ids");
    b.column(b.num_columns() - 1).as_primitive::<arrow_array::types::UInt64Type>().values().to_vec()
}

fn round_trip(b: &RecordBatch) -> RecordBatch {
    let bytes = ipc::encode(b).unwrap();
    let mut r = arrow_ipc::reader::StreamReader::try_new(Cursor::new(bytes), None).unwrap();
    let out = r.next().unwrap().unwrap();
    assert!(r.next().is_none());
    out
}

/// Three files, ids 0..130 / 130..210 / 210..400, several codecs and row-group sizes.
fn three_files() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("a.parquet", testdata::mixed_from(0, 130, 17, testdata::Codec::Snappy)),
        ("b.parquet", testdata::mixed_from(130, 80, 80, testdata::Codec::Zstd)),
        ("c.parquet", testdata::mixed_from(210, 190, 25, testdata::Codec::None)),
    ]
}

fn params(seed: u64, rank: u32) -> EpochParams {
    EpochParams {
        seed,
        epoch: 0,
        shuffle: true,
        window_shards: 4,
        world_size: 2,
        rank,
        batch_size: 16,
        drop_last: false,
    }
}

#[test]
fn two_ranks_two_workers_get_every_row_once_with_each_row_group_decoded_once() {
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, skipped) = open(dir.path(), &three_files()).unwrap();
    assert!(skipped.is_empty());
    assert_eq!(ds.num_rows(), 400);
    assert_eq!(ds.unit_rows().len(), 8 + 1 + 8);
    let fields: Vec<String> = ["id", "caption", "image", "tokens"].map(String::from).to_vec();
    let proj = ds.projection(Some(&fields)).unwrap();
    let cache = Arc::new(DecodedCache::new(64 << 20));
    let asm = BatchAssembler::new(ds.clone(), proj.clone(), cache.clone(), "ds").unwrap();
    let full = testdata::mixed_batch(0..400);

    let mut seen = Vec::new();
    let mut orders = Vec::new();
    for rank in 0..2 {
        let p = params(7, rank);
        let seq = plan::rank_sequence(ds.unit_rows(), &p).unwrap();
        orders.push(seq.clone());
        for worker in 0..2 {
            let w = WorkerParams { num_workers: 2, worker, start_batch: 0 };
            for range in plan::worker_batches(seq.len() as u64, p.batch_size, &w).unwrap() {
                let row_ids = &seq[range.start as usize..range.end as usize];
                let batch = round_trip(&asm.batch(row_ids, &files).unwrap());
                let names: Vec<String> = batch.schema().fields().iter().map(|f| f.name().clone()).collect();
                assert_eq!(names, [&fields[..], &["__row__".to_owned()]].concat(), "the fields, then the row ids");
                assert_eq!(row_column(&batch), row_ids);
                // Every delivered row is the row its id names, all columns.
                let got = ids(&batch);
                assert_eq!(got, row_ids.iter().map(|&i| i as i64).collect::<Vec<_>>());
                for (k, &id) in row_ids.iter().enumerate() {
                    let want = full.slice(id as usize, 1).project(&[0, 2, 3, 6]).unwrap();
                    assert_eq!(&batch.slice(k, 1).columns()[..4], want.columns(), "row {id}");
                }
                seen.extend(got);
            }
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..400).collect::<Vec<i64>>(), "every row exactly once");
    // A shuffle, not the file order, and each row group decoded once for the whole epoch.
    assert_ne!(orders[0], (0..200).collect::<Vec<u64>>());
    let s = cache.stats();
    assert_eq!(s.misses, ds.unit_rows().len() as u64);
    // Another seed, another order; the same seed, the same order (resume recomputes it).
    assert_ne!(plan::rank_sequence(ds.unit_rows(), &params(8, 0)).unwrap(), orders[0]);
    assert_eq!(plan::rank_sequence(ds.unit_rows(), &params(7, 0)).unwrap(), orders[0]);
}

/// A batch that draws on every row group of a cold cache (an epoch's first batch) decodes them in
/// parallel: each once, the rows in the asked order; the same batch again decodes nothing.
#[test]
fn a_batch_over_many_cold_row_groups_decodes_each_once_in_parallel() {
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &three_files()).unwrap();
    let proj = ds.projection(None).unwrap();
    let cache = Arc::new(DecodedCache::new(64 << 20));
    let asm = BatchAssembler::new(ds.clone(), proj, cache.clone(), "ds").unwrap();
    // One row of every row group, last group first, plus repeats of a few.
    let mut row_ids: Vec<u64> = (0..400).rev().step_by(7).collect();
    row_ids.extend([0, 399, 130, 0]);
    let units: std::collections::HashSet<usize> = row_ids.iter().map(|&id| ds.locate(id).unwrap().0).collect();
    assert_eq!(units.len(), ds.unit_rows().len(), "the batch draws on every row group");
    let b = asm.batch(&row_ids, &files).unwrap();
    assert_eq!(ids(&b), row_ids.iter().map(|&i| i as i64).collect::<Vec<_>>());
    let full = testdata::mixed_batch(0..400);
    for (k, &id) in row_ids.iter().enumerate() {
        assert_eq!(b.slice(k, 1).column(0), full.slice(id as usize, 1).column(0), "row {id}");
    }
    let s = cache.stats();
    assert_eq!((s.misses, s.hits), (units.len() as u64, 0));
    assert_eq!(asm.batch(&row_ids, &files).unwrap(), b);
    let s = cache.stats();
    assert_eq!((s.misses, s.hits), (units.len() as u64, units.len() as u64));
}

/// A projection whose row groups, decoded, cannot all fit the budget keeps them only within what
/// its stream's window claims (the rest of the budget is not filled with new memory in its first
/// epoch); one that fits keeps them up to the whole budget; the claim ends with the stream.
#[test]
fn an_outgrown_projection_is_kept_within_its_windows_claim() {
    let dir = tempfile::tempdir().unwrap();
    // 40 row groups of 10 rows, all alike.
    let (ds, files, _) =
        open(dir.path(), &[("even.parquet", testdata::mixed(400, 10, testdata::Codec::None))]).unwrap();
    let proj = ds.projection(None).unwrap();
    let probe = BatchAssembler::new(ds.clone(), proj.clone(), Arc::new(DecodedCache::new(1 << 30)), "p").unwrap();
    let (total, largest) = probe.projected_sizes();
    assert!(total > 0 && largest * 20 < total, "{total} {largest}");
    // One row of every row group, in file order: every row group decoded once.
    let firsts: Vec<u64> = ds.unit_rows().iter().scan(0u64, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
    let epoch = |asm: &BatchAssembler| {
        for &id in &firsts {
            asm.batch(&[id], &files).unwrap();
        }
    };

    let fits = Arc::new(DecodedCache::new(1 << 30));
    let asm = BatchAssembler::new(ds.clone(), proj.clone(), fits.clone(), "ds").unwrap().with_window(1);
    assert!(!asm.outgrown());
    epoch(&asm);
    assert_eq!(fits.stats().entries, firsts.len() as u64, "{:?}", fits.stats());
    assert_eq!(fits.stats().outgrown_bytes, 0);

    // A budget just too small for the projection: without a window's claim (as before) it fills.
    let budget = total - 1;
    let filled = Arc::new(DecodedCache::new(budget));
    epoch(&BatchAssembler::new(ds.clone(), proj.clone(), filled.clone(), "ds").unwrap());
    let kept_unclaimed = filled.stats().bytes;
    assert!(kept_unclaimed > budget / 2, "{:?}", filled.stats());

    let cache = Arc::new(DecodedCache::new(budget));
    let asm = BatchAssembler::new(ds.clone(), proj.clone(), cache.clone(), "ds").unwrap().with_window(2);
    assert!(asm.outgrown(), "{total} bytes of row groups against a budget of {budget}");
    epoch(&asm);
    let s = cache.stats();
    // 4 windows of 2 row groups claim less than the floor of a quarter of the budget.
    assert_eq!(s.outgrown_cap, budget / 4, "{s:?}");
    assert_eq!(s.bytes, s.outgrown_bytes, "every row group kept is the outgrown projection's");
    assert!(s.outgrown_bytes <= s.outgrown_cap && s.evictions > 0, "{s:?}");
    assert!(s.bytes < kept_unclaimed, "kept {} where the whole budget kept {kept_unclaimed}", s.bytes);
    assert_eq!(s.misses, firsts.len() as u64, "each row group decoded once all the same");
    // A second stream's claim adds to the first's.
    let wide = BatchAssembler::new(ds.clone(), proj.clone(), cache.clone(), "ds").unwrap().with_window(20);
    assert_eq!(cache.stats().outgrown_cap, (4 * 2 * largest + 4 * 20 * largest).min(budget));
    drop((asm, wide));
    assert_eq!(cache.stats().outgrown_cap, budget / 4, "the streams' claims end with them");
}

#[test]
fn a_row_group_is_read_only_for_its_selected_columns_and_ipc_fits_a_slot() {
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &three_files()).unwrap();
    let proj = ds.projection(Some(&["label".to_string()])).unwrap();
    let cache = Arc::new(DecodedCache::new(1 << 20));
    let asm = BatchAssembler::new(ds.clone(), proj.clone(), cache.clone(), "ds").unwrap();
    let b = asm.batch(&[398, 0, 200], &files).unwrap();
    assert_eq!(b.num_columns(), 2);
    assert_eq!(row_column(&b), [398, 0, 200]);
    let labels = b.column(0).as_primitive::<arrow_array::types::Int32Type>();
    // label = id % 10, null every 7th id.
    assert_eq!(labels.iter().collect::<Vec<_>>(), [Some(8), None, Some(0)]);
    let mut slot = vec![0u8; 1 << 16];
    let len = ipc::write_slot(&mut slot, 3, &b).unwrap();
    assert!(len > 0 && len < 4096, "{len}");
}

#[test]
fn bad_files_are_named_and_empty_ones_skipped() {
    let dir = tempfile::tempdir().unwrap();
    // Empty: a 0-byte file and a valid file with no rows are skipped; the rest serve.
    let mut files = three_files();
    files.push(("empty.parquet", Vec::new()));
    files.push(("norows.parquet", testdata::mixed(0, 10, testdata::Codec::None)));
    let (ds, _, skipped) = open(dir.path(), &files).unwrap();
    assert_eq!(ds.num_rows(), 400);
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(skipped[0].ends_with("norows.parquet"));

    // Truncated, bad magic: a shard error naming the file.
    let good = testdata::mixed(50, 10, testdata::Codec::Snappy);
    for (name, bytes) in [
        ("cut.parquet", good[..good.len() - 3].to_vec()),
        ("magic.parquet", [&good[..good.len() - 4], b"PAR2"].concat()),
        ("tiny.parquet", b"PAR1".to_vec()),
    ] {
        let e = open(dir.path(), &[(name, bytes)]).unwrap_err();
        assert!(matches!(&e, Error::Shard { shard, .. } if shard.ends_with(name)), "{name}: {e}");
    }

    // A column missing in the second file: InvalidArgument naming that file and the column.
    let other = testdata::wide(10, 5, 2);
    let (ds, _, _) = open(dir.path(), &[("x.parquet", good.clone()), ("y.parquet", other)]).unwrap();
    let e = ds.projection(Some(&["caption".to_string()])).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("y.parquet") && m.contains("\"caption\"")), "{e}");
    let e = ds.projection(None).unwrap_err();
    assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("y.parquet")), "{e}");
}

#[test]
fn a_corrupt_page_is_a_shard_error_naming_the_file_never_garbage() {
    let dir = tempfile::tempdir().unwrap();
    let good = testdata::mixed(60, 20, testdata::Codec::Snappy);
    let (ds, _, _) = open(dir.path(), &[("ok.parquet", good.clone())]).unwrap();
    let table = ds.files()[0].table.clone();
    // Overwrite the middle of row group 1's image column chunk (snappy: the decompressor notices).
    let r = table.chunk_range(1, 3).unwrap();
    let mut bad = good.clone();
    for b in &mut bad[(r.start as usize + 8)..(r.end as usize - 2)] {
        *b = 0xee;
    }
    let (ds, files, _) = open(dir.path(), &[("bad.parquet", bad)]).unwrap();
    let proj = ds.projection(None).unwrap();
    let cache = Arc::new(DecodedCache::new(1 << 20));
    let asm = BatchAssembler::new(ds.clone(), proj.clone(), cache.clone(), "bad").unwrap();
    // Row group 0 is intact and serves.
    assert_eq!(ids(&asm.batch(&[0, 19], &files).unwrap()), [0, 19]);
    let e = asm.batch(&[25], &files).unwrap_err();
    assert!(
        matches!(&e, Error::Shard { shard, reason, .. } if shard.ends_with("bad.parquet") && reason.contains("row group 1")),
        "{e}"
    );
    let mut seen = HashSet::new();
    for id in 40..60 {
        seen.insert(ids(&asm.batch(&[id], &files).unwrap())[0]);
    }
    assert_eq!(seen.len(), 20);
}

/// A file of 60 rows in row groups of 20 (`testdata::mixed`, uncompressed) written into `dir`,
/// and the byte range of row group 1's `label` chunk, which starts with its dictionary page.
fn label_chunk(dir: &Path) -> (Vec<u8>, std::ops::Range<u64>) {
    let good = testdata::mixed(60, 20, testdata::Codec::None);
    let (ds, _, _) = open(dir, &[("ok.parquet", good.clone())]).unwrap();
    let table = ds.files()[0].table.clone();
    let label = table.reader_metadata().metadata().row_group(1).column(1);
    assert!(label.dictionary_page_offset().is_some(), "the test needs label's dictionary page");
    let r = table.chunk_range(1, 1).unwrap();
    (good, r)
}

/// `bad` (a `label_chunk` file damaged in row group 1) as bad.parquet: row group 0 still serves,
/// and the error of a batch drawing on row group 1.
fn row_group_1_error(dir: &Path, bad: Vec<u8>) -> Error {
    let (ds, files, _) = open(dir, &[("bad.parquet", bad)]).unwrap();
    let proj = ds.projection(None).unwrap();
    let cache = Arc::new(DecodedCache::new(1 << 20));
    let asm = BatchAssembler::new(ds.clone(), proj, cache, "bad").unwrap();
    assert_eq!(ids(&asm.batch(&[0, 19], &files).unwrap()), [0, 19]);
    asm.batch(&[25], &files).unwrap_err()
}

#[test]
fn a_dictionary_page_claiming_more_values_than_it_holds_is_refused_before_decoding() {
    // arrow-rs sizes a dictionary from its page header's count before reading a value: a 4 KB
    // file whose count said ~10^9 took 3.6 GB (fuzz/seeds/parquet_row_group/finding_*). Here the
    // count of row group 1's `label` dictionary (int32, ~10 values) is raised as far as its
    // varint's length allows, so the file keeps its layout.
    let dir = tempfile::tempdir().unwrap();
    let (good, r) = label_chunk(dir.path());
    let header = &good[r.start as usize..];
    // Field 7 (the dictionary page header, a struct: delta 4 after the sizes) and its field 1
    // (num_values, an i32) lie at the same place whatever the sizes, once found.
    let at = header.windows(2).position(|w| w == [0x4c, 0x15]).expect("a dictionary page header") + 2;
    let len = header[at..].iter().position(|b| b & 0x80 == 0).unwrap() + 1;
    let mut bad = good.clone();
    let start = r.start as usize + at;
    for (i, b) in bad[start..start + len].iter_mut().enumerate() {
        // The largest even zigzag (a positive count) of this many bytes.
        *b = match (i, len) {
            (0, 1) => 0x7e,
            (0, _) => 0xfe,
            (i, l) if i + 1 == l => 0x7f,
            _ => 0xff,
        };
    }
    let e = row_group_1_error(dir.path(), bad);
    assert!(
        matches!(&e, Error::Shard { shard, reason, .. } if shard.ends_with("bad.parquet")
            && reason.contains("row group 1") && reason.contains("label") && reason.contains("a dictionary of")
            && reason.contains(&format!("page at byte {}", r.start))),
        "{e}"
    );
}

#[test]
fn a_dictionary_encoded_page_without_its_dictionary_is_refused_before_decoding() {
    // arrow-rs `expect`s a dictionary before a dictionary-encoded data page: without one it
    // panics (caught, but a panic in the daemon's log; the fuzz target met it in CI). Here row
    // group 1's `label` dictionary page is turned into an index page, which readers skip, so the
    // data page after it has no dictionary.
    let dir = tempfile::tempdir().unwrap();
    let (good, r) = label_chunk(dir.path());
    let start = r.start as usize;
    // Field 1 (type, i32): zigzag 4 is DICTIONARY_PAGE (2), 2 is INDEX_PAGE (1).
    assert_eq!(good[start..start + 2], [0x15, 0x04], "the chunk starts with its dictionary page");
    let mut bad = good.clone();
    bad[start + 1] = 0x02;
    let e = row_group_1_error(dir.path(), bad);
    assert!(
        matches!(&e, Error::Shard { shard, reason, .. } if shard.ends_with("bad.parquet")
            && reason.contains("row group 1") && reason.contains("label")
            && reason.contains("dictionary-encoded data page with no dictionary page before it")),
        "{e}"
    );
}

#[test]
fn strings_that_are_not_utf8_are_refused_when_the_file_does_not_mark_them_as_strings() {
    // arrow-rs checks UTF-8 only where the Parquet column says UTF8 (its converted type). A file
    // whose embedded Arrow schema says string over an unmarked byte-array column (the
    // `parquet_row_group` fuzz target made one; a writer that sets only the newer logical type
    // is another) decoded into string arrays holding any bytes, delivered as they were.
    use arrow_array::{Array, ArrayRef, BinaryArray, Int64Array, ListArray};
    use arrow_schema::{DataType, Field, Schema};
    use parquet::arrow::arrow_writer::ArrowWriterOptions;
    use parquet::arrow::{ArrowWriter, encode_arrow_schema};
    use parquet::file::metadata::KeyValue;
    use parquet::file::properties::WriterProperties;

    let values: Vec<&[u8]> = vec![b"ok", b"\xff\xfe not utf-8", b"fine"];
    let list = ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(vec![Some(vec![Some(1)]); 3]);
    let written = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Binary, false),
        Field::new("tags", list.data_type().clone(), true),
    ]);
    let claimed = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("name", DataType::Utf8, false),
        Field::new("tags", list.data_type().clone(), true),
    ]);
    let columns: Vec<ArrayRef> =
        vec![Arc::new(Int64Array::from(vec![0, 1, 2])), Arc::new(BinaryArray::from(values)), Arc::new(list)];
    let batch = RecordBatch::try_new(Arc::new(written), columns).unwrap();
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(vec![KeyValue::new("ARROW:schema".into(), encode_arrow_schema(&claimed))]))
        .build();
    let options = ArrowWriterOptions::new().with_properties(props).with_skip_arrow_metadata(true);
    let mut bytes = Vec::new();
    let mut w = ArrowWriter::try_new_with_options(&mut bytes, batch.schema(), options).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &[("s.parquet", bytes)]).unwrap();
    assert_eq!(ds.files()[0].table.schema().field_with_name("name").unwrap().data_type(), &DataType::Utf8);
    let cache = Arc::new(DecodedCache::new(1 << 20));
    // All columns (a list among them: decoded as delivered), and the flat ones (as views).
    for fields in [None, Some(vec!["id".to_string(), "name".to_string()])] {
        let proj = ds.projection(fields.as_deref()).unwrap();
        let asm = BatchAssembler::new(ds.clone(), proj, cache.clone(), "s").unwrap();
        let e = asm.batch(&[0, 2], &files).unwrap_err();
        assert!(
            matches!(&e, Error::Shard { shard, reason, .. } if shard.ends_with("s.parquet")
                && reason.contains("row group 0") && reason.contains("\"name\"") && reason.contains("UTF")),
            "{fields:?}: {e}"
        );
    }
}

#[test]
fn json_columns_that_are_not_utf8_are_refused() {
    // A column marked JSON is a string to arrow-rs, which checks UTF-8 only in columns marked
    // UTF8: it is checked after decoding.
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type as PqInt64};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;

    let schema = Arc::new(parse_message_type("message m { required int64 id; required binary doc (JSON); }").unwrap());
    let write = |docs: &[&[u8]]| {
        let mut bytes = Vec::new();
        let props = Arc::new(WriterProperties::builder().build());
        let mut w = SerializedFileWriter::new(&mut bytes, schema.clone(), props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        let ids: Vec<i64> = (0..docs.len() as i64).collect();
        c.typed::<PqInt64>().write_batch(&ids, None, None).unwrap();
        c.close().unwrap();
        let mut c = rg.next_column().unwrap().unwrap();
        let docs: Vec<ByteArray> = docs.iter().map(|d| ByteArray::from(d.to_vec())).collect();
        c.typed::<ByteArrayType>().write_batch(&docs, None, None).unwrap();
        c.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
        bytes
    };
    let dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(DecodedCache::new(1 << 20));
    let (ds, files, _) = open(dir.path(), &[("good.parquet", write(&[b"{}", b"{\"a\": 1}"]))]).unwrap();
    let asm = BatchAssembler::new(ds.clone(), ds.projection(None).unwrap(), cache.clone(), "good").unwrap();
    assert_eq!(ids(&asm.batch(&[1, 0], &files).unwrap()), [1, 0]);

    let (ds, files, _) = open(dir.path(), &[("bad.parquet", write(&[b"{}", b"{\"a\": \"\xff\"}"]))]).unwrap();
    let asm = BatchAssembler::new(ds.clone(), ds.projection(None).unwrap(), cache, "bad").unwrap();
    let e = asm.batch(&[0], &files).unwrap_err();
    assert!(
        matches!(&e, Error::Shard { shard, reason, .. } if shard.ends_with("bad.parquet")
            && reason.contains("row group 0") && reason.contains("UTF")),
        "{e}"
    );
}

#[test]
fn a_codec_this_build_cannot_decode_is_refused_by_column_before_any_batch() {
    // Written by pyarrow: x snappy, y brotli (this build decodes snappy, zstd, gzip and
    // uncompressed).
    let bytes = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/brotli_y.parquet")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &[("g.parquet", bytes)]).unwrap();
    let cache = Arc::new(DecodedCache::new(1 << 20));
    let x = ds.projection(Some(&["x".to_string()])).unwrap();
    let asm = BatchAssembler::new(ds.clone(), x, cache.clone(), "g").unwrap();
    assert_eq!(ids_of(&asm.batch(&[3, 19], &files).unwrap(), "x"), [3, 19]);
    let all = ds.projection(None).unwrap();
    let e = BatchAssembler::new(ds.clone(), all, cache, "g").unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("g.parquet") && m.contains("\"y\"") && m.contains("BROTLI") && m.contains("gzip")),
        "{e}"
    );
}

#[test]
fn gzip_column_chunks_are_decoded() {
    // Written by pyarrow: x snappy, y gzip (strings "0".."19").
    let bytes = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gzip_y.parquet")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &[("g.parquet", bytes)]).unwrap();
    let cache = Arc::new(DecodedCache::new(1 << 20));
    let all = ds.projection(None).unwrap();
    let asm = BatchAssembler::new(ds.clone(), all, cache, "g").unwrap();
    let b = asm.batch(&[3, 19], &files).unwrap();
    let y = b.column_by_name("y").unwrap();
    let y = arrow_cast_strings(y);
    assert_eq!(y, ["3", "19"]);
}

fn arrow_cast_strings(a: &arrow_array::ArrayRef) -> Vec<String> {
    use arrow_array::Array;
    if let Some(s) = a.as_any().downcast_ref::<arrow_array::StringArray>() {
        return s.iter().map(|v| v.unwrap_or_default().to_string()).collect();
    }
    let s = a.as_any().downcast_ref::<arrow_array::LargeStringArray>().expect("a string column");
    s.iter().map(|v| v.unwrap_or_default().to_string()).collect()
}

fn ids_of(b: &RecordBatch, col: &str) -> Vec<i64> {
    b.column_by_name(col).unwrap().as_primitive::<Int64Type>().values().to_vec()
}

/// `places` finds every row's unit and row by scanning the few units a batch draws on, and by a
/// map once a batch draws on more than it scans: both give `locate`'s answer, each unit once in
/// first-use order; `first_row_per_file` names one row of each file, in the order first drawn on.
#[test]
fn a_batch_places_its_rows_by_scan_or_map_alike() {
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &three_files()).unwrap();
    let fields: Vec<String> = ["id"].map(String::from).to_vec();
    let proj = ds.projection(Some(&fields)).unwrap();
    let asm = BatchAssembler::new(ds.clone(), proj, Arc::new(DecodedCache::new(64 << 20)), "p").unwrap();
    // A fixed shuffle of every row (17 units: past the scan) and of rows 200..260 (3 units).
    let mut all: Vec<u64> = (0..400).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, (i * 7919 + 13) % (i + 1));
    }
    let some: Vec<u64> = all.iter().copied().filter(|id| (200..260).contains(id)).collect();
    for rows_of in [&all, &some] {
        let places = asm.places(rows_of).unwrap();
        let mut units = places.units.clone();
        units.sort_unstable();
        units.dedup();
        assert_eq!(units.len(), places.units.len(), "each unit once");
        let mut first_use = Vec::new();
        for (&id, &(s, r)) in rows_of.iter().zip(&places.rows) {
            assert_eq!(ds.locate(id), Some((places.units[s], r)), "row {id}");
            if !first_use.contains(&places.units[s]) {
                first_use.push(places.units[s]);
            }
        }
        assert_eq!(first_use, places.units, "units in first-use order");
        let file_of = |id: u64| [130, 210, 400].iter().position(|&end| id < end).unwrap();
        let mut want_files: Vec<usize> = Vec::new();
        for &id in rows_of.iter() {
            if !want_files.contains(&file_of(id)) {
                want_files.push(file_of(id));
            }
        }
        let firsts = asm.first_row_per_file(&places);
        assert_eq!(firsts.iter().map(|&id| file_of(id)).collect::<Vec<_>>(), want_files);
        let rows = asm.rows_at(places, rows_of, &files).unwrap();
        assert_eq!(rows.rows.len(), rows_of.len());
        let batch = asm.batch(rows_of, &files).unwrap();
        assert_eq!(ids(&batch), rows_of.iter().map(|&i| i as i64).collect::<Vec<_>>());
    }
    assert!(asm.places(&[400]).unwrap_err().to_string().contains("past the dataset's 400 rows"));
}

/// Kept row groups in a directory, counting what is written and opened.
#[derive(Debug)]
struct DirKept {
    dir: std::path::PathBuf,
    writes: std::sync::atomic::AtomicU32,
    opens: std::sync::atomic::AtomicU32,
    /// Asked to keep a row group kept already.
    again: std::sync::atomic::AtomicU32,
}

impl DirKept {
    fn path(&self, file: usize, rg: usize) -> std::path::PathBuf {
        self.dir.join(format!("{file}-{rg}"))
    }
    fn count(n: &std::sync::atomic::AtomicU32) -> u32 {
        n.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl KeptRowGroups for DirKept {
    fn open(&self, file: usize, rg: usize) -> Option<std::fs::File> {
        let f = std::fs::File::open(self.path(file, rg)).ok()?;
        self.opens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(f)
    }

    fn keep(
        &self,
        file: usize,
        rg: usize,
        _bytes: u64,
        write: &mut dyn FnMut(&std::fs::File) -> Result<(), ParquetError>,
    ) -> Result<Option<std::fs::File>, ParquetError> {
        let path = self.path(file, rg);
        if path.try_exists().unwrap() {
            self.again.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(Some(std::fs::File::open(path).unwrap()));
        }
        write(&std::fs::File::create(&path).unwrap())?;
        self.writes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Some(std::fs::File::open(path).unwrap()))
    }

    fn discard(&self, file: usize, rg: usize) {
        let _ = std::fs::remove_file(self.path(file, rg));
    }
}

/// The three files with the flat projection `id, caption, image`, a decoded cache with room for
/// two thirds of it decoded, and an empty [`DirKept`] (the directories live as long as `Spill`).
struct Spill {
    ds: Arc<ParquetDataset>,
    files: LocalFiles,
    proj: shardstream::format::parquet::schema::Projection,
    cache: Arc<DecodedCache>,
    kept: Arc<DirKept>,
    _dirs: (tempfile::TempDir, tempfile::TempDir),
}

fn spill() -> Spill {
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &three_files()).unwrap();
    let fields: Vec<String> = ["id", "caption", "image"].map(String::from).to_vec();
    let proj = ds.projection(Some(&fields)).unwrap();
    let probe = Arc::new(DecodedCache::new(1 << 30));
    BatchAssembler::new(ds.clone(), proj.clone(), probe.clone(), "ds")
        .unwrap()
        .batch(&(0..400).collect::<Vec<u64>>(), &files)
        .unwrap();
    let cache = Arc::new(DecodedCache::new(probe.stats().bytes * 2 / 3));
    let kept_dir = tempfile::tempdir().unwrap();
    let kept =
        Arc::new(DirKept { dir: kept_dir.path().to_owned(), writes: 0.into(), opens: 0.into(), again: 0.into() });
    Spill { ds, files, proj, cache, kept, _dirs: (dir, kept_dir) }
}

/// A projection whose decoded row groups outgrow the budget: the first epoch keeps nothing; the
/// second keeps every row group, those it decodes again and those the first left in memory; the
/// third decodes none and writes none. Every batch holds the rows its ids name.
#[test]
fn row_groups_the_budget_lets_go_of_are_kept_from_their_second_decode_on() {
    let Spill { ds, files, proj, cache, kept, _dirs } = spill();
    let units = ds.unit_rows().len() as u64;
    let asm = BatchAssembler::new(ds.clone(), proj, cache.clone(), "ds").unwrap().with_kept(kept.clone());
    let full = testdata::mixed_batch(0..400);
    let epoch = |seed: u64| {
        let p = EpochParams { world_size: 1, rank: 0, ..params(seed, 0) };
        let seq = plan::rank_sequence(ds.unit_rows(), &p).unwrap();
        for chunk in seq.chunks(16) {
            let b = asm.batch(chunk, &files).unwrap();
            for (k, &id) in chunk.iter().enumerate() {
                let want = full.slice(id as usize, 1).project(&[0, 2, 3]).unwrap();
                assert_eq!(&b.slice(k, 1).columns()[..3], want.columns(), "row {id}");
            }
        }
    };
    epoch(1);
    assert_eq!(DirKept::count(&kept.writes), 0, "one decode of each row group: nothing kept");
    let after_first = cache.stats();
    assert_eq!(after_first.misses, units);
    assert!(after_first.entries > 0 && after_first.evictions > 0);
    epoch(2);
    assert_eq!(DirKept::count(&kept.writes), units as u32, "every row group kept by the second epoch");
    let (misses, opens) = (cache.stats().misses, DirKept::count(&kept.opens));
    epoch(3);
    assert_eq!(DirKept::count(&kept.writes), units as u32, "nothing written again");
    // What the budget let go of comes back from the kept files, never decoded.
    let loaded = DirKept::count(&kept.opens) - opens;
    assert_eq!(cache.stats().misses - misses, u64::from(loaded));
    assert!(loaded > 0);
    assert_eq!(DirKept::count(&kept.again), 0);
}

/// Two streams of one projection (two DataLoader workers) that both find it too large: a row
/// group one of them kept is not kept again by the other, which finds it loaded in the cache.
#[test]
fn a_row_group_another_stream_kept_is_not_kept_again() {
    let Spill { ds, files, proj, cache, kept, _dirs } = spill();
    let units = ds.unit_rows().len() as u32;
    let workers: Vec<BatchAssembler> = (0..2)
        .map(|_| BatchAssembler::new(ds.clone(), proj.clone(), cache.clone(), "ds").unwrap().with_kept(kept.clone()))
        .collect();
    for seed in 1..=3 {
        let p = EpochParams { world_size: 1, rank: 0, ..params(seed, 0) };
        let seq = plan::rank_sequence(ds.unit_rows(), &p).unwrap();
        for (i, chunk) in seq.chunks(16).enumerate() {
            let b = workers[i % 2].batch(chunk, &files).unwrap();
            assert_eq!(ids(&b), chunk.iter().map(|&i| i as i64).collect::<Vec<_>>());
        }
    }
    assert_eq!(DirKept::count(&kept.writes), units, "every row group kept");
    assert_eq!(DirKept::count(&kept.again), 0, "none asked for twice");
}

/// An inline batch beyond the message limit goes as runs of its rows, in order, each an IPC
/// stream within the limit, `more` on all but the last; together exactly the batch sent whole.
/// Flat columns are measured without being written, a list column is encoded to be measured:
/// both ways are split. A row beyond the limit by itself is named; a client that joins no parts
/// gets the batch's size.
#[test]
fn an_inline_batch_beyond_the_message_limit_is_split_into_runs_of_rows_within_it() {
    use shardstream::transport::arrow::{Inline, inline_rows};
    let dir = tempfile::tempdir().unwrap();
    let (ds, files, _) = open(dir.path(), &three_files()).unwrap();
    let cache = Arc::new(DecodedCache::new(64 << 20));
    let batch_ids: Vec<u64> = (0..400).rev().step_by(3).collect();
    for fields in [&["id", "image", "caption"][..], &["id", "image", "tokens"][..]] {
        let fields: Vec<String> = fields.iter().map(|f| f.to_string()).collect();
        let asm = BatchAssembler::new(ds.clone(), ds.projection(Some(&fields)).unwrap(), cache.clone(), "ds").unwrap();
        let rows = asm.rows(&batch_ids, &files).unwrap();
        let whole = asm.batch(&batch_ids, &files).unwrap();
        let Inline::Sent(one) = inline_rows(7, batch_ids.clone(), &asm, &rows, 1 << 30, true).unwrap() else {
            panic!("a batch within the limit is sent")
        };
        assert_eq!(one.len(), 1);
        let size = one[0].data.len() as u64;
        let limit = size / 5;
        let Inline::Sent(parts) = inline_rows(7, batch_ids.clone(), &asm, &rows, limit, true).unwrap() else {
            panic!("{fields:?}: a batch of small rows is split")
        };
        assert!(parts.len() >= 5, "{fields:?}: {} parts of at most {limit} bytes for {size}", parts.len());
        let mut joined = Vec::new();
        for (k, p) in parts.iter().enumerate() {
            assert_eq!(p.more, k + 1 < parts.len(), "{fields:?}: `more` on all parts but the last");
            assert!(p.batch_index == 7 && p.part_indices.is_empty());
            assert!(p.data.len() as u64 <= limit && p.length == p.data.len() as u64, "{fields:?}: part {k}");
            let b = read_one(&p.data);
            assert_eq!(row_column(&b), p.row_ids, "{fields:?}: part {k}'s rows are its row ids");
            joined.push(b);
        }
        let joined = arrow_select::concat::concat_batches(&whole.schema(), &joined).unwrap();
        assert_eq!(joined, whole, "{fields:?}: the parts are the batch, in order");
        // One row alone beyond the limit: named, whatever the batch around it.
        let tiny = 64;
        match inline_rows(7, batch_ids.clone(), &asm, &rows, tiny, true).unwrap() {
            Inline::RowTooLarge { row, bytes } => assert!(batch_ids.contains(&row) && bytes > tiny),
            other => panic!("{fields:?}: {other:?}"),
        }
        // A client that joins no parts: the batch's size, for the batch size that would fit.
        match inline_rows(7, batch_ids.clone(), &asm, &rows, limit, false).unwrap() {
            Inline::BatchTooLarge { bytes } => assert_eq!(bytes, size),
            other => panic!("{fields:?}: {other:?}"),
        }
    }
}

fn read_one(bytes: &[u8]) -> RecordBatch {
    let mut r = arrow_ipc::reader::StreamReader::try_new(Cursor::new(bytes), None).unwrap();
    let b = r.next().unwrap().unwrap();
    assert!(r.next().is_none(), "one record batch a part");
    b
}
