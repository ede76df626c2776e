//! Hive-partitioned places: a directory (or S3 prefix) whose Parquet files sit in `key=value`
//! subdirectories (`year=2020/region=eu/part-0.parquet`), as pyarrow's `write_to_dataset`,
//! Spark's `partitionBy` and Hive write them. Such a place is one dataset: its shards are named
//! by their paths below it, and each key is a column whose value a file's directories give
//! ([`crate::format::parquet::partitions`] types and delivers them).
//!
//! A place is partitioned when it has no shard of its own and one of its subdirectories is named
//! `key=value` (one with shards of its own beside such a subdirectory is refused: which is meant
//! cannot be told); then every shard below it, at any depth, is the dataset's, and each must sit in
//! `key=value` directories only, with the same keys in the same order: anything else (a file
//! beside the partitions' directories, `year=2020/extra/`, `year=` then `month=` elsewhere) is
//! refused naming it, never left out. Directories and files whose name starts with `.` or `_`
//! (Spark's `_temporary/`, `_SUCCESS`) are left out, as pyarrow.dataset leaves them out. TAR
//! shards have no columns to carry a key: a partitioned place of them is refused.

use crate::format::Format;
use crate::storage::pick::is_hidden;
use crate::{Error, Result};

/// `(key, raw value)` of a `key=value` directory name; None for any other name (a place with a
/// subdirectory so named is read as partitioned: see the module docs). The value is as stored (percent-encoded by pyarrow and Spark; [`decode_value`] reads it).
pub fn key_value(segment: &str) -> Option<(&str, &str)> {
    let (key, value) = segment.split_once('=')?;
    (!key.is_empty() && !is_hidden(segment)).then_some((key, value))
}

/// Whether a path below the place is left out of it: one of its components is hidden.
pub fn hidden_path(path: &str) -> bool {
    path.split('/').any(is_hidden)
}

/// The keys a shard's directories give, in order, with their raw values; an error naming the
/// shard when a directory is not `key=value`.
pub fn keys_of<'a>(name: &'a str, place: &str) -> Result<Vec<(&'a str, &'a str)>> {
    let Some((dirs, _)) = name.rsplit_once('/') else {
        return Err(Error::invalid(format!(
            "{place}{name} lies beside the partitions (key=value directories) of the dataset {place}: \
             a partitioned dataset's files are all inside them, so move it (or name one partition's directory)"
        )));
    };
    dirs.split('/')
        .map(|d| {
            key_value(d).ok_or_else(|| {
                Error::invalid(format!(
                    "{place}{name} is in the directory {d:?}, which is not a partition (key=value): every file of \
                     the partitioned dataset {place} must be inside key=value directories only"
                ))
            })
        })
        .collect()
}

/// The error for a place with shards of its own beside partition directories (`part`, one of
/// them): served as they are, the partitions' files would be left out without a word; served
/// together, the files beside would have no value for the keys.
pub fn beside_partitions(place: &str, shard: &str, part: &str) -> Error {
    Error::invalid(format!(
        "{place} holds shards ({place}{shard}) beside partition directories ({place}{part}/): move them into a \
         partition, name the partitions' dataset without them, or pick the files beside with a glob \
         ({place}*{})",
        shard.rsplit_once('.').map_or(String::new(), |(_, ext)| format!(".{ext}"))
    ))
}

/// Each of `names`' `(key, raw value)` pairs, checked to be the same keys in the same order
/// throughout, each key once.
pub fn keys_of_all<'a>(names: &[&'a str], place: &str) -> Result<Vec<Vec<(&'a str, &'a str)>>> {
    let all = names.iter().map(|n| keys_of(n, place)).collect::<Result<Vec<_>>>()?;
    let keys = |pairs: &[(&'a str, &'a str)]| pairs.iter().map(|(k, _)| *k).collect::<Vec<_>>();
    let (Some(first), Some(want)) = (names.first(), all.first().map(|p| keys(p))) else { return Ok(all) };
    if let Some((i, k)) = want.iter().enumerate().find(|(i, k)| want[..*i].contains(k)) {
        return Err(Error::invalid(format!(
            "{place}{first} names the partition key {k:?} twice (directory {} of its path): a key is one column",
            i + 1
        )));
    }
    if let Some((n, other)) = names.iter().zip(&all).map(|(n, p)| (n, keys(p))).find(|(_, k)| *k != want) {
        return Err(Error::invalid(format!(
            "{place} has files partitioned by different keys: {place}{first} by {} but {place}{n} by {}; \
             every file of a partitioned dataset must have the same key=value directories",
            want.join("/"),
            other.join("/")
        )));
    }
    Ok(all)
}

