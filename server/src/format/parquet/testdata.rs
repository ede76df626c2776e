//! Parquet files for tests, written by the `parquet` crate's `ArrowWriter`: several codecs and
//! row-group sizes, nulls, list, binary, large_binary and large_string columns. Self-contained
//! (only the crate's dependencies), so integration tests include it with `#[path]`.

#![allow(dead_code)]

use std::sync::Arc;

use arrow_array::builder::{Int32Builder, ListBuilder};
use arrow_array::{
    ArrayRef, BinaryArray, Int32Array, Int64Array, LargeBinaryArray, LargeStringArray, RecordBatch, StringArray,
};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;

#[derive(Debug, Clone, Copy)]
pub enum Codec {
    None,
    Snappy,
    Zstd,
}

fn props(codec: Codec, rg_rows: usize) -> WriterProperties {
    let c = match codec {
        Codec::None => Compression::UNCOMPRESSED,
        Codec::Snappy => Compression::SNAPPY,
        Codec::Zstd => Compression::ZSTD(ZstdLevel::default()),
    };
    WriterProperties::builder().set_compression(c).set_max_row_group_row_count(Some(rg_rows)).build()
}

/// The bytes of `image` for row `i`: its id repeated, 100-400 bytes.
pub fn image(i: i64) -> Vec<u8> {
    let n = 100 + (i as usize * 37) % 300;
    (0..n).map(|k| (i as u8).wrapping_add(k as u8)).collect()
}

/// Schema of [`mixed_from`]: id, label (nulls every 7th row), caption (utf8, null every 5th),
/// image (binary), blob (large_binary), text (large_utf8), tokens (list<int32>, 0-4 items).
pub fn mixed_schema() -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("label", DataType::Int32, true),
        Field::new("caption", DataType::Utf8, true),
        Field::new("image", DataType::Binary, false),
        Field::new("blob", DataType::LargeBinary, false),
        Field::new("text", DataType::LargeUtf8, false),
        Field::new("tokens", DataType::new_list(DataType::Int32, true), true),
    ]))
}

/// The record batch of rows `ids` in [`mixed_schema`].
pub fn mixed_batch(ids: std::ops::Range<i64>) -> RecordBatch {
    let id: Vec<i64> = ids.collect();
    let label: Int32Array = id.iter().map(|&i| (i % 7 != 0).then_some((i % 10) as i32)).collect();
    let caption: StringArray = id.iter().map(|&i| (i % 5 != 0).then(|| format!("caption {i}"))).collect();
    let images: Vec<Vec<u8>> = id.iter().map(|&i| image(i)).collect();
    let image_arr = BinaryArray::from_iter_values(images.iter());
    let blob = LargeBinaryArray::from_iter_values(id.iter().map(|&i| i.to_le_bytes()));
    let text = LargeStringArray::from_iter_values(id.iter().map(|&i| format!("row-{i:06}")));
    let mut tokens = ListBuilder::new(Int32Builder::new());
    for &i in &id {
        for k in 0..(i % 5) {
            tokens.values().append_value((i * 10 + k) as i32);
        }
        tokens.append(i % 11 != 0);
    }
    let cols: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(id.clone())),
        Arc::new(label),
        Arc::new(caption),
        Arc::new(image_arr),
        Arc::new(blob),
        Arc::new(text),
        Arc::new(tokens.finish()),
    ];
    RecordBatch::try_new(mixed_schema(), cols).expect("test batch")
}

/// A file of rows `first..first + rows` in [`mixed_schema`], row groups of `rg_rows`.
pub fn mixed_from(first: i64, rows: usize, rg_rows: usize, codec: Codec) -> Vec<u8> {
    let mut w = ArrowWriter::try_new(Vec::new(), mixed_schema(), Some(props(codec, rg_rows))).expect("writer");
    if rows > 0 {
        w.write(&mixed_batch(first..first + rows as i64)).expect("write");
    }
    w.into_inner().expect("finish")
}

/// [`mixed_from`] starting at row id 0.
pub fn mixed(rows: usize, rg_rows: usize, codec: Codec) -> Vec<u8> {
    mixed_from(0, rows, rg_rows, codec)
}

/// `cols` int32 columns `c0..`, `rows` rows in row groups of `rg_rows`: a large footer.
pub fn wide(rows: usize, rg_rows: usize, cols: usize) -> Vec<u8> {
    let schema = Arc::new(Schema::new(
        (0..cols).map(|c| Field::new(format!("c{c}"), DataType::Int32, false)).collect::<Vec<_>>(),
    ));
    let arrays: Vec<ArrayRef> = (0..cols)
        .map(|c| Arc::new(Int32Array::from_iter_values((0..rows as i32).map(|r| r + c as i32))) as ArrayRef)
        .collect();
    let batch = RecordBatch::try_new(schema.clone(), arrays).expect("test batch");
    let mut w = ArrowWriter::try_new(Vec::new(), schema, Some(props(Codec::None, rg_rows))).expect("writer");
    w.write(&batch).expect("write");
    w.into_inner().expect("finish")
}

/// `rows` rows of one int32 column `c` holding `value`: run-length encoded, a few hundred bytes
/// whatever the count; one row group.
pub fn constant(rows: usize, value: i32) -> Vec<u8> {
    let schema = Arc::new(Schema::new(vec![Field::new("c", DataType::Int32, false)]));
    let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(Int32Array::from_value(value, rows)) as ArrayRef])
        .expect("test batch");
    let mut w = ArrowWriter::try_new(Vec::new(), schema, Some(props(Codec::None, rows))).expect("writer");
    w.write(&batch).expect("write");
    w.into_inner().expect("finish")
}

/// A file with the given schema and one batch (for schema-mismatch tests).
pub fn with_batch(batch: &RecordBatch) -> Vec<u8> {
    let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), None).expect("writer");
    w.write(batch).expect("write");
    w.into_inner().expect("finish")
}
