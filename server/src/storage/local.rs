//! Local and parallel-file-system datasets: one directory listing finds the shards (a brace
//! pattern stats only the files it names, without listing), positioned reads (`pread`) fetch
//! byte ranges. No per-sample `stat` or `open` ever happens here: a shard file is opened once and
//! kept open by the dataset. Listings and stats are counted (`shardstream_local_*_total`): they
//! are the metadata load a PFS feels.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::format::Format;
use crate::storage::Pick;
use crate::storage::append::Append;
use crate::storage::table_log::ICEBERG_METADATA;
use crate::{Error, Result};

/// A shard found by listing: its file name within the dataset directory, size and mtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedShard {
    pub name: String,
    pub len: u64,
    pub mtime_ns: i64,
}

/// Lists the shards of a dataset directory that `pick` takes. [`Pick::Names`]: exactly those
/// files (in the given order) must exist, and nothing is listed; otherwise every file with the
/// extension of a shard format ([`Format::is_shard_name`]) that the pick keeps, sorted by name,
/// and stat'ed only once kept (a glob over a directory of millions stats its matches alone).
pub fn list_shards(dir: &Path, pick: &Pick) -> Result<Vec<ListedShard>> {
    let meta = std::fs::metadata(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::NotFound { what: "dataset", path: dir.display().to_string() },
        _ => Error::io("cannot read dataset directory", dir, e),
    })?;
    if !meta.is_dir() {
        return Err(Error::invalid(format!(
            "dataset {} is a file, not a directory of shards (name its directory, or use a pattern)",
            dir.display()
        )));
    }
    crate::metrics::local_stat(1);
    let stat = |name: &str| -> Result<ListedShard> {
        let path = dir.join(name);
        crate::metrics::local_stat(1);
        let meta = match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::NotFound { what: "shard", path: path.display().to_string() });
            }
            // std::fs::metadata follows symlinks: a shard may well be a symlink into a PFS.
            m => shard_metadata(&path, m)?,
        };
        Ok(ListedShard { name: name.to_owned(), len: meta.len(), mtime_ns: mtime_ns(&meta) })
    };
    let shards = match pick {
        // A brace pattern names its files: stat exactly those, never list the directory (which
        // may hold millions of other entries, each a metadata request on a PFS).
        Pick::Names(names) => names.iter().map(|n| stat(n)).collect::<Result<Vec<_>>>()?,
        Pick::All | Pick::Every | Pick::Glob(_) => {
            if matches!(pick, Pick::All | Pick::Every) {
                refuse_iceberg_data(dir)?;
            }
            let mut found = Vec::new();
            let mut subdirs = Vec::new();
            let mut unserved = super::Unserved::default();
            let mut manifest = false;
            crate::metrics::local_list(1);
            let entries = std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))?;
            for entry in entries {
                let entry = entry.map_err(|e| Error::io("cannot list", dir, e))?;
                let Some(name) = text_name(&entry, false)? else { continue };
                if Format::is_shard_name(&name) {
                    found.push(name);
                } else if is_dir(&entry) {
                    if name == super::table_log::DELTA_LOG && matches!(pick, Pick::All | Pick::Every) {
                        return Err(super::table_log::delta_table(&super::dir_base(dir)));
                    }
                    subdirs.push(name);
                } else {
                    manifest |= name == crate::index::manifest::MANIFEST_FILE;
                    unserved.note(&name);
                }
            }
            // A local pack publishes its shards from staging right before its manifest: a kill
            // between the two leaves its journal and no manifest (as an S3 pack does all along).
            if !manifest && subdirs.iter().any(|s| s == crate::index::manifest::SIDECAR_DIR) {
                let journal = crate::pack::journal::journal_path(dir);
                crate::metrics::local_stat(1);
                if journal.try_exists().map_err(|e| Error::io("cannot inspect", &journal, e))? {
                    let shards: Vec<&str> =
                        found.iter().map(String::as_str).filter(|n| !super::pick::is_hidden(n)).collect();
                    return Err(crate::pack::journal::unfinished(
                        &super::dir_base(dir),
                        &journal.display().to_string(),
                        &shards,
                    ));
                }
            }
            let part = subdirs.iter().find(|s| super::partitions::key_value(s).is_some());
            if let (Some(part), Pick::All | Pick::Every) = (part, pick) {
                let place = super::dir_base(dir);
                if let Some(shard) = found.iter().find(|n| !super::pick::is_hidden(n)) {
                    return Err(super::partitions::beside_partitions(&place, shard, part));
                }
                // The dataset's own directory counts as walked: a link back to it is a loop.
                let seen = HashMap::from([((meta.dev(), meta.ino()), String::new())]);
                let mut walk = PartitionWalk { place: &place, seen, shards: Vec::new() };
                for sub in subdirs.iter().filter(|s| !super::pick::is_hidden(s)) {
                    walk.dir(&dir.join(sub), &format!("{sub}/"))?;
                }
                let mut nested = walk.shards;
                nested.sort();
                found = super::partitions::partitioned(nested, String::as_str, &place)?;
            }
            if found.is_empty() {
                if subdirs.iter().any(|s| s == ICEBERG_METADATA) && holds_iceberg_metadata(&dir.join(ICEBERG_METADATA))
                {
                    let place = super::dir_base(dir);
                    return Err(super::table_log::iceberg_table(&place, &place));
                }
                subdirs.sort();
                return Err(super::no_shards(
                    "shards (*.tar or *.parquet files)",
                    dir.display().to_string(),
                    "directory",
                    &subdirs_with_shards(dir, subdirs),
                    &unserved,
                ));
            }
            if matches!(pick, Pick::All | Pick::Every)
                && let Some(e) = unserved.beside_shards(&super::dir_base(dir))
            {
                return Err(e);
            }
            found.sort();
            let kept = pick.keep_listed(found, String::as_str, &super::dir_base(dir))?;
            kept.iter().map(|n| stat(n)).collect::<Result<Vec<_>>>()?
        }
    };
    if shards.is_empty() {
        return Err(super::no_shards(
            "shards (*.tar or *.parquet files)",
            dir.display().to_string(),
            "directory",
            &[],
            &super::Unserved::default(),
        ));
    }
    Ok(shards)
}

