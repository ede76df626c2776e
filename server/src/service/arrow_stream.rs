//! Arrow batches of a Parquet stream: one batch decoded and written for its transport
//! ([`build_arrow_batch`]), and the loop that serves streams of small batches on one thread
//! ([`SmallArrowStream`]).

use std::sync::Arc;
use std::time::Instant;

use shardstream_proto::{ArrowBatch, StreamMessage, stream_message};

use super::batches::rdma_post;
use super::stream_core::StreamCore;
use super::{IDS_AHEAD, MESSAGE_ROWS_BYTES, ReadyBatch, SMALL_GROUP, ids_of, next_ranges, outbox, projected};
use crate::format::parquet::dataset::BatchAssembler;
use crate::index::{Dataset, Working};
use crate::transport::arrow::Inline;
use crate::transport::shm::Session;
use crate::transport::{self, inline};
use crate::{Error, Result};

/// Reads a Parquet dataset's files through a stream's working set (opened, verified against the
/// manifest's CRC and pinned on first use, like TAR shards).
struct WorkingFiles<'a> {
    ds: &'a Dataset,
    working: std::sync::Mutex<&'a mut Working>,
}

impl crate::format::parquet::dataset::FileReader for WorkingFiles<'_> {
    fn read_bytes(&self, file: usize, offset: u64, len: usize) -> Result<bytes::Bytes> {
        let mut working = self.working.lock().unwrap_or_else(|p| p.into_inner());
        let r = working.get(self.ds, file)?;
        let bytes = crate::format::parquet::dataset::read_recycled(&r.file, len, offset)?;
        // A file rewritten in place since it was opened: refused before its bytes are decoded
        // (and kept decoded for other streams).
        self.ds.check_in_place(r)?;
        Ok(bytes)
    }

    fn cached_copy(&self, file: usize, _rg: usize) -> Result<Option<crate::format::parquet::dataset::CachedCopy>> {
        let mut working = self.working.lock().unwrap_or_else(|p| p.into_inner());
        let Some(copy) = working.get(self.ds, file)?.cache_copy() else { return Ok(None) };
        let dup = copy.file.try_clone().map_err(|e| Error::io("cannot open a node-cache copy", &copy.path, e))?;
        let copy = crate::format::parquet::dataset::CachedCopy::new(dup, None)
            .map_err(|e| Error::io("cannot stat a node-cache copy", &copy.path, e))?;
        Ok(Some(copy))
    }

    fn fetch_again(
        &self,
        file: usize,
        rg: usize,
        why: &str,
    ) -> Result<Option<crate::format::parquet::dataset::CachedCopy>> {
        let (Some(key), Some(cache)) = (self.ds.cache_key(file), self.ds.node_cache()) else { return Ok(None) };
        // This stream's hold goes first: the cache drops no copy anyone holds.
        self.working.lock().unwrap_or_else(|p| p.into_inner()).forget(file);
        if cache.drop_copy(key, &format!("row group {rg} does not decode: {why}")) {
            return self.cached_copy(file, rg);
        }
        // Held by another stream: a copy of this read's own, and the cached one dropped at a
        // later read that finds it bad.
        let url = self.ds.shards.get(file).map(|m| m.url()).unwrap_or_default();
        tracing::warn!(shard = %url, row_group = rg, error = %why, "a node-cache copy does not decode and is in use: fetching it again apart");
        let Some(apart) = self.ds.fetch_whole_apart(file)? else { return Ok(None) };
        let apart = crate::format::parquet::dataset::CachedCopy::new(apart, None)
            .map_err(|e| Error::Internal(format!("{url}: cannot stat a copy fetched apart: {e}")))?;
        Ok(Some(apart))
    }
}

/// Column-chunk copies of one batch fetched at once (each with its own concurrent GETs, within
/// the store's daemon-wide cap): the files (or row groups) of a default shuffle window.
const PROJECTED_COPIES_AT_ONCE: usize = 16;

/// One Arrow batch built: its messages (one, or the parts of a split inline batch) and their
/// bytes, and how long its build waited for storage.
pub(super) type BuiltArrow = ((Vec<StreamMessage>, u64), std::time::Duration);

