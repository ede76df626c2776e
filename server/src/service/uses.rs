//! The prefetcher's view of a rank's plan (which shards it draws on, first and last use),
//! computed once per (dataset, epoch parameters) and shared by the rank's DataLoader worker
//! streams. Every worker of a rank follows the same rank sequence, and the next epoch's future
//! of one stream is the current epoch's future of the streams that come next: without sharing,
//! each of `K` workers walked two whole epoch plans at start-up.
//!
//! Concurrent streams asking for the same plan wait for one walk (`OnceLock`). Entries are
//! O(shards the rank uses) each (for Parquet, stretches of a file's use: at most one per row
//! group) and at most [`ENTRIES`] are kept, oldest first out.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use crate::Result;
use crate::index::Dataset;
use crate::plan::{EpochParams, RankStream};
use crate::prefetch::{ShardUse, uses_streamed};

/// Plans kept: a node's ranks times two epochs, with room for a few jobs.
pub const ENTRIES: usize = 64;

/// (dataset, fingerprint, epoch parameters, uses by plan unit rather than shard).
type Key = (String, String, EpochParams, bool);

/// A walk's result as waiters share it: `None` if the walk failed (each caller then walks for
/// itself and gets the error).
type Cell = Arc<OnceLock<Option<Arc<[ShardUse]>>>>;

#[derive(Debug, Default)]
pub struct UsesCache {
    entries: Mutex<VecDeque<(Key, Cell)>>,
    /// Whole-plan walks done (a test checks that workers share them).
    pub walks: AtomicU64,
}

