//! The page headers of a column chunk, checked before arrow-rs decodes the chunk.
//!
//! arrow-rs sizes some buffers from a page header before it has looked at the page's bytes, so a
//! damaged or hostile header of a few bytes could make the daemon take gigabytes:
//!
//! - a dictionary page's value count sizes the dictionary (`DictDecoder::set_dict` resizes it to
//!   that count, filled, before decoding a value): a 4 KB file with a count of ~10^9 took 3.6 GB
//!   (found by the `parquet_row_group` fuzz target);
//! - a snappy page's uncompressed size is zero-filled before decompressing into it (up to 2 GiB
//!   a page, whatever the snappy data holds);
//! - a dictionary-encoded data page is decoded with the dictionary that came before it, which
//!   arrow-rs `expect`s to be there (without one it panics).
//!
//! [`check_chunk`] walks the chunk's pages (header, then its stored bytes) and refuses, before
//! any decoding: a page that does not fit the chunk; an uncompressed size larger than the chunk's
//! in the footer (the sum of its pages') or, for snappy, larger than its stored bytes can expand
//! to; a dictionary with more values than its bytes can hold (the stored bytes when the page is
//! not compressed: its claimed size is bounded only by the footer's); a dictionary-encoded data
//! page with no dictionary page before it. What is left to arrow-rs: a zstd
//! page expands into at most its stated size (checked against what it expands to after
//! decompression, as arrow-rs does), which is bounded here by the footer's size of the chunk
//! only, as zstd's ratio has no useful bound; a gzip page expands to what its stream holds,
//! at most ~1,032 times its stored bytes (deflate's bound), whatever its header says.
//!
//! The headers are Thrift compact protocol (`PageHeader` of parquet.thrift, read by
//! [`super::thrift::Reader`]): walked first as arrow-rs reads them (every field it knows must have
//! its type, see [`super::thrift`]), then read for the fields checked here. arrow-rs parses the
//! same headers again when it decodes: a header is a few dozen bytes against pages of up to a MiB.

use parquet::basic::{Compression, Type as PhysicalType};
use parquet::file::metadata::ColumnChunkMetaData;

use super::thrift::{BOOL_FALSE, BOOL_TRUE, I32, Reader, STRUCT};

/// Snappy output is at most ~21.4x its input (a 3-byte copy element yields at most 64 bytes);
/// pages that claim more than this cannot be snappy data.
const SNAPPY_MAX_RATIO: u64 = 22;
/// Allowance for the snappy stream's preamble and a page's levels stored before it (v2 pages).
const SNAPPY_SLACK: u64 = 64;
/// Nesting of Thrift structs a page header may have (it has 3: header, page header, statistics).
const MAX_DEPTH: u32 = 8;

const DICTIONARY_PAGE: i32 = 2;
/// The value encodings that index a dictionary (`Encoding` of parquet.thrift).
const PLAIN_DICTIONARY: i32 = 2;
const RLE_DICTIONARY: i32 = 8;

/// What a page header says, of what is checked.
#[derive(Debug, Default, PartialEq, Eq)]
struct Header {
    page_type: i32,
    uncompressed: i32,
    compressed: i32,
    /// A dictionary page's `num_values`.
    dictionary_values: Option<i32>,
    /// A v2 data page's `is_compressed` (its data may be stored uncompressed whatever the codec).
    v2_compressed: Option<bool>,
    /// A data page's (v1 or v2) value encoding.
    data_encoding: Option<i32>,
    /// The page's CRC-32 (of its stored bytes), when the writer gave one.
    crc: Option<i32>,
}

