//! Packed mode (`collate="stack"`): gathers a batch's fields into a ring slot, each field as one
//! column of equal-length records (the slot layout of `shardstream_proto::ring`), so the client
//! gets one `(samples, record_bytes)` array per field over shared memory. This is the one copy of
//! packed mode: shard bytes -> slot; the client reads the slot where it lies.
//!
//! Shards in the node cache are read from a shared read-only mapping (see
//! [`ResidentShard::cached_bytes`]), so the only copy is mapping -> slot; a shard read in place is
//! read with one `pread` per sample into a reused buffer first.
//!
//! A large batch is gathered by [`GATHER_THREADS`] threads, each into its own records of every
//! column: the copy is bound by memory latency per record (each shuffled record is a different
//! page of a different shard), which more threads overlap.
//!
//! The first sample of a batch fixes each field's record length; every other sample must match
//! it, and must have every field: stacking is only defined for such batches, and the error names
//! the sample that breaks the rule rather than padding or truncating behind the user's back.

use std::ops::Range;
use std::sync::Arc;

use shardstream_proto::ring::{COLUMN_ALIGN, FIELD_DESC_BYTES, FieldDesc, SLOT_HEADER_BYTES, SlotHeader, round_up};

use crate::format::SampleLocation;
use crate::index::ResidentShard;
use crate::transport::shm::SlotGuard;
use crate::{Error, Result};

/// Threads that gather one batch (this one and helpers), and the smallest batch worth a helper:
/// measured here, one thread gathers 1 MiB of 4 KiB records in ~300 us, and a helper starts
/// running ~200 us after it is spawned (a waking vCPU), so smaller batches gain nothing.
pub const GATHER_THREADS: usize = 2;
const PARALLEL_MIN_BYTES: u64 = 1 << 20;

/// One sample of a batch: its open shard and its index in the shard.
pub type SampleRef = (Arc<ResidentShard>, u64);

/// A gathered batch, written into the slot of `guard`.
pub struct Gathered<'s> {
    pub guard: SlotGuard<'s>,
    pub keys: Vec<String>,
    pub payload_bytes: u64,
}

/// Gathers `samples` (fields `fields`, in the stream's order) into a slot that `acquire` gives
/// for the bytes the batch needs, and writes the slot header and field descriptors.
pub fn gather<'s>(
    fields: &[String],
    samples: &[SampleRef],
    batch_index: u64,
    acquire: impl FnOnce(u64) -> Result<SlotGuard<'s>>,
) -> Result<Gathered<'s>> {
    let n = samples.len();
    let first = samples.first().ok_or_else(|| Error::Internal("empty batch".into()))?;
    let mut scratch = Vec::new();
    let mut loc = SampleLocation::default();
    let mut found = Vec::with_capacity(fields.len());
    // The first sample fixes each column's record length and so the slot size.
    let (first_key, records) = with_sample(first, &mut scratch, &mut loc, |_, view| {
        payloads(fields, view, &mut found)?;
        Ok((view.key.clone(), found.iter().map(|r| r.len() as u64).collect::<Vec<_>>()))
    })?;
    let mut offsets = Vec::with_capacity(fields.len());
    let mut end = SlotHeader::columns_start(fields.len()).ok_or_else(|| Error::invalid("too many fields"))?;
    for &record in &records {
        offsets.push(end);
        end = record
            .checked_mul(n as u64)
            .and_then(|b| round_up(b, COLUMN_ALIGN))
            .and_then(|b| end.checked_add(b))
            .ok_or_else(|| Error::invalid("packed batch size overflows"))?;
    }
    let payload_bytes: u64 = records.iter().map(|r| r * n as u64).sum();
    let mut guard = acquire(end)?;
    fail_point!("packed-gather", |a| Err(Error::Internal(format!("failpoint packed-gather: {a:?}"))));
    let threads = if payload_bytes >= PARALLEL_MIN_BYTES { GATHER_THREADS.min(n) } else { 1 };
    let rules = Rules { fields, records: &records, first_key: &first_key };
    let keys = {
        let parts = carve(guard.bytes(), &records, &offsets, n, threads)?;
        let bounds: Vec<usize> = (0..=threads).map(|t| t * n / threads).collect();
        std::thread::scope(|scope| {
            let mut handles = Vec::new();
            let mut mine = None;
            for (t, cols) in parts.into_iter().enumerate() {
                let part = &samples[bounds[t]..bounds[t + 1]];
                let rules = &rules;
                if t == 0 {
                    mine = Some((part, cols));
                } else {
                    handles.push(scope.spawn(move || gather_part(rules, part, cols)));
                }
            }
            let mut keys = match mine {
                Some((part, cols)) => gather_part(&rules, part, cols)?,
                None => Vec::new(),
            };
            for h in handles {
                let more = h.join().map_err(|_| Error::Internal("a gather thread panicked".into()))??;
                keys.extend(more);
            }
            Ok::<_, Error>(keys)
        })?
    };
    let n_fields = u16::try_from(fields.len()).map_err(|_| Error::invalid("too many fields for a packed batch"))?;
    let slot = guard.bytes();
    let too_small = || Error::Internal("ring slot smaller than its header".into());
    slot.get_mut(..SLOT_HEADER_BYTES)
        .ok_or_else(too_small)?
        .copy_from_slice(&SlotHeader::new(n_fields, batch_index, n as u64, payload_bytes).encode());
    for (f, (&record_bytes, &offset)) in records.iter().zip(&offsets).enumerate() {
        let at = SLOT_HEADER_BYTES + f * FIELD_DESC_BYTES;
        let desc = FieldDesc { offset, record_bytes, count: n as u64, reserved: 0 };
        slot.get_mut(at..at + FIELD_DESC_BYTES).ok_or_else(too_small)?.copy_from_slice(&desc.encode());
    }
    Ok(Gathered { guard, keys, payload_bytes })
}

