//! Walking members: [`next_entry`] reads one member with its extension headers applied (GNU long
//! names, PAX, sparse maps) from a [`Source`], which is either a seekable reader (indexing a shard)
//! or an in-memory sample (parsing what was read). Every range is checked against the end of the
//! data before it is read.

use std::borrow::Cow;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::ops::Range;

use super::header::*;
use super::{BLOCK, MAX_NAME_BYTES, MAX_PAX_BYTES, TarError};

/// Which loaded bytes a name lives in.
#[derive(Clone, Copy)]
pub(super) enum Slot {
    /// The member's own header block.
    Header,
    /// The last GNU long name record.
    LongName,
    /// The PAX header that set the path.
    Pax,
}

/// Where a member's name lies, as absolute offsets of bytes the source has loaded.
#[derive(Debug, Clone)]
pub(super) enum NameLoc {
    Header { prefix: Option<Range<u64>>, name: Range<u64> },
    Long(Range<u64>),
    Pax(Range<u64>),
}

/// Builds a member name from where [`NameLoc`] says it lies; `get` returns loaded bytes.
pub(super) fn resolve_name<'n>(loc: &NameLoc, get: impl Fn(Slot, &Range<u64>) -> &'n [u8]) -> Cow<'n, str> {
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

/// The member name at `loc` escaped for an error (`caf\xe9.jpg`), when it is not UTF-8 as stored;
/// None when it is. Only names [`resolve_name`] had to allocate for can fail.
pub(super) fn non_utf8_name<'n>(loc: &NameLoc, get: impl Fn(Slot, &Range<u64>) -> &'n [u8]) -> Option<String> {
    let parts = match loc {
        NameLoc::Header { prefix, name } => {
            [prefix.as_ref().map(|p| get(Slot::Header, p)), Some(get(Slot::Header, name))]
        }
        NameLoc::Long(r) => [None, Some(get(Slot::LongName, r))],
        NameLoc::Pax(r) => [None, Some(get(Slot::Pax, r))],
    };
    if parts.iter().flatten().all(|p| std::str::from_utf8(p).is_ok()) {
        return None;
    }
    Some(parts.iter().flatten().map(|p| p.escape_ascii().to_string()).collect::<Vec<_>>().join("/"))
}

/// One member, its extension headers applied.
pub(super) struct Entry {
    /// Offset of the first block belonging to the member (extension headers included).
    pub(super) start: u64,
    /// Offset of the member's own header block.
    pub(super) header: u64,
    /// Offset and length of its payload (0 for types without data).
    pub(super) data: u64,
    pub(super) size: u64,
    /// Where the next header starts (saturating; may lie past the end of the data, which the next
    /// call reports as truncation).
    pub(super) next: u64,
    pub(super) regular: bool,
    /// The name of a member stored sparse (old GNU `S`, or a PAX `GNU.sparse.*` record), which is
    /// never `regular`: resolved before its sparse map's blocks were read.
    pub(super) sparse: Option<String>,
    pub(super) name: NameLoc,
}

/// Where header parsing reads from: a seekable reader ([`index_tar`]) or a buffer
/// ([`parse_sample`]). Callers check that every range they ask for lies within [`Source::len`].
pub(super) trait Source {
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
pub(super) fn next_entry(src: &mut impl Source, start: u64, shard_start: bool) -> Result<Option<Entry>, TarError> {
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
            return if shard_start && len == 0 {
                // An empty archive is at least its end blocks: a 0-byte shard is a copy that never
                // got its bytes (tarfile and webdataset refuse it too), not a shard of no samples.
                Err(TarError::Truncated {
                    offset: 0,
                    what: "the file is empty (0 bytes), not a TAR archive: an interrupted copy?",
                })
            } else if offset == start {
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
                TarError::NotTar { offset, compressed: None }
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
            TarError::BadChecksum { offset: 0 } if shard_start => {
                TarError::NotTar { offset: 0, compressed: compressed_kind(block) }
            }
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
                let name = match (pax_path, long_name) {
                    (Some(p), _) => NameLoc::Pax(p),
                    (None, Some(l)) => NameLoc::Long(l),
                    (None, None) => NameLoc::Header { prefix: header.prefix, name: header.name },
                };
                // Named now: reading a sparse map's extension blocks replaces the header in a
                // reader's buffer.
                let sparse = (sparse || typeflag == b'S')
                    .then(|| resolve_name(&name, |slot, r| src.loaded(slot, r)).into_owned());
                let mut data = data;
                if header.sparse_extended {
                    // The payload starts after the sparse map's extension blocks. Reading them
                    // replaces the header in a reader's buffer, so an error about this member
                    // may lack its name.
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
                    regular: matches!(typeflag, b'0' | 0 | b'7') && sparse.is_none(),
                    sparse,
                    name,
                }));
            }
        }
    }
}

/// True when `size` bytes from `data` end within `len`.
pub(super) fn fits(data: u64, size: u64, len: u64) -> bool {
    data.checked_add(size).is_some_and(|end| end <= len)
}

