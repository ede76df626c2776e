//! The inline transport: a batch's sample bytes are gathered into one buffer that travels in the
//! gRPC message (`InlineBatch.data`), with per-field (start, length) columns pointing into it.
//!
//! Each sample is read with one positioned read straight into the batch buffer. When every field
//! is wanted, the payloads stay where the read put them (the TAR headers between them travel
//! along, ~1 KiB per sample, cheaper than moving 20 KiB); when only some fields are wanted, the
//! wanted payloads are moved down over the rest, in place, so unwanted fields never cross the
//! socket.

use bytes::Bytes;
use shardstream_proto::{FieldColumn, InlineBatch};

use crate::Result;
use crate::format::SampleLocation;
use crate::index::ResidentShard;

/// Gathers one batch.
#[derive(Debug)]
pub struct InlineBatchBuilder {
    keys: Vec<String>,
    columns: Vec<FieldColumn>,
    data: Vec<u8>,
    /// True when the consumer wants every field of the dataset (no compaction needed).
    all_fields: bool,
    loc: SampleLocation,
    payload_bytes: u64,
}

impl InlineBatchBuilder {
    /// `fields`: the fields to deliver, in column order; `all_fields`: they are all the dataset
    /// has. `capacity`: expected bytes, to size the buffer once.
    pub fn new(fields: &[String], all_fields: bool, samples: usize, capacity: usize) -> Self {
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
            data: Vec::with_capacity(capacity),
            all_fields,
            loc: SampleLocation::default(),
            payload_bytes: 0,
        }
    }

    /// Reads sample `local` of `shard` into the batch.
    pub fn add_sample(&mut self, shard: &ResidentShard, local: u64) -> Result<()> {
        let region_start = self.data.len();
        shard.table.read_sample(&shard.file, local, &mut self.data, &mut self.loc)?;
        let sample_index = self.keys.len() as u32;
        let mut write = region_start;
        for col in &mut self.columns {
            // A sample has a handful of fields: a linear search beats any map here.
            let found = self.loc.fields().iter().find(|(name, _)| *name == col.name).map(|(_, r)| r.clone());
            match found {
                Some(range) => {
                    let len = range.len();
                    let start = if self.all_fields {
                        range.start
                    } else {
                        // Payloads appear in shard order and are written in column order, so
                        // only move when that order agrees; otherwise copy to the end.
                        if range.start >= write {
                            self.data.copy_within(range.clone(), write);
                            write += len;
                            write - len
                        } else {
                            let at = self.data.len();
                            self.data.extend_from_within(range);
                            at
                        }
                    };
                    col.starts.push(start as u64);
                    col.lengths.push(len as u64);
                    self.payload_bytes += len as u64;
                }
                None => {
                    col.starts.push(0);
                    col.lengths.push(0);
                    col.missing.push(sample_index);
                }
            }
        }
        if !self.all_fields {
            // Everything past the last moved payload is headers or unwanted fields, unless a
            // payload was appended after the region (rare order mismatch): keep those.
            let end_of_region = self.region_end(region_start);
            if end_of_region <= write {
                self.data.truncate(write);
            }
        }
        self.keys.push(std::mem::take(&mut self.loc.key));
        Ok(())
    }

    /// The furthest byte any column of the current sample points at.
    fn region_end(&self, region_start: usize) -> usize {
        self.columns
            .iter()
            .filter_map(|c| Some(c.starts.last()? + c.lengths.last()?))
            .map(|e| e as usize)
            .max()
            .unwrap_or(region_start)
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

    pub fn finish(self, batch_index: u64) -> InlineBatch {
        InlineBatch { batch_index, keys: self.keys, fields: self.columns, data: Bytes::from(self.data) }
    }
}