/// Refuses `dir` when it is an Iceberg table's `data/` ([`super::table_log`]). Costs a listing of
/// the `metadata/` beside it, for a directory named `data` only.
fn refuse_iceberg_data(dir: &Path) -> Result<()> {
    let place = super::dir_base(dir);
    match super::table_log::iceberg_table_above(&place) {
        Some(table) if holds_iceberg_metadata(&Path::new(table).join(ICEBERG_METADATA)) => {
            Err(super::table_log::iceberg_table(table, &place))
        }
        _ => Ok(()),
    }
}

/// Whether `dir` exists and holds an Iceberg table's metadata.
fn holds_iceberg_metadata(dir: &Path) -> bool {
    crate::metrics::local_list(1);
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| e.file_name().to_str().is_some_and(super::table_log::is_iceberg_metadata))
    })
}

/// Whether a listed entry is a directory, or a symbolic link to one (followed, as the stat of a
/// listed shard follows it); only a link costs a `stat`.
fn is_dir(entry: &std::fs::DirEntry) -> bool {
    entry
        .file_type()
        .is_ok_and(|t| t.is_dir() || (t.is_symlink() && std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir())))
}

/// The walk of a partitioned directory's subdirectories (one listing each, as pyarrow.dataset's
/// discovery), following symbolic links as the stat of a listed shard does.
struct PartitionWalk<'a> {
    /// The dataset's directory as errors name it (ending with `/`).
    place: &'a str,
    /// Every directory walked, by (device, inode), and its path below the dataset's: one met
    /// again through a symbolic link is refused, since a link back up the tree would make each
    /// level list the whole tree again (once per such link, until the kernel's ELOOP), and a
    /// link to a sibling partition would serve its files twice, under two keys.
    seen: HashMap<(u64, u64), String>,
    /// The shards found, by their paths below the dataset's directory.
    shards: Vec<String>,
}

