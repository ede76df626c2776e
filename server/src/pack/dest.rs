//! Where a pack writes: `--output` parsed into a local directory or an S3 prefix, locked for the
//! duration of the pack, its resume journal found, the question "whose dataset does DEST already
//! hold?" answered, and the [`Sink`] that writes into it opened. Everything that differs between
//! the two kinds of destination before the first shard is written lives here, so `pack` itself
//! reads the same for both.
//!
//! S3 output keeps its local state in a private directory (mode 0700) named after the destination:
//!
//! ```text
//!  $XDG_CACHE_HOME/shardstream/pack/    (default ~/.cache/shardstream/pack/; without HOME,
//!    <bucket>-<hash of s3://bucket/prefix/>/      $TMPDIR/shardstream-<uid>/pack/)
//!      pack-journal.jsonl             the resume journal, as `--resume` finds it again
//!      scratch/.shard-000007.tar.tmp  shards written, waiting for or during their upload
//! ```
//!
//! The journal is also uploaded next to the shards (`_shardstream/pack-journal.jsonl`, as a local
//! pack leaves it in DEST): before the first new shard, then at most every 10 s as shards become
//! durable, and at the end. So a pack from another machine, or after the state directory was
//! cleaned, still knows whose dataset the prefix holds and can resume it (packing again what the
//! bucket's copy did not list yet). When both exist and disagree, the bucket's wins: it describes
//! what is actually there.

use std::fs::File;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use super::journal::{self, JOURNAL_FILE, PriorJournal};
use super::s3_sink::{S3Sink, SCRATCH_DIR};
use super::sink::{LocalSink, Sink};
use crate::index::manifest::{MANIFEST_FILE, SIDECAR_DIR};
use crate::storage::s3::S3Store;
use crate::storage::s3_write::UploadOptions;
use crate::{Error, Result};

/// A parsed `--output`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    Local(PathBuf),
    /// `prefix` is empty or ends with `/`.
    S3 {
        bucket: String,
        prefix: String,
    },
}

/// Parses `--output`: a directory, a `file://` URL, or `s3://bucket/prefix/`.
pub fn parse_dest(dest: &str) -> Result<Dest> {
    let dest = dest.trim();
    if dest.starts_with("s3://") {
        return match crate::storage::DatasetUrl::parse(dest)? {
            crate::storage::DatasetUrl::S3 { bucket, prefix, pick: crate::storage::Pick::All } => {
                Ok(Dest::S3 { bucket, prefix })
            }
            _ => Err(Error::invalid(format!("{dest}: an S3 output is a prefix (s3://bucket/prefix/), not a pattern"))),
        };
    }
    let path = match dest.strip_prefix("file://") {
        Some(p) if p.starts_with('/') => p,
        Some(p) => return Err(Error::invalid(format!("file URL must be absolute: file://{p}"))),
        None if dest.contains("://") => return Err(Error::invalid(format!("unsupported output URL: {dest}"))),
        None => dest,
    };
    if path.is_empty() {
        return Err(Error::invalid("--output is empty"));
    }
    Ok(Dest::Local(PathBuf::from(path)))
}

/// An opened, locked destination.
pub struct Destination {
    kind: Kind,
    journal: PathBuf,
    /// Held for the whole pack; the lock goes with the process.
    _lock: File,
}

enum Kind {
    /// `made`: this pack created the directory.
    Local {
        dir: PathBuf,
        made: bool,
    },
    // Boxed: the store is ten times the local variant.
    S3 {
        store: Box<S3Store>,
        bucket: String,
        prefix: String,
        state: PathBuf,
    },
}

impl Destination {
    /// Opens `dest` for a pack of `src` (canonical). `s3`: the connection for `s3://` output.
    pub fn open(dest: &str, src: &Path, s3: Option<&S3Store>) -> Result<Self> {
        match parse_dest(dest)? {
            Dest::Local(dir) => {
                // Only a directory known to be absent counts as made here (then removed if the
                // pack is refused before writing); any doubt leaves it alone.
                let made =
                    matches!(std::fs::symlink_metadata(&dir), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
                std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create output directory", &dir, e))?;
                let dir =
                    std::fs::canonicalize(&dir).map_err(|e| Error::io("cannot open output directory", &dir, e))?;
                if dir == src {
                    return Err(Error::invalid(format!(
                        "output {} is the source directory; pack into another directory (a subdirectory is fine)",
                        dir.display()
                    )));
                }
                if dir.starts_with(src) {
                    refuse_inputs_in_output(&dir, src)?;
                }
                let lock = lock_dir(&dir, &dir.display().to_string())?;
                Ok(Self { journal: journal::journal_path(&dir), kind: Kind::Local { dir, made }, _lock: lock })
            }
            Dest::S3 { bucket, prefix } => {
                let store = s3.ok_or_else(|| {
                    Error::invalid(format!("{dest}: S3 output needs an S3 connection (pack_with and an S3Store)"))
                })?;
                let url = format!("s3://{bucket}/{prefix}");
                let state =
                    state_root().join("pack").join(format!("{bucket}-{:016x}", journal::stable_hash(url.as_bytes())));
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&state)
                    .map_err(|e| Error::io("cannot create pack state directory", &state, e))?;
                let lock = lock_dir(&state, &url)?;
                Ok(Self {
                    journal: state.join(JOURNAL_FILE),
                    kind: Kind::S3 { store: Box::new(store.clone()), bucket, prefix, state },
                    _lock: lock,
                })
            }
        }
    }

