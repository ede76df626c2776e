//! A Parquet file's footer: found with one tail read, decoded without trusting it, and kept as a
//! [`ParquetTable`] (row groups, their row counts, each column chunk's byte range, the Arrow
//! schema) while the file is in use.
//!
//! ```text
//!  file:  "PAR1" │ column chunks of row group 0, 1, ... │ footer (thrift FileMetaData) │ len u32 LE │ "PAR1"
//!                                                         └──────────── len bytes ─────┘
//! ```
//!
//! The reader reads the last [`TAIL_READ`] bytes (or the whole file when smaller): for nearly every
//! file that holds the footer, so indexing costs one read per file (one ranged GET on S3). Only a
//! footer larger than that (thousands of columns or row groups) needs a second read of exactly its
//! bytes. Every length read from the file is checked against the file's size before anything is
//! allocated for it, and the decoded metadata is checked (row counts, chunk ranges inside the
//! file's data region) before any reader relies on it.

use std::ops::Range;
use std::sync::Arc;

use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions};
use parquet::file::metadata::{ParquetMetaData, ParquetMetaDataReader, RowGroupMetaData};

use super::{ParquetError, no_panic};

/// Bytes of the speculative tail read: covers the footer of files with hundreds of columns and
/// row groups (footers of typical datasets are 1-30 KiB), and is one small ranged GET on S3.
pub const TAIL_READ: u64 = 64 << 10;
/// "PAR1" at both ends of a plaintext Parquet file.
pub const MAGIC: &[u8; 4] = b"PAR1";
/// "PARE": the tail magic of a file with an encrypted footer.
pub const MAGIC_ENCRYPTED: &[u8; 4] = b"PARE";
/// Footer length field plus tail magic.
pub const FOOTER_TAIL_BYTES: u64 = 8;
/// Leading magic plus the footer tail: the smallest possible file (an empty footer aside).
pub const MIN_FILE_BYTES: u64 = 4 + FOOTER_TAIL_BYTES;

/// The most rows a row group may claim. A row group is decoded whole (its rows held at once in
/// the daemon), and a few bytes of run-length encoding can claim any number of rows: a footer
/// claiming 2^40 had the daemon size allocations from it. pyarrow's largest default row group
/// (64 Mi rows, before version 13) fits with room.
pub const MAX_ROW_GROUP_ROWS: u64 = 1 << 27;

/// The file range to read first: its last [`TAIL_READ`] bytes, or all of it.
pub fn tail_range(file_len: u64) -> Result<Range<u64>, ParquetError> {
    if file_len < MIN_FILE_BYTES {
        return Err(ParquetError::Truncated(format!(
            "{file_len} bytes, fewer than the {MIN_FILE_BYTES} of an empty Parquet file"
        )));
    }
    Ok(file_len - file_len.min(TAIL_READ)..file_len)
}

/// Where the footer (thrift metadata) lies in the file, from the file's last 8 bytes.
pub fn footer_range(last8: &[u8], file_len: u64) -> Result<Range<u64>, ParquetError> {
    let [l0, l1, l2, l3, m @ ..] = last8 else {
        return Err(ParquetError::Truncated("fewer than 8 bytes at its end".into()));
    };
    if m == MAGIC_ENCRYPTED {
        return Err(ParquetError::Encrypted);
    }
    if m != MAGIC {
        return Err(ParquetError::NotParquet(format!("its last 4 bytes are {m:02x?}, not \"PAR1\"")));
    }
    let len = u64::from(u32::from_le_bytes([*l0, *l1, *l2, *l3]));
    // The footer sits after the leading magic and before the 8-byte tail.
    let end = file_len.saturating_sub(FOOTER_TAIL_BYTES);
    if file_len < MIN_FILE_BYTES || len > end - 4 {
        return Err(ParquetError::Truncated(format!("its footer claims {len} bytes but the file has {file_len}")));
    }
    Ok(end - len..end)
}

/// Reads a file's footer bytes with `read_at(offset, buf)` (fill `buf` exactly from `offset`):
/// one read of the tail, a second one only when the footer is larger than the tail.
pub fn read_footer(
    file_len: u64,
    mut read_at: impl FnMut(u64, &mut [u8]) -> Result<(), ParquetError>,
) -> Result<Vec<u8>, ParquetError> {
    let tail = tail_range(file_len)?;
    let mut buf = vec![0; to_usize(tail.end - tail.start)?];
    read_at(tail.start, &mut buf)?;
    footer_from_tail(&buf, tail.start, file_len, read_at)
}

