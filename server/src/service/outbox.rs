//! The queue between a stream's producer and the connection's task that writes its messages.
//!
//! Each item queued wakes that task once, and each wake-up costs the daemon a futex, an
//! `epoll_wait` round and a socket write: for batches of a few hundred small rows, built in
//! ~80 us, those hand-offs were a third of the daemon's time (bench/PARQUET_PROFILE.md). So an
//! item is a group of messages: a producer that has several batches ready queues them at once,
//! and the task encodes them into one write. The client sees the same messages as without groups.
//!
//! An inline stream's queue counts its bytes against the daemon's `--inline-budget`
//! ([`super::inline_budget`]): from when a group is queued until the connection has taken its
//! last message.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use prost::Message as _;
use shardstream_proto::StreamMessage;
use tokio::sync::mpsc;
use tonic::Status;

use super::inline_budget::StreamBytes;

pub type Message = Result<StreamMessage, Status>;

/// A group of messages and the bytes counted for it against the inline budget.
type Item = (Vec<Message>, u64);

/// The producer's end.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::Sender<Item>,
    /// A shutdown's last word did not fit the full queue.
    unsaid: Arc<AtomicBool>,
    /// An inline stream's account against `--inline-budget`.
    bytes: Option<Arc<StreamBytes>>,
}

/// The connection's end: the messages one by one, in the order they were queued.
#[derive(Debug)]
pub struct Messages {
    rx: mpsc::Receiver<Item>,
    group: std::vec::IntoIter<Message>,
    /// What the group being handed out counts against the inline budget, given back once its
    /// last message is taken.
    group_bytes: u64,
    /// Set by the producer when a shutdown's last word found the queue full (a client far
    /// behind): said here once the queue is drained, so the stream never just ends short of its
    /// batch count, which the client can only take for a daemon that died.
    unsaid: Arc<AtomicBool>,
    bytes: Option<Arc<StreamBytes>>,
    /// What the stream holds while its messages exist ([`Self::hold`]).
    held: Option<Held>,
}

/// A stream's admission (its places under `--max-streams` and `--max-streams-per-client`).
struct Held(#[allow(dead_code)] Box<dyn Send>);

impl std::fmt::Debug for Held {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Held")
    }
}

/// A queue of at most `groups` groups of messages ahead of the connection; `bytes`: an inline
/// stream's account, which its queued messages count against.
pub fn channel(groups: usize, bytes: Option<StreamBytes>) -> (Outbox, Messages) {
    let (tx, rx) = mpsc::channel(groups);
    let unsaid = Arc::new(AtomicBool::new(false));
    let bytes = bytes.map(Arc::new);
    let outbox = Outbox { tx, unsaid: unsaid.clone(), bytes: bytes.clone() };
    (outbox, Messages { rx, group: Vec::new().into_iter(), group_bytes: 0, unsaid, bytes, held: None })
}

/// The client went away (the connection's end is gone).
#[derive(Debug)]
pub struct Closed;

impl Outbox {
    pub async fn send(&self, m: Message) -> Result<(), Closed> {
        let group = vec![m];
        let bytes = self.charge(&group)?;
        self.tx.send((group, bytes)).await.map_err(|_| Closed)
    }

    /// Counts `group` against the inline budget (an inline stream's; nothing otherwise): its
    /// messages' encoded bytes. A failed send after this needs no release: it fails only once the
    /// connection's end is gone, whose account gave back everything when it went.
    fn charge(&self, group: &[Message]) -> Result<u64, Closed> {
        let Some(account) = &self.bytes else { return Ok(0) };
        let bytes = group.iter().map(|m| m.as_ref().map_or(0, |m| m.encoded_len() as u64)).sum();
        if account.charge(bytes) { Ok(bytes) } else { Err(Closed) }
    }

    /// Queues `group` as one item (from a blocking thread); an empty group queues nothing.
    pub fn blocking_send_all(&self, group: Vec<Message>) -> Result<(), Closed> {
        if group.is_empty() {
            return Ok(());
        }
        let bytes = self.charge(&group)?;
        self.tx.blocking_send((group, bytes)).map_err(|_| Closed)
    }

    /// Queues `group` from a blocking thread; false when the client left (a stream then stops).
    /// An empty group queues nothing.
    pub fn blocking_send_group(&self, group: Vec<Message>) -> bool {
        if group.is_empty() {
            return true;
        }
        fail_point!("stream-send", |_| false);
        if self.blocking_send_all(group).is_err() {
            tracing::debug!("client left mid-stream");
            return false;
        }
        true
    }

