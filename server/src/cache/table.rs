//! The cache table: which shards the node cache holds, in which state, and what to evict. A pure
//! state machine (no I/O, no clock, no locks): the caller holds it under a mutex, performs the
//! file operations its answers ask for, and reports back.
//!
//! ```text
//!            begin() -> Fill                 finish(ok)
//!  Absent ─────────────────────► Filling ─────────────────► Ready ──┐ pin()/unpin()
//!    ▲                             │ finish(failed)            │ ◄──┘
//!    └─────────────────────────────┘◄──────────────────────────┘ evicted (only with no pins)
//! ```
//!
//! Space is accounted when a fill begins (its full size is reserved), so concurrent fills can
//! never overshoot the capacity together. A pinned entry (a stream reads it, or a client holds a
//! lease on it) is never chosen for eviction.
//!
//! Each entry carries its next use ([`Entry::next`]): asked of the [`Eviction`] oracle once, when
//! the entry is made, then pushed by whoever knows the future ([`CacheTable::set_next_uses`],
//! the prefetcher after each of its walks). Choosing victims thus reads no map: asking the oracle
//! for every entry at every eviction (a hash of a ~70-byte key each), then sorting them all, took
//! most of the daemon's CPU once the cache held a copy per row group (16,000 entries:
//! bench/S3_RESULTS.md, "Choosing what to evict").
//!
//! Entries are keyed by [`CacheKey`] (the key and its hash): the prefetcher tells next uses by
//! [`KeyRef`], so its tens of thousands of lookups a second hash no key's bytes; a caller holding
//! only the string pays one hash per call.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::key::{CacheKey, KeyMap, KeyRef};

/// What a caller asking for an entry may evict to make room for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rights {
    /// Any entry nobody pins or leases, farthest next use first: a stream blocked on the entry.
    /// A shard in the middle of its span of the plan (a Parquet file whose row groups are spread
    /// over the epoch) counts as needed now until its last use, and protecting those too left a
    /// cache full of files nobody read and a stream waiting for room that never came.
    Idle,
    /// With [`Policy::Belady`], only entries needed later than this many seconds from now, so a
    /// prefetch never pushes out something needed sooner (with [`Policy::Lru`], any idle entry).
    NeededAfter(f64),
    /// Nothing: only free room (staging, which makes its room from its own dataset's copies).
    Nothing,
}

/// How victims are chosen when space is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Evict the shard whose next use is farthest in the future (Belady's rule); shards no active
    /// consumer will need go first. Possible because every consumer's order is known in advance.
    Belady,
    /// Evict the least recently used shard (what other loaders do; kept for comparison).
    Lru,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "belady" | "clairvoyant" => Ok(Policy::Belady),
            "lru" => Ok(Policy::Lru),
            other => Err(format!("unknown cache policy {other:?} (expected belady or lru)")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Filling,
    Ready,
}

#[derive(Debug, Clone)]
pub struct Entry {
    pub state: State,
    pub bytes: u64,
    pub pins: u32,
    /// Logical time of the last pin (for LRU).
    pub last_used: u64,
    /// Seconds until an active consumer next needs it (infinite: none will), as last told
    /// ([`CacheTable::set_next_uses`]).
    pub next: f64,
}

/// The answer to [`CacheTable::begin`].
#[derive(Debug, PartialEq, Eq)]
pub enum Begin {
    /// Ready: the entry is now pinned for the caller.
    Hit,
    /// Someone else is filling it: wait for `finish` and ask again.
    Wait,
    /// The caller fills it (the entry is reserved and pinned); first delete these evicted files.
    Fill { evicted: Vec<String> },
    /// It does not fit now without evicting what may not be evicted.
    NoSpace { needed: u64, evictable: u64 },
}

/// How the caller ranks and protects entries when space is needed.
pub trait Eviction {
    /// Seconds until the shard is next needed by an active consumer; `None`: not needed. Asked
    /// when an entry is made; later changes come through [`CacheTable::set_next_uses`].
    fn next_use(&self, key: &str) -> Option<f64>;
    /// True while a client holds a lease on the shard (checked in addition to pins).
    fn leased(&self, key: &str) -> bool;
    /// The shard's file was just unlinked: whoever still maps it should let go, or its disk
    /// space stays taken (the shm clients, see `transport::shm::ShmHub::forget`).
    fn evicted(&self, _key: &str) {}
}

