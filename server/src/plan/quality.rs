//! Shuffle-quality figures, so that tuning the plan (window size, partitioning) is measured
//! rather than guessed, in the spirit of MosaicML streaming's shuffle simulator. A uniform random
//! permutation ([`random_permutation`]) is the reference: it is the best any shuffle can do, and
//! the plan trades some of that for locality (a consumer reads few shards at a time).
//!
//! The figures take an *order*: a sequence of global sample ids, position by position. Ids are
//! the natural (unshuffled) order of the dataset, so "how far did a sample move" is
//! `|position - id|`. A rank's sequence or the padded union of all ranks is not a permutation of
//! `0..len`; [`to_permutation`] relabels it into one first. Pure functions; they never panic on
//! odd input (ids out of range, empty orders) and say what they return for it.

use super::shuffle::Rng;

/// Mean of `|position - id| / N` over an order that is a permutation of `0..N`: 0 for the
/// identity, about 1/3 for a uniform random permutation (the expected distance between two
/// independent uniform points of `[0, 1]`), at most about 1/2 (the reversal). Ids outside `0..N`
/// still count with their distance. 0 for an empty order.
pub fn mean_normalized_displacement(order: &[u64]) -> f64 {
    let n = order.len();
    if n == 0 {
        return 0.0;
    }
    let total: f64 = order.iter().enumerate().map(|(pos, &id)| (pos as f64 - id as f64).abs()).sum();
    total / (n as f64 * n as f64)
}

/// Replaces every id by its rank among the order's ids (equal ids ranked by position), giving a
/// permutation of `0..len` that keeps the relative natural order. Turns a rank's sequence (ids
/// from all over the dataset) or the union of ranks (padding repeats some ids) into something
/// [`mean_normalized_displacement`] and [`mean_neighbour_distance`] can score.
pub fn to_permutation(order: &[u64]) -> Vec<u64> {
    let mut by_id: Vec<usize> = (0..order.len()).collect();
    by_id.sort_by_key(|&pos| (order[pos], pos));
    let mut out = vec![0u64; order.len()];
    for (rank, pos) in by_id.into_iter().enumerate() {
        out[pos] = rank as u64;
    }
    out
}

/// For an order that is a permutation of `0..N`: the mean distance, in positions and divided by
/// `N`, between samples that were neighbours in the natural order (ids `i` and `i + 1`): about
/// 1/3 for a uniform random permutation, `1/N` when neighbours stay together. Catches what the
/// displacement alone hides: a shuffle that moves whole shards far but keeps each shard's samples
/// together scores high on displacement and near 0 here. Ids outside `0..N` are ignored; 0 for
/// fewer than two samples.
pub fn mean_neighbour_distance(order: &[u64]) -> f64 {
    let n = order.len();
    if n < 2 {
        return 0.0;
    }
    let mut position = vec![None; n];
    for (pos, &id) in order.iter().enumerate() {
        if let Some(slot) = usize::try_from(id).ok().and_then(|id| position.get_mut(id)) {
            *slot = Some(pos);
        }
    }
    let (mut sum, mut pairs) = (0f64, 0u64);
    for pair in position.windows(2) {
        if let [Some(a), Some(b)] = *pair {
            sum += a.abs_diff(b) as f64;
            pairs += 1;
        }
    }
    if pairs == 0 { 0.0 } else { sum / pairs as f64 / n as f64 }
}

/// Maps global sample ids to their shard (shard `i` owns ids `prefix[i] .. prefix[i + 1]`).
struct ShardOf {
    /// Global id one past each shard's last sample.
    ends: Vec<u64>,
}

impl ShardOf {
    fn new(shard_samples: &[u64]) -> Self {
        // Saturating: a dataset this large cannot be a real order's; ids past it map to `None`.
        let ends = shard_samples.iter().scan(0u64, |acc, &n| {
            *acc = acc.saturating_add(n);
            Some(*acc)
        });
        Self { ends: ends.collect() }
    }

    /// The shard holding `id`, or `None` past the dataset's end.
    fn get(&self, id: u64) -> Option<usize> {
        let shard = self.ends.partition_point(|&end| end <= id);
        (shard < self.ends.len()).then_some(shard)
    }
}

/// Fraction of consecutive pairs of the order that come from the same shard. With `S` shards of
/// equal size: about `1/S` for a uniform random permutation, `1 - (S - 1)/(N - 1)` for no shuffle.
/// High values mean batches are made of few shards, which correlates the samples a step sees.
/// Ids outside the dataset never match; 0 for fewer than two samples.
pub fn same_shard_adjacency(order: &[u64], shard_samples: &[u64]) -> f64 {
    if order.len() < 2 {
        return 0.0;
    }
    let shard_of = ShardOf::new(shard_samples);
    let shards: Vec<Option<usize>> = order.iter().map(|&id| shard_of.get(id)).collect();
    let same = shards.windows(2).filter(|p| p[0].is_some() && p[0] == p[1]).count();
    same as f64 / (order.len() - 1) as f64
}

