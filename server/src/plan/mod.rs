//! The epoch plan: which rank and DataLoader worker gets which sample, in which order. Pure
//! functions of (per-shard sample counts, seed, epoch, world size, rank, batch size, workers): no
//! I/O, no clocks, no platform-dependent randomness, so every rank computes its own share on its
//! own, the prefetcher knows the future, and a resumed job recomputes exactly the order it left.
//! This module owns the order; it does not own where samples come from (`index`, `format`) nor
//! how they travel (`transport`).
//!
//! # The exactly-once contract
//!
//! Input: the sample count of every shard, in manifest order. Shard `i`'s samples have the global
//! ids `prefix[i] .. prefix[i + 1]` (`prefix` is the running sum of the counts; empty shards are
//! allowed and own no id). `N` is the total, `W` the world size, `B` the batch size.
//!
//! 1. **Shard order.** With `shuffle`, the shards are put in a uniformly random order drawn from
//!    a generator seeded by (seed, epoch), so every epoch has its own order and all ranks agree on
//!    it; without, in manifest order ([`shard_order`]). The *sample stream* `S` is every shard's
//!    samples, shards in that order, samples in their in-shard order.
//! 2. **Rank shares, equal on every rank** (a rank with one batch fewer would hang DDP's
//!    collectives). Without `drop_last`: `L = ceil(N / W)`, and `S` is extended to `W * L`
//!    samples by repeating it from its start. This is the padding rule of torch's
//!    `DistributedSampler`: `W * L - N < W` samples are delivered twice (`padded_samples`), more
//!    than one full repeat only when `N < W`. With `drop_last`: `L = floor(floor(N / W) / B) * B`,
//!    so every batch is full and every rank has the same count; the tail of `S` beyond `W * L` is
//!    not delivered (`dropped_samples`; the same samples whichever rank asks, and `L` may be 0
//!    when a rank's share would not fill one batch). Rank `r` gets the contiguous slice
//!    `S[r * L .. (r + 1) * L]`: contiguous so that a rank needs only about `1 / W` of the
//!    shards, and a few at a time.
//! 3. **Window shuffle inside a rank's share** (with `shuffle`): a sliding window of
//!    `window = max(1, window_shards * ceil(N / num_shards))` samples (empty shards count in
//!    `num_shards`), seeded by (seed, epoch, rank): the share is taken in chunks of half a
//!    window, and each output block is the previous chunk's leftovers plus a random part of the
//!    next chunk, shuffled together ([`shuffle::window_shuffle`]). The rank sequence is a
//!    permutation of its share. `window_shards = 0` means *no in-rank shuffle*: the share stays in
//!    stream order and only the shard order is shuffled.
//!
//!    Locality, with a hard bound: a sample moves by less than `window` positions, so any
//!    `window` consecutive outputs come from at most three windows of input, about
//!    `3 * window_shards + 2` shards, whatever the shard size. This is what the prefetcher relies
//!    on; a plain shuffle buffer would leave a geometric tail of stragglers that keeps old shards
//!    in use (`window_shards * (1 + ln s)` shards for `s` samples per shard).
//!    `plan_tests::window_keeps_few_shards_in_use` holds the plan to the bound.
//! 4. **Batches and DataLoader workers.** The rank sequence is cut into batches of `B` (without
//!    `drop_last` the last one may be short). Worker `w` of `K` delivers the rank's batches
//!    `start_batch + w`, `start_batch + w + K`, `start_batch + w + 2K`, ... ([`worker_batches`]):
//!    torch's DataLoader takes one batch from each worker in turn, so it re-creates the rank's
//!    batch order exactly; and a job resumed with `start_batch = s` (the number of batches the
//!    rank had already yielded) continues that same sequence, with no batch lost or repeated.
//!    `start_batch` equal to the batch count is a finished epoch (nothing left); beyond is an
//!    error.
//! 5. **Randomness** is our own SplitMix64 + xoshiro256\*\* with Lemire's unbiased bounded
//!    integers ([`shuffle`]): the same inputs give the same order on every machine and with every
//!    build; golden tests pin it. Changing any of this changes every user's order and invalidates
//!    their saved resume states, so it is a versioned, deliberate act.
//!
//! Every function validates its input first and returns a [`PlanError`] naming the offending
//! value; none panics, whatever the input.

