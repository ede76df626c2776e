//! Writing TAR member headers, deterministically: the same name and size always give the same
//! bytes, whoever runs the pack, wherever, whenever. This module owns only the encoding of one
//! member's header blocks and the archive trailer; which members go into which shard is
//! `writer`'s business, and reading TARs back is `crate::format::tar`'s.
//!
//! A member is written as POSIX ustar, extended only when it must be:
//!
//! ```text
//!  offset  size  field       value written
//!  ┌─────┬─────┬───────────┬──────────────────────────────────────────────────────────────┐
//!  │   0 │ 100 │ name      │ member name (or its last part, see prefix), NUL-padded       │
//!  │ 100 │   8 │ mode      │ "0000644\0"                                                  │
//!  │ 108 │   8 │ uid       │ "0000000\0"                                                  │
//!  │ 116 │   8 │ gid       │ "0000000\0"                                                  │
//!  │ 124 │  12 │ size      │ 11 octal digits + NUL; base-256 from 8 GiB on (+ PAX size)  │
//!  │ 136 │  12 │ mtime     │ FIXED_MTIME, 11 octal digits + NUL                           │
//!  │ 148 │   8 │ chksum    │ 6 octal digits, NUL, space                                   │
//!  │ 156 │   1 │ typeflag  │ '0' (regular file); 'x' for a PAX extended header            │
//!  │ 157 │ 100 │ linkname  │ empty                                                        │
//!  │ 257 │   6 │ magic     │ "ustar\0"                                                    │
//!  │ 263 │   2 │ version   │ "00"                                                         │
//!  │ 265 │  32 │ uname     │ empty (numeric owner 0)                                      │
//!  │ 297 │  32 │ gname     │ empty                                                        │
//!  │ 329 │   8 │ devmajor  │ "0000000\0"                                                  │
//!  │ 337 │   8 │ devminor  │ "0000000\0"                                                  │
//!  │ 345 │ 155 │ prefix    │ leading directories when the name needs it, else empty       │
//!  │ 500 │  12 │ (padding) │ zeros                                                        │
//!  └─────┴─────┴───────────┴──────────────────────────────────────────────────────────────┘
//! ```
//!
//! followed by the payload, zero-padded to a multiple of 512 bytes. Names that are ASCII and fit
//! the `name` field, or split at a `/` into `prefix` (<= 155 bytes) and `name` (<= 100 bytes), use
//! plain ustar. Any other name (longer, or not ASCII) gets a PAX extended header (`x`, POSIX.1-2001)
//! before the member, carrying `path` in UTF-8, and the ustar `name` field holds an ASCII
//! fallback. PAX rather than GNU `L` records: PAX is the standard, GNU tar, bsdtar, Python's
//! `tarfile` (so `webdataset`) and `crate::format::tar` all read it, and it states the encoding.
//! Payloads of 8 GiB and more get a PAX `size` record, and base-256 in the `size` field for GNU
//! readers that ignore PAX.

/// TAR block size.
pub const BLOCK: usize = 512;
/// Two zero blocks end an archive. (GNU tar and Python pad the last record to 10 KiB; readers do
/// not need it, and it would only add bytes to every shard.)
pub const TRAILER: [u8; 2 * BLOCK] = [0; 2 * BLOCK];
/// Modification time of every member: a fixed time so that output bytes do not depend on when or
/// from which copy of the files a pack ran. 2000-01-01T00:00:00Z rather than 0, which some tools
/// treat as "no time" or warn about when extracting.
pub const FIXED_MTIME: u64 = 946_684_800;
/// Permission bits of every member: readable by all, as extracted files should be.
pub const FIXED_MODE: u64 = 0o644;
/// Largest size the 11 octal digits of the ustar `size` field hold (8 GiB - 1).
const MAX_OCTAL_SIZE: u64 = (1 << 33) - 1;
/// Name under which PAX extended headers appear to readers that do not know them (Python's
/// choice; deterministic, unlike GNU's `%d/PaxHeaders.%p/%f`).
const PAX_HEADER_NAME: &str = "././@PaxHeader";

/// Bytes of payload padding after `size` bytes of data.
pub fn padding(size: u64) -> usize {
    ((BLOCK as u64 - size % BLOCK as u64) % BLOCK as u64) as usize
}

/// How a member's name is stored.
enum NameLayout {
    /// Fits `name` (prefix empty).
    Plain,
    /// `prefix` = `name[..split]`, `name` = `name[split + 1..]`.
    Split(usize),
    /// Needs a PAX `path` record.
    Pax,
}

