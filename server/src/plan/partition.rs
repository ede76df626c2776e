//! Partitioning: how long every rank's share is, which slice of the sample stream it is, and
//! which of a rank's batches each DataLoader worker delivers. Owns the validation of the plan's
//! parameters and all the arithmetic on sample counts; randomness lives in [`super::shuffle`].

use std::ops::Range;

use super::{
    EpochParams, EpochSummary, MAX_BATCH_SIZE, MAX_SHARDS, MAX_TOTAL_SAMPLES, MAX_WORLD_SIZE, PlanError, WorkerParams,
};

/// Checks every parameter of an epoch and returns the dataset's total sample count `N`.
pub(crate) fn validate(shard_samples: &[u64], p: &EpochParams) -> Result<u64, PlanError> {
    if p.world_size == 0 {
        return Err(PlanError::ZeroWorldSize);
    }
    if p.world_size > MAX_WORLD_SIZE {
        return Err(PlanError::WorldSizeTooLarge { world_size: p.world_size });
    }
    if p.rank >= p.world_size {
        return Err(PlanError::RankOutOfRange { rank: p.rank, world_size: p.world_size });
    }
    check_batch_size(p.batch_size)?;
    let shards = shard_samples.len();
    if shards as u64 > MAX_SHARDS {
        return Err(PlanError::TooManyShards { shards });
    }
    let total = shard_samples
        .iter()
        .try_fold(0u64, |acc, &n| acc.checked_add(n))
        .ok_or(PlanError::Overflow { what: "the dataset's total sample count" })?;
    if total == 0 {
        return Err(PlanError::EmptyDataset { shards });
    }
    if total > MAX_TOTAL_SAMPLES {
        return Err(PlanError::TooManySamples { samples: total });
    }
    Ok(total)
}

fn check_batch_size(batch_size: u32) -> Result<(), PlanError> {
    if batch_size == 0 {
        return Err(PlanError::ZeroBatchSize);
    }
    if batch_size > MAX_BATCH_SIZE {
        return Err(PlanError::BatchSizeTooLarge { batch_size });
    }
    Ok(())
}

/// The epoch's totals, the same on every rank (cheap: no sequence is built).
///
/// Without `drop_last`, `L = ceil(N / W)` and `W * L - N` samples are padding (fewer than `W`);
/// with it, `L = floor(floor(N / W) / B) * B` and `N - W * L` samples are dropped. `L` may be 0
/// with `drop_last` when a rank's share does not fill one batch: every rank then has 0 batches.
pub fn summarize(shard_samples: &[u64], p: &EpochParams) -> Result<EpochSummary, PlanError> {
    let n = validate(shard_samples, p)?;
    let (w, b) = (u64::from(p.world_size), u64::from(p.batch_size));
    let per_rank = if p.drop_last { n / w / b * b } else { n.div_ceil(w) };
    // Validation bounds N and W far below overflow; checked all the same, since this is the one
    // product of two inputs.
    let covered = per_rank.checked_mul(w).ok_or(PlanError::Overflow { what: "samples per rank x world size" })?;
    Ok(EpochSummary {
        total_samples: n,
        samples_per_rank: per_rank,
        batches_per_rank: per_rank.div_ceil(b),
        padded_samples: covered.saturating_sub(n),
        dropped_samples: n.saturating_sub(covered),
    })
}

/// Rank `rank`'s share in stream order: positions `rank * len .. (rank + 1) * len` of the sample
/// stream `S` extended by repetition (position `i` is `S[i mod N]`), as global sample ids. `S` is
/// the shards' samples in `order`; shard `s` owns the ids `prefix[s] .. prefix[s + 1]`.
///
/// `shard_samples` must have been validated (`N = total > 0`) and `order` must be a permutation of
/// its indices.
pub(crate) fn rank_share(
    shard_samples: &[u64],
    order: &[u32],
    total: u64,
    rank: u32,
    len: u64,
) -> Result<Vec<u64>, PlanError> {
    let too_large = PlanError::Overflow { what: "the rank's share" };
    let capacity = usize::try_from(len).map_err(|_| too_large.clone())?;
    let mut share = Vec::new();
    share.try_reserve_exact(capacity).map_err(|_| PlanError::OutOfMemory { samples: len })?;
    if len == 0 {
        return Ok(share);
    }
    // Global id of each shard's first sample (shard index order) and stream offset of each
    // position of `order` (stream order); both end with N.
    let mut first_id = Vec::with_capacity(shard_samples.len() + 1);
    let mut acc = 0u64;
    for &count in shard_samples {
        first_id.push(acc);
        acc += count; // cannot overflow: the sum was checked by `validate`
    }
    let sizes_in_order: Vec<u64> = order.iter().map(|&s| shard_samples[s as usize]).collect();
    let mut stream_start = Vec::with_capacity(order.len() + 1);
    acc = 0;
    for &count in &sizes_in_order {
        stream_start.push(acc);
        acc += count;
    }
    stream_start.push(acc);

    let start = u64::from(rank).checked_mul(len).ok_or(too_large)?;
    let mut pos = start % total;
    let mut remaining = len;
    while remaining > 0 {
        // The last order position whose stream start is <= pos: the non-empty shard holding pos
        // (empty shards share their start with the next shard and are skipped). At least one
        // start (the first, 0) is <= pos, and the final entry N is > pos.
        let k = stream_start.partition_point(|&s| s <= pos).saturating_sub(1);
        let shard = order[k] as usize;
        let offset = pos - stream_start[k];
        let take = remaining.min(sizes_in_order[k] - offset);
        let first = first_id[shard] + offset;
        share.extend(first..first + take);
        remaining -= take;
        pos += take;
        if pos == total {
            // Past the end of S: the padding repeats S from its start.
            pos = 0;
        }
    }
    Ok(share)
}

