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
//! - members whose file name has no dot are skipped; so, unlike `webdataset`, are those whose
//!   file name starts with a dot (`dir/.hidden.jpg`, which it files under the key `dir/`) or
//!   ends with its first dot (`abc.`, which it gives an empty field name no `fields=` can ask for);
//! - WebDataset metadata (`__name__`, `__dir__/...`) is skipped;
//! - fields are lower-cased (`abc.JPG` is field `jpg`);
//! - a field appearing twice in one sample is an error ([`TarError::DuplicateField`]).
//!
//! Directories, links, devices and FIFOs are skipped. A sparse member (`tar --sparse`) that would
//! be a sample's field is refused ([`TarError::Sparse`]): its stored bytes are a map and the data
//! blocks, not the file `webdataset` reads, and samples are served from the shard's bytes in
//! place; skipping it would lose the field without a word. So is a member name that is not UTF-8
//! ([`TarError::NotUtf8Name`]): keys are text, and decoding it lossily would give different
//! names one key (two samples merged).
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

mod entry;
mod header;
pub mod layout;
mod naming;
mod sample;
mod scan;
#[cfg(test)]
mod tests;

use std::ops::Range;

pub use naming::split_key;
pub use sample::{Member, SampleView, parse_sample};
pub use scan::{MAX_SHARD_FIELDS, ScanAsWritten, index_tar, index_tar_bytes};

/// TAR block size: every header and every padded payload is a multiple of it.
pub const BLOCK: u64 = 512;
/// Longest GNU long name record accepted. Real paths stay under `PATH_MAX` (4 KiB); 64 KiB leaves
/// room for anything sane while a malicious header cannot make us allocate much.
pub const MAX_NAME_BYTES: u64 = 64 << 10;
/// Largest PAX extended header accepted, for the same reason: a path plus a few timestamps and
/// attributes takes well under 1 KiB, and 1 MiB leaves room for generous `SCHILY.xattr` records.
pub const MAX_PAX_BYTES: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TarError {
    #[error("read error at offset {offset}: {source}")]
    Io {
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    /// `compressed`: what the first bytes say the file is instead (gzip, zstd, ...), if anything.
    #[error(
        "not a TAR file: no valid TAR header at offset {offset}{}",
        compressed.map(|kind| format!(
            "; it is {kind}-compressed, a TAR compressed whole: shards are read in place, so store them \
             uncompressed (e.g. gunzip, zstd -d)"
        )).unwrap_or_default()
    )]
    NotTar { offset: u64, compressed: Option<&'static str> },
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
    #[error(
        "member '{name}' at offset {offset} brings the shard past the {max} distinct fields (extensions) a \
         shard may have: a sample's fields are a handful (jpg, cls, json); a name whose key and extension \
         split elsewhere than meant (keys with dots) can make every member its own field"
    )]
    TooManyFields { offset: u64, name: String, max: usize },
    #[error(
        "member '{name}' at offset {offset} is stored sparse (tar --sparse): its bytes in the shard are not the \
         file's, and samples are served from the shard in place; re-create the shard without --sparse"
    )]
    Sparse { offset: u64, name: String },
    #[error(
        "member '{name}' at offset {offset} has a name that is not UTF-8: keys and fields are text, and \
         decoding it would give other names the same key; rename the files in UTF-8 (e.g. with convmv) and \
         re-create the shard"
    )]
    NotUtf8Name { offset: u64, name: String },
}

impl TarError {
    /// Byte offset the error is about: within the shard for [`index_tar`], within the buffer for
    /// [`parse_sample`] until shifted by [`TarError::with_base`].
    pub fn offset(&self) -> Option<u64> {
        match self {
            TarError::Io { offset, .. }
            | TarError::NotTar { offset, .. }
            | TarError::Truncated { offset, .. }
            | TarError::BadChecksum { offset }
            | TarError::PastEnd { offset, .. }
            | TarError::BadPax { offset, .. }
            | TarError::BadNumber { offset, .. }
            | TarError::TooLong { offset, .. }
            | TarError::KeyMismatch { offset, .. }
            | TarError::DuplicateField { offset, .. }
            | TarError::TooManyFields { offset, .. }
            | TarError::NoMembers { offset }
            | TarError::Sparse { offset, .. }
            | TarError::NotUtf8Name { offset, .. } => Some(*offset),
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
            | TarError::NotTar { offset, .. }
            | TarError::Truncated { offset, .. }
            | TarError::BadChecksum { offset }
            | TarError::BadPax { offset, .. }
            | TarError::BadNumber { offset, .. }
            | TarError::TooLong { offset, .. }
            | TarError::KeyMismatch { offset, .. }
            | TarError::DuplicateField { offset, .. }
            | TarError::TooManyFields { offset, .. }
            | TarError::NoMembers { offset }
            | TarError::Sparse { offset, .. }
            | TarError::NotUtf8Name { offset, .. } => *offset = offset.saturating_add(base),
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
    /// Where each sample's key and fields lie, when the scan could record it (see [`layout`]).
    pub layout: Option<layout::Layout>,
    /// Samples whose key an earlier, not adjacent sample of the shard has: found by a scan, not
    /// kept in sidecars (the scan that wrote one has said so).
    pub split_keys: SplitKeys,
}

/// Samples of a shard whose key came back after other keys: a sample's files that are not
/// together in the archive (`tar cf` of a directory orders them as the file system lists them),
/// each run served as a sample of its own, with the fields it lacks None, as webdataset does.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SplitKeys {
    /// How many samples (runs) repeat an earlier key.
    pub count: usize,
    /// The first such key.
    pub first: Option<String>,
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

    /// Starts loading what [`sample_range`](Self::sample_range) and the layout read for sample
    /// `i` into the cache (see [`crate::cache_hint`]).
    pub fn prefetch(&self, i: usize) {
        if let Some(b) = self.boundaries.get(i) {
            crate::cache_hint::prefetch(b);
        }
        if let Some(layout) = &self.layout {
            layout.prefetch(i);
        }
    }

    /// True when the ranges never go back and end within a shard of `shard_len` bytes: what an
    /// index from elsewhere (a sidecar) must satisfy before its ranges size any read.
    pub fn fits_shard(&self, shard_len: u64) -> bool {
        self.boundaries.windows(2).all(|w| w[0] <= w[1])
            && self.boundaries.last().is_none_or(|&end| end <= shard_len)
            && self.layout.as_ref().is_none_or(|l| l.fits(&self.boundaries))
    }

    /// Bytes of heap memory the index holds.
    pub fn heap_bytes(&self) -> usize {
        self.boundaries.capacity() * size_of::<u64>()
            + self.fields.capacity() * size_of::<String>()
            + self.fields.iter().map(String::capacity).sum::<usize>()
            + self.layout.as_ref().map_or(0, layout::Layout::heap_bytes)
    }
}
