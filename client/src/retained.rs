//! Shard mappings a process keeps across its streams, so that the next epoch maps nothing anew.
//!
//! Every stream used to map each shard it received and fill the mapping's page tables (one fault
//! per 64 KiB, [`crate::shm`]'s `prefault`), then unmap it at the end: an epoch of 0.89 GB of
//! small-sample shards paid ~0.03 CPU-s for it, in every epoch of a training process
//! (bench/PROFILES.md, section 4). A mapping kept here is found again by the file's identity
//! (device, inode, size, modification and change times) when the daemon sends the same shard to
//! a later stream of this process, and is used as it is, page tables filled.
//!
//! Only shards that are mapped anyway are kept: node-cache copies, which never change once
//! published, and shards read in place when the trainer vouched that they do not change
//! (`SHARDSTREAM_MAP_IN_PLACE=1`). While a mapping is held its inode cannot be freed, so its
//! number cannot name another file: the identity is sound for as long as it is kept.
//!
//! What keeping costs: page tables (~2 MiB per GiB mapped), and the disk space of a node-cache
//! copy the daemon evicted meanwhile (an unlinked file stays allocated while mapped). The table
//! is bounded by `SHARDSTREAM_KEEP_MAPPED_BYTES` (default [`DEFAULT_LIMIT`], 0 turns keeping off;
//! the least recently used mapping goes first). A copy the daemon evicts while a stream runs is
//! let go at once (SHARD_FORGET, [`forget`]); every new stream first lets go of mappings whose
//! path no longer names their file (copies evicted between two streams).
//!
//! Per process: a forked child (a DataLoader worker) starts with an empty table of its own and
//! never takes the parent's lock, which a parent thread may have held at the moment of fork. The
//! parent's kept mappings stay in the child's address space, unused, until it exits (as every
//! mapping of the parent's did before; their page tables are not copied for shared file
//! mappings). DataLoader workers that persist across epochs (`persistent_workers=True`) keep
//! their own mappings from one epoch to the next like a process with 0 workers.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use crate::shm::Mapping;

/// Bytes of shard mappings kept when `SHARDSTREAM_KEEP_MAPPED_BYTES` is not set. A kept mapping
/// costs little memory (its page tables, ~2 MiB per GiB) but counts its page-cache pages in the
/// process's RSS, and so in its OOM score: 2 GiB keeps a small dataset's shards, or a process's
/// share of one, whole, without making every trainer look that much larger between epochs.
pub const DEFAULT_LIMIT: u64 = 2 << 30;

/// The environment variable bounding the table.
pub const LIMIT_VAR: &str = "SHARDSTREAM_KEEP_MAPPED_BYTES";

/// Most mappings kept, whatever their bytes: each is a VMA (a process may have 65,530 by
/// default, `vm.max_map_count`), and each new stream checks every kept one ([`Table::prune`]).
/// Datasets of many small shards keep their most recently used ones.
pub const MAX_KEPT: usize = 4096;

/// What makes two descriptors the same unchanged file. Times to the nanosecond: a shard rewritten
/// in place (same inode, same size) changes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl FileId {
    pub fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }
}

struct Kept {
    map: Arc<Mapping>,
    /// Stamp of its last use: its key in [`Table::order`].
    used: u64,
}

/// The mappings kept, and their order of last use.
pub struct Table {
    limit: u64,
    kept: HashMap<FileId, Kept>,
    order: BTreeMap<u64, FileId>,
    bytes: u64,
    clock: u64,
}

impl Table {
    pub fn new(limit: u64) -> Self {
        Self { limit, kept: HashMap::new(), order: BTreeMap::new(), bytes: 0, clock: 0 }
    }

    /// The kept mapping of `id`, marked as just used.
    pub fn get(&mut self, id: &FileId) -> Option<Arc<Mapping>> {
        self.clock += 1;
        let kept = self.kept.get_mut(id)?;
        self.order.remove(&kept.used);
        kept.used = self.clock;
        self.order.insert(self.clock, *id);
        Some(kept.map.clone())
    }

