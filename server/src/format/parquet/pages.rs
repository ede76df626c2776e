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
