//! WebDataset TAR shards: indexing a shard from its headers alone, and parsing one sample's bytes.
//!
//! This module owns the byte-level reading of TAR archives and the WebDataset grouping rule. It does
//! no I/O of its own beyond the reader handed to [`index_tar`], and knows nothing of caches,
//! storage or sidecars (see [`super::sidecar`] for the on-disk form of a [`TarIndex`]).
//!
//! # Samples
//!
//! A sample is a run of consecutive regular-file members sharing a key. For `dir/sub/abc.seg.png`
//! the key is `dir/sub/abc` (the path up to the first dot of the *file name*; dots in directory
//! names do not count) and the field is `seg.png`. As in the `webdataset` library:
//! - members whose file name has no dot, starts with a dot, or ends with its first dot are skipped;
//! - WebDataset metadata (`__name__`, `__dir__/...`) is skipped;
//! - fields are lower-cased (`abc.JPG` is field `jpg`);
//! - a field appearing twice in one sample is an error ([`TarError::DuplicateField`]).
//!
//! Directories, links, devices, FIFOs and sparse files are skipped (a sparse member's bytes on disk
//! are not the file's contents, and `webdataset` shards never hold one).
//!
//! # Headers
//!
//! POSIX ustar (`prefix` + `name`), old GNU and v7 headers, GNU long names (`L`) and long link names
//! (`K`, skipped), PAX extended headers (`x`, or Solaris `X`: `path` and `size`, so members beyond
//! the 8 GiB octal limit work), PAX global headers (`g`, ignored) and base-256 numbers. Every
//! header's checksum is verified, accepting both the unsigned and the signed sum, as GNU tar and
//! Python's `tarfile` do.
//! Which member types carry data blocks follows Python's `tarfile` (what `webdataset` reads with):
//! links, devices, directories and FIFOs have none whatever their size field says.
//!
//! The end of the archive is the first zero block (the second one of the end-of-archive marker is
//! not required), or the end of the data at a block boundary: lenient, like `tar`. Data that ends
//! anywhere else (inside a header, a payload, or the padding after one) is a truncated archive, and
//! so an error: every whole TAR archive is a multiple of 512 bytes.
//!
//! # Cost
//!
//! [`index_tar`] reads only header blocks (plus long-name and PAX records) and seeks over payloads,
//! with buffers reused across members: a 1 GiB shard of 100 KiB samples costs about 5 MiB of reads.
//! [`parse_sample`] runs for every delivered sample: it borrows names and payloads from the buffer
//! and allocates only its member list (and a string for a ustar `prefix`, a non-UTF-8 name or an
//! upper-case field).
//!
//! Nothing here trusts a header: every size is checked against the end of the data with checked
//! arithmetic before anything is read or allocated, and long-name and PAX records are capped at
//! [`MAX_NAME_BYTES`] and [`MAX_PAX_BYTES`].

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::ops::Range;

/// TAR block size: every header and every padded payload is a multiple of it.
pub const BLOCK: u64 = 512;
/// Longest GNU long name record accepted. Real paths stay under `PATH_MAX` (4 KiB); 64 KiB leaves
/// room for anything sane while a malicious header cannot make us allocate much.
pub const MAX_NAME_BYTES: u64 = 64 << 10;
/// Largest PAX extended header accepted, for the same reason: a path plus a few timestamps and
/// attributes takes well under 1 KiB, and 1 MiB leaves room for generous `SCHILY.xattr` records.
pub const MAX_PAX_BYTES: u64 = 1 << 20;

/// Members a sample usually has (image, label, metadata, ...): the initial capacity of
/// [`SampleView::members`], so that typical samples allocate once.
const TYPICAL_MEMBERS: usize = 4;

const BLOCK_BYTES: usize = BLOCK as usize;
type Block = [u8; BLOCK_BYTES];

// Header fields (POSIX.1-1988 ustar; old GNU and v7 share name, size, checksum and typeflag).
const NAME: Range<usize> = 0..100;
const SIZE: Range<usize> = 124..136;
const CHECKSUM: Range<usize> = 148..156;
const TYPEFLAG: usize = 156;
const MAGIC: Range<usize> = 257..263;
const PREFIX: Range<usize> = 345..500;
/// Old GNU sparse headers: "the sparse map continues in an extension block", in the header and
/// in each extension block.
const GNU_IS_EXTENDED: usize = 482;
const GNU_EXTENSION_IS_EXTENDED: usize = 504;
/// POSIX magic (old GNU headers say `"ustar  \0"` and keep other data where `prefix` would be).
const USTAR_MAGIC: &[u8; 6] = b"ustar\0";

