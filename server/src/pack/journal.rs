//! The pack journal (`_shardstream/pack-journal.jsonl` in DEST): what a pack has made durable so
//! far, so that `--resume` skips it, and whose dataset DEST holds. For S3 output the journal is
//! kept in a local state directory while packing and uploaded next to the shards as they become
//! durable (see [`super::dest`]). A journal without the manifest beside it is a pack running or
//! interrupted, which a reader refuses ([`unfinished`]).
//!
//! JSON lines, appended and fsynced one per completed shard, after the shard and its sidecar are
//! durable:
//!
//! ```text
//! {"journal":"shardstream-pack","version":1,"fingerprint":"9c0f...","created_by":"shardstream 0.1.0"}
//! {"shard":0,"name":"shard-000000.tar","first":0,"end":51234,"bytes":...,"samples":51230,...}
//! {"shard":1,...}
//! ```
//!
//! The fingerprint is a hash of everything that decides the output bytes: this build, the
//! options that shape shards, and the packing order of (key, field, path, class). A pack whose
//! fingerprint differs from the journal's is a different dataset and is refused; one that matches
//! may resume. Entries must be consecutive from shard 0, each starting where the previous ended; a
//! torn last line (a crash mid-append) and anything after a broken entry are ignored, which only
//! means re-packing a shard.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::group::Catalog;
use crate::stable_hash::Fnv1a;
use crate::{Error, Result};

pub const JOURNAL_FILE: &str = "pack-journal.jsonl";
const JOURNAL_MAGIC: &str = "shardstream-pack";
const JOURNAL_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    journal: String,
    version: u32,
    fingerprint: String,
    created_by: String,
}

/// One completed shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRecord {
    pub shard: u64,
    pub name: String,
    /// Positions `first..end` of the packing order.
    pub first: u64,
    pub end: u64,
    pub bytes: u64,
    pub samples: u64,
    pub files: u64,
    pub payload: u64,
    pub crc32c: String,
    pub fields: Vec<String>,
    pub bad_inputs: u64,
    /// The shard's largest sample: (index, bytes), for the manifest. Absent in journals written
    /// before it was recorded, and for Parquet shards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub largest: Option<(u64, u64)>,
}

/// A journal read back: its fingerprint and its valid prefix of shard records.
#[derive(Debug)]
pub struct PriorJournal {
    pub fingerprint: String,
    pub shards: Vec<ShardRecord>,
}

/// A stable 64-bit hash of `bytes` as one framed field, e.g. to name a directory after a
/// destination (persisted: see the golden test).
pub fn stable_hash(bytes: &[u8]) -> u64 {
    Fnv1a::new().field(bytes).finish()
}

/// The dataset fingerprint: `options` (a canonical description of the shaping options) and the
/// packing order. Two independent 64-bit hashes (forward and with a salt) make 128 bits.
pub fn fingerprint(options: &str, catalog: &Catalog, order: &[u32]) -> String {
    fingerprint_for(crate::VERSION, options, catalog, order)
}

/// [`fingerprint`] as made by release `version` (which is part of it: a new release never
/// resumes an older one's pack).
fn fingerprint_for(version: &str, options: &str, catalog: &Catalog, order: &[u32]) -> String {
    let mut a = Fnv1a::new();
    let mut b = Fnv1a::with_basis(crate::stable_hash::OFFSET ^ 0x5bd1_e995_5bd1_e995);
    let mut feed = |x: &[u8]| {
        // Framed fields, so ("ab","c") and ("a","bc") differ.
        a.field(x);
        b.field(x).rotate(17);
    };
    feed(version.as_bytes());
    feed(options.as_bytes());
    for &i in order {
        let Some(s) = catalog.sample(i as usize) else { continue };
        feed(s.key().as_bytes());
        for m in s.members() {
            feed(m.field.as_bytes());
            feed(m.path.as_bytes());
        }
        match s.class() {
            Some(c) => feed(&c.to_le_bytes()),
            None => feed(b"-"),
        }
    }
    format!("{:016x}{:016x}", a.finish(), b.finish())
}

pub fn journal_path(dest: &Path) -> PathBuf {
    dest.join(crate::index::manifest::SIDECAR_DIR).join(JOURNAL_FILE)
}

