//! One batch of a TAR (WebDataset) stream, for each transport: read into an inline message
//! (split over several when it outgrows one), read into the client's rdma ring, described for a
//! shm client that maps the shards itself, or gathered into a ring slot (packed, `collate="stack"`).

use std::collections::hash_map::Entry;
use std::sync::Arc;

use foldhash::HashMap;

use shardstream_proto::{FieldColumn, InlineBatch, PackedBatch, RdmaBatch, ShmBatch, StreamMessage, stream_message};

use super::stream_plan::oversized_sample;
use crate::index::{CacheMode, Dataset, LargestSample, Working};
use crate::storage::append::{Append, Fixed};
use crate::transport::inline::{self, InlineBatchBuilder};
use crate::transport::shm::Session;
use crate::transport::{self, packed};
use crate::{Error, Result};

/// The open shard and local index of sample `id`. Consecutive samples of a batch mostly come from
/// the same few shards (the shuffle window): `current` remembers the last shard used, to skip the
/// working set's lookup.
pub(super) fn sample_of(
    ds: &Dataset,
    working: &mut Working,
    id: u64,
    current: &mut Option<(usize, Arc<crate::index::ResidentShard>)>,
) -> Result<(Arc<crate::index::ResidentShard>, u64)> {
    let (shard, local) = ds.locate(id).ok_or_else(|| Error::Internal(format!("sample id {id} out of range")))?;
    match current {
        Some((s, r)) if *s == shard => Ok((r.clone(), local)),
        _ => {
            let r = working.get(ds, shard)?.clone();
            *current = Some((shard, r.clone()));
            Ok((r, local))
        }
    }
}

/// The shards read in place (a local dataset's, `cache="direct"`) that a batch's samples were
/// read from, each once: [`Self::check`]ed after the reads and before the batch goes out, so a
/// shard rewritten in place while a stream uses it is a `ShardError`, never samples of another
/// file at the indexed offsets ([`crate::storage::local::ShardFile::check_unchanged`]).
/// Node-cache copies never change and are not kept.
#[derive(Default)]
pub(super) struct ReadInPlace(Vec<Arc<crate::index::ResidentShard>>);

impl ReadInPlace {
    pub(super) fn note(&mut self, r: &Arc<crate::index::ResidentShard>) {
        // A batch draws on the shuffle window's few shards: a short list, the last one first.
        if r.cache_copy().is_some() || self.0.iter().rev().any(|seen| Arc::ptr_eq(seen, r)) {
            return;
        }
        self.0.push(r.clone());
    }

    /// Checks every shard noted since the last check, and forgets them.
    pub(super) fn check(&mut self, ds: &Dataset) -> Result<()> {
        self.0.drain(..).try_for_each(|r| ds.check_in_place(&r))
    }
}

/// Reads the samples `ids` into `b`, in order, and returns the shards read in place among theirs.
/// Before each sample is read, a sample whose stored bytes exceed `limit` is refused by name
/// (`too_large` says what it is larger than), then `before(b, i, region, reads)` sees the builder,
/// the sample's place in `ids`, its stored bytes and the shards read in place so far: to end a
/// part and start the next (checking `reads` first), or to refuse a batch that outgrows its
/// buffer. The caller checks what is returned before the batch goes out.
fn gather<B: Append>(
    ds: &Dataset,
    working: &mut Working,
    ids: &[u64],
    b: &mut InlineBatchBuilder<B>,
    limit: u64,
    too_large: &dyn Fn() -> String,
    mut before: impl FnMut(&mut InlineBatchBuilder<B>, usize, u64, &mut ReadInPlace) -> Result<()>,
) -> Result<ReadInPlace> {
    let mut current = None;
    let mut reads = ReadInPlace::default();
    for (i, &id) in ids.iter().enumerate() {
        let (resident, local) = sample_of(ds, working, id, &mut current)?;
        // The region the sample's read appends (its TAR members).
        let range = resident.table.sample_range(local).unwrap_or_default();
        let region = range.end.saturating_sub(range.start);
        // The open-time check knows only the samples the manifest or the scan described (an older
        // manifest records none): refuse an oversized one by name before reading its bytes.
        if region > limit
            && let Some((shard, _)) = &current
        {
            let l = LargestSample { shard: *shard, local, offset: Some(range.start), bytes: region };
            return Err(oversized_sample(ds, l, &too_large()));
        }
        before(b, i, region, &mut reads)?;
        b.add_sample(&resident, local)?;
        reads.note(&resident);
    }
    Ok(reads)
}

