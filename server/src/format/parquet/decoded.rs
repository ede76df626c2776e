//! Decoded row groups, shared by every stream of the daemon and bounded in bytes.
//!
//! A shuffled Parquet epoch visits a window of row groups and draws its batches' rows from all of
//! them, so a row group is needed by many batches, and by every rank and worker of the node that
//! reads the same window. Decoding it once and keeping the result here is what makes each row
//! group decoded about once per epoch and node instead of once per batch.
//!
//! The cache keeps at most `budget` bytes of decoded Arrow data (the allocations its buffers are
//! in, each counted once: see [`held_bytes`]), evicting the least recently used row group first;
//! a row group larger than the whole budget is decoded and handed out but not kept. Batches being gathered hold their row groups
//! through `Arc`s beyond the bound (at most a stream's window each). Concurrent requests for the
//! same row group decode it once: the others wait for the first (decoding runs on blocking
//! threads, so the wait is a `Condvar`).
//!
//! A projection whose row groups, decoded, cannot all fit the budget ("outgrown": the footers'
//! uncompressed sizes of its columns add up to more) gains little from the row groups kept
//! after its streams' windows have moved on: the next epoch wants them in another order, and
//! from its second decode of a row group on a stream keeps them on disk (`super::kept`). Filling
//! the budget with them costs a fresh daemon's first epoch that much new memory, which on a VM
//! cost more than all the decoding (bench/PARQUET_PROFILE.md). So each stream of an outgrown
//! projection claims an [`OutgrownShare`] of [`OUTGROWN_WINDOWS`] windows, and the row groups of
//! outgrown projections are kept only up to what the live shares claim (at least a quarter of the
//! budget), least recently used first; the rest of the budget stays for projections that fit.
//!
//! Row groups no stream has used for [`UNUSED_FOR`] are let go of ([`DecodedCache::release_unused`],
//! called every minute by the daemon): the budget bounds what streams being served hold, not what
//! datasets served hours ago, or deleted since, leave behind in an idle daemon.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use arrow_array::RecordBatch;

/// Default budget of decoded row groups per daemon: room for the default shuffle windows
/// (`service::DEFAULT_SHUFFLE_WINDOW`, 8 row groups of `pack`'s ~20 MB) of a few streams, small
/// beside the node cache. Only projections that fit it fill it (see the module docs).
pub const DEFAULT_BUDGET_BYTES: u64 = 1 << 30;

/// What a stream of an outgrown projection claims: this many of its windows of its largest row
/// group (the window being decoded, the one before it still being drawn from, and room for
/// streams of the node that read nearby windows).
pub const OUTGROWN_WINDOWS: u64 = 4;

/// The daemon's cache, shared by every stream (made on first use with [`DEFAULT_BUDGET_BYTES`];
/// `serve --decoded-budget` sets another with [`DecodedCache::set_budget`]).
pub fn shared() -> Arc<DecodedCache> {
    static SHARED: std::sync::OnceLock<Arc<DecodedCache>> = std::sync::OnceLock::new();
    SHARED.get_or_init(|| Arc::new(DecodedCache::new(DEFAULT_BUDGET_BYTES))).clone()
}

/// Which dataset version a key belongs to: its identity string (fingerprint and URL), shared by
/// every key of the dataset and hashed once when the tag is made.
///
/// Every batch looks up each row group it draws on (16 per batch with the default window): keys
/// used to be a `String` formatted and hashed in full per lookup, a measurable share of a batch of
/// small rows (bench/PARQUET_PROFILE.md). A key is now integers plus this `Arc`: hashing it hashes
/// four integers, cloning it bumps a count. Equality still compares the strings (after a pointer
/// check), so two datasets whose identities hash alike never share rows.
#[derive(Debug, Clone)]
pub struct DatasetTag {
    hash: u64,
    id: Arc<str>,
}

impl DatasetTag {
    pub fn new(id: &str) -> Self {
        Self { hash: crate::stable_hash::hash(id.as_bytes()), id: Arc::from(id) }
    }
}