fn name_layout(name: &str) -> NameLayout {
    let bytes = name.as_bytes();
    if !name.is_ascii() || bytes.contains(&0) {
        return NameLayout::Pax;
    }
    if bytes.len() <= 100 {
        return NameLayout::Plain;
    }
    // The leftmost '/' that leaves at most 100 bytes for the name and 155 for the prefix.
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'/' && bytes.len() - i - 1 <= 100 {
            return if i <= 155 && i > 0 && i + 1 < bytes.len() { NameLayout::Split(i) } else { NameLayout::Pax };
        }
    }
    NameLayout::Pax
}

/// PAX records `"<len> <key>=<value>\n"`, where `<len>` counts the whole record including its
/// own digits.
fn pax_records(name: Option<&str>, size: Option<u64>) -> Vec<u8> {
    fn record(out: &mut Vec<u8>, key: &str, value: &[u8]) {
        let rest = 1 + key.len() + 1 + value.len() + 1; // ' ' key '=' value '\n'
        let mut len = rest + 1;
        while len != rest + len.to_string().len() {
            len = rest + len.to_string().len();
        }
        out.extend_from_slice(len.to_string().as_bytes());
        out.push(b' ');
        out.extend_from_slice(key.as_bytes());
        out.push(b'=');
        out.extend_from_slice(value);
        out.push(b'\n');
    }
    let mut out = Vec::new();
    if let Some(n) = name {
        record(&mut out, "path", n.as_bytes());
    }
    if let Some(s) = size {
        record(&mut out, "size", s.to_string().as_bytes());
    }
    out
}

/// Number of header bytes (PAX header and records included) written before a member's payload.
pub fn header_len(name: &str, size: u64) -> usize {
    let pax_name = matches!(name_layout(name), NameLayout::Pax);
    let pax_size = size > MAX_OCTAL_SIZE;
    if !pax_name && !pax_size {
        return BLOCK;
    }
    let records = pax_records(pax_name.then_some(name), pax_size.then_some(size)).len();
    BLOCK + records + padding(records as u64) + BLOCK
}

fn octal(field: &mut [u8], value: u64) {
    // `field.len() - 1` digits and a NUL; callers keep values in range.
    let digits = field.len() - 1;
    let s = format!("{value:0digits$o}");
    field[..digits].copy_from_slice(&s.as_bytes()[s.len() - digits..]);
    field[digits] = 0;
}

fn size_field(field: &mut [u8], size: u64) {
    if size <= MAX_OCTAL_SIZE {
        octal(field, size);
    } else {
        // GNU base-256: the top bit of the first byte marks it, the rest is big-endian.
        field.fill(0);
        field[0] = 0x80;
        let be = size.to_be_bytes();
        let n = field.len();
        field[n - 8..].copy_from_slice(&be);
    }
}

/// One ustar header block for a member whose name fields are already decided.
fn ustar_block(name: &[u8], prefix: &[u8], size: u64, typeflag: u8) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], FIXED_MODE);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    size_field(&mut h[124..136], size);
    octal(&mut h[136..148], FIXED_MTIME);
    h[156] = typeflag;
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], 0);
    octal(&mut h[337..345], 0);
    h[345..345 + prefix.len()].copy_from_slice(prefix);
    // The checksum is the sum of all bytes with the checksum field taken as spaces.
    h[148..156].fill(b' ');
    let sum: u64 = h.iter().map(|&b| u64::from(b)).sum();
    let s = format!("{sum:06o}");
    h[148..154].copy_from_slice(s.as_bytes());
    h[154] = 0;
    h[155] = b' ';
    h
}

/// An ASCII stand-in for a name that needs PAX, for readers that ignore PAX: the last 100 bytes
/// of the name with every non-ASCII or NUL byte replaced by `_`.
fn fallback_name(name: &str) -> Vec<u8> {
    let b = name.as_bytes();
    let tail = &b[b.len().saturating_sub(100)..];
    tail.iter().map(|&c| if c.is_ascii() && c != 0 { c } else { b'_' }).collect()
}

/// Appends the header block(s) of a regular-file member `name` of `size` bytes to `out`; exactly
/// [`header_len`]`(name, size)` bytes.
pub fn write_header(out: &mut Vec<u8>, name: &str, size: u64) {
    let layout = name_layout(name);
    let pax_name = matches!(layout, NameLayout::Pax);
    let pax_size = size > MAX_OCTAL_SIZE;
    if pax_name || pax_size {
        let records = pax_records(pax_name.then_some(name), pax_size.then_some(size));
        out.extend_from_slice(&ustar_block(PAX_HEADER_NAME.as_bytes(), b"", records.len() as u64, b'x'));
        out.extend_from_slice(&records);
        out.resize(out.len() + padding(records.len() as u64), 0);
    }
    let bytes = name.as_bytes();
    let block = match layout {
        NameLayout::Plain => ustar_block(bytes, b"", size, b'0'),
        NameLayout::Split(i) => ustar_block(&bytes[i + 1..], &bytes[..i], size, b'0'),
        NameLayout::Pax => ustar_block(&fallback_name(name), b"", size, b'0'),
    };
    out.extend_from_slice(&block);
}