/// Builds one Arrow batch of a Parquet dataset (blocking): the rows `ids`, decoded through the
/// daemon's shared row-group cache, as an IPC stream inline, in a ring slot (shm), or written
/// into a slot of the client's ring (rdma). Inline, a batch beyond one message is several
/// messages when the client joins them (`split_inline`), else an error. `None`: the rows of
/// several batches (`parts`) outgrow the client's rdma ring slot; nothing was sent, and fewer
/// batches may fit.
#[allow(clippy::too_many_arguments)]
pub(super) fn build_arrow_batch(
    ds: &Dataset,
    working: &std::sync::Mutex<Working>,
    session: Option<&Session>,
    rdma: Option<&transport::rdma::RdmaPipe>,
    turn: u64,
    asm: &BatchAssembler,
    projected: Option<&projected::ProjectedReads>,
    ids: Vec<u64>,
    index: u64,
    parts: &[(u64, u32)],
    split_inline: bool,
    cancelled: &dyn Fn() -> bool,
    before_new_ring: &mut dyn FnMut() -> Result<()>,
) -> Result<Option<BuiltArrow>> {
    // The turn first: shm batches are published in order.
    let credit = session.map(|s| s.take_turn(turn, cancelled)).transpose()?;
    let places = asm.places(&ids)?;
    let (rows, waited) = if let Some(pr) = projected {
        // Only the selected column chunks: no whole file is opened. Every file the batch draws
        // on is verified first (its footer, once): the copies not yet cached, or of files not
        // yet verified, are fetched and verified here, all at once (one file after the other, a
        // first batch over the 4-8 files of a shuffle window waited a round trip per footer and
        // per chunk); the others were verified before.
        let started = Instant::now();
        let ended = working.lock().unwrap_or_else(|p| p.into_inner()).ended();
        let reader = pr.reader(ended);
        // Not the copies of row groups decoded already: a copy evicted since would be fetched
        // again only to be pinned. Their files' footers were checked before they were decoded;
        // a row group that leaves memory meanwhile is fetched by the decoder (`cached_copy`).
        let undecoded: Vec<usize> = places.units.iter().copied().filter(|&u| !asm.is_decoded(u)).collect();
        let copies = pr.copies_of_units(&undecoded);
        let unverified = |c: usize| pr.shard_of(c).is_some_and(|s| !ds.footer_verified(s));
        let cold: Vec<usize> = copies.into_iter().filter(|&c| !pr.copy_ready(c) || unverified(c)).collect();
        // The copy first: a copy fetched now checks its footer from its own GETs (see
        // `Dataset::fetch_projected`), and the check after it is then a no-op.
        let check_and_open = |&c: &usize| {
            reader.open_copy(c)?;
            pr.shard_of(c).map_or(Ok(()), |s| ds.verify_remote_footer(s))
        };
        let opened = if cold.len() > 1 {
            crate::parallel::try_map(&cold, cold.len().min(PROJECTED_COPIES_AT_ONCE), check_and_open).map(drop)
        } else {
            cold.iter().try_for_each(check_and_open)
        };
        let fetch_failed = opened.is_err();
        let rows = opened.and_then(|()| asm.rows_at(places, &ids, &reader));
        let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
        // A fetch that failed was waited for too: the stream counts it as it ends.
        if reader.fetched() || fetch_failed {
            working.add_wait(started.elapsed());
        }
        (rows?, working.take_wait())
    } else {
        // One row id per file the batch draws on, from the row groups it draws on (not per row).
        let touched = asm.first_row_per_file(&places);
        let mut working = working.lock().unwrap_or_else(|p| p.into_inner());
        working.preload(ds, &touched)?;
        // Every file the batch draws on is opened (and verified against the manifest) even when
        // its row groups are already decoded: a decoded row group never stands in for a check.
        for &id in &touched {
            if let Some((shard, _)) = ds.locate(id) {
                working.get(ds, shard)?;
            }
        }
        let rows = asm.rows_at(places, &ids, &WorkingFiles { ds, working: std::sync::Mutex::new(&mut working) });
        working.end_batch();
        (rows?, working.take_wait())
    };
    let mut msgs = match (session, credit) {
        (None, _) if let Some(pipe) = rdma => {
            // Batches are grouped by their stored size, which says little of their decoded size
            // (a column of repeated values stores a byte a row): a group that outgrows the slot
            // each of its batches fits is given back, unsent, to go as fewer.
            let outgrew = std::cell::Cell::new(false);
            let posted =
                rdma_post(pipe, index, cancelled, |buf| match transport::arrow::write_rows(asm, &rows, buf)? {
                    transport::arrow::Written::Bytes(n) => Ok((n, ())),
                    transport::arrow::Written::Outgrows(need) => {
                        outgrew.set(parts.len() > 1);
                        Err(transport::arrow::outgrows_slot(need, buf.len()))
                    }
                });
            let (slot, length, ()) = match posted {
                Err(_) if outgrew.get() => return Ok(None),
                posted => posted?,
            };
            vec![ArrowBatch { batch_index: index, row_ids: ids, slot, length: length as u64, ..Default::default() }]
        }
        (Some(s), Some(credit)) => {
            let view_slots = if asm.binary_views() { segment_slots(s, &rows, index)? } else { Vec::new() };
            let (guard, mut msg) = transport::arrow::shm_rows(index, ids, asm, &rows, |need| {
                if s.needs_ring(need) {
                    before_new_ring()?;
                }
                s.acquire_slot(credit, need, cancelled)
            })?;
            guard.publish(index);
            msg.view_slots = view_slots;
            vec![msg]
        }
        _ => {
            let count = ids.len() as u64;
            match transport::arrow::inline_rows(index, ids, asm, &rows, inline::payload_limit(), split_inline)? {
                Inline::Sent(msgs) => msgs,
                Inline::RowTooLarge { row, bytes } => return Err(row_beyond_inline(ds, row, bytes)),
                Inline::BatchTooLarge { bytes } => return Err(batch_beyond_inline(count, bytes)),
            }
        }
    };
    if let ([msg], true) = (&mut msgs[..], parts.len() > 1) {
        (msg.part_indices, msg.part_rows) = parts.iter().copied().unzip();
    }
    // The IPC streams' length: what crosses to the client, shm or inline.
    let bytes = msgs.iter().map(|m| m.length).sum();
    let msgs = msgs.into_iter().map(|m| StreamMessage { kind: Some(stream_message::Kind::ArrowBatch(m)) }).collect();
    Ok(Some(((msgs, bytes), waited)))
}

