//! A stream of TAR sample batches, inline or described over shared memory, built on one blocking
//! thread for the whole stream. (Over rdma a build may wait for a credit of the client's ring,
//! which the general loop in `mod.rs` can walk away from when the client goes; packed batches are
//! gathered several at a time there.)
//!
//! The general loop handed each batch to the blocking pool and back: two thread switches a batch,
//! plus a wake-up of the connection's task for each message. For shm batches, descriptors built
//! in ~20 us, those switches were most of the daemon's CPU in a warm epoch (bench/PROFILES.md).
//! Here one thread builds batch after batch and waits only on the outbox, and shm batches share
//! one outbox item ([`outbox`]) up to [`SMALL_GROUP`]: one wake-up of the connection's task and
//! one socket write for them. A group never holds a batch back while the next one may wait: it is
//! sent before a batch that would wait for the client to release one (it can only release what it
//! has: holding them back would deadlock) or that needs a shard outside the stream's working set
//! (a shard to open, fetch or verify), and the first batch goes alone (time to first batch).

use std::time::Instant;

use super::batches::{build_batch, build_shm_batch};
use super::stream_core::StreamCore;
use super::{IDS_AHEAD, ReadyBatch, SMALL_GROUP, ids_of, next_ranges, outbox, samples_in};
use crate::Result;
use crate::index::Working;

pub(super) struct SampleStream {
    pub(super) core: StreamCore,
    pub(super) fields: Vec<String>,
    pub(super) all_fields: bool,
}

impl SampleStream {
    pub(super) fn run(mut self, ranges: impl Iterator<Item = std::ops::Range<u64>>) {
        let mut ranges = ranges.peekable();
        let mut ready: std::collections::VecDeque<ReadyBatch> = std::collections::VecDeque::new();
        let mut working = Working::until(self.core.ended_by());
        // An inline batch holds its bytes: only shm descriptors are grouped.
        let grouped = self.core.session.is_some();
        let mut group: Vec<outbox::Message> = Vec::with_capacity(SMALL_GROUP);
        let mut sent_any = false;
        loop {
            if self.core.stop_before_next(&mut group) {
                return;
            }
            if ready.is_empty() {
                match ids_of(&mut self.core.sequence, next_ranges(&mut ranges, IDS_AHEAD)) {
                    Ok(ids) => ready.extend(ids),
                    Err(e) => return self.core.fail(group, e, working.take_wait()),
                }
            }
            let Some((range, ids)) = ready.pop_front() else { break };
            if !group.is_empty() && self.may_wait(&working, &ids) && !self.core.send(std::mem::take(&mut group)) {
                return;
            }
            let started = Instant::now();
            // The parts of a batch split over several messages go out as they are made. Only shm
            // batches are grouped, so for an inline one `group` is empty here: no part overtakes
            // an earlier message.
            let mut sent = 0;
            let built = self.build(&mut working, &ids, range.start / self.core.batch_size, &mut |part| {
                sent += samples_in(&part);
                self.core.send(vec![Ok(part)])
            });
            let waited = working.take_wait();
            self.core.built(started, waited);
            match built {
                Ok((message, bytes)) => {
                    let samples = sent + samples_in(&message);
                    group.push(Ok(message));
                    self.core.served(samples, bytes, range.end, waited);
                }
                Err(e) => return self.core.fail(group, e, waited),
            }
            if !grouped || !sent_any || group.len() >= SMALL_GROUP {
                if !self.core.send(std::mem::take(&mut group)) {
                    return;
                }
                sent_any = true;
            }
        }
        self.core.send(group);
    }

    /// Whether building the batch of `ids` may wait: for the client to release a batch (which it
    /// can only do for batches it has), or for storage (a shard outside the working set to open,
    /// fetch or verify).
    fn may_wait(&self, working: &Working, ids: &[u64]) -> bool {
        self.core.session.as_ref().is_some_and(|s| !s.ready_now()) || !working.holds_all(&self.core.dataset, ids)
    }

    /// One batch's message and its payload bytes. An inline batch split over several messages
    /// hands the parts before its last to `send_part` as it goes (see [`build_batch`]).
    fn build(
        &self,
        working: &mut Working,
        ids: &[u64],
        index: u64,
        send_part: &mut dyn FnMut(shardstream_proto::StreamMessage) -> bool,
    ) -> Result<(shardstream_proto::StreamMessage, u64)> {
        let (ds, fields) = (&*self.core.dataset, &self.fields[..]);
        let cancelled = || self.core.cancelled();
        let built = match &self.core.session {
            Some(s) => build_shm_batch(ds, working, s, fields, ids, index, &cancelled),
            None => build_batch(ds, working, fields, self.all_fields, ids, index, send_part),
        };
        let dropped = working.end_batch();
        if let Some(s) = &self.core.session
            && !dropped.is_empty()
        {
            // The client may let go of what the stream has moved past (its descriptors and
            // mappings would otherwise pile up for the whole epoch).
            s.done_with(dropped.iter().map(|r| r.file.path.as_path()));
        }
        built
    }
}