impl PartialEq for DatasetTag {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.id, &other.id) || (self.hash == other.hash && self.id == other.id)
    }
}

impl Eq for DatasetTag {}

impl std::hash::Hash for DatasetTag {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// One row group of one file of one dataset, decoded for one projection.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RowGroupKey {
    pub dataset: DatasetTag,
    /// The file's position in the dataset's list of files.
    pub file: u32,
    pub row_group: u32,
    /// Identity of the selected columns (e.g. a hash of their names in order).
    pub projection: u64,
}

/// Counters of the cache (status, metrics, tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodedStats {
    pub budget: u64,
    pub bytes: u64,
    pub entries: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Bytes of row groups of outgrown projections, and what they may hold (see the module docs).
    pub outgrown_bytes: u64,
    pub outgrown_cap: u64,
}

#[derive(Debug)]
struct Entry {
    batch: Arc<RecordBatch>,
    bytes: u64,
    last_use: u64,
    outgrown: bool,
    /// The node-cache copy (device, inode) whose mapping the row group's values lie in, if any
    /// (`super::mapped`): the entry goes when the copy does ([`DecodedCache::forget_copy`]).
    over: Option<(u64, u64)>,
}

#[derive(Debug, Default)]
struct State {
    map: HashMap<RowGroupKey, Entry>,
    /// last_use -> key: the eviction order.
    lru: BTreeMap<u64, RowGroupKey>,
    decoding: HashSet<RowGroupKey>,
    /// The eviction order of the outgrown entries alone (a subset of `lru`).
    outgrown_lru: BTreeMap<u64, RowGroupKey>,
    /// What the live [`OutgrownShare`]s claim, together.
    outgrown_claims: u64,
    /// Row groups decoded once and then let go of (evicted, or too large to keep): decoding one
    /// again means the budget cannot hold this projection's working set. Cleared when it reaches
    /// [`MAX_LET_GO`] keys, which only makes a later [`DecodedCache::decoded_before`] say no.
    let_go: HashSet<RowGroupKey>,
    tick: u64,
    /// When the cache's use count ([`State::tick`]) had which value: [`DecodedCache::release_unused`]
    /// marks it at each call, so that what was last used before a mark old enough is known
    /// without a clock read per lookup.
    marks: std::collections::VecDeque<(std::time::Instant, u64)>,
    stats: DecodedStats,
}

/// How long a row group no stream uses stays decoded (see the module docs).
pub const UNUSED_FOR: std::time::Duration = std::time::Duration::from_secs(600);

/// Bound of [`State::let_go`]: a million keys (some tens of MB).
const MAX_LET_GO: usize = 1 << 20;

#[derive(Debug)]
pub struct DecodedCache {
    state: Mutex<State>,
    done: Condvar,
}

/// A live stream's claim on the cache for an outgrown projection ([`DecodedCache::share_for`]),
/// given back when dropped.
#[derive(Debug)]
pub struct OutgrownShare {
    cache: Arc<DecodedCache>,
    claim: u64,
}

impl Drop for OutgrownShare {
    fn drop(&mut self) {
        let mut st = self.cache.lock();
        st.outgrown_claims = st.outgrown_claims.saturating_sub(self.claim);
    }
}

