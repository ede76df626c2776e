//! The daemon's sidecar cache (`<cache-dir>/index`), bounded in bytes.
//!
//! A shard read without a manifest gets its member table saved there (and an S3 Parquet file
//! without page checksums its probe answer), so that the next open of its dataset, in this daemon
//! or the next, does not scan it again. One file per shard location ever opened, and nothing
//! else ever removed them: on a node that serves dataset after dataset they grew without bound,
//! outside `--cache-size` and `status`. Each is cheap to make again (one scan, one probe), so the
//! oldest go first once the directory outgrows its bound: at start-up, then every hour.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The directory's name in the cache directory.
pub const DIR: &str = "index";

/// The bound: this share of the node cache's capacity, and at least [`MIN_BOUND`].
const CAPACITY_SHARE: u64 = 32;
const MIN_BOUND: u64 = 1 << 30;

/// How often a running daemon trims it, and how often its thread looks whether the daemon is
/// gone.
const EVERY: Duration = Duration::from_secs(3600);
const LOOK: Duration = Duration::from_secs(5);

/// The directory's bound for a node cache of `capacity` bytes.
pub fn bound(capacity: u64) -> u64 {
    (capacity / CAPACITY_SHARE).max(MIN_BOUND)
}

/// Trims `dir` on a thread of its own, now and every [`EVERY`], for as long as `cache` (the
/// daemon's node cache) lives: the thread ends within [`LOOK`] of the daemon.
pub fn trim_in_background(dir: PathBuf, bound: u64, cache: std::sync::Weak<crate::cache::NodeCache>) {
    let started = std::thread::Builder::new().name("sidecar-trim".into()).spawn(move || {
        while cache.strong_count() > 0 {
            trim(&dir, bound);
            let next = std::time::Instant::now() + EVERY;
            while cache.strong_count() > 0 && std::time::Instant::now() < next {
                std::thread::sleep(LOOK);
            }
        }
    });
    if let Err(e) = started {
        tracing::warn!(error = %e, "cannot start the sidecar cache's trimming thread; it is not bounded");
    }
}

/// What [`trim`] did: leftovers of interrupted writes removed, and files removed to fit.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Trimmed {
    pub leftovers: usize,
    pub files: usize,
    pub bytes: u64,
}

/// Deletes interrupted writes' leftovers in `dir`, then, when its files hold more than `bound`
/// bytes, the least recently written until they hold at most 90% of it (so that the next trims
/// find room for a while). A file that cannot be listed or removed is left, with a warning.
pub fn trim(dir: &Path, bound: u64) -> Trimmed {
    let mut done = Trimmed::default();
    let Ok(entries) = std::fs::read_dir(dir) else { return done };
    let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        let temporary = entry.file_name().to_str().is_some_and(crate::storage::local::is_temp_name);
        // A write in progress right now is younger than a minute: only older ones are leftovers.
        let stale =
            meta.modified().ok().and_then(|m| m.elapsed().ok()).is_some_and(|age| age > Duration::from_secs(60));
        if temporary {
            if stale && remove(&path) {
                done.leftovers += 1;
            }
            continue;
        }
        files.push((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), meta.len(), path));
    }
    let mut held: u64 = files.iter().map(|(_, len, _)| len).sum();
    if held <= bound {
        return done;
    }
    files.sort();
    let target = bound / 10 * 9;
    for (_, len, path) in files {
        if held <= target {
            break;
        }
        if remove(&path) {
            held -= len;
            done.files += 1;
            done.bytes += len;
        }
    }
    tracing::info!(
        dir = %dir.display(), removed = done.files, removed_bytes = done.bytes, left_bytes = held, bound,
        "sidecar cache trimmed (the oldest are scanned again when next needed)"
    );
    done
}

fn remove(path: &Path) -> bool {
    match std::fs::remove_file(path) {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot trim the sidecar cache");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aged(path: &Path, bytes: usize, seconds_ago: u64) {
        std::fs::write(path, vec![7u8; bytes]).unwrap();
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(seconds_ago)).unwrap();
    }

    #[test]
    fn the_oldest_go_until_nine_tenths_of_the_bound_and_only_old_leftovers() {
        let dir = tempfile::tempdir().unwrap();
        for (i, age) in [500, 400, 300, 200, 100].iter().enumerate() {
            aged(&dir.path().join(format!("{i}.idx")), 100, *age);
        }
        aged(&dir.path().join(".x.idx.tmp.1.0"), 100, 120);
        aged(&dir.path().join(".y.idx.tmp.1.0"), 100, 0); // a write in progress
        assert_eq!(trim(dir.path(), 1000), Trimmed { leftovers: 1, files: 0, bytes: 0 }, "within the bound");
        assert_eq!(trim(dir.path(), 400), Trimmed { leftovers: 0, files: 2, bytes: 200 });
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        assert_eq!(left, [".y.idx.tmp.1.0", "2.idx", "3.idx", "4.idx"]);
        assert_eq!(trim(&dir.path().join("absent"), 1), Trimmed::default());
        assert_eq!(bound(1 << 40), 1 << 35);
        assert_eq!(bound(1 << 20), MIN_BOUND);
    }
}