/// The footer bytes given `tail` (the file's bytes from `tail_start` to its end), reading the
/// part of a large footer that `tail` lacks with `read_at`.
pub fn footer_from_tail(
    tail: &[u8],
    tail_start: u64,
    file_len: u64,
    mut read_at: impl FnMut(u64, &mut [u8]) -> Result<(), ParquetError>,
) -> Result<Vec<u8>, ParquetError> {
    if tail_start.checked_add(tail.len() as u64) != Some(file_len) {
        return Err(ParquetError::Io(format!(
            "tail read of {} bytes at {tail_start} does not end at the file's end ({file_len})",
            tail.len()
        )));
    }
    let last8 = tail.get(tail.len().saturating_sub(8)..).unwrap_or_default();
    let range = footer_range(last8, file_len)?;
    if range.start >= tail_start {
        let from = to_usize(range.start - tail_start)?;
        let to = to_usize(range.end - tail_start)?;
        return Ok(tail[from..to].to_vec());
    }
    let mut footer = vec![0; to_usize(range.end - range.start)?];
    read_at(range.start, &mut footer)?;
    Ok(footer)
}

/// The integrity value `shardstream index` records for a Parquet file in its manifest
/// (`"checksum": "crc32c-footer"`): the CRC-32C of the file's last `footer.len() + 8` bytes, that
/// is the footer, its 4-byte length and the tail magic. The footer holds every column chunk's
/// offset, sizes, codec and statistics, so a file rewritten in any way a reader would notice
/// changes it; data pages are covered by their own checksums when the writer stored them.
pub fn footer_crc32c(footer: &[u8]) -> u32 {
    let len = u32::try_from(footer.len()).unwrap_or(u32::MAX);
    let crc = crc32c::crc32c(footer);
    let crc = crc32c::crc32c_append(crc, &len.to_le_bytes());
    crc32c::crc32c_append(crc, MAGIC)
}

fn to_usize(n: u64) -> Result<usize, ParquetError> {
    usize::try_from(n).map_err(|_| ParquetError::BadFooter(format!("{n} bytes do not fit in memory")))
}

/// A Parquet file's table: what the daemon keeps of its footer while the file is in use.
#[derive(Debug, Clone)]
pub struct ParquetTable {
    /// The decoded footer and its Arrow schema (what the row-group reader needs).
    meta: ArrowReaderMetadata,
    /// First row of each row group, then the file's row count.
    row_starts: Vec<u64>,
    file_len: u64,
    footer_bytes: u64,
    /// The footer itself: what the file's sidecar stores.
    footer: Arc<[u8]>,
    /// Top-level column names, in file order (the dataset's fields).
    columns: Vec<String>,
}

impl ParquetTable {
    /// Decodes and checks `footer` (the bytes [`read_footer`] returned) of a file of `file_len`
    /// bytes.
    pub fn decode(footer: &[u8], file_len: u64) -> Result<Self, ParquetError> {
        no_panic(
            || {
                super::thrift::check_struct(footer).map_err(|e| ParquetError::BadFooter(format!("its Thrift {e}")))?;
                let meta = ParquetMetaDataReader::decode_metadata(footer)
                    .map_err(|e| ParquetError::BadFooter(e.to_string()))?;
                Self::from_metadata(Arc::new(meta), file_len, footer)
            },
            |msg| ParquetError::BadFooter(format!("the decoder panicked: {msg}")),
        )
    }

