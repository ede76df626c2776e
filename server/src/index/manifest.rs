//! `manifest.json`: the list of a dataset's shards with their sample counts, sizes and checksums,
//! written next to the shards by `shardstream index` (and `shardstream pack`), so that opening a
//! dataset of 100,000 shards costs one read instead of 100,000 stats and scans.
//!
//! Format (version 1), JSON:
//!
//! ```json
//! {
//!   "format": "shardstream-manifest",
//!   "version": 1,
//!   "shard_format": "webdataset",
//!   "checksum": "crc32c",
//!   "created_by": "shardstream 0.1.0",
//!   "total_samples": 2000,
//!   "total_bytes": 41943040,
//!   "fields": ["cls", "jpg"],
//!   "shards": [
//!     {"name": "train-000000.tar", "bytes": 20971520, "samples": 1000,
//!      "crc32c": "1a2b3c4d", "index": "_shardstream/train-000000.tar.idx",
//!      "max_sample": 417, "max_sample_bytes": 31744}
//!   ]
//! }
//! ```
//!
//! - `name` is relative to the manifest's directory; `index` (optional) names the shard's sidecar
//!   (its member table, see `format::sidecar`), also relative.
//! - `crc32c` is a CRC-32C (Castagnoli) as 8 lowercase hex digits. What it covers is the top-level
//!   `checksum`:
//!   - `"crc32c"`: the whole shard file. Computed at hardware speed (SSE4.2/ARMv8 CRC
//!     instructions, well above disk bandwidth); the daemon verifies every shard against it before
//!     serving its first byte (for a local shard by reading it once; for an S3 shard as its copy
//!     arrives in the node cache). TAR manifests, and Parquet ones written by `shardstream pack`
//!     (which sees every byte as it writes them), use it.
//!   - `"crc32c-footer"` (Parquet only): the file's last `F + 8` bytes, where `F` is its footer
//!     length: the thrift footer, its 4-byte length and the tail magic `PAR1`
//!     (`format::parquet::footer::footer_crc32c`). This is what `shardstream index` records for
//!     Parquet, because it reads only footers (one tail read per file, a ranged GET on S3), never a
//!     whole file. The footer holds every column chunk's offset, sizes, codec and statistics, so a
//!     file rewritten in a way any reader would see changes it, together with `bytes` (the file's
//!     exact length, also checked). The daemon checks both when it first uses a file, before any
//!     of its rows is served: the footer is read again from the file (local) or from the node
//!     cache's copy (S3), and the footer the daemon decodes the file with must have the same CRC.
//!     It does not cover the data pages: a flipped bit inside a page is caught by the page's own
//!     CRC when the writer stored one (pyarrow: `write_page_checksum=True`), else it surfaces as a
//!     decode error or goes unnoticed, as with any Parquet reader. For S3 objects the entry
//!     also records the object's `etag` when the listing gave one: every GET of the object then
//!     carries `If-Match` (a replaced object fails, named, instead of being served), and an ETag
//!     that is an MD5 (single-part uploads) is checked against the whole downloaded copy.
//!     Daemons older than this value refuse such a manifest with a clear message.
//! - `footers` (optional, Parquet): the relative name of one object holding every file's footer
//!   (`format::parquet::footers`), which `shardstream index` writes: the daemon opens the dataset
//!   from it with one read instead of a tail read per file (a ranged GET each, on S3). An entry
//!   that does not match its file (stale), or a bundle that does not load, costs those files
//!   their tail reads again, with a warning.
//! - `max_sample` / `max_sample_bytes` (optional, together): the index within the shard of its
//!   largest sample and the shard bytes it spans (TAR headers included). They let the daemon
//!   refuse an inline stream that could not carry that sample when the stream opens, without
//!   reading any shard's member table; without them it happens as each batch is built.
//! - `page_checksums` / `etag_md5` (optional, Parquet, `shardstream index`): what the tail read
//!   for a file's footer said at no extra read: whether a page header in it carried a CRC (when
//!   the tail held one: a small last row group's chunks start there), and, on S3, whether the
//!   ETag its GET answered may be the object's MD5 (not under SSE-KMS or SSE-C, not a multipart
//!   upload's). The daemon decides with them how a row group's copy is checked, instead of a
//!   GET of the file's first page header (`index::page_probe`); an `etag_md5` counts only beside
//!   a recorded `etag`.
//! - Readers refuse a manifest whose `version` is newer than [`MANIFEST_VERSION`] and ignore
//!   fields they do not know (so version 1 readers can read additions that keep the meaning).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