    /// Removes the output directory if this pack made it and it is still empty: a pack refused
    /// before it wrote anything (nothing to pack, a bad list of inputs) leaves none behind.
    pub fn remove_if_made_and_empty(&self) {
        if let Kind::Local { dir, made: true } = &self.kind
            // remove_dir refuses a directory that is not empty: whatever is in it stays.
            && let Err(e) = std::fs::remove_dir(dir)
        {
            tracing::debug!(dir = %dir.display(), error = %e, "output directory left in place");
        }
    }

    /// True when the lock this pack holds keeps every other pack out of the destination (a
    /// local directory); an S3 prefix's lock is one machine's.
    pub fn locked_everywhere(&self) -> bool {
        matches!(self.kind, Kind::Local { .. })
    }

    /// The destination as a user names it: a path or an `s3://` URL.
    pub fn location(&self) -> String {
        match &self.kind {
            Kind::Local { dir, .. } => dir.display().to_string(),
            Kind::S3 { bucket, prefix, .. } => format!("s3://{bucket}/{prefix}"),
        }
    }

    pub fn manifest_location(&self) -> String {
        match &self.kind {
            Kind::Local { dir, .. } => dir.join(MANIFEST_FILE).display().to_string(),
            Kind::S3 { bucket, prefix, .. } => format!("s3://{bucket}/{prefix}{MANIFEST_FILE}"),
        }
    }

    /// A local directory the walk of SRC must skip: the output, or the S3 state directory.
    pub fn local_dir(&self) -> &Path {
        match &self.kind {
            Kind::Local { dir, .. } => dir,
            Kind::S3 { state, .. } => state,
        }
    }

    /// Where this pack keeps its journal.
    pub fn journal_path(&self) -> &Path {
        &self.journal
    }

    /// The journal of an earlier pack into this destination, if any, and where it was read (a
    /// path or URL, for messages).
    pub fn load_journal(&self) -> Result<Option<(PriorJournal, String)>> {
        let local = journal::load(&self.journal)?.map(|j| (j, self.journal.display().to_string()));
        let Kind::S3 { store, bucket, prefix, .. } = &self.kind else { return Ok(local) };
        let key = format!("{prefix}{SIDECAR_DIR}/{JOURNAL_FILE}");
        let Some(bytes) = store.block_on(store.get_small(bucket, &key))? else { return Ok(local) };
        let url = format!("s3://{bucket}/{key}");
        let remote = journal::parse(&bytes, &url)?;
        // Of the same pack, the journal further along: another machine may have finished what
        // this one's journal says it left (the bucket's copy lists only shards already there).
        Ok(match local {
            Some((l, at)) if l.fingerprint == remote.fingerprint && l.shards.len() >= remote.shards.len() => {
                Some((l, at))
            }
            _ => Some((remote, url)),
        })
    }

    /// True when the destination holds a manifest (a complete dataset).
    pub fn has_manifest(&self) -> Result<bool> {
        match &self.kind {
            Kind::Local { dir, .. } => {
                let path = dir.join(MANIFEST_FILE);
                path.try_exists().map_err(|e| Error::io("cannot inspect", &path, e))
            }
            Kind::S3 { store, bucket, prefix, .. } => {
                let key = format!("{prefix}{MANIFEST_FILE}");
                Ok(store.block_on(store.object_size(bucket, &key))?.is_some())
            }
        }
    }