#[cfg(test)]
mod tests {
    use std::io::{Cursor, Read};

    use super::*;
    use crate::format::tar as reader;

    fn archive(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, data) in members {
            let before = out.len();
            write_header(&mut out, name, data.len() as u64);
            assert_eq!(out.len() - before, header_len(name, data.len() as u64), "{name}");
            out.extend_from_slice(data);
            out.resize(out.len() + padding(data.len() as u64), 0);
        }
        out.extend_from_slice(&TRAILER);
        out
    }

    fn names() -> Vec<String> {
        vec![
            "a/x1.jpg".into(),
            "x.cls".into(),
            format!("{}/k.jpg", "d".repeat(120)), // ustar prefix split
            format!("{}/{}.jpg", "d".repeat(160), "n".repeat(20)), // prefix too long: PAX
            format!("dir/{}.json", "n".repeat(120)), // name part too long: PAX
            "données/été.jpg".into(),             // not ASCII: PAX
            format!("{}/日本/{}.seg.png", "p".repeat(140), "q".repeat(90)), // both
        ]
    }

    #[test]
    fn tar_crate_reads_names_sizes_and_fixed_metadata() {
        let names = names();
        let payloads: Vec<Vec<u8>> = (0..names.len()).map(|i| vec![i as u8; i * 700 + 1]).collect();
        let members: Vec<(&str, &[u8])> =
            names.iter().map(|n| n.as_str()).zip(payloads.iter().map(|p| &p[..])).collect();
        let bytes = archive(&members);
        let mut ar = tar::Archive::new(Cursor::new(&bytes));
        let mut seen = 0;
        for (i, entry) in ar.entries().unwrap().enumerate() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            assert_eq!(path, names[i]);
            let h = entry.header();
            assert_eq!(h.mtime().unwrap(), FIXED_MTIME);
            assert_eq!(h.mode().unwrap(), FIXED_MODE as u32);
            assert_eq!((h.uid().unwrap(), h.gid().unwrap()), (0, 0));
            let mut data = Vec::new();
            entry.read_to_end(&mut data).unwrap();
            assert_eq!(data, payloads[i]);
            seen += 1;
        }
        assert_eq!(seen, names.len());
    }

    #[test]
    fn shardstream_reader_finds_every_member() {
        let names = names();
        let members: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"payload"[..])).collect();
        let bytes = archive(&members);
        let ix = reader::index_tar(Cursor::new(&bytes), bytes.len() as u64).unwrap();
        assert_eq!(ix.num_samples(), names.len());
        for (i, name) in names.iter().enumerate() {
            let r = ix.sample_range(i).unwrap();
            let v = reader::parse_sample(&bytes[r.start as usize..r.end as usize]).unwrap();
            let (key, field) = reader::split_key(name).unwrap();
            assert_eq!((v.key.as_ref(), v.members[0].field.as_ref()), (key, field));
        }
    }

    #[test]
    fn huge_sizes_use_base256_and_pax() {
        let size = 10u64 << 30;
        let mut out = Vec::new();
        write_header(&mut out, "big.bin", size);
        assert_eq!(out.len(), header_len("big.bin", size));
        assert_eq!(out.len(), 3 * BLOCK);
        let records = std::str::from_utf8(&out[BLOCK..2 * BLOCK]).unwrap().trim_end_matches('\0');
        assert_eq!(records, format!("{} size={size}\n", 6 + size.to_string().len() + 2 + 1));
        let h = tar::Header::from_byte_slice(&out[2 * BLOCK..]);
        assert_eq!(h.entry_size().unwrap(), size);
        assert_eq!(header_len("small.bin", MAX_OCTAL_SIZE), BLOCK);
    }

    #[test]
    fn pax_record_lengths_count_their_own_digits() {
        for len in [1usize, 2, 80, 89, 90, 91, 985, 986, 995, 996, 9990] {
            let name = "n".repeat(len);
            let r = pax_records(Some(&name), None);
            let text = std::str::from_utf8(&r).unwrap();
            let (n, _) = text.split_once(' ').unwrap();
            assert_eq!(n.parse::<usize>().unwrap(), r.len(), "{len}");
        }
    }

    #[test]
    fn same_input_same_bytes() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        for n in names() {
            write_header(&mut a, &n, 12345);
            write_header(&mut b, &n, 12345);
        }
        assert_eq!(a, b);
    }
}
