//! The rank sequence produced on demand: the same ids in the same order as
//! [`super::rank_sequence`], but window by window, so a stream holds O(window + batch) sample ids
//! instead of its whole share (a 1e9-sample dataset over 64 streams was ~128 GB of plans).
//!
//! Both steps of the plan stream naturally: the rank's share is a walk along the shard order
//! ([`ShareCursor`]), and the window shuffle consumes its input half a window at a time and emits
//! a block per chunk ([`RankStream`]). The generator draws from the same [`Rng`] in the same
//! order as the eager [`super::shuffle::window_shuffle`], which is what keeps the two
//! bit-identical (`lazy_tests::lazy_equals_eager` holds them to it). Only a window as large as
//! the whole share needs the whole share at once, and then the share is no larger than the
//! window.
//!
//! What stays per stream is O(shards): the epoch's shard order and its running sums, the same
//! order of size as the dataset's own shard table.

use std::collections::VecDeque;
use std::ops::Range;

use super::partition::summarize;
use super::shuffle::{Rng, shard_order, window_rng, window_samples};
use super::{EpochParams, PlanError, WorkerParams};

/// Ids handed out at a time when no shuffle bounds the step (identity order).
const IDENTITY_STEP: u64 = 4096;

/// Walks rank `r`'s share of the sample stream `S` (extended by repetition), in stream order.
#[derive(Debug, Clone)]
struct ShareCursor {
    order: Vec<u32>,
    /// Stream offset of each position of `order`, then `N`.
    stream_start: Vec<u64>,
    /// Global id of each shard's first sample, by shard index.
    first_id: Vec<u64>,
    total: u64,
    /// Current position in `S` (mod `N`).
    pos: u64,
    /// Share ids not yet handed out.
    remaining: u64,
}

impl ShareCursor {
    fn new(shard_samples: &[u64], order: Vec<u32>, total: u64, rank: u32, len: u64) -> Result<Self, PlanError> {
        let mut first_id = Vec::with_capacity(shard_samples.len());
        let mut acc = 0u64;
        for &count in shard_samples {
            first_id.push(acc);
            acc += count; // cannot overflow: the sum was checked by `validate`
        }
        let mut stream_start = Vec::with_capacity(order.len() + 1);
        acc = 0;
        for &s in &order {
            stream_start.push(acc);
            acc += shard_samples[s as usize];
        }
        stream_start.push(acc);
        let start = u64::from(rank).checked_mul(len).ok_or(PlanError::Overflow { what: "the rank's share" })?;
        Ok(Self { order, stream_start, first_id, total, pos: start % total, remaining: len })
    }

    /// Appends the next `n` ids of the share (fewer at its end) to `out`.
    fn next_into(&mut self, n: u64, out: &mut Vec<u64>) {
        let mut want = n.min(self.remaining);
        while want > 0 {
            // The non-empty shard holding `pos`: see `partition::rank_share`.
            let k = self.stream_start.partition_point(|&s| s <= self.pos).saturating_sub(1);
            let shard = self.order[k] as usize;
            let offset = self.pos - self.stream_start[k];
            let take = want.min(self.stream_start[k + 1] - self.stream_start[k] - offset);
            let first = self.first_id[shard] + offset;
            out.extend(first..first + take);
            want -= take;
            self.remaining -= take;
            self.pos += take;
            if self.pos == self.total {
                self.pos = 0;
            }
        }
    }
}

/// How the share is mixed, decided once as `window_shuffle` decides it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mix {
    /// Stream order: no shuffle, or a window of one.
    Identity,
    /// The window covers the whole share: one uniform shuffle of it.
    Whole,
    /// Sliding window, half a window per chunk.
    Window { chunk: u64 },
}

/// Rank `p.rank`'s sample ids for the epoch, produced in order on demand.
#[derive(Debug, Clone)]
pub struct RankStream {
    share: ShareCursor,
    len: u64,
    mix: Mix,
    rng: Rng,
    /// The previous chunk's deferred part (window mode).
    left: Vec<u64>,
    /// Produced ids not handed out yet; the first is at position `next`.
    ready: VecDeque<u64>,
    next: u64,
    /// All of the share has been read and `left` emitted.
    drained: bool,
}

