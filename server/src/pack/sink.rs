//! Where completed shards go. The writer produces every shard as a complete local file and hands
//! it to a [`Sink`], which makes it durable at the destination; the pack publishes the manifest
//! through the sink last. Two sinks: [`LocalSink`], a local (or parallel file system) directory,
//! here; and [`super::s3_sink::S3Sink`], which uploads each shard as it completes while packing
//! goes on. A sink may make shards durable later than it is handed them (an upload in flight):
//! it reports how many have become durable, oldest first, and the pack journals only those.
//!
//! The local sink stages completed shards in `DEST/_shardstream/staging/` and moves them into
//! DEST only when every shard is durable, right before the manifest is written. So an interrupted
//! pack never leaves a directory of `*.tar` files that a reader could take for the dataset:
//! DEST holds either the previous complete dataset state or nothing of the new one, and
//! `manifest.json` appears last.
//!
//! ```text
//!  DEST/
//!    manifest.json                    written last, atomically
//!    classes.json                     --label-from-dir
//!    shard-000000.tar ...             moved in from staging/ at the end
//!    _shardstream/
//!      shard-000000.tar.idx ...       sidecars (member tables), written as shards complete
//!      footers.idx                    Parquet: every footer, read back after publishing
//!      pack-journal.jsonl             the resume journal
//!      staging/.shard-000007.tar.tmp.<pid>.<seq>  the shard being written
//!      staging/shard-000006.tar       durable, not yet published
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use super::journal::ShardRecord;
use super::writer::FinishedShard;
use crate::format::sidecar;
use crate::index::manifest::{MANIFEST_FILE, Manifest, SIDECAR_DIR};
use crate::{Error, Result};

/// Staging directory for completed shards, inside the sidecar directory.
pub const STAGING_DIR: &str = "staging";

/// A destination for shards, sidecars and the manifest.
pub trait Sink: Send + Sync {
    /// The destination, for messages.
    fn describe(&self) -> String;
    /// True when the sink reads each scratch file back right after it is written (an upload):
    /// shards are then written through the page cache, where that read finds them.
    fn rereads_scratch(&self) -> bool {
        false
    }
    /// Local path where the writer produces shard `name`.
    fn scratch_path(&self, name: &str) -> PathBuf;
    /// Starts making a completed shard (and its sidecar) durable. Called in shard order. Returns
    /// how many of the shards handed over so far became durable since the last call (oldest
    /// first; this one included or not).
    fn put_shard(&self, shard: FinishedShard) -> Result<usize>;
    /// Waits until every shard handed over is durable; returns how many became so in this call.
    fn flush(&self) -> Result<usize>;
    /// True when shard `rec` is already durable at the destination, with its sidecar if `sidecar`.
    fn has_shard(&self, rec: &ShardRecord, sidecar: bool) -> bool;
    /// Writes a small file (e.g. `classes.json`) atomically, relative to the destination.
    fn put_file(&self, rel: &str, bytes: &[u8]) -> Result<()>;
    /// Copies the resume journal at `journal` to the destination, where a `--resume` on another
    /// machine finds it (S3). A local destination holds the journal itself: nothing to do.
    fn share_journal(&self, _journal: &Path) -> Result<()> {
        Ok(())
    }
    /// Publishes the shards `names` (all of them, in order) and removes shards named like ours
    /// (`<prefix>-NNNNNN.<ext>`) that are not among them, left from an earlier run.
    fn publish(&self, names: &[String], prefix: &str, ext: &str) -> Result<()>;
    /// Writes the manifest: the dataset is complete once this returns.
    fn put_manifest(&self, manifest: &Manifest) -> Result<()>;
    /// Withdraws the manifest (before the dataset is rewritten).
    fn remove_manifest(&self) -> Result<()>;
    /// Reads `buf.len()` bytes at `offset` of published shard `name` (of `len` bytes).
    fn read_published(&self, name: &str, len: u64, offset: u64, buf: &mut [u8]) -> Result<()>;
}

/// A local or parallel-file-system directory.
pub struct LocalSink {
    dest: PathBuf,
    sidecars: PathBuf,
    staging: PathBuf,
}

fn sync_dir(dir: &Path) -> Result<()> {
    crate::atomic_write::sync_dir(dir).map_err(|e| Error::io("cannot sync directory", dir, e))
}

pub(super) fn is_ours(name: &str, prefix: &str, ext: &str) -> bool {
    name.strip_prefix(prefix)
        .and_then(|r| r.strip_prefix('-'))
        .and_then(|r| r.strip_suffix(ext))
        .and_then(|r| r.strip_suffix('.'))
        .is_some_and(|n| n.len() >= 6 && n.bytes().all(|b| b.is_ascii_digit()))
}

