//! The hand-off of a stream's batches from its receiving task to its queue, as the stream's drop
//! sees it. A batch that holds a lease (a shared-memory batch, a ring slot) is the client's once
//! it is queued: when the stream is dropped, the ones still queued are released one by one, and
//! the daemon is told where the queued ones end (`stream_end`), so that it takes back the leases
//! of every later batch itself. Counting a batch and queueing it must therefore be one step for
//! the drop: a batch counted but not yet queued when the drop drains the queue would be neither
//! released by the client nor taken back by the daemon, and its lease would stay held until the
//! side channel closed.

use std::sync::{Mutex, MutexGuard};

#[derive(Debug, Default)]
struct State {
    /// Index + 1 of the last leased batch queued (0: none yet).
    pushed: u64,
    /// The stream was dropped: nothing more is queued.
    closed: bool,
}

/// See the module documentation. Shared by a stream and its receiving task.
#[derive(Debug, Default)]
pub(crate) struct Handoff(Mutex<State>);

impl Handoff {
    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts `leased` (the index of a batch holding a lease, if the item is one) and runs
    /// `queue`, in one step the stream's drop cannot come between; or, when the stream was
    /// dropped already, neither, and false (the batch is the daemon's to take back). `queue`
    /// must not block: it runs under the hand-off's lock.
    pub(crate) fn pass(&self, leased: Option<u64>, queue: impl FnOnce()) -> bool {
        let mut st = self.state();
        if st.closed {
            return false;
        }
        if let Some(i) = leased {
            st.pushed = i + 1;
        }
        queue();
        true
    }

    /// Marks the stream dropped. Returns the index + 1 of the last leased batch queued: every
    /// batch before it is in the queue or handed out, none after it ever will be.
    pub(crate) fn close(&self) -> u64 {
        let mut st = self.state();
        st.closed = true;
        st.pushed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn a_drop_during_a_hand_off_waits_for_the_batch_to_be_queued() {
        let handoff = Arc::new(Handoff::default());
        let (queue_tx, queue_rx) = mpsc::channel();
        let (started_tx, started_rx) = mpsc::channel();
        let task = {
            let handoff = handoff.clone();
            std::thread::spawn(move || {
                handoff.pass(Some(5), || {
                    started_tx.send(()).unwrap();
                    // The drop arrives here, between counting the batch and queueing it.
                    std::thread::sleep(Duration::from_millis(100));
                    queue_tx.send(5u64).unwrap();
                })
            })
        };
        started_rx.recv().unwrap();
        let pushed = handoff.close();
        // What the drop then drains holds every batch before `pushed`.
        let drained: Vec<u64> = queue_rx.try_iter().collect();
        assert_eq!((pushed, drained), (6, vec![5]));
        assert!(task.join().unwrap());
    }

    #[test]
    fn after_a_drop_nothing_is_counted_or_queued() {
        let handoff = Handoff::default();
        assert!(handoff.pass(Some(2), || {}));
        // An unleased item (an error, an inline batch) is queued without being counted.
        assert!(handoff.pass(None, || {}));
        assert_eq!(handoff.close(), 3);
        let mut queued = false;
        assert!(!handoff.pass(Some(4), || queued = true));
        assert!(!queued);
        assert_eq!(handoff.close(), 3);
    }
}
