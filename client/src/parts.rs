//! Batches the daemon split over several messages: a batch whose bytes do not fit one gRPC
//! message arrives as consecutive parts with the same batch index, `more` set on all but the
//! last. [`Joiner`] collects them and hands out the whole batch once its last part is in; how
//! parts become one batch is each message kind's own ([`Part::join`]: inline samples in
//! `inline`, Arrow rows in `arrow_join`).

use crate::ClientError;

/// A message that may be one part of a split batch.
pub trait Part: Sized {
    /// What the messages are, for errors ("batch", "arrow batch").
    const KIND: &'static str;
    fn batch_index(&self) -> u64;
    /// More parts of the batch follow.
    fn more(&self) -> bool;
    /// Refuses a part that cannot belong to a split batch (checked for every part of one).
    fn check_part(&self) -> Result<(), ClientError> {
        Ok(())
    }
    /// The batch from all its parts, in order (at least two).
    fn join(parts: Vec<Self>) -> Result<Self, ClientError>;
}

/// The parts of the batch being received.
#[derive(Debug)]
pub struct Joiner<T> {
    parts: Vec<T>,
}

impl<T> Default for Joiner<T> {
    fn default() -> Self {
        Self { parts: Vec::new() }
    }
}

impl<T: Part> Joiner<T> {
    /// Takes one message; returns the whole batch once its last part is in (at once for a batch
    /// that was not split).
    pub fn push(&mut self, part: T) -> Result<Option<T>, ClientError> {
        if let Some(first) = self.parts.first()
            && first.batch_index() != part.batch_index()
        {
            return Err(ClientError::Protocol(format!(
                "{} {} ended without its last part ({} {} followed)",
                T::KIND,
                first.batch_index(),
                T::KIND,
                part.batch_index()
            )));
        }
        if part.more() || !self.parts.is_empty() {
            part.check_part()?;
        }
        if part.more() {
            self.parts.push(part);
            return Ok(None);
        }
        if self.parts.is_empty() {
            return Ok(Some(part));
        }
        self.parts.push(part);
        T::join(std::mem::take(&mut self.parts)).map(Some)
    }
}