    /// Keeps `map` (of `len` bytes), letting go of the least recently used mappings beyond the
    /// limit or [`MAX_KEPT`]. A mapping larger than the limit is not kept.
    pub fn keep(&mut self, id: FileId, map: Arc<Mapping>) {
        if id.len > self.limit || self.kept.contains_key(&id) {
            return;
        }
        while self.bytes + id.len > self.limit || self.kept.len() >= MAX_KEPT {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            self.drop_entry(&oldest);
        }
        self.clock += 1;
        self.order.insert(self.clock, id);
        self.kept.insert(id, Kept { map, used: self.clock });
        self.bytes += id.len;
    }

    /// Lets go of every mapping whose path no longer names its file: a node-cache copy the daemon
    /// evicted (unlinked; its disk space is freed once unmapped), or a shard replaced since.
    pub fn prune(&mut self) {
        let gone: Vec<FileId> = self
            .kept
            .iter()
            .filter(|(id, k)| std::fs::metadata(&k.map.name).map_or(true, |m| (m.dev(), m.ino()) != (id.dev, id.ino)))
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            if let Some(used) = self.kept.get(&id).map(|k| k.used) {
                self.order.remove(&used);
            }
            self.drop_entry(&id);
        }
    }

    /// Lets go of `map` (found by identity of the mapping, not of the file).
    pub fn forget(&mut self, map: &Arc<Mapping>) {
        let found = self.kept.iter().find(|(_, k)| Arc::ptr_eq(&k.map, map)).map(|(id, k)| (*id, k.used));
        if let Some((id, used)) = found {
            self.order.remove(&used);
            self.drop_entry(&id);
        }
    }

    fn drop_entry(&mut self, id: &FileId) {
        if self.kept.remove(id).is_some() {
            self.bytes -= id.len;
        }
    }

    #[cfg(test)]
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

/// The limit from the environment, read once per process.
fn limit() -> Result<u64, String> {
    static LIMIT: OnceLock<Result<u64, String>> = OnceLock::new();
    LIMIT
        .get_or_init(|| match std::env::var(LIMIT_VAR) {
            Err(std::env::VarError::NotPresent) => Ok(DEFAULT_LIMIT),
            Ok(v) => shardstream_proto::size::parse_size(&v).map_err(|e| format!("{LIMIT_VAR}: {e}")),
            Err(e) => Err(format!("{LIMIT_VAR}: {e}")),
        })
        .clone()
}

/// This process's table and the pid that made it. Read without a lock (see the module docs).
static TABLE: AtomicPtr<(u32, Mutex<Table>)> = AtomicPtr::new(std::ptr::null_mut());

/// This process's table: made on first use, and anew in a forked child. Tables are leaked: one
/// per process, and a child must never drop (unmap) what its parent's table holds.
fn table() -> Result<&'static Mutex<Table>, String> {
    let pid = std::process::id();
    loop {
        let current = TABLE.load(Ordering::Acquire);
        // SAFETY: a non-null pointer came from `Box::leak` below and is never freed.
        if let Some((owner, table)) = unsafe { current.as_ref() }
            && *owner == pid
        {
            return Ok(table);
        }
        let made: &'static mut (u32, Mutex<Table>) = Box::leak(Box::new((pid, Mutex::new(Table::new(limit()?)))));
        let made_ptr: *mut (u32, Mutex<Table>) = made;
        if TABLE.compare_exchange(current, made_ptr, Ordering::AcqRel, Ordering::Acquire).is_err() {
            // Another thread of this process made one first: use that (this one stays empty).
            continue;
        }
        return Ok(&made.1);
    }
}

/// The mapping of the shard behind `file` (`meta` its metadata): the one kept from an earlier
/// stream of this process if the file is the same and unchanged, else `map(file)`, kept for the
/// next streams within the limit.
pub fn mapping(
    file: &std::fs::File,
    meta: &std::fs::Metadata,
    map: impl FnOnce(&std::fs::File) -> Result<Mapping, String>,
) -> Result<Arc<Mapping>, String> {
    let table = table()?;
    let id = FileId::of(meta);
    if let Some(found) = table.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
        return Ok(found);
    }
    // Mapped and prefaulted outside the lock: another stream's receiver may adopt meanwhile.
    let mapped = Arc::new(map(file)?);
    // Kept only while its path names it: that is how [`Table::prune`] tells, later, that the
    // file is gone (an unlinked file's name is no path).
    if std::fs::metadata(&mapped.name).is_ok_and(|m| (m.dev(), m.ino()) == (meta.dev(), meta.ino())) {
        table.lock().unwrap_or_else(|p| p.into_inner()).keep(id, mapped.clone());
    }
    Ok(mapped)
}

