//! Parquet shards (`--format parquet`): one file per shard, one row per sample.
//!
//! Schema: `__key__` (UTF-8, not null), then one `binary` column per field of the dataset, in
//! field-name order, null where a sample lacks the field. Every shard has every column, so a
//! dataset of shards reads as one table (pyarrow, DuckDB, Spark, Hugging Face `datasets`).
//!
//! Row groups hold `--row-group-size` rows, and are cut earlier when their payload would pass
//! [`ROW_GROUP_MAX_BYTES`]: a row group is buffered in memory until it is written, so this bounds
//! the writer's memory and keeps every column of a batch under Arrow's 2 GiB offset limit.
//!
//! Encoding choices, for payloads that are mostly already-compressed media: no dictionary (every
//! value is distinct; trying one costs time and then falls back), no statistics on payload columns
//! (min/max of image bytes mean nothing), compression off by default (`--parquet-compression`
//! snappy or zstd for text-heavy fields). The output is deterministic: the Parquet writer adds no
//! timestamps, only its version in `created_by`, and the pack fingerprint includes this build.

use std::fs::File;
use std::sync::Arc;

use arrow_array::builder::{BinaryBuilder, StringBuilder};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::{EnabledStatistics, WriterProperties};
use parquet::schema::types::ColumnPath;

use super::read::LoadedSample;
use super::shard_file::CrcFile;
use crate::{Error, Result};

/// The key column, named as WebDataset names it.
pub const KEY_COLUMN: &str = "__key__";
/// Largest payload of one row group before it is cut early (see the module docs).
pub const ROW_GROUP_MAX_BYTES: u64 = 128 << 20;
/// Default rows per row group: ~20 MB of typical 20 KB images, large enough for efficient
/// sequential reads, small enough that a reader needing one sample reads little else.
pub const DEFAULT_ROW_GROUP_ROWS: usize = 1024;
/// zstd level for `--parquet-compression zstd`: zstd's own default, a good speed/ratio balance.
const ZSTD_LEVEL: i32 = 3;

/// Compression of Parquet pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ParquetCompression {
    #[default]
    None,
    Snappy,
    Zstd,
}

/// Parquet settings shared by all shards of a pack.
#[derive(Debug, Clone)]
pub struct ParquetOptions<'a> {
    /// All fields of the dataset, sorted: one column each.
    pub fields: &'a [String],
    pub row_group_rows: usize,
    pub compression: ParquetCompression,
}

fn perr(e: impl std::fmt::Display) -> Error {
    Error::Internal(format!("parquet writer: {e}"))
}

/// One Parquet shard being written.
pub struct ParquetShard<'a> {
    writer: ArrowWriter<CrcFile>,
    schema: SchemaRef,
    opts: ParquetOptions<'a>,
    keys: StringBuilder,
    columns: Vec<BinaryBuilder>,
    rows: usize,
    bytes: u64,
}

impl<'a> ParquetShard<'a> {
    pub fn new(out: CrcFile, opts: &ParquetOptions<'a>) -> Result<Self> {
        let mut fields = vec![Field::new(KEY_COLUMN, DataType::Utf8, false)];
        fields.extend(opts.fields.iter().map(|f| Field::new(f, DataType::Binary, true)));
        let schema = Arc::new(Schema::new(fields));
        let compression = match opts.compression {
            ParquetCompression::None => Compression::UNCOMPRESSED,
            ParquetCompression::Snappy => Compression::SNAPPY,
            ParquetCompression::Zstd => Compression::ZSTD(ZstdLevel::try_new(ZSTD_LEVEL).map_err(perr)?),
        };
        let props = WriterProperties::builder()
            .set_compression(compression)
            .set_dictionary_enabled(false)
            .set_statistics_enabled(EnabledStatistics::None)
            .set_column_statistics_enabled(ColumnPath::from(KEY_COLUMN), EnabledStatistics::Chunk)
            // Row groups are cut by `add`, never by the writer.
            .set_max_row_group_row_count(None)
            .set_max_row_group_bytes(None)
            .build();
        let writer = ArrowWriter::try_new(out, schema.clone(), Some(props)).map_err(perr)?;
        Ok(Self {
            writer,
            schema,
            opts: opts.clone(),
            keys: StringBuilder::new(),
            columns: opts.fields.iter().map(|_| BinaryBuilder::new()).collect(),
            rows: 0,
            bytes: 0,
        })
    }

    pub fn add(&mut self, s: &LoadedSample<'_>) -> Result<()> {
        if self.rows > 0 && self.bytes + s.payload > ROW_GROUP_MAX_BYTES {
            self.flush_group()?;
        }
        self.keys.append_value(s.key);
        // Both lists are sorted by field name: one merge walk.
        let mut members = s.members.iter().peekable();
        for (field, col) in self.opts.fields.iter().zip(&mut self.columns) {
            match members.peek() {
                Some((f, range)) if *f == field => {
                    col.append_value(&s.buf[range.clone()]);
                    members.next();
                }
                _ => col.append_null(),
            }
        }
        if let Some((f, _)) = members.next() {
            return Err(Error::Internal(format!("field {f:?} of sample {:?} has no column", s.key)));
        }
        self.rows += 1;
        self.bytes += s.payload;
        if self.rows >= self.opts.row_group_rows || self.bytes >= ROW_GROUP_MAX_BYTES {
            self.flush_group()?;
        }
        Ok(())
    }

    fn flush_group(&mut self) -> Result<()> {
        if self.rows == 0 {
            return Ok(());
        }
        let mut arrays: Vec<ArrayRef> = vec![Arc::new(self.keys.finish())];
        arrays.extend(self.columns.iter_mut().map(|c| Arc::new(c.finish()) as ArrayRef));
        let batch = RecordBatch::try_new(self.schema.clone(), arrays).map_err(perr)?;
        self.writer.write(&batch).map_err(perr)?;
        self.writer.flush().map_err(perr)?;
        self.rows = 0;
        self.bytes = 0;
        Ok(())
    }

    /// Writes the last row group and the footer; returns the file, its length and CRC-32C.
    pub fn finish(mut self) -> Result<(File, u64, u32)> {
        self.flush_group()?;
        let out = self.writer.into_inner().map_err(perr)?;
        out.finish()
    }
}
