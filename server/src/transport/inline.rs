//! The inline transport: a batch's sample bytes are gathered into one buffer that travels in the
//! gRPC message (`InlineBatch.data`), with per-field (start, length) columns pointing into it.
//!
//! Each sample is read with one positioned read straight into the batch buffer. When every field
//! is wanted, the payloads stay where the read put them (the TAR headers between them travel
//! along, ~1 KiB per sample, cheaper than moving 20 KiB); when only some fields are wanted, the
//! wanted payloads are moved down over the rest, in place and in the shard's order (whatever order
//! the fields are asked in), so unwanted fields never cross the socket.
//!
//! The same builder gathers an rdma batch straight into its registered staging buffer
//! ([`InlineBatchBuilder::into_parts`] over a [`Fixed`] buffer): the bytes are laid out as an
//! inline message's `data`, and only the keys and columns travel on gRPC.
//!
//! A batch whose bytes do not fit one message (the 512 MiB message limit, or a lower limit set
//! with `SHARDSTREAM_INLINE_MESSAGE_BYTES`, a knob for tests) is sent as several parts, each a
//! run of whole samples; the client joins them.

use std::ops::Range;

use bytes::Bytes;
use shardstream_proto::{FieldColumn, InlineBatch};

use crate::Result;
use crate::format::SampleLocation;
use crate::index::ResidentShard;
use crate::storage::append::Append;
#[cfg(doc)]
use crate::storage::append::Fixed;

/// Room for a batch's bytes in one inline message by default: the rest of the message limit is
/// for the keys and column tables.
pub const DEFAULT_PAYLOAD_LIMIT: u64 = shardstream_proto::MAX_MESSAGE_BYTES as u64 - (1 << 20);

/// Smallest limit the knob accepts: below it a part would hold less than a TAR header or two.
const MIN_PAYLOAD_LIMIT: u64 = 4096;

/// Bytes of sample data one inline message carries at most: [`DEFAULT_PAYLOAD_LIMIT`], or
/// `SHARDSTREAM_INLINE_MESSAGE_BYTES` when set (lower only; read once per process), so tests can
/// split batches without hundreds of MiB of data. A sample larger than this is refused by name.
pub fn payload_limit() -> u64 {
    static LIMIT: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| parse_limit(std::env::var("SHARDSTREAM_INLINE_MESSAGE_BYTES").ok().as_deref()))
}

/// [`payload_limit`] for messages: "512 MiB" (the message limit), or the knob's bytes.
pub fn limit_text() -> String {
    match payload_limit() {
        DEFAULT_PAYLOAD_LIMIT => format!("{} MiB", shardstream_proto::MAX_MESSAGE_BYTES >> 20),
        bytes => format!("{bytes} bytes"),
    }
}

/// The limit for the knob's value: unset, empty or unparsable values keep the default (the knob is
/// for tests; a typo must not shrink a production daemon's messages to nothing).
fn parse_limit(value: Option<&str>) -> u64 {
    match value.map(str::trim).and_then(|v| v.parse::<u64>().ok()) {
        Some(v) => v.clamp(MIN_PAYLOAD_LIMIT, DEFAULT_PAYLOAD_LIMIT),
        None => DEFAULT_PAYLOAD_LIMIT,
    }
}

/// Gathers one batch (or one part of a batch split over several messages) into `data`.
#[derive(Debug)]
pub struct InlineBatchBuilder<B = Vec<u8>> {
    keys: Vec<String>,
    columns: Vec<FieldColumn>,
    data: B,
    /// True when the consumer wants every field of the dataset (no compaction needed).
    all_fields: bool,
    loc: SampleLocation,
    /// The current sample's payload for each column (None: the sample lacks the field).
    found: Vec<Option<Range<usize>>>,
    /// The wanted payloads' (start, column) in the shard's order, for [`Self::compact`].
    order: Vec<(usize, usize)>,
    payload_bytes: u64,
}

impl InlineBatchBuilder {
    /// `fields`: the fields to deliver, in column order; `all_fields`: they are all the dataset
    /// has. `capacity`: expected bytes, to size the buffer once.
    pub fn new(fields: &[String], all_fields: bool, samples: usize, capacity: usize) -> Self {
        Self::with_buffer(fields, all_fields, samples, Vec::with_capacity(capacity))
    }