#[derive(Debug, thiserror::Error)]
pub enum TarError {
    #[error("read error at offset {offset}: {source}")]
    Io {
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("not a TAR file: no valid TAR header at offset {offset}")]
    NotTar { offset: u64 },
    #[error("truncated archive at offset {offset}: {what}")]
    Truncated { offset: u64, what: &'static str },
    #[error("bad header checksum at offset {offset}: the archive is corrupt")]
    BadChecksum { offset: u64 },
    /// `end` is where the data ends: the shard's length for [`index_tar`], the end of the buffer
    /// for [`parse_sample`] (an absolute shard offset after [`TarError::with_base`]).
    #[error("member '{name}' at offset {offset} claims {size} bytes but the {scope} ends at {end}")]
    PastEnd { offset: u64, name: String, size: u64, end: u64, scope: &'static str },
    #[error("malformed PAX extended header record at offset {offset}: {reason}")]
    BadPax { offset: u64, reason: &'static str },
    #[error("malformed {field} field in the header at offset {offset}")]
    BadNumber { offset: u64, field: &'static str },
    #[error("{what} at offset {offset} is {size} bytes, over the limit of {limit} bytes")]
    TooLong { offset: u64, what: &'static str, size: u64, limit: u64 },
    #[error("member '{name}' at offset {offset} does not belong to sample '{key}' whose byte range it is in")]
    KeyMismatch { offset: u64, name: String, key: String },
    #[error("sample '{key}' has a second '{field}' member at offset {offset}")]
    DuplicateField { offset: u64, key: String, field: String },
    #[error("no sample member in the byte range at offset {offset}")]
    NoMembers { offset: u64 },
}

impl TarError {
    /// Byte offset the error is about: within the shard for [`index_tar`], within the buffer for
    /// [`parse_sample`] until shifted by [`TarError::with_base`].
    pub fn offset(&self) -> Option<u64> {
        match self {
            TarError::Io { offset, .. }
            | TarError::NotTar { offset }
            | TarError::Truncated { offset, .. }
            | TarError::BadChecksum { offset }
            | TarError::PastEnd { offset, .. }
            | TarError::BadPax { offset, .. }
            | TarError::BadNumber { offset, .. }
            | TarError::TooLong { offset, .. }
            | TarError::KeyMismatch { offset, .. }
            | TarError::DuplicateField { offset, .. }
            | TarError::NoMembers { offset } => Some(*offset),
        }
    }

    /// Shifts every offset in the error by `base`: [`parse_sample`] reports offsets within its
    /// buffer, and the caller knows where the buffer starts in the shard.
    pub fn with_base(mut self, base: u64) -> Self {
        match &mut self {
            TarError::PastEnd { offset, end, .. } => {
                *offset = offset.saturating_add(base);
                *end = end.saturating_add(base);
            }
            TarError::Io { offset, .. }
            | TarError::NotTar { offset }
            | TarError::Truncated { offset, .. }
            | TarError::BadChecksum { offset }
            | TarError::BadPax { offset, .. }
            | TarError::BadNumber { offset, .. }
            | TarError::TooLong { offset, .. }
            | TarError::KeyMismatch { offset, .. }
            | TarError::DuplicateField { offset, .. }
            | TarError::NoMembers { offset } => *offset = offset.saturating_add(base),
        }
        self
    }
}

/// A shard's sample table.
///
/// Sample `i` occupies shard bytes `boundaries[i]..boundaries[i + 1]`: from the first header block
/// of its first member (extension headers included) to the first header block of the next sample,
/// so members skipped in between fall inside a range and are skipped again by [`parse_sample`].
/// The last sample ends where its last member's padded payload ends; members skipped after it are
/// in no range.
///
/// A shard without samples has no boundaries at all (`boundaries == []`); [`TarIndex::num_samples`]
/// also reads a lone boundary as no samples.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TarIndex {
    pub boundaries: Vec<u64>,
    /// Sorted, distinct field names seen in the shard.
    pub fields: Vec<String>,
}

impl TarIndex {
    pub fn num_samples(&self) -> usize {
        self.boundaries.len().saturating_sub(1)
    }

    /// The sample spanning the most shard bytes (headers included): (index, bytes), None for an
    /// empty shard. The first of equals, so the manifest's `max_sample` is stable.
    pub fn largest_sample(&self) -> Option<(u64, u64)> {
        self.boundaries.windows(2).enumerate().map(|(i, w)| (i as u64, w[1].saturating_sub(w[0]))).fold(
            None,
            |best: Option<(u64, u64)>, s| match best {
                Some(b) if b.1 >= s.1 => Some(b),
                _ => Some(s),
            },
        )
    }

    /// Shard byte range of sample `i`; None past the last sample.
    pub fn sample_range(&self, i: usize) -> Option<Range<u64>> {
        let end = *self.boundaries.get(i.checked_add(1)?)?;
        Some(*self.boundaries.get(i)?..end)
    }

    /// True when the ranges never go back and end within a shard of `shard_len` bytes: what an
    /// index from elsewhere (a sidecar) must satisfy before its ranges size any read.
    pub fn fits_shard(&self, shard_len: u64) -> bool {
        self.boundaries.windows(2).all(|w| w[0] <= w[1]) && self.boundaries.last().is_none_or(|&end| end <= shard_len)
    }

    /// Bytes of heap memory the index holds.
    pub fn heap_bytes(&self) -> usize {
        self.boundaries.capacity() * size_of::<u64>()
            + self.fields.capacity() * size_of::<String>()
            + self.fields.iter().map(String::capacity).sum::<usize>()
    }
}

/// Splits a member path into `(key, field)` by the WebDataset rule (the field as written, before
/// lower-casing); None for members that belong to no sample.
pub fn split_key(path: &str) -> Option<(&str, &str)> {
    if is_metadata(path) {
        return None;
    }
    let name_start = path.rfind('/').map_or(0, |slash| slash + 1);
    let dot = path.get(name_start..)?.find('.')?;
    if dot == 0 {
        return None; // ".hidden": no key
    }
    let key_end = name_start + dot;
    let field = path.get(key_end + 1..)?;
    if field.is_empty() {
        return None; // "abc.": no field to select it by
    }
    Some((path.get(..key_end)?, field))
}

/// WebDataset's metadata members (`skip_meta = r"__[^/]*__($|/)"`): a first path component
/// that starts and ends with `__`.
fn is_metadata(path: &str) -> bool {
    let first = path.split('/').next().unwrap_or(path);
    first.len() >= 4 && first.starts_with("__") && first.ends_with("__")
}

/// Lower-cases a field as `webdataset` does (`suffix.lower()`), allocating only when it changes.
fn normalize_field(field: Cow<'_, str>) -> Cow<'_, str> {
    if field.is_ascii() {
        if field.bytes().any(|b| b.is_ascii_uppercase()) { Cow::Owned(field.to_ascii_lowercase()) } else { field }
    } else {
        let lower = field.to_lowercase();
        if lower == *field { field } else { Cow::Owned(lower) }
    }
}

/// [`split_key`] on a name that may own its string: borrowed parts stay borrowed.
fn split_name(name: Cow<'_, str>) -> Option<(Cow<'_, str>, Cow<'_, str>)> {
    match name {
        Cow::Borrowed(n) => split_key(n).map(|(k, f)| (Cow::Borrowed(k), Cow::Borrowed(f))),
        Cow::Owned(mut n) => {
            let (key_len, field) = split_key(&n).map(|(k, f)| (k.len(), f.to_owned()))?;
            n.truncate(key_len);
            Some((Cow::Owned(n), Cow::Owned(field)))
        }
    }
}

/// Parses a numeric header field: octal text (NUL- or space-terminated, blanks around it allowed,
/// empty meaning 0, as Python's `tarfile` reads it) or GNU base-256 (top bit of the first byte set;
/// negative values are rejected).
fn parse_number(field: &[u8], offset: u64, name: &'static str) -> Result<u64, TarError> {
    let bad = || TarError::BadNumber { offset, field: name };
    let Some((&first, rest)) = field.split_first() else { return Ok(0) };
    if first & 0x80 != 0 {
        if first & 0x40 != 0 {
            return Err(bad()); // negative
        }
        return rest.iter().try_fold(u64::from(first & 0x3f), |v, &b| {
            v.checked_mul(256).and_then(|v| v.checked_add(u64::from(b))).ok_or_else(bad)
        });
    }
    let text = field.split(|&b| b == 0).next().unwrap_or(field).trim_ascii();
    text.iter().try_fold(0u64, |v, &b| {
        let digit = if (b'0'..=b'7').contains(&b) { u64::from(b - b'0') } else { return Err(bad()) };
        v.checked_mul(8).and_then(|v| v.checked_add(digit)).ok_or_else(bad)
    })
}

/// True when the stored checksum matches the sum of the header's bytes (checksum field read as
/// spaces), unsigned as POSIX says or signed as some historic tars wrote it.
fn checksum_ok(block: &Block) -> bool {
    let Some(stored) = block.get(CHECKSUM).and_then(|f| parse_number(f, 0, "checksum").ok()) else {
        return false;
    };
    let field = block.get(CHECKSUM).unwrap_or_default();
    // 512 bytes of at most 255 each: no overflow in u32/i32.
    let spaces = 8 * u32::from(b' ');
    let unsigned =
        block.iter().map(|&b| u32::from(b)).sum::<u32>() - field.iter().map(|&b| u32::from(b)).sum::<u32>() + spaces;
    if stored == u64::from(unsigned) {
        return true;
    }
    let signed = |bytes: &[u8]| bytes.iter().map(|&b| i32::from(b as i8)).sum::<i32>();
    let signed = signed(block) - signed(field) + spaces as i32;
    i64::try_from(stored).is_ok_and(|s| s == i64::from(signed))
}

fn is_zero(block: &Block) -> bool {
    block.iter().all(|&b| b == 0)
}

/// Absolute range of a NUL-terminated field of the header block at `offset`.
fn field_range(block: &Block, field: Range<usize>, offset: u64) -> Range<u64> {
    let bytes = block.get(field.clone()).unwrap_or_default();
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    offset + field.start as u64..offset + (field.start + len) as u64
}

/// Offset of whatever follows a payload of `size` bytes starting at `data` (saturating: a
/// payload that large has already been rejected or ends the archive).
fn after_payload(data: u64, size: u64) -> u64 {
    data.saturating_add(size.div_ceil(BLOCK).saturating_mul(BLOCK))
}

/// One header block, checksum verified.
struct Header {
    typeflag: u8,
    size: u64,
    name: Range<u64>,
    /// The ustar `prefix`, when the header is POSIX ustar and the prefix is not empty.
    prefix: Option<Range<u64>>,
    /// An old GNU sparse member (`S`) whose sparse map continues in extension blocks.
    sparse_extended: bool,
}

fn parse_header(block: &Block, offset: u64) -> Result<Header, TarError> {
    if !checksum_ok(block) {
        return Err(TarError::BadChecksum { offset });
    }
    let size = parse_number(block.get(SIZE).unwrap_or_default(), offset, "size")?;
    let ustar = block.get(MAGIC) == Some(USTAR_MAGIC.as_slice());
    Ok(Header {
        typeflag: block[TYPEFLAG],
        size,
        name: field_range(block, NAME, offset),
        prefix: ustar.then(|| field_range(block, PREFIX, offset)).filter(|r| !r.is_empty()),
        sparse_extended: block[TYPEFLAG] == b'S' && block[GNU_IS_EXTENDED] != 0,
    })
}

/// What one PAX extended header says about the next member.
#[derive(Default)]
struct Pax {
    /// `Some(None)`: the record is present with an empty value, which unsets the keyword.
    path: Option<Option<Range<u64>>>,
    size: Option<Option<u64>>,
    sparse: bool,
}

fn parse_decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits
        .iter()
        .try_fold(0u64, |v, &b| v.checked_mul(10)?.checked_add(u64::from(b.checked_sub(b'0').filter(|d| *d < 10)?)))
}

/// Parses PAX records `"<len> <key>=<value>\n"` (`len` counts the whole record) of a header
/// whose bytes start at shard offset `base`. Stops at a NUL, as Python's `tarfile` does.
fn parse_pax(bytes: &[u8], base: u64) -> Result<Pax, TarError> {
    let mut pax = Pax::default();
    let mut pos = 0usize;
    while let Some(rest) = bytes.get(pos..).filter(|r| r.first().is_some_and(|&b| b != 0)) {
        let at = base + pos as u64;
        let bad = |reason| TarError::BadPax { offset: at, reason };
        let space = rest.iter().position(|&b| b == b' ').ok_or_else(|| bad("record without a length"))?;
        let len = rest
            .get(..space)
            .and_then(parse_decimal)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(|| bad("record length is not a decimal number"))?;
        if len > rest.len() {
            return Err(bad("record runs past the end of the header"));
        }
        let Some((b'\n', body)) = rest.get(space + 1..len).and_then(<[u8]>::split_last) else {
            return Err(bad("record does not end with a newline where its length says"));
        };
        let eq =
            body.iter().position(|&b| b == b'=').filter(|&eq| eq > 0).ok_or_else(|| bad("record without a key"))?;
        let (key, value) = (body.get(..eq).unwrap_or_default(), body.get(eq + 1..).unwrap_or_default());
        let value_start = at + (space + 1 + eq + 1) as u64;
        match key {
            b"path" => pax.path = Some((!value.is_empty()).then(|| value_start..value_start + value.len() as u64)),
            b"size" if value.is_empty() => pax.size = Some(None),
            b"size" => pax.size = Some(Some(parse_decimal(value).ok_or_else(|| bad("size is not a decimal number"))?)),
            k if k.starts_with(b"GNU.sparse.") => pax.sparse = true,
            _ => {}
        }
        pos += len;
    }
    Ok(pax)
}

/// Which loaded bytes a name lives in.
#[derive(Clone, Copy)]
enum Slot {
    /// The member's own header block.
    Header,
    /// The last GNU long name record.
    LongName,
    /// The PAX header that set the path.
    Pax,
}

/// Where a member's name lies, as absolute offsets of bytes the source has loaded.
#[derive(Debug, Clone)]
enum NameLoc {
    Header { prefix: Option<Range<u64>>, name: Range<u64> },
    Long(Range<u64>),
    Pax(Range<u64>),
}

/// Builds a member name from where [`NameLoc`] says it lies; `get` returns loaded bytes.
fn resolve_name<'n>(loc: &NameLoc, get: impl Fn(Slot, &Range<u64>) -> &'n [u8]) -> Cow<'n, str> {
    match loc {
        NameLoc::Header { prefix: None, name } => String::from_utf8_lossy(get(Slot::Header, name)),
        NameLoc::Header { prefix: Some(prefix), name } => {
            let mut joined = String::from_utf8_lossy(get(Slot::Header, prefix)).into_owned();
            joined.push('/');
            joined.push_str(&String::from_utf8_lossy(get(Slot::Header, name)));
            Cow::Owned(joined)
        }
        NameLoc::Long(r) => String::from_utf8_lossy(get(Slot::LongName, r)),
        NameLoc::Pax(r) => String::from_utf8_lossy(get(Slot::Pax, r)),
    }
}

/// One member, its extension headers applied.
struct Entry {
    /// Offset of the first block belonging to the member (extension headers included).
    start: u64,
    /// Offset of the member's own header block.
    header: u64,
    /// Offset and length of its payload (0 for types without data).
    data: u64,
    size: u64,
    /// Where the next header starts (saturating; may lie past the end of the data, which the next
    /// call reports as truncation).
    next: u64,
    regular: bool,
    name: NameLoc,
}

/// Where header parsing reads from: a seekable reader ([`index_tar`]) or a buffer
/// ([`parse_sample`]). Callers check that every range they ask for lies within [`Source::len`].
trait Source {
    fn len(&self) -> u64;
    /// How error messages call the end of the data.
    fn scope(&self) -> &'static str;
    fn block(&mut self, offset: u64) -> Result<&Block, TarError>;
    /// Loads `len` bytes at `offset` as the latest contents of `slot` (LongName or Pax).
    fn load(&mut self, slot: Slot, offset: u64, len: u64) -> Result<&[u8], TarError>;
    /// Keeps the PAX record just loaded: it holds the path of the member being read, which a
    /// later PAX header without a path must not overwrite.
    fn keep_pax(&mut self);
    /// Bytes loaded earlier (by `block` for Slot::Header, `load` otherwise); empty if not loaded.
    fn loaded(&self, slot: Slot, range: &Range<u64>) -> &[u8];
}

/// Reads the next member starting at `start`; Ok(None) at the end of the archive. `shard_start`
/// is true for the first header of a shard, whose failure means the data is not a TAR at all.
fn next_entry(src: &mut impl Source, start: u64, shard_start: bool) -> Result<Option<Entry>, TarError> {
    let len = src.len();
    let mut offset = start;
    let mut long_name: Option<Range<u64>> = None;
    let mut pax_path: Option<Range<u64>> = None;
    let mut pax_size: Option<u64> = None;
    let mut sparse = false;
    if start > len {
        return Err(TarError::Truncated { offset: len, what: "the data ends inside the padding after a payload" });
    }
    loop {
        let remaining = len.saturating_sub(offset);
        if remaining == 0 {
            return if offset == start {
                Ok(None)
            } else {
                Err(TarError::Truncated {
                    offset: start,
                    what: "the data ends after extension headers, before their member",
                })
            };
        }
        if remaining < BLOCK {
            return Err(if shard_start && offset == 0 {
                TarError::NotTar { offset }
            } else {
                TarError::Truncated { offset, what: "the data ends inside a header" }
            });
        }
        let block = src.block(offset)?;
        if is_zero(block) {
            return if offset == start {
                Ok(None)
            } else {
                Err(TarError::Truncated {
                    offset: start,
                    what: "extension headers are followed by the end of the archive",
                })
            };
        }
        let header = parse_header(block, offset).map_err(|e| match e {
            TarError::BadChecksum { offset: 0 } if shard_start => TarError::NotTar { offset: 0 },
            e => e,
        })?;
        // offset + BLOCK <= len: no overflow.
        let data = offset + BLOCK;
        let header_name = NameLoc::Header { prefix: None, name: header.name.clone() };
        match header.typeflag {
            // 'X': the Solaris spelling of 'x', read as such by Python's `tarfile`.
            b'L' | b'x' | b'X' => {
                let (slot, what, limit) = if header.typeflag == b'L' {
                    (Slot::LongName, "GNU long name record", MAX_NAME_BYTES)
                } else {
                    (Slot::Pax, "PAX extended header", MAX_PAX_BYTES)
                };
                if header.size > limit {
                    return Err(TarError::TooLong { offset, what, size: header.size, limit });
                }
                if !fits(data, header.size, len) {
                    return Err(past_end(src, offset, &header_name, header.size));
                }
                let bytes = src.load(slot, data, header.size)?;
                if header.typeflag == b'L' {
                    let name_len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
                    long_name = Some(data..data + name_len as u64);
                } else {
                    let pax = parse_pax(bytes, data)?;
                    if let Some(path) = pax.path {
                        if path.is_some() {
                            src.keep_pax();
                        }
                        pax_path = path;
                    }
                    if let Some(size) = pax.size {
                        pax_size = size;
                    }
                    sparse |= pax.sparse;
                }
                offset = after_payload(data, header.size);
            }
            // Long link names and global headers say nothing we use: skip without reading.
            b'K' | b'g' => {
                if !fits(data, header.size, len) {
                    return Err(past_end(src, offset, &header_name, header.size));
                }
                offset = after_payload(data, header.size);
            }
            typeflag => {
                let mut data = data;
                if header.sparse_extended {
                    // The payload starts after the sparse map's extension blocks. Reading them
                    // replaces the header in a reader's buffer, so an error about this member
                    // may lack its name; sparse members are skipped in any case.
                    let mut more = true;
                    while more {
                        if len.saturating_sub(data) < BLOCK {
                            return Err(TarError::Truncated {
                                offset: data,
                                what: "the data ends inside a sparse map",
                            });
                        }
                        more = src.block(data)?[GNU_EXTENSION_IS_EXTENDED] != 0;
                        data += BLOCK;
                    }
                }
                let has_data = !matches!(typeflag, b'1'..=b'6');
                let size = if has_data { pax_size.unwrap_or(header.size) } else { 0 };
                let name = match (pax_path, long_name) {
                    (Some(p), _) => NameLoc::Pax(p),
                    (None, Some(l)) => NameLoc::Long(l),
                    (None, None) => NameLoc::Header { prefix: header.prefix, name: header.name },
                };
                if !fits(data, size, len) {
                    return Err(past_end(src, offset, &name, size));
                }
                return Ok(Some(Entry {
                    start,
                    header: offset,
                    data,
                    size,
                    next: after_payload(data, size),
                    // '0' regular, '\0' old regular, '7' contiguous (a regular file to everyone).
                    regular: matches!(typeflag, b'0' | 0 | b'7') && !sparse,
                    name,
                }));
            }
        }
    }
}

/// True when `size` bytes from `data` end within `len`.
fn fits(data: u64, size: u64, len: u64) -> bool {
    data.checked_add(size).is_some_and(|end| end <= len)
}

/// The error for a member (or extension header) at `offset` whose `size` bytes do not fit.
fn past_end(src: &impl Source, offset: u64, name: &NameLoc, size: u64) -> TarError {
    TarError::PastEnd {
        offset,
        name: resolve_name(name, |slot, r| src.loaded(slot, r)).into_owned(),
        size,
        end: src.len(),
        scope: src.scope(),
    }
}

/// `buf[range - at]`, empty when the range is not inside `buf`.
fn sub_slice<'b>(buf: &'b [u8], at: u64, range: &Range<u64>) -> &'b [u8] {
    let local = |x: u64| x.checked_sub(at).and_then(|x| usize::try_from(x).ok());
    local(range.start).zip(local(range.end)).and_then(|(s, e)| buf.get(s..e)).unwrap_or_default()
}

