//! A stream of TAR sample batches, inline or described over shared memory, built on one blocking
//! thread for the whole stream. (Over rdma a build may wait for a credit of the client's ring,
//! which the general loop in `mod.rs` can walk away from when the client goes; packed batches are
//! gathered two at a time there.)
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

use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::batches::{build_batch, build_shm_batch};
use super::{IDS_AHEAD, ReadyBatch, SMALL_GROUP, ids_of, next_ranges, outbox, samples_in};
use crate::index::{Dataset, Working};
use crate::metrics::Metrics;
use crate::prefetch::ConsumerGuard;
use crate::transport::shm::Session;
use crate::{Result, plan};

pub(super) struct SampleStream {
    pub(super) dataset: Arc<Dataset>,
    pub(super) fields: Vec<String>,
    pub(super) all_fields: bool,
    pub(super) session: Option<Arc<Session>>,
    pub(super) sequence: plan::RankStream,
    pub(super) batch_size: u64,
    pub(super) tx: outbox::Outbox,
    pub(super) metrics: Arc<Metrics>,
    /// The prefetcher follows the stream while this lives.
    pub(super) consumer: Option<ConsumerGuard>,
    pub(super) shutdown: CancellationToken,
}

impl SampleStream {
    pub(super) fn run(mut self, ranges: impl Iterator<Item = std::ops::Range<u64>>) {
        let mut ranges = ranges.peekable();
        let mut ready: std::collections::VecDeque<ReadyBatch> = std::collections::VecDeque::new();
        let mut working = Working::default();
        // An inline batch holds its bytes: only shm descriptors are grouped.
        let grouped = self.session.is_some();
        let mut group: Vec<outbox::Message> = Vec::with_capacity(SMALL_GROUP);
        let mut sent_any = false;
        loop {
            if self.tx.stop_before_next(&mut group, &self.shutdown) {
                return;
            }
            if ready.is_empty() {
                match ids_of(&mut self.sequence, next_ranges(&mut ranges, IDS_AHEAD)) {
                    Ok(ids) => ready.extend(ids),
                    Err(e) => return self.tx.blocking_fail(group, &self.dataset.url, e),
                }
            }
            let Some((range, ids)) = ready.pop_front() else { break };
            if !group.is_empty()
                && self.may_wait(&working, &ids)
                && !self.tx.blocking_send_group(std::mem::take(&mut group))
            {
                return;
            }
            let started = Instant::now();
            let built = self.build(&mut working, &ids, range.start / self.batch_size);
            self.metrics
                .read_wait_us
                .fetch_add(started.elapsed().as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
            match built {
                Ok((messages, bytes)) => {
                    let samples = messages.iter().map(samples_in).sum();
                    group.extend(messages.into_iter().map(Ok));
                    self.metrics.batch_served(samples, bytes);
                    if let Some(c) = &self.consumer {
                        c.consumer.advance(range.end, working.take_wait());
                    }
                }
                Err(e) => return self.tx.blocking_fail(group, &self.dataset.url, e),
            }
            if !grouped || !sent_any || group.len() >= SMALL_GROUP {
                if !self.tx.blocking_send_group(std::mem::take(&mut group)) {
                    return;
                }
                sent_any = true;
            }
        }
        self.tx.blocking_send_group(group);
    }

    /// Whether building the batch of `ids` may wait: for the client to release a batch (which it
    /// can only do for batches it has), or for storage (a shard outside the working set to open,
    /// fetch or verify).
    fn may_wait(&self, working: &Working, ids: &[u64]) -> bool {
        self.session.as_ref().is_some_and(|s| !s.ready_now()) || !working.holds_all(&self.dataset, ids)
    }

    /// One batch's messages (an inline batch may take several) and its payload bytes.
    fn build(
        &self,
        working: &mut Working,
        ids: &[u64],
        index: u64,
    ) -> Result<(Vec<shardstream_proto::StreamMessage>, u64)> {
        let (ds, fields) = (&*self.dataset, &self.fields[..]);
        let (tx, stop) = (&self.tx, &self.shutdown);
        let cancelled = || tx.is_closed() || stop.is_cancelled();
        let built = match &self.session {
            Some(s) => build_shm_batch(ds, working, s, fields, ids, index, &cancelled).map(|(m, b)| (vec![m], b)),
            None => build_batch(ds, working, fields, self.all_fields, ids, index),
        };
        let dropped = working.end_batch();
        if let Some(s) = &self.session
            && !dropped.is_empty()
        {
            // The client may let go of what the stream has moved past (its descriptors and
            // mappings would otherwise pile up for the whole epoch).
            s.done_with(dropped.iter().map(|r| r.file.path.as_path()));
        }
        built
    }
}