    /// The message. `more`: another part of the same batch follows.
    pub fn finish(self, batch_index: u64, more: bool) -> InlineBatch {
        InlineBatch { batch_index, keys: self.keys, fields: self.columns, data: Bytes::from(self.data), more }
    }
}

impl<B: Append> InlineBatchBuilder<B> {
    /// As [`InlineBatchBuilder::new`], gathering into `data` (empty).
    pub fn with_buffer(fields: &[String], all_fields: bool, samples: usize, data: B) -> Self {
        let columns = fields
            .iter()
            .map(|f| FieldColumn {
                name: f.clone(),
                starts: Vec::with_capacity(samples),
                lengths: Vec::with_capacity(samples),
                missing: Vec::new(),
            })
            .collect();
        Self {
            keys: Vec::with_capacity(samples),
            columns,
            data,
            all_fields,
            loc: SampleLocation::default(),
            found: Vec::with_capacity(fields.len()),
            order: Vec::with_capacity(fields.len()),
            payload_bytes: 0,
        }
    }

    /// Reads sample `local` of `shard` into the batch.
    pub fn add_sample(&mut self, shard: &ResidentShard, local: u64) -> Result<()> {
        let region_start = self.data.len();
        shard.table.read_sample(&shard.file, local, &mut self.data, &mut self.loc)?;
        let sample_index = self.keys.len() as u32;
        self.found.clear();
        for col in &self.columns {
            self.found.push(self.loc.field(&col.name));
        }
        if !self.all_fields {
            self.compact(region_start).map_err(|why| {
                crate::Error::invalid(format!("sample {} of {}: {why}", self.loc.key, shard.file.name))
            })?;
        }
        for (col, found) in self.columns.iter_mut().zip(&self.found) {
            match found {
                Some(range) => {
                    col.starts.push(range.start as u64);
                    col.lengths.push(range.len() as u64);
                    self.payload_bytes += range.len() as u64;
                }
                None => {
                    col.starts.push(0);
                    col.lengths.push(0);
                    col.missing.push(sample_index);
                }
            }
        }
        self.keys.push(std::mem::take(&mut self.loc.key));
        Ok(())
    }

    /// Moves the current sample's wanted payloads (`found`) down over its headers and unwanted
    /// fields, in place, and drops what is left after them. They are moved in the shard's order,
    /// whatever order the columns ask for: each lands at or before its own start and after every
    /// payload that precedes it, so no move overwrites bytes a later one has still to take.
    fn compact(&mut self, region_start: usize) -> std::result::Result<(), String> {
        self.order.clear();
        self.order.extend(self.found.iter().enumerate().filter_map(|(i, r)| Some((r.as_ref()?.start, i))));
        self.order.sort_unstable();
        let mut write = region_start;
        for &(start, i) in &self.order {
            let Some(range) = self.found[i].clone() else { continue };
            if start < write {
                // Two wanted fields over the same bytes: the earlier move has overwritten them.
                return Err(format!("field {:?} overlaps another field", self.columns[i].name));
            }
            let len = range.len();
            self.data.filled_mut().copy_within(range, write);
            self.found[i] = Some(write..write + len);
            write += len;
        }
        self.data.truncate(write);
        Ok(())
    }

    /// Bytes gathered so far, TAR headers included: what the message will carry.
    pub fn data_len(&self) -> usize {
        self.data.len()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Payload bytes delivered (what the consumer asked for, without headers).
    pub fn payload_bytes(&self) -> u64 {
        self.payload_bytes
    }

    /// The keys, the field columns and the bytes gathered, for a batch whose bytes do not travel
    /// in its message (rdma).
    pub fn into_parts(self) -> (Vec<String>, Vec<FieldColumn>, usize) {
        let len = self.data.len();
        (self.keys, self.columns, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_knob_only_lowers_the_limit_within_bounds() {
        assert_eq!(parse_limit(None), DEFAULT_PAYLOAD_LIMIT);
        assert_eq!(parse_limit(Some("")), DEFAULT_PAYLOAD_LIMIT);
        assert_eq!(parse_limit(Some("1MiB")), DEFAULT_PAYLOAD_LIMIT);
        assert_eq!(parse_limit(Some(" 65536 ")), 65536);
        assert_eq!(parse_limit(Some("1")), MIN_PAYLOAD_LIMIT);
        assert_eq!(parse_limit(Some("99999999999999")), DEFAULT_PAYLOAD_LIMIT);
    }
}
