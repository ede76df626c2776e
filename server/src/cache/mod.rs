//! The node cache: one directory on the node's fast disk holding shard copies, shared by every
//! client and every job of the daemon, bounded by a byte capacity.
//!
//! - **Single flight**: a shard wanted by eight ranks at once is fetched once; the others wait
//!   for that fill ([`table::Begin::Wait`]), and when it fails (after the store's retries) they
//!   fail with it: each starting the download again would repeat the whole retry policy once per
//!   waiter. A caller that asks after the failure fetches again ([`Want::since`]), and a full
//!   disk fails only its filler (what a fill may evict depends on who fills).
//! - **Never half-visible**: a fill writes `.<key>.tmp.<pid>.<seq>`, the filler verifies it (size,
//!   checksum), it is fsynced and renamed to `<key>`. Start-up deletes temporary leftovers of a
//!   crashed daemon and re-adopts complete files; one whose size is not its shard's when next
//!   asked for is fetched again ([`NodeCache::drop_unlike_copy`]).
//! - **Eviction** by the table's policy (Belady's rule with the prefetcher's knowledge of the
//!   future, or LRU); a pinned shard (a stream is reading it) or one leased to a client is never
//!   evicted. Evicted files are unlinked: a reader that still has one open or mapped keeps valid
//!   bytes, and a re-fetch writes a new file, so nothing anyone reads is ever rewritten. An
//!   unlinked file keeps its disk space while it is mapped, so eviction tells the shared-memory
//!   clients to let go of it ([`Eviction::evicted`]); otherwise an epoch of a dataset larger
//!   than the cache would fill the disk with copies its trainers still map.
//! - **A full disk evicts instead of failing**: when a write hits ENOSPC the capacity is lowered
//!   to what the disk really holds and the fill is retried once after evicting; only if that
//!   fails too does the stream get an error naming the cache directory. Once the disk has room
//!   again (measured at most once a second, and before refusing a shard as larger than the
//!   cache), the capacity rises back towards what was configured.
//! - **One daemon per directory**: the cache holds an `flock` on `<cache-dir>/lock` for its
//!   life. A second daemon on the same directory would take the first one's fills in progress for
//!   a crash's leftovers and delete them, and evict files the first still serves: it is refused.
//!
//! - **Derived entries** (keys starting [`DERIVED_PREFIX`]: row groups this daemon decoded, see
//!   `format::parquet::kept`) are made from other bytes and can be made again, so they are
//!   published without an fsync, which would hold the decoder up for the disk's write speed.
//!   Their durability comes from a clean shutdown instead: [`NodeCache::close`] syncs the file
//!   system and leaves [`CLEAN_MARKER`]; start-up consumes the marker and, without it (a crash or
//!   power loss), deletes every derived entry. They fill only space nothing a stream will need
//!   holds, and never wait for it.
//!
//! Layout: `<cache-dir>/shards/<key>` where the key is a hash of the shard's source and identity
//! plus its name (`0123456789abcdef-train-000001.tar`), so a changed object never reuses an old
//! copy. Locks: the table mutex is never held across I/O; `closed` is held across one rename
//! (read, by a derived fill) or the closing sync (write), and never while taking the table mutex.

pub mod download;
pub mod key;
pub mod table;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use table::{Begin, CacheTable, Eviction, Policy, Rights};

use crate::atomic_write::AtomicFile;
use crate::{Error, Result};

/// Subdirectory of the cache directory holding shard copies.
pub const SHARDS_DIR: &str = "shards";

/// Key prefix of derived entries (see the module docs).
pub const DERIVED_PREFIX: &str = "derived-";

/// Left in the cache directory by a clean shutdown, after a `syncfs`: the derived entries beside
/// it are whole.
pub const CLEAN_MARKER: &str = "derived.clean";

/// Share of the cache file system's space (free at start-up plus what the cache already holds)
/// used when no `--cache-size` is given: the rest is headroom for sidecars, logs and other users.
const DEFAULT_CAPACITY_SHARE: f64 = 0.9;

/// How long a stream waits for pinned shards to be released when the cache is full before it
/// fails: long enough for other streams to move on from their current shards. Timed from the
/// last release of any pin seen, and [`SPACE_WAIT_MOST`] at most in all ([`SpaceWait`]).
const SPACE_WAIT: Duration = Duration::from_secs(60);
const SPACE_WAIT_MOST: Duration = Duration::from_secs(600);
const SPACE_FAILURES_APART: Duration = Duration::from_secs(10);

/// A fill's wait for room that pins hold. Streams of several jobs that each need room the others
/// pin begin waiting about together: timed from its start alone, every wait ran out within
/// moments of the others and every job failed, where the first one's end (its pins let go of)
/// would have let the rest through. So a wait runs out after [`SPACE_WAIT`] in which no pinned
/// byte was let go of (the streams wait on each other), or after [`SPACE_WAIT_MOST`]; and one
/// wait at a time: a wait that runs out within [`SPACE_FAILURES_APART`] of another's goes on
/// ([`SpaceWait::spare`]), for the stream that failed to let go of its pins.
#[derive(Debug)]
struct SpaceWait {
    started: Instant,
    progress: Instant,
    pinned: u64,
}

impl SpaceWait {
    fn new(now: Instant) -> Self {
        Self { started: now, progress: now, pinned: u64::MAX }
    }

    /// Whether to give up at `now`, with `pinned` bytes pinned.
    fn expired(&mut self, pinned: u64, now: Instant) -> bool {
        if pinned < self.pinned {
            self.progress = now;
        }
        self.pinned = pinned;
        now.duration_since(self.progress) > SPACE_WAIT || now.duration_since(self.started) > SPACE_WAIT_MOST
    }

    /// Whether a wait that ran out at `now` goes on because another ran out at `last` (the
    /// cache's last), and if not, records `now` there. Spared, it runs out a minute later, as if
    /// a pin had been let go of now; the overall bound stays.
    fn spare(&mut self, last: &mut Option<Instant>, now: Instant) -> bool {
        let spared = last.is_some_and(|at| now.saturating_duration_since(at) < SPACE_FAILURES_APART)
            && now.duration_since(self.started) <= SPACE_WAIT_MOST;
        if spared {
            self.progress = now;
        } else {
            *last = Some(now);
        }
        spared
    }
}

/// How often a capacity lowered by a full disk is measured again, to raise it once the disk has
/// room (the other user's files are gone).
const REGAIN_EVERY: Duration = Duration::from_secs(1);

/// The lock file in the cache directory (see the module docs).
pub const LOCK_FILE: &str = "lock";

/// Fills retried after ENOSPC (each after lowering the capacity to what the disk holds): more
/// than one, because concurrent fills can hit a full disk together.
const MAX_DISK_FULL_RETRIES: u32 = 5;

/// Free bytes of the file system holding `dir`, for an unprivileged writer.
fn free_bytes(dir: &Path) -> Option<u64> {
    let vfs = rustix::fs::statvfs(dir).ok()?;
    Some(vfs.f_bavail.saturating_mul(vfs.f_frsize))
}

/// A cache key: `<hash of source and identity>-<shard name made file-safe>`.
pub fn key_for(source: &str, identity: &[u8], name: &str) -> String {
    let h = crate::stable_hash::hash_parts([source.as_bytes(), &[0], identity]);
    let safe: String = name
        .chars()
        .rev()
        .take(96)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') { c } else { '_' })
        .collect();
    format!("{h:016x}-{safe}")
}

/// Whether `name` in the shards directory may be one of the cache's entries: not a file a node
/// cache keeps beside its shards directory (its lock, its clean-shutdown marker), which only a
/// daemon given this shards directory as its `--cache-dir` puts here. Counted, the lock was
/// evicted first under pressure: a third daemon then started on that directory beside the second.
fn is_entry_name(name: &str) -> bool {
    !matches!(name, LOCK_FILE | CLEAN_MARKER)
}