/// Checks every page header of a column chunk (`chunk`: its bytes, as the footer's range gives
/// them, from file offset `start`) against its bytes and `meta`; the reason when one is refused,
/// naming the page's file offset.
pub fn check_chunk(chunk: &[u8], start: u64, meta: &ColumnChunkMetaData) -> Result<(), String> {
    let total = u64::try_from(meta.uncompressed_size()).map_err(|_| "a negative uncompressed size".to_string())?;
    let width = value_width(meta.column_type(), meta.column_descr().type_length());
    let mut pos = 0usize;
    let mut dictionary = false;
    while pos < chunk.len() {
        let offset = start + pos as u64;
        let (h, header_len) = read_header(&chunk[pos..]).map_err(|e| format!("page header at byte {offset}: {e}"))?;
        let at = |what: String| format!("page at byte {offset}: {what}");
        let (Ok(uncompressed), Ok(compressed)) = (u64::try_from(h.uncompressed), u64::try_from(h.compressed)) else {
            return Err(at(format!("negative sizes ({} uncompressed, {} stored)", h.uncompressed, h.compressed)));
        };
        let end = (pos + header_len).checked_add(usize::try_from(compressed).unwrap_or(usize::MAX));
        let Some(end) = end.filter(|&e| e <= chunk.len()) else {
            return Err(at(format!("{compressed} stored bytes run past the chunk's {}", chunk.len())));
        };
        if uncompressed > total {
            return Err(at(format!("{uncompressed} bytes uncompressed, more than the whole chunk's {total}")));
        }
        let snappy = meta.compression() == Compression::SNAPPY && h.v2_compressed != Some(false);
        if snappy && uncompressed > compressed.saturating_mul(SNAPPY_MAX_RATIO) + SNAPPY_SLACK {
            return Err(at(format!("{uncompressed} bytes uncompressed from {compressed} of snappy")));
        }
        if matches!(h.data_encoding, Some(PLAIN_DICTIONARY | RLE_DICTIONARY)) && !dictionary {
            return Err(at("a dictionary-encoded data page with no dictionary page before it".into()));
        }
        if h.page_type == DICTIONARY_PAGE {
            dictionary = true;
            let values = h.dictionary_values.ok_or_else(|| at("a dictionary page without its header".into()))?;
            let values = u64::try_from(values).map_err(|_| at(format!("a dictionary of {values} values")))?;
            // What the decoder gets: the stored bytes themselves when they are not compressed
            // (the claimed size is then bounded by nothing but the footer's claim).
            let decompressed = meta.compression() != Compression::UNCOMPRESSED && h.v2_compressed != Some(false);
            let bytes = if decompressed { uncompressed } else { compressed };
            // Bits for booleans, bytes for the rest: the least each value takes.
            let room = match width {
                Width::Bits => bytes.saturating_mul(8),
                Width::Bytes(w) => bytes / w,
            };
            if values > room {
                return Err(at(format!("a dictionary of {values} values in {bytes} bytes")));
            }
        }
        pos = end;
    }
    Ok(())
}

/// Checks the checksum of every page of a column chunk that has one (`chunk`: its bytes, from
/// file offset `start`): see [`check_crcs_with`].
pub fn check_crcs(chunk: &[u8], start: u64) -> Result<u64, String> {
    check_crcs_with(chunk.len() as u64, start, |at, buf| {
        let at = usize::try_from(at).map_err(|_| "past the chunk".to_string())?;
        let src = chunk.get(at..at.saturating_add(buf.len())).ok_or_else(|| "past the chunk".to_string())?;
        buf.copy_from_slice(src);
        Ok(())
    })
}

/// Room for a page header first; a header longer than that (large statistics) is read again
/// with 8 times the room, up to [`MAX_HEADER_READ`].
const HEADER_READ: usize = 16 << 10;
const MAX_HEADER_READ: usize = 16 << 20;
/// Bytes of the chunk read at a time (headers and the checksummed bytes after them): memory
/// stays about this, whatever the chunk's size.
const WINDOW: usize = 1 << 20;