impl RankStream {
    /// Validates like [`super::rank_sequence`] and returns the generator at position 0.
    pub fn new(shard_samples: &[u64], p: &EpochParams) -> Result<Self, PlanError> {
        let summary = summarize(shard_samples, p)?;
        let n = summary.total_samples;
        let len = summary.samples_per_rank;
        let order = shard_order(shard_samples.len(), p.seed, p.epoch, p.shuffle);
        let share = ShareCursor::new(shard_samples, order, n, p.rank, len)?;
        let mix = if p.shuffle {
            let window = window_samples(n, shard_samples.len(), p.window_shards);
            let w = window.clamp(1, len.max(1));
            if len < 2 || w < 2 {
                Mix::Identity
            } else if w >= len {
                Mix::Whole
            } else {
                Mix::Window { chunk: w / 2 }
            }
        } else {
            Mix::Identity
        };
        Ok(Self {
            share,
            len,
            mix,
            rng: window_rng(p.seed, p.epoch, p.rank),
            left: Vec::new(),
            ready: VecDeque::new(),
            next: 0,
            drained: false,
        })
    }

    /// Like [`Self::new`], but refuses a plan that would hold more than `limit` ids at once (a
    /// shuffle window as large as a huge share is a full shuffle of it: O(share) memory).
    pub fn bounded(shard_samples: &[u64], p: &EpochParams, limit: u64) -> Result<Self, PlanError> {
        let s = Self::new(shard_samples, p)?;
        let most = s.most_held();
        if most > limit {
            let largest = shard_samples.iter().copied().max().unwrap_or(0);
            return Err(PlanError::WindowTooLarge { window: most, limit, largest });
        }
        Ok(s)
    }

    /// The most ids this generator holds at once: the whole share for a window that covers it,
    /// otherwise a block (the previous chunk's leftovers and a chunk) plus the deferred part.
    pub fn most_held(&self) -> u64 {
        match self.mix {
            Mix::Identity => IDENTITY_STEP.min(self.len),
            Mix::Whole => self.len,
            Mix::Window { chunk } => chunk.saturating_mul(3),
        }
    }

    /// `L`, the length of the whole rank sequence.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The position of the next id [`Self::take`] returns.
    pub fn position(&self) -> u64 {
        self.next
    }

    /// Ids held right now (produced, not handed out): the stream's memory bound in action.
    pub fn buffered(&self) -> usize {
        self.ready.len() + self.left.len()
    }

    /// Produces the next block of the sequence into `ready`; false once everything is produced.
    fn refill(&mut self) -> Result<bool, PlanError> {
        if self.drained {
            return Ok(false);
        }
        let mut part = Vec::new();
        match self.mix {
            Mix::Identity => {
                self.share.next_into(IDENTITY_STEP, &mut part);
                self.drained = self.share.remaining == 0;
            }
            Mix::Whole => {
                reserve(&mut part, self.len)?;
                self.share.next_into(self.len, &mut part);
                self.rng.shuffle(&mut part);
                self.drained = true;
            }
            Mix::Window { chunk } => {
                if self.share.remaining == 0 {
                    // The end of `window_shuffle`: the last chunk's leftovers, shuffled.
                    part = std::mem::take(&mut self.left);
                    self.rng.shuffle(&mut part);
                    self.drained = true;
                } else {
                    // One iteration of `window_shuffle`'s chunk loop, draw for draw.
                    reserve(&mut part, chunk)?;
                    self.share.next_into(chunk, &mut part);
                    let mut fresh = part;
                    self.rng.shuffle(&mut fresh);
                    let defer = self.rng.below(fresh.len() as u64 + 1) as usize;
                    let deferred = fresh.split_off(fresh.len() - defer);
                    let mut block = std::mem::replace(&mut self.left, deferred);
                    block.extend(fresh);
                    self.rng.shuffle(&mut block);
                    part = block;
                }
            }
        }
        self.ready.extend(part);
        Ok(true)
    }

