//! Packed mode (`collate="stack"`): gathers a batch's fields into a ring slot, each field as one
//! column of equal-length records (the slot layout of `shardstream_proto::ring`), so the client
//! gets one `(samples, record_bytes)` array per field over shared memory. This is the one copy of
//! packed mode: shard bytes -> slot; the client reads the slot where it lies.
//!
//! The first sample of a batch fixes each field's record length; every other sample must match
//! it, and must have every field: stacking is only defined for such batches, and the error names
//! the sample that breaks the rule rather than padding or truncating behind the user's back.

use shardstream_proto::ring::{COLUMN_ALIGN, FIELD_DESC_BYTES, FieldDesc, SLOT_HEADER_BYTES, SlotHeader, round_up};

use crate::format::SampleLocation;
use crate::index::ResidentShard;
use crate::{Error, Result};

/// Gathers one packed batch.
#[derive(Debug)]
pub struct PackedGather {
    fields: Vec<String>,
    samples: usize,
    /// Per field: record bytes (from the first sample) and the column's offset in the slot.
    columns: Vec<(u64, u64)>,
    first_key: String,
    keys: Vec<String>,
    scratch: Vec<u8>,
    loc: SampleLocation,
}

impl PackedGather {
    /// A batch of `samples` samples of `fields` (in the stream's field order).
    pub fn new(fields: &[String], samples: usize) -> Self {
        Self {
            fields: fields.to_vec(),
            samples,
            columns: Vec::with_capacity(fields.len()),
            first_key: String::new(),
            keys: Vec::with_capacity(samples),
            scratch: Vec::new(),
            loc: SampleLocation::default(),
        }
    }

    /// Reads the next sample (one positioned read into a reused buffer).
    pub fn read(&mut self, shard: &ResidentShard, local: u64) -> Result<()> {
        self.scratch.clear();
        shard.table.read_sample(&shard.file, local, &mut self.scratch, &mut self.loc)
    }

    /// Bytes the batch needs in a slot, from the record lengths of the sample just read (the
    /// batch's first): call once, after the first [`Self::read`].
    pub fn slot_bytes(&mut self) -> Result<u64> {
        let mut at = SlotHeader::columns_start(self.fields.len())
            .ok_or_else(|| Error::invalid("too many fields for a packed batch"))?;
        self.first_key = self.loc.key.clone();
        self.columns.clear();
        for f in 0..self.fields.len() {
            let len = self.payload(f)?.len() as u64;
            self.columns.push((len, at));
            let column = len
                .checked_mul(self.samples as u64)
                .and_then(|b| round_up(b, COLUMN_ALIGN))
                .and_then(|b| at.checked_add(b))
                .ok_or_else(|| Error::invalid("packed batch size overflows"))?;
            at = column;
        }
        Ok(at)
    }

    /// The byte range of field `f` of the sample just read.
    fn payload(&self, f: usize) -> Result<std::ops::Range<usize>> {
        let name = &self.fields[f];
        // A sample has a handful of fields: a linear search beats any map.
        self.loc.fields().iter().find(|(n, _)| n == name).map(|(_, r)| r.clone()).ok_or_else(|| {
            Error::invalid(format!(
                "collate=\"stack\" needs field {name:?} in every sample, but sample {:?} has none; \
                 select fields every sample has, or use collate=None",
                self.loc.key
            ))
        })
    }

    /// Copies the sample just read into record `i` of each column of `slot`.
    pub fn place(&mut self, slot: &mut [u8], i: usize) -> Result<()> {
        for (f, &(record, offset)) in self.columns.iter().enumerate() {
            let range = self.payload(f)?;
            if range.len() as u64 != record {
                return Err(Error::invalid(format!(
                    "collate=\"stack\" needs equal-length {:?} within a batch: sample {:?} has {} bytes, \
                     sample {:?} has {record}",
                    self.fields[f],
                    self.loc.key,
                    range.len(),
                    self.first_key
                )));
            }
            let at = usize::try_from(offset + record * i as u64)
                .map_err(|_| Error::Internal("packed column beyond the address space".into()))?;
            let dst = slot
                .get_mut(at..at + range.len())
                .ok_or_else(|| Error::Internal(format!("record {i} of {:?} outside its slot", self.fields[f])))?;
            dst.copy_from_slice(&self.scratch[range]);
        }
        self.keys.push(std::mem::take(&mut self.loc.key));
        Ok(())
    }

    /// Writes the slot header and field descriptors after the last sample; returns the keys and
    /// the payload bytes of the batch.
    pub fn finish(self, slot: &mut [u8], batch_index: u64) -> Result<(Vec<String>, u64)> {
        let n = self.keys.len() as u64;
        let payload: u64 = self.columns.iter().map(|(record, _)| record * n).sum();
        let n_fields =
            u16::try_from(self.fields.len()).map_err(|_| Error::invalid("too many fields for a packed batch"))?;
        let too_small = || Error::Internal("ring slot smaller than its header".into());
        slot.get_mut(..SLOT_HEADER_BYTES)
            .ok_or_else(too_small)?
            .copy_from_slice(&SlotHeader::new(n_fields, batch_index, n, payload).encode());
        for (f, &(record_bytes, offset)) in self.columns.iter().enumerate() {
            let at = SLOT_HEADER_BYTES + f * FIELD_DESC_BYTES;
            let desc = FieldDesc { offset, record_bytes, count: n, reserved: 0 };
            slot.get_mut(at..at + FIELD_DESC_BYTES).ok_or_else(too_small)?.copy_from_slice(&desc.encode());
        }
        Ok((self.keys, payload))
    }
}
