//! Which of a directory's (or S3 prefix's) shards a dataset URL picks: all of them, the names a
//! brace pattern expands to (each must exist), or those a glob in the file name matches
//! (`train-*.parquet`, as Hugging Face's `data_files` are written); and the check that "all of
//! them" is not several splits of a dataset side by side.
//!
//! The split check follows the file-name convention Hugging Face `datasets` uses to find splits
//! (`train-00000-of-00002.parquet`, `imagenet-val-000001.tar`): a split's word (train/training,
//! validation/valid/val/dev, test/testing/eval/evaluation) as a whole word of the name, between
//! separators or digits. A directory whose shards name two splits or more is refused: served
//! whole, an epoch would mix test rows into training. The error names each split with an example
//! and the glob that picks one; `*.tar` or `*.parquet` picks all of them on purpose.

use crate::{Error, Result};

/// The shards of a directory or prefix that a URL picks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pick {
    /// Every shard the listing finds (or the manifest lists).
    All,
    /// Exactly these names, in this order; each must exist.
    Names(Vec<String>),
    /// The shards whose names match.
    Glob(NameGlob),
    /// Every shard the listing finds, of whatever splits: what `shardstream index` describes.
    /// Never made from a URL: the manifest it writes is the listing of every later open, which
    /// applies its own pick (the split check of [`Pick::All`] included).
    Every,
}

impl Pick {
    /// The pick a URL's last component makes: `None` for a plain name (a directory, or an S3
    /// prefix), a glob when it has `*`, `?` or `[` (its braces expanded into alternatives first),
    /// else the names its braces expand to.
    pub fn parse(file_name: &str) -> Result<Option<Pick>> {
        if file_name.contains(['*', '?', '[']) {
            return NameGlob::new(file_name).map(|g| Some(Pick::Glob(g)));
        }
        if file_name.contains('{') {
            return super::expand_braces(file_name).map(|n| Some(Pick::Names(n)));
        }
        Ok(None)
    }

    /// Keeps the listed shards this pick takes (`name` gives each one's name): refuses, for
    /// [`Pick::All`], shards of several splits, and for [`Pick::Glob`], no match at all. `place`:
    /// the directory or prefix as errors name it, ending with `/`. [`Pick::Names`] keeps
    /// everything: its names are looked up, not filtered from a listing. [`Pick::Every`] leaves
    /// hidden names out as [`Pick::All`] does, and keeps every split.
    pub fn keep_listed<T>(&self, mut listed: Vec<T>, name: impl Fn(&T) -> &str, place: &str) -> Result<Vec<T>> {
        match self {
            Pick::All | Pick::Every => {
                let hidden = listed.iter().filter(|t| is_hidden(name(t))).count();
                if hidden > 0 && hidden == listed.len() {
                    let shown: Vec<&str> = listed.iter().take(3).map(&name).collect();
                    let more = if hidden > shown.len() { ", ..." } else { "" };
                    return Err(Error::NotFound {
                        what: "shards",
                        path: format!(
                            "{place} (the only shards there, {}{more}, start with '.' or '_': a listing leaves \
                             those out, as pyarrow.dataset and Spark do (macOS' ._ copies, temporary and job \
                             files); name them in the URL to read them)",
                            shown.join(", ")
                        ),
                    });
                }
                if hidden > 0 {
                    listed.retain(|t| !is_hidden(name(t)));
                    tracing::debug!(place, left_out = hidden, "hidden shard names left out of the listing");
                }
                if *self == Pick::All {
                    // A partitioned dataset's `split=train/` is a column the trainer sees, not a
                    // mix it cannot tell apart: only file names count.
                    check_one_split(listed.iter().map(|t| file_name(name(t))), place)?
                }
            }
            Pick::Glob(g) => {
                listed.retain(|t| g.matches(name(t)));
                if listed.is_empty() {
                    return Err(Error::NotFound {
                        what: "shards matching the pattern",
                        path: format!("{place}{} (no *.tar or *.parquet file matches)", g.pattern()),
                    });
                }
            }
            Pick::Names(_) => {}
        }
        Ok(listed)
    }
}

/// The file name of a shard's path below its place (a partitioned dataset's shard has
/// directories).
pub fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