/// An entry's name, if it is UTF-8. One that is not cannot be named in a manifest, a plan or an
/// error as itself; leaving it out is right for a file that would not be served anyway, but a
/// shard (or, in a partitioned dataset, a directory that may hold shards) left out would serve
/// part of the dataset without a word: that is an error naming it.
fn text_name(entry: &std::fs::DirEntry, dirs_matter: bool) -> Result<Option<String>> {
    let os = entry.file_name();
    if let Some(name) = os.to_str() {
        return Ok(Some(name.to_owned()));
    }
    let lossy = os.to_string_lossy();
    if Format::is_shard_name(&lossy) || (dirs_matter && !super::pick::is_hidden(&lossy) && is_dir(entry)) {
        return Err(Error::invalid(format!(
            "{}: the name is not valid UTF-8; shards are named as text in manifests and plans, so it would be \
             left out of the dataset: rename it",
            entry.path().to_string_lossy()
        )));
    }
    Ok(None)
}

impl PartitionWalk<'_> {
    /// Walks `dir`, which is `rel` (ending with `/`) below the dataset's directory.
    fn dir(&mut self, dir: &Path, rel: &str) -> Result<()> {
        crate::metrics::local_stat(1);
        let meta = std::fs::metadata(dir).map_err(|e| Error::io("cannot stat", dir, e))?;
        if let Some(first) = self.seen.insert((meta.dev(), meta.ino()), rel.to_owned()) {
            return Err(Error::invalid(format!(
                "{place}{rel} is the directory {place}{first} again, through a symbolic link: its files would be \
                 read twice under two partitions (or, through a link back up the tree, without end); remove the link",
                place = self.place
            )));
        }
        crate::metrics::local_list(1);
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io("cannot list", dir, e))?;
            let Some(name) = text_name(&entry, true)? else { continue };
            if super::pick::is_hidden(&name) {
                continue;
            }
            if is_dir(&entry) {
                self.dir(&entry.path(), &format!("{rel}{name}/"))?;
            } else if Format::is_shard_name(&name) {
                self.shards.push(format!("{rel}{name}"));
            }
        }
        Ok(())
    }
}

/// Which of `subdirs` (names in `dir`) hold shards of their own, for the error of a directory
/// that holds none. Only on that error path, and at most [`SUBDIRS_LOOKED_INTO`] listings: a
/// PFS directory of many subdirectories is not walked to word an error.
fn subdirs_with_shards(dir: &Path, subdirs: Vec<String>) -> Vec<String> {
    subdirs
        .into_iter()
        .take(SUBDIRS_LOOKED_INTO)
        .filter(|sub| {
            crate::metrics::local_list(1);
            std::fs::read_dir(dir.join(sub)).is_ok_and(|entries| {
                entries.flatten().any(|e| e.file_name().to_str().is_some_and(Format::is_shard_name))
            })
        })
        .collect()
}

/// How many subdirectories a directory without shards has listed to say where its shards are.
const SUBDIRS_LOOKED_INTO: usize = 64;

/// A shard's metadata, refusing a shard's name on something that is not a file (a directory or
/// FIFO put in a shard's place) with an error naming it: skipping it would silently train on
/// another dataset.
fn shard_metadata(path: &Path, meta: std::io::Result<std::fs::Metadata>) -> Result<std::fs::Metadata> {
    let meta = meta.map_err(|e| Error::io("cannot stat shard", path, e))?;
    if meta.is_dir() {
        return Err(Error::io("cannot read shard", path, std::io::Error::from_raw_os_error(libc::EISDIR)));
    }
    if !meta.is_file() {
        return Err(Error::Shard {
            shard: path.display().to_string(),
            offset: None,
            reason: "is not a regular file (a FIFO, socket or device has a shard's name)".into(),
        });
    }
    Ok(meta)
}

/// A file's modification time in nanoseconds since the epoch (the side channel's definition).
pub use shardstream_proto::shm::mtime_ns;

/// An open shard file, read with positioned reads (safe to share between threads).
#[derive(Debug)]
pub struct ShardFile {
    pub path: PathBuf,
    pub file: File,
    pub len: u64,
    /// Its modification time when opened (what a listing records of a shard read in place).
    pub mtime_ns: i64,
    /// How errors name the shard: its path, or its `s3://` URL when `path` is a cache copy.
    pub name: String,
}