/// Reads headers from a seekable reader into buffers reused across members.
struct ReaderSource<R> {
    reader: R,
    len: u64,
    /// The reader's position, when known.
    pos: Option<u64>,
    block: Block,
    block_at: u64,
    long: Vec<u8>,
    long_at: u64,
    /// The PAX header being read, and the last one that set a path.
    pax: Vec<u8>,
    pax_at: u64,
    pax_kept: Vec<u8>,
    pax_kept_at: u64,
}

impl<R: Read + Seek> ReaderSource<R> {
    fn new(reader: R, len: u64) -> Self {
        ReaderSource {
            reader,
            len,
            pos: None,
            block: [0; BLOCK_BYTES],
            block_at: u64::MAX,
            long: Vec::new(),
            long_at: 0,
            pax: Vec::new(),
            pax_at: 0,
            pax_kept: Vec::new(),
            pax_kept_at: 0,
        }
    }
}

/// Reads `buf.len()` bytes at `offset`, seeking only when the reader is not already there.
/// Forward moves use `seek_relative`, so a `BufReader` keeps its buffer when the target is in it.
fn read_at<R: Read + Seek>(reader: &mut R, pos: &mut Option<u64>, offset: u64, buf: &mut [u8]) -> Result<(), TarError> {
    let io = |source| TarError::Io { offset, source };
    if *pos != Some(offset) {
        let forward = pos.and_then(|p| offset.checked_sub(p)).and_then(|d| i64::try_from(d).ok());
        *pos = None;
        match forward {
            Some(delta) => reader.seek_relative(delta).map_err(io)?,
            None => reader.seek(SeekFrom::Start(offset)).map(drop).map_err(io)?,
        }
    }
    *pos = None;
    reader.read_exact(buf).map_err(|source| match source.kind() {
        ErrorKind::UnexpectedEof => {
            TarError::Truncated { offset, what: "the data is shorter than the shard's listed size" }
        }
        _ => io(source),
    })?;
    *pos = Some(offset.saturating_add(buf.len() as u64));
    Ok(())
}