/// The error for row `id`, `bytes` long as Arrow by itself, beyond any inline message.
fn row_beyond_inline(ds: &Dataset, id: u64, bytes: u64) -> Error {
    let (file, row) = ds.locate(id).map_or_else(
        || (format!("row id {id}"), id),
        |(s, row)| (ds.shards.get(s).map_or_else(|| format!("#{s}"), |m| m.url()), row),
    );
    Error::invalid(format!(
        "row {row} of {file} is {bytes} bytes as Arrow, larger than the inline message limit of {}; read it \
         over {INLINE_WAY_OUT}",
        inline::limit_text()
    ))
}

/// The other ways to read a row too large for inline messages.
const INLINE_WAY_OUT: &str = "transport=\"shm\" (same host) or select fewer fields";

/// The error for a batch of `count` rows, `bytes` long as Arrow, beyond an inline message, for a
/// client that joins no parts (one older than `StreamRequest.arrow_parts_joined`): the batch size
/// that fits at its bytes per row (with a tenth to spare).
fn batch_beyond_inline(count: u64, bytes: u64) -> Error {
    let fits = (u128::from(inline::payload_limit()) * u128::from(count) / u128::from(bytes.max(1)) * 9 / 10).max(1);
    Error::invalid(format!(
        "a batch of {count} rows is {bytes} bytes as Arrow, larger than the inline message limit of {} (this \
         client reads a Parquet batch as one message); a batch_size of at most {fits} fits these rows; or \
         upgrade the shardstream client, which joins a batch sent as several messages, or read over \
         {INLINE_WAY_OUT}",
        inline::limit_text()
    ))
}

/// What [`build_arrow_batch`] built of a single batch, which it never gives back unsent.
pub(super) fn one_batch_sent<T>(built: Option<T>) -> Result<T> {
    built.ok_or_else(|| Error::Internal("a single Arrow batch came back unsent".into()))
}

/// The slots of the arenas the batch's sources keep their binary values in, one per source in
/// source order (a view's buffer index names its source), each sent to the client the first time
/// (see [`crate::format::parquet::arena`]). The batch leases them until the client releases it;
/// arenas the daemon let go of since the last batch are forgotten first.
fn segment_slots(session: &Session, rows: &crate::format::parquet::dataset::BatchRows, index: u64) -> Result<Vec<u32>> {
    session.sweep_segments();
    let mut slots = Vec::with_capacity(rows.sources.len());
    let mut held = Vec::with_capacity(rows.sources.len());
    for source in &rows.sources {
        let arena = crate::format::parquet::arena::first_view_array(source)
            .and_then(crate::format::parquet::arena::arena_of)
            .ok_or_else(|| Error::Internal("a decoded row group of a view stream has no arena".into()))?;
        let alive: Arc<dyn std::any::Any + Send + Sync> = arena.clone();
        slots.push(session.slot_for_segment(arena.path(), arena.file(), arena.len(), Arc::downgrade(&alive))?);
        held.push(arena.path().to_owned());
    }
    session.lease(index, held);
    Ok(slots)
}

