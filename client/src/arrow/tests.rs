use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{
    Array, ArrayRef, DictionaryArray, FixedSizeBinaryArray, Float64Array, Int8Array, Int64Array, RecordBatch,
    StringArray, StructArray, UInt64Array, types::Int32Type,
};
use arrow_buffer::{Buffer, NullBuffer};
use arrow_schema::{DataType, Field, Schema};
use proptest::prelude::*;
use shardstream_proto::ARROW_VIEW_KEY;

use super::{ArrowReadError, ArrowReader, ROW_COLUMN};

/// `batch` as one IPC stream (schema, dictionaries, batch, end marker), in an aligned buffer as
/// the daemon writes it.
fn ipc(batch: &RecordBatch) -> Buffer {
    let mut out = Vec::new();
    let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut out, &batch.schema()).expect("writer");
    w.write(batch).expect("write");
    w.finish().expect("finish");
    drop(w);
    // `Buffer::from(Vec)` is 64-byte aligned (arrow's own allocation).
    Buffer::from(out.as_slice())
}

fn inside(outer: &Buffer, ptr: *const u8, len: usize) -> bool {
    let (start, end) = (outer.as_ptr() as usize, outer.as_ptr() as usize + outer.len());
    ptr as usize >= start && ptr as usize + len <= end
}

fn tab(first: i64) -> RecordBatch {
    RecordBatch::try_from_iter([
        ("id", Arc::new(Int64Array::from_iter_values(first..first + 3)) as ArrayRef),
        ("x", Arc::new(Float64Array::from(vec![0.5; 3])) as ArrayRef),
    ])
    .expect("batch")
}

#[test]
fn the_schema_is_read_once_and_batches_past_it_zero_copy() {
    let mut reader = ArrowReader::new();
    let streams = [ipc(&tab(0)), ipc(&tab(3))];
    let got: Vec<_> = streams.iter().map(|s| reader.open(s, &[], 3).expect("open").batch).collect();
    let kept = &reader.known.as_ref().expect("the schema message was not kept").prefix;
    // The first message's buffer is its ring slot: a slice of it would hold the slot (one of the
    // stream's credits) for the whole stream.
    assert!(!inside(&streams[0], kept.as_ptr(), kept.len()), "the kept schema message is in the first message");
    let ids = |b: &RecordBatch| b.column(0).as_primitive::<arrow_array::types::Int64Type>().values().to_vec();
    assert_eq!(ids(&got[0]), [0, 1, 2]);
    assert_eq!(ids(&got[1]), [3, 4, 5]);
    let second = got[1].column(0).to_data();
    let values = &second.buffers()[0];
    assert!(inside(&streams[1], values.as_ptr(), values.len()), "the batch read past the schema was copied");
    // Another schema: read whole, and kept in its turn.
    let other = RecordBatch::try_from_iter([("y", Arc::new(Int8Array::from(vec![1, 2])) as ArrayRef)]).expect("b");
    assert_eq!(reader.open(&ipc(&other), &[], 2).expect("open").batch.schema().field(0).name(), "y");
    let again = reader.open(&ipc(&tab(6)), &[], 3).expect("open");
    assert_eq!(ids(&again.batch), [6, 7, 8]);
    assert!(!again.has_row, "no `__row__` column: an older daemon's batch, whose ids the client appends");
}

#[test]
fn streams_with_dictionaries_are_read_whole_each_time() {
    let cats: DictionaryArray<Int32Type> = vec!["a", "b"].into_iter().collect();
    let batch = RecordBatch::try_from_iter([("c", Arc::new(cats) as ArrayRef)]).expect("batch");
    let mut reader = ArrowReader::new();
    for _ in 0..2 {
        let got = reader.open(&ipc(&batch), &[], 2).expect("open").batch;
        let c = got.column(0).as_dictionary::<Int32Type>();
        let words = c.values().as_string::<i32>();
        let keys: Vec<&str> = c.keys().values().iter().map(|&k| words.value(k as usize)).collect();
        assert_eq!(keys, ["a", "b"]);
        assert!(reader.known.is_none());
    }
}

#[test]
fn bad_bytes_a_wrong_row_count_and_misaligned_streams_are_named_errors() {
    let mut reader = ArrowReader::new();
    let zeros = Buffer::from(vec![0u8; 64]);
    assert!(matches!(reader.open(&zeros, &[], 3), Err(ArrowReadError::Stream(_))), "zeros");
    let junk = Buffer::from(vec![0xABu8; 64]);
    let e = reader.open(&junk, &[], 3).expect_err("junk");
    assert!(e.to_string().starts_with("not a valid Arrow IPC stream: "), "{e}");
    let good = ipc(&tab(0));
    let e = reader.open(&good, &[], 4).expect_err("rows");
    assert_eq!(e.to_string(), "record batch has 3 rows, the message names 4");
    // One byte off its alignment: an error, not a silent copy.
    let mut skewed = vec![0u8; 1];
    skewed.extend_from_slice(good.as_slice());
    let skewed = Buffer::from(skewed).slice(1);
    let e = ArrowReader::new().open(&skewed, &[], 3).expect_err("misaligned");
    assert!(e.to_string().contains("align"), "{e}");
}

/// A column of views as the daemon sends them: `fixed_size_binary(16)`, marked.
fn views_field(name: &str) -> Field {
    Field::new(name, DataType::FixedSizeBinary(16), true)
        .with_metadata(HashMap::from([(ARROW_VIEW_KEY.to_owned(), "binary".to_owned())]))
}

