//! Where shard bytes come from: dataset URLs and the backends that list and read them.
//!
//! A dataset URL is `file:///dir/`, a plain path to a directory, or a path whose file name is a
//! brace pattern over shard names (`/data/train-{000000..000099}.tar`, `/data/{a,b}.tar`) or a
//! glob (`/data/train-*.parquet`; see [`pick`]). Patterns are only allowed in the file name, never
//! in directories, so a dataset is always one directory and is found with one listing (a brace
//! pattern, with none; a Hive-partitioned directory, with one per partition directory). `s3://bucket/prefix/` names a prefix of an S3 (or S3-compatible) bucket,
//! found with one paginated listing (or one manifest GET), with the same patterns in the last
//! component; a URL naming one shard file (or object) is a dataset of that shard.
//!
//! - [`append`]: the buffers sample reads append to (a growing `Vec`, a fixed rdma staging buffer).
//! - [`local`]: directories on local disks and parallel file systems, read in place.
//! - [`pick`]: which of a directory's shards a URL picks (all, brace names, a glob), and the
//!   refusal of a directory that holds several splits.
//! - [`no_shards`]: the error for a place without shards, naming what it holds instead.
//! - [`partitions`]: Hive-partitioned places (`year=2020/part-0.parquet`): which shards are
//!   theirs, the keys each file's directories give.
//! - [`s3`]: S3 objects, downloaded into the node cache with parallel ranged GETs.
//! - [`s3_write`]: uploads to S3 (single PUT or multipart from a local file), HEAD and DELETE,
//!   for `shardstream pack`.
//! - [`retry`]: the retry policy every remote request follows.
//! - [`table_log`]: places that are tables with a log (Delta Lake), whose files are not their
//!   rows: refused when listed.

pub mod append;
pub mod confine;
pub mod local;
mod no_shards;
pub mod partitions;
pub mod pick;
pub mod retry;
pub mod s3;
mod s3_tls;
pub mod s3_write;
pub mod table_log;

use std::path::PathBuf;

pub use no_shards::{Unserved, no_shards};
pub use pick::Pick;

use crate::{Error, Result};

/// Largest number of names a brace pattern may expand to: beyond this the pattern is almost
/// certainly a typo (and the names alone would take gigabytes).
pub const MAX_PATTERN_NAMES: usize = 10_000_000;

/// Largest total length, in bytes, of the names a brace pattern may expand to. A request is a few
/// KiB at most; without this bound a short pattern (`{0..9999999}` twice over) would make the
/// daemon allocate hundreds of MB before anything else could refuse it.
pub const MAX_PATTERN_BYTES: usize = 16 << 20;

/// Where one shard's bytes live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardSource {
    /// A file on a local or parallel file system.
    Local(PathBuf),
    /// An S3 object; `etag` (from a listing) pins the version every ranged GET reads.
    S3 { bucket: String, key: String, etag: Option<String> },
}

impl ShardSource {
    /// The shard as a user names it in errors: a path or an `s3://` URL.
    pub fn url(&self) -> String {
        match self {
            ShardSource::Local(p) => p.display().to_string(),
            ShardSource::S3 { bucket, key, .. } => format!("s3://{bucket}/{key}"),
        }
    }
}

/// A parsed dataset location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DatasetUrl {
    /// A directory on a local or parallel file system, or the shards of it that `pick` names.
    Local { dir: PathBuf, pick: Pick },
    /// A prefix of an S3 bucket (`prefix` is empty or ends with `/`), or the objects directly
    /// under it that `pick` names.
    S3 { bucket: String, prefix: String, pick: Pick },
}

impl DatasetUrl {
    /// The dataset's location as a URL prefix that a shard name is appended to.
    pub fn base(&self) -> String {
        match self {
            DatasetUrl::Local { dir, .. } => dir_base(dir),
            DatasetUrl::S3 { bucket, prefix, .. } => format!("s3://{bucket}/{prefix}"),
        }
    }