pub const MANIFEST_FILE: &str = "manifest.json";
pub const MANIFEST_FORMAT: &str = "shardstream-manifest";
pub const MANIFEST_VERSION: u32 = 1;
/// `checksum` of a manifest whose `crc32c`s cover whole shard files.
pub const CHECKSUM_FILE: &str = "crc32c";
/// `checksum` of a Parquet manifest whose `crc32c`s cover each file's footer (see the module doc).
pub const CHECKSUM_FOOTER: &str = "crc32c-footer";

/// What a manifest's per-shard `crc32c` covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChecksumScope {
    /// The whole file ([`CHECKSUM_FILE`]).
    File,
    /// A Parquet file's footer, its length and tail magic ([`CHECKSUM_FOOTER`]).
    Footer,
}
/// Directory (inside the dataset directory) holding the per-shard index sidecars.
pub const SIDECAR_DIR: &str = "_shardstream";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub shard_format: String,
    pub checksum: String,
    #[serde(default)]
    pub created_by: String,
    pub total_samples: u64,
    pub total_bytes: u64,
    #[serde(default)]
    pub fields: Vec<String>,
    /// Every file's footer in one object (Parquet; see the module docs), relative to the manifest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub footers: Option<String>,
    pub shards: Vec<ManifestShard>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestShard {
    pub name: String,
    pub bytes: u64,
    pub samples: u64,
    pub crc32c: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    /// Index within the shard of its largest sample (see [`LargestInShard`]); absent in manifests
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sample: Option<u64>,
    /// Shard bytes (TAR headers included) that sample spans.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_sample_bytes: Option<u64>,
    /// The S3 object's ETag when it was indexed (`crc32c-footer` manifests of S3 datasets): every
    /// GET of the object carries it as `If-Match`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    /// Parquet: whether a page header in the tail read for the footer carried a CRC-32 of its
    /// page (writers checksum every page of a file or none); absent when the tail held no page
    /// header. With `etag_md5`, how the daemon checks a row group's copy (`page_probe`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub page_checksums: Option<bool>,
    /// S3 Parquet: whether the ETag the tail's GET answered may be the object's MD5 (false for a
    /// multipart upload's, SSE-KMS, SSE-C).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag_md5: Option<bool>,
}

/// A shard's largest sample as its manifest entry records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LargestInShard {
    pub local: u64,
    pub bytes: u64,
}

impl ManifestShard {
    pub fn crc(&self) -> Option<u32> {
        u32::from_str_radix(&self.crc32c, 16).ok()
    }

    /// The recorded largest sample, when both keys are there (validation refuses one alone).
    pub fn largest(&self) -> Option<LargestInShard> {
        Some(LargestInShard { local: self.max_sample?, bytes: self.max_sample_bytes? })
    }

    /// Records `largest` ((index, bytes), as [`TarIndex::largest_sample`] gives it).
    ///
    /// [`TarIndex::largest_sample`]: crate::format::tar::TarIndex::largest_sample
    pub fn with_largest(mut self, largest: Option<(u64, u64)>) -> Self {
        self.max_sample = largest.map(|l| l.0);
        self.max_sample_bytes = largest.map(|l| l.1);
        self
    }

    /// Why the recorded largest sample cannot be true of this shard, if it cannot.
    fn largest_problem(&self) -> Option<String> {
        match (self.max_sample, self.max_sample_bytes) {
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => Some("max_sample and max_sample_bytes must be given together".into()),
            (Some(i), Some(b)) => {
                if i >= self.samples {
                    Some(format!("max_sample {i} is not below its {} samples", self.samples))
                } else if b > self.bytes {
                    Some(format!("max_sample_bytes {b} is more than its {} bytes", self.bytes))
                } else {
                    None
                }
            }
        }
    }
}

