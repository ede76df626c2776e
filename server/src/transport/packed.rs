//! Packed mode (`collate="stack"`): gathers a batch's fields into a ring slot, each field as one
//! column of equal-length records (the slot layout of `shardstream_proto::ring`), so the client
//! gets one `(samples, record_bytes)` array per field over shared memory. This is the one copy of
//! packed mode: shard bytes -> slot; the client reads the slot where it lies.
//!
//! Shards in the node cache are read from a shared read-only mapping (see
//! [`ResidentShard::cached_bytes`]), so the only copy is mapping -> slot; a shard read in place is
//! read with one `pread` per sample into a reused buffer first.
//!
//! A batch is gathered on the thread that builds it. The copy is bound by memory latency per
//! record (each shuffled record is a different page of a different shard), which more threads
//! overlap: a stream builds several batches at once (`service::PACKED_PIPELINE`), so that is where
//! the parallelism comes from. A daemon-wide helper thread that also took part in each batch cost
//! about a tenth more daemon CPU an epoch for no more throughput once builds overlapped (median of
//! 13 A/B runs, bench/PROFILES.md section 3), and went.
//!
//! Where a record's fields lie comes from the layout recorded when its shard was indexed
//! ([`crate::format::tar::layout`]): no TAR header is parsed per record, and each requested
//! field's number in a shard's table is looked up once per run of records from that shard. A
//! shard without a layout (or whose bytes do not match it) is parsed as before.
//!
//! The first sample of a batch fixes each field's record length; every other sample must match
//! it, and must have every field: stacking is only defined for such batches, and the error names
//! the sample that breaks the rule rather than padding or truncating behind the user's back.

use std::ops::Range;
use std::sync::Arc;

use shardstream_proto::keys::JoinedKeys;
use shardstream_proto::ring::{COLUMN_ALIGN, FIELD_DESC_BYTES, FieldDesc, SLOT_HEADER_BYTES, SlotHeader, round_up};

use crate::format::{SampleLocation, ShardTable};
use crate::index::ResidentShard;
use crate::transport::shm::SlotGuard;
use crate::{Error, Result};

/// One sample of a batch: its open shard and its index in the shard.
pub type SampleRef = (Arc<ResidentShard>, u64);

/// A gathered batch, written into the slot of `guard`.
pub struct Gathered<'s> {
    pub guard: SlotGuard<'s>,
    /// The samples' keys in one buffer: a `String` each, made on the gather threads and freed
    /// on the connection's after sending, took malloc's arena lock every time (10% of the
    /// daemon's samples in a packed epoch of 4 KiB records).
    pub keys: JoinedKeys,
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
    // The first sample fixes each column's record length and so the slot size.
    let (first_key, records) = Finder::new(fields)
        .find(first, |_, key, found| Ok((key.to_owned(), found.iter().map(|r| r.len() as u64).collect::<Vec<_>>())))?;
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
    let rules = Rules { fields, records: &records, first_key: &first_key };
    let keys = gather_all(&rules, samples, columns(guard.bytes(), &records, &offsets, n)?)?;
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

/// The slot's columns, one slice per field (`records[f] * n` bytes at `offsets[f]`).
fn columns<'a>(slot: &'a mut [u8], records: &[u64], offsets: &[u64], n: usize) -> Result<Vec<&'a mut [u8]>> {
    let slot_bytes = slot.len();
    let mut out = Vec::with_capacity(records.len());
    let mut rest = slot;
    let mut at = 0u64;
    for (f, (&record, &offset)) in records.iter().zip(offsets).enumerate() {
        let gap = offset.checked_sub(at).and_then(|g| usize::try_from(g).ok());
        let len = usize::try_from(record).ok().and_then(|r| r.checked_mul(n));
        let (gap, len) = match (gap, len) {
            (Some(gap), Some(len)) if gap.checked_add(len).is_some_and(|end| end <= rest.len()) => (gap, len),
            _ => {
                return Err(Error::Internal(format!(
                    "packed column {f} ({n} records of {record} bytes at offset {offset}) overlaps the column \
                     before (which ends at {at}) or lies outside its slot of {slot_bytes} bytes"
                )));
            }
        };
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(gap);
        let (column, tail) = tail.split_at_mut(len);
        rest = tail;
        // Within the slot (checked above), so within u64.
        at = offset + len as u64;
        out.push(column);
    }
    Ok(out)
}

fn too_many_key_bytes() -> Error {
    Error::invalid("a packed batch's keys exceed 4 GiB; use smaller batches")
}

