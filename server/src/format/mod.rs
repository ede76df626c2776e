//! What a shard looks like: how to index it (count and locate its samples) and how to pull one
//! sample's fields out of it. Everything above this module (index, plan, transport) sees a shard
//! only through [`ShardTable`]: a sample count, the field names, and [`ShardTable::read_sample`],
//! which appends a sample's bytes to a buffer and says where each field lies. A new format (Parquet:
//! a sample is a row, the table is its row groups) is a new variant here and nothing else changes.
//!
//! - [`tar`]: WebDataset TAR shards (ustar, GNU long names, PAX), indexed from headers only.
//! - [`parquet`]: Parquet files (a sample is a row), indexed from their footers; batches leave as
//!   Arrow IPC.
//! - [`sidecar`]: the on-disk form of a shard's member table, so restarts do not rescan.

pub mod parquet;
pub mod sidecar;
pub mod tar;

use std::ops::Range;

use crate::storage::local::ShardFile;
use crate::{Error, Result};

/// The name of the only shard format of this build, as written in manifests.
pub const WEBDATASET: &str = "webdataset";

/// A shard's member table, resident in memory while the shard is in use.
#[derive(Debug)]
pub enum ShardTable {
    Tar(tar::TarIndex),
}

/// Where one sample's fields landed in the caller's buffer.
#[derive(Debug, Default)]
pub struct SampleLocation {
    pub key: String,
    /// (field name, byte range in the buffer), in shard order; only the first `used` are valid
    /// (the rest are kept to reuse their allocations).
    fields: Vec<(String, Range<usize>)>,
    used: usize,
}

impl SampleLocation {
    pub fn fields(&self) -> &[(String, Range<usize>)] {
        &self.fields[..self.used]
    }
}

impl ShardTable {
    pub fn num_samples(&self) -> u64 {
        match self {
            ShardTable::Tar(t) => t.num_samples() as u64,
        }
    }

    pub fn fields(&self) -> &[String] {
        match self {
            ShardTable::Tar(t) => &t.fields,
        }
    }

    /// Shard bytes sample `i` spans (what a shm client parses in its own mapping).
    pub fn sample_range(&self, i: u64) -> Option<std::ops::Range<u64>> {
        match self {
            ShardTable::Tar(t) => t.sample_range(usize::try_from(i).ok()?),
        }
    }

    /// The sample spanning the most shard bytes: (index, bytes), None for an empty shard.
    pub fn largest_sample(&self) -> Option<(u64, u64)> {
        match self {
            ShardTable::Tar(t) => t.largest_sample(),
        }
    }

    /// Bytes of memory the table holds (for the index-memory figures in status and the bench).
    pub fn heap_bytes(&self) -> usize {
        match self {
            ShardTable::Tar(t) => t.heap_bytes(),
        }
    }

    /// Appends sample `i`'s bytes to `buf` (one positioned read) and describes its fields in
    /// `loc`. Ranges in `loc` are absolute positions in `buf`. On error `buf` is restored to its
    /// length on entry.
    pub fn read_sample(&self, file: &ShardFile, i: u64, buf: &mut Vec<u8>, loc: &mut SampleLocation) -> Result<()> {
        match self {
            ShardTable::Tar(t) => {
                let range = usize::try_from(i)
                    .ok()
                    .and_then(|i| t.sample_range(i))
                    .ok_or_else(|| Error::Internal(format!("sample {i} out of range in {}", file.name)))?;
                let len = usize::try_from(range.end - range.start)
                    .map_err(|_| Error::Internal("sample larger than the address space".into()))?;
                let start = buf.len();
                buf.resize(start + len, 0);
                let parsed = file.read_exact_at(&mut buf[start..], range.start).and_then(|()| {
                    let view = tar::parse_sample(&buf[start..]).map_err(|e| shard_error(file, range.start, e))?;
                    loc.key.clear();
                    loc.key.push_str(&view.key);
                    // Reuse the name strings of the previous sample: no allocation per member.
                    loc.used = 0;
                    for m in &view.members {
                        let range = start + m.data.start..start + m.data.end;
                        match loc.fields.get_mut(loc.used) {
                            Some((name, r)) => {
                                name.clear();
                                name.push_str(&m.field);
                                *r = range;
                            }
                            None => loc.fields.push((m.field.to_string(), range)),
                        }
                        loc.used += 1;
                    }
                    Ok(())
                });
                if parsed.is_err() {
                    buf.truncate(start);
                }
                parsed
            }
        }
    }
}

/// Converts a TAR error found at `base` (the byte offset of the buffer's start in the shard) into
/// a shard error naming the shard and the absolute offset.
pub fn shard_error(file: &ShardFile, base: u64, e: tar::TarError) -> Error {
    let e = e.with_base(base);
    Error::Shard { shard: file.name.clone(), offset: e.offset(), reason: e.to_string() }
}