/// Whether a directory listing leaves `name` out: names starting with `.` (hidden: macOS'
/// AppleDouble `._shard.tar` copied beside each shard, an upload in progress) or `_` (a job's
/// `_temporary` and `_SUCCESS`), as pyarrow.dataset, Spark and Hadoop do. A glob leaves out the
/// first by its own rule; named shards are read whatever their names.
pub fn is_hidden(name: &str) -> bool {
    name.starts_with('.') || name.starts_with('_')
}

/// A glob over shard file names: `*` any run of characters, `?` one, `[abc]`/`[a-z]`/`[!a]` a
/// class; `{a,b}` alternatives and `{0..9}` ranges as in brace patterns. A leading dot must be
/// matched literally (hidden and temporary files are never picked by `*`).
#[derive(Debug, Clone)]
pub struct NameGlob {
    pattern: String,
    alternatives: Vec<glob::Pattern>,
}

impl PartialEq for NameGlob {
    fn eq(&self, other: &Self) -> bool {
        self.pattern == other.pattern
    }
}

impl Eq for NameGlob {}

const MATCH: glob::MatchOptions =
    glob::MatchOptions { case_sensitive: true, require_literal_separator: true, require_literal_leading_dot: true };

impl NameGlob {
    pub fn new(pattern: &str) -> Result<Self> {
        let expanded = if pattern.contains('{') { super::expand_braces(pattern)? } else { vec![pattern.to_owned()] };
        let alternatives = expanded
            .iter()
            .map(|p| glob::Pattern::new(p).map_err(|e| Error::invalid(format!("bad pattern {pattern}: {e}"))))
            .collect::<Result<_>>()?;
        Ok(Self { pattern: pattern.to_owned(), alternatives })
    }

    pub fn pattern(&self) -> &str {
        &self.pattern
    }

    /// Whether `name` matches, or is the pattern itself: a file named `run[1].parquet` is found
    /// by its own name, which as a glob would match only `run1.parquet` (there is no escape to
    /// write it otherwise).
    pub fn matches(&self, name: &str) -> bool {
        name == self.pattern || self.alternatives.iter().any(|p| p.matches_with(name, MATCH))
    }

    /// The text every match begins with: an S3 listing need not look before it.
    pub fn literal_prefix(&self) -> &str {
        let end = self.pattern.find(['*', '?', '[', '{']).unwrap_or(self.pattern.len());
        &self.pattern[..end]
    }
}

/// The splits, by the words Hugging Face `datasets` reads as each one's name.
const SPLITS: [(&str, &[&str]); 3] = [
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "val", "dev"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// The split a shard's name names, and where its word ends: the first whole word (letters
/// between anything else) that is a split's.
fn split_of(name: &str) -> Option<(&'static str, usize)> {
    let stem = name.rsplit_once('.').map_or(name, |(stem, _)| stem);
    let mut start = None;
    for (i, c) in stem.char_indices().chain([(stem.len(), ' ')]) {
        match (c.is_ascii_alphabetic(), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                // Without allocating: a manifest of millions of shards is checked at every open.
                let word = &stem[s..i];
                if let Some((split, _)) =
                    SPLITS.iter().find(|(_, words)| words.iter().any(|w| w.eq_ignore_ascii_case(word)))
                {
                    return Some((split, i));
                }
                start = None;
            }
            _ => {}
        }
    }
    None
}

