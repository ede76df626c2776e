//! The footers of a whole Parquet dataset in one object: every file's sidecar ([`super::pqidx`])
//! behind its name, so that opening a dataset `shardstream index` described costs two reads
//! (the manifest and this), not one tail read per file. On S3 that is the difference between two
//! requests and one per file: 10,000 files opened 8 at a time at ~30 ms a GET would take ~40 s.
//!
//! ```text
//!  0               8            12          entries                                   end - 4
//!  ┌───────────────┬────────────┬───────────┬──────────────────────────────────────┬─────────┐
//!  │ "SSPQF\0\r\n" │ version u32│ count u32 │ count x (name_len u32, name,          │ crc32c  │
//!  │ magic         │ = 1        │           │          sidecar_len u32, sidecar)     │ u32     │
//!  └───────────────┴────────────┴───────────┴──────────────────────────────────────┴─────────┘
//!   all little-endian; the CRC-32C covers every byte before it
//! ```
//!
//! Each sidecar keeps its own identity and checksum, so one entry describing another version of
//! its file (stale) is told apart by the same check as a sidecar on its own, and only that file
//! is read again. Names are the manifest's shard names. Errors are [`SidecarError`]s.

use std::collections::HashMap;

use crate::format::sidecar::SidecarError;

pub const MAGIC: &[u8; 8] = b"SSPQF\0\r\n";
pub const VERSION: u32 = 1;
/// Where `shardstream index` writes it, relative to the dataset (beside the per-file sidecars).
pub const NAME: &str = "_shardstream/footers.idx";

/// The bundle of `entries` (a file's name, its sidecar bytes).
pub fn encode<'a>(entries: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Result<Vec<u8>, SidecarError> {
    let mut body = Vec::new();
    let mut count = 0u32;
    for (name, sidecar) in entries {
        for part in [name.as_bytes(), sidecar] {
            body.extend_from_slice(
                &u32::try_from(part.len())
                    .map_err(|_| SidecarError::Malformed { what: "an entry of 4 GiB or more" })?
                    .to_le_bytes(),
            );
            body.extend_from_slice(part);
        }
        count = count.checked_add(1).ok_or(SidecarError::Malformed { what: "more than 2^32 entries" })?;
    }
    let mut out = Vec::with_capacity(body.len() + 20);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&body);
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// The sidecar bytes of each file, by name: checks magic, version, checksum and structure, in that
/// order (a name given twice is malformed).
pub fn decode(bytes: &[u8]) -> Result<HashMap<&str, &[u8]>, SidecarError> {
    if bytes.get(..8) != Some(MAGIC.as_slice()) {
        return Err(SidecarError::BadMagic);
    }
    let version = read_u32(bytes, 8, "version")?;
    if version != VERSION {
        return Err(SidecarError::Version { found: version });
    }
    let body_len = bytes.len().checked_sub(4).filter(|&n| n >= 16).ok_or(SidecarError::Truncated { what: "header" })?;
    let stored = read_u32(bytes, body_len, "checksum")?;
    let computed = crc32c::crc32c(&bytes[..body_len]);
    if stored != computed {
        return Err(SidecarError::Checksum { stored, computed });
    }
    let body = &bytes[..body_len];
    let count = read_u32(body, 12, "entry count")?;
    let mut at = 16;
    let mut take = |what: &'static str| -> Result<&[u8], SidecarError> {
        let len = read_u32(body, at, what)? as usize;
        let start = at + 4;
        let end = start.checked_add(len).filter(|&e| e <= body.len()).ok_or(SidecarError::Truncated { what })?;
        at = end;
        Ok(&body[start..end])
    };
    let mut out = HashMap::new();
    for _ in 0..count {
        let name = std::str::from_utf8(take("name")?).map_err(|_| SidecarError::Malformed { what: "a name" })?;
        let sidecar = take("sidecar")?;
        if out.insert(name, sidecar).is_some() {
            return Err(SidecarError::Malformed { what: "a file named twice" });
        }
    }
    if at != body.len() {
        return Err(SidecarError::Malformed { what: "bytes after the last entry" });
    }
    Ok(out)
}

fn read_u32(b: &[u8], at: usize, what: &'static str) -> Result<u32, SidecarError> {
    let s = b.get(at..at + 4).ok_or(SidecarError::Truncated { what })?;
    Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        encode([("a.parquet", b"first".as_slice()), ("dir/b.parquet", b"".as_slice()), ("c.parquet", &[7u8; 300])])
            .unwrap()
    }

    #[test]
    fn every_entry_comes_back_by_name() {
        let bytes = sample();
        let got = decode(&bytes).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got["a.parquet"], b"first");
        assert_eq!(got["dir/b.parquet"], b"");
        assert_eq!(got["c.parquet"], &[7u8; 300]);
        assert!(decode(&encode([]).unwrap()).unwrap().is_empty());
    }

    #[test]
    fn any_damaged_or_missing_byte_is_an_error_never_a_panic() {
        let bytes = sample();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x20;
            assert!(decode(&bad).is_err(), "byte {i} flipped");
            assert!(decode(&bytes[..i]).is_err(), "cut at {i}");
        }
        assert!(matches!(decode(b"SSPQX\0\r\n...."), Err(SidecarError::BadMagic)));
    }

    #[test]
    fn a_name_given_twice_or_trailing_bytes_are_malformed() {
        let twice = encode([("a", b"1".as_slice()), ("a", b"2".as_slice())]).unwrap();
        assert!(matches!(decode(&twice), Err(SidecarError::Malformed { what: "a file named twice" })));
        // One entry counted, two present: re-checksummed so only the structure is wrong.
        let mut extra = encode([("a", b"1".as_slice()), ("b", b"2".as_slice())]).unwrap();
        extra[12..16].copy_from_slice(&1u32.to_le_bytes());
        let n = extra.len() - 4;
        let crc = crc32c::crc32c(&extra[..n]);
        extra[n..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode(&extra), Err(SidecarError::Malformed { what: "bytes after the last entry" })));
    }
}