impl DecodedCache {
    pub fn new(budget: u64) -> Self {
        let stats = DecodedStats { budget, ..Default::default() };
        Self { state: Mutex::new(State { stats, ..Default::default() }), done: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent state (every mutation is complete
        // before anything that can panic), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> DecodedStats {
        let st = self.lock();
        DecodedStats { outgrown_cap: st.outgrown_cap(), ..st.stats }
    }

    /// A stream's claim for a projection of `projection_bytes` (its row groups decoded, all
    /// files) whose shuffle window holds at most `window_bytes`: `None` when the projection fits
    /// the budget (its row groups may use all of it), else an [`OutgrownShare`] of
    /// [`OUTGROWN_WINDOWS`] windows, held while the stream lives; its row groups are then decoded
    /// with `outgrown` set ([`Self::get_or_decode_as`]).
    pub fn share_for(self: &Arc<Self>, projection_bytes: u64, window_bytes: u64) -> Option<OutgrownShare> {
        let mut st = self.lock();
        if projection_bytes <= st.stats.budget {
            return None;
        }
        let claim = window_bytes.saturating_mul(OUTGROWN_WINDOWS);
        st.outgrown_claims = st.outgrown_claims.saturating_add(claim);
        Some(OutgrownShare { cache: self.clone(), claim })
    }

    /// Whether row group `key` was decoded before and then let go of: a decode of it now is a
    /// second one (see `super::kept` for what a stream does with that).
    pub fn decoded_before(&self, key: &RowGroupKey) -> bool {
        self.lock().let_go.contains(key)
    }

    /// Row group `key` as `batch` from now on (the same rows, held elsewhere: loaded from a kept
    /// file, `over`), when the cache holds it; its place in the eviction order stays.
    pub fn replace(&self, key: &RowGroupKey, batch: Arc<RecordBatch>, over: Option<(u64, u64)>) {
        let bytes = held_bytes(&batch);
        let mut guard = self.lock();
        let st = &mut *guard;
        let Some(e) = st.map.get_mut(key) else { return };
        st.stats.bytes = st.stats.bytes - e.bytes + bytes;
        if e.outgrown {
            st.stats.outgrown_bytes = st.stats.outgrown_bytes - e.bytes + bytes;
        }
        e.batch = batch;
        e.bytes = bytes;
        e.over = over;
        st.evict_outgrown_to(0);
        st.evict_to(0);
        crate::metrics::parquet_decoded(st.stats.bytes, st.stats.budget);
    }

    /// Lets go of the row groups last used before the newest of its earlier calls that is at
    /// least `unused_for` before `now` (called periodically, so: unused for about `unused_for`).
    /// Unlike an eviction for room, a row group let go of here is not "decoded before" (its
    /// projection fits the budget; it was only idle). Returns the bytes let go of.
    pub fn release_unused(&self, now: std::time::Instant, unused_for: std::time::Duration) -> u64 {
        let mut st = self.lock();
        let tick = st.tick;
        st.marks.push_back((now, tick));
        let mut upto = None;
        while let Some(&(at, tick)) = st.marks.front() {
            if now.saturating_duration_since(at) < unused_for {
                break;
            }
            upto = Some(tick);
            st.marks.pop_front();
        }
        let Some(upto) = upto else { return 0 };
        let before = st.stats.bytes;
        // Dropped after the lock (a row group loaded from a kept file unmaps it): lookups go on.
        let mut released = Vec::new();
        while let Some((&last_use, _)) = st.lru.first_key_value() {
            if last_use > upto {
                break;
            }
            let Some((_, key)) = st.lru.pop_first() else { break };
            if let Some(e) = st.take(&key) {
                released.push(e.batch);
            }
        }
        st.stats.entries = st.map.len() as u64;
        crate::metrics::parquet_decoded(st.stats.bytes, st.stats.budget);
        let bytes = before - st.stats.bytes;
        drop(st);
        drop(released);
        bytes
    }

    /// Lets go of the row groups decoded over node-cache copy `copy` (device, inode), which the
    /// node cache has just unlinked: kept, they would keep its blocks on disk beyond the node
    /// cache's bound for as long as they stay (up to the budget, [`UNUSED_FOR`] when idle). A
    /// later use decodes the row group from the copy fetched then, which costs only its page
    /// headers; it is no sign that the budget is short ([`Self::decoded_before`]). Batches being
    /// gathered keep theirs until they are sent. Returns the row groups let go of.
    pub fn forget_copy(&self, copy: (u64, u64)) -> usize {
        let mut st = self.lock();
        let keys: Vec<RowGroupKey> =
            st.map.iter().filter(|(_, e)| e.over == Some(copy)).map(|(k, _)| k.clone()).collect();
        if keys.is_empty() {
            return 0;
        }
        // Dropped after the lock: the last of them unmaps the copy.
        let mut gone = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(e) = st.take(&key) {
                gone.push(e.batch);
            }
        }
        st.stats.entries = st.map.len() as u64;
        crate::metrics::parquet_decoded(st.stats.bytes, st.stats.budget);
        drop(st);
        gone.len()
    }

    /// Bounds the cache at `budget` bytes from now on, evicting the least recently used row
    /// groups until it fits.
    pub fn set_budget(&self, budget: u64) {
        let mut st = self.lock();
        st.stats.budget = budget;
        st.evict_to(0);
        crate::metrics::parquet_decoded(st.stats.bytes, st.stats.budget);
    }

    /// The decoded row group `key` when it is cached (counted as a hit; a miss is not counted:
    /// the caller decodes it through [`Self::get_or_decode`], which counts it).
    pub fn get(&self, key: &RowGroupKey) -> Option<Arc<RecordBatch>> {
        let mut st = self.lock();
        let hit = st.touch(key)?;
        st.stats.hits += 1;
        Some(hit)
    }

    /// The decoded row group `key`, decoding it with `decode` when it is not cached (once, however
    /// many callers ask at the same time).
    pub fn get_or_decode<E>(
        &self,
        key: &RowGroupKey,
        decode: impl FnOnce() -> Result<RecordBatch, E>,
    ) -> Result<Arc<RecordBatch>, E> {
        self.get_or_decode_as(key, false, decode)
    }

    /// [`Self::get_or_decode`] for a row group of an outgrown projection when `outgrown` (see
    /// [`Self::share_for`]): kept within what the live shares claim.
    pub fn get_or_decode_as<E>(
        &self,
        key: &RowGroupKey,
        outgrown: bool,
        decode: impl FnOnce() -> Result<RecordBatch, E>,
    ) -> Result<Arc<RecordBatch>, E> {
        self.get_or_decode_over(key, outgrown, || decode().map(|b| (b, None)))
    }

    /// [`Self::get_or_decode_as`] where `decode` also says which node-cache copy's mapping the
    /// row group's values lie in, if any.
    pub fn get_or_decode_over<E>(
        &self,
        key: &RowGroupKey,
        outgrown: bool,
        decode: impl FnOnce() -> Result<(RecordBatch, Option<(u64, u64)>), E>,
    ) -> Result<Arc<RecordBatch>, E> {
        let mut st = self.lock();
        loop {
            if let Some(b) = st.touch(key) {
                st.stats.hits += 1;
                return Ok(b);
            }
            if !st.decoding.contains(key) {
                break;
            }
            st = self.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.stats.misses += 1;
        st.decoding.insert(key.clone());
        drop(st);
        // Removes the in-flight mark however decode ends (error or panic), so waiters retry.
        struct Mark<'a>(&'a DecodedCache, &'a RowGroupKey);
        impl Drop for Mark<'_> {
            fn drop(&mut self) {
                self.0.lock().decoding.remove(self.1);
                self.0.done.notify_all();
            }
        }
        let mark = Mark(self, key);
        let (batch, over) = decode()?;
        let batch = Arc::new(batch);
        // Measured before the lock: it walks every buffer of the row group.
        let bytes = held_bytes(&batch);
        self.lock().insert(key.clone(), batch.clone(), bytes, outgrown, over);
        drop(mark);
        Ok(batch)
    }
}

impl State {
    fn touch(&mut self, key: &RowGroupKey) -> Option<Arc<RecordBatch>> {
        self.tick += 1;
        let e = self.map.get_mut(key)?;
        self.lru.remove(&e.last_use);
        if e.outgrown {
            self.outgrown_lru.remove(&e.last_use);
            self.outgrown_lru.insert(self.tick, key.clone());
        }
        e.last_use = self.tick;
        self.lru.insert(self.tick, key.clone());
        Some(e.batch.clone())
    }