/// Refuses a cache directory inside another node cache's shards directory: the two daemons'
/// locks would not see each other, and each would hold the other's files.
pub fn refuse_nested(cache_dir: &Path) -> Result<()> {
    // Resolved as far as it exists (symlinks, `..`): it is made only once it is known to be fine.
    let Some((full, rest)) = cache_dir.ancestors().find_map(|a| {
        let real = std::fs::canonicalize(a).ok()?;
        Some((real, cache_dir.strip_prefix(a).ok()?.to_path_buf()))
    }) else {
        return Ok(());
    };
    let full = full.join(rest);
    for dir in full.ancestors() {
        if dir.file_name().is_some_and(|n| n == SHARDS_DIR)
            && let Some(outer) = dir.parent()
            && outer.join(LOCK_FILE).is_file()
        {
            return Err(Error::invalid(format!(
                "--cache-dir {} is inside the node cache {} (its {SHARDS_DIR} directory): give this daemon a \
                 directory of its own, outside it",
                cache_dir.display(),
                outer.display()
            )));
        }
    }
    Ok(())
}

/// Counters of the cache since start-up.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct CacheStats {
    pub capacity: u64,
    /// The capacity asked for: `capacity` is lower while a full disk lowered it.
    pub configured: u64,
    pub used: u64,
    /// Entries that are shard copies (or column-chunk copies), not derived ones.
    pub shards: u64,
    /// Derived entries (decoded row groups) and their bytes (a fill's reservation while it runs,
    /// as in `used`).
    pub derived: u64,
    pub derived_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub filled_bytes: u64,
    /// Largest `used` seen (never above `capacity`).
    pub high_water: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    filled_bytes: AtomicU64,
    high_water: AtomicU64,
}

pub struct NodeCache {
    dir: PathBuf,
    table: Mutex<CacheTable>,
    changed: Condvar,
    eviction: RwLock<Arc<dyn Eviction + Send + Sync>>,
    counters: Counters,
    /// Set by [`NodeCache::close`]; derived entries are published under its read lock, so none
    /// is renamed into place after the closing `syncfs`.
    closed: RwLock<bool>,
    /// Whether derived entries are made at all (`serve --no-keep-decoded` turns them off).
    keep_derived: std::sync::atomic::AtomicBool,
    /// Whether this run published a derived entry (unsynced): only then does [`NodeCache::close`]
    /// sync the file system.
    wrote_derived: std::sync::atomic::AtomicBool,
    /// Set when the daemon begins to drain ([`NodeCache::stop_waits`]): callers waiting for room or
    /// for another's fill give up, so that their streams end with the shutdown, not after it.
    stopping: std::sync::atomic::AtomicBool,
    /// The capacity given at open: a full disk lowers the table's, never above this.
    configured: u64,
    /// When a full disk lowered the capacity, the last time the disk was measured to raise it.
    lowered_at: Mutex<Option<Instant>>,
    /// When a wait for room last ran out ([`SpaceWait`]): the others wait on, for its stream's
    /// pins to be let go of, rather than fail with it.
    space_failed_at: Mutex<Option<Instant>>,
    /// The last failed fill of each key, and when it failed: a caller that waited on that fill
    /// fails with it rather than begin the same download again with the same retries (locked
    /// inside `table`'s lock).
    failures: Mutex<HashMap<String, (Instant, Error)>>,
    /// Told the device and inode of each copy the cache unlinks ([`NodeCache::on_removed`]).
    on_removed: std::sync::OnceLock<Box<Removed>>,
    /// The `flock` on [`LOCK_FILE`], released with the cache (and by the kernel at exit).
    _lock: File,
}

impl std::fmt::Debug for NodeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCache").field("dir", &self.dir).finish_non_exhaustive()
    }
}

/// What [`NodeCache::on_removed`] calls with a removed copy's device and inode.
type Removed = dyn Fn((u64, u64)) + Send + Sync;

/// A shard held in the cache for as long as the pin lives: it cannot be evicted meanwhile.
#[derive(Debug)]
pub struct Pin {
    cache: Arc<NodeCache>,
    key: String,
    path: PathBuf,
    /// True when this call fetched the shard (a miss).
    pub filled: bool,
}

impl Pin {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

impl Drop for Pin {
    fn drop(&mut self) {
        self.cache.lock().unpin(&self.key);
        self.cache.changed.notify_all();
    }
}

/// Whether the stream a wait serves has ended (its client left, or the daemon stops). A stream
/// waiting for room holds the pins of its shuffle window: waiting on for a client that is gone,
/// it kept them from the streams that could use the room for a minute ([`SPACE_WAIT`]).
#[derive(Clone, Copy)]
pub struct Ended<'a>(pub &'a (dyn Fn() -> bool + Sync));

impl std::fmt::Debug for Ended<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Ended(..)")
    }
}

/// An [`Ended`] owned, as a stream's working set keeps it.
#[derive(Clone)]
pub struct EndedBy(pub Arc<dyn Fn() -> bool + Send + Sync>);

impl EndedBy {
    pub fn as_ended(&self) -> Ended<'_> {
        Ended(&*self.0)
    }
}

impl std::fmt::Debug for EndedBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("EndedBy(..)")
    }
}

/// How a caller wants to be served.
#[derive(Debug, Clone, Copy)]
pub struct Want<'a> {
    /// Seconds until the shard is needed (0: a stream waits on it now).
    pub urgency: f64,
    /// Wait for another fill or for space (a stream), or give up at once (a prefetch).
    pub wait: bool,
    /// When the caller began asking for the shard, if before this call (it waited for another
    /// caller of the same shard first): a fill of it that fails after that is its failure too.
    pub since: Option<Instant>,
    /// May evict other entries for it (as `urgency` and `wait` allow); without, it takes free
    /// room only, and gets `Ok(None)` at once when there is not enough of it.
    pub evict: bool,
    /// A wait (for room, or for another caller's fill) gives up with [`Error::ClientGone`] once
    /// this says its stream ended; a fill under way finishes.
    pub ended: Option<Ended<'a>>,
}

impl Want<'_> {
    pub const NOW: Want<'static> = Want { urgency: 0.0, wait: true, since: None, evict: true, ended: None };
    /// Staging: waits for another caller's fill of the same shard, evicts nothing.
    pub const FREE_ROOM: Want<'static> = Want { evict: false, ..Want::NOW };

    fn rights(&self) -> Rights {
        match (self.evict, self.wait) {
            (false, _) => Rights::Nothing,
            (true, true) => Rights::Idle,
            (true, false) => Rights::NeededAfter(self.urgency),
        }
    }
}

/// Where [`clear_directory`] moves a directory it cannot delete, in the cache directory.
pub const MOVED_ASIDE_DIR: &str = "moved-aside";

/// A directory where a node-cache copy belongs (another hand's debris: the daemon makes none
/// there) would fail every stream that needs that shard, the copy never published over it. An
/// empty one is deleted; one with files is moved to [`MOVED_ASIDE_DIR`] in `cache_dir`, its
/// contents left for whoever made it. Said in a warning either way.
fn clear_directory(cache_dir: &Path, path: &Path) {
    if std::fs::remove_dir(path).is_ok() {
        tracing::warn!(path = %path.display(), "a directory held a node-cache copy's place: deleted (it was empty)");
        return;
    }
    let aside = cache_dir.join(MOVED_ASIDE_DIR);
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let to =
        aside.join(format!("{}.{stamp}", path.file_name().map_or_else(|| "entry".into(), |n| n.to_string_lossy())));
    match std::fs::create_dir_all(&aside).and_then(|()| std::fs::rename(path, &to)) {
        Ok(()) => tracing::warn!(
            path = %path.display(), moved_to = %to.display(),
            "a directory held a node-cache copy's place: moved aside, its files kept"
        ),
        Err(e) => tracing::warn!(
            path = %path.display(), error = %e,
            "a directory holds a node-cache copy's place and cannot be moved aside: that shard cannot be cached"
        ),
    }
}

/// How long a fill's failure is kept for the callers that waited on it.
const FAILURE_KEPT: Duration = Duration::from_secs(60);