/// The refusal of a dataset place (ending with `/`) that holds a pack's `journal` (a path or URL)
/// and no manifest. `pack` writes the manifest last, so the shards there are only part of its
/// dataset: a listing or a glob would serve them as the whole. Named shards are each there whole
/// or not found by name, so naming them is how to serve them knowingly: `shards`, the shard names
/// the listing found there, give the pattern to name them by (a local pack keeps its shards in
/// staging until it publishes them with its manifest, so there are usually none).
pub fn unfinished(place: &str, journal: &str, shards: &[&str]) -> Error {
    let serve = match shards {
        [] => format!(" None of its shards is at {place} yet."),
        [one] => format!(" To serve the one shard there so far knowingly, name it ({place}{one})."),
        _ => match brace_pattern(shards) {
            Some(pattern) => {
                format!(" To serve the {} shards there so far knowingly, name them ({place}{pattern}).", shards.len())
            }
            None => format!(
                " To serve the {} shards there so far knowingly, name them in a brace pattern ({place}{}, ...).",
                shards.len(),
                shards[0]
            ),
        },
    };
    Error::invalid(format!(
        "{place} is an unfinished `shardstream pack` ({journal} is there, its manifest.json is not yet): \
         wait for the pack to finish, or finish it with `shardstream pack ... --resume`.{serve}"
    ))
}

/// The brace pattern naming exactly `names` (`train-{000000..000011}.tar`) when they are one
/// numbered run: a stem, consecutive numbers of one width, an extension. None otherwise.
fn brace_pattern(names: &[&str]) -> Option<String> {
    let split = |name: &'_ str| -> Option<(String, String, String)> {
        let (base, ext) = name.rsplit_once('.')?;
        let digits = base.len() - base.trim_end_matches(|c: char| c.is_ascii_digit()).len();
        (digits > 0).then(|| {
            let (stem, number) = base.split_at(base.len() - digits);
            (stem.to_owned(), number.to_owned(), ext.to_owned())
        })
    };
    let mut parts = names.iter().map(|n| split(n)).collect::<Option<Vec<_>>>()?;
    parts.sort_by(|a, b| a.1.cmp(&b.1));
    let (stem, first, ext) = parts.first()?.clone();
    let same = parts.iter().all(|(s, n, e)| *s == stem && n.len() == first.len() && *e == ext);
    let numbers = parts.iter().map(|(_, n, _)| n.parse::<u64>().ok()).collect::<Option<Vec<_>>>()?;
    let consecutive = numbers.windows(2).all(|w| w[0].checked_add(1) == Some(w[1]));
    let last = &parts.last()?.1;
    (same && consecutive).then(|| format!("{stem}{{{first}..{last}}}.{ext}"))
}

/// Reads a journal; `Ok(None)` when there is none.
pub fn load(path: &Path) -> Result<Option<PriorJournal>> {
    match std::fs::read(path) {
        Ok(text) => parse(&text, &path.display().to_string()).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("cannot read pack journal", path, e)),
    }
}

/// Parses the bytes of a journal read from `origin` (a path or URL, for errors).
pub fn parse(text: &[u8], origin: &str) -> Result<PriorJournal> {
    let mut lines = text.split(|&b| b == b'\n');
    let header: Header = lines
        .next()
        .and_then(|l| serde_json::from_slice(l).ok())
        .ok_or_else(|| Error::invalid(format!("{origin} is not a shardstream pack journal")))?;
    if header.journal != JOURNAL_MAGIC || header.version != JOURNAL_VERSION {
        return Err(Error::invalid(format!(
            "{origin}: journal {:?} version {} is not one this build reads ({JOURNAL_MAGIC:?} version {JOURNAL_VERSION})",
            header.journal, header.version
        )));
    }
    let mut shards: Vec<ShardRecord> = Vec::new();
    for line in lines {
        let Ok(rec) = serde_json::from_slice::<ShardRecord>(line) else { break };
        let expected_first = shards.last().map_or(0, |p| p.end);
        if rec.shard != shards.len() as u64 || rec.first != expected_first || rec.end < rec.first {
            break;
        }
        shards.push(rec);
    }
    Ok(PriorJournal { fingerprint: header.fingerprint, shards })
}

/// A journal open for appending.
pub struct Journal {
    file: File,
    path: PathBuf,
}