    /// One string for each dataset however its URL is spelt: `/data/ds`, `/data/ds/` and
    /// `/data//./ds` are one directory to the file system (symlinks are not followed: another
    /// path may be another dataset tomorrow), `s3://b/train` and `s3://b/train/` one prefix.
    /// The daemon keeps one listing and index for them all.
    pub fn identity(&self) -> String {
        let base = match self {
            DatasetUrl::Local { dir, .. } => dir_base(&dir.components().collect::<PathBuf>()),
            DatasetUrl::S3 { .. } => self.base(),
        };
        match self.pick() {
            Pick::All => base,
            Pick::Every => format!("{base}\0every"),
            Pick::Names(names) => format!("{base}\0names\0{}", names.join("\0")),
            Pick::Glob(glob) => format!("{base}\0glob\0{}", glob.pattern()),
        }
    }

    pub fn pick(&self) -> &Pick {
        match self {
            DatasetUrl::Local { pick, .. } | DatasetUrl::S3 { pick, .. } => pick,
        }
    }
}

/// Whether `url` is a relative local path: not a URL (`s3://`, `file://`) and not starting at `/`.
/// A daemon would resolve one in its own working directory, so clients make it absolute and the
/// daemon refuses it. A `pipe:` URL is none (`DatasetUrl::parse` says why it is not read).
pub fn is_relative_path(url: &str) -> bool {
    !url.contains("://") && !url.starts_with('/') && !url.starts_with("pipe:")
}

/// A directory as the prefix a shard name is appended to (`/data/train/`).
pub fn dir_base(dir: &std::path::Path) -> String {
    format!("{}/", dir.display().to_string().trim_end_matches('/'))
}

fn pattern_in_directory(url: &str) -> Error {
    Error::invalid(format!("patterns are allowed only in the shard file name, not in directories: {url}"))
}

/// Parses `s3://bucket[/prefix[/pattern]]`.
fn parse_s3(url: &str, rest: &str) -> Result<DatasetUrl> {
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() || bucket.contains(['{', '*', '?', '[']) {
        return Err(Error::invalid(format!("S3 URL without a bucket name: {url}")));
    }
    let (dir, last) = key.rsplit_once('/').unwrap_or(("", key));
    if dir.contains(['{', '*', '?']) {
        return Err(pattern_in_directory(url));
    }
    let dir_prefix = if dir.is_empty() { String::new() } else { format!("{dir}/") };
    if let Some(pick) = Pick::parse(last)? {
        return Ok(DatasetUrl::S3 { bucket: bucket.to_owned(), prefix: dir_prefix, pick });
    }
    // A shard's name is that one object: no request can tell it from a prefix of the same name
    // (Spark's `out.parquet/`) in advance, so the URL says which; the listing then names a prefix
    // found in its place.
    if crate::format::Format::is_shard_name(last) {
        return Ok(DatasetUrl::S3 {
            bucket: bucket.to_owned(),
            prefix: dir_prefix,
            pick: Pick::Names(vec![last.to_owned()]),
        });
    }
    // `s3://b/train` and `s3://b/train/` both name the prefix `train/`: a dataset is a "directory".
    let prefix = if last.is_empty() { dir_prefix } else { format!("{dir_prefix}{last}/") };
    Ok(DatasetUrl::S3 { bucket: bucket.to_owned(), prefix, pick: Pick::All })
}