/// The shards of a partitioned place among `nested` (names below it with at least one directory,
/// hidden paths left out, sorted): each checked to sit in partitions with the keys of the first.
pub fn partitioned<T>(nested: Vec<T>, name: impl Fn(&T) -> &str, place: &str) -> Result<Vec<T>> {
    let names: Vec<&str> = nested.iter().map(&name).collect();
    if let Some(n) = names.iter().find(|n| Format::of_file(n) == Some(Format::WebDataset)) {
        return Err(Error::invalid(format!(
            "{place} is partitioned (key=value directories), which is served for Parquet files, whose keys \
             become columns; {place}{n} is a TAR shard: name one partition's directory instead"
        )));
    }
    keys_of_all(&names, place)?;
    Ok(nested)
}

/// How a directory names a null partition value (Hive's, as pyarrow and Spark write it).
pub const HIVE_NULL: &str = "__HIVE_DEFAULT_PARTITION__";

/// A partition value as written: `%XX` escapes decoded (pyarrow and Spark escape `/`, `=`, `%`
/// and more), the text kept when an escape is malformed or decodes to no UTF-8, as pyarrow keeps
/// it; None for Hive's null, `__HIVE_DEFAULT_PARTITION__`.
pub fn decode_value(raw: &str) -> Option<String> {
    if raw == HIVE_NULL {
        return None;
    }
    if !raw.contains('%') {
        return Some(raw.to_owned());
    }
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1).copied().and_then(hex), bytes.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    Some(String::from_utf8(out).unwrap_or_else(|_| raw.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_named_key_value_are_partitions() {
        assert_eq!(key_value("year=2020"), Some(("year", "2020")));
        assert_eq!(key_value("s=a=b"), Some(("s", "a=b")));
        assert_eq!(key_value("s="), Some(("s", "")));
        for not in ["=2020", "year", "_year=1", ".k=v"] {
            assert_eq!(key_value(not), None, "{not}");
        }
        assert!(hidden_path("_temporary/0/part-0.parquet") && hidden_path("year=1/.x.parquet"));
        assert!(!hidden_path("year=1/part-0.parquet"));
    }

    #[test]
    fn every_file_has_the_keys_of_the_first_or_is_named() {
        let ok = vec!["year=2020/r=a/p.parquet", "year=2021/r=b/q.parquet"];
        assert_eq!(partitioned(ok.clone(), |n| n, "/d/").unwrap(), ok);
        let cases: [(&[&str], &str); 4] = [
            (&["year=2020/p.parquet", "month=1/p.parquet"], "by year but /d/month=1/p.parquet by month"),
            (&["year=2020/p.parquet", "year=2020/extra/p.parquet"], "\"extra\", which is not a partition"),
            (&["year=2020/p.parquet", "p.parquet"], "beside the partitions"),
            (&["year=2020/p.tar"], "is a TAR shard"),
        ];
        for (names, want) in cases {
            let e = partitioned(names.to_vec(), |n| n, "/d/").unwrap_err().to_string();
            assert!(e.contains(want), "{names:?}: {e}");
        }
    }

    #[test]
    fn values_are_unescaped_as_pyarrow_writes_them() {
        assert_eq!(decode_value("us%2Feast").as_deref(), Some("us/east"));
        assert_eq!(decode_value("eu%20west").as_deref(), Some("eu west"));
        assert_eq!(decode_value("na%C3%AFve").as_deref(), Some("naïve"));
        assert_eq!(decode_value("100%").as_deref(), Some("100%"));
        assert_eq!(decode_value("%ZZ").as_deref(), Some("%ZZ"));
        assert_eq!(decode_value("%FF").as_deref(), Some("%FF"));
        assert_eq!(decode_value("__HIVE_DEFAULT_PARTITION__"), None);
    }
}