/// Reads one batch (blocking): one message, or several when the batch's bytes exceed
/// [`inline::payload_limit`] (each part a run of whole samples; `InlineBatch.more` on all but the
/// last). Each full part goes to `send_part` as soon as it is made, so a stream holds at most one
/// part while it reads the next, whatever the batch's size (a batch of 65,536 samples of 1 MiB
/// would otherwise be 64 GiB of the daemon's memory before its first byte is sent); `send_part`
/// answers false when the client is gone. Returns the last part, and the batch's payload bytes and
/// samples over every part.
pub(super) fn build_batch(
    ds: &Dataset,
    working: &mut Working,
    fields: &[String],
    all_fields: bool,
    ids: &[u64],
    index: u64,
    send_part: &mut dyn FnMut(StreamMessage) -> bool,
) -> Result<(StreamMessage, u64)> {
    let limit = inline::payload_limit();
    let avg = ds.total_bytes().checked_div(ds.num_samples()).unwrap_or(0) as usize;
    let capacity = |n: usize| avg.saturating_mul(n).saturating_add(4096).min(limit as usize);
    working.preload(ds, ids)?;
    let mut b = InlineBatchBuilder::new(fields, all_fields, ids.len(), capacity(ids.len()));
    let mut bytes = 0;
    let too_large = || format!("the inline message limit of {}", inline::limit_text());
    let message = |p: InlineBatch| StreamMessage { kind: Some(stream_message::Kind::InlineBatch(p)) };
    let mut reads = gather(ds, working, ids, &mut b, limit, &too_large, |b, i, region, reads| {
        if !b.is_empty() && b.data_len() as u64 + region > limit {
            reads.check(ds)?;
            let left = ids.len() - i;
            let full = std::mem::replace(b, InlineBatchBuilder::new(fields, all_fields, left, capacity(left)));
            bytes += full.payload_bytes();
            if !send_part(message(full.finish(index, true))) {
                return Err(Error::ClientGone("stream cancelled".into()));
            }
        }
        Ok(())
    })?;
    reads.check(ds)?;
    bytes += b.payload_bytes();
    Ok((message(b.finish(index, false)), bytes))
}

/// Reserves a staging buffer of the stream's rdma sender for batch `index` (blocking: waits for
/// a credit for as long as the stream is not `cancelled`, as the other transports do: a trainer
/// holding its batches through an evaluation or a checkpoint is still there), lets `fill` write
/// the batch at its start, returning its length and whatever else it made, and posts the RDMA
/// write of those bytes into a slot of the client's ring (waiting for room in the provider's
/// queue on the same terms: a client that left or a shutdown ends the wait at once). Returns the slot and what `fill` made.
/// The sender is held only to reserve and to post, so its progress thread keeps earlier writes
/// moving while `fill` runs; a `fill` that fails gives the buffer and the credit back.
pub(super) fn rdma_post<T>(
    rdma: &transport::rdma::RdmaPipe,
    index: u64,
    cancelled: &dyn Fn() -> bool,
    fill: impl FnOnce(&mut [u8]) -> Result<(usize, T)>,
) -> Result<(u32, usize, T)> {
    let failed = |e: shardstream_fabric::stream::StreamError| match e {
        shardstream_fabric::stream::StreamError::Stopped => Error::ClientGone("stream cancelled".into()),
        e => Error::Unavailable(format!("rdma stream to the client failed: {e}")),
    };
    let waiting = || !cancelled();
    let mut staged = rdma.lock()?.sender.reserve_while(index, &waiting).map_err(failed)?;
    let filled = fill(staged.buffer());
    let mut r = rdma.lock()?;
    let (len, made) = match filled {
        Ok(f) => f,
        Err(e) => {
            r.sender.cancel(staged);
            return Err(e);
        }
    };
    // Posted, not waited for: the metadata may overtake the bytes (the client joins the two in
    // either order) and the progress thread moves the write while the next batch is read.
    let slot = r.sender.post_while(staged, len, &waiting).map_err(failed)?;
    Ok((slot, len, made))
}