impl DatasetUrl {
    /// Parses a dataset URL as given by a user. A local path whose last component reads as a glob
    /// but names an existing directory (`/data/run[1]`) is that directory; one that names a shard
    /// file is a dataset of that one shard (a directory named like one, as Spark writes
    /// `out.parquet/`, is a directory).
    pub fn parse(url: &str) -> Result<Self> {
        let url = url.trim();
        if url.is_empty() {
            return Err(Error::invalid("dataset URL is empty"));
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            return parse_s3(url, rest);
        }
        let path = match url.strip_prefix("file://") {
            Some(p) if p.starts_with('/') => p,
            Some(p) => return Err(Error::invalid(format!("file URL must be absolute: file://{p}"))),
            // webdataset's shell-command URLs: as a path, "not found" under the working directory.
            None if url.starts_with("pipe:") => {
                return Err(Error::invalid(format!(
                    "pipe: URLs (a shell command's output, as webdataset reads) are not read: shardstream reads the \
                     shards itself, from a local directory, a file:// or s3:// URL, or a brace pattern of shards \
                     (/data/shard-{{000000..000099}}.tar): {url}"
                )));
            }
            None if url.contains("://") => {
                return Err(Error::invalid(format!("unsupported dataset URL scheme: {url}")));
            }
            None => url,
        };
        let path = PathBuf::from(path);
        let file_name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let dir = path.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        let dir_name = dir.to_string_lossy();
        let missing = |p: &std::path::Path| matches!(std::fs::symlink_metadata(p), Err(e) if e.kind() == std::io::ErrorKind::NotFound);
        if dir_name.contains('{') || (dir_name.contains(['*', '?']) && missing(&dir)) {
            return Err(pattern_in_directory(url));
        }
        let is_dir = |p: &std::path::Path| std::fs::metadata(p).is_ok_and(|m| m.is_dir());
        match Pick::parse(file_name)? {
            Some(Pick::Glob(_)) if is_dir(&path) => Ok(DatasetUrl::Local { dir: path, pick: Pick::All }),
            Some(pick) => Ok(DatasetUrl::Local { dir, pick }),
            None => match std::fs::metadata(&path) {
                Ok(m) if m.is_file() && crate::format::Format::is_shard_name(file_name) => {
                    Ok(DatasetUrl::Local { dir, pick: Pick::Names(vec![file_name.to_owned()]) })
                }
                Ok(m) if m.is_file() => Err(Error::invalid(format!(
                    "dataset {url} is a file, but neither a *.tar nor a *.parquet shard nor a directory of them"
                ))),
                // Read as a directory, these said "cannot read manifest {url}/manifest.json: Not a
                // directory".
                Ok(m) if !m.is_dir() => Err(Error::invalid(format!(
                    "dataset {url} is not a regular file nor a directory (a FIFO, socket or device)"
                ))),
                Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Err(Error::io("cannot open dataset", &path, e)),
                _ => Ok(DatasetUrl::Local { dir: path, pick: Pick::All }),
            },
        }
    }
}

/// Expands `{000..099}` numeric ranges (zero-padded to the width of the first bound) and `{a,b}`
/// alternatives, left to right, in order. Every expansion must be a plain file name (no `/`, NUL,
/// `.` or `..`): a pattern can only pick shards inside the dataset's directory or prefix, never
/// step out of it. The expansion is bounded in names and in bytes before it is made.
pub fn expand_braces(pattern: &str) -> Result<Vec<String>> {
    let out = expand_unchecked(pattern)?;
    if let Some(bad) = out.iter().find(|n| n.is_empty() || *n == "." || *n == ".." || n.contains(['/', '\0'])) {
        return Err(Error::invalid(format!(
            "pattern {pattern} expands to {bad:?}, which is not a shard file name (a pattern may not leave its directory)"
        )));
    }
    Ok(out)
}

