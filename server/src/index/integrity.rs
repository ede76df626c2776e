//! What a dataset's identity and integrity rest on: its fingerprint, the content digest of a
//! local shard without a manifest checksum, and the checks of a shard (whole file, or a Parquet
//! file's footer) against the CRC its manifest records.

use std::path::Path;

use super::ShardMeta;
use crate::format::ShardTable;
use crate::storage::local::{self, ShardFile};
use crate::{Error, Result};

/// Hash of the shards' names, sample counts and content identities (see ARCHITECTURE.md,
/// "Dataset fingerprint"); persisted in trainers' state_dicts.
pub(super) fn fingerprint(shards: &[ShardMeta]) -> String {
    let mut h = crate::stable_hash::Fnv1a::new();
    for s in shards {
        h.bytes(s.name.as_bytes()).bytes(&[0]).bytes(&s.content_identity()).bytes(&s.samples.to_le_bytes());
    }
    format!("{:016x}", h.finish())
}

/// Bytes at each end of a local shard that its content digest covers.
const DIGEST_EDGE: u64 = 64 << 10;

/// A digest of a local shard's content, for shards without a manifest checksum: its length,
/// member table (every sample's byte range and the field names) and the CRC-32C of its first and
/// last [`DIGEST_EDGE`] bytes. Two positioned reads; what it does not cover is in ARCHITECTURE.md.
pub(super) fn content_digest(file: &ShardFile, table: &ShardTable) -> Result<u64> {
    let mut h = crate::stable_hash::Fnv1a::new();
    h.field(b"shardstream-content-1").field(&file.len.to_le_bytes());
    table.digest_into(&mut h);
    let head = file.len.min(DIGEST_EDGE);
    let tail_start = file.len.saturating_sub(DIGEST_EDGE).max(head);
    let mut buf = vec![0u8; DIGEST_EDGE as usize];
    for range in [0..head, tail_start..file.len] {
        let chunk = &mut buf[..(range.end - range.start) as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file.file, chunk, range.start)
            .map_err(|e| Error::io("cannot read shard", &file.path, e))?;
        // The bytes through CRC-32C (hardware speed) rather than byte-wise FNV: this runs for
        // every shard at every open.
        h.field(&crc32c::crc32c(chunk).to_le_bytes());
    }
    Ok(h.finish())
}

fn verify(path: &Path, meta: &ShardMeta, expected: u32) -> Result<()> {
    let (len, crc) = local::file_crc32c(path).map_err(|e| match e {
        Error::NotFound { .. } => Error::NotFound { what: "shard", path: path.display().to_string() },
        other => other,
    })?;
    if len != meta.len || crc != expected {
        return Err(Error::Shard {
            shard: path.display().to_string(),
            offset: None,
            reason: format!(
                "does not match manifest.json (size {len} vs {}, crc32c {crc:08x} vs {expected:08x}); refusing to serve it",
                meta.len
            ),
        });
    }
    Ok(())
}

/// Checks local shard `path` against what the manifest records of it: its CRC, or for a Parquet
/// file its footer's (`opened`: the file, when the caller has it open); nothing when it records
/// neither.
pub(super) fn verify_source(path: &Path, meta: &ShardMeta, opened: Option<&ShardFile>) -> Result<()> {
    if let Some(expected) = meta.crc32c {
        verify(path, meta, expected)
    } else if let Some(expected) = meta.footer_crc32c {
        match opened {
            Some(file) => verify_footer(file, meta, expected),
            None => verify_footer(&ShardFile::open(path.to_owned(), meta.len)?, meta, expected),
        }
    } else {
        Ok(())
    }
}

/// Checks a Parquet file's footer against the CRC a `crc32c-footer` manifest records (its length
/// was checked when `file` was opened): one tail read, never the whole file.
fn verify_footer(file: &ShardFile, meta: &ShardMeta, expected: u32) -> Result<()> {
    let got = footer_crc(file)?;
    if got != expected {
        return Err(footer_mismatch(&meta.url(), got, expected, "its footer"));
    }
    Ok(())
}

/// Checks that a node-cache copy of a Parquet file ends in the footer (CRC `opened_with`) the
/// dataset's table of it was decoded from, read before the copy was made: otherwise the file
/// changed in between, and the table's chunk offsets point at other bytes.
pub(super) fn verify_copy_footer(copy: &ShardFile, meta: &ShardMeta, opened_with: u32) -> Result<()> {
    let got = footer_crc(copy)?;
    if got != opened_with {
        return Err(Error::Shard {
            shard: meta.url(),
            offset: None,
            reason: format!(
                "its node-cache copy ends in another footer (crc32c {got:08x}) than the one the dataset was opened \
                 with ({opened_with:08x}): the file changed since; open the dataset again"
            ),
        });
    }
    Ok(())
}

/// The CRC-32C of a local Parquet file's footer (one tail read).
fn footer_crc(file: &ShardFile) -> Result<u32> {
    let footer = crate::format::parquet::dataset::read_local_footer(file)?;
    Ok(crate::format::parquet::footer::footer_crc32c(&footer))
}

pub(super) fn footer_mismatch(shard: &str, got: u32, expected: u32, what: &str) -> Error {
    Error::Shard {
        shard: shard.to_owned(),
        offset: None,
        reason: format!(
            "does not match manifest.json: the crc32c of {what} is {got:08x}, the manifest says {expected:08x} \
             (the file changed after it was indexed); refusing to serve it"
        ),
    }
}