impl LocalSink {
    /// Opens `dest` (created if needed) and clears leftovers of an interrupted writer: temporary
    /// shards in staging, and half-written sidecars or manifest (a kill between a sidecar's
    /// create and its rename leaves one), so a resumed pack ends byte-identical to a clean one.
    pub fn open(dest: &Path) -> Result<Self> {
        let sidecars = dest.join(SIDECAR_DIR);
        let staging = sidecars.join(STAGING_DIR);
        std::fs::create_dir_all(&staging).map_err(|e| Error::io("cannot create", &staging, e))?;
        let sink = Self { dest: dest.to_owned(), sidecars, staging };
        for dir in [&sink.staging, &sink.sidecars, &sink.dest] {
            for entry in std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))? {
                let entry = entry.map_err(|e| Error::io("cannot list", dir, e))?;
                if entry.file_name().to_str().is_some_and(crate::storage::local::is_temp_name) {
                    let p = entry.path();
                    std::fs::remove_file(&p).map_err(|e| Error::io("cannot remove", &p, e))?;
                }
            }
        }
        Ok(sink)
    }

    fn sidecar_path(&self, name: &str) -> PathBuf {
        self.sidecars.join(format!("{name}.idx"))
    }
}

impl Sink for LocalSink {
    fn describe(&self) -> String {
        self.dest.display().to_string()
    }

    fn scratch_path(&self, name: &str) -> PathBuf {
        crate::atomic_write::temp_path(&self.staging.join(name))
    }

    fn put_shard(&self, shard: FinishedShard) -> Result<usize> {
        let staged = self.staging.join(&shard.name);
        crate::atomic_write::publish(&shard.file, &shard.scratch, &staged)
            .map_err(|e| Error::io("cannot stage shard", &shard.scratch, e))?;
        if let Some(ix) = &shard.tar_index {
            let path = self.sidecar_path(&shard.name);
            sidecar::write_atomic(&path, shard.identity().as_bytes(), ix)
                .map_err(|e| Error::io("cannot write sidecar", &path, e))?;
        }
        Ok(1)
    }

    fn flush(&self) -> Result<usize> {
        Ok(0)
    }

    fn has_shard(&self, rec: &ShardRecord, sidecar: bool) -> bool {
        let present = [self.dest.join(&rec.name), self.staging.join(&rec.name)]
            .iter()
            .any(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() == rec.bytes));
        present && (!sidecar || self.sidecar_path(&rec.name).is_file())
    }

    fn put_file(&self, rel: &str, bytes: &[u8]) -> Result<()> {
        crate::storage::local::write_atomic(&self.dest.join(rel), bytes)
    }

    fn publish(&self, names: &[String], prefix: &str, ext: &str) -> Result<()> {
        for name in names {
            let staged = self.staging.join(name);
            if staged.try_exists().map_err(|e| Error::io("cannot inspect staged shard", &staged, e))? {
                let target = self.dest.join(name);
                std::fs::rename(&staged, &target).map_err(|e| Error::io("cannot publish shard", &staged, e))?;
            } else if !self.dest.join(name).is_file() {
                return Err(Error::NotFound { what: "completed shard", path: staged.display().to_string() });
            }
        }
        let keep: HashSet<&str> = names.iter().map(String::as_str).collect();
        let idx_ext = format!("{ext}.idx");
        for (dir, ext) in [(&self.dest, ext), (&self.staging, ext), (&self.sidecars, idx_ext.as_str())] {
            for entry in std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))? {
                let entry = entry.map_err(|e| Error::io("cannot list", dir, e))?;
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else { continue };
                let shard = name.strip_suffix(".idx").unwrap_or(&name);
                if is_ours(&name, prefix, ext) && !keep.contains(shard) {
                    let p = entry.path();
                    std::fs::remove_file(&p).map_err(|e| Error::io("cannot remove stale shard", &p, e))?;
                }
            }
        }
        sync_dir(&self.dest)?;
        // The staging directory is empty now; a reader of DEST sees no trace of it.
        let _ = std::fs::remove_dir(&self.staging);
        Ok(())
    }

    fn put_manifest(&self, manifest: &Manifest) -> Result<()> {
        manifest.write_atomic(&self.dest)
    }

    fn remove_manifest(&self) -> Result<()> {
        let path = self.dest.join(MANIFEST_FILE);
        match std::fs::remove_file(&path) {
            Ok(()) => sync_dir(&self.dest),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("cannot remove old manifest", &path, e)),
        }
    }

    fn read_published(&self, name: &str, len: u64, offset: u64, buf: &mut [u8]) -> Result<()> {
        crate::storage::local::ShardFile::open(self.dest.join(name), len)?.read_exact_at(buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_its_own_shard_names() {
        assert!(is_ours("shard-000000.tar", "shard", "tar"));
        assert!(is_ours("shard-1234567.tar", "shard", "tar"));
        assert!(is_ours("shard-000001.tar.idx", "shard", "tar.idx"));
        assert!(!is_ours("shard-00001.tar", "shard", "tar"));
        assert!(!is_ours("shard-000001.parquet", "shard", "tar"));
        assert!(!is_ours("train-000001.tar", "shard", "tar"));
        assert!(!is_ours("shard-00000a.tar", "shard", "tar"));
    }
}
