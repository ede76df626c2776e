//! Packed mode (`collate="stack"`): gathers a batch's fields into a ring slot, each field as one
//! column of equal-length records (the slot layout of `shardstream_proto::ring`), so the client
//! gets one `(samples, record_bytes)` array per field over shared memory. This is the one copy of
//! packed mode: shard bytes -> slot; the client reads the slot where it lies.
//!
//! Shards in the node cache are read from a shared read-only mapping (see
//! [`ResidentShard::cached_bytes`]), so the only copy is mapping -> slot; a shard read in place is
//! read with one `pread` per sample into a reused buffer first.
//!
//! The first sample of a batch fixes each field's record length; every other sample must match
//! it, and must have every field: stacking is only defined for such batches, and the error names
//! the sample that breaks the rule rather than padding or truncating behind the user's back.

use shardstream_proto::ring::{COLUMN_ALIGN, FIELD_DESC_BYTES, FieldDesc, SLOT_HEADER_BYTES, SlotHeader, round_up};

use crate::format::shard_error;
use crate::format::tar::parse_sample;
use crate::index::ResidentShard;
use crate::transport::shm::SlotGuard;
use crate::{Error, Result};

/// Bytes of a sample loaded ahead by [`PackedGather::prefetch`]: a TAR header (512 bytes, all
/// read by its checksum) and the first lines of the payload.
const PREFETCH_BYTES: usize = 768;

#[cfg(target_arch = "x86_64")]
fn prefetch_line(byte: &u8) {
    // SAFETY: a prefetch is a hint; it never faults and reads nothing into the program, and the
    // address is that of a live reference. SSE is part of the x86_64 baseline.
    unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>((byte as *const u8).cast()) }
}

#[cfg(not(target_arch = "x86_64"))]
fn prefetch_line(_byte: &u8) {}

/// Gathers one packed batch.
#[derive(Debug)]
pub struct PackedGather {
    fields: Vec<String>,
    samples: usize,
    /// Per field: record bytes (from the first sample) and the column's offset in the slot.
    columns: Vec<(u64, u64)>,
    first_key: String,
    keys: Vec<String>,
    /// Sample bytes of shards read with pread.
    scratch: Vec<u8>,
    /// Per field, the payload range of the current sample in its bytes.
    found: Vec<std::ops::Range<usize>>,
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
            found: Vec::with_capacity(fields.len()),
        }
    }

    /// Asks the CPU to start loading the header (and the first payload lines) of a sample that
    /// will be added soon, from a mapped cached shard. A shuffled batch jumps between shards, so
    /// each sample's header is a cache and TLB miss: measured, the gather stalled on that first
    /// touch more than it spent copying. Loading a few samples ahead overlaps those misses.
    pub fn prefetch(shard: &ResidentShard, local: u64) {
        let Some(all) = shard.cached_bytes() else { return };
        let Some(range) = shard.table.sample_range(local) else { return };
        let Ok(start) = usize::try_from(range.start) else { return };
        let end = usize::try_from(range.end).unwrap_or(usize::MAX).min(all.len()).min(start + PREFETCH_BYTES);
        for line in (start..end).step_by(64) {
            prefetch_line(&all[line]);
        }
    }

    /// Adds sample `local` of `shard` as record `i` of every column. The first sample sizes the
    /// batch and takes a slot through `acquire` (given the bytes the batch needs).
    pub fn add<'s>(
        &mut self,
        shard: &ResidentShard,
        local: u64,
        i: usize,
        slot: &mut Option<SlotGuard<'s>>,
        acquire: &dyn Fn(u64) -> Result<SlotGuard<'s>>,
    ) -> Result<()> {
        let range = shard
            .table
            .sample_range(local)
            .ok_or_else(|| Error::Internal(format!("sample {local} out of range in {}", shard.file.name)))?;
        let mut scratch = std::mem::take(&mut self.scratch);
        let bytes: &[u8] = match shard.cached_bytes() {
            Some(all) => usize::try_from(range.start)
                .ok()
                .zip(usize::try_from(range.end).ok())
                .and_then(|(a, z)| all.get(a..z))
                .ok_or_else(|| Error::Internal(format!("sample {local} outside {}", shard.file.name)))?,
            None => {
                let len = usize::try_from(range.end - range.start)
                    .map_err(|_| Error::Internal("sample larger than the address space".into()))?;
                scratch.resize(len, 0);
                shard.file.read_exact_at(&mut scratch, range.start)?;
                &scratch
            }
        };
        let placed = self.place(shard, range.start, bytes, i, slot, acquire);
        self.scratch = scratch;
        placed
    }

    fn place<'s>(
        &mut self,
        shard: &ResidentShard,
        base: u64,
        bytes: &[u8],
        i: usize,
        slot: &mut Option<SlotGuard<'s>>,
        acquire: &dyn Fn(u64) -> Result<SlotGuard<'s>>,
    ) -> Result<()> {
        let view = parse_sample(bytes).map_err(|e| shard_error(&shard.file, base, e))?;
        self.found.clear();
        for name in &self.fields {
            // A sample has a handful of fields: a linear search beats any map.
            let m = view.members.iter().find(|m| m.field == name.as_str()).ok_or_else(|| {
                Error::invalid(format!(
                    "collate=\"stack\" needs field {name:?} in every sample, but sample {:?} has none; \
                     select fields every sample has, or use collate=None",
                    view.key
                ))
            })?;
            self.found.push(m.data.clone());
        }
        let guard = match slot {
            Some(g) => g,
            None => {
                let need = self.size_columns(&view.key)?;
                slot.insert(acquire(need)?)
            }
        };
        let dst = guard.bytes();
        for (f, (&(record, offset), src)) in self.columns.iter().zip(&self.found).enumerate() {
            if src.len() as u64 != record {
                return Err(Error::invalid(format!(
                    "collate=\"stack\" needs equal-length {:?} within a batch: sample {:?} has {} bytes, \
                     sample {:?} has {record}",
                    self.fields[f],
                    view.key,
                    src.len(),
                    self.first_key
                )));
            }
            let at = usize::try_from(offset + record * i as u64)
                .map_err(|_| Error::Internal("packed column beyond the address space".into()))?;
            dst.get_mut(at..at + src.len())
                .ok_or_else(|| Error::Internal(format!("record {i} of {:?} outside its slot", self.fields[f])))?
                .copy_from_slice(&bytes[src.clone()]);
        }
        self.keys.push(view.key.into_owned());
        Ok(())
    }

    /// Lays the columns out from the record lengths of the batch's first sample (in `found`);
    /// returns the bytes the batch needs in a slot.
    fn size_columns(&mut self, key: &str) -> Result<u64> {
        let mut at = SlotHeader::columns_start(self.fields.len())
            .ok_or_else(|| Error::invalid("too many fields for a packed batch"))?;
        key.clone_into(&mut self.first_key);
        self.columns.clear();
        for src in &self.found {
            let len = src.len() as u64;
            self.columns.push((len, at));
            at = len
                .checked_mul(self.samples as u64)
                .and_then(|b| round_up(b, COLUMN_ALIGN))
                .and_then(|b| at.checked_add(b))
                .ok_or_else(|| Error::invalid("packed batch size overflows"))?;
        }
        Ok(at)
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