/// Refuses a local shard whose metadata `now` is not what the dataset was listed with (`len`,
/// and `mtime_ns` when recorded), as opening a shard read in place does: for a shard served from
/// a node-cache copy, whose source is not opened.
pub fn check_listed(path: &Path, now: &std::fs::Metadata, len: u64, mtime_ns: Option<i64>) -> Result<()> {
    unlike_listing(path, (now.len(), self::mtime_ns(now)), len, mtime_ns)
}

/// The error of a local shard whose (length, mtime) `now` are not what the dataset was listed
/// with: `len`, and `mtime_ns` when recorded (a manifest's shard is checked by its CRC instead).
/// A shard rewritten in place at the same length (TAR pads members to 512 bytes) would otherwise
/// be read with the old index, values cut or run on.
fn unlike_listing(path: &Path, now: (u64, i64), len: u64, mtime_ns: Option<i64>) -> Result<()> {
    let changed = |reason: String| Error::Shard { shard: path.display().to_string(), offset: None, reason };
    if now.0 != len {
        return Err(changed(format!(
            "is {} bytes but the dataset index says {len}: it changed since the dataset was listed",
            now.0
        )));
    }
    match mtime_ns {
        Some(listed) if listed != now.1 => Err(changed(
            "has the same length but another modification time: it changed since the dataset was listed".into(),
        )),
        _ => Ok(()),
    }
}

impl ShardFile {
    pub fn open(path: PathBuf, expected_len: u64) -> Result<Self> {
        let name = path.display().to_string();
        Self::open_as(path, expected_len, name)
    }

    /// Opens a local copy of the shard `name` (a node-cache file of an S3 object).
    pub fn open_as(path: PathBuf, expected_len: u64, name: String) -> Result<Self> {
        let file = open_regular(&path)?;
        let meta = file.metadata().map_err(|e| Error::io("cannot stat shard", &path, e))?;
        let (len, mtime_ns) = (meta.len(), mtime_ns(&meta));
        unlike_listing(&path, (len, mtime_ns), expected_len, None)?;
        Ok(Self { path, file, len, mtime_ns, name })
    }

    /// Refuses a file whose modification time is not the one the dataset was listed with
    /// (`None`: nothing recorded), see [`unlike_listing`].
    pub fn check_mtime(&self, listed_ns: Option<i64>) -> Result<()> {
        unlike_listing(&self.path, (self.len, self.mtime_ns), self.len, listed_ns)
    }

    /// Refuses a file no longer as it was opened (its length or modification time): a shard
    /// read in place that was rewritten while a stream read it. The open's check against the
    /// listing cannot see that, and a rewrite at the same length (TAR pads members to 512 bytes)
    /// reads as a well-formed shard: other samples at the indexed offsets, or garbage. Called
    /// after a batch's reads from the file and before the batch is handed out, it catches every
    /// rewrite a read saw: a write moves the time before it copies a byte. One `fstat` of the
    /// open descriptor, no path lookup.
    pub fn check_unchanged(&self) -> Result<()> {
        let now = self.file.metadata().map_err(|e| Error::io("cannot stat shard", &self.path, e))?;
        match shardstream_proto::shm::changed_while_read((self.len, self.mtime_ns), (now.len(), mtime_ns(&now))) {
            None => Ok(()),
            Some(reason) => Err(Error::Shard { shard: self.name.clone(), offset: None, reason }),
        }
    }