    fn insert(
        &mut self,
        key: RowGroupKey,
        batch: Arc<RecordBatch>,
        bytes: u64,
        outgrown: bool,
        over: Option<(u64, u64)>,
    ) {
        if self.map.contains_key(&key) {
            return;
        }
        if bytes > self.stats.budget {
            self.let_go_of(key);
            return;
        }
        if outgrown {
            self.evict_outgrown_to(bytes);
        }
        self.evict_to(bytes);
        self.tick += 1;
        self.lru.insert(self.tick, key.clone());
        if outgrown {
            self.outgrown_lru.insert(self.tick, key.clone());
            self.stats.outgrown_bytes += bytes;
        }
        self.map.insert(key, Entry { batch, bytes, last_use: self.tick, outgrown, over });
        self.stats.bytes += bytes;
        self.stats.entries = self.map.len() as u64;
        crate::metrics::parquet_decoded(self.stats.bytes, self.stats.budget);
    }

    /// What the row groups of outgrown projections may hold: what the live shares claim, at
    /// least a quarter of the budget (left by projections that end), at most all of it.
    fn outgrown_cap(&self) -> u64 {
        self.outgrown_claims.max(self.stats.budget / 4).min(self.stats.budget)
    }

    /// Evicts least recently used row groups until `room` more bytes fit in the budget.
    fn evict_to(&mut self, room: u64) {
        while self.stats.bytes + room > self.stats.budget {
            let Some((_, old)) = self.lru.pop_first() else { break };
            self.evict(old);
        }
        self.stats.entries = self.map.len() as u64;
    }