impl Manifest {
    pub fn new(shard_format: &str, fields: Vec<String>, shards: Vec<ManifestShard>) -> Self {
        Self {
            format: MANIFEST_FORMAT.into(),
            version: MANIFEST_VERSION,
            shard_format: shard_format.into(),
            checksum: CHECKSUM_FILE.into(),
            created_by: format!("shardstream {}", crate::VERSION),
            total_samples: shards.iter().map(|s| s.samples).sum(),
            total_bytes: shards.iter().map(|s| s.bytes).sum(),
            fields,
            footers: None,
            shards,
        }
    }

    /// The manifest with its `crc32c`s covering `scope`.
    pub fn with_checksum(mut self, scope: ChecksumScope) -> Self {
        self.checksum = match scope {
            ChecksumScope::File => CHECKSUM_FILE,
            ChecksumScope::Footer => CHECKSUM_FOOTER,
        }
        .into();
        self
    }

    /// What the shards' `crc32c`s cover (validated: only the two known values are accepted).
    pub fn checksum_scope(&self) -> ChecksumScope {
        if self.checksum == CHECKSUM_FOOTER { ChecksumScope::Footer } else { ChecksumScope::File }
    }

    /// The shard format `shard_format` names, through the format registry ([`Format::from_name`]).
    pub fn format(&self) -> Result<crate::format::Format> {
        crate::format::Format::from_name(&self.shard_format)
    }