/// Checks the checksum of every page of a column chunk of `len` bytes from file offset `start`
/// that has one: the CRC-32 of the page's stored bytes, as its header gives it (pyarrow's
/// `write_page_checksum`, parquet-mr's `parquet.page.write-checksum.enabled`). `read(at, buf)`
/// fills `buf` from byte `at` of the chunk. Ranged reads of column chunks have no other check:
/// no ETag or manifest covers a range. The chunk is read a window at a time, so memory does not
/// grow with it. The pages without a checksum (checked by nothing); the reason when a page does
/// not match (or its header cannot be read), naming the page's file offset.
pub fn check_crcs_with(
    len: u64,
    start: u64,
    read: impl FnMut(u64, &mut [u8]) -> Result<(), String>,
) -> Result<u64, String> {
    let mut w = Window { read, len, at: 0, buf: Vec::new() };
    let (mut pos, mut unchecked) = (0u64, 0u64);
    while pos < len {
        let offset = start + pos;
        let left = usize::try_from(len - pos).unwrap_or(usize::MAX);
        let mut room = HEADER_READ.min(left);
        let (h, header_len) = loop {
            match read_header(w.bytes(pos, room, room)?) {
                Ok(h) => break h,
                // Perhaps cut short: once more with more room, while there is more.
                Err(_) if room < left && room < MAX_HEADER_READ => room = (room * 8).min(left).min(MAX_HEADER_READ),
                Err(e) => return Err(format!("page header at byte {offset}: {e}")),
            }
        };
        let stored = u64::try_from(h.compressed).map_err(|_| format!("page at byte {offset}: a negative size"))?;
        let body = pos + header_len as u64;
        let end = body.saturating_add(stored);
        if end > len {
            return Err(format!("page at byte {offset}: {stored} stored bytes run past the chunk's {len}"));
        }
        if let Some(crc) = h.crc {
            let mut hasher = crc32fast::Hasher::new();
            let mut at = body;
            while at < end {
                let n = usize::try_from(end - at).unwrap_or(WINDOW).min(WINDOW);
                hasher.update(w.bytes(at, n, WINDOW)?);
                at += n as u64;
            }
            // parquet.thrift keeps the unsigned CRC in an i32.
            let (got, said) = (hasher.finalize(), crc as u32);
            if got != said {
                return Err(format!(
                    "page at byte {offset}: its bytes' CRC-32 is {got:08x}, its header says {said:08x}"
                ));
            }
        } else {
            unchecked += 1;
        }
        pos = end;
    }
    Ok(unchecked)
}

/// Bytes of a column chunk's start read to tell whether its first page carries a checksum: room
/// for the whole header, statistics and all (writers drop statistics larger than 4 KiB).
pub const CRC_PROBE_BYTES: u64 = HEADER_READ as u64;

/// Whether the page header at the start of `prefix` (the first bytes of a column chunk of
/// `chunk_len` bytes) carries a CRC-32 of its page; None when the prefix does not hold a whole
/// page header that fits the chunk. Writers checksum every page of a file or none (pyarrow's
/// `write_page_checksum`, parquet-mr's `parquet.page.write-checksum.enabled`), so one header
/// tells of the file. The header is read whole, as arrow-rs will read it, and its page must fit
/// the chunk: a byte spoilt in transit that made a header seem to have a CRC field (one bit of
/// the first field's header does, read by its first fields alone) spoils the rest of it too.
pub fn header_has_crc(prefix: &[u8], chunk_len: u64) -> Option<bool> {
    let (h, header_len) = read_header(prefix).ok()?;
    let page_end = u64::try_from(h.compressed).ok()?.checked_add(header_len as u64)?;
    let known_type = (0..=3).contains(&h.page_type);
    (known_type && h.uncompressed >= 0 && page_end <= chunk_len).then_some(h.crc.is_some())
}

/// The bytes of a chunk last read, from `at`: small pages' headers and bodies come from one read,
/// and a page without a checksum costs the read of its header only.
struct Window<F> {
    read: F,
    len: u64,
    at: u64,
    buf: Vec<u8>,
}