    /// Reads exactly `buf.len()` bytes at `offset`; a short read means the shard was truncated
    /// after it was indexed and is reported as a shard error naming the offset.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        fail_point!("local-read", |a| Err(crate::failpoints::io("cannot read shard", &self.path, a)));
        self.file.read_exact_at(buf, offset).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => self.truncated(buf.len(), offset),
            _ => Error::io("cannot read shard", &self.path, e),
        })
    }

    /// The error of a read of `len` bytes at `offset` that met the end of the file: the shard
    /// was truncated after it was indexed.
    fn truncated(&self, len: usize, offset: u64) -> Error {
        Error::Shard {
            shard: self.name.clone(),
            offset: Some(offset),
            reason: format!("truncated: cannot read {len} bytes at offset {offset}"),
        }
    }

    /// Exactly `len` bytes read at `offset`, in a new buffer (see [`Self::read_append`]).
    pub fn read_vec(&self, len: usize, offset: u64) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        self.read_append(&mut buf, len, offset)?;
        Ok(buf)
    }

    /// Appends exactly `len` bytes read at `offset` to `buf`, without zero-filling the space
    /// first (see [`pread_append`]; the zero fill of `Vec::resize` before a `read_exact_at` was
    /// 4-5% of the daemon's CPU on inline streams). On error `buf` is as it was; a short read is
    /// the truncated-shard error of [`Self::read_exact_at`].
    pub fn read_append(&self, buf: &mut impl Append, len: usize, offset: u64) -> Result<()> {
        fail_point!("local-read", |a| Err(crate::failpoints::io("cannot read shard", &self.path, a)));
        if offset.checked_add(len as u64).and_then(|end| libc::off_t::try_from(end).ok()).is_none() {
            return Err(Error::Shard {
                shard: self.name.clone(),
                offset: Some(offset),
                reason: format!("read of {len} bytes at offset {offset} out of range"),
            });
        }
        // A fixed buffer without room is its own error (not an I/O error on the shard).
        buf.spare(len)?;
        let before = buf.len();
        let n =
            pread_append(&self.file, buf, len, offset).map_err(|e| Error::io("cannot read shard", &self.path, e))?;
        if n < len {
            buf.truncate(before);
            return Err(self.truncated(len, offset));
        }
        Ok(())
    }
}

/// Appends up to `len` bytes of `file` read at `offset` to `buf`, fewer only where the file ends
/// first, and returns how many. The kernel reads straight into `buf`'s spare room, with no zero
/// fill first: one `pread` for a file that has the bytes. On error `buf` is as it was. The one
/// read without a zero fill: the daemon's shard reads ([`ShardFile::read_append`]) and `pack`'s
/// file reads (`pack::read`) both come here.
pub fn pread_append(file: &File, buf: &mut impl Append, len: usize, offset: u64) -> std::io::Result<usize> {
    pread_until(file, buf, len, offset, len)
}

/// [`pread_append`] of the whole of a file stat'ed at `len` bytes, asking for one byte more: the
/// same `pread` tells a file that grew since (`len + 1` back: a file still being written), and a
/// short read that reaches `len` is its end (a regular file's reads are short only there), not
/// asked again. Fewer than `len` back: it shrank.
pub fn pread_append_stated(file: &File, buf: &mut impl Append, len: usize) -> std::io::Result<usize> {
    let more = len.checked_add(1).ok_or_else(|| std::io::Error::other("file length out of range"))?;
    pread_until(file, buf, more, 0, len)
}

/// Reads up to `len` bytes as [`pread_append`] says, stopping early once `enough` are in.
fn pread_until(file: &File, buf: &mut impl Append, len: usize, offset: u64, enough: usize) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let spare = buf.spare(len).map_err(|e| std::io::Error::new(std::io::ErrorKind::OutOfMemory, e.to_string()))?;
    let mut done = 0;
    while done < len {
        let at = offset
            .checked_add(done as u64)
            .and_then(|o| libc::off_t::try_from(o).ok())
            .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "read offset out of range"))?;
        // SAFETY: `spare` points at room for `len` bytes of `buf` (its `spare` contract), which
        // nothing else touches until `grow` below; pread writes at most the `len - done` bytes
        // past `done` and nothing else.
        let n = unsafe { libc::pread(file.as_raw_fd(), spare.add(done).cast(), len - done, at) };
        match n {
            0 => break,
            n if n < 0 => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            n => {
                done += n.unsigned_abs();
                if done >= enough {
                    break;
                }
            }
        }
    }
    // SAFETY: the loop above wrote the first `done` bytes at `spare` (`done <= len`), with no
    // other call on `buf` since `spare(len)`.
    unsafe { buf.grow(done) };
    Ok(done)
}