/// An Arrow binary view: inline up to 12 bytes, else prefix, buffer index and offset.
fn view(value: &[u8], buffer: u32, offset: u32) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..4].copy_from_slice(&(value.len() as u32).to_le_bytes());
    if value.len() <= 12 {
        v[4..4 + value.len()].copy_from_slice(value);
    } else {
        v[4..8].copy_from_slice(&value[..4]);
        v[8..12].copy_from_slice(&buffer.to_le_bytes());
        v[12..].copy_from_slice(&offset.to_le_bytes());
    }
    v
}

fn views(rows: &[Option<[u8; 16]>]) -> FixedSizeBinaryArray {
    FixedSizeBinaryArray::try_from_sparse_iter_with_size(rows.iter().map(|r| r.as_ref().map(|v| v.to_vec())), 16)
        .expect("views")
}

#[test]
fn view_columns_are_binary_views_over_the_segments_at_the_top_and_in_structs() {
    let segment = Buffer::from(b"the first long value|second one, also long".as_slice());
    let (a, b) = (&segment.as_slice()[..21], &segment.as_slice()[21..]);
    let top = views(&[Some(view(a, 0, 0)), None, Some(view(b"short", 0, 0))]);
    let path = StringArray::from(vec![Some("a.jpg"), None, Some("c.jpg")]);
    let child = views(&[Some(view(b, 0, 21)), None, Some(view(a, 0, 0))]);
    let image_fields = vec![views_field("bytes"), Field::new("path", DataType::Utf8, true)];
    let image = StructArray::try_new(
        image_fields.clone().into(),
        vec![Arc::new(child) as ArrayRef, Arc::new(path)],
        Some(NullBuffer::from(vec![true, false, true])),
    )
    .expect("struct");
    let ids = UInt64Array::from(vec![7, 8, 9]);
    let schema = Schema::new(vec![
        views_field("blob"),
        Field::new("image", DataType::Struct(image_fields.into()), true),
        Field::new(ROW_COLUMN, DataType::UInt64, false),
    ]);
    let batch =
        RecordBatch::try_new(Arc::new(schema), vec![Arc::new(top), Arc::new(image), Arc::new(ids)]).expect("batch");
    let opened = ArrowReader::new().open(&ipc(&batch), std::slice::from_ref(&segment), 3).expect("open");
    assert!(opened.has_row);
    let got = opened.batch;
    assert_eq!(got.schema().field(0).data_type(), &DataType::BinaryView);
    assert!(got.schema().field(0).metadata().is_empty(), "the marker is dropped");
    let blob = got.column(0).as_binary_view();
    assert_eq!((blob.value(0), blob.is_null(1), blob.value(2)), (a, true, b"short".as_slice()));
    assert!(inside(&segment, blob.value(0).as_ptr(), a.len()), "a view's value was copied");
    let image = got.column(1).as_struct();
    assert!(image.is_null(1));
    let bytes = image.column(0).as_binary_view();
    assert_eq!((bytes.value(0), bytes.value(2)), (b, a));
    assert_eq!(image.column(1).as_string::<i32>().value(2), "c.jpg");
}

#[test]
fn a_view_outside_its_segment_or_naming_no_segment_is_an_error_naming_the_column() {
    let segment = Buffer::from(vec![b'x'; 64]);
    let long = [b'x'; 20];
    for (bad, what) in [(view(&long, 0, 50), "past the end"), (view(&long, 1, 0), "a missing segment")] {
        let schema = Arc::new(Schema::new(vec![views_field("blob")]));
        let batch = RecordBatch::try_new(schema, vec![Arc::new(views(&[Some(bad)]))]).expect("batch");
        let e = ArrowReader::new().open(&ipc(&batch), std::slice::from_ref(&segment), 1).expect_err(what);
        assert!(matches!(&e, ArrowReadError::Views { column, .. } if column == "blob"), "{what}: {e}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Damaged streams (cut short, bytes changed) open or fail; never a panic.
    #[test]
    fn damaged_streams_never_panic(cut in 0usize..2048, flips in proptest::collection::vec((0usize..2048, any::<u8>()), 0..6)) {
        let segment = Buffer::from(vec![b'v'; 256]);
        let schema = Arc::new(Schema::new(vec![views_field("blob"), Field::new("s", DataType::Utf8, true)]));
        let rows = [Some(view(&[b'v'; 40], 0, 8)), None, Some(view(b"tiny", 0, 0))];
        let batch = RecordBatch::try_new(schema, vec![
            Arc::new(views(&rows)),
            Arc::new(StringArray::from(vec![Some("a"), None, Some("ccc")])),
        ]).expect("batch");
        let whole = ipc(&batch);
        let mut bytes = whole.as_slice().to_vec();
        bytes.truncate(cut.min(bytes.len()));
        for (at, b) in flips {
            if let Some(x) = bytes.get_mut(at) {
                *x = b;
            }
        }
        let mut reader = ArrowReader::new();
        // Once with a kept schema, once without.
        let _ = reader.open(&whole, std::slice::from_ref(&segment), 3);
        let _ = reader.open(&Buffer::from(bytes.as_slice()), std::slice::from_ref(&segment), 3);
        let _ = ArrowReader::new().open(&Buffer::from(bytes.as_slice()), std::slice::from_ref(&segment), 3);
    }
}