    /// Evicts least recently used row groups of outgrown projections until `room` more bytes
    /// of them fit in [`Self::outgrown_cap`].
    fn evict_outgrown_to(&mut self, room: u64) {
        let cap = self.outgrown_cap();
        while self.stats.outgrown_bytes + room > cap {
            let Some((last_use, old)) = self.outgrown_lru.pop_first() else { break };
            self.lru.remove(&last_use);
            self.evict(old);
        }
        self.stats.entries = self.map.len() as u64;
    }

    /// Takes `key`'s entry out of the map, both eviction orders and the byte counts.
    fn take(&mut self, key: &RowGroupKey) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.lru.remove(&e.last_use);
        self.stats.bytes -= e.bytes;
        if e.outgrown {
            self.outgrown_lru.remove(&e.last_use);
            self.stats.outgrown_bytes -= e.bytes;
        }
        Some(e)
    }

    /// Drops `key`, out of the map and both eviction orders (whichever it was taken from).
    fn evict(&mut self, key: RowGroupKey) {
        if self.take(&key).is_none() {
            return;
        }
        self.stats.evictions += 1;
        self.let_go_of(key);
    }

    fn let_go_of(&mut self, key: RowGroupKey) {
        if self.let_go.len() >= MAX_LET_GO {
            self.let_go.clear();
        }
        self.let_go.insert(key);
    }
}