    /// Queues the batches built so far, then the error `e` of a stream of `dataset`, which ends
    /// it (from a blocking thread). A build that gave up because the daemon is shutting down
    /// says so instead, as [`Self::stop_before_next`] does.
    pub fn blocking_fail(
        &self,
        mut group: Vec<Message>,
        dataset: &str,
        e: crate::Error,
        shutdown: &tokio_util::sync::CancellationToken,
    ) {
        match last_word(dataset, e, shutdown) {
            Ending::Shutdown(status) => {
                group.push(Err(status));
                self.try_send_all(group);
            }
            Ending::Failed(status) => {
                group.push(Err(status));
                let _ = self.blocking_send_all(group);
            }
        }
    }

    /// Whether a stream on a blocking thread must stop before its next batch: the client left, or
    /// the daemon is shutting down. The client then learns of the shutdown after `group` (and,
    /// when its queue is full, after what the queue holds: [`Messages`]). An inline stream waits
    /// here first while the inline budget is spent and its own messages wait
    /// ([`super::inline_budget`]), once it has queued `group` (its client may be waiting for it).
    pub fn stop_before_next(&self, group: &mut Vec<Message>, shutdown: &tokio_util::sync::CancellationToken) -> bool {
        if let Some(account) = &self.bytes
            && !self.is_closed()
            && !shutdown.is_cancelled()
            && !account.may_build()
        {
            if !group.is_empty() && self.blocking_send_all(std::mem::take(group)).is_err() {
                return true;
            }
            account.wait_blocking(&|| self.is_closed() || shutdown.is_cancelled());
            if account.is_closed() {
                // Let through because its connection went (the queue itself goes a moment later).
                return true;
            }
        }
        if self.is_closed() {
            return true;
        }
        if !shutdown.is_cancelled() {
            return false;
        }
        let mut last = std::mem::take(group);
        last.push(Err(shutting_down()));
        self.try_send_all(last);
        true
    }

    /// Queues `group`, a shutdown's last word, unless the queue is full or closed: it must not
    /// block. When it is full, the connection's end says the shutdown itself once it has sent
    /// what was queued ([`Messages`]).
    pub fn try_send_all(&self, group: Vec<Message>) {
        if group.is_empty() {
            return;
        }
        let Ok(bytes) = self.charge(&group) else { return };
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send((group, bytes)) {
            self.unsaid.store(true, Ordering::Release);
            if let Some(account) = &self.bytes {
                account.release(bytes);
            }
        }
    }

    pub fn try_send(&self, m: Message) {
        self.try_send_all(vec![m]);
    }

    /// Resolves once the stream may build its next batch: at once but for an inline stream
    /// whose messages wait while the inline budget is spent ([`super::inline_budget`]).
    pub async fn room(&self) {
        if let Some(account) = &self.bytes {
            account.room().await;
        }
    }

    /// Whether the stream may build its next batch now ([`Self::room`]).
    #[cfg(test)]
    pub fn may_build(&self) -> bool {
        self.bytes.as_ref().is_none_or(|a| a.may_build())
    }

    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// [`Self::is_closed`] for a stream's other parts (its working set): holds no sender, so
    /// the client's stream still ends when the stream's outbox goes. Gone, the outbox is closed.
    pub fn closed_probe(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let weak = self.tx.downgrade();
        move || weak.upgrade().is_none_or(|tx| tx.is_closed())
    }

    pub async fn closed(&self) {
        self.tx.closed().await;
    }
}

impl Messages {
    /// Keeps `admission` until the connection lets go of these messages (its client read them
    /// all, or left), not only until the producer is done (which holds it as well): a client that does not read holds a
    /// whole queue of batches in the daemon, and must go on counting against the stream limits
    /// while it does, or one client could hold any number of such queues.
    pub fn hold(&mut self, admission: impl Send + 'static) {
        self.held = Some(Held(Box::new(admission)));
    }
}