impl NodeCache {
    /// Opens the cache in `cache_dir`: deletes temporary leftovers, re-adopts complete shards,
    /// and evicts down to `capacity` (default: [`DEFAULT_CAPACITY_SHARE`] of the space the file
    /// system gives it).
    pub fn open(cache_dir: &Path, capacity: Option<u64>, policy: Policy) -> Result<Arc<Self>> {
        refuse_nested(cache_dir)?;
        let dir = cache_dir.join(SHARDS_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create cache directory", &dir, e))?;
        // Before anything below deletes or evicts: those files may be another daemon's.
        let lock = lock_dir(cache_dir)?;
        // Consumed now, and durably: should this daemon crash, the derived entries it writes
        // unsynced must not be trusted by the next one.
        let marker = cache_dir.join(CLEAN_MARKER);
        let clean = match std::fs::remove_file(&marker) {
            Ok(()) => {
                crate::atomic_write::sync_dir(cache_dir).map_err(|e| Error::io("cannot sync", cache_dir, e))?;
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(Error::io("cannot remove", &marker, e)),
        };
        let mut adopted = Vec::new();
        let (mut removed, mut unclean) = (0usize, 0usize);
        for entry in std::fs::read_dir(&dir).map_err(|e| Error::io("cannot list cache directory", &dir, e))? {
            let entry = entry.map_err(|e| Error::io("cannot list cache directory", &dir, e))?;
            let path = entry.path();
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
            if crate::storage::local::is_temp_name(&name) {
                std::fs::remove_file(&path).map_err(|e| Error::io("cannot remove partial download", &path, e))?;
                removed += 1;
                continue;
            }
            if !clean && name.starts_with(DERIVED_PREFIX) {
                std::fs::remove_file(&path).map_err(|e| Error::io("cannot remove unsynced derived entry", &path, e))?;
                unclean += 1;
                continue;
            }
            if !is_entry_name(&name) {
                tracing::warn!(path = %path.display(), "not a node-cache entry: left alone, not counted");
                continue;
            }
            let meta = entry.metadata().map_err(|e| Error::io("cannot stat", &path, e))?;
            if meta.is_file() {
                adopted.push((name, meta.len()));
            } else if meta.is_dir() {
                clear_directory(cache_dir, &path);
            }
        }
        let held: u64 = adopted.iter().map(|(_, b)| b).sum();
        let capacity = match capacity {
            Some(c) => c,
            None => {
                let free = free_bytes(&dir).ok_or_else(|| {
                    Error::invalid(format!("cannot tell the free space of {}; give --cache-size", dir.display()))
                })?;
                ((free.saturating_add(held)) as f64 * DEFAULT_CAPACITY_SHARE) as u64
            }
        };
        let mut table = CacheTable::new(capacity, policy);
        for (name, bytes) in &adopted {
            table.adopt(name, *bytes);
        }
        let over = table.shrink_to(capacity, &());
        for k in &over {
            let _ = std::fs::remove_file(dir.join(k));
        }
        tracing::info!(
            dir = %dir.display(), capacity, adopted = adopted.len() - over.len(), removed_partial = removed,
            removed_unclean_derived = unclean, evicted = over.len(), ?policy, "node cache opened"
        );
        let cache = Arc::new(Self {
            dir,
            table: Mutex::new(table),
            changed: Condvar::new(),
            eviction: RwLock::new(Arc::new(())),
            counters: Counters::default(),
            closed: RwLock::new(false),
            stopping: std::sync::atomic::AtomicBool::new(false),
            keep_derived: std::sync::atomic::AtomicBool::new(true),
            wrote_derived: std::sync::atomic::AtomicBool::new(false),
            configured: capacity,
            lowered_at: Mutex::new(None),
            space_failed_at: Mutex::new(None),
            failures: Mutex::new(HashMap::new()),
            on_removed: std::sync::OnceLock::new(),
            _lock: lock,
        });
        cache.publish_gauges();
        Ok(cache)
    }

    fn lock(&self) -> MutexGuard<'_, CacheTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn policy(&self) -> Policy {
        self.lock().policy()
    }

    /// Installs what eviction consults about the future and about leases (the prefetcher).
    pub fn set_eviction(&self, ev: Arc<dyn Eviction + Send + Sync>) {
        *self.eviction.write().unwrap_or_else(|p| p.into_inner()) = ev;
    }

    /// Tells the entries among `uses` (key, seconds until its next use) their next use; with
    /// `whole`, `uses` names every key a consumer will read and the other entries are needed by
    /// none ([`CacheTable::set_next_uses`]).
    pub fn set_next_uses<'a>(&self, uses: impl IntoIterator<Item = (key::KeyRef<'a>, f64)>, whole: bool) {
        self.lock().set_next_uses(uses, whole);
    }

    fn eviction(&self) -> Arc<dyn Eviction + Send + Sync> {
        self.eviction.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    pub fn is_ready(&self, key: &str) -> bool {
        self.lock().is_ready(key)
    }

    /// True when the shard is ready or being filled.
    pub fn is_present(&self, key: &str) -> bool {
        self.lock().get(key).is_some()
    }

    /// Frees `bytes` of room by evicting ready entries among `keys`, in their order, that nobody
    /// pins or leases, and never another entry; true when the room is there. Staging replaces a
    /// dataset's own copies needed later with those needed first this way: it evicts nobody
    /// else's.
    pub fn make_room_from(&self, bytes: u64, keys: &[&str]) -> bool {
        let ev = self.eviction();
        let (evicted, room) = {
            let mut t = self.lock();
            let free = |t: &CacheTable| t.capacity().saturating_sub(t.used());
            let mut evicted = Vec::new();
            for k in keys {
                if free(&t) >= bytes {
                    break;
                }
                let idle = t.get(k).is_some_and(|e| e.state == table::State::Ready && e.pins == 0);
                if idle && !ev.leased(k) && t.remove_ready(k) {
                    evicted.push((*k).to_owned());
                }
            }
            (evicted, free(&t) >= bytes)
        };
        if !evicted.is_empty() {
            self.remove_evicted(&evicted);
            self.publish_gauges();
            self.changed.notify_all();
        }
        room
    }

    /// Bytes the cache may hold now (lowered while the disk is fuller than configured).
    pub fn capacity(&self) -> u64 {
        self.lock().capacity()
    }

    /// Bytes the cache was given at open: what [`Self::capacity`] returns to once the disk has
    /// room.
    pub fn configured_capacity(&self) -> u64 {
        self.configured
    }

    pub fn stats(&self) -> CacheStats {
        let t = self.lock();
        let (derived, derived_bytes) = t.count_prefixed(DERIVED_PREFIX);
        CacheStats {
            capacity: t.capacity(),
            configured: self.configured,
            used: t.used(),
            shards: (t.len() as u64).saturating_sub(derived),
            derived,
            derived_bytes,
            hits: self.counters.hits.load(Relaxed),
            misses: self.counters.misses.load(Relaxed),
            evictions: self.counters.evictions.load(Relaxed),
            filled_bytes: self.counters.filled_bytes.load(Relaxed),
            high_water: self.counters.high_water.load(Relaxed),
        }
    }

    pub fn publish_gauges(&self) {
        let (used, capacity) = {
            let t = self.lock();
            (t.used(), t.capacity())
        };
        self.counters.high_water.fetch_max(used, Relaxed);
        crate::metrics::cache_gauges(used, capacity);
    }

    /// Returns the shard pinned in the cache, filling it with `fill` on a miss. `fill` writes
    /// the shard into the temporary file it is given and verifies it; it runs without any lock
    /// held. Blocking. `Ok(None)` only when `want.wait` is false and the shard is being filled by
    /// someone else or does not fit without evicting sooner-needed shards, or when `want.evict`
    /// is false and the free room is short.
    pub fn get<'k>(
        self: &Arc<Self>,
        key: impl Into<key::KeyRef<'k>>,
        bytes: u64,
        want: Want,
        fill: &mut dyn FnMut(&Path, &File) -> Result<()>,
    ) -> Result<Option<Pin>> {
        self.get_or_fill(key.into(), bytes, want, true, fill)
    }

    /// The derived entry `key` pinned when it is ready. Never fills.
    pub fn derived(self: &Arc<Self>, key: &str) -> Option<Pin> {
        debug_assert!(key.starts_with(DERIVED_PREFIX));
        if !self.lock().pin_ready(key) {
            return None;
        }
        Some(Pin { cache: self.clone(), key: key.to_owned(), path: self.path_of(key), filled: false })
    }

    /// Turns the making of derived entries on or off (on by default); existing ones stay.
    pub fn set_keep_derived(&self, keep: bool) {
        self.keep_derived.store(keep, Relaxed);
    }

    /// Whether derived entries are made ([`Self::set_keep_derived`]).
    pub fn keeps_derived(&self) -> bool {
        self.keep_derived.load(Relaxed)
    }

    /// Deletes the derived entry `key` (it proved damaged).
    pub fn remove_derived(&self, key: &str) {
        debug_assert!(key.starts_with(DERIVED_PREFIX));
        if self.lock().remove_ready(key) {
            let p = self.path_of(key);
            if let Err(e) = std::fs::remove_file(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot delete a damaged derived entry");
            }
            self.publish_gauges();
        }
    }

    /// Fills the derived entry `key` (at most `bytes`; accounted at what `fill` wrote) and pins
    /// it, published without an fsync (see the module docs). Only into space that nothing a
    /// stream will need holds, and without waiting: `Ok(None)` when it does not fit or is being
    /// filled already.
    pub fn fill_derived(
        self: &Arc<Self>,
        key: &str,
        bytes: u64,
        fill: &mut dyn FnMut(&Path, &File) -> Result<()>,
    ) -> Result<Option<Pin>> {
        debug_assert!(key.starts_with(DERIVED_PREFIX));
        // Evicts only what is never needed again (`next_use` None): `f64::MAX` is later than
        // every known use.
        self.get_or_fill(
            key.into(),
            bytes,
            Want { urgency: f64::MAX, wait: false, since: None, evict: true, ended: None },
            false,
            fill,
        )
    }

    /// Ends every wait for room or for another caller's fill, now and later, with
    /// [`Error::Unavailable`] (the daemon drains: a wait could outlast the drain, and its stream
    /// would end in a broken connection instead of the shutdown's word). Fills under way finish.
    pub fn stop_waits(&self) {
        self.stopping.store(true, Relaxed);
        // Under the table's lock, so that no waiter between its check and its wait misses it.
        drop(self.lock());
        self.changed.notify_all();
    }

    /// Makes this run's derived entries durable and says so to the next start-up (see the module
    /// docs). At a clean shutdown, after the last fill; blocking (a `syncfs` of the cache's file
    /// system, when this run wrote any: the earlier runs' were synced by their own close).
    pub fn close(&self) -> Result<()> {
        let Some(root) = self.dir.parent() else { return Ok(()) };
        let mut closed = self.closed.write().unwrap_or_else(|p| p.into_inner());
        *closed = true;
        if self.wrote_derived.load(Relaxed) {
            let dir = File::open(&self.dir).map_err(|e| Error::io("cannot open", &self.dir, e))?;
            rustix::fs::syncfs(&dir).map_err(|e| Error::io("cannot sync the file system of", &self.dir, e.into()))?;
        }
        let marker = root.join(CLEAN_MARKER);
        let written = crate::atomic_write::write(&marker, b"derived entries synced at a clean shutdown\n")
            .map_err(|e| Error::io("cannot write", &marker, e));
        drop(closed);
        written
    }

    fn get_or_fill(
        self: &Arc<Self>,
        entry: key::KeyRef<'_>,
        bytes: u64,
        want: Want,
        durable: bool,
        fill: &mut dyn FnMut(&Path, &File) -> Result<()>,
    ) -> Result<Option<Pin>> {
        let key = entry.as_str();
        if durable {
            self.drop_unlike_copy(key, bytes);
        }
        let mut disk_full_retries = 0;
        let mut measured_for_this = false;
        let mut space_wait = SpaceWait::new(Instant::now());
        // From when this caller waits on another's fill of `key`: that fill's failure is its own.
        let mut waiting_since = want.since;
        self.regain_capacity(false);
        loop {
            let ev = self.eviction();
            let begun = {
                let mut t = self.lock();
                loop {
                    if let Some(e) = waiting_since.and_then(|since| self.failed_since(key, since)) {
                        return Err(e);
                    }
                    let begun = t.begin(entry, bytes, want.rights(), ev.as_ref());
                    let waits = match begun {
                        Begin::Wait => want.wait,
                        Begin::NoSpace { .. } => want.wait && want.evict,
                        _ => false,
                    };
                    if waits && self.stopping.load(Relaxed) {
                        return Err(Error::Unavailable(format!(
                            "daemon is shutting down (shard {key} was waiting for room in the node cache or for \
                             another stream's download of it)"
                        )));
                    }
                    if waits && want.ended.is_some_and(|e| (e.0)()) {
                        return Err(Error::ClientGone(format!(
                            "the stream ended while shard {key} waited for room in the node cache or for another \
                             stream's download of it"
                        )));
                    }
                    match begun {
                        Begin::Wait if want.wait => {
                            waiting_since.get_or_insert_with(Instant::now);
                            t = self
                                .changed
                                .wait_timeout(t, Duration::from_millis(200))
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        Begin::NoSpace { needed, evictable } if want.wait && want.evict => {
                            if needed > t.capacity() && !measured_for_this && self.is_lowered() {
                                // Lowered by a full disk that may have room again by now.
                                measured_for_this = true;
                                drop(t);
                                self.regain_capacity(true);
                                t = self.lock();
                                continue;
                            }
                            if needed > t.capacity() {
                                return Err(Error::CacheFull(format!(
                                    "its copy ({needed} bytes) is larger than the node cache ({} bytes in {}; entry \
                                     {key}); raise --cache-size",
                                    t.capacity(),
                                    self.dir.display()
                                )));
                            }
                            let now = Instant::now();
                            if space_wait.expired(t.pinned_bytes(), now)
                                && !space_wait
                                    .spare(&mut self.space_failed_at.lock().unwrap_or_else(|p| p.into_inner()), now)
                            {
                                if t.capacity() < self.configured && self.is_lowered() {
                                    // The advice below would mislead: the size asked for fits.
                                    return Err(Error::CacheFull(format!(
                                        "node cache {} is full: its file system is full, so its capacity is lowered \
                                         to {} of the {} bytes asked for (--cache-size), and {} of them are pinned \
                                         by active streams or leased to clients; {needed} more are needed (only \
                                         {evictable} could be freed). Free space on that file system (the capacity \
                                         comes back as it frees), or run fewer jobs on this node",
                                        self.dir.display(),
                                        t.capacity(),
                                        self.configured,
                                        t.pinned_bytes(),
                                    )));
                                }
                                return Err(Error::CacheFull(format!(
                                    "node cache {} is full: {} of {} bytes are pinned by active streams or leased \
                                     to clients and {needed} more are needed (only {evictable} could be freed). \
                                     Each stream keeps the shards of its shuffle window pinned (shuffle_window, \
                                     8 by default) and those its batches in flight still draw on, a few more, so \
                                     a cache smaller than that many shards per stream stalls: raise --cache-size, \
                                     lower the loader's shuffle_window, or run fewer jobs on this node",
                                    self.dir.display(),
                                    t.pinned_bytes(),
                                    t.capacity()
                                )));
                            }
                            t = self
                                .changed
                                .wait_timeout(t, Duration::from_millis(200))
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        other => break other,
                    }
                }
            };
            let evicted = match begun {
                Begin::Hit => {
                    self.counters.hits.fetch_add(1, Relaxed);
                    crate::metrics::cache_hit();
                    return Ok(Some(Pin {
                        cache: self.clone(),
                        key: key.to_owned(),
                        path: self.path_of(key),
                        filled: false,
                    }));
                }
                Begin::Wait | Begin::NoSpace { .. } => return Ok(None),
                Begin::Fill { evicted } => evicted,
            };
            self.remove_evicted(&evicted);
            if durable {
                // Hits and misses are the shards' (the hit ratio operators watch); a derived entry
                // is looked up, and made, apart.
                self.counters.misses.fetch_add(1, Relaxed);
                crate::metrics::cache_miss();
            }
            self.publish_gauges();
            match self.fill_one(key, durable, fill) {
                Ok(()) => {
                    // A derived entry's size is bounded beforehand, known only now: its file is
                    // measured before the table is locked (no I/O under that lock), and nothing
                    // else touches it while the entry is still being filled.
                    let written =
                        if durable { None } else { std::fs::metadata(self.path_of(key)).ok().map(|m| m.len()) };
                    let mut t = self.lock();
                    t.finish(key, true);
                    // A caller still waiting since an earlier fill failed takes this copy instead.
                    self.failures.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
                    if let Some(len) = written {
                        t.settle(key, len);
                    }
                    drop(t);
                    let filled = written.unwrap_or(bytes);
                    self.changed.notify_all();
                    self.counters.filled_bytes.fetch_add(filled, Relaxed);
                    if !durable {
                        self.publish_gauges();
                    }
                    return Ok(Some(Pin {
                        cache: self.clone(),
                        key: key.to_owned(),
                        path: self.path_of(key),
                        filled: true,
                    }));
                }
                Err(e) => {
                    let disk_full = is_disk_full(&e);
                    // Measured after the failed fill's file is gone: what the disk can still take.
                    let free = disk_full.then(|| free_bytes(&self.dir)).flatten();
                    // What the cache's files hold on disk, ready or still being written by other fills.
                    let held = disk_full.then(|| bytes_in(&self.dir));
                    let last = {
                        let mut t = self.lock();
                        t.finish(key, false);
                        if let Some(free) = free {
                            // The disk holds less than the capacity promised (other users, a small
                            // file system): from now on account for what really fits. Fills still
                            // in flight may use some of `free`; if so the next ENOSPC lowers it again.
                            // Never below what other fills have already reserved: they were
                            // admitted and will finish (or fail and lower it again).
                            // Measured as the cache's own files plus the free space: counting only
                            // ready shards would forget the bytes other fills have already written,
                            // and each ENOSPC under concurrent fills would ratchet the capacity down
                            // below what the disk holds.
                            let on_disk = held.unwrap_or(0).max(t.ready_bytes());
                            let real = (on_disk + free).max(t.used()).min(t.capacity());
                            tracing::warn!(dir = %self.dir.display(), capacity = real, "cache disk full, lowering capacity");
                            t.set_capacity(real);
                            // Just measured: the next look is a REGAIN_EVERY away.
                            *self.lowered_at.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                        }
                        let fits = bytes <= t.capacity();
                        let last = match e {
                            _ if disk_full && fits && disk_full_retries < MAX_DISK_FULL_RETRIES => None,
                            _ if disk_full => Some(Error::CacheFull(format!(
                                "node cache {} ran out of disk space writing shard {key} ({bytes} bytes) even \
                                 after evicting; free space there or lower --cache-size",
                                self.dir.display()
                            ))),
                            e => Some(e),
                        };
                        // Recorded before the entry's waiters can see it gone (under the table's
                        // lock): they fail with this fill rather than start another. Not a full
                        // disk: that depends on what this filler may evict (a prefetch may evict
                        // less than a stream), and a waiter tries with its own rights.
                        if let Some(e) = last.as_ref().filter(|_| !disk_full) {
                            self.note_failure(key, e);
                        }
                        last
                    };
                    self.changed.notify_all();
                    self.publish_gauges();
                    // None: the disk was full, and the shard fits once more is evicted: again.
                    if let Some(e) = last {
                        return Err(e);
                    }
                    disk_full_retries += 1;
                }
            }
        }
    }

    /// Records that the fill of `key` failed with `e` now (called under the table's lock).
    fn note_failure(&self, key: &str, e: &Error) {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        failures.retain(|_, (at, _)| now.duration_since(*at) < FAILURE_KEPT);
        failures.insert(key.to_owned(), (now, e.again()));
    }

    /// The failure of a fill of `key` that ended at or after `since` (called under the table's
    /// lock, so a fill that fails is recorded before its entry is gone).
    fn failed_since(&self, key: &str, since: Instant) -> Option<Error> {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        failures.get(key).filter(|(at, _)| *at >= since).map(|(_, e)| e.again())
    }

    /// Whether a fill of `key` failed less than `within` ago (the prefetcher's backoff: a shard
    /// whose download a stream just gave up on is not begun again at the next tick).
    pub fn failed_recently(&self, key: &str, within: Duration) -> bool {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        failures.get(key).is_some_and(|(at, _)| at.elapsed() < within)
    }

    fn is_lowered(&self) -> bool {
        self.lowered_at.lock().unwrap_or_else(|p| p.into_inner()).is_some()
    }

    /// Raises a capacity that a full disk lowered back towards the configured one, as far as the
    /// disk now has room: the cache's own files plus the free space, measured as when it was
    /// lowered. At most once a [`REGAIN_EVERY`] unless `now`; nothing to do while not lowered.
    fn regain_capacity(&self, now: bool) {
        {
            let mut at = self.lowered_at.lock().unwrap_or_else(|p| p.into_inner());
            match *at {
                None => return,
                Some(t) if !now && t.elapsed() < REGAIN_EVERY => return,
                Some(_) => *at = Some(Instant::now()),
            }
        }
        // Measured without the table's lock (I/O), like the lowering.
        let Some(free) = free_bytes(&self.dir) else { return };
        let held = bytes_in(&self.dir);
        let raised = {
            let mut t = self.lock();
            let real = held.max(t.ready_bytes()).saturating_add(free).min(self.configured);
            if real <= t.capacity() {
                return;
            }
            t.set_capacity(real);
            real
        };
        if raised == self.configured {
            *self.lowered_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
        }
        tracing::info!(dir = %self.dir.display(), capacity = raised, "cache disk has room again, raising capacity");
        self.changed.notify_all();
        self.publish_gauges();
    }

    /// A ready copy of `key` whose size is not `bytes`, the shard's listed size, is not the
    /// shard: a file adopted at start-up that was cut short or grown while no daemon ran (a
    /// fill is verified before it is published). Kept, every stream reading it would fail on it
    /// for good; dropped here (unless a stream or client holds it now), it is fetched again.
    fn drop_unlike_copy(&self, key: &str, bytes: u64) {
        let ev = self.eviction();
        let dropped = {
            let mut t = self.lock();
            let unlike = t
                .get(key)
                .and_then(|e| (e.state == table::State::Ready && e.bytes != bytes && e.pins == 0).then_some(e.bytes));
            unlike.filter(|_| !ev.leased(key) && t.remove_ready(key))
        };
        if let Some(had) = dropped {
            tracing::warn!(
                path = %self.path_of(key).display(), copy_bytes = had, shard_bytes = bytes,
                "node-cache copy is not the size of its shard (changed while no daemon ran?): fetched again"
            );
            self.remove_evicted(&[key.to_owned()]);
            self.publish_gauges();
        }
    }

    /// Drops the ready copy `key` (`why` says why, in the warning) so that its next use fetches
    /// it again: a copy found not to be its shard (a local source rewritten since it was copied,
    /// a copy damaged on disk). Refused (false) while a stream or a client holds it.
    pub fn drop_copy(&self, key: &str, why: &str) -> bool {
        let ev = self.eviction();
        let dropped = {
            let mut t = self.lock();
            let idle = t.get(key).is_some_and(|e| e.state == table::State::Ready && e.pins == 0);
            idle && !ev.leased(key) && t.remove_ready(key)
        };
        if dropped {
            tracing::warn!(path = %self.path_of(key).display(), "node-cache copy dropped, fetched again at its next use: {why}");
            self.remove_evicted(&[key.to_owned()]);
            self.publish_gauges();
        }
        dropped
    }

    /// Has `removed` told the device and inode of each copy the cache unlinks (evicted, or
    /// dropped as not its shard), after the unlink. An unlinked file keeps its blocks for as
    /// long as it is open or mapped anywhere: what the daemon itself keeps mapped of it (decoded
    /// row groups over a Parquet copy) is let go of there, or the disk would hold it beyond
    /// `--cache-size`. Set once; later calls are ignored.
    pub fn on_removed(&self, removed: impl Fn((u64, u64)) + Send + Sync + 'static) {
        if self.on_removed.set(Box::new(removed)).is_err() {
            tracing::debug!("the node cache's removal hook was set already");
        }
    }

    /// Clears the way for the copy `key` when a directory holds its place (see
    /// [`clear_directory`]). One `lstat` per fill, beside a download.
    fn clear_way(&self, key: &str) {
        let p = self.path_of(key);
        if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir())
            && let Some(root) = self.dir.parent()
        {
            clear_directory(root, &p);
        }
    }

    fn remove_evicted(&self, evicted: &[String]) {
        use std::os::unix::fs::MetadataExt;
        let ev = if evicted.is_empty() { None } else { Some(self.eviction()) };
        for k in evicted {
            let p = self.path_of(k);
            let identity = match self.on_removed.get() {
                Some(_) => std::fs::symlink_metadata(&p).ok().map(|m| (m.dev(), m.ino())),
                None => None,
            };
            match std::fs::remove_file(&p) {
                Ok(()) => {
                    if let (Some(removed), Some(id)) = (self.on_removed.get(), identity) {
                        removed(id);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) if std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir()) => {
                    if let Some(root) = self.dir.parent() {
                        clear_directory(root, &p);
                    }
                }
                Err(e) => tracing::warn!(path = %p.display(), error = %e, "cannot delete evicted shard"),
            }
            if let Some(ev) = &ev {
                ev.evicted(k);
            }
            self.counters.evictions.fetch_add(1, Relaxed);
            crate::metrics::cache_eviction();
        }
    }

    /// Writes one fill to a temporary file, syncs it (when `durable`) and renames it into place.
    fn fill_one(&self, key: &str, durable: bool, fill: &mut dyn FnMut(&Path, &File) -> Result<()>) -> Result<()> {
        let dest = self.path_of(key);
        self.clear_way(key);
        // Dropped on any error below, which removes the temporary file.
        let tmp = AtomicFile::create(&dest).map_err(|e| Error::io("cannot create cache file", &dest, e))?;
        fill(tmp.temp_path(), tmp.file())?;
        fail_point!("cache-fill", |a| Err(crate::failpoints::io("cannot write cache file", tmp.temp_path(), a)));
        if durable {
            fail_point!("cache-fsync", |a| Err(crate::failpoints::io("cannot sync cache file", tmp.temp_path(), a)));
        }
        fail_point!("cache-rename", |a| Err(crate::failpoints::io("cannot publish cache file", &dest, a)));
        if !durable {
            let closed = self.closed.read().unwrap_or_else(|p| p.into_inner());
            if *closed {
                return Err(Error::Unavailable("the node cache is closing".into()));
            }
            self.wrote_derived.store(true, Relaxed);
            return tmp.commit_unsynced().map_err(|e| Error::io("cannot publish cache file", &dest, e));
        }
        tmp.commit().map_err(|e| Error::io("cannot publish cache file", &dest, e))
    }
}

