//! The per-file sidecar of a Parquet shard: the file's own footer bytes behind a checked header,
//! so a restarted daemon (or a dataset indexed by `shardstream index`) decodes the table without
//! reading the file at all. The footer already holds everything the daemon keeps (row counts,
//! column chunk ranges, codecs, schema) in Parquet's compact thrift form, so nothing is
//! re-encoded, and the same decoder and checks apply as to a fresh tail read.
//!
//! ```text
//!  0               8            12           16             16+I        24+I         28+I        28+I+F
//!  ┌───────────────┬────────────┬────────────┬──────────────┬───────────┬────────────┬───────────┬────────┐
//!  │ "SSPQX\0\r\n" │ version u32│ I: u32     │ identity     │ file_len  │ F: u32     │ footer    │ crc32c │
//!  │ magic         │ = 1        │            │ I bytes      │ u64       │            │ F bytes   │ u32    │
//!  └───────────────┴────────────┴────────────┴──────────────┴───────────┴────────────┴───────────┴────────┘
//!   all little-endian; the CRC-32C covers every byte before it
//! ```
//!
//! The identity (an opaque string chosen by the caller, as for TAR sidecars: `len=..;crc32c=..`,
//! `len=..;mtime_ns=..` or an S3 ETag) names the file version the sidecar describes; a sidecar
//! whose identity differs is stale and never used. Errors are [`SidecarError`]s, as for TAR.

use super::ParquetTable;
use crate::format::sidecar::SidecarError;

pub const MAGIC: &[u8; 8] = b"SSPQX\0\r\n";
pub const VERSION: u32 = 1;
/// Sidecar file name suffix (`<file>.parquet` -> `<file>.parquet.pqidx`).
pub const SUFFIX: &str = ".pqidx";

/// Encodes the sidecar of a file of `file_len` bytes whose footer is `footer`.
pub fn encode(identity: &[u8], file_len: u64, footer: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(32 + identity.len() + footer.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&u32::try_from(identity.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(identity);
    out.extend_from_slice(&file_len.to_le_bytes());
    out.extend_from_slice(&u32::try_from(footer.len()).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(footer);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// A decoded sidecar, borrowing from its bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct PqIdx<'a> {
    pub identity: &'a [u8],
    pub file_len: u64,
    pub footer: &'a [u8],
}

/// Checks magic, version, checksum and structure, in that order.
pub fn decode(bytes: &[u8]) -> Result<PqIdx<'_>, SidecarError> {
    if bytes.get(..8) != Some(MAGIC.as_slice()) {
        return Err(SidecarError::BadMagic);
    }
    let mut r = Reader { b: bytes, at: 8 };
    let found = r.u32("version")?;
    if found != VERSION {
        return Err(SidecarError::Version { found });
    }
    let body_len = bytes.len().checked_sub(4).filter(|&n| n >= 12).ok_or(SidecarError::Truncated { what: "header" })?;
    let stored =
        u32::from_le_bytes(bytes[body_len..].try_into().map_err(|_| SidecarError::Truncated { what: "checksum" })?);
    let computed = crc32c::crc32c(&bytes[..body_len]);
    if stored != computed {
        return Err(SidecarError::Checksum { stored, computed });
    }
    r.b = &bytes[..body_len];
    let i = r.u32("identity length")? as usize;
    let identity = r.take(i, "identity")?;
    let file_len = r.u64("file length")?;
    let f = r.u32("footer length")? as usize;
    let footer = r.take(f, "footer")?;
    if r.at != body_len {
        return Err(SidecarError::Malformed { what: "bytes after the footer" });
    }
    Ok(PqIdx { identity, file_len, footer })
}

/// The table of the file with `identity` from its sidecar `bytes`; `Ok(None)` when the sidecar
/// describes another version of the file (stale).
pub fn load(bytes: &[u8], identity: &[u8]) -> Result<Option<ParquetTable>, SidecarError> {
    let idx = decode(bytes)?;
    if idx.identity != identity {
        return Ok(None);
    }
    ParquetTable::decode(idx.footer, idx.file_len).map(Some).map_err(|_| SidecarError::Malformed { what: "footer" })
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], SidecarError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len()).ok_or(SidecarError::Truncated { what })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, SidecarError> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, SidecarError> {
        let s = self.take(8, what)?;
        let mut a = [0; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{footer, testdata};
    use super::*;

    #[test]
    fn round_trip_stale_identity_and_every_damage_detected() {
        let file = testdata::mixed(40, 16, testdata::Codec::Snappy);
        let len = file.len() as u64;
        let foot = footer::read_footer(len, |o, b| {
            b.copy_from_slice(&file[o as usize..o as usize + b.len()]);
            Ok(())
        })
        .unwrap();
        let bytes = encode(b"len=1;mtime_ns=2", len, &foot);
        let t = load(&bytes, b"len=1;mtime_ns=2").unwrap().unwrap();
        assert_eq!((t.num_rows(), t.num_row_groups(), t.file_len()), (40, 3, len));
        assert!(load(&bytes, b"len=1;mtime_ns=3").unwrap().is_none());
        assert!(matches!(decode(b"garbage!"), Err(SidecarError::BadMagic)));
        let mut v2 = bytes.clone();
        v2[8] = 2;
        assert!(matches!(decode(&v2), Err(SidecarError::Version { found: 2 })));
        for i in 12..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad).is_err(), "flip at {i} undetected");
        }
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "truncation to {n} undetected");
        }
    }
}