/// The batches worker `w.worker` of `w.num_workers` delivers, as ranges of positions in the rank
/// sequence (of `rank_len` samples), in delivery order: batches `start_batch + worker`,
/// `start_batch + worker + num_workers`, ... Batch `j` is positions `j * B .. min((j + 1) * B,
/// rank_len)`; only the rank's last batch can be short.
///
/// `start_batch` equal to the rank's batch count is a valid resume point (the epoch is complete:
/// every worker gets nothing); beyond it is an error.
pub fn worker_batches(rank_len: u64, batch_size: u32, w: &WorkerParams) -> Result<Vec<Range<u64>>, PlanError> {
    check_worker(rank_len, batch_size, w)?;
    let b = u64::from(batch_size);
    let batches = rank_len.div_ceil(b);
    // No overflow: start_batch <= batches <= MAX_TOTAL_SAMPLES, far below u64::MAX - u32::MAX.
    let first = w.start_batch + u64::from(w.worker);
    let stride = u64::from(w.num_workers);
    let count = batches.saturating_sub(first).div_ceil(stride);
    let mut out = Vec::new();
    let capacity = usize::try_from(count).map_err(|_| PlanError::Overflow { what: "the worker's batch count" })?;
    out.try_reserve_exact(capacity).map_err(|_| PlanError::OutOfMemory { samples: count })?;
    let mut j = first;
    while j < batches {
        let lo = j * b; // < rank_len, since j < ceil(rank_len / b)
        out.push(lo..rank_len.min(lo + b));
        j += stride;
    }
    Ok(out)
}