/// Lets go of `map` if it is kept: the daemon evicted its file (SHARD_FORGET).
pub fn forget(map: &Arc<Mapping>) {
    if let Ok(table) = table() {
        table.lock().unwrap_or_else(|p| p.into_inner()).forget(map);
    }
}

/// Lets go of kept mappings whose files are gone (called as a stream attaches). A bad limit in
/// the environment is reported by [`mapping`], where it can fail the stream.
pub fn prune() {
    if let Ok(table) = table() {
        table.lock().unwrap_or_else(|p| p.into_inner()).prune();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ino: u64, len: u64) -> FileId {
        FileId { dev: 1, ino, len, mtime: (0, 0), ctime: (0, 0) }
    }

    fn mapping_named(name: &str) -> Arc<Mapping> {
        Arc::new(Mapping::unmapped(name.into()))
    }

    #[test]
    fn least_recently_used_mappings_go_first_beyond_the_limit() {
        let mut t = Table::new(100);
        t.keep(id(1, 40), mapping_named("/a"));
        t.keep(id(2, 40), mapping_named("/b"));
        assert!(t.get(&id(1, 40)).is_some()); // 1 is now the most recent
        t.keep(id(3, 40), mapping_named("/c"));
        assert!(t.get(&id(2, 40)).is_none(), "the least recently used one is let go");
        assert!(t.get(&id(1, 40)).is_some() && t.get(&id(3, 40)).is_some());
        assert_eq!((t.len(), t.bytes()), (2, 80));
        t.keep(id(4, 101), mapping_named("/d"));
        assert!(t.get(&id(4, 101)).is_none(), "larger than the limit: not kept");
        assert_eq!(t.bytes(), 80);
        let mut many = Table::new(u64::MAX);
        for ino in 0..MAX_KEPT as u64 + 10 {
            many.keep(id(ino, 1), mapping_named("/f"));
        }
        assert_eq!(many.len(), MAX_KEPT);
        assert!(many.get(&id(9, 1)).is_none() && many.get(&id(10, 1)).is_some(), "the oldest went first");
        let mut off = Table::new(0);
        off.keep(id(5, 1), mapping_named("/e"));
        assert!(off.is_empty());
    }

    #[test]
    fn a_forgotten_mapping_is_let_go() {
        let mut t = Table::new(100);
        let (a, b) = (mapping_named("/a"), mapping_named("/b"));
        t.keep(id(1, 10), a.clone());
        t.keep(id(2, 10), b.clone());
        t.forget(&a);
        assert!(t.get(&id(1, 10)).is_none() && t.get(&id(2, 10)).is_some());
        assert_eq!((t.len(), t.bytes()), (1, 10));
        t.forget(&a); // not kept: nothing happens
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_changed_file_is_another_file() {
        let mut t = Table::new(100);
        t.keep(id(1, 10), mapping_named("/a"));
        assert!(t.get(&id(1, 11)).is_none(), "another size");
        let touched = FileId { mtime: (0, 1), ..id(1, 10) };
        assert!(t.get(&touched).is_none(), "another modification time");
    }

    #[test]
    fn pruning_lets_go_of_files_that_are_gone_or_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let [kept, gone, replaced] = ["kept", "gone", "replaced"].map(|n| dir.path().join(n));
        for p in [&kept, &gone, &replaced] {
            std::fs::write(p, b"shard").unwrap();
        }
        let ids = [&kept, &gone, &replaced].map(|p| FileId::of(&std::fs::metadata(p).unwrap()));
        let mut t = Table::new(1 << 20);
        for (p, i) in [&kept, &gone, &replaced].into_iter().zip(ids) {
            t.keep(i, mapping_named(p.to_str().unwrap()));
        }
        std::fs::remove_file(&gone).unwrap();
        let held = std::fs::File::open(&replaced).unwrap(); // keeps the old inode from being reused
        std::fs::remove_file(&replaced).unwrap();
        std::fs::write(&replaced, b"other").unwrap();
        t.prune();
        assert!(t.get(&ids[0]).is_some());
        assert!(t.get(&ids[1]).is_none() && t.get(&ids[2]).is_none());
        assert_eq!((t.len(), t.bytes()), (1, 5));
        drop(held);
    }
}