    fn from_metadata(meta: Arc<ParquetMetaData>, file_len: u64, footer: &[u8]) -> Result<Self, ParquetError> {
        let footer_bytes = footer.len() as u64;
        // Column chunks lie between the leading magic and the footer.
        let data = 4..file_len.saturating_sub(FOOTER_TAIL_BYTES + footer_bytes);
        let leaves = meta.file_metadata().schema_descr().num_columns();
        let mut row_starts = Vec::with_capacity(meta.num_row_groups() + 1);
        let mut rows = 0u64;
        for (i, rg) in meta.row_groups().iter().enumerate() {
            row_starts.push(rows);
            let n = u64::try_from(rg.num_rows())
                .map_err(|_| ParquetError::BadFooter(format!("row group {i} has {} rows", rg.num_rows())))?;
            if n > MAX_ROW_GROUP_ROWS {
                return Err(ParquetError::BadFooter(format!(
                    "row group {i} claims {n} rows, more than the {MAX_ROW_GROUP_ROWS} a row group may hold here \
                     (each is decoded whole); write the file with smaller row groups (pyarrow: row_group_size)"
                )));
            }
            rows = rows.checked_add(n).ok_or_else(|| ParquetError::BadFooter("the row count overflows".into()))?;
            if rg.num_columns() != leaves {
                return Err(ParquetError::BadFooter(format!(
                    "row group {i} has {} column chunks, the schema {leaves} columns",
                    rg.num_columns()
                )));
            }
            // A row group of no rows is never read, and pyarrow writes its chunks with a data page
            // offset of 0 (an empty table through ParquetWriter): nothing there to check.
            if n == 0 {
                continue;
            }
            for c in 0..leaves {
                let r = chunk_range(rg, c).ok_or_else(|| {
                    ParquetError::BadFooter(format!("row group {i} column {c}: negative offset or size"))
                })?;
                if r.start < data.start || r.end > data.end {
                    return Err(ParquetError::BadFooter(format!(
                        "row group {i} column {c}: bytes {r:?} lie outside the data region {data:?} of the file"
                    )));
                }
            }
        }
        row_starts.push(rows);
        let meta = ArrowReaderMetadata::try_new(meta, ArrowReaderOptions::new())
            .and_then(super::zones::rezone)
            .map_err(|e| ParquetError::BadFooter(format!("cannot map the schema to Arrow: {e}")))?;
        let columns = meta.schema().fields().iter().map(|f| f.name().clone()).collect();
        Ok(Self { meta, row_starts, file_len, footer_bytes, footer: footer.into(), columns })
    }

    pub fn num_rows(&self) -> u64 {
        self.row_starts.last().copied().unwrap_or(0)
    }

    pub fn num_row_groups(&self) -> usize {
        self.row_starts.len() - 1
    }

    /// Rows of row group `rg` (0 past the end).
    pub fn row_group_rows(&self, rg: usize) -> u64 {
        match (self.row_starts.get(rg), self.row_starts.get(rg + 1)) {
            (Some(a), Some(b)) => b - a,
            _ => 0,
        }
    }

    /// The file's rows of row group `rg`.
    pub fn row_group_span(&self, rg: usize) -> Option<Range<u64>> {
        Some(*self.row_starts.get(rg)?..*self.row_starts.get(rg + 1)?)
    }

    /// (row group, row within it) of the file's row `row`.
    pub fn locate_row(&self, row: u64) -> Option<(usize, u64)> {
        if row >= self.num_rows() {
            return None;
        }
        // The last start <= row; empty row groups share their start with the next, which wins.
        let rg = self.row_starts.partition_point(|&s| s <= row) - 1;
        Some((rg, row - self.row_starts[rg]))
    }

    /// Byte range of leaf column `col`'s chunk in row group `rg` (checked at decode); None for a
    /// row group of no rows.
    pub fn chunk_range(&self, rg: usize, col: usize) -> Option<Range<u64>> {
        let rg = self.meta.metadata().row_groups().get(rg)?;
        if col >= rg.num_columns() || rg.num_rows() == 0 {
            // An empty row group's chunks are unchecked (see `from_metadata`) and never read.
            return None;
        }
        chunk_range(rg, col)
    }

    pub fn schema(&self) -> &arrow_schema::SchemaRef {
        self.meta.schema()
    }

    pub fn reader_metadata(&self) -> &ArrowReaderMetadata {
        &self.meta
    }

    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Bytes of the footer in the file.
    pub fn footer_bytes(&self) -> u64 {
        self.footer_bytes
    }

    /// The footer's bytes (the sidecar's content).
    pub fn footer(&self) -> &[u8] {
        &self.footer
    }

    /// [`footer_crc32c`] of this table's footer: what a `crc32c-footer` manifest records.
    pub fn footer_crc32c(&self) -> u32 {
        footer_crc32c(&self.footer)
    }

    /// Top-level column names, in file order.
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Bytes of memory the table holds (index-memory figures).
    pub fn heap_bytes(&self) -> usize {
        self.meta.metadata().memory_size()
            + self.row_starts.capacity() * 8
            + self.footer.len()
            + self.columns.iter().map(|c| c.capacity() + 24).sum::<usize>()
    }
}

/// A column chunk's bytes: from its dictionary page when it has one, else its first data page.
/// Computed here rather than by `ColumnChunkMetaData::byte_range`, which asserts (panics) on
/// negative values that a damaged footer can hold.
fn chunk_range(rg: &RowGroupMetaData, col: usize) -> Option<Range<u64>> {
    let c = rg.column(col);
    let data = u64::try_from(c.data_page_offset()).ok()?;
    // The reader takes a chunk's start from its dictionary offset whenever there is one (and
    // asserts it is not negative): a negative one is damage, refused here.
    if c.dictionary_page_offset().is_some_and(|d| d < 0) {
        return None;
    }
    // Some old writers record a dictionary offset of 0 for chunks without a dictionary.
    let start = match c.dictionary_page_offset().and_then(|d| u64::try_from(d).ok()) {
        Some(d) if d > 0 && d <= data => d,
        _ => data,
    };
    let len = u64::try_from(c.compressed_size()).ok()?;
    Some(start..start.checked_add(len)?)
}