    /// The next `n` ids (fewer at the end of the sequence).
    pub fn take(&mut self, n: u64) -> Result<Vec<u64>, PlanError> {
        let n = n.min(self.len - self.next);
        let mut out = Vec::new();
        reserve(&mut out, n)?;
        while (out.len() as u64) < n {
            if self.ready.is_empty() && !self.refill()? {
                break;
            }
            let k = (n - out.len() as u64).min(self.ready.len() as u64) as usize;
            out.extend(self.ready.drain(..k));
        }
        self.next += out.len() as u64;
        Ok(out)
    }

    /// Discards ids up to position `pos` (a position behind the cursor is an error: the
    /// generator only goes forward).
    pub fn skip_to(&mut self, pos: u64) -> Result<(), PlanError> {
        if pos < self.next {
            return Err(PlanError::Rewind { position: pos, cursor: self.next });
        }
        let mut want = pos.min(self.len) - self.next;
        while want > 0 {
            if self.ready.is_empty() && !self.refill()? {
                break;
            }
            let k = want.min(self.ready.len() as u64) as usize;
            self.ready.drain(..k);
            self.next += k as u64;
            want -= k as u64;
        }
        Ok(())
    }

    /// The ids at positions `range` of the sequence (the range must not start behind the cursor).
    pub fn range(&mut self, range: Range<u64>) -> Result<Vec<u64>, PlanError> {
        self.skip_to(range.start)?;
        self.take(range.end.saturating_sub(range.start))
    }
}

fn reserve(v: &mut Vec<u64>, n: u64) -> Result<(), PlanError> {
    let n_usize = usize::try_from(n).map_err(|_| PlanError::Overflow { what: "the plan's window" })?;
    v.try_reserve_exact(n_usize).map_err(|_| PlanError::OutOfMemory { samples: n })
}

/// Worker `w.worker`'s batches as an iterator of position ranges: what
/// [`super::worker_batches`] returns, without the O(batches) vector.
#[derive(Debug, Clone)]
pub struct WorkerBatches {
    next: u64,
    batches: u64,
    stride: u64,
    batch: u64,
    rank_len: u64,
}

impl WorkerBatches {
    pub fn new(rank_len: u64, batch_size: u32, w: &WorkerParams) -> Result<Self, PlanError> {
        // The eager version validates everything (and allocates nothing for an empty result).
        super::partition::check_worker(rank_len, batch_size, w)?;
        let batch = u64::from(batch_size);
        let batches = rank_len.div_ceil(batch);
        Ok(Self {
            next: w.start_batch + u64::from(w.worker),
            batches,
            stride: u64::from(w.num_workers),
            batch,
            rank_len,
        })
    }

    /// The first batch's range, if any (where the stream starts reading).
    pub fn peek(&self) -> Option<Range<u64>> {
        self.clone().next()
    }
}

impl Iterator for WorkerBatches {
    type Item = Range<u64>;

    fn next(&mut self) -> Option<Range<u64>> {
        if self.next >= self.batches {
            return None;
        }
        let lo = self.next * self.batch;
        self.next += self.stride;
        Some(lo..self.rank_len.min(lo + self.batch))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.batches.saturating_sub(self.next).div_ceil(self.stride);
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        (n, Some(n))
    }
}

impl ExactSizeIterator for WorkerBatches {}