/// Largest estimated batch (rows x the dataset's stored bytes per row) served by
/// [`SmallArrowStream`]: such a batch is built in about 100 us, where each thread hand-off costs
/// tens. Larger batches keep the two-batch pipeline, which puts both cores on their copies.
const SMALL_ARROW_BATCH_BYTES: u64 = 1 << 20;

/// A dataset's stored bytes per row (per sample), what batch sizes are judged by.
fn stored_bytes_per_row(ds: &Dataset) -> u64 {
    ds.total_bytes().checked_div(ds.num_samples()).unwrap_or(0)
}

pub(super) fn small_batches(ds: &Dataset, batch_size: u64) -> bool {
    stored_bytes_per_row(ds).saturating_mul(batch_size) <= SMALL_ARROW_BATCH_BYTES
}

/// An Arrow (Parquet) stream of small batches, served by one blocking thread that takes the ids,
/// builds each message and queues it in turn, up to [`SMALL_GROUP`] messages at once. Over shared
/// memory or rdma a message carries up to [`MAX_BATCHES_PER_MESSAGE`](super::MAX_BATCHES_PER_MESSAGE) consecutive batches of the
/// stream (as many as the client accepts), one record batch in one ring slot, which the client
/// cuts by the part counts.
///
/// The general loop of [`produce`](super::produce) hands every batch to the blocking pool and back (plus a trip
/// for its ids): with 256 rows of 40 bytes those hand-offs were the largest share of the daemon's
/// time, larger than the gather itself (bench/PARQUET_PROFILE.md). Here a batch costs one
/// hand-off, to the connection's task that writes the message, and batches built back to back
/// share it ([`outbox`]). The first batch goes alone (time to first batch), and a group is sent
/// before anything that would wait on the client: a turn without a free slot, or a new ring
/// (its budget may wait for this stream's own slots); over rdma, where every batch holds a credit
/// of the client's ring, each message goes at once. Behaviour is the general loop's otherwise:
/// batches in order, the client leaving or a shutdown ends the stream before the next batch, an
/// error is sent to the client after the batches before it and ends the stream.
pub(super) struct SmallArrowStream {
    pub(super) core: StreamCore,
    /// The stream's rdma sender, when the batches go into the client's registered ring.
    pub(super) rdma: Option<Arc<transport::rdma::RdmaPipe>>,
    pub(super) asm: Arc<BatchAssembler>,
    pub(super) projected: Option<Arc<projected::ProjectedReads>>,
    /// Most batches one message carries ([`MAX_BATCHES_PER_MESSAGE`](super::MAX_BATCHES_PER_MESSAGE)).
    pub(super) parts: usize,
    /// Inline batches beyond one message go as parts the client joins.
    pub(super) split_inline: bool,
}