pub mod lazy;
pub mod partition;
pub mod quality;
pub mod shuffle;

pub use lazy::{RankStream, WorkerBatches};
pub use partition::{summarize, worker_batches};
pub use shuffle::{Rng, shard_order, window_samples};

/// Largest world size accepted: about ten times the largest training jobs run today (~100,000
/// GPUs). A larger value is a unit or wiring mistake, not a job; the limit also keeps every
/// product of a per-rank count with the world size far from overflow.
pub const MAX_WORLD_SIZE: u32 = 1 << 20;

/// Largest batch size accepted, in samples per rank and step: far beyond any real per-rank batch
/// (they are in the thousands at most), so a larger one is a mistake.
pub const MAX_BATCH_SIZE: u32 = 1 << 24;

/// Most shards a dataset can have: shard indices are `u32` ([`shard_order`]).
pub const MAX_SHARDS: u64 = 1 << 32;

/// Most samples a dataset can have: ~2.8e14, five orders of magnitude above the largest public
/// datasets (LAION-5B has 5.85e9 samples). Bounding it keeps all sample arithmetic (shares times
/// world size, batch indices times batch size) far from `u64` overflow.
pub const MAX_TOTAL_SAMPLES: u64 = 1 << 48;

/// A plan that cannot be made; the message names the offending value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("world size must be at least 1, got 0")]
    ZeroWorldSize,
    #[error("world size {world_size} exceeds the limit of {MAX_WORLD_SIZE}")]
    WorldSizeTooLarge { world_size: u32 },
    #[error("rank {rank} is out of range for world size {world_size}")]
    RankOutOfRange { rank: u32, world_size: u32 },
    #[error("batch size must be at least 1, got 0")]
    ZeroBatchSize,
    #[error("batch size {batch_size} exceeds the limit of {MAX_BATCH_SIZE}")]
    BatchSizeTooLarge { batch_size: u32 },
    #[error("num_workers must be at least 1, got 0")]
    ZeroWorkers,
    #[error("worker {worker} is out of range for {num_workers} workers")]
    WorkerOutOfRange { worker: u32, num_workers: u32 },
    #[error("start batch {start_batch} is past the end of the epoch ({batches} batches per rank)")]
    StartPastEnd { start_batch: u64, batches: u64 },
    #[error("the dataset has no samples ({shards} shards listed)")]
    EmptyDataset { shards: usize },
    #[error("the dataset has {shards} shards, more than the limit of {MAX_SHARDS}")]
    TooManyShards { shards: usize },
    #[error("{samples} samples exceed the limit of {MAX_TOTAL_SAMPLES}")]
    TooManySamples { samples: u64 },
    #[error("{what} overflows 64-bit arithmetic")]
    Overflow { what: &'static str },
    #[error("cannot allocate memory for {samples} entries of the plan")]
    OutOfMemory { samples: u64 },
    /// `largest`: the most samples one shard (or Parquet row group) holds. A window spans whole
    /// ones, so when one alone is near the limit no shuffle_window helps.
    #[error(
        "the shuffle would hold {window} sample ids at once, over the limit of {limit} a stream may hold: \
         a shuffle window spans whole shards (or Parquet row groups), and this dataset's hold up to {largest} \
         samples each; use a smaller shuffle_window if it is above 1, smaller shards or row groups, more \
         ranks, or shuffle=False"
    )]
    WindowTooLarge { window: u64, limit: u64, largest: u64 },
    #[error("plan position {position} is behind the stream's cursor at {cursor}; the plan only moves forward")]
    Rewind { position: u64, cursor: u64 },
}

/// The parameters of one rank's epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EpochParams {
    pub seed: u64,
    pub epoch: u64,
    /// Shuffle the shard order and, if `window_shards > 0`, the samples inside each rank's share.
    pub shuffle: bool,
    /// Size of the in-rank shuffle buffer, in average shards; 0 = no in-rank shuffle.
    pub window_shards: u32,
    pub world_size: u32,
    pub rank: u32,
    /// Samples per batch, per rank.
    pub batch_size: u32,
    /// Deliver only full batches (see the module docs for what is dropped).
    pub drop_last: bool,
}

/// Which DataLoader worker of the rank this is, and where the rank resumes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkerParams {
    pub num_workers: u32,
    pub worker: u32,
    /// Batches the rank (all its workers together) has already yielded this epoch.
    pub start_batch: u64,
}