impl<F: FnMut(u64, &mut [u8]) -> Result<(), String>> Window<F> {
    /// Bytes `from..from + n` of the chunk (`n` at most what is left of it), read with up to
    /// `ahead` bytes when they are not at hand.
    fn bytes(&mut self, from: u64, n: usize, ahead: usize) -> Result<&[u8], String> {
        let inside = from >= self.at && from + n as u64 <= self.at + self.buf.len() as u64;
        if !inside {
            let left = usize::try_from(self.len.saturating_sub(from)).unwrap_or(usize::MAX);
            self.buf.resize(n.max(ahead).min(left), 0);
            (self.read)(from, &mut self.buf)?;
            self.at = from;
        }
        let skip = usize::try_from(from - self.at).map_err(|_| "past the chunk".to_string())?;
        self.buf.get(skip..skip + n).ok_or_else(|| format!("{n} bytes at {from} past the chunk's {}", self.len))
    }
}

/// The least room one value of a column takes in a PLAIN page (dictionaries are PLAIN).
enum Width {
    Bits,
    Bytes(u64),
}

fn value_width(ty: PhysicalType, type_length: i32) -> Width {
    match ty {
        PhysicalType::BOOLEAN => Width::Bits,
        PhysicalType::INT32 | PhysicalType::FLOAT => Width::Bytes(4),
        PhysicalType::INT64 | PhysicalType::DOUBLE => Width::Bytes(8),
        PhysicalType::INT96 => Width::Bytes(12),
        // Its 4-byte length.
        PhysicalType::BYTE_ARRAY => Width::Bytes(4),
        PhysicalType::FIXED_LEN_BYTE_ARRAY => Width::Bytes(u64::try_from(type_length).unwrap_or(0).max(1)),
    }
}

/// Reads a `PageHeader` from the start of `buf`: the fields checked, and the header's length.
fn read_header(buf: &[u8]) -> Result<(Header, usize), String> {
    // First as arrow-rs will read it, every field it knows of the type it knows.
    Reader::new(buf, MAX_DEPTH, "header").walk(super::idl::PAGE_HEADER, 0)?;
    let mut r = Reader::new(buf, MAX_DEPTH, "header");
    let mut h = Header::default();
    let (mut seen_type, mut seen_sizes) = (false, 0);
    r.fields(0, |r, id, ty| {
        match (id, ty) {
            (1, I32) => {
                h.page_type = r.i32()?;
                seen_type = true;
            }
            (2, I32) => {
                h.uncompressed = r.i32()?;
                seen_sizes += 1;
            }
            (3, I32) => {
                h.compressed = r.i32()?;
                seen_sizes += 1;
            }
            (4, I32) => h.crc = Some(r.i32()?),
            // A v1 data page header's encoding; a dictionary page header's value count.
            (5, STRUCT) => h.data_encoding = r.nested_i32(2)?,
            (7, STRUCT) => h.dictionary_values = r.nested_i32(1)?,
            (8, STRUCT) => {
                r.fields(1, |r, id, ty| match (id, ty) {
                    (4, I32) => {
                        h.data_encoding = Some(r.i32()?);
                        Ok(())
                    }
                    (7, BOOL_TRUE) => {
                        h.v2_compressed = Some(true);
                        Ok(())
                    }
                    (7, BOOL_FALSE) => {
                        h.v2_compressed = Some(false);
                        Ok(())
                    }
                    _ => r.skip(ty, 2),
                })?;
            }
            _ => r.skip(ty, 1)?,
        }
        Ok(())
    })?;
    if !seen_type || seen_sizes != 2 {
        return Err("a page header without its type or sizes".into());
    }
    Ok((h, r.pos()))
}

#[cfg(test)]
mod tests {
    use super::super::{footer, testdata};
    use super::*;
    use crate::format::parquet::thrift::{I64, LIST};
    use crate::format::parquet::{ParquetError, ParquetTable};

