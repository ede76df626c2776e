//! The one way files are made visible whole: write a temporary file beside the target, fsync it,
//! rename it over the target, fsync the directory.
//!
//! Readers (a daemon, a trainer, `tar`) see the old file or the complete new one, never a prefix;
//! after the final directory fsync the new file survives a power loss. A crash before the rename
//! leaves only a temporary file, whose name [`is_temp_name`] recognises so that the next writer
//! into the directory (cache start-up, pack sink, ...) deletes it.
//!
//! Temporary names have a single scheme, `.<name>.tmp.<pid>.<seq>`: hidden (WebDataset tools and
//! shard listings skip dot files), beside the target (same file system, so the rename is atomic),
//! and unique per writer (process id and a per-process sequence), so concurrent writers of one
//! target never share a temporary file; the last rename wins.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

static SEQ: AtomicU64 = AtomicU64::new(0);

/// The temporary path for a new version of `target`: `.<name>.tmp.<pid>.<seq>` beside it.
pub fn temp_path(target: &Path) -> PathBuf {
    let name = target.file_name().map_or_else(|| "file".into(), |n| n.to_string_lossy());
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    target.with_file_name(format!(".{name}.tmp.{}.{seq}", std::process::id()))
}

/// True for a name [`temp_path`] makes: what a crashed writer leaves behind, safe to delete
/// before writing into the same directory. Also true for the `.<name>.tmp` and
/// `.<name>.tmp.<pid>` names releases before this scheme left, so their leftovers go too.
pub fn is_temp_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix('.') else { return false };
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let mut parts = rest.rsplitn(3, '.');
    match (parts.next(), parts.next(), parts.next()) {
        // .<name>.tmp.<pid>.<seq>
        (Some(seq), Some(pid), Some(head)) if digits(seq) && digits(pid) && head.ends_with(".tmp") => {
            head.len() > ".tmp".len()
        }
        _ => {
            // Legacy: .<name>.tmp.<pid> or .<name>.tmp
            let legacy = match rest.rsplit_once('.') {
                Some((head, pid)) if digits(pid) => head,
                _ => rest,
            };
            legacy.strip_suffix(".tmp").is_some_and(|n| !n.is_empty())
        }
    }
}

/// A new version of a file being written under a temporary name; [`commit`](Self::commit)
/// makes it visible. Dropped without a commit, the temporary file is removed.
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    temp: PathBuf,
    file: File,
    committed: bool,
}

impl AtomicFile {
    /// Creates the temporary file (readable and writable, never an existing file).
    pub fn create(target: &Path) -> std::io::Result<Self> {
        let temp = temp_path(target);
        let file = File::options().read(true).write(true).create_new(true).open(&temp)?;
        Ok(Self { target: target.to_owned(), temp, file, committed: false })
    }

    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn temp_path(&self) -> &Path {
        &self.temp
    }

    /// fsync, rename over the target, fsync of the directory. On error the temporary file is
    /// removed and the target is as it was (or, when only the directory fsync failed, already
    /// replaced but perhaps not durable).
    pub fn commit(mut self) -> std::io::Result<()> {
        let result = publish(&self.file, &self.temp, &self.target);
        // Renamed (or to be removed by Drop on error).
        self.committed = result.is_ok();
        result
    }

    /// Renames over the target without any fsync: visible whole to this boot's readers, but after
    /// a power loss the file may hold anything. Only for data its owner can tell apart and throw
    /// away after a crash (the node cache's derived entries, see `cache`).
    pub fn commit_unsynced(mut self) -> std::io::Result<()> {
        let result = std::fs::rename(&self.temp, &self.target);
        self.committed = result.is_ok();
        result
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            // Best effort: the error being reported is the write's, not the cleanup's.
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Makes `file`, written at `temp`, visible as `target` in the same directory: fsync, rename,
/// fsync of the directory. For writers that create their temporary file themselves (a pack
/// shard, written at a [`temp_path`] by the shard writer).
pub fn publish(file: &File, temp: &Path, target: &Path) -> std::io::Result<()> {
    file.sync_all()?;
    std::fs::rename(temp, target)?;
    sync_dir(target.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))
}

/// fsyncs a directory, making renames and removals in it durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes `bytes` as the new content of `path`, atomically and durably.
pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.file.write_all(bytes)?;
    f.commit()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn writes_replace_whole_files_and_leave_no_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        write(&p, b"one").unwrap();
        write(&p, b"two, longer").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two, longer");
        assert_eq!(names(dir.path()), ["a.json"]);
        assert!(write(&dir.path().join("missing/a.json"), b"x").is_err());
        // A directory as the target: the rename fails, the temporary file goes.
        std::fs::create_dir(dir.path().join("d")).unwrap();
        std::fs::write(dir.path().join("d/x"), b"x").unwrap();
        assert!(write(&dir.path().join("d"), b"x").is_err());
        assert_eq!(names(dir.path()), ["a.json", "d"]);
    }

    #[test]
    fn a_crash_before_the_rename_leaves_no_visible_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("shard.idx");
        let mut f = AtomicFile::create(&p).unwrap();
        f.file.write_all(b"half").unwrap();
        let temp = f.temp_path().to_owned();
        // A crash: no commit, and no destructor runs either.
        std::mem::forget(f);
        assert!(std::fs::metadata(&p).is_err(), "the target must not appear");
        let left = names(dir.path());
        assert_eq!(left.len(), 1);
        assert!(is_temp_name(&left[0]), "{left:?} must be recognised as a leftover");
        assert_eq!(dir.path().join(&left[0]), temp);
        // An abandoned write (an error before commit) cleans up after itself.
        let g = AtomicFile::create(&dir.path().join("other")).unwrap();
        drop(g);
        assert_eq!(names(dir.path()), left);
    }

    #[test]
    fn one_temporary_name_scheme() {
        let t = temp_path(Path::new("/x/train-000001.tar.idx"));
        let name = t.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with(".train-000001.tar.idx.tmp."), "{name}");
        assert_eq!(t.parent(), Some(Path::new("/x")));
        assert!(is_temp_name(name));
        assert_ne!(temp_path(Path::new("/x/a")), temp_path(Path::new("/x/a")));
        for legacy in [".a.tmp", ".manifest.json.tmp.123", ".k.tar.tmp.1.0"] {
            assert!(is_temp_name(legacy), "{legacy}");
        }
        for other in
            ["a.tmp", ".tmp", ".tmp.1.2", ".hidden", ".a.tmpx.1.2", ".a.tmp.x.1", "manifest.json", ".a.tmp.1.2.3"]
        {
            assert!(!is_temp_name(other), "{other}");
        }
    }
}