impl Journal {
    /// Starts a journal holding `fingerprint` and the shards kept from an earlier run, replacing
    /// any journal at `path` atomically.
    pub fn create(path: &Path, fingerprint: &str, kept: &[ShardRecord]) -> Result<Self> {
        let header = Header {
            journal: JOURNAL_MAGIC.into(),
            version: JOURNAL_VERSION,
            fingerprint: fingerprint.into(),
            created_by: format!("shardstream {}", crate::VERSION),
        };
        let mut text = serde_json::to_vec(&header).map_err(|e| Error::Internal(e.to_string()))?;
        text.push(b'\n');
        for r in kept {
            text.extend(serde_json::to_vec(r).map_err(|e| Error::Internal(e.to_string()))?);
            text.push(b'\n');
        }
        crate::storage::local::write_atomic(path, &text)?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| Error::io("cannot open pack journal", path, e))?;
        Ok(Self { file, path: path.to_owned() })
    }

    /// Appends a shard record durably.
    pub fn append(&mut self, rec: &ShardRecord) -> Result<()> {
        let mut line = serde_json::to_vec(rec).map_err(|e| Error::Internal(e.to_string()))?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.sync_data())
            .map_err(|e| Error::io("cannot write pack journal", &self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::group::GroupOptions;
    use crate::pack::report::Reporter;

    #[test]
    fn a_brace_pattern_names_one_numbered_run_or_nothing() {
        assert_eq!(brace_pattern(&["a-000003.tar", "a-000002.tar"]).as_deref(), Some("a-{000002..000003}.tar"));
        assert_eq!(brace_pattern(&["x9.parquet", "x10.parquet"]), None, "numbers of two widths");
        assert_eq!(brace_pattern(&["a-01.tar", "a-03.tar"]), None, "a gap");
        assert_eq!(brace_pattern(&["a-01.tar", "b-02.tar"]), None, "two stems");
        assert_eq!(brace_pattern(&["a-01.tar", "a-02.parquet"]), None, "two formats");
        assert_eq!(brace_pattern(&["a.tar", "b.tar"]), None, "no numbers");
        let err = unfinished("d/", "d/_shardstream/pack-journal.jsonl", &["a.tar", "b.tar"]).to_string();
        assert!(
            err.contains("the 2 shards there so far knowingly, name them in a brace pattern (d/a.tar, ...)"),
            "{err}"
        );
    }

    fn rec(shard: u64, first: u64, end: u64) -> ShardRecord {
        ShardRecord {
            shard,
            name: format!("s-{shard:06}.tar"),
            first,
            end,
            bytes: 10240,
            samples: end - first,
            files: end - first,
            payload: 100,
            crc32c: "0000abcd".into(),
            fields: vec!["jpg".into()],
            bad_inputs: 0,
            largest: None,
        }
    }

    #[test]
    fn round_trip_and_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(JOURNAL_FILE);
        assert!(load(&path).unwrap().is_none());
        let mut j = Journal::create(&path, "fp", &[rec(0, 0, 5)]).unwrap();
        j.append(&rec(1, 5, 9)).unwrap();
        j.append(&rec(2, 9, 12)).unwrap();
        drop(j);
        let prior = load(&path).unwrap().unwrap();
        assert_eq!(prior.fingerprint, "fp");
        assert_eq!(prior.shards, [rec(0, 0, 5), rec(1, 5, 9), rec(2, 9, 12)]);
        // A torn append: the last line is cut.
        let mut text = std::fs::read(&path).unwrap();
        text.truncate(text.len() - 7);
        std::fs::write(&path, &text).unwrap();
        assert_eq!(load(&path).unwrap().unwrap().shards.len(), 2);
        // A gap ends the valid prefix.
        let mut j = Journal::create(&path, "fp", &[rec(0, 0, 5)]).unwrap();
        j.append(&rec(1, 6, 9)).unwrap();
        assert_eq!(load(&path).unwrap().unwrap().shards.len(), 1);
        std::fs::write(&path, b"not json\n").unwrap();
        assert!(load(&path).is_err());
    }

    #[test]
    fn persisted_hashes_are_pinned() {
        // The journal fingerprint decides whether --resume continues a pack; stable_hash names
        // the local state directory of an S3 pack. Computed by the code before the hashes were
        // unified (see `crate::stable_hash`).
        assert_eq!(stable_hash(b"s3://bucket/prefix/"), 0xbb0b_a15d_6a88_d207);
        let r = Reporter::new(false, &());
        let cat = Catalog::build(
            vec!["c0/a.jpg".into(), "c0/a.json".into(), "c1/b.jpg".into()],
            GroupOptions { key_regex: None, label_from_dir: true },
            &r,
        )
        .unwrap();
        assert_eq!(fingerprint_for("0.1.0", "format=webdataset", &cat, &[1, 0]), "15677a9285df910cdf6f266f1165c421");
    }

    #[test]
    fn fingerprint_tracks_order_options_and_names() {
        let r = Reporter::new(false, &());
        let cat = Catalog::build(vec!["a.jpg".into(), "b.jpg".into()], GroupOptions::default(), &r).unwrap();
        let other = Catalog::build(vec!["a.jpg".into(), "c.jpg".into()], GroupOptions::default(), &r).unwrap();
        let f = fingerprint("x", &cat, &[0, 1]);
        assert_eq!(f, fingerprint("x", &cat, &[0, 1]));
        assert_ne!(f, fingerprint("y", &cat, &[0, 1]));
        assert_ne!(f, fingerprint("x", &cat, &[1, 0]));
        assert_ne!(f, fingerprint("x", &other, &[0, 1]));
        assert_eq!(f.len(), 32);
    }
}