    fn table(bytes: &[u8]) -> ParquetTable {
        let f = footer::read_footer(bytes.len() as u64, |o, b| {
            let o = o as usize;
            b.copy_from_slice(bytes.get(o..o + b.len()).ok_or(ParquetError::Io("short".into()))?);
            Ok(())
        })
        .unwrap();
        ParquetTable::decode(&f, bytes.len() as u64).unwrap()
    }

    /// A compact-protocol field header and value of type i32.
    fn i32_field(delta: u8, v: i32) -> Vec<u8> {
        let mut out = vec![(delta << 4) | I32];
        let mut z = ((v << 1) ^ (v >> 31)) as u32 as u64;
        loop {
            let b = (z & 0x7f) as u8;
            z >>= 7;
            out.push(if z == 0 { b } else { b | 0x80 });
            if z == 0 {
                return out;
            }
        }
    }

    /// A page header: type, sizes, and a dictionary page header of `dict_values` if given.
    fn header(page_type: i32, uncompressed: i32, compressed: i32, dict_values: Option<i32>) -> Vec<u8> {
        let mut h = [i32_field(1, page_type), i32_field(1, uncompressed), i32_field(1, compressed)].concat();
        if let Some(n) = dict_values {
            // Field 7 (delta 4 from field 3): a struct of num_values and encoding (PLAIN).
            h.push((4 << 4) | STRUCT);
            h.extend(i32_field(1, n));
            h.extend(i32_field(1, 0));
            h.push(0);
        }
        h.push(0);
        h
    }

    /// The metadata of the first column chunk (`id`, int64) of a test file written with `codec`.
    fn meta_of(codec: testdata::Codec) -> ColumnChunkMetaData {
        largest(codec, false)
    }

    /// The first or, with `largest`, the largest column chunk of a test file written with `codec`.
    fn largest(codec: testdata::Codec, largest: bool) -> ColumnChunkMetaData {
        let bytes = testdata::mixed(40, 40, codec);
        let t = table(&bytes);
        let rg = t.reader_metadata().metadata().row_group(0);
        let pick =
            if largest { rg.columns().iter().max_by_key(|c| c.uncompressed_size()) } else { rg.columns().first() };
        pick.unwrap().clone()
    }

