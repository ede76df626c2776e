//! A stream's working set ([`Working`]): the shards its last batches used, held open and pinned
//! between batches, and the time the stream waited for storage to get them (the consumer-wait
//! metric, taken per batch and when the stream fails).

use std::collections::hash_map::Entry;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use foldhash::HashMap;

use super::{CacheMode, Dataset, ResidentShard};
use crate::Result;
use crate::cache::EndedBy;

/// A stream's working set: the shards it used in its last batches, kept open (and pinned) so a
/// windowed shuffle that hops between a dozen shards per batch opens each once, not per sample.
#[derive(Debug, Default)]
pub struct Working {
    shards: HashMap<usize, (Arc<ResidentShard>, u64)>,
    batch: u64,
    /// Time spent waiting for shards to be fetched (cache misses), since the last `take_wait`.
    waited: Waits,
    /// Shards whose fetch failed, and how: the stream ends with that error, and the batches
    /// built ahead of it that need the same shard fail with it too rather than fetch it again,
    /// each with the store's whole retry policy.
    failed: HashMap<usize, crate::Error>,
    /// Whether the stream ended (its client left): its waits for room in the node cache end then.
    ended: Option<EndedBy>,
}

/// Shards of one batch fetched at once when none of them is cached yet (a cold start): each is
/// itself a set of parallel ranged GETs, bounded daemon-wide.
const PRELOAD_THREADS: usize = 8;

/// Batches a shard stays in a working set after its last use: the shuffle window makes a shard
/// reappear within a batch or two, or not at all.
const WORKING_BATCHES: u64 = 2;

impl Working {
    /// The working set of a stream that `ended` says has ended once its client is gone.
    pub fn until(ended: EndedBy) -> Self {
        Self { ended: Some(ended), ..Self::default() }
    }

    /// What tells this set's stream ended, for its fetches made outside the set.
    pub fn ended(&self) -> Option<EndedBy> {
        self.ended.clone()
    }

    pub fn get(&mut self, ds: &Dataset, i: usize) -> Result<&Arc<ResidentShard>> {
        let batch = self.batch;
        let ended = self.ended.as_ref().map(EndedBy::as_ended);
        let entry = match self.shards.entry(i) {
            Entry::Occupied(held) => held.into_mut(),
            Entry::Vacant(slot) => {
                if let Some(e) = self.failed.get(&i) {
                    return Err(e.again());
                }
                let started = Instant::now();
                // A fetch that fails was waited for too (the stream ends with its error).
                let got = ds.shard_fetched(i, ended);
                if got.as_ref().map_or(true, |&(_, fetched)| fetched) {
                    self.waited.add(started.elapsed());
                }
                match got {
                    Ok((shard, _)) => slot.insert((shard, batch)),
                    Err(e) => {
                        self.failed.insert(i, e.again());
                        return Err(e);
                    }
                }
            }
        };
        entry.1 = batch;
        Ok(&entry.0)
    }

    /// Lets go of shard `i` at once (its copy is found bad: the cache drops no copy a stream
    /// holds).
    pub fn forget(&mut self, i: usize) {
        self.shards.remove(&i);
    }

    /// Fetches, in parallel, the shards of a batch (`ids`: its sample ids) that are neither in
    /// the working set nor ready locally: a batch drawing on a dozen shards then waits for the
    /// slowest download, not for the sum of them. Datasets read in place skip this.
    pub fn preload(&mut self, ds: &Dataset, ids: &[u64]) -> Result<()> {
        if ds.mode == CacheMode::Direct {
            return Ok(());
        }
        let mut missing: Vec<usize> = ids
            .iter()
            .filter_map(|&id| ds.locate(id).map(|(s, _)| s))
            .filter(|s| !self.shards.contains_key(s))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        missing.retain(|&s| !ds.is_local(s));
        if let Some(e) = missing.iter().find_map(|s| self.failed.get(s)) {
            return Err(e.again());
        }
        if missing.len() < 2 {
            return Ok(());
        }
        let started = Instant::now();
        let failed = std::sync::Mutex::new(Vec::new());
        let ended = self.ended.as_ref().map(EndedBy::as_ended);
        let got = crate::parallel::try_map(&missing, PRELOAD_THREADS, |&s| {
            ds.shard_fetched(s, ended)
                .inspect_err(|e| failed.lock().unwrap_or_else(|p| p.into_inner()).push((s, e.again())))
        });
        self.waited.add(started.elapsed());
        self.failed.extend(failed.into_inner().unwrap_or_else(|p| p.into_inner()));
        for (s, (shard, _)) in missing.into_iter().zip(got?) {
            self.shards.insert(s, (shard, self.batch));
        }
        Ok(())
    }

    /// Whether every shard of the samples `ids` is in the working set: a batch of them is then
    /// built without opening, fetching or verifying a shard, so without waiting for storage.
    pub fn holds_all(&self, ds: &Dataset, ids: &[u64]) -> bool {
        let mut last = None;
        ids.iter().all(|&id| match ds.locate(id) {
            Some((s, _)) if last == Some(s) => true,
            Some((s, _)) => {
                last = Some(s);
                self.shards.contains_key(&s)
            }
            None => false,
        })
    }

    /// Ends a batch: shards unused for [`WORKING_BATCHES`] batches are let go; returns them.
    pub fn end_batch(&mut self) -> Vec<Arc<ResidentShard>> {
        self.batch += 1;
        let keep_from = self.batch.saturating_sub(WORKING_BATCHES);
        let mut dropped = Vec::new();
        self.shards.retain(|_, (shard, used)| {
            let keep = *used >= keep_from;
            if !keep {
                dropped.push(shard.clone());
            }
            keep
        });
        dropped
    }

    /// Counts `d` of waiting for storage done outside this set (a batch's column-chunk copies).
    pub fn add_wait(&mut self, d: Duration) {
        self.waited.add(d);
    }

    /// The set's clock of waits, readable without the set: a failing stream takes what its
    /// builds waited while another build, ahead of it, holds the set waiting for storage.
    pub fn waits(&self) -> Waits {
        self.waited.clone()
    }

    pub fn take_wait(&mut self) -> Duration {
        self.waited.take()
    }
}

/// Time waited for storage and not yet taken, in microseconds, shared by a working set and its
/// stream.
#[derive(Debug, Default, Clone)]
pub struct Waits(Arc<AtomicU64>);

impl Waits {
    fn add(&self, d: Duration) {
        self.0.fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// What was waited since the last take.
    pub fn take(&self) -> Duration {
        Duration::from_micros(self.0.swap(0, Ordering::Relaxed))
    }
}