/// Opens a shard for reading, refusing anything but a regular file with an error naming it: a
/// directory put in a shard's place (EISDIR), or a FIFO, on which a plain open would block the
/// stream forever waiting for a writer (hence `O_NONBLOCK`, which regular files ignore).
pub fn open_regular(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| Error::io("cannot open shard", path, e))?;
    super::confine::check_opened(&file, path)?;
    let kind = file.metadata().map_err(|e| Error::io("cannot stat shard", path, e))?.file_type();
    if kind.is_dir() {
        return Err(Error::io("cannot read shard", path, std::io::Error::from_raw_os_error(libc::EISDIR)));
    }
    if !kind.is_file() {
        return Err(Error::Shard {
            shard: path.display().to_string(),
            offset: None,
            reason: "is not a regular file (a FIFO, socket or device took the shard's place)".into(),
        });
    }
    Ok(file)
}

/// The most a dataset's own metadata file (`manifest.json`, a sidecar, the footers bundle) may
/// hold: far above a manifest of a million shards, far below what a daemon can hold in memory.
pub const METADATA_LIMIT: u64 = 1 << 30;

/// Reads a dataset's metadata file whole: a regular file of at most [`METADATA_LIMIT`] bytes.
/// Opened without blocking and checked before a byte is read: a FIFO in its place would hold a
/// thread for good, and a device (`/dev/zero`) or a sparse file of terabytes would be read until
/// the daemon runs out of memory. `NotFound` as the plain error, for callers that take a
/// missing file as "none".
///
/// When opens are confined ([`super::confine`]), `path` must be the file's real location, and a
/// descriptor that leads elsewhere (a link swapped in since that location was checked) is
/// refused as PermissionDenied before a byte is read, as shards are.
pub fn read_metadata(path: &Path) -> std::io::Result<Vec<u8>> {
    read_metadata_as(path, super::confine::confined())
}

fn read_metadata_as(path: &Path, confined: bool) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    if confined {
        super::confine::opened_at(&file, path)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string()))?;
    }
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, socket, device or directory in its place)",
        ));
    }
    if meta.len() > METADATA_LIMIT {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} bytes, over the limit of {METADATA_LIMIT} for a dataset's metadata file", meta.len()),
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // Bounded again: the file may grow while it is read.
    file.take(METADATA_LIMIT + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > METADATA_LIMIT {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "grew past the limit while read"));
    }
    Ok(bytes)
}

/// Writes `bytes` to `path` so that readers see either the old file or the complete new one
/// (see [`crate::atomic_write`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    fail_point!("atomic-write", |a| Err(crate::failpoints::io("cannot write", path, a)));
    crate::atomic_write::write(path, bytes).map_err(|e| Error::io("cannot write", path, e))
}

/// True for the temporary names of [`crate::atomic_write`]: what a crashed writer leaves
/// behind, safe to delete before the next write into the same directory.
pub fn is_temp_name(name: &str) -> bool {
    crate::atomic_write::is_temp_name(name)
}