/// Gathers `samples` into `cols` (record j of field f at `cols[f][j * record_f..]`); returns
/// their keys.
fn gather_all(rules: &Rules<'_>, samples: &[SampleRef], mut cols: Vec<&mut [u8]>) -> Result<JoinedKeys> {
    let mut keys = JoinedKeys::with_capacity(samples.len(), rules.first_key.len());
    let mut finder = Finder::new(rules.fields);
    for (j, sample) in samples.iter().enumerate() {
        if let Some((shard, local)) = samples.get(j + 2 * PREFETCH_AHEAD) {
            shard.table.prefetch(*local);
        }
        if let Some(ahead) = samples.get(j + PREFETCH_AHEAD) {
            prefetch(ahead);
        }
        finder.find(sample, |bytes, key, found| {
            for (f, src) in found.iter().enumerate() {
                let record = rules.records[f];
                if src.len() as u64 != record {
                    return Err(Error::invalid(format!(
                        "collate=\"stack\" needs equal-length {:?} within a batch: sample {key:?} has {} bytes, \
                         sample {:?} has {record}",
                        rules.fields[f],
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
            keys.push(key).ok_or_else(too_many_key_bytes)
        })?;
    }
    Ok(keys)
}

/// Records ahead of the one being copied whose first bytes are prefetched (and twice as far
/// ahead, their entries in the shard's table, which that prefetch reads). Each shuffled record
/// lies on other pages of another shard, and its table entries on other lines: the first touch
/// of each was a miss to memory, not work, and the largest cost after the copy itself in the
/// profiles (bench/PROFILES.md, section 3).
const PREFETCH_AHEAD: usize = 4;

/// Starts loading the first cache lines of a record's header and data (mapped shards only),
/// which also fills the TLB for their pages, while earlier records are copied.
fn prefetch((shard, local): &SampleRef) {
    if let (Some(all), Some(range)) = (shard.cached_bytes(), shard.table.sample_range(*local))
        && let Some(head) = usize::try_from(range.start).ok().and_then(|s| all.get(s..))
    {
        crate::cache_hint::prefetch(head);
        if let Some(data) = head.get(512..) {
            crate::cache_hint::prefetch(data);
        }
    }
}

/// Finds the requested fields of one sample after another, reusing its buffers across them.
struct Finder<'a> {
    fields: &'a [String],
    /// The table `numbers` was looked up in (its address; the batch holds it alive), and each
    /// requested field's number in it.
    table: usize,
    numbers: Vec<Option<usize>>,
    scratch: Vec<u8>,
    loc: SampleLocation,
    found: Vec<Range<usize>>,
}

impl<'a> Finder<'a> {
    fn new(fields: &'a [String]) -> Self {
        Finder {
            fields,
            table: 0,
            numbers: Vec::with_capacity(fields.len()),
            scratch: Vec::new(),
            loc: SampleLocation::default(),
            found: Vec::with_capacity(fields.len()),
        }
    }

    /// Reads sample `local` of `shard` (from the shard's mapping if it is cached, else with one
    /// `pread` into a reused buffer), finds its key and the requested fields (from the shard's
    /// layout, else by parsing it), and calls `f` with its bytes, key and the fields' ranges in
    /// the bytes, in the order of the requested fields. An error names a sample that lacks one.
    fn find<T>(
        &mut self,
        (shard, local): &SampleRef,
        f: impl FnOnce(&[u8], &str, &[Range<usize>]) -> Result<T>,
    ) -> Result<T> {
        let Finder { fields, table, numbers, scratch, loc, found } = self;
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
        let this = Arc::as_ptr(&shard.table) as usize;
        if *table != this {
            *table = this;
            let names = shard.table.fields();
            numbers.clear();
            numbers.extend(fields.iter().map(|f| names.iter().position(|n| n == f)));
        }
        if let Some(key) = from_layout(&shard.table, *local, bytes, numbers, found) {
            return f(bytes, key, found);
        }
        shard.table.locate_fields(&shard.file, *local, bytes, 0, loc)?;
        payloads(fields, loc, found)?;
        f(bytes, &loc.key, found)
    }
}

/// Sample `local`'s key and the fields numbered `numbers` (in `found`), from the layout its shard
/// recorded when it was indexed. None when the shard has no layout, a field is missing, or the
/// bytes do not match the layout: the caller then parses the sample, which says what is wrong.
fn from_layout<'b>(
    table: &ShardTable,
    local: u64,
    bytes: &'b [u8],
    numbers: &[Option<usize>],
    found: &mut Vec<Range<usize>>,
) -> Option<&'b str> {
    let key = table.key_at(local).and_then(|r| bytes.get(r)).and_then(|k| std::str::from_utf8(k).ok())?;
    found.clear();
    for &number in numbers {
        let range = table.field_at(local, number?)??;
        if range.end > bytes.len() {
            return None;
        }
        found.push(range);
    }
    Some(key)
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

#[cfg(test)]
mod tests {
    use super::columns;

    #[test]
    fn columns_split_a_slot_at_their_offsets() {
        // Each byte holds its own offset, so a column's first byte says where it was cut.
        let mut slot: [u8; 64] = std::array::from_fn(|i| i as u8);
        let cols = columns(&mut slot, &[4, 2], &[8, 32], 3).expect("columns within the slot");
        assert_eq!(cols.iter().map(|c| c.len()).collect::<Vec<_>>(), [12, 6]);
        assert_eq!(cols.iter().map(|c| c[0]).collect::<Vec<_>>(), [8, 32]);
    }

    #[test]
    fn columns_outside_the_slot_are_an_error_not_a_panic() {
        let mut slot = [0u8; 64];
        // Past the end, overlapping the column before, and sizes that overflow.
        assert!(columns(&mut slot, &[4], &[56], 3).is_err());
        assert!(columns(&mut slot, &[4, 4], &[0, 8], 3).is_err());
        assert!(columns(&mut slot, &[u64::MAX], &[0], 2).is_err());
        assert!(columns(&mut slot, &[1], &[u64::MAX], 1).is_err());
        let err = columns(&mut slot, &[2, 4], &[0, 56], 3).expect_err("past the end").to_string();
        assert!(err.contains("column 1") && err.contains("offset 56") && err.contains("64 bytes"), "{err}");
    }
}