impl UsesCache {
    /// The shard uses of rank `p.rank`'s sequence in epoch `p.epoch`, positions from 0;
    /// `plan_units` is the plan's input (`Dataset::plan_units`). With `by_unit`, the uses of the
    /// plan's units instead (`prefetch::uses_streamed`).
    pub fn uses(&self, ds: &Dataset, plan_units: &[u64], p: &EpochParams, by_unit: bool) -> Result<Arc<[ShardUse]>> {
        let key = (ds.url.clone(), ds.fingerprint.clone(), *p, by_unit);
        let cell = {
            let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            match entries.iter().find(|(k, _)| *k == key) {
                Some((_, c)) => c.clone(),
                None => {
                    let c = Cell::default();
                    entries.push_back((key, c.clone()));
                    if entries.len() > ENTRIES {
                        entries.pop_front();
                    }
                    c
                }
            }
        };
        let walk = || -> Result<Arc<[ShardUse]>> {
            self.walks.fetch_add(1, Relaxed);
            let mut seq = RankStream::new(plan_units, p)?;
            Ok(uses_streamed(ds, &mut seq, 0, by_unit)?.into())
        };
        match cell.get_or_init(|| walk().ok()) {
            Some(u) => Ok(u.clone()),
            None => walk(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{Backends, Registry};

    fn write_shards(dir: &std::path::Path, shards: usize, per_shard: usize) {
        std::fs::create_dir_all(dir).unwrap();
        for s in 0..shards {
            let f = std::fs::File::create(dir.join(format!("part-{s:04}.tar"))).unwrap();
            let mut b = tar::Builder::new(f);
            for i in 0..per_shard {
                let data = [s as u8, i as u8];
                let mut h = tar::Header::new_gnu();
                h.set_size(2);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, format!("k{s:04}_{i:04}.bin"), &data[..]).unwrap();
            }
            b.finish().unwrap();
        }
    }

    /// A local TAR dataset of `shards` shards of `per_shard` samples, opened (with the directory
    /// that holds it).
    fn dataset(shards: usize, per_shard: usize) -> (tempfile::TempDir, Arc<crate::index::Dataset>) {
        let tmp = tempfile::tempdir().unwrap();
        write_shards(&tmp.path().join("d"), shards, per_shard);
        let reg = Registry::new(None, Arc::new(Backends::local()));
        let ds = reg.open(&tmp.path().join("d").display().to_string(), "").unwrap();
        (tmp, ds)
    }

    #[test]
    fn workers_of_a_rank_share_one_walk_per_epoch() {
        let (_tmp, ds) = dataset(30, 10);
        let samples = ds.shard_samples();
        let cache = UsesCache::default();
        let p = EpochParams {
            seed: 3,
            epoch: 0,
            shuffle: true,
            window_shards: 2,
            world_size: 2,
            rank: 1,
            batch_size: 4,
            drop_last: false,
        };
        // Four workers at once, each asking for this epoch and the next.
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let this = cache.uses(&ds, &samples, &p, false).unwrap();
                    let next = cache.uses(&ds, &samples, &EpochParams { epoch: 1, ..p }, false).unwrap();
                    assert!(!this.is_empty() && !next.is_empty());
                });
            }
        });
        assert_eq!(cache.walks.load(Relaxed), 2, "one walk per epoch plan, shared by the workers");
        // The same spans as a walk of its own, and every shard of the rank's share appears.
        let got = cache.uses(&ds, &samples, &p, false).unwrap();
        let mut own = RankStream::new(&samples, &p).unwrap();
        assert_eq!(&got[..], &crate::prefetch::shard_uses_streamed(&ds, &mut own, 0).unwrap()[..]);
        assert_eq!(got.iter().map(|u| u.first).min(), Some(0));
        assert_eq!(got.iter().map(|u| u.last).max(), Some(own.len() - 1));
        // A TAR shard is one stretch of use, however far apart its samples come.
        let mut shards: Vec<u32> = got.iter().map(|u| u.shard).collect();
        shards.sort_unstable();
        shards.dedup();
        assert_eq!(shards.len(), got.len());
        // Another rank is another plan.
        cache.uses(&ds, &samples, &EpochParams { rank: 0, ..p }, false).unwrap();
        assert_eq!(cache.walks.load(Relaxed), 3);
    }

    #[test]
    fn uses_further_apart_than_the_gap_are_stretches_of_their_own() {
        use crate::prefetch::{ShardUse, UseSpans};
        let (_tmp, ds) = dataset(3, 10);
        // Positions 0..8: shard 0, 0, 1, 2, 1, 2, 2, 0 (ids 0-9 are shard 0, 10-19 shard 1, ...).
        let ids = [0, 1, 10, 20, 11, 21, 22, 2];
        let span = |shard, first, last| ShardUse { shard, first, last };
        assert_eq!(
            UseSpans::of(&ds, &ids, 2, false),
            [span(0, 0, 1), span(1, 2, 4), span(2, 3, 6), span(0, 7, 7)],
            "shard 0 is unused for 6 positions: a second stretch"
        );
        assert_eq!(UseSpans::of(&ds, &ids, u64::MAX, false), [span(0, 0, 7), span(1, 2, 4), span(2, 3, 6)]);
    }

    #[test]
    fn the_uses_of_a_stream_caching_row_groups_name_the_plan_s_units() {
        use crate::format::parquet::testdata::{Codec, mixed};
        use crate::prefetch::{ShardUse, UseSpans};
        // Two files of 4 row groups of 10 rows: units 0-3 are file 0's, 4-7 file 1's.
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("d");
        std::fs::create_dir_all(&dir).unwrap();
        for k in 0..2 {
            std::fs::write(dir.join(format!("part-{k}.parquet")), mixed(40, 10, Codec::None)).unwrap();
        }
        let reg = Registry::new(None, Arc::new(Backends::local()));
        let ds = reg.open(&dir.display().to_string(), "").unwrap();
        assert_eq!(ds.plan_units(), [10; 8]);
        let ids = [0, 15, 40, 79, 11, 1];
        let span = |shard, first, last| ShardUse { shard, first, last };
        assert_eq!(
            UseSpans::of(&ds, &ids, u64::MAX, true),
            [span(0, 0, 5), span(1, 1, 4), span(4, 2, 2), span(7, 3, 3)]
        );
        assert_eq!(UseSpans::of(&ds, &ids, u64::MAX, false), [span(0, 0, 5), span(1, 2, 3)]);
        // A whole plan's walk by unit names every unit once and only units.
        let p = EpochParams {
            seed: 1,
            epoch: 0,
            shuffle: true,
            window_shards: 2,
            world_size: 1,
            rank: 0,
            batch_size: 4,
            drop_last: false,
        };
        let by_unit = UsesCache::default().uses(&ds, &ds.plan_units(), &p, true).unwrap();
        let mut units: Vec<u32> = by_unit.iter().map(|u| u.shard).collect();
        units.sort_unstable();
        units.dedup();
        assert_eq!(units, (0..8).collect::<Vec<u32>>());
    }

    #[test]
    fn the_cache_is_bounded() {
        let (_tmp, ds) = dataset(3, 2);
        let samples = ds.shard_samples();
        let cache = UsesCache::default();
        for epoch in 0..(ENTRIES as u64 + 10) {
            let p = EpochParams {
                seed: 0,
                epoch,
                shuffle: true,
                window_shards: 1,
                world_size: 1,
                rank: 0,
                batch_size: 1,
                drop_last: false,
            };
            cache.uses(&ds, &samples, &p, false).unwrap();
        }
        assert_eq!(cache.entries.lock().unwrap().len(), ENTRIES);
    }
}
