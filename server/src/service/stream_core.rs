//! What every stream served on one blocking thread of its own holds, and the steps they share
//! ([`super::sample_stream`] for TAR batches, [`super::arrow_stream`] for small Arrow batches):
//! the dataset and the rank's sample order, the outbox to the connection, the stream's metrics
//! and prefetch consumer, and the shutdown signal.

use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::outbox;
use crate::Error;
use crate::cache::EndedBy;
use crate::index::Dataset;
use crate::metrics::Metrics;
use crate::plan;
use crate::prefetch::ConsumerGuard;
use crate::transport::shm::Session;

pub(super) struct StreamCore {
    pub(super) dataset: Arc<Dataset>,
    pub(super) session: Option<Arc<Session>>,
    pub(super) sequence: plan::RankStream,
    pub(super) batch_size: u64,
    pub(super) tx: outbox::Outbox,
    pub(super) metrics: Arc<Metrics>,
    /// The prefetcher follows the stream while this lives.
    pub(super) consumer: Option<ConsumerGuard>,
    pub(super) shutdown: CancellationToken,
}

impl StreamCore {
    /// Whether a build should give up: the client left or the daemon shuts down.
    pub(super) fn cancelled(&self) -> bool {
        self.tx.is_closed() || self.shutdown.is_cancelled()
    }

    /// What tells the stream's working set that the stream ended ([`Self::cancelled`]), so
    /// that a wait for room in the node cache does not keep the stream's pins for nobody.
    pub(super) fn ended_by(&self) -> EndedBy {
        let closed = self.tx.closed_probe();
        let shutdown = self.shutdown.clone();
        EndedBy(Arc::new(move || closed() || shutdown.is_cancelled()))
    }

    /// Sends what `group` holds first when the stream must end before its next batch (the
    /// client left or a shutdown).
    pub(super) fn stop_before_next(&self, group: &mut Vec<outbox::Message>) -> bool {
        self.tx.stop_before_next(group, &self.shutdown)
    }

    /// Counts what the stream waited for storage in a build begun at `started`: the build's
    /// waits for shards (`waited`), at most its time. A build also waits for the client (a credit,
    /// a ring slot, a split part's send): the trainer's pace, which counted as the daemon's read
    /// time made a sleeping trainer look like slow storage.
    pub(super) fn built(&self, started: Instant, waited: std::time::Duration) {
        count_read_wait(&self.metrics, started.elapsed().min(waited));
    }

    /// Counts a built batch: `samples` samples or rows of `bytes`; the prefetcher learns the
    /// order reached `end` after the build waited `waited` for storage.
    pub(super) fn served(&self, samples: u64, bytes: u64, end: u64, waited: std::time::Duration) {
        self.metrics.batch_served(samples, bytes);
        if let Some(c) = &self.consumer {
            c.consumer.advance(end, waited);
        }
    }

    /// Sends `group`; false when the client is gone.
    pub(super) fn send(&self, group: Vec<outbox::Message>) -> bool {
        self.tx.blocking_send_group(group)
    }

    /// Sends `group`, then `e`, which ends the stream; `waited`: what the stream waited for
    /// storage and never served (the wait that ended in `e`).
    pub(super) fn fail(&self, group: Vec<outbox::Message>, e: Error, waited: std::time::Duration) {
        if let Some(c) = &self.consumer {
            c.consumer.waited(waited);
        }
        self.dataset.note_stream_failure(&e);
        self.tx.blocking_fail(group, &self.dataset.url, e, &self.shutdown);
    }
}

/// Runs a stream's loop on a blocking thread of its own until it ends.
pub(super) async fn run_on_own_thread(run: impl FnOnce() + Send + 'static) {
    if let Err(e) = tokio::task::spawn_blocking(run).await {
        tracing::warn!(error = %e, "stream task failed");
    }
}

/// Adds `waited` to the daemon's read time (`StatusReply.read_wait_ms`).
pub(super) fn count_read_wait(metrics: &crate::metrics::Metrics, waited: std::time::Duration) {
    metrics.read_wait_us.fetch_add(waited.as_micros() as u64, std::sync::atomic::Ordering::Relaxed);
}