    /// The name of something in the destination that looks like a dataset (a manifest, sidecars,
    /// shards), for when no journal accounts for it.
    pub fn foreign_dataset(&self) -> Result<Option<String>> {
        let looks_like_data = |name: &str| {
            name == MANIFEST_FILE || name == SIDECAR_DIR || name.ends_with(".tar") || name.ends_with(".parquet")
        };
        match &self.kind {
            Kind::Local { dir, .. } => {
                let entries = match std::fs::read_dir(dir) {
                    Ok(e) => e,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => return Err(Error::io("cannot list output directory", dir, e)),
                };
                for entry in entries {
                    let entry = entry.map_err(|e| Error::io("cannot list output directory", dir, e))?;
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if looks_like_data(&name) {
                        return Ok(Some(name));
                    }
                }
                Ok(None)
            }
            Kind::S3 { store, bucket, prefix, .. } => {
                let listed = store.block_on(store.list(bucket, prefix))?;
                Ok(listed.into_iter().find_map(|o| {
                    let rel = o.key.strip_prefix(prefix.as_str())?;
                    let top = rel.split('/').next().unwrap_or(rel);
                    looks_like_data(top).then(|| rel.to_owned())
                }))
            }
        }
    }

    /// Opens the sink that writes into this destination.
    pub fn sink(&self, upload: UploadOptions) -> Result<Box<dyn Sink>> {
        Ok(match &self.kind {
            Kind::Local { dir, .. } => Box::new(LocalSink::open(dir)?),
            Kind::S3 { store, bucket, prefix, state } => Box::new(S3Sink::open(
                S3Store::clone(store),
                bucket.clone(),
                prefix.clone(),
                &state.join(SCRATCH_DIR),
                &self.journal,
                upload,
            )?),
        })
    }
}

/// Refuses an output directory inside SRC that holds anything a pack does not write: the walk of
/// SRC skips the output, so those files would be left out of the pack without a word. Hidden
/// names are skipped by the walk anyway.
fn refuse_inputs_in_output(dir: &Path, src: &Path) -> Result<()> {
    const SHOWN: usize = 4;
    let ours = |name: &str| {
        name == MANIFEST_FILE || name == SIDECAR_DIR || name.ends_with(".tar") || name.ends_with(".parquet")
    };
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io("cannot list output directory", dir, e))?;
    let mut stray = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("cannot list output directory", dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && !ours(&name) {
            stray.push(name);
        }
    }
    if stray.is_empty() {
        return Ok(());
    }
    stray.sort();
    let n = stray.len();
    let more = if n > SHOWN { ", ..." } else { "" };
    stray.truncate(SHOWN);
    Err(Error::invalid(format!(
        "output {} lies inside the source directory {} and holds {n} entries a pack does not write ({}{more}): \
         the walk skips the output, so they would be left out of the pack; pack into an empty directory",
        dir.display(),
        src.display(),
        stray.join(", ")
    )))
}

/// `$XDG_CACHE_HOME/shardstream`, else `~/.cache/shardstream`, else a per-user directory under
/// the system temp directory (a service account without a home).
fn state_root() -> PathBuf {
    let env_dir = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = env_dir("XDG_CACHE_HOME") {
        return d.join("shardstream");
    }
    if let Some(h) = env_dir("HOME") {
        return h.join(".cache").join("shardstream");
    }
    // SAFETY: getuid cannot fail and touches no memory.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("shardstream-{uid}"))
}

/// Takes an exclusive lock on `dir` for the duration of the pack (released when the returned
/// handle is dropped, or when the process dies), so two packs never write into one destination
/// at once. `shown`: the destination, for the error.
fn lock_dir(dir: &Path, shown: &str) -> Result<File> {
    use std::os::fd::AsRawFd;
    let handle = File::open(dir).map_err(|e| Error::io("cannot open output directory", dir, e))?;
    // SAFETY: flock on a file descriptor we own; no memory is involved.
    if unsafe { libc::flock(handle.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return Err(Error::Unavailable(format!("another pack is writing to {shown}")));
        }
        return Err(Error::io("cannot lock output directory", dir, e));
    }
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_outputs() {
        assert_eq!(parse_dest("/d/x").unwrap(), Dest::Local("/d/x".into()));
        assert_eq!(parse_dest("file:///d/x").unwrap(), Dest::Local("/d/x".into()));
        let s3 = |b: &str, p: &str| Dest::S3 { bucket: b.into(), prefix: p.into() };
        assert_eq!(parse_dest("s3://b/p/").unwrap(), s3("b", "p/"));
        assert_eq!(parse_dest("s3://b/p").unwrap(), s3("b", "p/"));
        assert_eq!(parse_dest("s3://b").unwrap(), s3("b", ""));
        for bad in ["", "file://rel", "gs://b/p", "s3://", "s3://b/p/x-{1..2}.tar"] {
            assert!(parse_dest(bad).is_err(), "{bad}");
        }
    }
}