/// The error for a member (or extension header) at `offset` whose `size` bytes do not fit.
pub(super) fn past_end(src: &impl Source, offset: u64, name: &NameLoc, size: u64) -> TarError {
    TarError::PastEnd {
        offset,
        name: resolve_name(name, |slot, r| src.loaded(slot, r)).into_owned(),
        size,
        end: src.len(),
        scope: src.scope(),
    }
}

/// `buf[range - at]`, empty when the range is not inside `buf`.
pub(super) fn sub_slice<'b>(buf: &'b [u8], at: u64, range: &Range<u64>) -> &'b [u8] {
    let local = |x: u64| x.checked_sub(at).and_then(|x| usize::try_from(x).ok());
    local(range.start).zip(local(range.end)).and_then(|(s, e)| buf.get(s..e)).unwrap_or_default()
}

/// Reads headers from a seekable reader into buffers reused across members.
pub(super) struct ReaderSource<R> {
    pub(super) reader: R,
    pub(super) len: u64,
    /// The reader's position, when known.
    pub(super) pos: Option<u64>,
    pub(super) block: Block,
    pub(super) block_at: u64,
    pub(super) long: Vec<u8>,
    pub(super) long_at: u64,
    /// The PAX header being read, and the last one that set a path.
    pub(super) pax: Vec<u8>,
    pub(super) pax_at: u64,
    pub(super) pax_kept: Vec<u8>,
    pub(super) pax_kept_at: u64,
}

impl<R: Read + Seek> ReaderSource<R> {
    pub(super) fn new(reader: R, len: u64) -> Self {
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
pub(super) fn read_at<R: Read + Seek>(
    reader: &mut R,
    pos: &mut Option<u64>,
    offset: u64,
    buf: &mut [u8],
) -> Result<(), TarError> {
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

/// The header block `bytes` read at `offset`, which must be exactly one block long.
fn as_block(bytes: &[u8], offset: u64) -> Result<&Block, TarError> {
    bytes.try_into().map_err(|_| TarError::Truncated { offset, what: "the data ends inside a header" })
}

/// Reads headers from bytes in memory (one sample, or a whole mapped shard): everything
/// borrowed from the buffer.
pub(super) struct SliceSource<'a> {
    pub(super) buf: &'a [u8],
    /// How error messages call the end of `buf`.
    pub(super) scope: &'static str,
}

impl<'a> SliceSource<'a> {
    /// Like [`Source::loaded`], with the buffer's lifetime.
    pub(super) fn bytes(&self, range: &Range<u64>) -> &'a [u8] {
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
        self.scope
    }

    fn block(&mut self, offset: u64) -> Result<&Block, TarError> {
        as_block(self.get(offset, BLOCK)?, offset)
    }

    fn load(&mut self, _slot: Slot, offset: u64, len: u64) -> Result<&[u8], TarError> {
        self.get(offset, len)
    }

    fn keep_pax(&mut self) {}

    fn loaded(&self, _slot: Slot, range: &Range<u64>) -> &[u8] {
        self.bytes(range)
    }
}

/// Reads headers from a sample held in pieces at their absolute shard offsets (see
/// [`super::ScanAsWritten`]). A range must lie within one piece; bytes between pieces are
/// payloads the writer streams, never read here.
pub(super) struct PartsSource<'a, 'p> {
    pub(super) parts: &'p [(u64, &'a [u8])],
    /// Absolute offset of the sample's end.
    pub(super) end: u64,
}

impl PartsSource<'_, '_> {
    fn get(&self, offset: u64, len: u64) -> Result<&[u8], TarError> {
        let range = offset..offset.saturating_add(len);
        self.parts
            .iter()
            .map(|(at, buf)| sub_slice(buf, *at, &range))
            .find(|b| b.len() as u64 == len)
            .ok_or(TarError::Truncated { offset, what: "a header lies outside the bytes the writer holds" })
    }
}

impl Source for PartsSource<'_, '_> {
    fn len(&self) -> u64 {
        self.end
    }

    fn scope(&self) -> &'static str {
        "sample"
    }

    fn block(&mut self, offset: u64) -> Result<&Block, TarError> {
        as_block(self.get(offset, BLOCK)?, offset)
    }

    fn load(&mut self, _slot: Slot, offset: u64, len: u64) -> Result<&[u8], TarError> {
        self.get(offset, len)
    }

    fn keep_pax(&mut self) {}

    fn loaded(&self, _slot: Slot, range: &Range<u64>) -> &[u8] {
        let len = range.end.saturating_sub(range.start);
        self.get(range.start, len).unwrap_or_default()
    }
}

/// What a file's first bytes say it is when they are a compressor's magic number: a TAR
/// compressed whole (webdataset reads `.tar.gz`; the daemon reads members in place).
fn compressed_kind(head: &[u8]) -> Option<&'static str> {
    const MAGIC: [(&[u8], &str); 5] = [
        (&[0x1f, 0x8b], "gzip"),
        (&[0x28, 0xb5, 0x2f, 0xfd], "zstd"),
        (b"BZh", "bzip2"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0], "xz"),
        (&[0x04, 0x22, 0x4d, 0x18], "lz4"),
    ];
    MAGIC.iter().find(|(magic, _)| head.starts_with(magic)).map(|(_, kind)| *kind)
}