/// The epoch's totals, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EpochSummary {
    /// `N`, the samples in the dataset.
    pub total_samples: u64,
    /// `L`, the length of every rank's sequence.
    pub samples_per_rank: u64,
    /// `ceil(L / B)`, the same on every rank.
    pub batches_per_rank: u64,
    /// Samples delivered twice so that the ranks are equal (without `drop_last`): `W * L - N`.
    pub padded_samples: u64,
    /// Samples not delivered at all (with `drop_last`): `N - W * L`.
    pub dropped_samples: u64,
}

/// Rank `p.rank`'s sample ids for the epoch, in delivery order: `samples_per_rank` global ids, a
/// permutation of the rank's share (see the module docs). O(L) memory: the daemon streams the
/// same sequence through [`RankStream`] (O(window) memory); this eager form is the reference the
/// lazy one is tested against.
pub fn rank_sequence(shard_samples: &[u64], p: &EpochParams) -> Result<Vec<u64>, PlanError> {
    let summary = summarize(shard_samples, p)?;
    let n = summary.total_samples;
    let order = shard_order(shard_samples.len(), p.seed, p.epoch, p.shuffle);
    let mut sequence = partition::rank_share(shard_samples, &order, n, p.rank, summary.samples_per_rank)?;
    if p.shuffle {
        let window = window_samples(n, shard_samples.len(), p.window_shards);
        shuffle::window_shuffle(&mut sequence, window, &mut shuffle::window_rng(p.seed, p.epoch, p.rank));
    }
    Ok(sequence)
}

#[cfg(test)]
mod plan_tests {
    //! Properties of the whole plan: permutations, exactly-once across ranks and workers, equal
    //! batch counts, determinism, epochs, resume-equivalence, window locality, every invalid
    //! parameter, and a golden order.

    use std::collections::HashMap;
    use std::ops::Range;

    use proptest::prelude::*;

    use super::*;

    fn params(seed: u64, world_size: u32, batch_size: u32, drop_last: bool, shuffle: bool) -> EpochParams {
        EpochParams { seed, epoch: 0, shuffle, window_shards: 2, world_size, rank: 0, batch_size, drop_last }
    }

    /// 0..50 shards (empty ones included) of 0..200 samples, at least one sample overall.
    fn shards_strategy() -> impl Strategy<Value = Vec<u64>> {
        prop::collection::vec(prop_oneof![1 => Just(0u64), 4 => 0u64..200], 1..50)
            .prop_filter("at least one sample", |v| v.iter().sum::<u64>() > 0)
    }

    /// The sample stream `S` of the module docs, built the obvious way (independently of
    /// `partition::rank_share`).
    fn stream(shards: &[u64], order: &[u32]) -> Vec<u64> {
        let prefix: Vec<u64> = std::iter::once(0)
            .chain(shards.iter().scan(0, |acc, &n| {
                *acc += n;
                Some(*acc)
            }))
            .collect();
        order.iter().flat_map(|&s| prefix[s as usize]..prefix[s as usize + 1]).collect()
    }

