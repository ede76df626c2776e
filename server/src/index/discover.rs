//! Finding a dataset's shards: one read of its `manifest.json`, or one listing of its directory or
//! S3 prefix, before any shard is opened or scanned.

use std::collections::HashMap;
use std::path::Path;

use super::manifest::{self, Manifest};
use super::page_probe::RowGroupCheck;
use super::{Backends, ShardMeta};
use crate::format::Format;
use crate::storage::{DatasetUrl, Pick, ShardSource, local};
use crate::{Error, Result};

/// A dataset's shard list as found by one manifest read or one listing, before any shard is
/// scanned.
pub(super) struct Discovered {
    pub(super) url: String,
    pub(super) format: Format,
    /// Location prefix a shard name is appended to (a directory or `s3://bucket/prefix/`).
    pub(super) base: String,
    pub(super) shards: Vec<ShardMeta>,
    /// Some(fields) when the list came from manifest.json (sample counts are then known).
    pub(super) manifest_fields: Option<Vec<String>>,
    /// The manifest's footers bundle (Parquet: every file's table in one object).
    pub(super) footers: Option<ShardSource>,
}

/// Where the shards of a dataset are, for building their [`ShardSource`].
enum Place<'a> {
    Dir(&'a Path),
    Bucket { bucket: &'a str, prefix: &'a str },
}

impl Place<'_> {
    /// A local shard is where its path leads when opens are confined
    /// ([`crate::storage::confine::real_location`]): that is what the allow list checks, and what is opened.
    fn source(&self, name: &str, etag: Option<String>) -> Result<ShardSource> {
        Ok(match self {
            Place::Dir(dir) => ShardSource::Local(crate::storage::confine::real_location(dir.join(name))?),
            Place::Bucket { bucket, prefix } => {
                ShardSource::S3 { bucket: (*bucket).to_owned(), key: format!("{prefix}{name}"), etag }
            }
        })
    }
}

