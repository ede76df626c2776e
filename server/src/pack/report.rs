//! Bad inputs and ignored files: what kinds there are, how each is described (always with its
//! path), and the one place that decides what happens to them: with `--strict` the first one
//! ends the pack with an error; otherwise it is reported, skipped and counted for the summary.
//!
//! A sample with a bad file is left out whole (a sample missing a field would break the readers
//! that expect it); the sample is named too, with how many of its other files go with it.
//!
//! Ignored files are not errors: hidden files and files without a field extension are not
//! samples by the WebDataset convention (the `webdataset` reader would skip them too), nor are
//! files a `--key-regex` does not match. They are counted and the first few are named.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::PackProgress;
use crate::{Error, Result};

/// What is wrong with an input. The order is the order of the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum BadKind {
    /// Exists but cannot be opened or read (permissions, I/O error).
    Unreadable,
    /// Listed or walked, but gone by the time it was opened.
    Vanished,
    /// A name that is not valid UTF-8 (a key must be text).
    NotUtf8,
    /// A symbolic link whose target lies outside SRC.
    SymlinkOutside,
    /// A `--files-from` entry with a `..` component, or an absolute path outside SRC.
    OutsideSrc,
    /// Not a regular file (directory behind a symlink, FIFO, socket, device).
    NotAFile,
    /// Two files giving the same key and field (or a `cls` file next to `--label-from-dir`).
    DuplicateKey,
    /// A key or field that cannot be stored so that it reads back the same (from `--key-regex`),
    /// or a sample without a class directory under `--label-from-dir`.
    BadKey,
    /// A payload the output format cannot hold (Parquet values are limited to 2 GiB).
    TooLarge,
    /// A directory inside SRC that holds a shardstream dataset (`_shardstream/`): an earlier
    /// pack's output, whose shards and manifest are not samples.
    Dataset,
}

impl BadKind {
    pub fn describe(self) -> &'static str {
        match self {
            BadKind::Unreadable => "unreadable",
            BadKind::Vanished => "vanished",
            BadKind::NotUtf8 => "name not UTF-8",
            BadKind::SymlinkOutside => "symlink outside SRC",
            BadKind::OutsideSrc => "path outside SRC",
            BadKind::NotAFile => "not a regular file",
            BadKind::DuplicateKey => "duplicate key",
            BadKind::BadKey => "unusable key",
            BadKind::TooLarge => "too large",
            BadKind::Dataset => "dataset inside SRC",
        }
    }
}

/// One bad input: its kind, its path (relative to SRC where there is one, lossily decoded when
/// it is not UTF-8) and what exactly went wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadInput {
    pub kind: BadKind,
    pub path: String,
    pub detail: String,
}

impl BadInput {
    pub fn new(kind: BadKind, path: impl Into<String>, detail: impl Into<String>) -> Self {
        Self { kind, path: path.into(), detail: detail.into() }
    }
}

impl std::fmt::Display for BadInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.path, self.kind.describe(), self.detail)
    }
}

/// Counts bad inputs by kind and applies `--strict`.
pub struct Reporter<'a> {
    strict: bool,
    progress: &'a dyn PackProgress,
    counts: Mutex<BTreeMap<BadKind, u64>>,
    ignored: Mutex<u64>,
    /// Samples left out for their bad inputs, and their other files (not packed either).
    left_out: Mutex<(u64, u64)>,
    /// The path of every bad input reported so far: those found before the files are grouped
    /// into samples (a FIFO, a name not UTF-8) leave their samples out whole there.
    bad_paths: Mutex<Vec<String>>,
}

impl<'a> Reporter<'a> {
    pub fn new(strict: bool, progress: &'a dyn PackProgress) -> Self {
        Self {
            strict,
            progress,
            counts: Mutex::default(),
            ignored: Mutex::default(),
            left_out: Mutex::default(),
            bad_paths: Mutex::default(),
        }
    }

    /// Reports a bad input: an error under `--strict`, else counted and passed to the progress
    /// display.
    pub fn bad(&self, bad: BadInput) -> Result<()> {
        if self.strict {
            return Err(Error::invalid(format!("bad input (--strict): {bad}")));
        }
        *self.counts.lock().unwrap_or_else(|p| p.into_inner()).entry(bad.kind).or_default() += 1;
        self.progress.bad_input(&bad);
        self.bad_paths.lock().unwrap_or_else(|p| p.into_inner()).push(bad.path);
        Ok(())
    }

    /// The paths of the bad inputs reported so far.
    pub fn bad_paths(&self) -> Vec<String> {
        self.bad_paths.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Notes a file that is not part of any sample by convention.
    pub fn ignored(&self, path: &str, why: &str) {
        *self.ignored.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.progress.ignored(path, why);
    }

    /// Notes a sample left out because some of its files are bad (each reported already): its
    /// `other_files`, readable or not yet tried, are not packed either, and would otherwise go
    /// unmentioned.
    pub fn left_out(&self, key: &str, other_files: u64) {
        let mut l = self.left_out.lock().unwrap_or_else(|p| p.into_inner());
        l.0 += 1;
        l.1 += other_files;
        drop(l);
        self.progress.sample_left_out(key, other_files);
    }

    /// Samples left out for bad inputs, and how many other files they took along.
    pub fn left_out_counts(&self) -> (u64, u64) {
        *self.left_out.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn counts(&self) -> BTreeMap<BadKind, u64> {
        self.counts.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn ignored_count(&self) -> u64 {
        *self.ignored.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_fails_and_lenient_counts() {
        let bad = BadInput::new(BadKind::Vanished, "a/b.jpg", "no such file");
        assert_eq!(bad.to_string(), "a/b.jpg: vanished: no such file");
        let strict = Reporter::new(true, &());
        let err = strict.bad(bad.clone()).unwrap_err().to_string();
        assert!(err.contains("a/b.jpg") && err.contains("--strict"), "{err}");
        let lenient = Reporter::new(false, &());
        lenient.bad(bad.clone()).unwrap();
        lenient.bad(bad).unwrap();
        lenient.ignored("README", "no extension");
        assert_eq!(lenient.counts().get(&BadKind::Vanished), Some(&2));
        assert_eq!(lenient.ignored_count(), 1);
    }
}