    fn sorted(mut v: Vec<u64>) -> Vec<u64> {
        v.sort_unstable();
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn ranks_share_the_dataset_exactly_once(
            shards in shards_strategy(), world in 1u32..64, batch in 1u32..64,
            drop_last: bool, shuffle: bool, window_shards in 0u32..4, seed: u64, epoch in 0u64..4,
        ) {
            let n: u64 = shards.iter().sum();
            let p = EpochParams { window_shards, epoch, ..params(seed, world, batch, drop_last, shuffle) };
            let summary = summarize(&shards, &p).unwrap();
            let len = summary.samples_per_rank;
            prop_assert_eq!(summary.total_samples, n);
            prop_assert_eq!(summary.batches_per_rank, len.div_ceil(u64::from(batch)));
            let s = stream(&shards, &shard_order(shards.len(), seed, epoch, shuffle));
            let mut counts: HashMap<u64, u64> = HashMap::new();
            for rank in 0..world {
                let p = EpochParams { rank, ..p };
                // The same totals whatever the rank asking: equal batch counts, no DDP hang.
                prop_assert_eq!(summarize(&shards, &p).unwrap(), summary);
                let seq = rank_sequence(&shards, &p).unwrap();
                prop_assert_eq!(seq.len() as u64, len);
                let share: Vec<u64> = (u64::from(rank) * len..(u64::from(rank) + 1) * len)
                    .map(|i| s[(i % n) as usize])
                    .collect();
                if !(shuffle && window_shards > 0) {
                    prop_assert_eq!(&seq, &share, "without the window shuffle, the share in stream order");
                }
                prop_assert_eq!(sorted(seq.clone()), sorted(share), "rank {} is a permutation of its share", rank);
                for id in seq {
                    *counts.entry(id).or_default() += 1;
                }
            }
            let delivered: u64 = counts.values().sum();
            if drop_last {
                prop_assert_eq!(summary.padded_samples, 0);
                prop_assert!(counts.values().all(|&c| c == 1), "a sample delivered twice with drop_last");
                prop_assert_eq!(delivered, n - summary.dropped_samples);
                prop_assert_eq!(len % u64::from(batch), 0, "every batch full");
                // The dropped samples are the tail of S, the same whichever rank asks.
                let kept = s[..(n - summary.dropped_samples) as usize].to_vec();
                prop_assert_eq!(sorted(counts.keys().copied().collect()), sorted(kept));
            } else {
                prop_assert_eq!(summary.dropped_samples, 0);
                prop_assert_eq!(counts.len() as u64, n, "every sample delivered");
                prop_assert_eq!(delivered, n + summary.padded_samples);
                prop_assert!(summary.padded_samples < u64::from(world));
                // The repeats are S from its start: the first `padded` stream samples, cycling.
                let repeats: Vec<u64> =
                    counts.iter().flat_map(|(&id, &c)| std::iter::repeat_n(id, c as usize - 1)).collect();
                let expected: Vec<u64> = (0..summary.padded_samples).map(|i| s[(i % n) as usize]).collect();
                prop_assert_eq!(sorted(repeats), sorted(expected));
            }
        }

        #[test]
        fn workers_deliver_the_rank_sequence_and_resume_exactly(
            shards in shards_strategy(), world in 1u32..64, batch in 1u32..64, workers in 1u32..8,
            drop_last: bool, shuffle: bool, seed: u64, start_frac in 0.0f64..=1.0,
        ) {
            let p = EpochParams { rank: seed as u32 % world, ..params(seed, world, batch, drop_last, shuffle) };
            let summary = summarize(&shards, &p).unwrap();
            let seq = rank_sequence(&shards, &p).unwrap();
            let len = seq.len() as u64;
            let start = ((summary.batches_per_rank as f64) * start_frac) as u64;
            let worker = |worker| WorkerParams { num_workers: workers, worker, start_batch: start };
            let per_worker: Vec<Vec<Range<u64>>> =
                (0..workers).map(|w| worker_batches(len, batch, &worker(w)).unwrap()).collect();
            // torch's round-robin over the workers, mapped to sample ids.
            let longest = per_worker.iter().map(Vec::len).max().unwrap_or(0);
            let mut delivered = Vec::new();
            let mut batches = 0u64;
            for j in 0..longest {
                for w in &per_worker {
                    if let Some(r) = w.get(j) {
                        let full = r.end - r.start == u64::from(batch);
                        prop_assert!(full || r.end == len, "only the last batch is short");
                        delivered.extend_from_slice(&seq[r.start as usize..r.end as usize]);
                        batches += 1;
                    }
                }
            }
            // From batch `start` on, the workers together deliver the rank's sequence, in order,
            // each batch once: the tail of the uninterrupted run.
            let skipped = (start * u64::from(batch)).min(len) as usize;
            prop_assert_eq!(&delivered[..], &seq[skipped..]);
            prop_assert_eq!(batches, summary.batches_per_rank - start);
        }

        #[test]
        fn plans_are_deterministic(
            shards in shards_strategy(), world in 1u32..64, batch in 1u32..64, drop_last: bool, seed: u64,
        ) {
            let p = EpochParams { rank: world - 1, ..params(seed, world, batch, drop_last, true) };
            prop_assert_eq!(rank_sequence(&shards, &p).unwrap(), rank_sequence(&shards, &p).unwrap());
            prop_assert_eq!(summarize(&shards, &p).unwrap(), summarize(&shards, &p).unwrap());
        }

        #[test]
        fn epochs_give_different_orders(
            shards in prop::collection::vec(1u64..200, 12..50), seed: u64, epoch in 0u64..1000,
            window_shards in 0u32..4,
        ) {
            // At least 12 non-empty shards: two uniform shard orders coincide with probability
            // at most 1/12! ~ 2e-9, so a failure is a bug, not bad luck.
            let p = EpochParams { epoch, window_shards, ..params(seed, 1, 8, false, true) };
            let next = EpochParams { epoch: epoch + 1, ..p };
            prop_assert_ne!(rank_sequence(&shards, &p).unwrap(), rank_sequence(&shards, &next).unwrap());
        }

        #[test]
        fn window_keeps_few_shards_in_use(
            sizes in prop::collection::vec(20u64..40, 100..200), window_shards in 1u32..6,
            world in 1u32..4, seed: u64,
        ) {
            let p = EpochParams { window_shards, rank: seed as u32 % world, ..params(seed, world, 8, false, true) };
            let seq = rank_sequence(&sizes, &p).unwrap();
            let n: u64 = sizes.iter().sum();
            let window = window_samples(n, sizes.len(), window_shards);
            let used = quality::shards_in_window(&seq, &sizes, window as usize);
            // A sample moves by less than a window, so `window` outputs draw on at most three
            // windows of input: 3k shards' worth of samples, plus two partial shards at the edges
            // (shard sizes vary by up to 2x here, so count in the smallest shard). A global
            // shuffle would use ~`window` (100+) distinct shards.
            let min_shard = *sizes.iter().min().unwrap() as f64;
            let per_shard = n.div_ceil(sizes.len() as u64) as f64;
            let bound = (3.0 * f64::from(window_shards) * per_shard / min_shard).ceil() + 2.0;
            prop_assert!(
                used.max as f64 <= bound,
                "{} shards among {} samples (bound {:.1})", used.max, window, bound
            );
        }
    }