/// Checks a worker's parameters against a rank sequence of `rank_len` samples.
pub(crate) fn check_worker(rank_len: u64, batch_size: u32, w: &WorkerParams) -> Result<(), PlanError> {
    check_batch_size(batch_size)?;
    if w.num_workers == 0 {
        return Err(PlanError::ZeroWorkers);
    }
    if w.worker >= w.num_workers {
        return Err(PlanError::WorkerOutOfRange { worker: w.worker, num_workers: w.num_workers });
    }
    if rank_len > MAX_TOTAL_SAMPLES {
        return Err(PlanError::TooManySamples { samples: rank_len });
    }
    let b = u64::from(batch_size);
    let batches = rank_len.div_ceil(b);
    if w.start_batch > batches {
        return Err(PlanError::StartPastEnd { start_batch: w.start_batch, batches });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn params(world_size: u32, rank: u32, batch_size: u32, drop_last: bool) -> EpochParams {
        EpochParams { seed: 0, epoch: 0, shuffle: false, window_shards: 0, world_size, rank, batch_size, drop_last }
    }

    fn wp(num_workers: u32, worker: u32, start_batch: u64) -> WorkerParams {
        WorkerParams { num_workers, worker, start_batch }
    }

    /// torch's DataLoader collects its workers round-robin: worker 0's first batch, worker 1's
    /// first, ..., worker 0's second, ...
    fn round_robin(per_worker: &[Vec<Range<u64>>]) -> Vec<Range<u64>> {
        let longest = per_worker.iter().map(Vec::len).max().unwrap_or(0);
        (0..longest).flat_map(|j| per_worker.iter().filter_map(move |w| w.get(j).cloned())).collect()
    }

    #[test]
    fn summary_examples() {
        // 10 samples over 4 ranks: 3 each, the first 2 samples delivered twice.
        let s = summarize(&[4, 0, 6], &params(4, 0, 2, false)).unwrap();
        assert_eq!(
            s,
            EpochSummary {
                total_samples: 10,
                samples_per_rank: 3,
                batches_per_rank: 2,
                padded_samples: 2,
                dropped_samples: 0
            }
        );
        // With drop_last: floor(10 / 4) = 2 samples, one full batch of 2 per rank, 2 dropped.
        let s = summarize(&[4, 0, 6], &params(4, 0, 2, true)).unwrap();
        assert_eq!((s.samples_per_rank, s.batches_per_rank, s.dropped_samples), (2, 1, 2));
        // A batch larger than the share: no batch at all, everything dropped.
        let s = summarize(&[4, 0, 6], &params(4, 0, 3, true)).unwrap();
        assert_eq!((s.samples_per_rank, s.batches_per_rank, s.dropped_samples), (0, 0, 10));
    }

    #[test]
    fn shares_wrap_around_the_stream() {
        // 3 samples, 8 ranks: one sample each, the stream repeated: 0 1 2 0 1 2 0 1.
        let shares: Vec<Vec<u64>> = (0..8).map(|r| rank_share(&[3], &[0], 3, r, 1).unwrap()).collect();
        assert_eq!(shares.concat(), [0, 1, 2, 0, 1, 2, 0, 1]);
        // Shard order 2, 0, 1 with an empty shard 1: the stream is 2 3 0 1; rank 1 of 2 takes
        // positions 3, 4, 5, i.e. the last sample and then, wrapping, the first two.
        assert_eq!(rank_share(&[2, 0, 2], &[2, 0, 1], 4, 1, 3).unwrap(), [1, 2, 3]);
    }

    #[test]
    fn worker_batch_examples() {
        // 10 samples, batches of 3: [0..3) [3..6) [6..9) [9..10); two workers from batch 1.
        assert_eq!(worker_batches(10, 3, &wp(2, 0, 1)).unwrap(), [3..6, 9..10]);
        assert_eq!(worker_batches(10, 3, &wp(2, 1, 1)).unwrap(), [Range { start: 6, end: 9 }]);
        assert_eq!(worker_batches(10, 3, &wp(2, 1, 4)).unwrap(), []);
        assert_eq!(worker_batches(0, 3, &wp(3, 2, 0)).unwrap(), []);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn workers_split_the_rank_and_round_robin_restores_it(
            len in 0u64..3000, batch in 1u32..64, workers in 1u32..8, start_frac in 0.0f64..=1.0,
        ) {
            let batches = len.div_ceil(u64::from(batch));
            let start = ((batches as f64) * start_frac) as u64;
            let whole = worker_batches(len, batch, &wp(1, 0, 0)).unwrap();
            // The single-worker run from 0 is the rank's batches in order, tiling the sequence.
            prop_assert_eq!(whole.len() as u64, batches);
            let mut next = 0;
            for (j, r) in whole.iter().enumerate() {
                prop_assert_eq!(r.start, next);
                prop_assert!(r.end - r.start == u64::from(batch) || j + 1 == whole.len());
                next = r.end;
            }
            prop_assert_eq!(next, len);
            // From any resume point, the workers together deliver exactly the tail, each batch
            // once, and torch's round-robin puts it back in rank order.
            let per_worker: Vec<Vec<Range<u64>>> =
                (0..workers).map(|w| worker_batches(len, batch, &wp(workers, w, start)).unwrap()).collect();
            prop_assert_eq!(round_robin(&per_worker), &whole[start as usize..]);
        }

        #[test]
        fn resuming_continues_the_uninterrupted_run(
            len in 0u64..3000, batch in 1u32..64, workers in 1u32..8, start_frac in 0.0f64..=1.0,
        ) {
            // A job that yielded s batches and restarts gets, per worker, the tail of what that
            // worker would have delivered had the job not stopped, re-based so workers rotate
            // from batch s: so the rank-level sequences must agree.
            let batches = len.div_ceil(u64::from(batch));
            let s = ((batches as f64) * start_frac) as u64;
            let uninterrupted: Vec<Vec<Range<u64>>> =
                (0..workers).map(|w| worker_batches(len, batch, &wp(workers, w, 0)).unwrap()).collect();
            let resumed: Vec<Vec<Range<u64>>> =
                (0..workers).map(|w| worker_batches(len, batch, &wp(workers, w, s)).unwrap()).collect();
            prop_assert_eq!(round_robin(&resumed), &round_robin(&uninterrupted)[s as usize..]);
        }
    }
}