/// What every record of the batch must match.
struct Rules<'a> {
    fields: &'a [String],
    records: &'a [u64],
    first_key: &'a str,
}

/// Splits the slot's columns into `parts` runs of records: part t gets records
/// `[t*n/parts, (t+1)*n/parts)` of every column, as one slice per field.
fn carve<'a>(
    slot: &'a mut [u8],
    records: &[u64],
    offsets: &[u64],
    n: usize,
    parts: usize,
) -> Result<Vec<Vec<&'a mut [u8]>>> {
    let outside = || Error::Internal("packed columns outside their slot".into());
    let mut out: Vec<Vec<&mut [u8]>> = (0..parts).map(|_| Vec::with_capacity(records.len())).collect();
    let mut rest = slot;
    let mut at = 0u64;
    for (&record, &offset) in records.iter().zip(offsets) {
        let gap = usize::try_from(offset.checked_sub(at).ok_or_else(outside)?).map_err(|_| outside())?;
        let record = usize::try_from(record).map_err(|_| outside())?;
        let len = record.checked_mul(n).ok_or_else(outside)?;
        if rest.len() < gap + len {
            return Err(outside());
        }
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(gap);
        let (mut column, tail) = tail.split_at_mut(len);
        rest = tail;
        at = offset + len as u64;
        for (t, part) in out.iter_mut().enumerate() {
            let count = (t + 1) * n / parts - t * n / parts;
            let (mine, others) = std::mem::take(&mut column).split_at_mut(count * record);
            part.push(mine);
            column = others;
        }
    }
    Ok(out)
}

/// Gathers `samples` into `cols` (record j of field f at `cols[f][j * record_f..]`); returns
/// their keys.
fn gather_part(rules: &Rules<'_>, samples: &[SampleRef], mut cols: Vec<&mut [u8]>) -> Result<Vec<String>> {
    let mut keys = Vec::with_capacity(samples.len());
    let mut scratch = Vec::new();
    let mut loc = SampleLocation::default();
    let mut found = Vec::with_capacity(rules.fields.len());
    for (j, sample) in samples.iter().enumerate() {
        let key = with_sample(sample, &mut scratch, &mut loc, |bytes, view| {
            payloads(rules.fields, view, &mut found)?;
            for (f, src) in found.iter().enumerate() {
                let record = rules.records[f];
                if src.len() as u64 != record {
                    return Err(Error::invalid(format!(
                        "collate=\"stack\" needs equal-length {:?} within a batch: sample {:?} has {} bytes, \
                         sample {:?} has {record}",
                        rules.fields[f],
                        view.key,
                        src.len(),
                        rules.first_key
                    )));
                }
                let at = j * src.len();
                cols[f]
                    .get_mut(at..at + src.len())
                    .ok_or_else(|| Error::Internal(format!("record {j} of {:?} outside its slot", rules.fields[f])))?
                    .copy_from_slice(&bytes[src.clone()]);
            }
            Ok(view.key.clone())
        })?;
        keys.push(key);
    }
    Ok(keys)
}

/// Reads sample `local` of `shard` (from the shard's mapping if it is cached, else with one
/// `pread` into `scratch`), has its format locate the fields (into `loc`, reused across samples),
/// and calls `f` with its bytes and their location.
fn with_sample<T>(
    (shard, local): &SampleRef,
    scratch: &mut Vec<u8>,
    loc: &mut SampleLocation,
    f: impl FnOnce(&[u8], &SampleLocation) -> Result<T>,
) -> Result<T> {
    let range = shard
        .table
        .sample_range(*local)
        .ok_or_else(|| Error::Internal(format!("sample {local} out of range in {}", shard.file.name)))?;
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
            shard.file.read_exact_at(scratch, range.start)?;
            scratch
        }
    };
    shard.table.locate_fields(&shard.file, *local, bytes, 0, loc)?;
    f(bytes, loc)
}

/// The payload range of each of `fields` in the sample, into `found`; an error naming the sample
/// if it lacks one.
fn payloads(fields: &[String], view: &SampleLocation, found: &mut Vec<Range<usize>>) -> Result<()> {
    found.clear();
    for name in fields {
        let range = view.field(name).ok_or_else(|| {
            Error::invalid(format!(
                "collate=\"stack\" needs field {name:?} in every sample, but sample {:?} has none; \
                 select fields every sample has, or use collate=None",
                view.key
            ))
        })?;
        found.push(range);
    }
    Ok(())
}