    #[test]
    fn golden_order() {
        // Pins the order of a small plan: a change here changes every user's sample order and
        // breaks their saved resume states. Update only deliberately, with a new state version.
        let shards = [3, 0, 4, 3, 5, 1];
        let p = EpochParams {
            seed: 0x5EED,
            epoch: 3,
            shuffle: true,
            window_shards: 1,
            world_size: 2,
            rank: 1,
            batch_size: 4,
            drop_last: false,
        };
        assert_eq!(shard_order(shards.len(), p.seed, p.epoch, true), GOLDEN_SHARD_ORDER);
        assert_eq!(rank_sequence(&shards, &p).unwrap(), GOLDEN_RANK_1);
        assert_eq!(rank_sequence(&shards, &EpochParams { rank: 0, ..p }).unwrap(), GOLDEN_RANK_0);
    }

    // Shards own ids 0..3, -, 3..7, 7..10, 10..15, 15; in shard order 2 3 0 4 1 5 the stream is
    // 3 4 5 6 7 8 9 0 | 1 2 10 11 12 13 14 15 (rank 0 | rank 1), each half shuffled in a window
    // of 1 * ceil(16 / 6) = 3 samples.
    const GOLDEN_SHARD_ORDER: [u32; 6] = [2, 3, 0, 4, 1, 5];
    const GOLDEN_RANK_0: [u64; 8] = [4, 3, 5, 6, 7, 8, 9, 0];
    const GOLDEN_RANK_1: [u64; 8] = [1, 10, 2, 11, 13, 12, 14, 15];

    #[test]
    fn no_shuffle_is_the_natural_order() {
        let shards = vec![100; 30];
        let p = EpochParams { window_shards: 4, ..params(1, 1, 8, false, false) };
        assert_eq!(rank_sequence(&shards, &p).unwrap(), (0..3000).collect::<Vec<_>>());
        let seeded = rank_sequence(&shards, &EpochParams { shuffle: true, ..p }).unwrap();
        assert_ne!(seeded, rank_sequence(&shards, &EpochParams { shuffle: true, seed: 2, ..p }).unwrap());
    }

