//! One TAR header block and the extension records that modify the next member: checksums,
//! octal and base-256 numbers, ustar `prefix`, PAX records. Pure functions over bytes; nothing here
//! reads or trusts a size beyond what it is handed.

use std::ops::Range;

use super::{BLOCK, TarError};

pub(super) const BLOCK_BYTES: usize = BLOCK as usize;
pub(super) type Block = [u8; BLOCK_BYTES];

// Header fields (POSIX.1-1988 ustar; old GNU and v7 share name, size, checksum and typeflag).
pub(super) const NAME: Range<usize> = 0..100;
pub(super) const SIZE: Range<usize> = 124..136;
pub(super) const CHECKSUM: Range<usize> = 148..156;
pub(super) const TYPEFLAG: usize = 156;
pub(super) const MAGIC: Range<usize> = 257..263;
pub(super) const PREFIX: Range<usize> = 345..500;
/// Old GNU sparse headers: "the sparse map continues in an extension block", in the header and
/// in each extension block.
pub(super) const GNU_IS_EXTENDED: usize = 482;
pub(super) const GNU_EXTENSION_IS_EXTENDED: usize = 504;
/// POSIX magic (old GNU headers say `"ustar  \0"` and keep other data where `prefix` would be).
pub(super) const USTAR_MAGIC: &[u8; 6] = b"ustar\0";

/// Parses a numeric header field: octal text (NUL- or space-terminated, blanks around it allowed,
/// empty meaning 0, as Python's `tarfile` reads it) or GNU base-256 (top bit of the first byte set;
/// negative values are rejected).
pub(super) fn parse_number(field: &[u8], offset: u64, name: &'static str) -> Result<u64, TarError> {
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
pub(super) fn checksum_ok(block: &Block) -> bool {
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

pub(super) fn is_zero(block: &Block) -> bool {
    block.iter().all(|&b| b == 0)
}

/// Absolute range of a NUL-terminated field of the header block at `offset`.
pub(super) fn field_range(block: &Block, field: Range<usize>, offset: u64) -> Range<u64> {
    let bytes = block.get(field.clone()).unwrap_or_default();
    let len = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    offset + field.start as u64..offset + (field.start + len) as u64
}

/// Offset of whatever follows a payload of `size` bytes starting at `data` (saturating: a
/// payload that large has already been rejected or ends the archive).
pub(super) fn after_payload(data: u64, size: u64) -> u64 {
    data.saturating_add(size.div_ceil(BLOCK).saturating_mul(BLOCK))
}

/// One header block, checksum verified.
pub(super) struct Header {
    pub(super) typeflag: u8,
    pub(super) size: u64,
    pub(super) name: Range<u64>,
    /// The ustar `prefix`, when the header is POSIX ustar and the prefix is not empty.
    pub(super) prefix: Option<Range<u64>>,
    /// An old GNU sparse member (`S`) whose sparse map continues in extension blocks.
    pub(super) sparse_extended: bool,
}

pub(super) fn parse_header(block: &Block, offset: u64) -> Result<Header, TarError> {
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
pub(super) struct Pax {
    /// `Some(None)`: the record is present with an empty value, which unsets the keyword.
    pub(super) path: Option<Option<Range<u64>>>,
    pub(super) size: Option<Option<u64>>,
    pub(super) sparse: bool,
}

pub(super) fn parse_decimal(digits: &[u8]) -> Option<u64> {
    if digits.is_empty() {
        return None;
    }
    digits
        .iter()
        .try_fold(0u64, |v, &b| v.checked_mul(10)?.checked_add(u64::from(b.checked_sub(b'0').filter(|d| *d < 10)?)))
}

/// Parses PAX records `"<len> <key>=<value>\n"` (`len` counts the whole record) of a header
/// whose bytes start at shard offset `base`. Stops at a NUL, as Python's `tarfile` does.
pub(super) fn parse_pax(bytes: &[u8], base: u64) -> Result<Pax, TarError> {
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