impl SmallArrowStream {
    pub(super) fn run(mut self, ranges: impl Iterator<Item = std::ops::Range<u64>>) {
        let mut ranges = ranges.peekable();
        let working = Working::until(self.core.ended_by());
        let waits = working.waits();
        let working = std::sync::Mutex::new(working);
        let mut ready: std::collections::VecDeque<ReadyBatch> = std::collections::VecDeque::new();
        let mut group: Vec<outbox::Message> = Vec::with_capacity(SMALL_GROUP);
        let mut sent_any = false;
        // Rows' bytes of the messages in `group`.
        let mut held_bytes = 0u64;
        let mut turn = 0u64;
        loop {
            if self.core.stop_before_next(&mut group) {
                return;
            }
            // The first batch goes alone (time to first batch); later ones share a message (one
            // ring slot) over shared memory or rdma, up to the client's and the message's limits.
            // Inline, one a message.
            let most = if sent_any && (self.core.session.is_some() || self.rdma.is_some()) { self.parts } else { 1 };
            let mut batches = match self.take_batches(&mut ready, &mut ranges, most) {
                Ok(b) if b.is_empty() => break,
                Ok(b) => b,
                Err(e) => return self.core.fail(group, e, waits.take()),
            };
            let parts: Vec<(u64, u32)> =
                batches.iter().map(|(r, ids)| (r.start / self.core.batch_size, ids.len() as u32)).collect();
            let end = batches.last().map_or(0, |(r, _)| r.end);
            // Kept to be taken again, as fewer, should the group outgrow an rdma ring slot.
            let regroup = (self.rdma.is_some() && batches.len() > 1).then(|| batches.clone());
            let ids: Vec<u64> = match batches.len() {
                1 => batches.pop().map(|(_, ids)| ids).unwrap_or_default(),
                _ => batches.into_iter().flat_map(|(_, ids)| ids).collect(),
            };
            let rows = ids.len() as u64;
            let core = &self.core;
            let cancelled = || core.cancelled();
            let mut send_group = || -> Result<()> {
                core.tx
                    .blocking_send_all(std::mem::take(&mut group))
                    .map_err(|_| Error::ClientGone("the client went away".into()))
            };
            let started = Instant::now();
            let built = build_arrow_batch(
                &self.core.dataset,
                &working,
                self.core.session.as_deref(),
                self.rdma.as_deref(),
                turn,
                &self.asm,
                self.projected.as_deref(),
                ids,
                parts[0].0,
                &parts,
                self.split_inline,
                &cancelled,
                &mut send_group,
            );
            if let (Ok(None), Some(again)) = (&built, regroup) {
                // At most halved four times a stream (16 batches to 1): one batch that outgrows
                // its slot is an error naming the knob.
                self.parts = (again.len() / 2).max(1);
                again.into_iter().rev().for_each(|b| ready.push_front(b));
                continue;
            }
            // Turns are this thread's messages, in order (a message may carry several batches).
            turn += 1;
            match built.and_then(one_batch_sent) {
                Ok(((msgs, bytes), waited)) => {
                    if group.is_empty() {
                        // Sent meanwhile (before the build waited, or at the top of the loop).
                        held_bytes = 0;
                    }
                    group.extend(msgs.into_iter().map(Ok));
                    held_bytes += bytes;
                    self.core.built(started, waited);
                    self.core.served(rows, bytes, end, waited);
                }
                Err(e) => {
                    let waited = waits.take();
                    self.core.built(started, waited);
                    return self.core.fail(group, e, waited);
                }
            }
            // Over rdma every batch holds a credit the client returns only once it has the
            // batch's message: a message held back here could leave the next batch waiting for
            // a credit that cannot come, so each goes at once. Inline, a message carries its
            // rows: past MESSAGE_ROWS_BYTES a wake-up saved is nothing beside them, and what is
            // held back here is not counted against the inline budget (`inline_budget`).
            let inline = self.core.session.is_none() && self.rdma.is_none();
            let next_waits = self.core.session.as_ref().is_some_and(|s| !s.credit_free())
                || self.rdma.is_some()
                || (inline && held_bytes >= MESSAGE_ROWS_BYTES);
            if !sent_any || group.len() >= SMALL_GROUP || next_waits {
                if !self.core.send(std::mem::take(&mut group)) {
                    return;
                }
                sent_any = true;
                held_bytes = 0;
            }
        }
        self.core.send(group);
    }

    /// The stream's next batches for one message: at most `most` (at least one), and more than
    /// one only while their rows fit [`MESSAGE_ROWS_BYTES`]. Empty at the end.
    fn take_batches(
        &mut self,
        ready: &mut std::collections::VecDeque<ReadyBatch>,
        ranges: &mut std::iter::Peekable<impl Iterator<Item = std::ops::Range<u64>>>,
        most: usize,
    ) -> Result<Vec<ReadyBatch>> {
        let most = most.max(1);
        let per_row = stored_bytes_per_row(&self.core.dataset).max(1);
        let mut taken: Vec<ReadyBatch> = Vec::with_capacity(most);
        let mut rows = 0u64;
        while taken.len() < most {
            if ready.is_empty() {
                ready.extend(ids_of(&mut self.core.sequence, next_ranges(ranges, IDS_AHEAD))?);
            }
            let Some((_, ids)) = ready.front() else { break };
            rows += ids.len() as u64;
            if !taken.is_empty() && rows.saturating_mul(per_row) > MESSAGE_ROWS_BYTES {
                break;
            }
            taken.extend(ready.pop_front());
        }
        Ok(taken)
    }
}