/// Reads one batch straight into a staging buffer of the stream's rdma sender (registered
/// memory, laid out as an inline batch's `data`), posts it ([`rdma_post`]) and describes it as
/// an `RdmaBatch`.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_rdma_batch(
    ds: &Dataset,
    working: &mut Working,
    fields: &[String],
    all_fields: bool,
    ids: &[u64],
    index: u64,
    rdma: &transport::rdma::RdmaPipe,
    cancelled: &dyn Fn() -> bool,
) -> Result<(StreamMessage, u64)> {
    working.preload(ds, ids)?;
    let (slot, len, (bytes, keys, columns)) = rdma_post(rdma, index, cancelled, |buf| {
        let slot_bytes = buf.len() as u64;
        let mut b = InlineBatchBuilder::with_buffer(fields, all_fields, ids.len(), Fixed::new(buf));
        let too_large = || format!("the client's rdma ring slots of {slot_bytes} bytes (SHARDSTREAM_RDMA_SLOT_BYTES)");
        let mut reads = gather(ds, working, ids, &mut b, slot_bytes, &too_large, |b, _, region, _| {
            if b.data_len() as u64 + region > slot_bytes {
                return Err(Error::invalid(format!(
                    "transport \"rdma\": batch {index} of {} samples outgrows the client's {slot_bytes}-byte ring \
                     slots (its samples are larger than the dataset's average); raise SHARDSTREAM_RDMA_SLOT_BYTES \
                     or lower batch_size",
                    ids.len()
                )));
            }
            Ok(())
        })?;
        // Before the write is posted: the client never sees the batch.
        reads.check(ds)?;
        let bytes = b.payload_bytes();
        let (keys, columns, len) = b.into_parts();
        Ok((len, (bytes, keys, columns)))
    })?;
    let batch = RdmaBatch { batch_index: index, slot, keys, fields: columns, data_bytes: len as u64 };
    Ok((StreamMessage { kind: Some(stream_message::Kind::RdmaBatch(batch)) }, bytes))
}

/// Describes one batch for a shm client (blocking: may wait for the client's credits). No sample
/// byte is read: the client parses the samples in its own mapping.
pub(super) fn build_shm_batch(
    ds: &Dataset,
    working: &mut Working,
    session: &Session,
    fields: &[String],
    ids: &[u64],
    index: u64,
    cancelled: &dyn Fn() -> bool,
) -> Result<(StreamMessage, u64)> {
    session.wait_ready(cancelled)?;
    working.preload(ds, ids)?;
    let mut b = ShmBatch {
        batch_index: index,
        slots: Vec::with_capacity(ids.len()),
        starts: Vec::with_capacity(ids.len()),
        lengths: Vec::with_capacity(ids.len()),
        ..Default::default()
    };
    let mut located = Located::new(fields, ids.len());
    // The batch's shards, by shard index: a shuffled batch switches shard at almost every sample,
    // so the session (a lock and a path lookup) is asked once per shard, not once per sample.
    // foldhash rather than std's SipHash, here and in the working set and the shm session: hashing
    // shard numbers and segment paths was ~18% of the daemon's view-mode CPU (bench/PROFILES.md,
    // section 4). The keys are the daemon's own, so a keyed hash buys nothing.
    let mut shards: HashMap<usize, (u32, Arc<crate::index::ResidentShard>)> = HashMap::default();
    let mut bytes = 0u64;
    for &id in ids {
        let (shard, local) = ds.locate(id).ok_or_else(|| Error::Internal(format!("sample id {id} out of range")))?;
        let (slot, resident) = match shards.entry(shard) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let r = working.get(ds, shard)?.clone();
                // A shard read in place may be truncated by others while the client holds it:
                // the client then reads it rather than maps it (SIGBUS otherwise).
                let mutable = ds.mode == CacheMode::Direct
                    && matches!(ds.shards.get(shard).map(|m| &m.source), Some(crate::storage::ShardSource::Local(_)));
                let in_place = mutable.then_some(r.file.mtime_ns);
                let slot = session.slot_for(&r.file.path, &r.file.file, r.file.len, in_place)?;
                e.insert((slot, r))
            }
        };
        let slot = *slot;
        let range = resident.table.sample_range(local).ok_or_else(|| {
            Error::Internal(format!("sample {local} out of range in {}", resident.file.path.display()))
        })?;
        b.slots.push(slot);
        b.starts.push(range.start);
        b.lengths.push(range.end - range.start);
        bytes += range.end - range.start;
        located.add(&resident.table, shard, local);
    }
    // The client reads the shards read in place itself and checks them after its reads; this
    // check refuses to describe a batch of a shard known changed, and marks the dataset changed
    // (the next open lists it again) even when the client's check came first.
    for (_, r) in shards.values() {
        ds.check_in_place(r)?;
    }
    // The metric's payload bytes, as inline batches count them; a batch with a shard indexed
    // before layouts existed counts its samples' stored bytes.
    let bytes = located.payload.filter(|_| located.ok).unwrap_or(bytes);
    located.finish(&mut b);
    session.lease(index, shards.into_values().map(|(_, r)| r.file.path.clone()).collect());
    Ok((StreamMessage { kind: Some(stream_message::Kind::ShmBatch(b)) }, bytes))
}

/// The per-sample key and field locations of a shm batch (`ShmBatch.key_offsets` and
/// `fields`), from the member tables' layouts: a client that gets them parses no TAR header. A
/// batch with any sample of a shard without a layout carries none (the client parses them all).
struct Located<'a> {
    fields: &'a [String],
    ok: bool,
    key_offsets: Vec<u32>,
    key_lengths: Vec<u32>,
    columns: Vec<FieldColumn>,
    /// The shard field index of each stream field, for the shard last seen (a lookup by name per
    /// shard switch, not per sample and field).
    map: (Option<usize>, Vec<Option<usize>>),
    /// Payload bytes of the fields the client gets (all of them without a selection); counts
    /// only while `ok`.
    payload: Option<u64>,
}