impl<R: Read + Seek> Source for ReaderSource<R> {
    fn len(&self) -> u64 {
        self.len
    }

    fn scope(&self) -> &'static str {
        "shard"
    }

    fn block(&mut self, offset: u64) -> Result<&Block, TarError> {
        self.block_at = u64::MAX; // not valid until the read succeeds
        read_at(&mut self.reader, &mut self.pos, offset, &mut self.block)?;
        self.block_at = offset;
        Ok(&self.block)
    }

    fn load(&mut self, slot: Slot, offset: u64, len: u64) -> Result<&[u8], TarError> {
        let (buf, at) = match slot {
            Slot::LongName => (&mut self.long, &mut self.long_at),
            Slot::Pax | Slot::Header => (&mut self.pax, &mut self.pax_at),
        };
        // `len` is capped by the caller (MAX_NAME_BYTES / MAX_PAX_BYTES), so this fits memory.
        let len =
            usize::try_from(len).map_err(|_| TarError::Truncated { offset, what: "record larger than memory" })?;
        buf.clear();
        buf.resize(len, 0);
        *at = offset;
        read_at(&mut self.reader, &mut self.pos, offset, buf)?;
        Ok(buf.as_slice())
    }

    fn keep_pax(&mut self) {
        std::mem::swap(&mut self.pax, &mut self.pax_kept);
        self.pax_kept_at = self.pax_at;
    }

    fn loaded(&self, slot: Slot, range: &Range<u64>) -> &[u8] {
        match slot {
            Slot::Header => sub_slice(&self.block, self.block_at, range),
            Slot::LongName => sub_slice(&self.long, self.long_at, range),
            Slot::Pax => sub_slice(&self.pax_kept, self.pax_kept_at, range),
        }
    }
}

/// Reads headers from one in-memory sample: everything borrowed from the buffer.
struct SliceSource<'a> {
    buf: &'a [u8],
}

impl<'a> SliceSource<'a> {
    /// Like [`Source::loaded`], with the buffer's lifetime.
    fn bytes(&self, range: &Range<u64>) -> &'a [u8] {
        sub_slice(self.buf, 0, range)
    }

    fn get(&self, offset: u64, len: u64) -> Result<&'a [u8], TarError> {
        let range = offset..offset.saturating_add(len);
        let bytes = self.bytes(&range);
        if bytes.len() as u64 == len {
            Ok(bytes)
        } else {
            Err(TarError::Truncated { offset, what: "the data ends inside a header" })
        }
    }
}

impl Source for SliceSource<'_> {
    fn len(&self) -> u64 {
        self.buf.len() as u64
    }

    fn scope(&self) -> &'static str {
        "sample's byte range"
    }

    fn block(&mut self, offset: u64) -> Result<&Block, TarError> {
        self.get(offset, BLOCK)?
            .try_into()
            .map_err(|_| TarError::Truncated { offset, what: "the data ends inside a header" })
    }

    fn load(&mut self, _slot: Slot, offset: u64, len: u64) -> Result<&[u8], TarError> {
        self.get(offset, len)
    }

    fn keep_pax(&mut self) {}

    fn loaded(&self, _slot: Slot, range: &Range<u64>) -> &[u8] {
        self.bytes(range)
    }
}

/// The fields of the sample being indexed, in one reused string (no allocation per member).
#[derive(Default)]
struct FieldList {
    names: String,
    ends: Vec<usize>,
}

impl FieldList {
    fn clear(&mut self) {
        self.names.clear();
        self.ends.clear();
    }

    fn contains(&self, field: &str) -> bool {
        let mut start = 0;
        self.ends.iter().any(|&end| {
            let hit = self.names.get(start..end) == Some(field);
            start = end;
            hit
        })
    }

    fn push(&mut self, field: &str) {
        self.names.push_str(field);
        self.ends.push(self.names.len());
    }
}

/// Indexes a shard from its headers alone; payloads are skipped with seeks.
///
/// `shard_len` is the shard's size (from the listing or manifest) and bounds every member; the
/// reader is read within `0..shard_len` only. A `BufReader` around a file reads its whole buffer
/// at each header: pass the file itself (or a small buffer) when payloads are large.
pub fn index_tar<R: Read + Seek>(reader: R, shard_len: u64) -> Result<TarIndex, TarError> {
    let mut src = ReaderSource::new(reader, shard_len);
    let mut boundaries = Vec::new();
    let mut fields = BTreeSet::new();
    let mut key = String::new();
    let mut sample_fields = FieldList::default();
    let mut end = 0;
    let mut offset = 0;
    while let Some(e) = next_entry(&mut src, offset, offset == 0)? {
        offset = e.next;
        if !e.regular {
            continue;
        }
        let name = resolve_name(&e.name, |slot, r| src.loaded(slot, r));
        let Some((k, field)) = split_key(&name) else { continue };
        let field = normalize_field(Cow::Borrowed(field));
        if boundaries.is_empty() || k != key {
            boundaries.push(e.start);
            key.clear();
            key.push_str(k);
            sample_fields.clear();
        } else if sample_fields.contains(&field) {
            return Err(TarError::DuplicateField { offset: e.header, key, field: field.into_owned() });
        }
        sample_fields.push(&field);
        if !fields.contains(&*field) {
            fields.insert(field.into_owned());
        }
        end = e.next;
    }
    if !boundaries.is_empty() {
        boundaries.push(end);
    }
    boundaries.shrink_to_fit();
    Ok(TarIndex { boundaries, fields: fields.into_iter().collect() })
}

/// One sample as parsed from its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleView<'a> {
    pub key: Cow<'a, str>,
    /// The sample's members in shard order.
    pub members: Vec<Member<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member<'a> {
    /// Lower-cased field name (`jpg`, `seg.png`).
    pub field: Cow<'a, str>,
    /// Payload range within the parsed buffer.
    pub data: Range<usize>,
}