/// CRC-32C of a whole file, streamed in large reads.
pub fn file_crc32c(path: &Path) -> Result<(u64, u32)> {
    use std::io::Read;
    /// Large enough that syscall overhead vanishes against the CRC (~20 GB/s), small enough to
    /// stay in L2 cache.
    const CHUNK: usize = 1 << 20;
    let mut f = open_regular(path)?;
    let mut buf = vec![0u8; CHUNK];
    let (mut crc, mut len) = (0u32, 0u64);
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io("cannot read", path, e))?;
        if n == 0 {
            return Ok((len, crc));
        }
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        len += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(bytes: &[u8]) -> (tempfile::TempDir, ShardFile) {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("s.tar");
        std::fs::write(&path, bytes).expect("write shard");
        let file = ShardFile::open(path, bytes.len() as u64).expect("open shard");
        (dir, file)
    }

    #[test]
    fn read_append_appends_exactly_the_bytes_at_the_offset() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (_dir, f) = shard(&data);
        let mut buf = b"head".to_vec();
        f.read_append(&mut buf, 5000, 1234).expect("read");
        f.read_append(&mut buf, 0, 9999).expect("empty read");
        f.read_append(&mut buf, 1, 9999).expect("last byte");
        assert_eq!(&buf[..4], b"head");
        assert_eq!(&buf[4..5004], &data[1234..6234]);
        assert_eq!(buf[5004], data[9999]);
        assert_eq!(buf.len(), 5005);
    }

    #[test]
    fn a_shard_rewritten_in_place_since_it_was_opened_is_refused_by_its_check() {
        use std::os::unix::fs::FileExt;
        let data = vec![7u8; 4096];
        let (_dir, f) = shard(&data);
        f.check_unchanged().expect("as opened");
        // Rewritten at its length, without truncation: every read succeeds, with other bytes.
        let writer = std::fs::OpenOptions::new().write(true).open(&f.path).expect("open for writing");
        writer.write_all_at(&[9u8; 4096], 0).expect("rewrite");
        // Apart from the first write's time, which a coarse clock might repeat.
        writer.set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(2_000_000_000)).expect("set time");
        assert_eq!(f.read_vec(4, 100).expect("read"), [9u8; 4]);
        let err = f.check_unchanged().expect_err("rewritten");
        assert!(
            matches!(&err, Error::Shard { offset: None, reason, .. }
                if reason.contains("changed while a stream read it") && reason.contains("modification time moved")),
            "{err}"
        );
        writer.set_len(5000).expect("grow");
        let err = f.check_unchanged().expect_err("grown");
        assert!(
            matches!(&err, Error::Shard { reason, .. } if reason.contains("5000 bytes, 4096 when opened")),
            "{err}"
        );
    }

    #[test]
    fn read_vec_is_exactly_the_bytes_at_the_offset_or_a_truncated_shard() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let (_dir, f) = shard(&data);
        assert_eq!(f.read_vec(5000, 1234).expect("read"), &data[1234..6234]);
        assert!(f.read_vec(0, 10_000).expect("empty read").is_empty());
        let err = f.read_vec(2, 9999).expect_err("past the end");
        assert!(
            matches!(&err, Error::Shard { offset: Some(9999), reason, .. } if reason.contains("truncated")),
            "{err}"
        );
    }

    #[test]
    fn a_short_read_is_a_truncated_shard_and_leaves_the_buffer_as_it_was() {
        let (_dir, f) = shard(&[1u8; 100]);
        let mut buf = b"kept".to_vec();
        let err = f.read_append(&mut buf, 50, 80).expect_err("past the end");
        assert!(matches!(&err, Error::Shard { offset: Some(80), reason, .. } if reason.contains("truncated")), "{err}");
        assert_eq!(buf, b"kept");
    }

    #[test]
    fn an_offset_past_what_the_system_can_read_names_the_shard() {
        let (_dir, f) = shard(&[1u8; 100]);
        let mut buf = Vec::new();
        let err = f.read_append(&mut buf, 10, u64::MAX - 2).expect_err("offset out of range");
        assert!(
            matches!(&err, Error::Shard { shard, offset: Some(o), .. } if shard == &f.name && *o == u64::MAX - 2),
            "{err}"
        );
        assert!(buf.is_empty());
    }

    #[test]
    fn confined_metadata_is_read_only_where_it_was_checked_to_lie() {
        // The allow list's check finds a manifest's real location, then it is read: a directory
        // on the way swapped for a link in between must not lead the read elsewhere.
        let root = tempfile::tempdir().expect("temp dir");
        let (mine, theirs) = (root.path().join("mine"), root.path().join("theirs"));
        for (d, text) in [(&mine, "mine"), (&theirs, "theirs")] {
            std::fs::create_dir(d).expect("dir");
            std::fs::write(d.join("manifest.json"), text).expect("manifest");
        }
        let checked = std::fs::canonicalize(mine.join("manifest.json")).expect("real location");
        assert_eq!(read_metadata_as(&checked, true).expect("read where checked"), b"mine");
        std::fs::rename(&mine, root.path().join("moved")).expect("move away");
        std::os::unix::fs::symlink(&theirs, &mine).expect("swap in a link");
        let err = read_metadata_as(&checked, true).expect_err("refused");
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        assert!(err.to_string().contains("theirs"), "names where it leads: {err}");
        // Without confinement, paths are read as named.
        assert_eq!(read_metadata_as(&checked, false).expect("read"), b"theirs");
    }

    #[test]
    fn a_pack_journal_without_its_manifest_is_an_unfinished_pack() {
        let root = tempfile::tempdir().expect("temp dir");
        let dir = root.path();
        std::fs::create_dir_all(dir.join("_shardstream")).expect("sidecar dir");
        std::fs::write(dir.join("shard-000000.tar"), b"").expect("shard");
        std::fs::write(dir.join("_shardstream/shard-000000.tar.idx"), b"").expect("sidecar");
        // Sidecars alone (an `index` whose manifest went missing) are no pack's.
        assert_eq!(list_shards(dir, &Pick::All).expect("indexed dir").len(), 1);
        std::fs::write(dir.join("_shardstream/pack-journal.jsonl"), b"{}\n").expect("journal");
        let glob = Pick::Glob(crate::storage::pick::NameGlob::new("shard-*.tar").expect("glob"));
        for pick in [Pick::All, glob.clone()] {
            let err = list_shards(dir, &pick).expect_err("an unfinished pack").to_string();
            assert!(err.contains("unfinished") && err.contains("_shardstream/pack-journal.jsonl"), "{err}");
            let named = format!("name it ({}/shard-000000.tar)", dir.display());
            assert!(err.contains(&named), "{err}");
        }
        let named = Pick::Names(vec!["shard-000000.tar".into()]);
        assert_eq!(list_shards(dir, &named).expect("named shard").len(), 1);
        // The manifest is written last: with it, the pack is done.
        std::fs::write(dir.join("manifest.json"), b"{}").expect("manifest");
        for pick in [Pick::All, glob] {
            assert_eq!(list_shards(dir, &pick).expect("a finished pack").len(), 1);
        }
    }

    /// A shard whose name is not UTF-8 cannot be named in a manifest or a plan; leaving it out
    /// would serve part of the dataset without a word.
    #[test]
    fn a_shard_name_that_is_not_utf8_is_an_error_naming_it() {
        use std::os::unix::ffi::OsStrExt;
        let root = tempfile::tempdir().expect("temp dir");
        let dir = root.path();
        std::fs::write(dir.join("train-0.tar"), b"").expect("shard");
        // Not a shard by its extension: not served either way, so no reason to refuse.
        std::fs::write(dir.join(std::ffi::OsStr::from_bytes(b"notes-\xe9.txt")), b"").expect("other file");
        assert_eq!(list_shards(dir, &Pick::All).expect("only a text file is not UTF-8").len(), 1);
        std::fs::write(dir.join(std::ffi::OsStr::from_bytes(b"train-\xe9t\xe9.tar")), b"").expect("shard");
        let err = list_shards(dir, &Pick::All).expect_err("a shard left out").to_string();
        assert!(err.contains("not valid UTF-8") && err.contains("train-\u{fffd}t\u{fffd}.tar"), "{err}");
    }

    #[test]
    fn an_iceberg_tables_directory_and_its_data_are_refused_but_not_a_data_directory_of_another_kind() {
        let root = tempfile::tempdir().expect("temp dir");
        let table = root.path().join("t");
        std::fs::create_dir_all(table.join("data")).expect("data dir");
        std::fs::create_dir_all(table.join("metadata")).expect("metadata dir");
        std::fs::write(table.join("data/00000-0-a.parquet"), b"PAR1").expect("data file");
        std::fs::write(table.join("metadata/00000-b.metadata.json"), b"{}").expect("metadata file");
        for named in [table.clone(), table.join("data")] {
            let err = list_shards(&named, &Pick::All).expect_err("an Iceberg table").to_string();
            assert!(err.contains("Iceberg table") && err.contains("/t/metadata/ holds"), "{err}");
        }
        // A glob over data/ is the user's pick.
        let glob = Pick::Glob(crate::storage::pick::NameGlob::new("*.parquet").expect("glob"));
        assert_eq!(list_shards(&table.join("data"), &glob).expect("glob")[0].name, "00000-0-a.parquet");
        // A `metadata/` of other files beside a `data/` is no table's.
        std::fs::remove_file(table.join("metadata/00000-b.metadata.json")).expect("remove");
        std::fs::write(table.join("metadata/labels.json"), b"{}").expect("other file");
        assert_eq!(list_shards(&table.join("data"), &Pick::All).expect("plain data dir").len(), 1);
    }
}