    /// Pages of `bodies`, each with a header of its sizes and, where given, its CRC field.
    fn pages_with_crcs(bodies: &[(&[u8], Option<u32>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (body, crc) in bodies {
            let n = body.len() as i32;
            out.extend([i32_field(1, 0), i32_field(1, n), i32_field(1, n)].concat());
            if let Some(c) = crc {
                out.extend(i32_field(1, *c as i32));
            }
            out.push(0);
            out.extend_from_slice(body);
        }
        out
    }

    #[test]
    fn a_first_page_header_tells_whether_the_file_checksums_its_pages() {
        let body = &b"a page"[..];
        let with = pages_with_crcs(&[(body, Some(crc32fast::hash(body)))]);
        let without = pages_with_crcs(&[(body, None)]);
        let len = with.len() as u64;
        assert_eq!(header_has_crc(&with, len), Some(true));
        assert_eq!(header_has_crc(&without, len), Some(false));
        // A prefix must hold the whole header, and its page must fit the chunk.
        assert_eq!(header_has_crc(&with[..10], len), None);
        assert_eq!(header_has_crc(b"", len), None);
        assert_eq!(header_has_crc(&with, 8), None);
        let odd_type = [i32_field(1, 9), i32_field(1, 6), i32_field(1, 6), i32_field(1, 7), vec![0]].concat();
        assert_eq!(header_has_crc(&odd_type, 100), None);
        // arrow-rs writes no page checksums (pyarrow's are read end to end, in test_parquet.py).
        for codec in [testdata::Codec::None, testdata::Codec::Snappy] {
            let bytes = testdata::mixed(40, 40, codec);
            let chunk = table(&bytes).chunk_range(0, 0).unwrap();
            let (start, len) = (chunk.start as usize, chunk.end - chunk.start);
            let prefix = &bytes[start..start + (CRC_PROBE_BYTES.min(len) as usize)];
            assert_eq!(header_has_crc(prefix, len), Some(false), "{codec:?}");
            // A byte spoilt in transit (inverted, or one bit of it) never makes a header without
            // a CRC field say it has one: the file then stays whole, checked by its MD5.
            for at in 0..prefix.len().min(256) {
                for flip in [0xffu8, 1, 2, 4, 8, 16, 32, 64, 128] {
                    let mut spoilt = prefix.to_vec();
                    spoilt[at] ^= flip;
                    assert_ne!(header_has_crc(&spoilt, len), Some(true), "{codec:?}: byte {at} ^ {flip:#x}");
                }
            }
        }
    }

    #[test]
    fn page_checksums_are_checked_where_the_writer_gave_them() {
        let (a, b) = (&b"first page's bytes"[..], &b"second"[..]);
        let good = pages_with_crcs(&[(a, Some(crc32fast::hash(a))), (b, None), (b, Some(crc32fast::hash(b)))]);
        // The page without one is counted: checked by nothing.
        assert_eq!(check_crcs(&good, 1000), Ok(1));
        // One byte of the first page's body inverted: named by the page's offset.
        let mut bad = good.clone();
        let at = good.windows(a.len()).position(|w| w == a).unwrap() + 3;
        bad[at] ^= 0xff;
        let e = check_crcs(&bad, 1000).unwrap_err();
        assert!(e.starts_with("page at byte 1000: its bytes' CRC-32 is"), "{e}");
        // In the page without a checksum nothing can tell.
        let mut unchecked = good.clone();
        let second = good.windows(b.len()).position(|w| w == b).unwrap();
        unchecked[second] ^= 0xff;
        assert_eq!(check_crcs(&unchecked, 0), Ok(1));
        // A chunk cut short, and a header spoilt, are refused too.
        assert!(check_crcs(&good[..good.len() - 1], 0).unwrap_err().contains("run past the chunk"));
        let mut header = good.clone();
        header[0] = 0xff;
        assert!(check_crcs(&header, 7).unwrap_err().starts_with("page header at byte 7"));
    }

    /// A chunk larger than the window, pages of every size across its edges: read a window at a
    /// time (about the chunk once, never more than a window at once), every checksum checked.
    #[test]
    fn a_large_chunk_is_checked_a_window_at_a_time() {
        let bodies: Vec<Vec<u8>> = [10usize, WINDOW + WINDOW / 2, 700 << 10, 300 << 10, 1, WINDOW - 5, 3 << 10]
            .iter()
            .enumerate()
            .map(|(k, &n)| (0..n).map(|i| (i * 31 + k) as u8).collect())
            .collect();
        let pages: Vec<(&[u8], Option<u32>)> = bodies.iter().map(|b| (&b[..], Some(crc32fast::hash(b)))).collect();
        let chunk = pages_with_crcs(&pages);
        let (mut reads, mut largest, mut bytes) = (0, 0, 0);
        let counted = |at: u64, buf: &mut [u8]| {
            reads += 1;
            largest = largest.max(buf.len());
            bytes += buf.len();
            buf.copy_from_slice(&chunk[at as usize..at as usize + buf.len()]);
            Ok(())
        };
        check_crcs_with(chunk.len() as u64, 0, counted).unwrap();
        assert!(largest <= WINDOW, "{largest}");
        assert!(bytes < chunk.len() * 2 && reads < 16, "{reads} reads of {bytes} bytes for {}", chunk.len());
        let mut bad = chunk.clone();
        let last = bad.len() - 2;
        bad[last] ^= 1;
        assert!(check_crcs(&bad, 0).unwrap_err().contains("its bytes' CRC-32"));
    }

    #[test]
    fn every_page_of_files_written_by_arrow_passes() {
        for codec in [testdata::Codec::None, testdata::Codec::Snappy, testdata::Codec::Zstd] {
            for rg_rows in [1, 7, 300] {
                let bytes = testdata::mixed(300, rg_rows, codec);
                let t = table(&bytes);
                let md = t.reader_metadata().metadata();
                for rg in 0..t.num_row_groups() {
                    for c in 0..md.row_group(rg).num_columns() {
                        let r = t.chunk_range(rg, c).unwrap();
                        let chunk = &bytes[r.start as usize..r.end as usize];
                        check_chunk(chunk, r.start, md.row_group(rg).column(c))
                            .unwrap_or_else(|e| panic!("{codec:?} rg {rg} column {c}: {e}"));
                        check_crcs(chunk, r.start).unwrap_or_else(|e| panic!("{codec:?} rg {rg} column {c}: {e}"));
                    }
                }
            }
        }
    }

    #[test]
    fn a_dictionary_with_more_values_than_its_bytes_hold_is_refused() {
        // Column 0 is int64: 8 bytes a value.
        let meta = meta_of(testdata::Codec::None);
        let ok = [header(DICTIONARY_PAGE, 80, 80, Some(10)), vec![0; 80]].concat();
        check_chunk(&ok, 0, &meta).unwrap();
        let bad = [header(DICTIONARY_PAGE, 80, 80, Some(11)), vec![0; 80]].concat();
        let e = check_chunk(&bad, 0, &meta).unwrap_err();
        assert!(e.contains("a dictionary of 11 values in 80 bytes"), "{e}");
        let huge = [header(DICTIONARY_PAGE, 80, 80, Some(i32::MAX)), vec![0; 80]].concat();
        assert!(check_chunk(&huge, 0, &meta).is_err());
        // Stored uncompressed, a dictionary is the bytes stored, whatever size the header claims
        // (a footer can claim any chunk size, so that claim bounds nothing).
        let claims_more = [header(DICTIONARY_PAGE, 300, 80, Some(11)), vec![0; 80]].concat();
        let e = check_chunk(&claims_more, 0, &meta).unwrap_err();
        assert!(e.contains("a dictionary of 11 values in 80 bytes"), "{e}");
        let negative = [header(DICTIONARY_PAGE, 80, 80, Some(-1)), vec![0; 80]].concat();
        assert!(check_chunk(&negative, 0, &meta).is_err());
        let headless = [header(DICTIONARY_PAGE, 80, 80, None), vec![0; 80]].concat();
        assert!(check_chunk(&headless, 0, &meta).unwrap_err().contains("without its header"));
    }

    /// A data page header (v1, or v2 with `v2`) of 16 bytes whose values are encoded `encoding`.
    fn data_page(encoding: i32, v2: bool) -> Vec<u8> {
        let mut h = [i32_field(1, if v2 { 3 } else { 0 }), i32_field(1, 16), i32_field(1, 16)].concat();
        if v2 {
            // Field 8: num_values, num_nulls, num_rows, encoding, the two level lengths.
            h.push((5 << 4) | STRUCT);
            for v in [4, 0, 4, encoding, 0, 0] {
                h.extend(i32_field(1, v));
            }
        } else {
            // Field 5: num_values, encoding, the two level encodings (RLE).
            h.push((2 << 4) | STRUCT);
            for v in [4, encoding, 3, 3] {
                h.extend(i32_field(1, v));
            }
        }
        h.push(0);
        h.push(0);
        [h, vec![0; 16]].concat()
    }

    #[test]
    fn a_dictionary_encoded_data_page_needs_a_dictionary_page_before_it() {
        let meta = meta_of(testdata::Codec::None);
        let dict = [header(DICTIONARY_PAGE, 80, 80, Some(10)), vec![0; 80]].concat();
        for v2 in [false, true] {
            for encoding in [PLAIN_DICTIONARY, RLE_DICTIONARY] {
                let alone = data_page(encoding, v2);
                let e = check_chunk(&alone, 0, &meta).unwrap_err();
                assert!(e.contains("dictionary-encoded data page with no dictionary page before it"), "{e}");
                check_chunk(&[dict.clone(), alone.clone()].concat(), 0, &meta).unwrap();
                let e = check_chunk(&[alone.clone(), dict.clone()].concat(), 0, &meta).unwrap_err();
                assert!(e.contains("page at byte 0:"), "{e}");
            }
            // PLAIN needs none.
            check_chunk(&data_page(0, v2), 0, &meta).unwrap();
        }
    }

    #[test]
    fn sizes_that_do_not_fit_the_chunk_or_its_codec_are_refused() {
        let plain = meta_of(testdata::Codec::None);
        let total = plain.uncompressed_size() as i32;
        let data = |u: i32, c: i32, stored: usize| [header(0, u, c, None), vec![0; stored]].concat();
        check_chunk(&data(16, 16, 16), 0, &plain).unwrap();
        assert!(check_chunk(&data(16, 17, 16), 0, &plain).unwrap_err().contains("run past the chunk"));
        assert!(check_chunk(&data(-1, 16, 16), 0, &plain).unwrap_err().contains("negative"));
        assert!(check_chunk(&data(total + 1, 16, 16), 0, &plain).unwrap_err().contains("more than the whole chunk"));
        // Snappy: ~21x at most.
        let snappy = largest(testdata::Codec::Snappy, true);
        let big = snappy.uncompressed_size() as i32;
        assert!(big > 22 * 16 + 64, "the test needs a chunk larger than the snappy bound");
        check_chunk(&data(22 * 16 + 64, 16, 16), 0, &snappy).unwrap();
        let e = check_chunk(&data(22 * 16 + 65, 16, 16), 0, &snappy).unwrap_err();
        assert!(e.contains("from 16 of snappy"), "{e}");
        // Zstd may expand further (checked after decompression, as arrow-rs does).
        let zstd = largest(testdata::Codec::Zstd, true);
        let big = (zstd.uncompressed_size() as i32).min(22 * 16 + 65);
        check_chunk(&data(big, 16, 16), 0, &zstd).unwrap();
    }

    #[test]
    fn damaged_headers_are_errors_never_panics_or_endless() {
        let meta = meta_of(testdata::Codec::Snappy);
        let good = [header(DICTIONARY_PAGE, 80, 80, Some(10)), vec![0; 80]].concat();
        for cut in 0..good.len() {
            let _ = check_chunk(&good[..cut], 0, &meta);
        }
        for pos in 0..good.len() {
            for v in [0u8, 0x0f, 0x19, 0x1c, 0x80, 0xff] {
                let mut bad = good.clone();
                bad[pos] = v;
                let _ = check_chunk(&bad, 0, &meta);
            }
        }
        // Deep nesting (in a field arrow-rs skips), a list claiming more elements than there
        // are bytes, and a field arrow-rs knows sent as another type.
        let deep = [vec![(9 << 4) | STRUCT], vec![(1 << 4) | STRUCT; 63], vec![0; 64]].concat();
        assert!(check_chunk(&deep, 0, &meta).unwrap_err().contains("too deep"));
        let list = [vec![(9 << 4) | LIST, 0xf0 | I64], vec![0xff, 0xff, 0xff, 0xff, 0x0f]].concat();
        assert!(check_chunk(&list, 0, &meta).unwrap_err().contains("declares"));
        let typed = [vec![(1 << 4) | I64, 4], header(DICTIONARY_PAGE, 80, 80, Some(10))].concat();
        let e = check_chunk(&typed, 0, &meta).unwrap_err();
        assert!(e.contains("field 1 is an i64 where parquet.thrift has an i32"), "{e}");
    }
}