impl<'a> Located<'a> {
    fn new(fields: &'a [String], n: usize) -> Self {
        let column = |name: &String| FieldColumn {
            name: name.clone(),
            starts: Vec::with_capacity(n),
            lengths: Vec::with_capacity(n),
            missing: Vec::new(),
        };
        Self {
            fields,
            ok: true,
            key_offsets: Vec::with_capacity(n),
            key_lengths: Vec::with_capacity(n),
            columns: fields.iter().map(column).collect(),
            map: (None, Vec::new()),
            payload: Some(0),
        }
    }

    fn add(&mut self, table: &crate::format::ShardTable, shard: usize, local: u64) {
        if !self.ok {
            return;
        }
        if self.fields.is_empty() {
            let all = (0..table.fields().len()).map(|f| table.field_at(local, f).map(|r| r.map_or(0, |r| r.len())));
            self.payload = self.payload.zip(all.sum::<Option<usize>>()).map(|(p, n)| p + n as u64);
        }
        if self.map.0 != Some(shard) {
            let names = table.fields();
            self.map = (Some(shard), self.fields.iter().map(|f| names.iter().position(|n| n == f)).collect());
        }
        let i = self.key_offsets.len() as u32;
        let to_u32 = |r: &std::ops::Range<usize>| Some((u32::try_from(r.start).ok()?, u32::try_from(r.len()).ok()?));
        let Some((ko, kl)) = table.key_at(local).as_ref().and_then(to_u32) else {
            self.ok = false;
            return;
        };
        self.key_offsets.push(ko);
        self.key_lengths.push(kl);
        for (col, f) in self.columns.iter_mut().zip(&self.map.1) {
            let at = match f {
                Some(f) => match table.field_at(local, *f) {
                    Some(at) => at,
                    None => {
                        self.ok = false;
                        return;
                    }
                },
                None => None,
            };
            match at {
                Some(r) => {
                    col.starts.push(r.start as u64);
                    col.lengths.push(r.len() as u64);
                    if let Some(p) = &mut self.payload {
                        *p += r.len() as u64;
                    }
                }
                None => {
                    col.starts.push(0);
                    col.lengths.push(0);
                    col.missing.push(i);
                }
            }
        }
    }

    fn finish(self, b: &mut ShmBatch) {
        if self.ok && self.key_offsets.len() == b.slots.len() {
            b.key_offsets = self.key_offsets;
            b.key_lengths = self.key_lengths;
            b.fields = self.columns;
        }
    }
}

/// Gathers one batch into a ring slot for a packed shm client (blocking), with the `credit` its
/// turn took ([`Session::take_turn`]). The stream's working set is locked only to find the
/// samples' shards, so the next batch can be gathered meanwhile. `joined_keys`: the client reads
/// keys from `PackedBatch.key_bytes` / `key_ends` (`StreamRequest.packed_keys_joined`).
#[allow(clippy::too_many_arguments)]
pub(super) fn build_packed_batch<'s>(
    ds: &Dataset,
    working: &std::sync::Mutex<Working>,
    session: &'s Session,
    credit: transport::shm::Credit<'s>,
    fields: &[String],
    ids: &[u64],
    index: u64,
    joined_keys: bool,
    cancelled: &dyn Fn() -> bool,
) -> Result<((StreamMessage, u64), std::time::Duration)> {
    let (samples, waited) = {
        let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
        working.preload(ds, ids)?;
        let mut current = None;
        let samples = ids.iter().map(|&id| sample_of(ds, &mut working, id, &mut current)).collect::<Result<Vec<_>>>();
        working.end_batch();
        (samples?, working.take_wait())
    };
    let g = packed::gather(fields, &samples, index, |need| session.acquire_slot(credit, need, cancelled))?;
    // Before the slot is published (an unpublished slot goes back to the ring).
    let mut reads = ReadInPlace::default();
    samples.iter().for_each(|(r, _)| reads.note(r));
    reads.check(ds)?;
    let mut batch =
        PackedBatch { batch_index: index, ring: g.guard.ring(), slot: g.guard.slot(), ..Default::default() };
    if joined_keys {
        batch.key_bytes = g.keys.bytes.into();
        batch.key_ends = g.keys.ends;
    } else {
        batch.keys = g.keys.to_strings();
    }
    let payload = g.payload_bytes;
    g.guard.publish(index);
    Ok(((StreamMessage { kind: Some(stream_message::Kind::PackedBatch(batch)) }, payload), waited))
}
