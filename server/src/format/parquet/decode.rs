//! Decoding one row group of the selected columns.
//!
//! The selected column chunks of the row group are read first, each exactly once (adjacent chunks
//! merged into one read), into a [`ChunkSet`]; the decoder then reads only from that set. A read
//! outside it is an error, not a silent fetch: projection pushdown holds by construction (an
//! unselected column chunk is never read, locally or from S3), and a damaged page header that
//! points elsewhere cannot make the decoder wander over the file.
//!
//! The decoder (arrow-rs) runs under [`crate::panics::catch`]: a corrupt page becomes a
//! [`ParquetError::BadData`] naming the row group and where arrow-rs gave up, never a daemon
//! panic and never garbage rows (the decoded row count is checked against the footer's).

use std::ops::Range;

use arrow_array::{RecordBatch, RecordBatchReader};
use bytes::{Buf, Bytes};
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::file::reader::{ChunkReader, Length};

use super::schema::FileProjection;
use super::{ParquetError, ParquetTable, no_panic, pages};

/// Chunks closer than this are read as one range: a small gap costs less than another request
/// (S3 first-byte latency is ~10-30 ms; a local read of 64 KiB is a few microseconds).
pub const MERGE_GAP: u64 = 64 << 10;

/// The file ranges to read to decode row group `rg` of `proj`: the selected leaf columns' chunks,
/// sorted and merged when at most [`MERGE_GAP`] apart.
pub fn chunk_ranges(table: &ParquetTable, rg: usize, proj: &FileProjection) -> Vec<Range<u64>> {
    merge_ranges(leaf_chunks(table, rg, proj).collect())
}

/// The byte ranges of the selected leaf columns' chunks of row group `rg`, one each, unmerged.
pub fn leaf_chunks<'a>(
    table: &'a ParquetTable,
    rg: usize,
    proj: &'a FileProjection,
) -> impl Iterator<Item = Range<u64>> + 'a {
    let leaves = table.reader_metadata().parquet_schema().num_columns();
    (0..leaves)
        .filter(|&c| proj.mask.leaf_included(c))
        .filter_map(move |c| table.chunk_range(rg, c))
        .filter(|r| !r.is_empty())
}

/// What row group `rg` of `proj` takes decoded, as the footer tells it without reading a page:
/// the uncompressed sizes of the selected leaf columns' chunks (a negative size, which the decode
/// refuses, counts 0). Dictionary-encoded values decode to more than that.
pub fn projected_bytes(table: &ParquetTable, rg: usize, proj: &FileProjection) -> u64 {
    let Some(meta) = table.reader_metadata().metadata().row_groups().get(rg) else { return 0 };
    meta.columns()
        .iter()
        .enumerate()
        .filter(|&(c, _)| proj.mask.leaf_included(c))
        .map(|(_, chunk)| u64::try_from(chunk.uncompressed_size()).unwrap_or(0))
        // The sizes are the footer's, any i64: summed as they are, two near i64::MAX would wrap.
        .fold(0, u64::saturating_add)
}