/// Refuses shard names of two splits or more (see the module docs). `place`: the directory or
/// prefix as the error names it, ending with `/`.
pub fn check_one_split<'a>(names: impl Iterator<Item = &'a str>, place: &str) -> Result<()> {
    let mut found: Vec<(&'static str, usize, &'a str, usize)> = Vec::new();
    for name in names {
        let Some((split, end)) = split_of(name) else { continue };
        match found.iter_mut().find(|f| f.0 == split) {
            Some(f) => f.1 += 1,
            None => found.push((split, 1, name, end)),
        }
    }
    if found.len() < 2 {
        return Ok(());
    }
    // In the order of SPLITS: the example pattern picks the training split when there is one.
    found.sort_by_key(|f| SPLITS.iter().position(|(split, _)| *split == f.0));
    let each: Vec<String> = found
        .iter()
        .map(|(split, n, example, _)| {
            let files = if *n == 1 { "file" } else { "files" };
            format!("{split}: {n} {files}, e.g. {example}")
        })
        .collect();
    let (_, _, example, end) = found[0];
    let ext = example.rsplit_once('.').map_or("", |(_, e)| e);
    // The separator after the split's word stays in the pattern: `train-*`, not `train*`.
    let end = end + example[end..].chars().next().filter(|c| matches!(c, '-' | '_')).map_or(0, char::len_utf8);
    Err(Error::invalid(format!(
        "{place} holds the shards of several splits ({}); served as one dataset an epoch would mix \
         them. Name one split's files, e.g. {place}{}*.{ext} (or {place}*.{ext} for all of them)",
        each.join("; "),
        &example[..end],
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_is_a_whole_word_of_the_name() {
        assert_eq!(split_of("train-00000-of-00002.parquet").map(|s| s.0), Some("train"));
        assert_eq!(split_of("imagenet-val-000001.tar"), Some(("validation", 12)));
        assert_eq!(split_of("shard_test3.tar").map(|s| s.0), Some("test"));
        assert_eq!(split_of("Validation.parquet").map(|s| s.0), Some("validation"));
        for none in ["pretrained-000.tar", "contest-0.tar", "latest.parquet", "trainer.tar", "part-0.parquet"] {
            assert_eq!(split_of(none), None, "{none}");
        }
    }

    #[test]
    fn one_split_passes_and_two_are_refused_with_a_pattern_for_one() {
        assert!(check_one_split(["train-0.tar", "train-1.tar", "extra-0.tar"].into_iter(), "/d/").is_ok());
        let e = check_one_split(["a-train-0.tar", "a-train-1.tar", "a-val-0.tar"].into_iter(), "/d/").unwrap_err();
        let e = e.to_string();
        assert!(e.contains("train: 2 files, e.g. a-train-0.tar; validation: 1 file, e.g. a-val-0.tar"), "{e}");
        assert!(e.contains("e.g. /d/a-train-*.tar (or /d/*.tar for all of them)"), "{e}");
        let e = check_one_split(["test-0.parquet", "train-0.parquet"].into_iter(), "s3://b/").unwrap_err();
        assert!(e.to_string().contains("e.g. s3://b/train-*.parquet"), "the training split first: {e}");
    }

    #[test]
    fn every_keeps_all_splits_and_leaves_hidden_names_out() {
        let listed = vec!["._test-0.parquet", "test-0.parquet", "train-0.parquet", "train-1.parquet"];
        assert!(Pick::All.keep_listed(listed.clone(), |n| n, "/d/").is_err());
        let kept = Pick::Every.keep_listed(listed, |n| n, "/d/").unwrap();
        assert_eq!(kept, ["test-0.parquet", "train-0.parquet", "train-1.parquet"]);
    }

    #[test]
    fn a_listing_leaves_hidden_names_out_unless_they_are_all_there_is() {
        let listed = vec!["._a.parquet", "_tmp.parquet", "a.parquet", "b.parquet"];
        assert_eq!(Pick::All.keep_listed(listed.clone(), |n| n, "/d/").unwrap(), ["a.parquet", "b.parquet"]);
        let e = Pick::All.keep_listed(vec!["._a.parquet", "_b.parquet"], |n| n, "/d/").unwrap_err().to_string();
        assert!(e.contains("._a.parquet, _b.parquet") && e.contains("name them"), "{e}");
        // A glob says for itself: `*` never matches a leading dot, but does match a `_`.
        let g = Pick::Glob(NameGlob::new("*.parquet").unwrap());
        assert_eq!(g.keep_listed(listed, |n| n, "/d/").unwrap(), ["_tmp.parquet", "a.parquet", "b.parquet"]);
    }

    #[test]
    fn globs_match_names_and_know_their_literal_prefix() {
        let g = NameGlob::new("train-*-of-0000?.parquet").unwrap();
        assert!(g.matches("train-00001-of-00002.parquet"));
        assert!(!g.matches("test-00000-of-00001.parquet"));
        assert_eq!(g.literal_prefix(), "train-");
        let g = NameGlob::new("{test,validation}-*.parquet").unwrap();
        assert!(g.matches("test-0.parquet") && g.matches("validation-0.parquet") && !g.matches("train-0.parquet"));
        assert_eq!(g.literal_prefix(), "");
        assert!(!NameGlob::new("*.tar").unwrap().matches(".hidden.tar"));
        assert!(NameGlob::new("[a-.tar").is_err());
        assert_eq!(Pick::parse("plain").unwrap(), None);
        assert!(matches!(Pick::parse("t-{1..2}.tar").unwrap(), Some(Pick::Names(n)) if n.len() == 2));
    }
}