/// Nothing known about the future, nothing leased.
impl Eviction for () {
    fn next_use(&self, _: &str) -> Option<f64> {
        None
    }
    fn leased(&self, _: &str) -> bool {
        false
    }
}

#[derive(Debug)]
pub struct CacheTable {
    entries: KeyMap<Entry>,
    capacity: u64,
    /// Bytes of Ready entries plus reservations of Filling ones.
    used: u64,
    clock: u64,
    policy: Policy,
}

impl CacheTable {
    pub fn new(capacity: u64, policy: Policy) -> Self {
        Self { entries: KeyMap::default(), capacity, used: 0, clock: 0, policy }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Changes the capacity (a disk that holds less than promised); the next fills evict down
    /// to it.
    pub fn set_capacity(&mut self, capacity: u64) {
        self.capacity = capacity;
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.get(&KeyRef::from(key))
    }

    pub fn is_ready(&self, key: &str) -> bool {
        self.entries.get(&KeyRef::from(key)).is_some_and(|e| e.state == State::Ready)
    }

    /// Bytes of complete (Ready) entries.
    pub fn ready_bytes(&self) -> u64 {
        self.entries.values().filter(|e| e.state == State::Ready).map(|e| e.bytes).sum()
    }

    /// Bytes pinned (being read or filled) right now.
    pub fn pinned_bytes(&self) -> u64 {
        self.entries.values().filter(|e| e.pins > 0).map(|e| e.bytes).sum()
    }

    /// Registers a file found complete in the cache directory at start-up (Ready, unpinned).
    pub fn adopt(&mut self, key: &str, bytes: u64) {
        if self.entries.contains_key(&KeyRef::from(key)) {
            return;
        }
        self.used += bytes;
        let e = Entry { state: State::Ready, bytes, pins: 0, last_used: 0, next: f64::INFINITY };
        self.entries.insert(CacheKey::new(key), e);
    }

    /// Sets the next use of the entries among `uses` (key, seconds until its next use); with
    /// `whole`, `uses` is every key any consumer will read, and the entries missing from it are
    /// needed by none.
    pub fn set_next_uses<'a>(&mut self, uses: impl IntoIterator<Item = (KeyRef<'a>, f64)>, whole: bool) {
        if whole {
            for e in self.entries.values_mut() {
                e.next = f64::INFINITY;
            }
        }
        for (k, secs) in uses {
            if let Some(e) = self.entries.get_mut(&k) {
                e.next = secs;
            }
        }
    }

    /// Asks for `key` (of `bytes`), evicting for it what `rights` allow when the free room is
    /// short (see [`Rights`]).
    pub fn begin<'k>(&mut self, key: impl Into<KeyRef<'k>>, bytes: u64, rights: Rights, ev: &dyn Eviction) -> Begin {
        let key = key.into();
        self.clock += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            return match e.state {
                State::Ready => {
                    e.pins += 1;
                    e.last_used = self.clock;
                    Begin::Hit
                }
                State::Filling => Begin::Wait,
            };
        }
        let free = self.capacity.saturating_sub(self.used);
        let mut evicted = Vec::new();
        if bytes > free {
            let lru = self.policy == Policy::Lru;
            let candidates = self.idle().filter(|v| match rights {
                Rights::Idle => true,
                Rights::NeededAfter(secs) => lru || v.next > secs,
                Rights::Nothing => false,
            });
            evicted = match self.choose(candidates, bytes - free, ev) {
                Ok(chosen) => chosen,
                Err(freeable) => return Begin::NoSpace { needed: bytes, evictable: free + freeable },
            };
            for k in &evicted {
                if let Some(e) = self.entries.remove(&KeyRef::from(k)) {
                    self.used -= e.bytes;
                }
            }
        }
        self.used += bytes;
        let next = ev.next_use(key.as_str()).unwrap_or(f64::INFINITY);
        let e = Entry { state: State::Filling, bytes, pins: 1, last_used: self.clock, next };
        // Made from the caller's borrow: the prefetcher's lookups of it compare pointers.
        self.entries.insert(key.into(), e);
        Begin::Fill { evicted }
    }

    /// The Ready entries nobody pins, as eviction candidates (leases are checked only on the few
    /// chosen: [`Self::choose`]).
    fn idle(&self) -> impl Iterator<Item = Victim<'_>> {
        let lru = self.policy == Policy::Lru;
        self.entries.iter().filter(|(_, e)| e.state == State::Ready && e.pins == 0).map(move |(key, e)| Victim {
            // LRU ranks by recency alone.
            next: if lru { 0.0 } else { e.next },
            last_used: e.last_used,
            key,
            bytes: e.bytes,
        })
    }

    /// Victims among `candidates` freeing at least `need` bytes, first to evict first: with
    /// [`Policy::Belady`] the farthest next use (those never needed again before all), then the
    /// least recent; never one `ev` says is leased. `Err(bytes)`: only `bytes` could be freed.
    /// A heap, not a sort: an eviction usually takes one or two of thousands.
    fn choose<'a>(
        &self,
        candidates: impl Iterator<Item = Victim<'a>>,
        need: u64,
        ev: &dyn Eviction,
    ) -> Result<Vec<String>, u64> {
        let mut heap: BinaryHeap<Victim<'a>> = candidates.collect();
        let (mut freed, mut chosen) = (0u64, Vec::new());
        while freed < need {
            let Some(v) = heap.pop() else { return Err(freed) };
            if ev.leased(v.key) {
                continue;
            }
            freed += v.bytes;
            chosen.push(v.key.as_str().to_owned());
        }
        Ok(chosen)
    }

    /// Ends a fill begun by [`begin`](Self::begin): the entry becomes Ready (still pinned by the
    /// filler), or disappears and frees its reservation.
    pub fn finish(&mut self, key: &str, ok: bool) {
        if ok {
            if let Some(e) = self.entries.get_mut(&KeyRef::from(key)) {
                e.state = State::Ready;
            }
        } else if let Some(e) = self.entries.remove(&KeyRef::from(key)) {
            self.used -= e.bytes;
        }
    }

    /// Entries (ready or being filled) whose keys start with `prefix`, and their bytes.
    pub fn count_prefixed(&self, prefix: &str) -> (u64, u64) {
        self.entries.iter().filter(|(k, _)| k.starts_with(prefix)).fold((0, 0), |(n, b), (_, e)| (n + 1, b + e.bytes))
    }

    /// Pins `key` when it is ready (a hit), without ever starting a fill.
    pub fn pin_ready(&mut self, key: &str) -> bool {
        self.clock += 1;
        match self.entries.get_mut(&KeyRef::from(key)) {
            Some(e) if e.state == State::Ready => {
                e.pins += 1;
                e.last_used = self.clock;
                true
            }
            _ => false,
        }
    }

    /// Accounts a just-filled entry at the `bytes` it really holds, when its filler could only
    /// bound its size beforehand.
    pub fn settle(&mut self, key: &str, bytes: u64) {
        if let Some(e) = self.entries.get_mut(&KeyRef::from(key)) {
            self.used = self.used - e.bytes + bytes;
            e.bytes = bytes;
        }
    }

    /// Forgets a ready entry nothing pins (its file is to be deleted: readers that opened it
    /// keep their bytes); true when there was one.
    pub fn remove_ready(&mut self, key: &str) -> bool {
        let key = KeyRef::from(key);
        match self.entries.get(&key) {
            // Not while pinned: pins are given back by key, so a pin of the entry removed would
            // later count against an entry made again under the same key, which could then be
            // evicted while in use.
            Some(e) if e.state == State::Ready && e.pins == 0 => {
                self.used -= e.bytes;
                self.entries.remove(&key);
                true
            }
            _ => false,
        }
    }

    pub fn unpin(&mut self, key: &str) {
        if let Some(e) = self.entries.get_mut(&KeyRef::from(key)) {
            e.pins = e.pins.saturating_sub(1);
        }
    }

    /// Evicts unpinned, unleased Ready entries until `used <= target` (a lowered capacity, or a
    /// disk that filled up under us); returns the keys whose files to delete.
    pub fn shrink_to(&mut self, target: u64, ev: &dyn Eviction) -> Vec<String> {
        let need = self.used.saturating_sub(target);
        if need == 0 {
            return Vec::new();
        }
        // Not enough can go: all that can, as far towards the target as it gets.
        let chosen = self
            .choose(self.idle(), need, ev)
            .unwrap_or_else(|_| self.idle().filter(|v| !ev.leased(v.key)).map(|v| v.key.as_str().to_owned()).collect());
        for k in &chosen {
            if let Some(e) = self.entries.remove(&KeyRef::from(k)) {
                self.used -= e.bytes;
            }
        }
        chosen
    }
}