/// `ranges` sorted by start, overlapping ones and ones at most [`MERGE_GAP`] apart made one.
pub fn merge_ranges(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.sort_unstable_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match merged.last_mut() {
            Some(last) if r.start <= last.end.saturating_add(MERGE_GAP) => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

/// Some byte ranges of a file, in memory: all the decoder may read.
#[derive(Debug, Clone, Default)]
pub struct ChunkSet {
    file_len: u64,
    /// Sorted, disjoint.
    pieces: Vec<(u64, Bytes)>,
}

impl ChunkSet {
    /// Reads `ranges` (sorted, disjoint: what [`chunk_ranges`] gives) of a file of `file_len`
    /// bytes with `read_at(offset, len)`, which returns exactly `len` bytes.
    pub fn read<B: Into<Bytes>>(
        file_len: u64,
        ranges: &[Range<u64>],
        mut read_at: impl FnMut(u64, usize) -> Result<B, ParquetError>,
    ) -> Result<Self, ParquetError> {
        let mut pieces = Vec::with_capacity(ranges.len());
        for r in ranges {
            if r.end > file_len || r.start > r.end {
                return Err(ParquetError::Truncated(format!("bytes {r:?} lie past its end ({file_len})")));
            }
            let len = usize::try_from(r.end - r.start).map_err(|_| ParquetError::Io("chunk too large".into()))?;
            let buf: Bytes = read_at(r.start, len)?.into();
            if buf.len() != len {
                return Err(ParquetError::Io(format!(
                    "read {} bytes at {} where {len} were asked for",
                    buf.len(),
                    r.start
                )));
            }
            pieces.push((r.start, buf));
        }
        Self::from_pieces(file_len, pieces)
    }

    /// A set of pieces already in memory (e.g. ranged GETs); they must be disjoint.
    pub fn from_pieces(file_len: u64, mut pieces: Vec<(u64, Bytes)>) -> Result<Self, ParquetError> {
        pieces.sort_unstable_by_key(|(s, _)| *s);
        let mut end = 0;
        for (s, b) in &pieces {
            if *s < end {
                return Err(ParquetError::Io("overlapping chunk pieces".into()));
            }
            end = s + b.len() as u64;
        }
        Ok(Self { file_len, pieces })
    }

    /// The pieces, by file offset.
    #[cfg(test)]
    pub fn pieces(&self) -> &[(u64, Bytes)] {
        &self.pieces
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.pieces.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// The bytes from `start` to the end of the piece holding it.
    fn rest_from(&self, start: u64) -> parquet::errors::Result<Bytes> {
        let i = self.pieces.partition_point(|(s, _)| *s <= start);
        let hit = i.checked_sub(1).and_then(|i| self.pieces.get(i)).and_then(|(s, b)| {
            let off = usize::try_from(start - s).ok()?;
            (off < b.len()).then(|| b.slice(off..))
        });
        hit.ok_or_else(|| {
            parquet::errors::ParquetError::General(format!("read at offset {start} outside the selected column chunks"))
        })
    }
}

impl Length for ChunkSet {
    fn len(&self) -> u64 {
        self.file_len
    }
}

impl ChunkReader for ChunkSet {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        Ok(self.rest_from(start)?.reader())
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        let rest = self.rest_from(start)?;
        if rest.len() < length {
            return Err(parquet::errors::ParquetError::General(format!(
                "read of {length} bytes at offset {start} runs past the selected column chunks"
            )));
        }
        Ok(rest.slice(..length))
    }
}

/// The most rows arrow-rs decodes in one batch of a row group whose rows its bytes do not
/// account for (see [`decode_row_group`]).
const DECODE_BATCH_ROWS: usize = 1 << 20;

/// Decodes row group `rg` of `proj` from `chunks` (which hold at least [`chunk_ranges`]) into one
/// record batch in the delivered schema and column order.
pub fn decode_row_group(
    table: &ParquetTable,
    rg: usize,
    proj: &FileProjection,
    chunks: ChunkSet,
) -> Result<RecordBatch, ParquetError> {
    let rows = table.row_group_rows(rg);
    let bad = |reason: String| ParquetError::BadData { row_group: rg, reason };
    if rg >= table.num_row_groups() {
        return Err(bad(format!("the file has {} row groups", table.num_row_groups())));
    }
    let exact_rows = usize::try_from(rows).map_err(|_| bad(format!("{rows} rows")))?;
    // arrow-rs reserves a batch's rows up front, sized by the footer's claim. A row group whose
    // selected chunks could hold its rows (a bit a row at least) decodes in one batch, as ever;
    // rows out of proportion to the bytes (a crafted claim, or long runs of one value) decode in
    // batches of DECODE_BATCH_ROWS, concatenated, so that what is reserved before a page is read
    // is bounded by the bytes there are.
    let bits = {
        let meta = table.reader_metadata().metadata().row_group(rg);
        (0..meta.num_columns())
            .filter(|&c| proj.mask.leaf_included(c))
            .map(|c| u64::try_from(meta.column(c).uncompressed_size()).unwrap_or(0))
            .fold(0, u64::saturating_add)
            .saturating_mul(8)
    };
    let batch_rows = if rows <= bits { exact_rows.max(1) } else { exact_rows.clamp(1, DECODE_BATCH_ROWS) };
    // Caught too: partition keys, widenings and string checks call arrow-rs kernels that assert
    // on what they are given (a text key past 2 GiB of offsets did, before it was refused).
    let arrange = |decoded: &RecordBatch| {
        no_panic(
            || {
                proj.arrange(decoded).map_err(|e| match e {
                    ParquetError::BadData { reason, .. } => bad(reason),
                    ParquetError::Unfit { reason, .. } => ParquetError::Unfit { row_group: rg, reason },
                    e => e,
                })
            },
            |msg| bad(format!("arranging the decoded columns panicked: {msg}")),
        )
    };
    if proj.reads_nothing() {
        // Only partition keys: the row group's rows are its row count, nothing is decoded.
        let options = arrow_array::RecordBatchOptions::new().with_row_count(Some(exact_rows));
        let none =
            RecordBatch::try_new_with_options(std::sync::Arc::new(arrow_schema::Schema::empty()), vec![], &options)
                .map_err(|e| bad(e.to_string()))?;
        return arrange(&none);
    }
    check_pages(table, rg, proj, &chunks).map_err(bad)?;
    let decoded = match decode_mask(table, rg, proj, proj.mask.clone(), chunks.clone(), batch_rows) {
        Ok(decoded) => decoded,
        // arrow-rs decodes the selected columns together and its errors (a codec's "corrupt
        // input", a short page) do not say whose page it was: decoding each column alone, on
        // this error path only, finds the one to name.
        Err(reason) => return Err(bad(name_bad_column(table, rg, proj, &chunks, batch_rows).unwrap_or(reason))),
    };
    if decoded.num_rows() as u64 != rows {
        return Err(bad(format!("decoded {} rows but the footer says {rows}", decoded.num_rows())));
    }
    arrange(&decoded)
}

/// Decodes row group `rg`'s columns in `mask` from `chunks` into one batch, in arrow-rs's order;
/// an error (or a panic of the decoder) is its reason.
fn decode_mask(
    table: &ParquetTable,
    rg: usize,
    proj: &FileProjection,
    mask: parquet::arrow::ProjectionMask,
    chunks: ChunkSet,
    batch_rows: usize,
) -> Result<RecordBatch, String> {
    crate::panics::catch(|| {
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(chunks, proj.reader_metadata(table).clone())
            .with_row_groups(vec![rg])
            .with_projection(mask)
            .with_batch_size(batch_rows)
            .build()
            .map_err(|e| e.to_string())?;
        let schema = reader.schema();
        let batches = reader.collect::<Result<Vec<_>, _>>().map_err(|e| e.to_string())?;
        match batches.len() {
            1 => Ok(batches.into_iter().next().unwrap_or_else(|| RecordBatch::new_empty(schema))),
            _ => arrow_select::concat::concat_batches(&schema, &batches).map_err(|e| e.to_string()),
        }
    })
    .unwrap_or_else(|caught| Err(format!("the decoder panicked: {caught}")))
}

/// The first selected leaf column of row group `rg` that fails to decode alone, named with its
/// error; `None` when each decodes alone (the columns disagree only together, say on row counts).
fn name_bad_column(
    table: &ParquetTable,
    rg: usize,
    proj: &FileProjection,
    chunks: &ChunkSet,
    batch_rows: usize,
) -> Option<String> {
    let schema = table.reader_metadata().parquet_schema();
    (0..schema.num_columns()).filter(|&c| proj.mask.leaf_included(c)).find_map(|c| {
        let alone = parquet::arrow::ProjectionMask::leaves(schema, [c]);
        decode_mask(table, rg, proj, alone, chunks.clone(), batch_rows)
            .err()
            .map(|e| format!("column {}: {e}", schema.column(c).path()))
    })
}

/// Checks the page headers of every selected column chunk of row group `rg` (see [`pages`]),
/// before arrow-rs sizes anything from them.
fn check_pages(table: &ParquetTable, rg: usize, proj: &FileProjection, chunks: &ChunkSet) -> Result<(), String> {
    let meta = table.reader_metadata().metadata().row_group(rg);
    for c in (0..meta.num_columns()).filter(|&c| proj.mask.leaf_included(c)) {
        let column = meta.column(c);
        let named = |e: String| format!("column {}: {e}", column.column_path());
        // What arrow-rs reads as the chunk's pages (`ColumnChunkMetaData::byte_range`): from the
        // dictionary offset whenever the footer has one, which `chunk_range` (what is fetched)
        // does not follow when it is 0 or past the data offset.
        let start = column.dictionary_page_offset().unwrap_or(column.data_page_offset());
        let (Ok(start), Ok(len)) = (u64::try_from(start), usize::try_from(column.compressed_size())) else {
            return Err(named(format!("a negative offset ({start}) or size in the footer")));
        };
        if len == 0 {
            continue;
        }
        let bytes = chunks.get_bytes(start, len).map_err(|e| named(e.to_string()))?;
        pages::check_chunk(&bytes, start, column).map_err(named)?;
    }
    Ok(())
}

/// Reads and decodes row group `rg` of `proj` from a file read with `read_at`: the whole path
/// from footer table to record batch. Returns the batch and the bytes read.
pub fn read_row_group<B: Into<Bytes>>(
    table: &ParquetTable,
    rg: usize,
    proj: &FileProjection,
    read_at: impl FnMut(u64, usize) -> Result<B, ParquetError>,
) -> Result<(RecordBatch, u64), ParquetError> {
    let ranges = chunk_ranges(table, rg, proj);
    let chunks = ChunkSet::read(table.file_len(), &ranges, read_at)?;
    let read = chunks.bytes();
    Ok((decode_row_group(table, rg, proj, chunks)?, read))
}

#[cfg(test)]
mod tests {
    use arrow_array::cast::AsArray;
    use arrow_array::types::{Int32Type, Int64Type};
    use arrow_schema::{DataType, Field};

    use super::super::schema::Projection;
    use super::super::{footer, testdata};
    use super::*;

    fn reader(bytes: &[u8]) -> impl FnMut(u64, usize) -> Result<Vec<u8>, ParquetError> + '_ {
        move |o, len| Ok(bytes.get(o as usize..o as usize + len).ok_or(ParquetError::Io("short".into()))?.to_vec())
    }

    fn table(bytes: &[u8]) -> ParquetTable {
        let mut read = reader(bytes);
        let f = footer::read_footer(bytes.len() as u64, |o, b| {
            b.copy_from_slice(&read(o, b.len())?);
            Ok(())
        })
        .unwrap();
        ParquetTable::decode(&f, bytes.len() as u64).unwrap()
    }

    #[test]
    fn a_row_group_of_more_rows_than_its_bytes_account_for_decodes_whole_in_batches() {
        // A column of one value, run-length encoded: a few hundred bytes for a million rows and
        // more, so decoded DECODE_BATCH_ROWS at a time, then joined.
        let rows = DECODE_BATCH_ROWS + 5;
        let bytes = testdata::constant(rows, 7);
        let t = table(&bytes);
        assert_eq!((t.num_row_groups(), t.row_group_rows(0)), (1, rows as u64));
        assert!(t.reader_metadata().metadata().row_group(0).column(0).uncompressed_size() * 8 < rows as i64);
        let proj = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
        let (b, _) = read_row_group(&t, 0, &proj, reader(&bytes)).unwrap();
        let c = b.column(0).as_primitive::<Int32Type>();
        assert_eq!(c.len(), rows);
        assert!(c.values().iter().all(|&v| v == 7));
        // Rows its bytes account for: one batch, whatever their count.
        let bytes = testdata::wide(rows, rows, 1);
        let t = table(&bytes);
        let proj = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
        let (b, _) = read_row_group(&t, 0, &proj, reader(&bytes)).unwrap();
        let c = b.column(0).as_primitive::<Int32Type>();
        assert!(c.values().iter().enumerate().all(|(i, &v)| v == i as i32) && c.len() == rows);
    }

    #[test]
    fn a_read_of_another_length_than_asked_is_an_error() {
        let range = vec![10..20, 30..30];
        let got = ChunkSet::read(100, &range, |_, len| Ok(vec![0; len.saturating_sub(1)]));
        assert!(matches!(got, Err(ParquetError::Io(m)) if m.contains("9 bytes at 10 where 10")));
        let got = ChunkSet::read(100, &range, |_, len| Ok(vec![7; len])).unwrap();
        assert_eq!(got.pieces(), &[(10, Bytes::from(vec![7u8; 10])), (30, Bytes::new())]);
    }

    #[test]
    fn every_codec_and_row_group_size_decodes_every_row_group_exactly() {
        for codec in [testdata::Codec::None, testdata::Codec::Snappy, testdata::Codec::Zstd] {
            for rg_rows in [1, 7, 64, 1000] {
                let bytes = testdata::mixed(150, rg_rows, codec);
                let t = table(&bytes);
                let proj = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
                let mut rows = Vec::new();
                for rg in 0..t.num_row_groups() {
                    let (b, _) = read_row_group(&t, rg, &proj, reader(&bytes)).unwrap();
                    rows.push(b);
                }
                let all = arrow_select::concat::concat_batches(&rows[0].schema(), &rows).unwrap();
                assert_eq!(all, testdata::mixed_batch(0..150), "{codec:?} rg {rg_rows}");
            }
        }
    }

    #[test]
    fn partition_keys_are_constant_columns_where_the_selection_puts_them() {
        use super::super::partitions::KeyValue;
        let bytes = testdata::mixed(40, 16, testdata::Codec::Snappy);
        let t = table(&bytes);
        let keys = [Field::new("year", DataType::Int32, true), Field::new("region", DataType::Utf8, true)];
        let values = [KeyValue::Int(2021), KeyValue::Str("eu west, a value past twelve bytes".into())];
        let all = Projection::new(t.schema(), &keys, None).unwrap();
        let names: Vec<&str> = all.names().collect();
        assert_eq!(names, ["id", "label", "caption", "image", "blob", "text", "tokens", "year", "region"]);
        let sel: Vec<String> = ["region", "id", "year"].map(String::from).to_vec();
        for flat in [true, false] {
            // Flat selections decode bytes as views (the region a StringView), others as delivered.
            let mut sel = sel.clone();
            if !flat {
                sel.push("tokens".into());
            }
            let fp = Projection::new(t.schema(), &keys, Some(&sel)).unwrap().for_file(&t, &values).unwrap();
            let (b, _) = read_row_group(&t, 2, &fp, reader(&bytes)).unwrap();
            assert_eq!(b.num_rows(), 8);
            let region: Vec<Option<&str>> = match b.column(0).data_type() {
                DataType::Utf8View => b.column(0).as_string_view().iter().collect(),
                _ => b.column(0).as_string::<i32>().iter().collect(),
            };
            assert_eq!(region, vec![Some("eu west, a value past twelve bytes"); 8], "flat: {flat}");
            assert_eq!(b.column(1).as_primitive::<Int64Type>().values().to_vec(), (32..40).collect::<Vec<i64>>());
            assert_eq!(b.column(2).as_primitive::<Int32Type>().values().to_vec(), vec![2021; 8]);
        }
        // Only keys: no column chunk is read, the rows are the row group's.
        let only: Vec<String> = vec!["year".into()];
        let fp = Projection::new(t.schema(), &keys, Some(&only))
            .unwrap()
            .for_file(&t, &[KeyValue::Null, KeyValue::Null])
            .unwrap();
        assert!(fp.reads_nothing() && chunk_ranges(&t, 0, &fp).is_empty());
        let b = decode_row_group(&t, 0, &fp, ChunkSet::default()).unwrap();
        assert_eq!((b.num_rows(), b.column(0).null_count()), (16, 16));
        // A key named like a column of the first file is that column (once, the file's type).
        let clash = [Field::new("label", DataType::Utf8, true)];
        let p = Projection::new(t.schema(), &clash, None).unwrap();
        assert_eq!(p.key_columns(), [(0, "label".to_string())]);
        assert_eq!(p.names().filter(|n| *n == "label").count(), 1);
        assert_eq!(
            p.schema().field_with_name("label").unwrap().data_type(),
            t.schema().field_with_name("label").unwrap().data_type()
        );
        // A missing column's error lists the keys too.
        let e = Projection::new(t.schema(), &keys, Some(&["nope".to_string()])).unwrap_err().to_string();
        assert!(e.contains("partition keys: year, region"), "{e}");
    }

    #[test]
    fn only_the_selected_column_chunks_are_read() {
        let bytes = testdata::mixed(2000, 500, testdata::Codec::None);
        let t = table(&bytes);
        let sel = vec!["label".to_string(), "id".to_string()];
        let p = Projection::new(t.schema(), &[], Some(&sel)).unwrap();
        let fp = p.for_file(&t, &[]).unwrap();
        let (b, read) = read_row_group(&t, 1, &fp, reader(&bytes)).unwrap();
        // The image column alone is ~250 bytes per row: far more than id + label.
        let image_chunk = t.chunk_range(1, 3).unwrap();
        assert!(read < image_chunk.end - image_chunk.start, "read {read} bytes");
        let selected: u64 = (0..2).map(|c| t.chunk_range(1, c).map(|r| r.end - r.start).unwrap()).sum();
        assert_eq!(read, selected);
        assert_eq!(b.schema().field(0).name(), "label");
        let ids = b.column(1).as_primitive::<Int64Type>();
        assert_eq!(ids.values().to_vec(), (500..1000).collect::<Vec<i64>>());
        // The decoder cannot read outside the set: an empty set fails cleanly.
        let e = decode_row_group(&t, 1, &fp, ChunkSet::default()).unwrap_err();
        assert!(matches!(e, ParquetError::BadData { row_group: 1, .. }), "{e}");
    }

    #[test]
    fn a_corrupt_page_is_named_by_its_column() {
        let mut bytes = testdata::mixed(2000, 500, testdata::Codec::Snappy);
        let t = table(&bytes);
        let caption = t.chunk_range(1, 2).unwrap();
        // The end of the chunk's last data page: compressed values, past any page header.
        for b in &mut bytes[caption.end as usize - 60..caption.end as usize - 20] {
            *b ^= 0xA5;
        }
        let t = table(&bytes);
        let sel = vec!["id".to_string(), "caption".to_string(), "label".to_string()];
        let fp = Projection::new(t.schema(), &[], Some(&sel)).unwrap().for_file(&t, &[]).unwrap();
        let e = read_row_group(&t, 1, &fp, reader(&bytes)).unwrap_err();
        assert!(matches!(e, ParquetError::BadData { row_group: 1, .. }), "{e}");
        assert!(e.to_string().contains("column \"caption\": "), "{e}");
        // The other row groups, and the other columns of this one, still decode.
        assert!(read_row_group(&t, 0, &fp, reader(&bytes)).is_ok());
        let rest = vec!["id".to_string(), "label".to_string()];
        let fp = Projection::new(t.schema(), &[], Some(&rest)).unwrap().for_file(&t, &[]).unwrap();
        assert!(read_row_group(&t, 1, &fp, reader(&bytes)).is_ok());
    }

    /// The IPC stream `direct` writes for `rows` of one decoded row group.
    fn direct_bytes(
        schema: &arrow_schema::Schema,
        message: &[u8],
        decoded: &RecordBatch,
        rows: &[(usize, usize)],
    ) -> Vec<u8> {
        let sources = [decoded];
        let d =
            super::super::direct::Direct::plan(schema, message, &sources, rows, None).unwrap().expect("flat columns");
        let mut out = vec![0u8; d.stream_len()];
        d.write(&mut out).unwrap();
        out
    }

    /// The flat columns of the test data (every one but the `tokens` list).
    fn flat_fields() -> Vec<String> {
        ["id", "label", "caption", "image", "blob", "text"].map(String::from).to_vec()
    }

    #[test]
    fn flat_projections_decode_bytes_as_views_and_deliver_the_same_bytes() {
        use super::super::{direct, ipc};
        for codec in [testdata::Codec::None, testdata::Codec::Snappy, testdata::Codec::Zstd] {
            let bytes = testdata::mixed(300, 64, codec);
            let t = table(&bytes);
            let flat = Projection::new(t.schema(), &[], Some(&flat_fields())).unwrap();
            let fp = flat.for_file(&t, &[]).unwrap();
            assert!(fp.views());
            let all = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
            assert!(!all.views(), "a list column: decoded as delivered");
            let message = direct::schema_message(flat.schema()).unwrap();
            for rg in 0..t.num_row_groups() {
                let (viewed, _) = read_row_group(&t, rg, &fp, reader(&bytes)).unwrap();
                let types: Vec<String> = viewed.schema().fields().iter().map(|f| f.data_type().to_string()).collect();
                assert_eq!(types, ["Int64", "Int32", "Utf8View", "BinaryView", "BinaryView", "Utf8View"]);
                // The same rows decoded as delivered, gathered and written by arrow-ipc.
                let (plain, _) = read_row_group(&t, rg, &all, reader(&bytes)).unwrap();
                let plain = plain.project(&[0, 1, 2, 3, 4, 5]).unwrap();
                let n = viewed.num_rows();
                let rows: Vec<(usize, usize)> = (0..n).rev().map(|r| (0, r)).chain([(0, n / 2)]).collect();
                let want = ipc::encode(&ipc::gather(flat.schema(), &[&plain], &rows).unwrap()).unwrap();
                let got = direct_bytes(flat.schema(), &message, &viewed, &rows);
                assert!(got == want, "{codec:?} row group {rg}: direct bytes from views differ");
            }
        }
    }

    #[test]
    fn a_struct_of_bytes_decodes_as_views_and_delivers_the_same_bytes() {
        // A Hugging Face image column: {bytes: binary, path: string}, with null images and null
        // paths.
        use std::sync::Arc;

        use arrow_array::{ArrayRef, BinaryArray, Int64Array, StringArray, StructArray};
        use arrow_schema::{DataType, Field, Schema};

        use super::super::{direct, ipc};
        let n = 300;
        let fields: arrow_schema::Fields =
            vec![Field::new("bytes", DataType::Binary, true), Field::new("path", DataType::Utf8, true)].into();
        let bytes: BinaryArray = (0..n).map(|i| (i % 5 != 3).then(|| testdata::image(i))).collect();
        let path: StringArray = (0..n).map(|i| (i % 4 != 1).then(|| format!("img/{i}.jpg"))).collect();
        let valid: arrow_buffer::NullBuffer = (0..n).map(|i| i % 7 != 0).collect();
        let image = StructArray::new(fields.clone(), vec![Arc::new(bytes) as ArrayRef, Arc::new(path)], Some(valid));
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("image", DataType::Struct(fields), true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(Int64Array::from_iter_values(0..n)) as ArrayRef, Arc::new(image)],
        )
        .unwrap();
        let file = testdata::with_batch(&batch);
        let t = table(&file);
        let p = Projection::new(t.schema(), &[], None).unwrap();
        let fp = p.for_file(&t, &[]).unwrap();
        assert!(fp.views());
        let message = direct::schema_message(p.schema()).unwrap();
        // The same file decoded as delivered by arrow-rs itself (not `batch`: a null struct
        // comes back with null children, which Parquet cannot store).
        let plain: Vec<RecordBatch> = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(file.clone()))
            .unwrap()
            .with_batch_size(n as usize)
            .build()
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let plain = arrow_select::concat::concat_batches(&plain[0].schema(), &plain).unwrap();
        assert_eq!(plain.num_rows(), n as usize);
        let mut first = 0usize;
        for rg in 0..t.num_row_groups() {
            let (viewed, _) = read_row_group(&t, rg, &fp, reader(&file)).unwrap();
            assert_eq!(
                viewed.schema().field(1).data_type().to_string(),
                "Struct(\"bytes\": BinaryView, \"path\": Utf8View)"
            );
            let rows: Vec<(usize, usize)> = (0..viewed.num_rows()).rev().map(|r| (0, r)).collect();
            let expected = plain.slice(first, viewed.num_rows());
            first += viewed.num_rows();
            let want = ipc::encode(&ipc::gather(p.schema(), &[&expected], &rows).unwrap()).unwrap();
            let got = direct_bytes(p.schema(), &message, &viewed, &rows);
            assert!(got == want, "row group {rg}: direct bytes of a struct of views differ");
        }
        assert_eq!(first, n as usize);
    }

    #[test]
    fn corrupt_pages_are_errors_naming_the_row_group_never_panics() {
        let flat = flat_fields();
        for (codec, fields) in [
            (testdata::Codec::None, None),
            (testdata::Codec::Snappy, None),
            (testdata::Codec::Zstd, None),
            (testdata::Codec::None, Some(&flat[..])),
            (testdata::Codec::Snappy, Some(&flat[..])),
        ] {
            let good = testdata::mixed(60, 20, codec);
            let t = table(&good);
            let fp = Projection::new(t.schema(), &[], fields).unwrap().for_file(&t, &[]).unwrap();
            let data_end = (good.len() as u64 - 8 - t.footer_bytes()) as usize;
            let want = match fields {
                None => testdata::mixed_batch(0..60).schema(),
                Some(_) => read_row_group(&t, 0, &fp, reader(&good)).unwrap().0.schema(),
            };
            // Flip bytes all over the data region; the footer stays intact.
            let mut errors = 0;
            for pos in (4..data_end).step_by(13) {
                let mut bad = good.clone();
                bad[pos] ^= 0x5a;
                for rg in 0..t.num_row_groups() {
                    match read_row_group(&t, rg, &fp, reader(&bad)) {
                        Ok((b, _)) => {
                            // Uncompressed payload bytes can change silently (Parquet pages have
                            // no mandatory checksum) but the shape must hold.
                            assert_eq!(b.num_rows(), 20);
                            assert_eq!(b.schema(), want);
                        }
                        Err(ParquetError::BadData { row_group, .. }) => {
                            assert_eq!(row_group, rg);
                            errors += 1;
                        }
                        Err(e) => panic!("unexpected error kind: {e}"),
                    }
                }
            }
            assert!(errors > 0, "{codec:?}: no corruption detected at all");
        }
    }

    #[test]
    fn pages_are_checked_from_where_the_decoder_reads_them() {
        // libFuzzer's input: row group 0's `id` has its dictionary offset (47) past its data
        // offset (4). arrow-rs reads a chunk from its dictionary offset whenever there is one, so
        // it met the data page at 47 with no dictionary and panicked (caught), while the page
        // check walked from 4, saw the dictionary first, and let the chunk through.
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../fuzz/seeds/parquet_row_group/finding_dictionary_offset_past_data.parquet"
        );
        let bytes = std::fs::read(path).unwrap();
        let t = table(&bytes);
        let id = t.reader_metadata().metadata().row_group(0).column(0);
        assert_eq!((id.dictionary_page_offset(), id.data_page_offset()), (Some(47), 4), "the input's damage");
        let fp = Projection::new(t.schema(), &[], None).unwrap().for_file(&t, &[]).unwrap();
        let e = read_row_group(&t, 0, &fp, reader(&bytes)).unwrap_err().to_string();
        assert!(e.contains("page at byte 47") && e.contains("no dictionary page before it"), "{e}");
    }
}