impl tokio_stream::Stream for Messages {
    type Item = Message;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        loop {
            if let Some(m) = self.group.next() {
                return Poll::Ready(Some(m));
            }
            // The connection has taken the whole group.
            let taken = std::mem::take(&mut self.group_bytes);
            if let Some(account) = self.bytes.as_ref().filter(|_| taken > 0) {
                account.release(taken);
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some((group, bytes))) => {
                    self.group = group.into_iter();
                    self.group_bytes = bytes;
                }
                Poll::Ready(None) if self.unsaid.swap(false, Ordering::AcqRel) => {
                    return Poll::Ready(Some(Err(shutting_down())));
                }
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Drop for Messages {
    /// The connection lets go of the stream (read whole, or its client left): what is still
    /// queued goes with it, and so does its count, before the queue itself is dropped (a producer
    /// that queues after this counts nothing: [`StreamBytes::charge`]).
    fn drop(&mut self) {
        if let Some(account) = &self.bytes {
            account.close();
        }
    }
}

/// What a stream's client is told when the daemon's shutdown ends it.
pub fn shutting_down() -> Status {
    Status::unavailable(super::SHUTTING_DOWN)
}

/// How a stream that failed with `e` ends, logged once: a build that gave up because the daemon
/// is shutting down says so (sent without waiting on a client that stopped reading, as the
/// shutdown's own branch is), any other failure is the error itself, a warning unless its client
/// left ([`crate::Error::ClientGone`]).
pub enum Ending {
    Shutdown(Status),
    Failed(Status),
}

pub fn last_word(dataset: &str, e: crate::Error, shutdown: &tokio_util::sync::CancellationToken) -> Ending {
    if shutdown.is_cancelled() {
        tracing::debug!(dataset, error = %e, "stream ended by the shutdown");
        return Ending::Shutdown(shutting_down());
    }
    if matches!(e, crate::Error::ClientGone(_)) {
        // A trainer that stops mid-epoch (a step budget, a `break`) drops its loader: routine,
        // but said (at info) for a remote client whose connection died.
        tracing::info!(dataset, error = %e, "stream ended: its client left");
    } else {
        tracing::warn!(dataset, error = %e, "stream failed");
    }
    Ending::Failed(super::to_status(e))
}

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;

    use super::*;

    fn msg(i: u64) -> Message {
        Ok(StreamMessage {
            kind: Some(shardstream_proto::stream_message::Kind::ArrowBatch(shardstream_proto::ArrowBatch {
                batch_index: i,
                ..Default::default()
            })),
        })
    }

    fn index(m: Message) -> u64 {
        match m {
            Ok(StreamMessage { kind: Some(shardstream_proto::stream_message::Kind::ArrowBatch(b)) }) => b.batch_index,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn groups_arrive_as_single_messages_in_order() {
        let (tx, mut rx) = channel(2, None);
        tx.send(msg(0)).await.unwrap();
        let producer = {
            let tx = tx.clone();
            tokio::task::spawn_blocking(move || {
                tx.blocking_send_all(vec![msg(1), msg(2), msg(3)]).unwrap();
                tx.blocking_send_all(Vec::new()).unwrap();
                tx.blocking_send_all(vec![msg(4)]).unwrap();
            })
        };
        drop(tx);
        // Read while the producer sends: the queue holds two groups, the producer sends three.
        let mut got = Vec::new();
        while let Some(m) = rx.next().await {
            got.push(index(m));
        }
        producer.await.unwrap();
        assert_eq!(got, [0, 1, 2, 3, 4]);
    }

    #[tokio::test]
    async fn what_a_stream_holds_is_let_go_of_with_its_unread_messages_not_with_its_producer() {
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let gone = Arc::new(AtomicBool::new(false));
        let (tx, mut rx) = channel(2, None);
        rx.hold(Flag(gone.clone()));
        tx.send(msg(0)).await.unwrap();
        tx.send(msg(1)).await.unwrap();
        drop(tx); // the producer is done; its messages are not read yet
        assert!(!gone.load(Ordering::Acquire), "held while messages wait for the client");
        assert_eq!(index(rx.next().await.unwrap()), 0);
        assert!(!gone.load(Ordering::Acquire));
        drop(rx); // read whole, or the client left: the connection drops its end
        assert!(gone.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_last_word_that_found_the_queue_full_is_said_after_what_was_queued() {
        let (tx, mut rx) = channel(1, None);
        tx.send(msg(0)).await.unwrap();
        tx.try_send(Err(shutting_down())); // the queue is full: not queued
        drop(tx);
        assert_eq!(index(rx.next().await.unwrap()), 0);
        let last = rx.next().await.unwrap().unwrap_err();
        assert_eq!((last.code(), last.message()), (tonic::Code::Unavailable, "daemon is shutting down"));
        assert!(rx.next().await.is_none(), "said once");
        // A stream that ended whole says nothing more.
        let (tx, mut rx) = channel(1, None);
        tx.send(msg(0)).await.unwrap();
        drop(tx);
        assert_eq!(index(rx.next().await.unwrap()), 0);
        assert!(rx.next().await.is_none());
    }

    #[tokio::test]
    async fn an_inline_queue_counts_its_bytes_until_the_connection_takes_each_group() {
        use crate::service::inline_budget::{ALLOWANCE, InlineBudget};
        // Messages of half the allowance each: a stream holding two may not build past the budget.
        let big = |i: u64| {
            Ok(StreamMessage {
                kind: Some(shardstream_proto::stream_message::Kind::ArrowBatch(shardstream_proto::ArrowBatch {
                    batch_index: i,
                    data: vec![0; ALLOWANCE as usize / 2].into(),
                    ..Default::default()
                })),
            })
        };
        let budget = InlineBudget::new(1);
        let (tx, mut rx) = channel(2, Some(budget.account()));
        let len = |i: u64| big(i).map_or(0, |m: StreamMessage| m.encoded_len() as u64);
        assert!(tx.may_build(), "nothing queued");
        tx.send(big(0)).await.unwrap();
        assert!(tx.may_build(), "under the stream's allowance");
        let blocking = tx.clone();
        tokio::task::spawn_blocking(move || blocking.blocking_send_all(vec![big(1), big(2)])).await.unwrap().unwrap();
        assert_eq!(budget.used(), len(0) + len(1) + len(2));
        assert!(!tx.may_build(), "over the budget with messages waiting");
        assert_eq!(index(rx.next().await.unwrap()), 0);
        assert_eq!(index(rx.next().await.unwrap()), 1);
        assert_eq!(budget.used(), len(1) + len(2), "the group is counted until its last message is taken");
        assert_eq!(index(rx.next().await.unwrap()), 2);
        // The next poll finds the group taken whole (and nothing else queued).
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), rx.next()).await.is_err());
        assert_eq!(budget.used(), 0);
        assert!(tx.may_build());
        // A full queue's last word is not queued, nor counted.
        tx.send(big(3)).await.unwrap();
        tx.send(big(4)).await.unwrap();
        tx.try_send(Err(shutting_down()));
        assert_eq!(budget.used(), len(3) + len(4));
        // The connection goes: everything it held is given back, and later sends count nothing.
        drop(rx);
        assert_eq!(budget.used(), 0);
        assert!(tx.send(msg(5)).await.is_err());
        assert_eq!(budget.used(), 0);
    }

    /// A stream over the inline budget, its queue full: `(tx, rx, the shutdown)`.
    async fn blocked_by_the_budget() -> (Outbox, Messages, tokio_util::sync::CancellationToken) {
        use crate::service::inline_budget::{ALLOWANCE, InlineBudget};
        let big = |i: u64| {
            Ok(StreamMessage {
                kind: Some(shardstream_proto::stream_message::Kind::ArrowBatch(shardstream_proto::ArrowBatch {
                    batch_index: i,
                    data: vec![0; ALLOWANCE as usize].into(),
                    ..Default::default()
                })),
            })
        };
        let (tx, rx) = channel(2, Some(InlineBudget::new(1).account()));
        tx.send(big(0)).await.unwrap();
        tx.send(big(1)).await.unwrap();
        assert!(!tx.may_build());
        (tx, rx, tokio_util::sync::CancellationToken::new())
    }

    #[tokio::test]
    async fn a_stream_blocked_by_the_budget_stops_at_once_at_a_shutdown_without_queueing_its_group() {
        let (tx, mut rx, shutdown) = blocked_by_the_budget().await;
        shutdown.cancel();
        let stopped = tokio::task::spawn_blocking(move || {
            // A group held back: queueing it would wait on the full queue for good.
            let mut group = vec![msg(2)];
            tx.stop_before_next(&mut group, &shutdown)
        });
        assert!(tokio::time::timeout(std::time::Duration::from_secs(5), stopped).await.unwrap().unwrap());
        assert_eq!(index(rx.next().await.unwrap()), 0);
        assert_eq!(index(rx.next().await.unwrap()), 1);
        let last = rx.next().await.unwrap().unwrap_err();
        assert_eq!(last.message(), "daemon is shutting down", "said once the queue is read");
    }

    #[tokio::test]
    async fn a_stream_blocked_by_the_budget_stops_when_its_client_leaves() {
        let (tx, rx, shutdown) = blocked_by_the_budget().await;
        let stopped = tokio::task::spawn_blocking(move || tx.stop_before_next(&mut Vec::new(), &shutdown));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(!stopped.is_finished(), "blocked while its client has not read");
        drop(rx);
        assert!(tokio::time::timeout(std::time::Duration::from_secs(5), stopped).await.unwrap().unwrap());
    }

    #[tokio::test]
    async fn a_gone_connection_is_closed_for_the_producer() {
        let (tx, rx) = channel(1, None);
        drop(rx);
        assert!(tx.is_closed());
        assert!(tx.send(msg(0)).await.is_err());
        let blocking = tx.clone();
        let r = tokio::task::spawn_blocking(move || blocking.blocking_send_all(vec![msg(1)])).await.unwrap();
        assert!(r.is_err());
        tx.try_send(msg(2)); // no panic, nothing to do
    }
}