/// An eviction candidate, ordered so that the greatest is the first to evict.
struct Victim<'a> {
    next: f64,
    last_used: u64,
    key: &'a CacheKey,
    bytes: u64,
}

impl Ord for Victim<'_> {
    fn cmp(&self, o: &Self) -> Ordering {
        // Farthest next use, then least recently used, then (adopted entries share a time) the
        // key, for an order that does not depend on the map's.
        self.next.total_cmp(&o.next).then(o.last_used.cmp(&self.last_used)).then_with(|| o.key.cmp(self.key))
    }
}

impl PartialOrd for Victim<'_> {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

impl PartialEq for Victim<'_> {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}

impl Eq for Victim<'_> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{HashMap as Map, HashSet};

    struct Future(Map<String, f64>, HashSet<String>);
    impl Eviction for Future {
        fn next_use(&self, key: &str) -> Option<f64> {
            self.0.get(key).copied()
        }
        fn leased(&self, key: &str) -> bool {
            self.1.contains(key)
        }
    }

    /// Tells the table a whole future, as the prefetcher does after a whole walk.
    fn tell(t: &mut CacheTable, future: &Future) {
        t.set_next_uses(future.0.iter().map(|(k, s)| (KeyRef::from(k), *s)), true);
    }

    fn fill(t: &mut CacheTable, key: &str, bytes: u64, ev: &dyn Eviction) -> Vec<String> {
        match t.begin(key, bytes, Rights::NeededAfter(0.0), ev) {
            Begin::Fill { evicted } => {
                t.finish(key, true);
                t.unpin(key);
                evicted
            }
            other => panic!("{key}: {other:?}"),
        }
    }

    #[test]
    fn hit_wait_fill_and_single_flight() {
        let mut t = CacheTable::new(100, Policy::Lru);
        assert_eq!(t.begin("a", 10, Rights::NeededAfter(0.0), &()), Begin::Fill { evicted: vec![] });
        assert_eq!(
            t.begin("a", 10, Rights::NeededAfter(0.0), &()),
            Begin::Wait,
            "a second reader waits for the first fill"
        );
        t.finish("a", true);
        assert_eq!(t.begin("a", 10, Rights::NeededAfter(0.0), &()), Begin::Hit);
        assert_eq!(t.get("a").unwrap().pins, 2);
        assert_eq!(t.used(), 10);
        assert_eq!(t.begin("b", 20, Rights::NeededAfter(0.0), &()), Begin::Fill { evicted: vec![] });
        t.finish("b", false);
        assert!(t.get("b").is_none());
        assert_eq!(t.used(), 10, "a failed fill frees its reservation");
    }

    #[test]
    fn belady_evicts_the_farthest_next_use_and_never_a_sooner_one() {
        let mut t = CacheTable::new(30, Policy::Belady);
        let future = Future([("a".into(), 5.0), ("b".into(), 50.0), ("c".into(), 1.0)].into(), HashSet::new());
        for k in ["a", "b", "c"] {
            fill(&mut t, k, 10, &future);
        }
        assert_eq!(fill(&mut t, "d", 10, &future), vec!["b".to_string()]);
        // d was made not needed (its next use asked then); told 2 s now, a prefetch of a shard
        // needed in 10 s may not push out a (5 s), c (1 s) or d.
        let future = Future([("a".into(), 5.0), ("c".into(), 1.0), ("d".into(), 2.0)].into(), HashSet::new());
        tell(&mut t, &future);
        assert_eq!(t.begin("e", 10, Rights::NeededAfter(10.0), &future), Begin::NoSpace { needed: 10, evictable: 0 });
        // Shards nobody needs go first of all: a whole future that no longer names d says so.
        let future = Future([("a".into(), 5.0), ("c".into(), 1.0)].into(), HashSet::new());
        tell(&mut t, &future);
        assert_eq!(fill(&mut t, "e", 10, &future), vec!["d".to_string()]);
        // A partial telling changes only the entries it names.
        t.set_next_uses([("a".into(), 90.0), ("e".into(), 3.0)], false);
        assert_eq!((t.get("a").unwrap().next, t.get("c").unwrap().next), (90.0, 1.0));
        assert_eq!(fill(&mut t, "f", 10, &future), vec!["a".to_string()]);
    }

    #[test]
    fn the_first_to_go_are_the_farthest_then_the_least_recent_whatever_the_cache_holds() {
        // Many entries, a few of equal next use: each eviction takes exactly what a full sort of
        // the candidates would have put first, and skips the leased.
        let mut t = CacheTable::new(1000, Policy::Belady);
        let old = (0..100).map(|k| (k.to_string(), f64::from(k % 7)));
        let new = (0..30).map(|n| (format!("new{n}"), 0.5));
        let future = Future(old.chain(new).collect(), ["96".to_string()].into());
        for k in 0..100 {
            fill(&mut t, &k.to_string(), 10, &future);
        }
        let mut expect: Vec<(f64, u64, String)> = t
            .entries
            .iter()
            .filter(|(k, _)| !future.leased(k))
            .map(|(k, e)| (-e.next, e.last_used, k.to_string()))
            .collect();
        expect.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        let mut got = Vec::new();
        for n in 0..30 {
            got.extend(fill(&mut t, &format!("new{n}"), if n % 3 == 0 { 20 } else { 10 }, &future));
        }
        let want: Vec<String> = expect.into_iter().map(|e| e.2).take(got.len()).collect();
        assert_eq!(got, want);
        assert!(!got.contains(&"96".to_string()), "leased");
    }

    #[test]
    fn a_waiting_stream_may_evict_idle_shards_in_the_middle_of_their_use() {
        let mut t = CacheTable::new(30, Policy::Belady);
        let far = Future([("a".into(), 0.0), ("b".into(), 0.0), ("c".into(), 0.0)].into(), HashSet::new());
        for k in ["a", "b", "c"] {
            fill(&mut t, k, 10, &far);
        }
        // Every one of them is within its span of the plan (next use 0), none is read now: a
        // prefetch may not push them out, a stream blocked on "d" may (the least recent first).
        assert_eq!(t.begin("d", 10, Rights::NeededAfter(0.0), &far), Begin::NoSpace { needed: 10, evictable: 0 });
        assert_eq!(t.begin("d", 10, Rights::Idle, &far), Begin::Fill { evicted: vec!["a".to_string()] });
        // Farthest next use still first, and never what is pinned or leased.
        t.finish("d", true);
        let later = Future([("b".into(), 0.0), ("c".into(), 9.0)].into(), ["b".to_string()].into());
        tell(&mut t, &later);
        assert_eq!(t.begin("e", 10, Rights::Idle, &later), Begin::Fill { evicted: vec!["c".to_string()] });
        assert_eq!(t.begin("f", 10, Rights::Idle, &later), Begin::NoSpace { needed: 10, evictable: 0 });
    }

    #[test]
    fn lru_evicts_the_least_recently_used() {
        let mut t = CacheTable::new(30, Policy::Lru);
        for k in ["a", "b", "c"] {
            fill(&mut t, k, 10, &());
        }
        assert_eq!(t.begin("a", 10, Rights::NeededAfter(0.0), &()), Begin::Hit);
        t.unpin("a");
        assert_eq!(fill(&mut t, "d", 10, &()), vec!["b".to_string()]);
    }

    #[test]
    fn a_caller_without_rights_takes_free_room_only() {
        for policy in [Policy::Lru, Policy::Belady] {
            let mut t = CacheTable::new(30, policy);
            let never = Future(Map::new(), HashSet::new()); // no entry is needed again
            fill(&mut t, "a", 10, &never);
            fill(&mut t, "b", 10, &never);
            assert_eq!(t.begin("c", 10, Rights::Nothing, &never), Begin::Fill { evicted: vec![] }, "{policy:?}");
            t.finish("c", true);
            t.unpin("c");
            assert_eq!(
                t.begin("d", 10, Rights::Nothing, &never),
                Begin::NoSpace { needed: 10, evictable: 0 },
                "{policy:?}"
            );
            assert_eq!(t.used, 30, "{policy:?}: nothing evicted");
            // Another caller's fill of the same entry is still waited for, and then a hit.
            assert!(matches!(t.begin("d", 10, Rights::Idle, &never), Begin::Fill { .. }));
            assert_eq!(t.begin("d", 10, Rights::Nothing, &never), Begin::Wait, "{policy:?}");
        }
    }

    #[test]
    fn a_pinned_entry_is_not_removed_so_its_pin_never_counts_against_a_new_one() {
        let mut t = CacheTable::new(30, Policy::Lru);
        fill(&mut t, "a", 10, &());
        assert_eq!(t.begin("a", 10, Rights::NeededAfter(0.0), &()), Begin::Hit); // pinned by a reader
        assert!(!t.remove_ready("a"));
        t.unpin("a");
        assert!(t.remove_ready("a"));
        assert_eq!(t.used, 0);
    }

    #[test]
    fn pinned_and_leased_entries_are_never_evicted() {
        let mut t = CacheTable::new(20, Policy::Belady);
        let leased = Future(Map::new(), ["b".to_string()].into());
        assert!(matches!(t.begin("a", 10, Rights::NeededAfter(0.0), &leased), Begin::Fill { .. }));
        t.finish("a", true); // still pinned by its filler
        fill(&mut t, "b", 10, &leased);
        assert_eq!(t.begin("c", 10, Rights::NeededAfter(0.0), &leased), Begin::NoSpace { needed: 10, evictable: 0 });
        t.unpin("a");
        assert_eq!(t.begin("c", 10, Rights::NeededAfter(0.0), &leased), Begin::Fill { evicted: vec!["a".to_string()] });
        assert!(t.shrink_to(0, &leased).is_empty(), "c is pinned, b leased");
    }

    #[test]
    fn a_shard_larger_than_the_capacity_never_fits() {
        let mut t = CacheTable::new(10, Policy::Lru);
        assert_eq!(t.begin("big", 11, Rights::NeededAfter(0.0), &()), Begin::NoSpace { needed: 11, evictable: 10 });
    }

    #[derive(Debug, Clone)]
    enum Op {
        Begin(u8, u64, bool),
        Finish(u8, bool),
        Unpin(u8),
        Shrink(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..12, 1u64..40, any::<bool>()).prop_map(|(k, b, u)| Op::Begin(k, b, u)),
            (0u8..12, any::<bool>()).prop_map(|(k, ok)| Op::Finish(k, ok)),
            (0u8..12).prop_map(Op::Unpin),
            (0u64..100).prop_map(Op::Shrink),
        ]
    }

    proptest! {
        /// Whatever happens, used bytes equal the sum of entries and never exceed the capacity,
        /// and a pinned or leased entry is never evicted.
        #[test]
        fn accounting_holds_and_protected_entries_survive(
            ops in prop::collection::vec(op(), 1..200), lru in any::<bool>(),
        ) {
            let policy = if lru { Policy::Lru } else { Policy::Belady };
            let mut t = CacheTable::new(100, policy);
            let future = Future((0u8..12).map(|k| (k.to_string(), f64::from(k))).collect(), ["3".to_string()].into());
            let mut filling: HashSet<String> = HashSet::new();
            for op in ops {
                let protected: HashSet<String> = t.entries.iter()
                    .filter(|(k, e)| e.pins > 0 || future.leased(k))
                    .map(|(k, _)| k.to_string())
                    .collect();
                match op {
                    Op::Begin(k, b, urgent) => {
                        let k = k.to_string();
                        let urgency = if urgent { 0.0 } else { 6.0 };
                        if let Begin::Fill { evicted } = t.begin(&k, b, Rights::NeededAfter(urgency), &future) {
                            filling.insert(k);
                            for v in evicted { prop_assert!(!protected.contains(&v), "evicted protected {v}"); }
                        }
                    }
                    Op::Finish(k, ok) => {
                        let k = k.to_string();
                        if filling.remove(&k) { t.finish(&k, ok); }
                    }
                    Op::Unpin(k) => {
                        let k = k.to_string();
                        if !filling.contains(&k) { t.unpin(&k); }
                    }
                    Op::Shrink(target) => {
                        for v in t.shrink_to(target, &future) { prop_assert!(!protected.contains(&v)); }
                    }
                }
                prop_assert_eq!(t.used(), t.entries.values().map(|e| e.bytes).sum::<u64>());
                prop_assert!(t.used() <= t.capacity());
            }
        }
    }
}
