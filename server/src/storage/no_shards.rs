//! The error for a dataset place (a directory, an S3 prefix) that holds no shard of its own,
//! saying what it holds instead: subdirectories with shards (a directory per split; `key=value`
//! partitions are a dataset of their own, [`super::partitions`]), shards compressed whole, or
//! Parquet files under another extension. "Holds none" alone sends the user looking for a wrong
//! path. And the error for a place holding those files beside its shards, which would otherwise
//! be served as part of the dataset without a word.

use crate::Error;

/// Files that look like shards but are not served, counted by extension while a place is listed,
/// for the error when it holds no shard: shards compressed whole, which webdataset reads but the
/// daemon cannot serve (it reads members in place), and Parquet files named otherwise (pyarrow
/// writes whatever name it is given; the listing goes by the `.parquet` extension).
#[derive(Debug, Default)]
pub struct Unserved {
    compressed: std::collections::BTreeMap<&'static str, usize>,
    /// The first few of them by name.
    compressed_names: std::collections::BTreeSet<String>,
    parquet_named_otherwise: usize,
    /// The first few of them by name.
    parquet_names: std::collections::BTreeSet<String>,
    /// Files whose name has no extension at all (Hive's `000000_0`, Hadoop's `part-00000`):
    /// how many, and the first few by name.
    no_extension: (usize, std::collections::BTreeSet<String>),
}

impl Unserved {
    const EXTENSIONS: [&'static str; 6] = [".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz", ".tar.lz4"];
    const PARQUET_OTHERWISE: [&'static str; 2] = [".pq", ".parq"];

    pub fn note(&mut self, name: &str) {
        let ends = |e: &str| crate::format::ends_with_ignoring_case(name, e);
        if let Some(ext) = Self::EXTENSIONS.iter().find(|e| ends(e)) {
            *self.compressed.entry(ext).or_default() += 1;
            first_few(&mut self.compressed_names, name);
        } else if Self::PARQUET_OTHERWISE.iter().any(|e| ends(e)) {
            self.parquet_named_otherwise += 1;
            first_few(&mut self.parquet_names, name);
        } else if !name.contains('.') && !super::pick::is_hidden(name) {
            let (count, first) = &mut self.no_extension;
            *count += 1;
            first_few(first, name);
        }
    }

    /// The error for a place (`place` ends with '/') whose whole listing found shards and, beside
    /// them, shards compressed whole or Parquet files named otherwise: serving the shards alone
    /// would be part of the dataset, without a word. None when it holds none of those.
    pub fn beside_shards(&self, place: &str) -> Option<Error> {
        let n: usize = self.compressed.values().sum();
        if n > 0 {
            let exts: Vec<&str> = self.compressed.keys().copied().collect();
            let (files, names) = (files(n), shown(&self.compressed_names, n));
            return Some(Error::invalid(format!(
                "{place} holds {files} ending in {} ({names}) beside the shards it serves: shards \
                 compressed whole are not served (members are read in place), and serving the others \
                 alone would be part of the dataset; store them uncompressed (e.g. gunzip, zstd -d), or \
                 pick the uncompressed ones with a glob (e.g. {place}*.tar)",
                exts.join(" or "),
            )));
        }
        let n = self.parquet_named_otherwise;
        (n > 0).then(|| {
            let (files, names) = (files(n), shown(&self.parquet_names, n));
            Error::invalid(format!(
                "{place} holds {files} ending in .pq or .parq ({names}) beside the shards it serves: \
                 Parquet shards are found by their name, *.parquet, and serving the others alone would \
                 be part of the dataset; rename them, or pick the others with a glob (e.g. \
                 {place}*.parquet)"
            ))
        })
    }

    /// True when the place holds nothing of what [`Unserved::note`] counts.
    fn is_empty(&self) -> bool {
        self.compressed.is_empty() && self.parquet_named_otherwise == 0 && self.no_extension.0 == 0
    }

    /// The most common extension and its count.
    fn most(&self) -> Option<(&'static str, usize)> {
        self.compressed.iter().max_by_key(|(_, n)| **n).map(|(e, n)| (*e, *n))
    }
}

/// How many names an error shows of a kind.
const SHOWN: usize = 4;

/// Keeps `name` in `first` if it is among the first [`SHOWN`] by name.
fn first_few(first: &mut std::collections::BTreeSet<String>, name: &str) {
    first.insert(name.to_owned());
    if first.len() > SHOWN {
        first.pop_last();
    }
}

/// The names kept of `n` files, and "..." when there are more.
fn shown(first: &std::collections::BTreeSet<String>, n: usize) -> String {
    let names: Vec<&str> = first.iter().map(String::as_str).collect();
    let more = if n > names.len() { ", ..." } else { "" };
    format!("{}{more}", names.join(", "))
}

/// "1 file", "3 files".
fn files(n: usize) -> String {
    if n == 1 { "1 file".to_owned() } else { format!("{n} files") }
}

/// The error for a dataset place (a directory, an S3 prefix) with no shard of its own. `nested`:
/// its subdirectories (sorted) whose own entries include shards, as a directory per split has
/// them; a dataset is the shards of the one place named, so the user is told which places to name
/// instead of "none". `unserved`: what it holds of shards compressed whole and of Parquet files
/// named otherwise.
pub fn no_shards(what: &'static str, place: String, holder: &str, nested: &[String], unserved: &Unserved) -> Error {
    let mut path = format!("{place} (the {holder} holds none");
    if let Some((ext, n)) = unserved.most() {
        let files = files(n);
        path.push_str(&format!(
            "; it holds {files} ending in {ext}: shards compressed whole are not served (members are \
             read in place), so store them uncompressed (e.g. gunzip, zstd -d)"
        ));
    }
    if unserved.parquet_named_otherwise > 0 {
        let n = unserved.parquet_named_otherwise;
        let files = files(n);
        path.push_str(&format!(
            "; it holds {files} ending in .pq or .parq: Parquet shards are found by their name, \
             *.parquet, so rename them"
        ));
    }
    if let (n @ 1.., first) = &unserved.no_extension {
        let (files, names) = (files(*n), shown(first, *n));
        path.push_str(&format!(
            "; it holds {files} without an extension ({names}), as Hive and Hadoop jobs name theirs: shards \
             are found by their extension, *.tar or *.parquet, so rename them"
        ));
    }
    if !nested.is_empty() {
        let names: Vec<String> = nested.iter().take(SHOWN).map(|n| format!("{n}/")).collect();
        let more = match nested.len().saturating_sub(SHOWN) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        path.push_str(&format!(
            "; its subdirectories {}{more} do: a dataset is the shards of the one place named, so \
             name one of those",
            names.join(", ")
        ));
    }
    if unserved.is_empty() && nested.is_empty() {
        // Loose samples (a folder of images, a directory per class) are what most users arrive with.
        path.push_str(
            "; a dataset is shards, WebDataset *.tar or *.parquet files: `shardstream pack DIR --output DEST` \
             makes them of a tree of loose files",
        );
    }
    path.push(')');
    Error::NotFound { what, path }
}