impl Discovered {
    pub(super) fn discover(url: &str, backends: &Backends) -> Result<Self> {
        let parsed = DatasetUrl::parse(url)?;
        let base = parsed.base();
        match &parsed {
            DatasetUrl::Local { dir, pick } => {
                let place = Place::Dir(dir);
                let at = Confined::of(dir)?.check(&dir.join(manifest::MANIFEST_FILE), "its manifest.json")?;
                if let Some(manifest) = Manifest::read_file(&at)? {
                    return Self::from_manifest(url, base, &place, pick, manifest);
                }
                let listed = local::list_shards(dir, pick)?;
                let format = Format::of_shards(listed.iter().map(|l| l.name.as_str()), &base)?;
                let shards = listed
                    .into_iter()
                    .map(|l| {
                        Ok(ShardMeta {
                            source: place.source(&l.name, None)?,
                            name: l.name,
                            len: l.len,
                            samples: 0,
                            crc32c: None,
                            footer_crc32c: None,
                            mtime_ns: Some(l.mtime_ns),
                            sidecar: None,
                            content: None,
                            largest: None,
                            row_group_check: None,
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(Self { url: url.to_owned(), base, format, shards, manifest_fields: None, footers: None })
            }
            DatasetUrl::S3 { bucket, prefix, pick } => {
                let store = backends.s3()?;
                let place = Place::Bucket { bucket, prefix };
                let manifest_key = format!("{prefix}{}", manifest::MANIFEST_FILE);
                if let Some(bytes) = store.block_on(store.get_small(bucket, &manifest_key))? {
                    let m = Manifest::parse(&bytes, &format!("s3://{bucket}/{manifest_key}"))?;
                    return Self::from_manifest(url, base, &place, pick, m);
                }
                // A prefix `pack` is still writing (or was interrupted writing) is refused by the
                // listing (`storage::s3::shards_in_listing`).
                let listed = store.list_picked(bucket, prefix, pick)?;
                let format = Format::of_shards(listed.iter().map(|(n, _)| n.as_str()), &base)?;
                let shards = listed
                    .into_iter()
                    .map(|(name, o)| {
                        Ok(ShardMeta {
                            source: place.source(&name, o.etag.clone())?,
                            name,
                            len: o.size,
                            samples: 0,
                            crc32c: None,
                            footer_crc32c: None,
                            // Names the version (with the size) where the listing has no ETag:
                            // the node-cache copy and the sidecar are keyed by it.
                            mtime_ns: o.modified_ns,
                            sidecar: None,
                            content: None,
                            largest: None,
                            row_group_check: None,
                        })
                    })
                    .collect::<Result<_>>()?;
                Ok(Self { url: url.to_owned(), base, format, shards, manifest_fields: None, footers: None })
            }
        }
    }

    fn from_manifest(url: &str, base: String, place: &Place<'_>, pick: &Pick, m: Manifest) -> Result<Self> {
        let format = m.format()?;
        let footer_scope = m.checksum_scope() == manifest::ChecksumScope::Footer;
        let confined = match place {
            Place::Dir(dir) => Confined::of(dir)?,
            Place::Bucket { .. } => Confined::default(),
        };
        let to_meta = |s: &manifest::ManifestShard| -> Result<ShardMeta> {
            Ok(ShardMeta {
                name: s.name.clone(),
                // A recorded ETag makes every GET of the object conditional on it (If-Match).
                source: place.source(&s.name, s.etag.clone())?,
                len: s.bytes,
                samples: s.samples,
                crc32c: s.crc().filter(|_| !footer_scope),
                footer_crc32c: s.crc().filter(|_| footer_scope),
                mtime_ns: None,
                // Sidecars named by the manifest are read in place; an S3 shard's table is scanned
                // from its cache copy (headers only, already in the page cache).
                sidecar: match place {
                    Place::Dir(dir) => match &s.index {
                        Some(i) => Some(confined.check(&dir.join(i), "a sidecar its manifest names")?),
                        None => None,
                    },
                    Place::Bucket { .. } => None,
                },
                content: None,
                largest: s.largest(),
                // An answer about the ETag holds only for the upload the recorded ETag pins.
                row_group_check: RowGroupCheck::from_facts(s.page_checksums, s.etag_md5.filter(|_| s.etag.is_some())),
            })
        };
        /// A shard a pattern names that the manifest does not list (the manifest is the listing).
        const MANIFEST_LACKS: &str =
            "shard (not in the dataset's manifest.json: run `shardstream index` again if it was added since)";
        let shards: Vec<ShardMeta> = match pick {
            // The manifest is the listing: the same glob and the same split check.
            Pick::All | Pick::Every | Pick::Glob(_) => {
                let listed: Vec<&manifest::ManifestShard> = m.shards.iter().collect();
                pick.keep_listed(listed, |s| s.name.as_str(), &base)?.into_iter().map(to_meta).collect::<Result<_>>()?
            }
            Pick::Names(names) => {
                let by_name: HashMap<&str, &manifest::ManifestShard> =
                    m.shards.iter().map(|s| (s.name.as_str(), s)).collect();
                names
                    .iter()
                    .map(|n| {
                        by_name.get(n.as_str()).map_or_else(
                            || Err(Error::NotFound { what: MANIFEST_LACKS, path: format!("{base}{n}") }),
                            |s| to_meta(s),
                        )
                    })
                    .collect::<Result<_>>()?
            }
        };
        if shards.is_empty() {
            return Err(Error::NotFound { what: "shards", path: format!("{base} (manifest.json lists none)") });
        }
        if let (Place::Dir(dir), Some(f)) = (place, &m.footers) {
            confined.check(&dir.join(f), "its footers bundle")?;
        }
        let footers = m.footers.as_ref().map(|f| place.source(f, None)).transpose()?;
        Ok(Self { url: url.to_owned(), base, format, shards, manifest_fields: Some(m.fields), footers })
    }
}

/// When opens are confined by an allow list ([`crate::storage::confine`]), a dataset's metadata
/// files (its manifest, the sidecars it names, its footers bundle) must really lie inside its
/// directory. The shards are checked against the roots by where they really are; these files
/// are read before that check, and one linked out of the roots would be read for anyone who may
/// write inside one (its shard names then shown in errors, its counts served as this dataset's).
#[derive(Default)]
struct Confined {
    /// The dataset directory's real location; None when opens are not confined.
    dir_real: Option<std::path::PathBuf>,
    dir: std::path::PathBuf,
}

impl Confined {
    /// Resolves `dir` once (a manifest names a sidecar per shard) when opens are confined.
    fn of(dir: &Path) -> Result<Self> {
        let dir_real = crate::storage::confine::confined()
            .then(|| std::fs::canonicalize(dir).map_err(|e| Error::io("cannot resolve", dir, e)))
            .transpose()?;
        Ok(Self { dir_real, dir: dir.to_owned() })
    }

    /// Refuses metadata file `path` (`what`) when it really lies outside the directory, and
    /// otherwise gives the path to read it by: its real location when opens are confined (the
    /// read then refuses a descriptor that leads anywhere else, `storage::local::read_metadata`),
    /// `path` as it is when not. A missing file is no one's: nothing is read.
    fn check(&self, path: &Path, what: &str) -> Result<std::path::PathBuf> {
        let Some(dir_real) = &self.dir_real else { return Ok(path.to_owned()) };
        let real = match std::fs::canonicalize(path) {
            Ok(p) => p,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(path.to_owned()),
            Err(e) => return Err(Error::io("cannot resolve", path, e)),
        };
        if real.starts_with(dir_real) {
            return Ok(real);
        }
        Err(Error::PermissionDenied {
            path: self.dir.display().to_string(),
            reason: format!(
                "{what} ({}) leads out of the dataset's directory, to {}: refused while the daemon confines \
                 opens to its allow list",
                path.display(),
                real.display()
            ),
        })
    }
}