    /// Reads the manifest at `path`; `Ok(None)` when there is none.
    pub fn read_file(path: &Path) -> Result<Option<Self>> {
        let bytes = match crate::storage::local::read_metadata(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("cannot read manifest", path, e)),
        };
        Self::parse(&bytes, &path.display().to_string()).map(Some)
    }

    pub fn parse(bytes: &[u8], origin: &str) -> Result<Self> {
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| Error::invalid(format!("manifest {origin} is not valid: {e}")))?;
        m.validate(origin)?;
        Ok(m)
    }

    fn validate(&self, origin: &str) -> Result<()> {
        let bad = |why: String| Err(Error::invalid(format!("manifest {origin}: {why}")));
        if self.format != MANIFEST_FORMAT {
            return bad(format!("format is {:?}, expected {MANIFEST_FORMAT:?}", self.format));
        }
        if self.version > MANIFEST_VERSION || self.version == 0 {
            return bad(format!(
                "version {} is not supported (this build reads versions 1 to {MANIFEST_VERSION})",
                self.version
            ));
        }
        if self.checksum != CHECKSUM_FILE && self.checksum != CHECKSUM_FOOTER {
            return bad(format!(
                "checksum {:?} is not supported (expected {CHECKSUM_FILE:?} or {CHECKSUM_FOOTER:?})",
                self.checksum
            ));
        }
        match self.format() {
            Err(e) => return bad(e.to_string()),
            Ok(f) if f != crate::format::Format::Parquet && self.checksum_scope() == ChecksumScope::Footer => {
                return bad(format!("checksum {CHECKSUM_FOOTER:?} is for Parquet files, not {:?}", self.shard_format));
            }
            Ok(_) => {}
        }
        if let Some(f) = &self.footers
            && (f.is_empty() || f.starts_with('/') || f.split('/').any(|part| part == ".." || part.is_empty()))
        {
            return bad(format!("footers {f:?} must be a relative path inside the dataset"));
        }
        // A shard listed twice would be read twice an epoch: exactly once would not hold.
        let mut names: Vec<&str> = self.shards.iter().map(|s| s.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return bad(format!("shard {} is listed twice", w[0]));
        }
        for s in &self.shards {
            if s.crc().is_none() || s.crc32c.len() != 8 {
                return bad(format!("shard {}: crc32c {:?} is not 8 hex digits", s.name, s.crc32c));
            }
            // A partitioned dataset's shards are paths below it (`year=2020/part-0.parquet`); no
            // name may leave the dataset or name a directory.
            if s.name.starts_with('/') || s.name.split('/').any(|part| part.is_empty() || part == "." || part == "..") {
                return bad(format!(
                    "shard name {:?} must be a file name or a relative path inside the dataset",
                    s.name
                ));
            }
            if let Some(idx) = &s.index
                && (idx.starts_with('/') || idx.split('/').any(|c| c == ".."))
            {
                return bad(format!("shard {}: index path {idx:?} must stay inside the dataset", s.name));
            }
            if let Some(why) = s.largest_problem() {
                return bad(format!("shard {}: {why}", s.name));
            }
        }
        // Checked: counts a file claims must not wrap around to match its own total.
        let sum = |field: fn(&ManifestShard) -> u64| self.shards.iter().try_fold(0u64, |t, s| t.checked_add(field(s)));
        match sum(|s| s.samples) {
            None => return bad("the shards' sample counts overflow 64 bits".into()),
            Some(n) if n != self.total_samples => {
                return bad("total_samples is not the sum of the shards' samples".into());
            }
            Some(_) => {}
        }
        match sum(|s| s.bytes) {
            None => return bad("the shards' sizes overflow 64 bits".into()),
            Some(n) if n != self.total_bytes => return bad("total_bytes is not the sum of the shards' bytes".into()),
            Some(_) => {}
        }
        Ok(())
    }

    /// Writes the manifest atomically: a temporary file, fsynced, then renamed over the old one.
    pub fn write_atomic(&self, dir: &Path) -> Result<()> {
        crate::storage::local::write_atomic(&dir.join(MANIFEST_FILE), &self.to_json()?)
    }

    /// The bytes of `manifest.json`, the same wherever it is written.
    pub fn to_json(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self).map_err(|e| Error::Internal(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest::new(
            "webdataset",
            vec!["cls".into(), "jpg".into()],
            vec![ManifestShard {
                name: "a-0.tar".into(),
                bytes: 10240,
                samples: 3,
                crc32c: "0000abcd".into(),
                index: Some("_shardstream/a-0.tar.idx".into()),
                max_sample: Some(2),
                max_sample_bytes: Some(4096),
                etag: None,
                page_checksums: None,
                etag_md5: None,
            }],
        )
    }

    #[test]
    fn round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let m = sample();
        m.write_atomic(dir.path()).unwrap();
        assert_eq!(Manifest::read_file(&dir.path().join(MANIFEST_FILE)).unwrap(), Some(m));
        assert_eq!(Manifest::read_file(&dir.path().join("nope").join(MANIFEST_FILE)).unwrap(), None);
    }

    #[test]
    fn rejects_what_it_cannot_trust() {
        let mut m = sample();
        m.version = 2;
        let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("version 2"), "{err}");
        for outside in ["../etc/passwd", "/etc/passwd", "", "year=1/../../x", "year=1//a.tar", "./a.tar", "year=1/"] {
            let mut m = sample();
            m.shards[0].name = outside.into();
            let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
            assert!(err.contains("relative path inside the dataset"), "{outside}: {err}");
        }
        // A partitioned dataset's shard is a path below it.
        let mut m = sample();
        m.shards[0].name = "year=2020/region=eu%20west/part-0.tar".into();
        assert_eq!(Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap(), m);
        let mut m = sample();
        m.shards[0].index = Some("../../x".into());
        assert!(Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").is_err());
        let mut m = sample();
        m.total_samples = 4;
        assert!(Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").is_err());
        assert!(Manifest::parse(b"{not json", "x").is_err());
        for outside in ["", "/etc/x", "../x", "_shardstream/../../x", "a//b"] {
            let mut m = sample();
            m.footers = Some(outside.into());
            let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
            assert!(err.contains("must be a relative path"), "{outside}: {err}");
        }
        let mut m = sample();
        m.footers = Some("_shardstream/footers.idx".into());
        assert_eq!(Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap(), m);
        // A shard listed twice would be read twice an epoch: exactly once would not hold.
        let mut m = sample();
        let again = m.shards[0].clone();
        m.total_samples += again.samples;
        m.total_bytes += again.bytes;
        m.shards.push(again);
        let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("listed twice") && err.contains(&m.shards[0].name), "{err}");
    }

    /// Found writing the `manifest` fuzz target: per-shard counts whose sum overflows u64 panicked in a
    /// debug build and, in a release build, wrapped around to whatever `total_samples` claimed.
    #[test]
    fn counts_whose_sum_overflows_are_rejected_not_wrapped() {
        let two = |field: fn(&mut ManifestShard) -> &mut u64| {
            let mut m = sample();
            // Not what this test is about: a largest sample that the tiny counts could not hold.
            m.shards[0] = m.shards[0].clone().with_largest(None);
            let mut second = m.shards[0].clone();
            second.name = "a-1.tar".into();
            *field(&mut m.shards[0]) = u64::MAX;
            *field(&mut second) = 2;
            m.shards.push(second);
            m
        };
        let mut m = two(|s| &mut s.samples);
        m.total_samples = 1; // u64::MAX + 2, wrapped
        m.total_bytes = 2 * 10240;
        let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("sample counts overflow"), "{err}");

        let mut m = two(|s| &mut s.bytes);
        m.total_samples = 6;
        m.total_bytes = 1;
        let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("sizes overflow"), "{err}");
    }

    #[test]
    fn largest_sample_is_optional_and_checked_against_the_shard() {
        // A manifest written before the keys existed stays valid, and says nothing.
        let mut m = sample();
        m.shards[0].max_sample = None;
        m.shards[0].max_sample_bytes = None;
        let json = String::from_utf8(serde_json::to_vec(&m).unwrap()).unwrap();
        assert!(!json.contains("max_sample"), "{json}");
        let read = Manifest::parse(json.as_bytes(), "x").unwrap();
        assert_eq!(read.shards[0].largest(), None);
        assert_eq!(
            Manifest::parse(&sample().to_json().unwrap(), "x").unwrap().shards[0].largest(),
            Some(LargestInShard { local: 2, bytes: 4096 })
        );

        let refused = |edit: fn(&mut ManifestShard)| {
            let mut m = sample();
            edit(&mut m.shards[0]);
            Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string()
        };
        let err = refused(|s| s.max_sample_bytes = None);
        assert!(err.contains("together"), "{err}");
        let err = refused(|s| s.max_sample = None);
        assert!(err.contains("together"), "{err}");
        let err = refused(|s| s.max_sample = Some(3));
        assert!(err.contains("max_sample 3 is not below its 3 samples"), "{err}");
        let err = refused(|s| s.max_sample = Some(u64::MAX));
        assert!(err.contains("not below"), "{err}");
        let err = refused(|s| s.max_sample_bytes = Some(10241));
        assert!(err.contains("max_sample_bytes 10241 is more than its 10240 bytes"), "{err}");
        let err = refused(|s| {
            s.samples = 0;
            s.max_sample = Some(0);
        });
        assert!(err.contains("not below its 0 samples"), "{err}");
        // The whole shard as one sample is possible (no trailer counted): accepted.
        let mut m = sample();
        m.shards[0].max_sample_bytes = Some(10240);
        assert!(Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").is_ok());
    }

    #[test]
    fn the_checksum_says_what_the_crcs_cover_and_footer_crcs_are_for_parquet_only() {
        let json = String::from_utf8(sample().to_json().unwrap()).unwrap();
        assert!(json.contains("\"checksum\": \"crc32c\""), "{json}");
        assert!(!json.contains("etag"), "{json}");
        assert_eq!(Manifest::parse(json.as_bytes(), "x").unwrap().checksum_scope(), ChecksumScope::File);

        let mut m = sample().with_checksum(ChecksumScope::Footer);
        let err = Manifest::parse(&m.to_json().unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("for Parquet files"), "{err}");
        m.shard_format = "parquet".into();
        m.shards[0].etag = Some("\"0123\"".into());
        let read = Manifest::parse(&m.to_json().unwrap(), "x").unwrap();
        assert_eq!(read.checksum_scope(), ChecksumScope::Footer);
        assert_eq!(read.shards[0].etag.as_deref(), Some("\"0123\""));
        m.checksum = "md5".into();
        let err = Manifest::parse(&m.to_json().unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("\"md5\" is not supported"), "{err}");
    }

    #[test]
    fn total_bytes_must_be_the_sum_of_the_shards() {
        let mut m = sample();
        m.total_bytes += 1;
        let err = Manifest::parse(&serde_json::to_vec(&m).unwrap(), "x").unwrap_err().to_string();
        assert!(err.contains("total_bytes"), "{err}");
    }
}