/// Parses one sample's bytes (exactly a range of a [`TarIndex`], read into memory) into its key and
/// members. Payloads are not copied: each member says where its bytes lie in `buf`. Error offsets
/// are relative to `buf`; see [`TarError::with_base`].
pub fn parse_sample(buf: &[u8]) -> Result<SampleView<'_>, TarError> {
    let mut src = SliceSource { buf };
    let mut key: Option<Cow<'_, str>> = None;
    let mut members: Vec<Member<'_>> = Vec::with_capacity(TYPICAL_MEMBERS);
    let mut offset = 0;
    while let Some(e) = next_entry(&mut src, offset, false)? {
        offset = e.next;
        if !e.regular {
            continue;
        }
        let Some((k, raw_field)) = split_name(resolve_name(&e.name, |_, r| src.bytes(r))) else { continue };
        match &key {
            None => key = Some(k),
            Some(existing) if *existing == k => {}
            Some(existing) => {
                return Err(TarError::KeyMismatch {
                    offset: e.header,
                    name: format!("{k}.{raw_field}"),
                    key: existing.to_string(),
                });
            }
        }
        let field = normalize_field(raw_field);
        if members.iter().any(|m| m.field == field) {
            return Err(TarError::DuplicateField {
                offset: e.header,
                key: key.as_deref().unwrap_or_default().to_owned(),
                field: field.into_owned(),
            });
        }
        // next_entry checked data + size <= buf.len().
        let data = usize::try_from(e.data).ok().zip(usize::try_from(e.size).ok()).map(|(d, s)| d..d + s);
        let data = data.ok_or(TarError::Truncated { offset: e.data, what: "payload larger than memory" })?;
        members.push(Member { field, data });
    }
    let key = key.ok_or(TarError::NoMembers { offset: 0 })?;
    Ok(SampleView { key, members })
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn largest_sample_is_the_first_of_the_largest() {
        let index = |b: &[u64]| TarIndex { boundaries: b.to_vec(), fields: Vec::new() };
        assert_eq!(index(&[]).largest_sample(), None);
        assert_eq!(index(&[512]).largest_sample(), None);
        assert_eq!(index(&[0, 1024, 3072, 4096, 6144]).largest_sample(), Some((1, 2048)));
    }

    /// How a test member's header is written.
    #[derive(Clone, Copy, Debug)]
    enum Style {
        /// POSIX ustar: long paths split into `prefix`, GNU long names beyond that.
        Ustar,
        /// GNU: long names as `L` records.
        Gnu,
        /// v7 (no magic), long names as `L` records.
        Old,
        /// The path in a PAX `x` header; the header's own name is a decoy.
        Pax,
    }

    const STYLES: [Style; 4] = [Style::Ustar, Style::Gnu, Style::Old, Style::Pax];

    fn header(style: Style) -> tar::Header {
        let mut h = match style {
            Style::Ustar | Style::Pax => tar::Header::new_ustar(),
            Style::Gnu => tar::Header::new_gnu(),
            Style::Old => tar::Header::new_old(),
        };
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h
    }

    fn add_file(b: &mut tar::Builder<Vec<u8>>, style: Style, path: &str, data: &[u8]) {
        let mut h = header(style);
        h.set_size(data.len() as u64);
        if let Style::Pax = style {
            b.append_pax_extensions([("path", path.as_bytes())]).unwrap();
            h.set_path("decoy.bin").unwrap();
            h.set_cksum();
            b.append(&h, data).unwrap();
        } else {
            b.append_data(&mut h, path, data).unwrap();
        }
    }

    fn add_dir(b: &mut tar::Builder<Vec<u8>>, path: &str) {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, path, &[][..]).unwrap();
    }

    fn add_symlink(b: &mut tar::Builder<Vec<u8>>, path: &str, target: &str) {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_size(0);
        b.append_link(&mut h, path, target).unwrap();
    }

    fn archive(members: &[(&str, &[u8])], style: Style) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in members {
            add_file(&mut b, style, path, data);
        }
        b.into_inner().unwrap()
    }

    /// A header block for `path` claiming `size` bytes, checksum set.
    fn raw_header(path: &str, size: u64, kind: tar::EntryType) -> Vec<u8> {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_size(size);
        h.set_mode(0o644);
        h.set_entry_type(kind);
        h.set_cksum();
        h.as_bytes().to_vec()
    }

    fn pad(bytes: &mut Vec<u8>) {
        bytes.resize(bytes.len().div_ceil(512) * 512, 0);
    }

    fn end_marker(bytes: &mut Vec<u8>) {
        pad(bytes);
        bytes.extend_from_slice(&[0; 1024]);
    }

    fn index(bytes: &[u8]) -> Result<TarIndex, TarError> {
        index_tar(Cursor::new(bytes), bytes.len() as u64)
    }

    type Parsed = Vec<(String, Vec<(String, Vec<u8>)>)>;

    /// Indexes `bytes` and parses every sample range, as the daemon does.
    fn samples_of(bytes: &[u8]) -> Result<Parsed, TarError> {
        let ix = index(bytes)?;
        (0..ix.num_samples())
            .map(|i| {
                let r = ix.sample_range(i).unwrap();
                let buf = &bytes[r.start as usize..r.end as usize];
                let v = parse_sample(buf).map_err(|e| e.with_base(r.start))?;
                let members = v.members.iter().map(|m| (m.field.to_string(), buf[m.data.clone()].to_vec())).collect();
                Ok((v.key.to_string(), members))
            })
            .collect()
    }

    fn sample(key: &str, members: &[(&str, &[u8])]) -> (String, Vec<(String, Vec<u8>)>) {
        (key.to_owned(), members.iter().map(|(f, d)| (f.to_string(), d.to_vec())).collect())
    }

    #[test]
    fn split_key_follows_webdataset() {
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("dir/sub/abc.seg.png", Some(("dir/sub/abc", "seg.png"))),
            ("abc.jpg", Some(("abc", "jpg"))),
            ("v1.2/x.y/abc.tar.gz", Some(("v1.2/x.y/abc", "tar.gz"))),
            ("./abc.jpg", Some(("./abc", "jpg"))),
            ("__init__.py", Some(("__init__", "py"))),
            ("README", None),
            ("v1.2/README", None),
            (".hidden.jpg", None),
            ("dir/.hidden", None),
            ("abc.", None),
            ("dir.d/", None),
            ("", None),
            ("__meta__", None),
            ("__meta__/abc.json", None),
            ("données/é.txt", Some(("données/é", "txt"))),
        ];
        for (path, want) in cases {
            assert_eq!(split_key(path), *want, "{path}");
        }
        assert_eq!(normalize_field(Cow::Borrowed("JPG")), "jpg");
        assert!(matches!(normalize_field(Cow::Borrowed("seg.png")), Cow::Borrowed(_)));
        assert_eq!(normalize_field(Cow::Borrowed("ÉTÉ")), "été");
    }

    #[test]
    fn groups_members_into_samples_and_skips_the_rest() {
        for style in STYLES {
            let mut b = tar::Builder::new(Vec::new());
            add_dir(&mut b, "a.d/");
            add_file(&mut b, style, "a.d/x1.jpg", b"JPG1");
            add_file(&mut b, style, "a.d/x1.cls", b"3");
            add_file(&mut b, style, "README", b"no dot: skipped");
            add_symlink(&mut b, "a.d/x1.lnk.jpg", "x1.jpg");
            add_file(&mut b, style, "a.d/x1.seg.png", b"PNG");
            add_file(&mut b, style, "v1.2/x2.JPG", b"");
            add_file(&mut b, style, "v1.2/.hidden.txt", b"hidden");
            add_file(&mut b, style, "__meta__/x3.json", b"meta");
            add_file(&mut b, style, "x3.json", b"{}");
            add_dir(&mut b, "trailing.d/");
            let bytes = b.into_inner().unwrap();
            let got = samples_of(&bytes).unwrap();
            assert_eq!(
                got,
                vec![
                    sample("a.d/x1", &[("jpg", b"JPG1"), ("cls", b"3"), ("seg.png", b"PNG")]),
                    sample("v1.2/x2", &[("jpg", b"")]),
                    sample("x3", &[("json", b"{}")]),
                ],
                "{style:?}"
            );
            let ix = index(&bytes).unwrap();
            assert_eq!(ix.fields, ["cls", "jpg", "json", "seg.png"]);
            // The leading directory is in no sample; the trailing one neither.
            assert_eq!(ix.boundaries[0], 512, "{style:?}");
            let last_end = *ix.boundaries.last().unwrap();
            assert_eq!(last_end, bytes.len() as u64 - 1024 - 512, "{style:?}");
            assert!(ix.heap_bytes() >= 4 * 8 + 4 * size_of::<String>());
        }
    }

    #[test]
    fn gnu_long_names_and_long_link_names() {
        let dir = "d".repeat(150);
        let long = format!("{dir}/deep.name.txt");
        let mut b = tar::Builder::new(Vec::new());
        add_file(&mut b, Style::Gnu, &long, b"long");
        add_symlink(&mut b, &format!("{dir}/link.txt"), &"t".repeat(200));
        add_file(&mut b, Style::Gnu, &format!("{dir}/deep.cls"), b"7");
        let bytes = b.into_inner().unwrap();
        assert_eq!(bytes[156], b'L', "the tar crate wrote a GNU long name");
        assert_eq!(
            samples_of(&bytes).unwrap(),
            vec![sample(&format!("{dir}/deep"), &[("name.txt", b"long"), ("cls", b"7")])]
        );
        // Long names are borrowed from the buffer too.
        let ix = index(&bytes).unwrap();
        let r = ix.sample_range(0).unwrap();
        let view = parse_sample(&bytes[r.start as usize..r.end as usize]).unwrap();
        assert!(matches!(view.key, Cow::Borrowed(_)));
    }

    #[test]
    fn ustar_prefix_is_joined_to_the_name() {
        let path = format!("{}/{}/abc.jpg", "p".repeat(80), "q".repeat(60));
        let bytes = archive(&[(&path, b"x")], Style::Ustar);
        assert_ne!(bytes[345], 0, "the tar crate split the path into prefix and name");
        assert_eq!(samples_of(&bytes).unwrap(), vec![sample(&path[..path.len() - 4], &[("jpg", b"x")])]);
    }

    #[test]
    fn pax_paths_and_sizes_override_the_header() {
        let mut b = tar::Builder::new(Vec::new());
        let long = format!("top/{}.txt", "p".repeat(300));
        add_file(&mut b, Style::Pax, &long, b"hello");
        add_file(&mut b, Style::Pax, "données/é.txt", b"utf8");
        // Two PAX headers: the path of the first survives a second without one.
        b.append_pax_extensions([("path", &b"two/x.a"[..])]).unwrap();
        b.append_pax_extensions([("mtime", &b"1.5"[..])]).unwrap();
        let mut h = header(Style::Ustar);
        h.set_path("decoy.bin").unwrap();
        h.set_size(1);
        h.set_cksum();
        b.append(&h, &b"1"[..]).unwrap();
        // ... and a later path wins over an earlier one.
        b.append_pax_extensions([("path", &b"two/y.a"[..])]).unwrap();
        b.append_pax_extensions([("path", &b"three/z.b"[..])]).unwrap();
        b.append(&h, &b"2"[..]).unwrap();
        // A Solaris 'X' header is a PAX header too.
        let mut x = raw_header("solaris", 18, tar::EntryType::new(b'X'));
        x.extend_from_slice(b"18 path=sol/s.txt\n");
        pad(&mut x);
        b.get_mut().extend_from_slice(&x);
        add_file(&mut b, Style::Ustar, "decoy.bin", b"sol");
        // The PAX size wins over the header's (0 here: the tar crate copies what it is given).
        b.append_pax_extensions([("size", &b"5"[..]), ("path", &b"sized.bin"[..])]).unwrap();
        let mut h0 = header(Style::Ustar);
        h0.set_path("decoy.bin").unwrap();
        h0.set_size(0);
        h0.set_cksum();
        b.append(&h0, &b"12345"[..]).unwrap();
        let bytes = b.into_inner().unwrap();
        assert_eq!(
            samples_of(&bytes).unwrap(),
            vec![
                sample(&long[..long.len() - 4], &[("txt", b"hello")]),
                sample("données/é", &[("txt", b"utf8")]),
                sample("two/x", &[("a", b"1")]),
                sample("three/z", &[("b", b"2")]),
                sample("sol/s", &[("txt", b"sol")]),
                sample("sized", &[("bin", b"12345")]),
            ]
        );
    }

    #[test]
    fn pax_sparse_members_are_skipped() {
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([("GNU.sparse.major", &b"1"[..]), ("GNU.sparse.minor", &b"0"[..])]).unwrap();
        add_file(&mut b, Style::Ustar, "sparse.bin", b"map and data");
        add_file(&mut b, Style::Ustar, "plain.bin", b"data");
        let bytes = b.into_inner().unwrap();
        assert_eq!(samples_of(&bytes).unwrap(), vec![sample("plain", &[("bin", b"data")])]);
    }

    #[test]
    fn gnu_sparse_members_are_skipped_with_their_extension_blocks() {
        let mut h = tar::Header::new_gnu();
        h.set_path("sparse.bin").unwrap();
        h.set_entry_type(tar::EntryType::GNUSparse);
        h.set_size(600);
        h.as_mut_bytes()[GNU_IS_EXTENDED] = 1;
        h.set_cksum();
        let mut bytes = h.as_bytes().to_vec();
        let mut extension = [0u8; 512];
        extension[GNU_EXTENSION_IS_EXTENDED] = 1;
        bytes.extend_from_slice(&extension);
        bytes.extend_from_slice(&[0; 512]); // the last extension block
        bytes.extend_from_slice(&[b'S'; 600]);
        pad(&mut bytes);
        let mut b = tar::Builder::new(bytes);
        add_file(&mut b, Style::Gnu, "ok.txt", b"ok");
        let bytes = b.into_inner().unwrap();
        assert_eq!(samples_of(&bytes).unwrap(), vec![sample("ok", &[("txt", b"ok")])]);
        assert_eq!(index(&bytes).unwrap().boundaries[0], 2560);
        assert!(matches!(index(&bytes[..1000]), Err(TarError::Truncated { offset: 512, .. })));
    }

    #[test]
    fn v7_headers_old_regular_type_and_signed_checksums() {
        let mut bytes = Vec::new();
        // Typeflag '\0' (old regular file), v7 header without magic.
        let mut h = tar::Header::new_old();
        h.set_path("old.txt").unwrap();
        h.set_size(3);
        h.as_mut_bytes()[156] = 0;
        h.set_cksum();
        bytes.extend_from_slice(h.as_bytes());
        bytes.extend_from_slice(b"old");
        pad(&mut bytes);
        // An old regular file whose name ends in '/' is a directory.
        let mut d = tar::Header::new_old();
        d.as_mut_bytes()[..6].copy_from_slice(b"x.dir/");
        d.as_mut_bytes()[156] = 0;
        d.set_cksum();
        bytes.extend_from_slice(d.as_bytes());
        // A checksum computed with signed bytes, as some old tars did.
        let mut s = tar::Header::new_gnu();
        s.set_path("é.jpg").unwrap();
        s.set_size(2);
        s.set_entry_type(tar::EntryType::Regular);
        let block = s.as_mut_bytes();
        block[148..156].fill(b' ');
        let signed: i64 = block.iter().map(|&b| i64::from(b as i8)).sum();
        block[148..156].copy_from_slice(format!("{signed:06o}\0 ").as_bytes());
        bytes.extend_from_slice(block);
        bytes.extend_from_slice(b"jp");
        end_marker(&mut bytes);
        assert_eq!(
            samples_of(&bytes).unwrap(),
            vec![sample("old", &[("txt", b"old")]), sample("é", &[("jpg", b"jp")])]
        );
    }

    #[test]
    fn base256_sizes() {
        let mut bytes = raw_header("b.bin", 0, tar::EntryType::Regular);
        bytes[124..136].copy_from_slice(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3]);
        let mut h = tar::Header::from_byte_slice(&bytes).clone();
        h.set_cksum();
        let mut bytes = h.as_bytes().to_vec();
        bytes.extend_from_slice(b"abc");
        end_marker(&mut bytes);
        assert_eq!(samples_of(&bytes).unwrap(), vec![sample("b", &[("bin", b"abc")])]);

        assert_eq!(parse_number(b"0000644\0", 0, "x").unwrap(), 0o644);
        assert_eq!(parse_number(b"   12 \0", 0, "x").unwrap(), 0o12);
        assert_eq!(parse_number(b"\0\0\0", 0, "x").unwrap(), 0);
        assert_eq!(parse_number(&[0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x10, 0], 0, "x").unwrap(), 0x1000);
        assert!(parse_number(b"12x4\0", 0, "x").is_err());
        assert!(parse_number(b"1 2\0", 0, "x").is_err());
        assert!(parse_number(&[0xC0, 0, 0, 0], 0, "x").is_err(), "negative");
        assert!(parse_number(&[0xBF; 12], 0, "x").is_err(), "overflow");
        assert!(parse_number(b"7777777777777777777777777", 0, "x").is_err(), "overflow");
    }

    #[test]
    fn sizes_beyond_the_shard_are_errors_not_allocations() {
        // 10 GiB in base-256 (written so by the tar crate) and in a PAX record.
        let mut bytes = raw_header("big.bin", 10 << 30, tar::EntryType::Regular);
        assert_eq!(bytes[124] & 0x80, 0x80);
        end_marker(&mut bytes);
        let err = index(&bytes).unwrap_err();
        assert_eq!(err.to_string(), "member 'big.bin' at offset 0 claims 10737418240 bytes but the shard ends at 1536");

        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([("size", &b"18446744073709551615"[..])]).unwrap();
        add_file(&mut b, Style::Ustar, "huge.bin", b"");
        let bytes = b.into_inner().unwrap();
        assert!(matches!(index(&bytes), Err(TarError::PastEnd { offset: 1024, size: u64::MAX, .. })));

        // A GNU long name record claiming 8 GiB is refused before anything is read.
        let mut bytes = raw_header("././@LongLink", 8 << 30, tar::EntryType::GNULongName);
        end_marker(&mut bytes);
        let err = index(&bytes).unwrap_err();
        assert!(matches!(err, TarError::TooLong { offset: 0, limit: MAX_NAME_BYTES, .. }), "{err}");
        let mut bytes = raw_header("pax", MAX_PAX_BYTES + 1, tar::EntryType::XHeader);
        end_marker(&mut bytes);
        assert!(matches!(index(&bytes), Err(TarError::TooLong { .. })));
        // Within the cap but past the end of the shard.
        let mut bytes = raw_header("././@LongLink", 4000, tar::EntryType::GNULongName);
        end_marker(&mut bytes);
        let err = index(&bytes).unwrap_err();
        assert!(matches!(err, TarError::PastEnd { offset: 0, size: 4000, .. }), "{err}");
        assert!(err.to_string().contains("LongLink'"), "{err}");
    }

    #[test]
    fn member_larger_than_the_shard() {
        let mut bytes = raw_header("x/abc.jpg", 5_000_000, tar::EntryType::Regular);
        bytes.extend_from_slice(&[7; 1000]);
        end_marker(&mut bytes);
        let err = index(&bytes).unwrap_err();
        assert_eq!(err.to_string(), "member 'x/abc.jpg' at offset 0 claims 5000000 bytes but the shard ends at 2560");
        // The same member seen by parse_sample, at shard offset 10240.
        let err = parse_sample(&bytes).unwrap_err().with_base(10240);
        assert_eq!(
            err.to_string(),
            "member 'x/abc.jpg' at offset 10240 claims 5000000 bytes but the sample's byte range ends at 12800"
        );
    }

    #[test]
    fn empty_archives() {
        let empty = archive(&[], Style::Gnu);
        for bytes in [&empty[..], &[], &[0; 512], &[0; 700]] {
            let ix = index(bytes).unwrap();
            assert_eq!((ix.num_samples(), ix.boundaries.len(), ix.sample_range(0)), (0, 0, None));
        }
        let mut b = tar::Builder::new(Vec::new());
        add_dir(&mut b, "only/");
        add_file(&mut b, Style::Ustar, "only/README", b"x");
        let bytes = b.into_inner().unwrap();
        assert_eq!(index(&bytes).unwrap(), TarIndex::default());
        assert_eq!(TarIndex { boundaries: vec![512], fields: vec![] }.num_samples(), 0);
        let ix = TarIndex { boundaries: vec![0, 1024, 512], fields: vec![] };
        assert!(!ix.fits_shard(4096) && TarIndex::default().fits_shard(0));
        assert!(index(&bytes).unwrap().fits_shard(bytes.len() as u64));
    }

    #[test]
    fn lenient_ends() {
        let bytes = archive(&[("k1.jpg", &[7; 3000]), ("k2.jpg", &[8; 3000])], Style::Ustar);
        let all = samples_of(&bytes).unwrap();
        assert_eq!(all.len(), 2);
        // No end-of-archive marker: EOF at a block boundary.
        assert_eq!(samples_of(&bytes[..7168]).unwrap(), all);
        // One zero block followed by EOF.
        assert_eq!(samples_of(&bytes[..7680]).unwrap(), all);
        // Cut at a header boundary: the members before it.
        assert_eq!(samples_of(&bytes[..3584]).unwrap(), all[..1]);
    }

    #[test]
    fn truncated_archives() {
        // k1: header 0, data 512..3512; k2: header 3584, data 4096..7096.
        let bytes = archive(&[("k1.jpg", &[7; 3000]), ("k2.jpg", &[8; 3000])], Style::Ustar);
        let err = index(&bytes[..4196]).unwrap_err();
        assert_eq!(err.to_string(), "member 'k2.jpg' at offset 3584 claims 3000 bytes but the shard ends at 4196");
        // Data complete, padding missing: cut all the same.
        let err = index(&bytes[..7096]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "truncated archive at offset 7096: the data ends inside the padding after a payload"
        );
        let r = index(&bytes).unwrap().sample_range(1).unwrap();
        assert!(matches!(parse_sample(&bytes[r.start as usize..7096]), Err(TarError::Truncated { offset: 3512, .. })));
        let err = index(&bytes[..3684]).unwrap_err();
        assert!(matches!(err, TarError::Truncated { offset: 3584, .. }), "{err}");
        assert_eq!(err.to_string(), "truncated archive at offset 3584: the data ends inside a header");
        // The listing says more bytes than the reader has.
        let err = index_tar(Cursor::new(&bytes[..4000]), bytes.len() as u64).unwrap_err();
        assert!(matches!(err, TarError::Truncated { offset: 3584, .. }), "{err}");
        // Extension headers with no member after them.
        let mut b = tar::Builder::new(Vec::new());
        add_file(&mut b, Style::Ustar, "a.txt", b"a");
        b.append_pax_extensions([("path", &b"b.txt"[..])]).unwrap();
        let bytes = b.into_inner().unwrap();
        assert!(matches!(index(&bytes), Err(TarError::Truncated { offset: 1024, .. })));
        assert!(matches!(index(&bytes[..2048]), Err(TarError::Truncated { offset: 1024, .. })));
    }

    #[test]
    fn corrupt_headers() {
        let bytes = archive(&[("k1.jpg", &[7; 3000]), ("k2.jpg", &[8; 3000])], Style::Gnu);
        let mut bad = bytes.clone();
        bad[3584 + 10] ^= 0x55;
        let err = index(&bad).unwrap_err();
        assert!(matches!(err, TarError::BadChecksum { offset: 3584 }), "{err}");
        assert_eq!(err.to_string(), "bad header checksum at offset 3584: the archive is corrupt");
        assert_eq!(err.with_base(100).offset(), Some(3684));
        // In the first header: not a TAR at all.
        let mut bad = bytes.clone();
        bad[0] ^= 0x55;
        assert!(matches!(index(&bad), Err(TarError::NotTar { offset: 0 })));
        // ... but inside a sample it is a bad checksum.
        assert!(matches!(parse_sample(&bad), Err(TarError::BadChecksum { offset: 0 })));
        // A size field that is not a number.
        let mut h = tar::Header::from_byte_slice(&bytes[3584..4096]).clone();
        h.as_mut_bytes()[124..136].copy_from_slice(b"0000000x000\0");
        h.set_cksum();
        let mut bad = bytes.clone();
        bad[3584..4096].copy_from_slice(h.as_bytes());
        let err = index(&bad).unwrap_err();
        assert_eq!(err.to_string(), "malformed size field in the header at offset 3584");
    }

    #[test]
    fn malformed_pax_records() {
        for (record, reason) in [
            (&b"zz path=a\n"[..], "record length is not a decimal number"),
            (b"path=a\n", "record without a length"),
            (b"99 path=a\n", "record runs past the end of the header"),
            (b"8 path=a\n", "record does not end with a newline where its length says"),
            (b"7 =abc\n", "record without a key"),
            (b"11 size=-1\n", "size is not a decimal number"),
        ] {
            let mut bytes = raw_header("pax", record.len() as u64, tar::EntryType::XHeader);
            bytes.extend_from_slice(record);
            pad(&mut bytes);
            bytes.extend(raw_header("a.txt", 0, tar::EntryType::Regular));
            end_marker(&mut bytes);
            let err = index(&bytes).unwrap_err();
            assert!(matches!(err, TarError::BadPax { offset: 512, reason: r } if r == reason), "{err}");
        }
    }

    #[test]
    fn garbage_is_not_a_tar() {
        let garbage = b"definitely not a tar file".repeat(50);
        for bytes in [&garbage[..], &garbage[..10]] {
            let err = index(bytes).unwrap_err();
            assert!(matches!(err, TarError::NotTar { offset: 0 }), "{err}");
            assert!(err.to_string().starts_with("not a TAR file"), "{err}");
        }
    }

    #[test]
    fn duplicate_fields_are_errors() {
        let bytes = archive(&[("a.jpg", b"1"), ("a.JPG", b"2")], Style::Ustar);
        let err = index(&bytes).unwrap_err();
        assert_eq!(err.to_string(), "sample 'a' has a second 'jpg' member at offset 1024");
        assert!(matches!(parse_sample(&bytes), Err(TarError::DuplicateField { offset: 1024, .. })));
        // The same field in the next sample is fine.
        let bytes = archive(&[("a.jpg", b"1"), ("b.jpg", b"2"), ("a.jpg", b"3")], Style::Ustar);
        assert_eq!(index(&bytes).unwrap().num_samples(), 3);
    }

    #[test]
    fn parse_sample_checks_its_range() {
        let bytes = archive(&[("a.jpg", b"1"), ("b.jpg", b"2")], Style::Ustar);
        let err = parse_sample(&bytes).unwrap_err();
        assert_eq!(
            err.to_string(),
            "member 'b.jpg' at offset 1024 does not belong to sample 'a' whose byte range it is in"
        );
        assert_eq!(err.with_base(4096).offset(), Some(5120));
        assert!(matches!(parse_sample(&[]), Err(TarError::NoMembers { offset: 0 })));
        let mut b = tar::Builder::new(Vec::new());
        add_dir(&mut b, "d/");
        let bytes = b.into_inner().unwrap();
        assert!(matches!(parse_sample(&bytes[..512]), Err(TarError::NoMembers { .. })));
        // A range that starts mid-payload.
        let bytes = archive(&[("a.jpg", &[1; 1000])], Style::Ustar);
        assert!(matches!(parse_sample(&bytes[512..]), Err(TarError::BadChecksum { offset: 0 })));
        assert!(parse_sample(&bytes[..700]).is_err());
    }

    #[test]
    fn parse_sample_borrows_names_and_payloads() {
        let bytes = archive(&[("dir/k.jpg", b"JPEG"), ("dir/k.seg.png", b"PNG!")], Style::Ustar);
        let ix = index(&bytes).unwrap();
        let r = ix.sample_range(0).unwrap();
        let buf = &bytes[r.start as usize..r.end as usize];
        let view = parse_sample(buf).unwrap();
        assert!(matches!(view.key, Cow::Borrowed("dir/k")));
        assert!(view.members.iter().all(|m| matches!(m.field, Cow::Borrowed(_))));
        assert_eq!(view.members[0].data, 512..516);
        assert_eq!(&buf[view.members[1].data.clone()], b"PNG!");
    }

    /// Counts bytes read, to show that indexing skips payloads.
    struct Counting<R> {
        inner: R,
        read: u64,
    }

    impl<R: Read> Read for Counting<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buf)?;
            self.read += n as u64;
            Ok(n)
        }
    }

    impl<R: Seek> Seek for Counting<R> {
        fn seek(&mut self, pos: SeekFrom) -> std::io::Result<u64> {
            self.inner.seek(pos)
        }
    }

    #[test]
    fn indexing_reads_only_headers() {
        let big = vec![1u8; 1 << 20];
        let mut b = tar::Builder::new(Vec::new());
        for i in 0..8 {
            add_file(&mut b, Style::Gnu, &format!("s{i}.bin"), &big);
            add_file(&mut b, Style::Pax, &format!("s{i}.txt"), &big[..5000]);
        }
        add_file(&mut b, Style::Gnu, &format!("{}/s8.bin", "x".repeat(200)), &big);
        let bytes = b.into_inner().unwrap();
        let mut r = Counting { inner: Cursor::new(&bytes), read: 0 };
        let ix = index_tar(&mut r, bytes.len() as u64).unwrap();
        assert_eq!(ix.num_samples(), 9);
        // 17 member headers, 8 PAX headers and their records, 1 long name header and record, the
        // end marker: 26 members' worth of at most 2 blocks each.
        assert!(r.read <= 26 * 2 * 512, "read {} bytes of a {} byte shard", r.read, bytes.len());
        // A BufReader gives the same index.
        let buffered = index_tar(std::io::BufReader::new(Cursor::new(&bytes)), bytes.len() as u64).unwrap();
        assert_eq!(buffered, ix);
    }

    /// A member of a generated archive: a sample member, or something to skip.
    #[derive(Clone, Debug)]
    enum Gen {
        File { path: String, data: Vec<u8>, style: Style },
        Dir,
        NoDot,
        Link,
    }

    fn build(members: &[Gen]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for m in members {
            match m {
                Gen::File { path, data, style } => add_file(&mut b, *style, path, data),
                Gen::Dir => add_dir(&mut b, "some.dir/"),
                Gen::NoDot => add_file(&mut b, Style::Gnu, "dir.d/NODOT", b"skipped"),
                Gen::Link => add_symlink(&mut b, "l.jpg", "target.jpg"),
            }
        }
        b.into_inner().unwrap()
    }

    type GenSample = (String, String, Vec<(String, usize, Style)>, Vec<Gen>);

    fn samples_strategy() -> impl Strategy<Value = Vec<GenSample>> {
        let field = prop::sample::select(vec!["jpg", "JPG", "cls", "seg.png", "json", "tar.gz", "x"]);
        let skipped = prop::sample::select(vec![Gen::Dir, Gen::NoDot, Gen::Link]);
        let style = prop::sample::select(STYLES.to_vec());
        prop::collection::vec(
            (
                // Directories with dots; some long enough to need a prefix or a long name.
                prop_oneof!["", "[a-z][a-z.]{0,6}/", "[a-z]{90,130}/[a-z][a-z.]{0,19}/"],
                "[a-z0-9_-]{1,12}",
                prop::collection::vec(
                    (field.prop_map(str::to_owned), prop_oneof![0usize..3, 0usize..1500], style),
                    1..5,
                ),
                prop::collection::vec(skipped, 0..2),
            ),
            0..12,
        )
    }

    /// The members of generated samples, and what reading them must give.
    fn generate(samples: Vec<GenSample>) -> (Vec<Gen>, Parsed, BTreeSet<String>) {
        let mut members = Vec::new();
        let mut expected: Parsed = Vec::new();
        let mut fields = BTreeSet::new();
        for (i, (dir, stem, sample_fields, skipped)) in samples.into_iter().enumerate() {
            let key = format!("{dir}{stem}_{i}"); // consecutive samples never share a key
            let mut exp: Vec<(String, Vec<u8>)> = Vec::new();
            for (field, len, style) in sample_fields {
                let lower = field.to_lowercase();
                if exp.iter().any(|(f, _)| *f == lower) {
                    continue;
                }
                let data: Vec<u8> = (0..len).map(|j| (j * 7 + i) as u8).collect();
                exp.push((lower.clone(), data.clone()));
                fields.insert(lower);
                members.push(Gen::File { path: format!("{key}.{field}"), data, style });
            }
            members.extend(skipped);
            expected.push((key, exp));
        }
        (members, expected, fields)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn random_archives_round_trip(samples in samples_strategy()) {
            let (members, expected, fields) = generate(samples);
            let bytes = build(&members);
            let ix = index(&bytes).unwrap();
            prop_assert_eq!(ix.fields.iter().cloned().collect::<BTreeSet<_>>(), fields);
            prop_assert_eq!(ix.boundaries.windows(2).filter(|w| w[0] < w[1]).count(), ix.num_samples());
            prop_assert_eq!(samples_of(&bytes).unwrap(), expected);
        }

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..3000), claimed in 0u64..10_000) {
            let _ = index_tar(Cursor::new(&bytes), bytes.len() as u64);
            let _ = index_tar(Cursor::new(&bytes), claimed);
            let _ = parse_sample(&bytes);
        }

        #[test]
        fn damaged_archives_never_panic(
            samples in samples_strategy(),
            cut in any::<prop::sample::Index>(),
            flips in prop::collection::vec((any::<prop::sample::Index>(), 1u8..=255), 0..8),
            extra_len in 0u64..5000,
        ) {
            let (members, _, _) = generate(samples);
            let mut bytes = build(&members);
            for (at, x) in flips {
                let at = at.index(bytes.len());
                bytes[at] ^= x;
            }
            bytes.truncate(cut.index(bytes.len() + 1));
            for claimed in [bytes.len() as u64, bytes.len() as u64 + extra_len] {
                if let Ok(ix) = index_tar(Cursor::new(&bytes), claimed) {
                    for i in 0..ix.num_samples() {
                        let r = ix.sample_range(i).unwrap();
                        prop_assert!(r.start <= r.end && r.end <= claimed);
                        if let Some(buf) = bytes.get(r.start as usize..r.end as usize)
                            && let Ok(view) = parse_sample(buf)
                        {
                            for m in &view.members {
                                prop_assert!(m.data.end <= buf.len());
                            }
                        }
                    }
                }
            }
            let _ = parse_sample(&bytes);
        }
    }
}