fn expand_unchecked(pattern: &str) -> Result<Vec<String>> {
    let too_big =
        || Error::invalid(format!("pattern {pattern} expands to more than {MAX_PATTERN_BYTES} bytes of names"));
    let mut out = vec![String::new()];
    // Total length of the names in `out`.
    let mut bytes = 0usize;
    let mut rest = pattern;
    while let Some(open) = rest.find('{') {
        let close = rest[open..]
            .find('}')
            .map(|c| open + c)
            .ok_or_else(|| Error::invalid(format!("unclosed '{{' in pattern {pattern}")))?;
        let literal = &rest[..open];
        let body = &rest[open + 1..close];
        if body.contains('{') {
            return Err(Error::invalid(format!("nested braces are not supported: {pattern}")));
        }
        let alternatives = brace_alternatives(body, pattern)?;
        let total = out.len().saturating_mul(alternatives.len());
        if total > MAX_PATTERN_NAMES {
            return Err(Error::invalid(format!("pattern {pattern} expands to more than {MAX_PATTERN_NAMES} names")));
        }
        // Each old name appears once per alternative, followed by the literal and that alternative.
        let alt_bytes: usize = alternatives.iter().map(String::len).fold(0, usize::saturating_add);
        bytes = bytes
            .saturating_mul(alternatives.len())
            .saturating_add(out.len().saturating_mul(literal.len().saturating_mul(alternatives.len())))
            .saturating_add(out.len().saturating_mul(alt_bytes));
        if bytes > MAX_PATTERN_BYTES {
            return Err(too_big());
        }
        let mut next = Vec::with_capacity(total);
        for prefix in &out {
            for alt in &alternatives {
                next.push(format!("{prefix}{literal}{alt}"));
            }
        }
        out = next;
        rest = &rest[close + 1..];
    }
    if rest.contains('}') {
        return Err(Error::invalid(format!("unmatched '}}' in pattern {pattern}")));
    }
    if bytes.saturating_add(out.len().saturating_mul(rest.len())) > MAX_PATTERN_BYTES {
        return Err(too_big());
    }
    for name in &mut out {
        name.push_str(rest);
    }
    Ok(out)
}