    #[test]
    fn invalid_parameters_are_named() {
        let ok = params(0, 4, 8, false, true);
        let cases = [
            (EpochParams { world_size: 0, ..ok }, "world size must be at least 1, got 0"),
            (EpochParams { world_size: MAX_WORLD_SIZE + 1, rank: 0, ..ok }, "world size 1048577 exceeds the limit"),
            (EpochParams { rank: 4, ..ok }, "rank 4 is out of range for world size 4"),
            (EpochParams { rank: u32::MAX, ..ok }, "rank 4294967295 is out of range for world size 4"),
            (EpochParams { batch_size: 0, ..ok }, "batch size must be at least 1, got 0"),
            (EpochParams { batch_size: MAX_BATCH_SIZE + 1, ..ok }, "batch size 16777217 exceeds the limit"),
        ];
        for (p, needle) in cases {
            for e in [summarize(&[10, 10], &p).unwrap_err(), rank_sequence(&[10, 10], &p).unwrap_err()] {
                assert!(e.to_string().contains(needle), "{e} does not say {needle:?}");
            }
        }
        assert_eq!(summarize(&[0, 0], &ok).unwrap_err(), PlanError::EmptyDataset { shards: 2 });
        assert_eq!(rank_sequence(&[], &ok).unwrap_err().to_string(), "the dataset has no samples (0 shards listed)");
        assert!(matches!(summarize(&[u64::MAX, 1], &ok).unwrap_err(), PlanError::Overflow { .. }));
        assert_eq!(
            summarize(&[MAX_TOTAL_SAMPLES, 1], &ok).unwrap_err(),
            PlanError::TooManySamples { samples: MAX_TOTAL_SAMPLES + 1 }
        );

        let w = |num_workers, worker, start_batch| WorkerParams { num_workers, worker, start_batch };
        assert_eq!(worker_batches(10, 0, &w(1, 0, 0)).unwrap_err(), PlanError::ZeroBatchSize);
        assert_eq!(
            worker_batches(10, MAX_BATCH_SIZE + 1, &w(1, 0, 0)).unwrap_err(),
            PlanError::BatchSizeTooLarge { batch_size: MAX_BATCH_SIZE + 1 }
        );
        assert_eq!(
            worker_batches(10, 2, &w(0, 0, 0)).unwrap_err().to_string(),
            "num_workers must be at least 1, got 0"
        );
        assert_eq!(
            worker_batches(10, 2, &w(2, 2, 0)).unwrap_err().to_string(),
            "worker 2 is out of range for 2 workers"
        );
        assert_eq!(
            worker_batches(10, 2, &w(1, 0, 6)).unwrap_err().to_string(),
            "start batch 6 is past the end of the epoch (5 batches per rank)"
        );
        assert_eq!(
            worker_batches(10, 2, &w(1, 0, u64::MAX)).unwrap_err(),
            PlanError::StartPastEnd { start_batch: u64::MAX, batches: 5 }
        );
        assert!(worker_batches(10, 2, &w(1, 0, 5)).unwrap().is_empty(), "resuming a finished epoch is fine");
        assert!(matches!(worker_batches(u64::MAX, 1, &w(1, 0, 0)).unwrap_err(), PlanError::TooManySamples { .. }));
    }

    #[test]
    fn extreme_but_valid_inputs_do_not_panic() {
        // One sample, the largest world: every rank gets that sample (padding), one batch each.
        let p = EpochParams { world_size: MAX_WORLD_SIZE, rank: MAX_WORLD_SIZE - 1, ..params(0, 1, 1, false, true) };
        assert_eq!(rank_sequence(&[1], &p).unwrap(), [0]);
        let s = summarize(&[1], &p).unwrap();
        assert_eq!((s.padded_samples, s.batches_per_rank), (u64::from(MAX_WORLD_SIZE) - 1, 1));
        // The same with drop_last: nothing to deliver, every rank agrees.
        let p = EpochParams { drop_last: true, ..p };
        assert!(rank_sequence(&[1], &p).unwrap().is_empty());
        // Huge shard counts and windows, the largest batch, extreme seeds.
        let p = EpochParams {
            seed: u64::MAX,
            epoch: u64::MAX,
            window_shards: u32::MAX,
            batch_size: MAX_BATCH_SIZE,
            ..params(0, 3, 1, false, true)
        };
        let mut shards = vec![0u64; 100_000];
        shards[77_777] = 5;
        assert_eq!(sorted(rank_sequence(&shards, &p).unwrap()), [0, 1]);
        assert_eq!(
            worker_batches(
                2,
                MAX_BATCH_SIZE,
                &WorkerParams { num_workers: u32::MAX, worker: u32::MAX - 1, start_batch: 0 }
            )
            .unwrap(),
            []
        );
    }
}