/// Opens and locks `<cache_dir>/lock` (see the module docs); refused while another daemon holds it.
fn lock_dir(cache_dir: &Path) -> Result<File> {
    let path = cache_dir.join(LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("cannot open the node cache's lock file", &path, e))?;
    match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(file),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(Error::invalid(format!(
            "the node cache {} is in use by another shardstream daemon (it holds {}): connect to that \
             daemon, or give this one a --cache-dir of its own (SHARDSTREAM_CACHE_DIR for a server \
             started inside a trainer)",
            cache_dir.display(),
            path.display()
        ))),
        Err(e) => Err(Error::io("cannot lock", &path, e.into())),
    }
}

/// Bytes of the files in `dir` (the shards directory: ready copies and fills in progress).
fn bytes_in(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.filter_map(|e| e.ok()?.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

fn is_disk_full(e: &Error) -> bool {
    matches!(e, Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) || source.raw_os_error() == Some(libc::EDQUOT))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_for_room_runs_out_a_minute_after_the_last_pin_let_go_of() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = SpaceWait::new(t0);
        assert!(!w.expired(100, at(0)));
        assert!(!w.expired(120, at(50)), "more pinned: no progress");
        assert!(!w.expired(90, at(59)), "a pin let go of");
        assert!(!w.expired(90, at(110)));
        assert!(w.expired(90, at(120)), "a minute without one");
        // However the pins come and go, not past ten minutes.
        let mut w = SpaceWait::new(t0);
        for s in (0..600).step_by(30) {
            assert!(!w.expired(if s % 60 == 0 { 100 } else { 90 }, at(s)), "{s}");
        }
        assert!(w.expired(80, at(601)));
        // Waits that run out together fail one at a time, ten seconds apart at least.
        let mut last = None;
        let (mut a, mut b) = (SpaceWait::new(t0), SpaceWait::new(t0));
        assert!(!a.expired(100, t0) && !b.expired(100, t0));
        assert!(a.expired(100, at(61)) && !a.spare(&mut last, at(61)), "the first fails");
        assert!(b.expired(100, at(61)) && b.spare(&mut last, at(61)), "the second goes on");
        assert!(!b.expired(100, at(100)));
        assert!(b.expired(100, at(122)) && !b.spare(&mut last, at(122)), "a minute later, alone");
    }

    #[test]
    fn only_entries_are_adopted_and_a_cache_inside_another_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outer = dir.path().join("outer");
        drop(NodeCache::open(&outer, Some(1 << 20), Policy::Lru).unwrap());
        let shards = outer.join(SHARDS_DIR);
        let key = key_for("/d/a.tar", b"len=3", "a.tar");
        std::fs::write(shards.join(&key), b"abc").unwrap();
        std::fs::write(shards.join(format!("{DERIVED_PREFIX}{key}")), b"de").unwrap();
        for stranger in [LOCK_FILE, CLEAN_MARKER] {
            std::fs::write(shards.join(stranger), b"0123456789").unwrap();
        }
        // A clean shutdown's marker, so that the derived entry is trusted.
        std::fs::write(outer.join(CLEAN_MARKER), b"").unwrap();
        let cache = NodeCache::open(&outer, Some(1 << 20), Policy::Lru).unwrap();
        let st = cache.stats();
        assert_eq!((st.shards, st.derived, st.used), (1, 1, 5));
        assert!(shards.join("lock").try_exists().unwrap(), "a stranger is left alone");
        drop(cache);
        for nested in [shards.clone(), shards.join("deeper")] {
            let e = NodeCache::open(&nested, Some(1 << 20), Policy::Lru).unwrap_err().to_string();
            assert!(e.contains("is inside the node cache") && e.contains("outer"), "{e}");
            assert!(!nested.join(SHARDS_DIR).try_exists().unwrap(), "nothing made there");
        }
        // Beside the shards directory is the user's choice, and harmless.
        NodeCache::open(&outer.join("job2"), Some(1 << 20), Policy::Lru).unwrap();
    }

    #[test]
    fn cache_keys_are_pinned() {
        // File names in every node cache: a change orphans all cached shards. Computed by the
        // code before the hashes were unified (see `crate::stable_hash`).
        assert_eq!(
            key_for("s3://b/ds/train-000001.tar", b"len=20480;etag=\"0123abcd\"", "train-000001.tar"),
            "811711802475e0cc-train-000001.tar"
        );
        assert_eq!(
            key_for("/data/ds/train-000000.tar", b"len=10240;crc32c=deadbeef", "dir/with space/train-000000.tar"),
            "7cfc9b1388aa295c-dir_with_space_train-000000.tar"
        );
    }
    use std::io::Write;

    fn write(bytes: &'static [u8]) -> impl FnMut(&Path, &File) -> Result<()> {
        move |_, mut f: &File| f.write_all(bytes).map_err(|e| Error::io("write", "x", e))
    }

    /// Fills `key` (5 bytes) on a thread of its own, returning once the fill is under way; `end`
    /// says how it ends (the bytes written, or the fill's error).
    fn fill_under_way(
        cache: &Arc<NodeCache>,
        key: &'static str,
        end: impl FnOnce() -> Result<&'static [u8]> + Send + 'static,
    ) -> std::thread::JoinHandle<Result<()>> {
        let (began, in_flight) = std::sync::mpsc::channel();
        let cache = cache.clone();
        let filler = std::thread::spawn(move || {
            let mut end = Some(end);
            let mut fill = |tmp: &Path, f: &File| {
                began.send(()).unwrap();
                let bytes = end.take().expect("one fill")()?;
                write(bytes)(tmp, f)
            };
            cache.get(key, 5, Want::NOW, &mut fill).map(drop)
        });
        in_flight.recv().unwrap();
        filler
    }

    #[test]
    fn fills_once_hits_after_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let pin = cache.get("k1", 5, Want::NOW, &mut write(b"hello")).unwrap().unwrap();
        assert!(pin.filled);
        assert_eq!(std::fs::read(pin.path()).unwrap(), b"hello");
        let again = cache.get("k1", 5, Want::NOW, &mut |_, _| panic!("filled twice")).unwrap().unwrap();
        assert!(!again.filled);
        drop((pin, again));
        // A crashed daemon's partial download, then a restart: the partial file goes, the
        // complete one is adopted.
        std::fs::write(dir.path().join("shards/.k2.tmp.1.0"), b"par").unwrap();
        drop(cache);
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        assert!(!dir.path().join("shards/.k2.tmp.1.0").try_exists().unwrap());
        assert!(cache.is_ready("k1"));
        assert_eq!(cache.stats().used, 5);
    }

    #[test]
    fn an_adopted_copy_of_another_size_is_filled_again_unless_held() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("shards")).unwrap();
        std::fs::write(dir.path().join("shards/short"), b"abc").unwrap();
        std::fs::write(dir.path().join("shards/held"), b"abc").unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let _holder = cache.get("held", 3, Want::NOW, &mut |_, _| panic!("a hit")).unwrap().unwrap();
        // The shard is 5 bytes: the 3 on disk are not it.
        let pin = cache.get("short", 5, Want::NOW, &mut write(b"hello")).unwrap().unwrap();
        assert!(pin.filled);
        assert_eq!(std::fs::read(pin.path()).unwrap(), b"hello");
        assert_eq!(cache.stats().used, 8);
        // Held by a stream: left alone (its reader fails on it, naming the file).
        let held = cache.get("held", 5, Want::NOW, &mut |_, _| panic!("replaced under its holder")).unwrap().unwrap();
        assert!(!held.filled);
    }

    #[test]
    fn a_second_cache_on_the_same_directory_is_refused() {
        // A second daemon on the same directory would delete the first one's fills in progress
        // as a crash's leftovers, and evict files the first still lists as ready.
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let pin = cache
            .get("k", 5, Want::NOW, &mut |tmp, mut f: &File| {
                let e = NodeCache::open(dir.path(), Some(1), Policy::Lru).unwrap_err().to_string();
                assert!(e.contains("in use by another") && e.contains(&dir.path().display().to_string()), "{e}");
                assert!(tmp.try_exists().unwrap(), "the fill in progress was deleted");
                f.write_all(b"hello").map_err(|e| Error::io("write", "x", e))
            })
            .unwrap()
            .unwrap();
        assert!(cache.is_ready("k"));
        assert!(NodeCache::open(dir.path(), Some(100), Policy::Lru).is_err(), "a pin keeps the cache open");
        drop((pin, cache));
        let again = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        assert!(again.is_ready("k"), "the next daemon adopts the copy once the first is gone");
    }

    #[test]
    fn a_failed_fill_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let err = cache
            .get("k", 5, Want::NOW, &mut |_, mut f: &File| {
                f.write_all(b"ha").unwrap();
                Err(Error::Shard { shard: "s3://b/k".into(), offset: None, reason: "checksum".into() })
            })
            .unwrap_err();
        assert!(err.to_string().contains("s3://b/k"));
        assert_eq!(std::fs::read_dir(dir.path().join("shards")).unwrap().count(), 0);
        assert_eq!(cache.stats().used, 0);
    }

    #[test]
    fn eviction_keeps_the_cache_under_capacity_and_spares_pinned_shards() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(10), Policy::Lru).unwrap();
        let a = cache.get("a", 5, Want::NOW, &mut write(b"aaaaa")).unwrap().unwrap();
        drop(cache.get("b", 5, Want::NOW, &mut write(b"bbbbb")).unwrap().unwrap());
        drop(cache.get("c", 5, Want::NOW, &mut write(b"ccccc")).unwrap().unwrap());
        assert!(cache.is_ready("a") && !cache.is_ready("b") && cache.is_ready("c"), "b evicted, a pinned");
        assert!(!dir.path().join("shards/b").try_exists().unwrap());
        // A reader holding an evicted file still reads valid bytes.
        let f = File::open(a.path()).unwrap();
        drop(a);
        drop(cache.get("d", 10, Want::NOW, &mut write(b"dddddddddd")).unwrap().unwrap());
        assert_eq!(std::io::read_to_string(f).unwrap(), "aaaaa");
        let s = cache.stats();
        assert!(s.high_water <= 10 && s.evictions == 3, "{s:?}");
        let err = cache.get("huge", 11, Want::NOW, &mut write(b"")).unwrap_err().to_string();
        assert!(err.contains("larger than the node cache"), "{err}");
    }

    #[test]
    fn making_room_evicts_only_the_listed_idle_entries_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(15), Policy::Lru).unwrap();
        drop(cache.get("other", 5, Want::NOW, &mut write(b"ooooo")).unwrap().unwrap());
        let pinned = cache.get("pinned", 5, Want::NOW, &mut write(b"ppppp")).unwrap().unwrap();
        drop(cache.get("late", 5, Want::NOW, &mut write(b"lllll")).unwrap().unwrap());
        assert!(!cache.make_room_from(10, &["pinned", "absent", "late"]), "a pinned copy is never taken");
        assert!(cache.is_ready("pinned") && cache.is_ready("other") && !cache.is_ready("late"));
        assert!(!dir.path().join("shards/late").try_exists().unwrap());
        assert!(cache.make_room_from(5, &["other"]) && cache.is_ready("other"), "the room was free already");
        drop(pinned);
        assert!(cache.make_room_from(10, &["pinned", "other"]));
        assert!(!cache.is_ready("pinned") && cache.is_ready("other"), "no more is evicted than the room needs");
        assert_eq!(cache.stats().used, 5);
    }

    #[test]
    fn a_wait_for_room_or_for_another_fill_ends_with_its_stream() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(10), Policy::Lru).unwrap();
        let _pinned = cache.get("pinned", 5, Want::NOW, &mut write(b"ppppp")).unwrap().unwrap();
        let (release, held) = std::sync::mpsc::channel::<()>();
        let filler = fill_under_way(&cache, "slow", move || {
            held.recv().ok();
            Ok(b"sssss")
        });
        let gone = std::sync::atomic::AtomicBool::new(false);
        let ended = || gone.load(Relaxed);
        let want = Want { ended: Some(Ended(&ended)), ..Want::NOW };
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(300));
                gone.store(true, Relaxed);
            });
            let t0 = Instant::now();
            // The cache is full of pins: a minute's wait (SPACE_WAIT) for its stream's client
            // that left, holding that stream's pins all along.
            let err = cache.get("late", 5, want, &mut |_, _| panic!("no room")).unwrap_err();
            assert!(matches!(err, Error::ClientGone(_)), "{err}");
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        });
        let err = cache.get("slow", 5, want, &mut |_, _| panic!("filled twice")).unwrap_err();
        assert!(matches!(err, Error::ClientGone(_)), "{err}");
        assert!(err.to_string().contains("slow"), "{err}");
        release.send(()).unwrap();
        filler.join().unwrap().unwrap();
        assert!(cache.is_ready("slow"), "another stream's fill is not its to stop");
    }

    #[test]
    fn free_room_takes_only_free_room_and_still_waits_for_a_fill_under_way() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(10), Policy::Lru).unwrap();
        drop(cache.get("idle", 5, Want::NOW, &mut write(b"iiiii")).unwrap().unwrap());
        assert!(cache.get("staged", 5, Want::FREE_ROOM, &mut write(b"sssss")).unwrap().is_some());
        assert!(cache.get("more", 5, Want::FREE_ROOM, &mut |_, _| panic!("no room")).unwrap().is_none());
        assert!(cache.is_ready("idle") && cache.is_ready("staged"), "nothing evicted");
        // Another caller's fill of the same entry is waited for, then served as a hit.
        let filler = fill_under_way(&cache, "waited", || {
            std::thread::sleep(Duration::from_millis(200));
            Ok(b"wwwww")
        });
        let pin = cache.get("waited", 5, Want::FREE_ROOM, &mut |_, _| panic!("filled twice")).unwrap().unwrap();
        assert!(!pin.filled);
        filler.join().unwrap().unwrap();
    }

    #[test]
    fn a_drain_ends_waits_for_room_and_for_fills() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(5), Policy::Lru).unwrap();
        let _held = cache.get("held", 5, Want::NOW, &mut write(b"hhhhh")).unwrap().unwrap();
        let waiter = {
            let cache = cache.clone();
            std::thread::spawn(move || cache.get("next", 5, Want::NOW, &mut |_, _| panic!("no room")).map(drop))
        };
        std::thread::sleep(Duration::from_millis(300));
        assert!(!waiter.is_finished(), "waits for room while the cache is full");
        let asked = Instant::now();
        cache.stop_waits();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)) && err.to_string().contains("shutting down"), "{err}");
        assert!(asked.elapsed() < Duration::from_secs(2));
        // Later callers that would wait give up at once; a hit is still served, and staging's
        // free room says "no room" as before.
        assert!(cache.get("next", 5, Want::NOW, &mut |_, _| panic!("no room")).is_err());
        assert!(cache.get("held", 5, Want::NOW, &mut |_, _| panic!("a hit")).unwrap().is_some());
        assert!(cache.get("next", 5, Want::FREE_ROOM, &mut |_, _| panic!("no room")).unwrap().is_none());
    }

    #[test]
    fn a_drain_ends_a_wait_for_another_callers_fill() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let filler = fill_under_way(&cache, "k", move || {
            released.recv().unwrap();
            Ok(b"fffff")
        });
        let waiter = {
            let cache = cache.clone();
            std::thread::spawn(move || cache.get("k", 5, Want::NOW, &mut |_, _| panic!("filled twice")).map(drop))
        };
        std::thread::sleep(Duration::from_millis(300));
        assert!(!waiter.is_finished(), "waits for the fill under way");
        cache.stop_waits();
        let err = waiter.join().unwrap().unwrap_err();
        assert!(err.to_string().contains("shutting down"), "{err}");
        release.send(()).unwrap();
        filler.join().unwrap().unwrap(); // the fill under way finishes
        assert!(cache.is_ready("k"));
    }

    #[test]
    fn a_caller_that_waited_on_a_failed_fill_fails_with_it_and_a_later_one_fills_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let filler = fill_under_way(&cache, "k", || {
            std::thread::sleep(Duration::from_millis(300));
            Err(Error::Unavailable("storage said no after its retries".into()))
        });
        let err = cache.get("k", 5, Want::NOW, &mut |_, _| panic!("a waiter downloaded again")).unwrap_err();
        assert_eq!(err.to_string(), "storage said no after its retries");
        assert!(filler.join().unwrap().is_err());
        // Asked after the failure: downloaded again (the store may be back).
        assert!(cache.get("k", 5, Want::NOW, &mut write(b"hello")).unwrap().unwrap().filled);

        // `since`: a caller that began asking before a failure (waiting behind another caller)
        // fails with it, an I/O error keeping its kind; one that began after fills again.
        let asked = Instant::now();
        let broken = || Error::io("read", "s3://b/j", std::io::ErrorKind::ConnectionReset.into());
        let first = cache.get("j", 5, Want::NOW, &mut |_, _| Err(broken())).unwrap_err();
        let joined = Want { since: Some(asked), ..Want::NOW };
        let again = cache.get("j", 5, joined, &mut |_, _| panic!("downloaded again")).unwrap_err();
        assert_eq!(again.to_string(), first.to_string());
        assert!(matches!(again, Error::Io { ref source, .. } if source.kind() == std::io::ErrorKind::ConnectionReset));
        assert!(cache.get("j", 5, Want::NOW, &mut write(b"jjjjj")).unwrap().unwrap().filled);
        // A copy made since the failure serves whoever asked before it.
        let copy = cache.get("j", 5, joined, &mut |_, _| panic!("downloaded again")).unwrap().unwrap();
        assert!(!copy.filled);
    }

    #[test]
    fn a_full_disk_fails_only_its_filler_not_a_caller_that_waited() {
        // A disk-full failure depends on what its filler may evict (a prefetch may evict less
        // than a stream): a caller that waited behind it tries with its own rights.
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        let asked = Instant::now();
        let full = || Error::io("write", "k", std::io::Error::from_raw_os_error(libc::ENOSPC));
        let err = cache.get("k", 5, Want::NOW, &mut |_, _| Err(full())).unwrap_err();
        assert!(matches!(err, Error::CacheFull(_)), "{err}");
        let joined = Want { since: Some(asked), ..Want::NOW };
        assert!(cache.get("k", 5, joined, &mut write(b"hello")).unwrap().unwrap().filled);
    }

    #[test]
    fn a_prefetch_does_not_wait() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(5), Policy::Lru).unwrap();
        let _a = cache.get("a", 5, Want::NOW, &mut write(b"aaaaa")).unwrap().unwrap();
        let later = Want { urgency: 1.0, wait: false, since: None, evict: true, ended: None };
        assert!(cache.get("b", 5, later, &mut write(b"bbbbb")).unwrap().is_none());
    }

    #[test]
    fn derived_entries_survive_a_clean_shutdown_only() {
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        assert!(cache.derived("derived-a").is_none(), "a miss never fills");
        let pin = cache.fill_derived("derived-a", 50, &mut write(b"decoded")).unwrap().unwrap();
        assert!(pin.filled);
        assert_eq!(cache.stats().used, 7, "accounted at what was written, not the bound");
        let s = cache.stats();
        assert_eq!((s.shards, s.derived, s.derived_bytes, s.filled_bytes), (0, 1, 7, 7));
        drop(pin);
        assert!(cache.derived("derived-a").is_some());
        drop(cache.get("shard", 5, Want::NOW, &mut write(b"shard")).unwrap().unwrap());
        let s = cache.stats();
        assert_eq!((s.hits, s.misses, s.shards, s.derived), (0, 1, 1, 1), "hits and misses are the shards'");
        // A crash (no close): the unsynced derived entry goes at the next start, the shard stays.
        drop(cache);
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        assert!(!dir.path().join("shards/derived-a").try_exists().unwrap());
        assert!(cache.derived("derived-a").is_none() && cache.is_ready("shard"));
        // A clean shutdown: kept, and the marker is consumed by the start that trusts it.
        drop(cache.fill_derived("derived-b", 50, &mut write(b"decoded")).unwrap().unwrap());
        cache.close().unwrap();
        assert!(dir.path().join(CLEAN_MARKER).try_exists().unwrap());
        let err = cache.fill_derived("derived-c", 50, &mut write(b"late")).unwrap_err().to_string();
        assert!(err.contains("closing"), "{err}");
        drop(cache);
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        assert!(!dir.path().join(CLEAN_MARKER).try_exists().unwrap());
        assert!(cache.derived("derived-b").is_some() && cache.is_ready("shard"));
        cache.remove_derived("derived-b");
        assert!(cache.derived("derived-b").is_none() && !dir.path().join("shards/derived-b").try_exists().unwrap());
        drop(cache.fill_derived("derived-b", 50, &mut write(b"decoded")).unwrap().unwrap());
        assert!(!dir.path().join("shards/derived-c").try_exists().unwrap());
        // ... and the start after that, without a close in between, does not.
        drop(cache);
        let cache = NodeCache::open(dir.path(), Some(100), Policy::Lru).unwrap();
        assert!(cache.derived("derived-b").is_none());
    }

    #[test]
    fn a_derived_entry_takes_only_space_nothing_needed_holds() {
        struct Needed;
        impl Eviction for Needed {
            fn next_use(&self, key: &str) -> Option<f64> {
                (key == "needed").then_some(1e9)
            }
            fn leased(&self, _: &str) -> bool {
                false
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let cache = NodeCache::open(dir.path(), Some(10), Policy::Belady).unwrap();
        cache.set_eviction(Arc::new(Needed));
        drop(cache.get("needed", 5, Want::NOW, &mut write(b"nnnnn")).unwrap().unwrap());
        drop(cache.get("done", 5, Want::NOW, &mut write(b"ddddd")).unwrap().unwrap());
        assert!(cache.fill_derived("derived-x", 6, &mut write(b"xxxxxx")).unwrap().is_none());
        drop(cache.fill_derived("derived-y", 5, &mut write(b"yyyyy")).unwrap().unwrap());
        assert!(cache.is_ready("needed") && !cache.is_ready("done"), "only the shard never needed again went");
    }

    #[test]
    fn keys_are_file_safe_and_depend_on_identity() {
        let k = key_for("s3://b/p/", b"len=3;etag=x", "dir/../a b.tar");
        assert!(k.ends_with("-dir_.._a_b.tar") && !k.contains('/'), "{k}");
        assert_ne!(k, key_for("s3://b/p/", b"len=3;etag=y", "dir/../a b.tar"));
    }
}