/// The table of a whole Parquet file held in memory: what the modules' tests read their files with.
#[cfg(test)]
pub(crate) fn table_of(bytes: &[u8]) -> ParquetTable {
    let len = bytes.len() as u64;
    let footer = read_footer(len, |o, b| {
        b.copy_from_slice(&bytes[o as usize..o as usize + b.len()]);
        Ok(())
    })
    .expect("a footer");
    ParquetTable::decode(&footer, len).expect("a table")
}

#[cfg(test)]
mod tests {
    use super::super::testdata;
    use super::*;

    fn read(bytes: &[u8]) -> impl FnMut(u64, &mut [u8]) -> Result<(), ParquetError> + '_ {
        move |off, buf| {
            let off = off as usize;
            let src = bytes.get(off..off + buf.len()).ok_or(ParquetError::Io("short read".into()))?;
            buf.copy_from_slice(src);
            Ok(())
        }
    }

    fn table(bytes: &[u8]) -> Result<ParquetTable, ParquetError> {
        let footer = read_footer(bytes.len() as u64, read(bytes))?;
        ParquetTable::decode(&footer, bytes.len() as u64)
    }

    #[test]
    fn a_list_declaring_more_elements_than_its_bytes_is_refused_before_arrow_rs_walks_it() {
        // Found by the parquet_footer fuzz target: a 49-byte file whose footer declares a list of
        // ~2^31 booleans in an unknown field. arrow-rs skips such a list an element at a time
        // without reading the byte each takes, so the decode kept a thread busy for seconds.
        let file =
            b"PR1\x15\x03\x00<\xf1\xf1\xf1\xf1\xf1\xf1\xf1\xf1\xf1\xf1\xf1\xf1\xf9\xf1\xf1\xf1\xf1\xf3\x07\x0e\x0e\x0e\
                     \xf1\xf1\xf1\xf1\xf1\xf12\xfb\xe6\xd9\xfb\x08%\x00\x00\x00PAR1";
        let err = table(file).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("declares") && err.contains("elements"), "{err}");
    }

    #[test]
    fn a_field_arrow_rs_knows_given_another_type_is_refused_before_arrow_rs_reads_it() {
        // arrow-rs reads a field it knows by its id, whatever type the wire gives it: here field 1
        // (`version`, an i32) sent as a 7-byte binary. Read as an i32 it takes one byte, and
        // arrow-rs goes on to read the binary's bytes as fields: field 16, unknown, a list of
        // 2^31-1 booleans, which arrow-rs skips an element at a time without reading a byte. A
        // walk by wire type alone skips the binary and passes the footer (the `parquet_footer`
        // fuzz target found a 1,548-byte footer of this kind).
        let footer = [0x18, 0x07, 0xf9, 0xf1, 0xff, 0xff, 0xff, 0xff, 0x07, 0x00];
        let mut file = b"PAR1".to_vec();
        file.extend_from_slice(&footer);
        file.extend_from_slice(&(footer.len() as u32).to_le_bytes());
        file.extend_from_slice(b"PAR1");
        let err = table(&file).map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("field 1 ") && err.contains("i32"), "{err}");
    }

    #[test]
    fn one_tail_read_for_a_small_footer_two_for_a_large_one() {
        let small = testdata::mixed(100, 30, testdata::Codec::Snappy);
        let mut reads = 0;
        let footer = read_footer(small.len() as u64, |o, b| {
            reads += 1;
            read(&small)(o, b)
        })
        .unwrap();
        assert_eq!(reads, 1);
        let t = ParquetTable::decode(&footer, small.len() as u64).unwrap();
        assert_eq!(t.num_rows(), 100);
        assert_eq!(t.num_row_groups(), 4);
        assert_eq!((0..4).map(|g| t.row_group_rows(g)).collect::<Vec<_>>(), [30, 30, 30, 10]);

        // Many row groups of many columns: a footer past the 64 KiB tail.
        let wide = testdata::wide(400, 2, 40);
        let mut reads = 0;
        let footer = read_footer(wide.len() as u64, |o, b| {
            reads += 1;
            read(&wide)(o, b)
        })
        .unwrap();
        assert!(footer.len() as u64 > TAIL_READ, "footer of {} bytes", footer.len());
        assert_eq!(reads, 2);
        let t = ParquetTable::decode(&footer, wide.len() as u64).unwrap();
        assert_eq!(t.num_rows(), 400);
        assert_eq!(t.num_row_groups(), 200);
    }

    #[test]
    fn the_footer_checksum_covers_the_files_last_bytes_from_the_footer_on() {
        let file = testdata::mixed(60, 16, testdata::Codec::Snappy);
        let footer = read_footer(file.len() as u64, read(&file)).unwrap();
        let tail = &file[file.len() - footer.len() - 8..];
        assert_eq!(footer_crc32c(&footer), crc32c::crc32c(tail));
        assert_eq!(ParquetTable::decode(&footer, file.len() as u64).unwrap().footer_crc32c(), crc32c::crc32c(tail));
    }

    /// `file` with its footer rewritten so that every row group claims `rows` rows.
    fn claiming(file: &[u8], rows: i64) -> Vec<u8> {
        let meta = ParquetMetaDataReader::new().parse_and_finish(&bytes::Bytes::copy_from_slice(file)).unwrap();
        let mut b = meta.into_builder();
        let groups = b.take_row_groups().into_iter().map(|rg| rg.into_builder().set_num_rows(rows).build().unwrap());
        let meta = b.set_row_groups(groups.collect()).build();
        let footer_len = u32::from_le_bytes(file[file.len() - 8..file.len() - 4].try_into().unwrap()) as usize;
        let mut out = file[..file.len() - 8 - footer_len].to_vec();
        parquet::file::metadata::ParquetMetaDataWriter::new(&mut out, &meta).finish().unwrap();
        out
    }

    #[test]
    fn a_row_group_claiming_more_rows_than_one_may_hold_is_refused() {
        // A few bytes of run-length encoding can claim any number of rows, and a row group is
        // decoded whole: a footer claiming 2^40 had the decoder (and a projection of partition
        // keys, which decodes nothing) allocate by the claim, and the daemon abort.
        let good = testdata::mixed(50, 20, testdata::Codec::None);
        assert!(table(&claiming(&good, MAX_ROW_GROUP_ROWS as i64)).is_ok());
        let Err(ParquetError::BadFooter(e)) = table(&claiming(&good, 1 << 40)) else { panic!("accepted") };
        assert!(e.contains("row group 0 claims 1099511627776 rows") && e.contains("row_group_size"), "{e}");
    }

    #[test]
    fn rows_locate_to_their_row_group() {
        let t = table(&testdata::mixed(100, 30, testdata::Codec::None)).unwrap();
        assert_eq!(t.locate_row(0), Some((0, 0)));
        assert_eq!(t.locate_row(29), Some((0, 29)));
        assert_eq!(t.locate_row(30), Some((1, 0)));
        assert_eq!(t.locate_row(99), Some((3, 9)));
        assert_eq!(t.locate_row(100), None);
        assert_eq!(t.row_group_span(3), Some(90..100));
        // Every chunk lies inside the file, after the leading magic.
        for rg in 0..t.num_row_groups() {
            for c in 0..t.reader_metadata().parquet_schema().num_columns() {
                let r = t.chunk_range(rg, c).unwrap();
                assert!(r.start >= 4 && r.end <= t.file_len() - 8 - t.footer_bytes(), "{r:?}");
            }
        }
    }

    #[test]
    fn damaged_files_are_errors_not_panics() {
        let good = testdata::mixed(50, 20, testdata::Codec::Zstd);
        // Too short, wrong magic, encrypted magic, a length past the file, truncated in the footer.
        assert!(matches!(table(b"PAR1PAR"), Err(ParquetError::Truncated(_))));
        let mut bad = good.clone();
        let n = bad.len();
        bad[n - 1] = b'X';
        assert!(matches!(table(&bad), Err(ParquetError::NotParquet(_))));
        bad[n - 4..].copy_from_slice(b"PARE");
        assert!(matches!(table(&bad), Err(ParquetError::Encrypted)));
        let mut bad = good.clone();
        bad[n - 8..n - 4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(table(&bad), Err(ParquetError::Truncated(_))));
        let cut = &good[..n - 100];
        assert!(table(cut).is_err());
        // Garbage in the footer body: every byte flipped in turn must give Ok or an error.
        let footer = read_footer(n as u64, read(&good)).unwrap();
        for i in 0..footer.len() {
            for x in [0xffu8, 0x80, 0x01] {
                let mut f = footer.clone();
                f[i] ^= x;
                let _ = ParquetTable::decode(&f, n as u64);
            }
        }
    }
}