/// Distinct shards among `window` consecutive samples of an order, over every position: what a
/// consumer needs resident to deliver the next `window` samples (its working set).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkingSet {
    /// The largest working set at any position.
    pub max: usize,
    /// The mean over positions.
    pub mean: f64,
}

/// The [`WorkingSet`] of an order over windows of `window` samples (clamped to `1..=len`; every
/// full window when `len >= window`, else the whole order once). Ids outside the dataset are not
/// counted. All zero for an empty order.
pub fn shards_in_window(order: &[u64], shard_samples: &[u64], window: usize) -> WorkingSet {
    let shard_of = ShardOf::new(shard_samples);
    let shards: Vec<Option<usize>> = order.iter().map(|&id| shard_of.get(id)).collect();
    let window = window.clamp(1, shards.len().max(1));
    let mut count = vec![0usize; shard_samples.len()];
    let mut distinct = 0usize;
    let (mut max, mut sum, mut windows) = (0usize, 0f64, 0usize);
    for (i, &entering) in shards.iter().enumerate() {
        if let Some(s) = entering {
            count[s] += 1;
            distinct += usize::from(count[s] == 1);
        }
        if let Some(&Some(s)) = i.checked_sub(window).and_then(|out| shards.get(out)) {
            count[s] -= 1;
            distinct -= usize::from(count[s] == 0);
        }
        if i + 1 >= window {
            max = max.max(distinct);
            sum += distinct as f64;
            windows += 1;
        }
    }
    WorkingSet { max, mean: if windows == 0 { 0.0 } else { sum / windows as f64 } }
}

/// A uniform random permutation of `0..n` from our own generator: the reference a shuffle is
/// compared with. Empty if `n` ids do not fit in memory.
pub fn random_permutation(n: u64, seed: u64) -> Vec<u64> {
    let mut order = Vec::new();
    let Some(()) = usize::try_from(n).ok().and_then(|len| order.try_reserve_exact(len).ok()) else {
        return order;
    };
    order.extend(0..n);
    Rng::new(seed).shuffle(&mut order);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_values() {
        let n = 10_000u64;
        let identity: Vec<u64> = (0..n).collect();
        assert_eq!(mean_normalized_displacement(&identity), 0.0);
        assert!(mean_neighbour_distance(&identity) <= 1.0 / n as f64);
        let random = random_permutation(n, 1);
        let d = mean_normalized_displacement(&random);
        assert!((d - 1.0 / 3.0).abs() < 0.02, "{d}");
        let nd = mean_neighbour_distance(&random);
        assert!((nd - 1.0 / 3.0).abs() < 0.02, "{nd}");
        let reversed: Vec<u64> = (0..n).rev().collect();
        assert!((mean_normalized_displacement(&reversed) - 0.5).abs() < 0.01);
        assert_eq!(mean_normalized_displacement(&[]), 0.0);
        assert_eq!(mean_neighbour_distance(&[7]), 0.0);
        assert!(random_permutation(u64::MAX, 0).is_empty(), "too large: empty, not an abort");
    }

    #[test]
    fn relabelling_keeps_relative_order() {
        assert_eq!(to_permutation(&[50, 10, 30, 10]), [3, 0, 2, 1]);
        assert!(to_permutation(&[]).is_empty());
    }

    #[test]
    fn shard_figures() {
        let shards = [3, 0, 2];
        let plain = [0, 1, 2, 3, 4];
        // Pairs (0,1) (1,2) same shard 0, (2,3) crosses, (3,4) same shard 2.
        assert_eq!(same_shard_adjacency(&plain, &shards), 0.75);
        assert_eq!(same_shard_adjacency(&[0, 3, 1, 4, 2], &shards), 0.0);
        assert_eq!(same_shard_adjacency(&[9, 9], &shards), 0.0);
        assert_eq!(shards_in_window(&plain, &shards, 2), WorkingSet { max: 2, mean: 1.25 });
        assert_eq!(shards_in_window(&plain, &shards, 100), WorkingSet { max: 2, mean: 2.0 });
        assert_eq!(shards_in_window(&[], &shards, 3), WorkingSet { max: 0, mean: 0.0 });
        assert_eq!(shards_in_window(&[0, 99, 4], &shards, 0), WorkingSet { max: 1, mean: 2.0 / 3.0 });
    }
}