/// The bytes `batch` holds: each allocation its buffers are in, counted once however many
/// buffers slice it. A row group with binary views has all its view columns in one arena, and a
/// row group loaded from a kept file (`super::kept`) has every column in the file's mapping;
/// `RecordBatch::get_array_memory_size` counts such an allocation once per buffer.
///
/// A view column over the mapping of a node-cache copy of its file (`super::mapped`) counts the
/// bytes its values name, not the whole file: the mapping is shared by every row group of the
/// file. The budget then bounds the bytes such row groups name, not the files they keep mapped: a
/// copy the node cache evicted stays allocated on disk while a held row group maps it.
pub fn held_bytes(batch: &RecordBatch) -> u64 {
    fn walk(d: &arrow_data::ArrayData, seen: &mut HashSet<usize>, total: &mut u64) {
        let nulls = d.nulls().map(|n| n.buffer());
        let views_over_a_copy = *d.data_type() == arrow_schema::DataType::BinaryView
            && d.buffers().get(1).is_some_and(|b| super::arena::is_borrowed(b.as_ptr() as usize));
        if views_over_a_copy && let Some(views) = d.buffers().first() {
            let views: &[u128] = views.typed_data();
            let named = views.iter().map(|&v| u64::from(v as u32)).filter(|&n| n > u64::from(super::arena::INLINE));
            *total += named.sum::<u64>() + views.len() as u64 * 16;
            if let Some(n) = nulls {
                *total += n.capacity() as u64;
            }
            return;
        }
        for b in d.buffers().iter().chain(nulls) {
            if seen.insert(b.data_ptr().as_ptr() as usize) {
                *total += b.capacity() as u64;
            }
        }
        for c in d.child_data() {
            walk(c, seen, total);
        }
    }
    let (mut seen, mut total) = (HashSet::new(), 0u64);
    for c in batch.columns() {
        walk(&c.to_data(), &mut seen, &mut total);
    }
    total
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::super::testdata;
    use super::*;

    fn key(rg: u32) -> RowGroupKey {
        RowGroupKey { dataset: DatasetTag::new("f"), file: 0, row_group: rg, projection: 0 }
    }

    #[test]
    fn an_allocation_two_columns_slice_is_held_once() {
        use arrow_array::{ArrayRef, Int64Array};
        let values = Int64Array::from_iter_values(0..1000);
        let schema = Arc::new(arrow_schema::Schema::new(vec![
            arrow_schema::Field::new("a", arrow_schema::DataType::Int64, false),
            arrow_schema::Field::new("b", arrow_schema::DataType::Int64, false),
        ]));
        let (a, b): (ArrayRef, ArrayRef) = (Arc::new(values.slice(0, 500)), Arc::new(values.slice(500, 500)));
        let shared = RecordBatch::try_new(schema.clone(), vec![a, b]).unwrap();
        let own: (ArrayRef, ArrayRef) =
            (Arc::new(Int64Array::from_iter_values(0..500)), Arc::new(Int64Array::from_iter_values(0..500)));
        let apart = RecordBatch::try_new(schema, vec![own.0, own.1]).unwrap();
        assert_eq!(held_bytes(&shared), 8000, "the one 8,000-byte buffer, once");
        assert_eq!(held_bytes(&apart), 8000, "two of 4,000");
        assert!(shared.get_array_memory_size() >= 16000, "what it counted before: the buffer twice");
    }

    #[test]
    fn bounded_by_bytes_least_recently_used_first() {
        let one = testdata::mixed_batch(0..100);
        let size = held_bytes(&one);
        let cache = DecodedCache::new(3 * size + size / 2);
        let decodes = AtomicU32::new(0);
        let get = |rg| {
            cache
                .get_or_decode(&key(rg), || {
                    decodes.fetch_add(1, Ordering::Relaxed);
                    Ok::<_, ()>(testdata::mixed_batch(0..100))
                })
                .unwrap()
        };
        for rg in 0..3 {
            get(rg);
        }
        get(0); // 0 is now the most recent; 1 the least.
        get(3);
        let s = cache.stats();
        assert_eq!((s.entries, s.evictions, s.misses, s.hits), (3, 1, 4, 1));
        assert!(s.bytes <= s.budget);
        get(0);
        get(2);
        assert_eq!(decodes.load(Ordering::Relaxed), 4);
        assert!(cache.decoded_before(&key(1)), "evicted");
        assert!(!cache.decoded_before(&key(0)) && !cache.decoded_before(&key(9)), "cached, never decoded");
        get(1);
        assert_eq!(decodes.load(Ordering::Relaxed), 5);
        // Larger than the budget: handed out, not kept.
        let small = DecodedCache::new(size / 2);
        let b = small.get_or_decode(&key(0), || Ok::<_, ()>(testdata::mixed_batch(0..100))).unwrap();
        assert_eq!(b.num_rows(), 100);
        assert_eq!(small.stats().entries, 0);
        assert!(small.decoded_before(&key(0)), "too large to keep: let go of at once");
        // An error is not cached.
        assert!(small.get_or_decode(&key(1), || Err::<RecordBatch, _>("bad")).is_err());
        assert_eq!(small.stats().entries, 0);
    }

    #[test]
    fn outgrown_row_groups_stay_within_their_claims_and_leave_the_others_alone() {
        let size = held_bytes(&testdata::mixed_batch(0..100));
        let cache = Arc::new(DecodedCache::new(8 * size));
        assert!(cache.share_for(8 * size, size).is_none(), "a projection that fits claims nothing");
        let share = cache.share_for(8 * size + 1, size / 2).expect("outgrown");
        assert_eq!(cache.stats().outgrown_cap, 2 * size, "4 windows of half a row group, or the floor");
        let get = |rg, outgrown| {
            cache.get_or_decode_as(&key(rg), outgrown, || Ok::<_, ()>(testdata::mixed_batch(0..100))).unwrap()
        };
        for rg in 0..3 {
            get(rg, false);
        }
        for rg in 10..15 {
            get(rg, true);
        }
        let s = cache.stats();
        // The outgrown ones evicted one another, oldest first; the others stayed.
        assert_eq!((s.entries, s.bytes, s.outgrown_bytes, s.evictions), (5, 5 * size, 2 * size, 3), "{s:?}");
        assert!(cache.get(&key(0)).is_some() && cache.get(&key(13)).is_some() && cache.get(&key(12)).is_none());
        // Touched, an outgrown row group is the last of them to go.
        get(13, true);
        get(15, true);
        assert!(cache.get(&key(13)).is_some() && cache.get(&key(14)).is_none());
        drop(share);
        assert_eq!(cache.stats().outgrown_cap, 2 * size, "the floor: a quarter of the budget");
    }

    #[test]
    fn a_smaller_budget_evicts_the_least_recently_used_at_once() {
        let size = held_bytes(&testdata::mixed_batch(0..100));
        let cache = DecodedCache::new(4 * size);
        for rg in 0..4 {
            cache.get_or_decode(&key(rg), || Ok::<_, ()>(testdata::mixed_batch(0..100))).unwrap();
        }
        cache.get(&key(0));
        cache.set_budget(2 * size);
        let s = cache.stats();
        assert_eq!((s.budget, s.entries, s.bytes, s.evictions), (2 * size, 2, 2 * size, 2));
        assert!(cache.get(&key(0)).is_some() && cache.get(&key(3)).is_some(), "the two most recent stay");
        assert!(cache.get(&key(1)).is_none() && cache.get(&key(2)).is_none());
        cache.set_budget(8 * size);
        assert_eq!(cache.stats().entries, 2, "a larger budget evicts nothing");
    }

    #[test]
    fn row_groups_unused_for_a_while_are_let_go_of_and_not_taken_for_outgrown() {
        let size = held_bytes(&testdata::mixed_batch(0..100));
        let cache = DecodedCache::new(8 * size);
        for rg in 0..4 {
            cache.get_or_decode(&key(rg), || Ok::<_, ()>(testdata::mixed_batch(0..100))).unwrap();
        }
        let (t0, unused_for) = (std::time::Instant::now(), std::time::Duration::from_secs(600));
        assert_eq!(cache.release_unused(t0, unused_for), 0, "the first call only marks");
        cache.get(&key(1)); // used after the mark
        assert_eq!(cache.release_unused(t0 + unused_for / 2, unused_for), 0, "no mark old enough yet");
        let released = cache.release_unused(t0 + unused_for, unused_for);
        assert_eq!(released, 3 * size);
        assert_eq!((cache.stats().entries, cache.stats().bytes, cache.stats().evictions), (1, size, 0));
        assert!(cache.get(&key(1)).is_some());
        assert!(!cache.decoded_before(&key(0)), "idle, not outgrown: no stream is to spill for it");
        // The mark made half way lets go of what was unused since, at its turn.
        assert_eq!(cache.release_unused(t0 + unused_for * 3 / 2, unused_for), 0, "key 1 was used after it");
        assert_eq!(cache.release_unused(t0 + unused_for * 3, unused_for), size);
    }

    #[test]
    fn a_replaced_row_group_is_held_as_its_new_batch_only_while_cached() {
        let cache = DecodedCache::new(1 << 30);
        cache.get_or_decode(&key(0), || Ok::<_, ()>(testdata::mixed_batch(0..100))).unwrap();
        let smaller = Arc::new(testdata::mixed_batch(0..10));
        cache.replace(&key(0), smaller.clone(), None);
        assert!(Arc::ptr_eq(&cache.get(&key(0)).unwrap(), &smaller));
        assert_eq!(cache.stats().bytes, held_bytes(&smaller));
        cache.replace(&key(1), smaller, None);
        assert!(cache.get(&key(1)).is_none(), "not cached: not added");
        assert_eq!(cache.stats().entries, 1);
    }

    #[test]
    fn the_row_groups_over_a_removed_copy_go_with_it_and_only_they() {
        let cache = DecodedCache::new(1 << 30);
        let (a, b) = ((1, 10), (1, 11));
        let decode = |over| move || Ok::<_, ()>((testdata::mixed_batch(0..100), over));
        for (rg, over) in [(0, Some(a)), (1, Some(a)), (2, Some(b)), (3, None)] {
            cache.get_or_decode_over(&key(rg), false, decode(over)).unwrap();
        }
        let size = cache.stats().bytes / 4;
        // Loaded from a kept file since: held over that file now, not over the copy.
        cache.replace(&key(1), Arc::new(testdata::mixed_batch(0..100)), Some((1, 12)));
        assert_eq!(cache.forget_copy(a), 1);
        assert_eq!(cache.forget_copy(a), 0);
        assert!(cache.get(&key(0)).is_none());
        assert!(cache.get(&key(1)).is_some() && cache.get(&key(2)).is_some() && cache.get(&key(3)).is_some());
        assert_eq!((cache.stats().entries, cache.stats().bytes, cache.stats().evictions), (3, 3 * size, 0));
        assert!(!cache.decoded_before(&key(0)), "no sign of a budget too small");
        assert_eq!(cache.forget_copy((1, 12)), 1);
        assert_eq!(cache.stats().entries, 2);
    }

    #[test]
    fn keys_of_one_dataset_match_across_tags_and_never_across_datasets() {
        let cache = DecodedCache::new(1 << 30);
        let k = |id: &str| RowGroupKey { dataset: DatasetTag::new(id), file: 3, row_group: 1, projection: 7 };
        cache.get_or_decode(&k("fp@/data/a"), || Ok::<_, ()>(testdata::mixed_batch(0..10))).unwrap();
        // Another assembler of the same dataset makes its own tag: same key.
        assert_eq!(cache.get(&k("fp@/data/a")).map(|b| b.num_rows()), Some(10));
        // A copy of the dataset elsewhere (same fingerprint, other URL) shares nothing.
        assert!(cache.get(&k("fp@/data/b")).is_none());
        let other_file = RowGroupKey { file: 4, ..k("fp@/data/a") };
        assert!(cache.get(&other_file).is_none());
    }

    #[test]
    fn concurrent_requests_decode_once() {
        let cache = DecodedCache::new(1 << 30);
        let decodes = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    cache
                        .get_or_decode(&key(9), || {
                            decodes.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            Ok::<_, ()>(testdata::mixed_batch(0..10))
                        })
                        .unwrap()
                });
            }
        });
        assert_eq!(decodes.load(Ordering::Relaxed), 1);
        assert_eq!(cache.stats().hits, 7);
    }
}