fn brace_alternatives(body: &str, pattern: &str) -> Result<Vec<String>> {
    if let Some((lo, hi)) = body.split_once("..") {
        let bad = || Error::invalid(format!("bad range {{{body}}} in pattern {pattern}"));
        let (a, b): (u64, u64) = (lo.parse().map_err(|_| bad())?, hi.parse().map_err(|_| bad())?);
        if a > b {
            return Err(Error::invalid(format!("empty range {{{body}}} in pattern {pattern}")));
        }
        // {0..18446744073709551615} has one name more than a u64 counts.
        let count = (b - a).saturating_add(1);
        if count > MAX_PATTERN_NAMES as u64 {
            return Err(Error::invalid(format!("pattern {pattern} expands to more than {MAX_PATTERN_NAMES} names")));
        }
        let width = lo.len().max(b.to_string().len());
        if count.saturating_mul(width as u64) > MAX_PATTERN_BYTES as u64 {
            return Err(Error::invalid(format!(
                "pattern {pattern} expands to more than {MAX_PATTERN_BYTES} bytes of names"
            )));
        }
        let width = lo.len();
        return Ok((a..=b).map(|i| format!("{i:0width$}")).collect());
    }
    if body.is_empty() {
        return Err(Error::invalid(format!("empty braces in pattern {pattern}")));
    }
    Ok(body.split(',').map(str::to_owned).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_paths_and_file_urls() {
        assert_eq!(
            DatasetUrl::parse("/data/x/").unwrap(),
            DatasetUrl::Local { dir: "/data/x/".into(), pick: Pick::All }
        );
        assert_eq!(
            DatasetUrl::parse("file:///data/x").unwrap(),
            DatasetUrl::Local { dir: "/data/x".into(), pick: Pick::All }
        );
        assert!(DatasetUrl::parse("file://rel/x").is_err());
        assert!(DatasetUrl::parse("gs://b/x").is_err());
        // webdataset's shell-command URLs were joined to the working directory: "not found".
        let e = DatasetUrl::parse("pipe:curl -s https://host/shard-000000.tar").unwrap_err().to_string();
        assert!(e.contains("pipe: URLs") && e.contains("s3://"), "{e}");
        // An existing shard file is a dataset of one; another file is refused by name; a
        // directory named like a shard is a directory.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("a.tar"), b"").unwrap();
        std::fs::write(tmp.path().join("notes.txt"), b"").unwrap();
        std::fs::create_dir(tmp.path().join("out.parquet")).unwrap();
        assert_eq!(
            DatasetUrl::parse(&tmp.path().join("a.tar").display().to_string()).unwrap(),
            DatasetUrl::Local { dir: tmp.path().into(), pick: Pick::Names(vec!["a.tar".into()]) }
        );
        let err = DatasetUrl::parse(&tmp.path().join("notes.txt").display().to_string()).unwrap_err();
        assert!(err.to_string().contains("notes.txt is a file"), "{err}");
        let spark = tmp.path().join("out.parquet");
        assert_eq!(
            DatasetUrl::parse(&spark.display().to_string()).unwrap(),
            DatasetUrl::Local { dir: spark, pick: Pick::All }
        );
    }

    #[test]
    fn parses_s3_prefixes_and_patterns() {
        let s3 = |bucket: &str, prefix: &str, names: Option<Vec<&str>>| DatasetUrl::S3 {
            bucket: bucket.into(),
            prefix: prefix.into(),
            pick: names.map_or(Pick::All, |n| Pick::Names(n.into_iter().map(String::from).collect())),
        };
        assert_eq!(DatasetUrl::parse("s3://b/laion/").unwrap(), s3("b", "laion/", None));
        assert_eq!(DatasetUrl::parse("s3://b/laion").unwrap(), s3("b", "laion/", None));
        assert_eq!(DatasetUrl::parse("s3://b").unwrap(), s3("b", "", None));
        assert_eq!(DatasetUrl::parse("s3://b/").unwrap(), s3("b", "", None));
        assert_eq!(
            DatasetUrl::parse("s3://b/a/c/t-{1..2}.tar").unwrap(),
            s3("b", "a/c/", Some(vec!["t-1.tar", "t-2.tar"]))
        );
        assert_eq!(DatasetUrl::parse("s3://b/a/").unwrap().base(), "s3://b/a/");
        // A shard's name is that object; with a '/' it is a prefix (Spark's `out.parquet/`).
        assert_eq!(DatasetUrl::parse("s3://b/a/x.parquet").unwrap(), s3("b", "a/", Some(vec!["x.parquet"])));
        assert_eq!(DatasetUrl::parse("s3://b/a/x.parquet/").unwrap(), s3("b", "a/x.parquet/", None));
        assert_eq!(DatasetUrl::parse("s3://b/t.tar").unwrap(), s3("b", "", Some(vec!["t.tar"])));
        for bad in ["s3://", "s3:///x", "s3://b/{a,b}/x.tar"] {
            assert!(DatasetUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn spellings_of_one_dataset_have_one_identity() {
        let id = |url: &str| DatasetUrl::parse(url).unwrap().identity();
        for same in ["/nonexistent/d/ds/", "/nonexistent//d/./ds", "/nonexistent/d/ds//", "file:///nonexistent/d/ds"] {
            assert_eq!(id(same), id("/nonexistent/d/ds"), "{same}");
        }
        assert_eq!(id("s3://b/train"), id("s3://b/train/"));
        // What a URL picks is part of what it names; a `..` may lead elsewhere through a symlink.
        let others = [
            "/nonexistent/d/ds",
            "/nonexistent/d/ds/../ds",
            "/nonexistent/d/ds/t-{1..2}.tar",
            "/nonexistent/d/ds/t-1.tar",
            "/nonexistent/d/ds/t-*.tar",
            "s3://b/train/",
            "s3://b/train/t-1.tar",
            "s3://c/train/",
        ];
        let ids: std::collections::HashSet<_> = others.iter().map(|u| id(u)).collect();
        assert_eq!(ids.len(), others.len(), "{ids:?}");
    }

    #[test]
    fn expands_brace_patterns() {
        let url = DatasetUrl::parse("/d/train-{000008..000011}.tar").unwrap();
        let DatasetUrl::Local { dir, pick: Pick::Names(names) } = url else { panic!("not local names") };
        assert_eq!(dir, PathBuf::from("/d"));
        assert_eq!(names, ["train-000008.tar", "train-000009.tar", "train-000010.tar", "train-000011.tar"]);
        assert_eq!(expand_braces("{a,b}-{1..2}.tar").unwrap(), ["a-1.tar", "a-2.tar", "b-1.tar", "b-2.tar"]);
    }

    #[test]
    fn a_glob_in_the_file_name_picks_from_its_directory() {
        let glob = |p: &str| Pick::Glob(pick::NameGlob::new(p).unwrap());
        assert_eq!(
            DatasetUrl::parse("/nonexistent/d/train-*.parquet").unwrap(),
            DatasetUrl::Local { dir: "/nonexistent/d".into(), pick: glob("train-*.parquet") }
        );
        assert_eq!(
            DatasetUrl::parse("s3://b/hub/data/{test,validation}-*.parquet").unwrap(),
            DatasetUrl::S3 {
                bucket: "b".into(),
                prefix: "hub/data/".into(),
                pick: glob("{test,validation}-*.parquet")
            }
        );
        for bad in ["/nonexistent/*/x.tar", "s3://b/*/x.tar", "s3://b?/x.tar", "/d/[a-.tar"] {
            assert!(DatasetUrl::parse(bad).is_err(), "{bad}");
        }
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("run[1]");
        std::fs::create_dir(&odd).unwrap();
        assert_eq!(
            DatasetUrl::parse(odd.to_str().unwrap()).unwrap(),
            DatasetUrl::Local { dir: odd.clone(), pick: Pick::All },
            "an existing directory whose name reads as a glob is that directory"
        );
    }

    #[test]
    fn rejects_bad_patterns() {
        for p in [
            "x-{1..",
            "x-{2..1}.tar",
            "x-{}.tar",
            "x-{a{b}}.tar",
            "x}.tar",
            "x-{1..99999999999}",
            "x-{0..18446744073709551615}.tar",
        ] {
            assert!(expand_braces(p).is_err(), "{p}");
        }
        assert!(DatasetUrl::parse("/d/{a,b}/x.tar").is_err());
    }

    /// A pattern whose expansions leave the dataset's directory or prefix (`..`, `.`, an empty
    /// name) is refused, whatever the allow list says.
    #[test]
    fn patterns_cannot_leave_their_directory() {
        for url in ["/d/{.,x}.", "/d/{.}.", "/d/{a,}", "/d/{.,x}", "s3://b/p/{.,x}.", "s3://b/p/{.}{.}"] {
            let e = DatasetUrl::parse(url).unwrap_err().to_string();
            assert!(e.contains("not a shard file name"), "{url}: {e}");
        }
        // `..` as an alternative reads as a (bad) range: refused as well.
        assert!(DatasetUrl::parse("/d/{..,a}").is_err());
        assert!(DatasetUrl::parse("/d/{a,b}..tar").is_ok(), "dots inside a name are fine");
    }

    /// Expansion is bounded in bytes before the names are made: each pattern here is short,
    /// within the name-count limit, and would expand to far more than MAX_PATTERN_BYTES.
    #[test]
    fn expansion_is_bounded_in_bytes() {
        let long = "x".repeat(4096);
        for p in [
            format!("{{0..9999999}}{long}"),
            format!("{{{long},{long}}}-{{0000000..0999999}}"),
            "{0000000000..0009999999}".to_owned(),
        ] {
            let e = expand_braces(&p).unwrap_err().to_string();
            assert!(e.contains("bytes of names"), "{e}");
        }
        assert_eq!(expand_braces("t-{0..2}").unwrap().len(), 3);
    }
}