#[cfg(test)]
mod lazy_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::{rank_sequence, worker_batches};

    fn shards_strategy() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(prop_oneof![1 => Just(0u64), 4 => 0u64..300], 1..60)
            .prop_filter("at least one sample", |v| v.iter().sum::<u64>() > 0)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn lazy_equals_eager(
            shards in shards_strategy(), world in 1u32..16, batch in 1u32..64, drop_last: bool,
            shuffle: bool, window_shards in 0u32..6, seed: u64, epoch in 0u64..4, step in 1u64..500,
            rank_pick: u32,
        ) {
            let p = EpochParams {
                seed, epoch, shuffle, window_shards, world_size: world, rank: rank_pick % world,
                batch_size: batch, drop_last,
            };
            let eager = rank_sequence(&shards, &p).unwrap();
            let mut lazy = RankStream::new(&shards, &p).unwrap();
            prop_assert_eq!(lazy.len(), eager.len() as u64);
            let mut got = Vec::new();
            loop {
                let part = lazy.take(step).unwrap();
                if part.is_empty() {
                    break;
                }
                got.extend(part);
            }
            prop_assert_eq!(&got, &eager);
        }

        #[test]
        fn lazy_worker_reads_equal_eager_slices(
            shards in shards_strategy(), world in 1u32..8, batch in 1u32..32, workers in 1u32..6,
            shuffle: bool, seed: u64, start_frac in 0.0f64..=1.0, worker_pick: u32,
        ) {
            let p = EpochParams {
                seed, epoch: 1, shuffle, window_shards: 2, world_size: world, rank: seed as u32 % world,
                batch_size: batch, drop_last: false,
            };
            let eager = rank_sequence(&shards, &p).unwrap();
            let len = eager.len() as u64;
            let batches = len.div_ceil(u64::from(batch));
            let start = ((batches as f64) * start_frac) as u64;
            let w = WorkerParams { num_workers: workers, worker: worker_pick % workers, start_batch: start };
            let ranges: Vec<Range<u64>> = WorkerBatches::new(len, batch, &w).unwrap().collect();
            prop_assert_eq!(&ranges, &worker_batches(len, batch, &w).unwrap());
            prop_assert_eq!(WorkerBatches::new(len, batch, &w).unwrap().len(), ranges.len());
            let mut lazy = RankStream::new(&shards, &p).unwrap();
            for r in ranges {
                let ids = lazy.range(r.clone()).unwrap();
                prop_assert_eq!(&ids[..], &eager[r.start as usize..r.end as usize]);
            }
        }
    }

    #[test]
    fn memory_is_bounded_by_the_window_not_the_share() {
        // 1000 shards of 1000 samples, one rank: a share of 1e6 ids, a window of 2 shards.
        let shards = vec![1000u64; 1000];
        let p = EpochParams {
            seed: 9,
            epoch: 0,
            shuffle: true,
            window_shards: 2,
            world_size: 1,
            rank: 0,
            batch_size: 256,
            drop_last: false,
        };
        let mut lazy = RankStream::new(&shards, &p).unwrap();
        let mut most = 0;
        let mut seen = 0u64;
        while !lazy.take(256).unwrap().is_empty() {
            most = most.max(lazy.buffered());
            seen += 1;
        }
        assert_eq!(seen, 1_000_000u64.div_ceil(256));
        // The window is 2000 ids: at most a block (<= 1.5 windows) and a deferred half window.
        assert!(most <= 2 * 2000, "held {most} ids at once");
        assert!(most as u64 <= lazy.most_held(), "{most} > the advertised {}", lazy.most_held());
        // A window as large as the share would hold the share: refused above a limit.
        let whole = EpochParams { window_shards: 5000, ..p };
        assert_eq!(
            RankStream::bounded(&shards, &whole, 1 << 16).unwrap_err(),
            PlanError::WindowTooLarge { window: 1_000_000, limit: 1 << 16, largest: 1000 }
        );
        // One unit larger than the limit: the smallest window holds it whole, and the error
        // must say the unit is the cause, not the window the caller chose.
        let one = [40_000u64];
        let smallest = EpochParams { window_shards: 1, ..p };
        let err = RankStream::bounded(&one, &smallest, 1 << 15).unwrap_err();
        assert_eq!(err, PlanError::WindowTooLarge { window: 40_000, limit: 1 << 15, largest: 40_000 });
        let text = err.to_string();
        assert!(text.contains("up to 40000 samples each") && text.contains("shuffle=False"), "{text}");
        assert!(RankStream::bounded(&shards, &p, 1 << 16).is_ok());
    }

    #[test]
    fn rewinding_is_an_error_not_a_panic() {
        let p = EpochParams {
            seed: 1,
            epoch: 0,
            shuffle: true,
            window_shards: 1,
            world_size: 1,
            rank: 0,
            batch_size: 4,
            drop_last: false,
        };
        let mut lazy = RankStream::new(&[10, 10], &p).unwrap();
        lazy.range(8..12).unwrap();
        assert_eq!(lazy.range(0..4).unwrap_err(), PlanError::Rewind { position: 0, cursor: 12 });
        // Past the end: empty, not an error.
        assert!(lazy.range(30..40).unwrap().is_empty());
    }
}
