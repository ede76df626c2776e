//! What a shard looks like: how to index it (count and locate its samples) and how to pull one
//! sample's fields out of it. Every format-specific decision of the daemon is made here, behind
//! two types:
//!
//! - [`Format`]: a dataset's shard format (a closed set: WebDataset TAR, Parquet). It names the
//!   format in manifests and `DatasetInfo`, recognises its shards by file extension when a
//!   directory or prefix is listed, says which [`BatchFormat`] its streams carry, and indexes a
//!   shard into a [`ShardTable`] (from a sidecar or by scanning).
//! - [`ShardTable`]: a shard's member table, resident while the shard is in use. Everything above
//!   this module (index, plan, transport) sees a shard only through it: a sample count, the field
//!   names, and [`ShardTable::read_sample`] / [`ShardTable::locate_fields`], which say where each
//!   field of a sample lies.
//!
//! A format is a variant of each. A row-oriented format fits the same shape: its "sample" is a
//! row, its "shard" is a file (or a row group, if the format presents row groups as plan units),
//! and the plan only ever sees sample counts per shard.
//!
//! - [`tar`]: WebDataset TAR shards (ustar, GNU long names, PAX), indexed from headers only.
//! - [`parquet`]: Parquet files (a sample is a row), indexed from their footers; batches leave as
//!   Arrow IPC.
//! - [`sidecar`]: the on-disk form of a TAR shard's member table, so restarts do not rescan.

pub mod parquet;
pub mod sidecar;
pub mod tar;

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use shardstream_proto::BatchFormat;

use crate::storage::append::Append;
use crate::storage::local::ShardFile;
use crate::{Error, Result};

/// The manifest name of the WebDataset format (`Format::WebDataset.name()`).
pub const WEBDATASET: &str = "webdataset";
/// The manifest name of the Parquet format (`Format::Parquet.name()`).
pub const PARQUET: &str = "parquet";

/// A dataset's shard format. One per dataset: from its manifest's `shard_format`, or from the
/// extension of the files a listing finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// WebDataset TAR shards (`*.tar`): a sample is a run of members sharing a key.
    WebDataset,
    /// Parquet files (`*.parquet`): a sample is a row; batches are Arrow record batches.
    Parquet,
}

impl Format {
    /// Every format this build knows, in the order listings and messages name them.
    pub const ALL: [Format; 2] = [Format::WebDataset, Format::Parquet];

    /// The name manifests (`shard_format`) and `DatasetInfo.format` use.
    pub fn name(self) -> &'static str {
        match self {
            Format::WebDataset => WEBDATASET,
            Format::Parquet => PARQUET,
        }
    }

    /// The file name extension a listing recognises the format's shards by.
    pub fn extension(self) -> &'static str {
        match self {
            Format::WebDataset => ".tar",
            Format::Parquet => ".parquet",
        }
    }

    /// The format a manifest's `shard_format` names.
    pub fn from_name(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name).ok_or_else(|| {
            let known: Vec<String> = Self::ALL.iter().map(|f| format!("{:?}", f.name())).collect();
            Error::invalid(format!("shard format {name:?} is not supported (this build knows {})", known.join(", ")))
        })
    }

    /// The format whose extension `file_name` has, if any, in any case: files copied from tools
    /// or file systems that name in capitals (`PART-0.PARQUET`) are shards like the others.
    pub fn of_file(file_name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| ends_with_ignoring_case(file_name, f.extension()))
    }

    /// True when `file_name` is a shard of some format (what a listing keeps).
    pub fn is_shard_name(file_name: &str) -> bool {
        Self::of_file(file_name).is_some()
    }

    /// The format of a dataset whose shards are `names` (a listing, or the names a brace pattern
    /// gives). Names without a known extension (a brace pattern may name anything) count as
    /// WebDataset, as they always have; a mix of formats is refused rather than half served.
    pub fn of_shards<'a>(names: impl IntoIterator<Item = &'a str>, origin: &str) -> Result<Self> {
        let mut found: Option<(Format, &str)> = None;
        for name in names {
            let Some(f) = Self::of_file(name) else { continue };
            match found {
                None => found = Some((f, name)),
                Some((g, first)) if g != f => {
                    return Err(Error::invalid(format!(
                        "dataset {origin} mixes shard formats ({first} is {}, {name} is {}); \
                         put each format in its own directory (a Loader may also read one format's shards \
                         by naming them with a brace pattern; `shardstream index` takes a directory of one format)",
                        g.name(),
                        f.name()
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(found.map_or(Format::WebDataset, |(f, _)| f))
    }

    /// How the batches of this format's streams are encoded on the wire.
    pub fn batch_format(self) -> BatchFormat {
        match self {
            Format::WebDataset => BatchFormat::Samples,
            Format::Parquet => BatchFormat::Arrow,
        }
    }

    /// Ok when this build can serve datasets of the format; the error names the format and the
    /// dataset. Checked when a dataset opens, so nothing half-works mid-epoch.
    pub fn check_served(self, dataset: &str) -> Result<()> {
        let _ = dataset;
        match self {
            Format::WebDataset | Format::Parquet => Ok(()),
        }
    }

    /// Indexes the shard `file` (of `file.len` bytes) by scanning it.
    pub fn index_shard(self, file: &ShardFile) -> Result<ShardTable> {
        match self {
            // Unbuffered: a buffer would read 8 KiB around every 512-byte header.
            Format::WebDataset => tar::index_tar(&file.file, file.len)
                .map(|ix| warned_if_split(file, ShardTable::Tar(ix)))
                .map_err(|e| shard_error(file, 0, e)),
            Format::Parquet => {
                let table = parquet::dataset::open_local(file)?.ok_or_else(|| Error::Shard {
                    shard: file.name.clone(),
                    offset: None,
                    reason: "is empty (0 bytes), not a Parquet file".into(),
                })?;
                // A file without rows is warned about once, where the dataset leaves it out.
                Ok(ShardTable::Parquet(Arc::new(table)))
            }
        }
    }

    /// [`index_shard`](Self::index_shard) of a shard whose bytes are also in memory (`bytes`, a
    /// mapping of `file`): a TAR's headers are read from memory instead of with a seek and a read
    /// each. A Parquet file reads only its footer either way.
    pub fn index_mapped(self, file: &ShardFile, bytes: &[u8]) -> Result<ShardTable> {
        match self {
            Format::WebDataset => {
                // The file was `file.len` bytes when opened and a cache copy never changes; a
                // shorter mapping would still end in a truncation error naming the shard.
                let shard = bytes.get(..usize::try_from(file.len).unwrap_or(usize::MAX)).unwrap_or(bytes);
                tar::index_tar_bytes(shard)
                    .map(|ix| warned_if_split(file, ShardTable::Tar(ix)))
                    .map_err(|e| shard_error(file, 0, e))
            }
            Format::Parquet => self.index_shard(file),
        }
    }

    /// The table stored in the sidecar at `path`, if it exists, is of this format, describes the
    /// shard whose identity is `identity`, and fits a shard of `shard_len` bytes. A sidecar with a
    /// valid checksum could still describe ranges past the shard's end: it is never trusted
    /// further than the shard's real length.
    pub fn read_sidecar(
        self,
        path: &Path,
        identity: &[u8],
        shard_len: u64,
    ) -> Result<Option<ShardTable>, SidecarProblem> {
        match self {
            Format::WebDataset => match sidecar::read(path, identity) {
                Ok(Some(index)) if index.fits_shard(shard_len) => Ok(Some(ShardTable::Tar(index))),
                Ok(Some(_)) => Err(SidecarProblem::DoesNotFit),
                Ok(None) => Ok(None),
                Err(e) => Err(SidecarProblem::Unreadable(e)),
            },
            Format::Parquet => {
                let bytes = match crate::storage::local::read_metadata(path) {
                    Ok(b) => b,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(source) => {
                        return Err(SidecarProblem::Unreadable(sidecar::SidecarError::Io {
                            path: path.to_owned(),
                            source,
                        }));
                    }
                };
                match parquet::pqidx::load(&bytes, identity)? {
                    Some(t) if t.file_len() == shard_len => Ok(Some(ShardTable::Parquet(Arc::new(t)))),
                    Some(_) => Err(SidecarProblem::DoesNotFit),
                    None => Ok(None),
                }
            }
        }
    }
}

/// Why a sidecar that exists was not used (the caller rescans and says so in its log).
#[derive(Debug, thiserror::Error)]
pub enum SidecarProblem {
    #[error("sidecar does not fit its shard")]
    DoesNotFit,
    #[error(transparent)]
    Unreadable(#[from] sidecar::SidecarError),
}

fn not_samples(file: &ShardFile) -> Error {
    Error::Internal(format!("{}: the rows of a Parquet file are served as Arrow batches, not as samples", file.name))
}

/// A shard's member table, resident in memory while the shard is in use.
#[derive(Debug)]
pub enum ShardTable {
    Tar(tar::TarIndex),
    /// A Parquet file's footer: rows are its samples (served as Arrow batches, not as byte runs).
    Parquet(Arc<parquet::ParquetTable>),
}

/// `table`, after a warning when its scan found samples whose files are not together (see
/// [`tar::SplitKeys`]): served as webdataset serves them, a sample per run, but said. The first
/// few shards of a process are named; a dataset written so has it in every shard.
fn warned_if_split(file: &ShardFile, table: ShardTable) -> ShardTable {
    static WARNED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    const NAMED: usize = 3;
    if let Some(split) = table.split_keys() {
        let n = WARNED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n < NAMED {
            tracing::warn!(
                shard = %file.name,
                "{}",
                split_keys_message(split, table.num_samples())
                    + if n + 1 == NAMED { " (further shards like this are not named)" } else { "" }
            );
        }
    }
    table
}

/// What [`tar::SplitKeys`] mean for a shard of `samples` samples, and the way out.
pub fn split_keys_message(split: &tar::SplitKeys, samples: u64) -> String {
    format!(
        "{} of its {samples} samples repeat the key of an earlier one that is not next to them (first {:?}): \
         a sample's files are not together in the archive (`tar cf` of a directory orders them as the file \
         system lists them), so each run is a sample of its own, with the fields it lacks None; write the \
         shards with `tar --sort=name` or `shardstream pack`",
        split.count,
        split.first.as_deref().unwrap_or_default()
    )
}

/// Where one sample's fields landed in the caller's buffer.
#[derive(Debug, Default)]
pub struct SampleLocation {
    pub key: String,
    /// (field name, byte range in the buffer), in shard order; only the first `used` are valid
    /// (the rest are kept to reuse their allocations).
    fields: Vec<(String, Range<usize>)>,
    used: usize,
}

impl SampleLocation {
    pub fn fields(&self) -> &[(String, Range<usize>)] {
        &self.fields[..self.used]
    }

    /// Where field `name` lies, if the sample has it (a sample has a handful of fields: a linear
    /// search beats any map).
    pub fn field(&self, name: &str) -> Option<Range<usize>> {
        self.fields().iter().find(|(n, _)| n == name).map(|(_, r)| r.clone())
    }

    /// Starts a new sample: the key and field list are cleared, their allocations kept.
    fn reset(&mut self, key: &str) {
        self.key.clear();
        self.key.push_str(key);
        self.used = 0;
    }

    /// Appends a field, reusing the name string of the previous sample's field in this position
    /// (no allocation per field once the first sample was seen).
    fn push(&mut self, field: &str, range: Range<usize>) {
        match self.fields.get_mut(self.used) {
            Some((name, r)) => {
                name.clear();
                name.push_str(field);
                *r = range;
            }
            None => self.fields.push((field.to_owned(), range)),
        }
        self.used += 1;
    }
}

impl ShardTable {
    /// The format the table is of.
    pub fn format(&self) -> Format {
        match self {
            ShardTable::Tar(_) => Format::WebDataset,
            ShardTable::Parquet(_) => Format::Parquet,
        }
    }

    pub fn num_samples(&self) -> u64 {
        match self {
            ShardTable::Tar(t) => t.num_samples() as u64,
            ShardTable::Parquet(t) => t.num_rows(),
        }
    }

    pub fn fields(&self) -> &[String] {
        match self {
            ShardTable::Tar(t) => &t.fields,
            ShardTable::Parquet(t) => t.columns(),
        }
    }

    /// Shard bytes sample `i` spans (what a shm client parses in its own mapping, and what
    /// [`locate_fields`](Self::locate_fields) is handed). None past the last sample, and for a
    /// format whose samples are not byte ranges of the shard.
    pub fn sample_range(&self, i: u64) -> Option<std::ops::Range<u64>> {
        match self {
            ShardTable::Tar(t) => t.sample_range(usize::try_from(i).ok()?),
            ShardTable::Parquet(_) => None,
        }
    }

    /// Starts loading the table's entries for sample `i` into the cache, for a loop that will
    /// look it up a few samples from now (see [`crate::cache_hint`]); nothing for Parquet.
    pub fn prefetch(&self, i: u64) {
        if let (ShardTable::Tar(t), Ok(i)) = (self, usize::try_from(i)) {
            t.prefetch(i);
        }
    }

    /// A TAR shard's samples whose key an earlier, not adjacent sample has (as its scan found
    /// them; none from a sidecar).
    pub fn split_keys(&self) -> Option<&tar::SplitKeys> {
        match self {
            ShardTable::Tar(t) if t.split_keys.count > 0 => Some(&t.split_keys),
            _ => None,
        }
    }

    /// The sample spanning the most shard bytes: (index, bytes), None for an empty shard.
    pub fn largest_sample(&self) -> Option<(u64, u64)> {
        match self {
            ShardTable::Tar(t) => t.largest_sample(),
            ShardTable::Parquet(_) => None,
        }
    }

    /// Bytes of memory the table holds (for the index-memory figures in status and the bench).
    pub fn heap_bytes(&self) -> usize {
        match self {
            ShardTable::Tar(t) => t.heap_bytes(),
            ShardTable::Parquet(t) => t.heap_bytes(),
        }
    }

    /// Feeds what the table says about the shard's content (sample boundaries, field names) into
    /// a content digest (the dataset fingerprint of shards without a checksum).
    pub fn digest_into(&self, h: &mut crate::stable_hash::Fnv1a) {
        match self {
            ShardTable::Tar(ix) => {
                for b in &ix.boundaries {
                    h.bytes(&b.to_le_bytes());
                }
                for f in &ix.fields {
                    h.field(f.as_bytes());
                }
            }
            // The footer describes the whole file (row groups, chunk offsets, schema).
            ShardTable::Parquet(t) => {
                h.field(t.footer());
            }
        }
    }

    /// The table as sidecar bytes for the shard whose identity is `identity`.
    pub fn encode_sidecar(&self, identity: &[u8]) -> Vec<u8> {
        match self {
            ShardTable::Tar(ix) => sidecar::encode(identity, ix),
            ShardTable::Parquet(t) => parquet::pqidx::encode(identity, t.file_len(), t.footer()),
        }
    }

    /// Writes the table's sidecar at `path` (atomically).
    pub fn write_sidecar(&self, path: &Path, identity: &[u8]) -> std::io::Result<()> {
        match self {
            ShardTable::Tar(ix) => sidecar::write_atomic(path, identity, ix),
            ShardTable::Parquet(_) => crate::atomic_write::write(path, &self.encode_sidecar(identity)),
        }
    }

    /// True when the table says where each sample's key and fields lie without reading it
    /// ([`key_at`](Self::key_at), [`field_at`](Self::field_at)).
    pub fn has_layout(&self) -> bool {
        match self {
            ShardTable::Tar(t) => t.layout.is_some(),
            ShardTable::Parquet(_) => false,
        }
    }

    /// Sample `i`'s key, as a byte range relative to the sample's start; None without a layout.
    pub fn key_at(&self, i: u64) -> Option<Range<usize>> {
        match self {
            ShardTable::Tar(t) => t.layout.as_ref()?.key(usize::try_from(i).ok()?),
            ShardTable::Parquet(_) => None,
        }
    }

    /// Field `f` (an index into [`fields`](Self::fields)) of sample `i`, relative to the sample's
    /// start: Some(None) when the sample lacks it; None without a layout or out of range.
    pub fn field_at(&self, i: u64, f: usize) -> Option<Option<Range<usize>>> {
        match self {
            ShardTable::Tar(t) => t.layout.as_ref()?.field(usize::try_from(i).ok()?, f),
            ShardTable::Parquet(_) => None,
        }
    }

    /// Says where sample `i`'s key and fields lie in `bytes`, which hold exactly the shard bytes
    /// [`sample_range`](Self::sample_range)`(i)` (read, or in a mapping). Ranges in `loc` are
    /// relative to `bytes`, shifted by `at` (the position of `bytes` in the caller's buffer).
    /// Errors name the shard (`file`) and the absolute offset.
    pub fn locate_fields(
        &self,
        file: &ShardFile,
        i: u64,
        bytes: &[u8],
        at: usize,
        loc: &mut SampleLocation,
    ) -> Result<()> {
        match self {
            ShardTable::Tar(t) => {
                if let Some(layout) = &t.layout
                    && let Ok(i) = usize::try_from(i)
                    && from_layout(layout, &t.fields, i, bytes, at, loc)
                {
                    return Ok(());
                }
                let base = usize::try_from(i).ok().and_then(|i| t.sample_range(i)).map_or(0, |r| r.start);
                let view = tar::parse_sample(bytes).map_err(|e| shard_error(file, base, e))?;
                loc.reset(&view.key);
                for m in &view.members {
                    loc.push(&m.field, at + m.data.start..at + m.data.end);
                }
                Ok(())
            }
            ShardTable::Parquet(_) => Err(not_samples(file)),
        }
    }

    /// Appends sample `i`'s bytes to `buf` (one positioned read) and describes its fields in
    /// `loc`. Ranges in `loc` are absolute positions in `buf`. On error `buf` is restored to its
    /// length on entry.
    pub fn read_sample(&self, file: &ShardFile, i: u64, buf: &mut impl Append, loc: &mut SampleLocation) -> Result<()> {
        let range =
            self.sample_range(i).ok_or_else(|| Error::Internal(format!("sample {i} out of range in {}", file.name)))?;
        let len = usize::try_from(range.end - range.start)
            .map_err(|_| Error::Internal("sample larger than the address space".into()))?;
        let start = buf.len();
        file.read_append(buf, len, range.start)?;
        let parsed = self.locate_fields(file, i, &buf.filled()[start..], start, loc);
        if parsed.is_err() {
            buf.truncate(start);
        }
        parsed
    }
}

/// Fills `loc` from the layout recorded at index time, without parsing; false when the bytes do
/// not match it (shorter than a recorded range, a key that is not UTF-8: a shard changed since
/// it was indexed), and the caller parses them instead, which reports what is wrong.
fn from_layout(
    layout: &tar::layout::Layout,
    fields: &[String],
    i: usize,
    bytes: &[u8],
    at: usize,
    loc: &mut SampleLocation,
) -> bool {
    let Some(key) = layout.key(i).and_then(|r| bytes.get(r)).and_then(|k| std::str::from_utf8(k).ok()) else {
        return false;
    };
    loc.reset(key);
    for (f, name) in fields.iter().enumerate() {
        match layout.field(i, f) {
            Some(None) => {}
            Some(Some(r)) if r.end <= bytes.len() => loc.push(name, at + r.start..at + r.end),
            _ => return false,
        }
    }
    true
}

/// Converts a TAR error found at `base` (the byte offset of the buffer's start in the shard) into
/// a shard error naming the shard and the absolute offset.
pub fn shard_error(file: &ShardFile, base: u64, e: tar::TarError) -> Error {
    let e = e.with_base(base);
    Error::Shard { shard: file.name.clone(), offset: e.offset(), reason: e.to_string() }
}

/// True when `name` ends with `suffix`, ASCII letters compared without case.
pub(crate) fn ends_with_ignoring_case(name: &str, suffix: &str) -> bool {
    let (name, suffix) = (name.as_bytes(), suffix.as_bytes());
    name.len() >= suffix.len() && name[name.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_round_trips_through_its_name_and_extension() {
        for f in Format::ALL {
            assert_eq!(Format::from_name(f.name()).unwrap(), f);
            assert_eq!(Format::of_file(&format!("shard-000001{}", f.extension())), Some(f));
        }
        assert_eq!(Format::WebDataset.batch_format(), BatchFormat::Samples);
        assert_eq!(Format::Parquet.batch_format(), BatchFormat::Arrow);
        let err = Format::from_name("orc").unwrap_err().to_string();
        assert!(err.contains("\"orc\"") && err.contains("\"webdataset\"") && err.contains("\"parquet\""), "{err}");
        assert!(!Format::is_shard_name("manifest.json") && !Format::is_shard_name("a.tar.idx"));
        assert_eq!(Format::of_file("PART-0.PARQUET"), Some(Format::Parquet));
        assert_eq!(Format::of_file("Shard.Tar"), Some(Format::WebDataset));
        assert!(!Format::is_shard_name("tar") && !Format::is_shard_name("é.ta"));
    }

    #[test]
    fn a_dataset_has_one_format_from_its_shard_names() {
        let of = |names: &[&str]| Format::of_shards(names.iter().copied(), "/d/");
        assert_eq!(of(&["a.tar", "b.tar"]).unwrap(), Format::WebDataset);
        assert_eq!(of(&["a.parquet"]).unwrap(), Format::Parquet);
        // A brace pattern may name files without a known extension: TAR, as before formats.
        assert_eq!(of(&["a.shard", "b"]).unwrap(), Format::WebDataset);
        assert_eq!(of(&["x.bin", "a.parquet"]).unwrap(), Format::Parquet);
        let err = of(&["a.tar", "b.tar", "c.parquet"]).unwrap_err().to_string();
        assert!(err.contains("/d/") && err.contains("a.tar") && err.contains("c.parquet"), "{err}");
    }

    #[test]
    fn parquet_files_index_from_their_footers_and_round_trip_through_sidecars() {
        Format::Parquet.check_served("/d/").unwrap();
        let dir = tempfile::tempdir().unwrap();
        // Not Parquet at all: a shard error naming the file.
        let path = dir.path().join("a.parquet");
        std::fs::write(&path, b"PAR1").unwrap();
        let err = Format::Parquet.index_shard(&ShardFile::open(path, 4).unwrap()).unwrap_err();
        assert!(matches!(&err, Error::Shard { shard, .. } if shard.ends_with("a.parquet")), "{err:?}");
        let path = dir.path().join("empty.parquet");
        std::fs::write(&path, b"").unwrap();
        let err = Format::Parquet.index_shard(&ShardFile::open(path, 0).unwrap()).unwrap_err();
        assert!(err.to_string().contains("empty.parquet") && err.to_string().contains("0 bytes"), "{err}");
        // A real file: rows are samples, columns are fields (in file order), sidecars round-trip.
        let bytes = parquet::testdata::mixed(30, 8, parquet::testdata::Codec::Snappy);
        let path = dir.path().join("b.parquet");
        std::fs::write(&path, &bytes).unwrap();
        let file = ShardFile::open(path, bytes.len() as u64).unwrap();
        let table = Format::Parquet.index_shard(&file).unwrap();
        assert_eq!((table.format(), table.num_samples()), (Format::Parquet, 30));
        assert_eq!(table.fields(), ["id", "label", "caption", "image", "blob", "text", "tokens"]);
        assert_eq!(table.sample_range(0), None);
        let side = dir.path().join("b.parquet.idx");
        table.write_sidecar(&side, b"id-1").unwrap();
        let again = Format::Parquet.read_sidecar(&side, b"id-1", bytes.len() as u64).unwrap().unwrap();
        assert_eq!(again.num_samples(), 30);
        assert!(Format::Parquet.read_sidecar(&side, b"id-2", bytes.len() as u64).unwrap().is_none());
        assert!(matches!(Format::Parquet.read_sidecar(&side, b"id-1", 7), Err(SidecarProblem::DoesNotFit)));
        // Rows are never served as byte runs.
        let mut loc = SampleLocation::default();
        assert!(matches!(table.read_sample(&file, 0, &mut Vec::new(), &mut loc), Err(Error::Internal(_))));
    }

    /// The seam's field location for TAR is what `tar::parse_sample` says, shifted by `at`, and
    /// the reused location forgets the fields of a previous, larger sample.
    #[test]
    fn locate_fields_matches_the_tar_parser_and_reuses_its_location() {
        let mut b = ::tar::Builder::new(Vec::new());
        for (key, fields) in [("a", &["cls", "jpg", "txt"][..]), ("b", &["cls"][..])] {
            for field in fields {
                let data = format!("{key}-{field}");
                let mut h = ::tar::Header::new_gnu();
                h.set_size(data.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, format!("{key}.{field}"), data.as_bytes()).unwrap();
            }
        }
        let bytes = b.into_inner().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.tar");
        std::fs::write(&path, &bytes).unwrap();
        let file = ShardFile::open(path, bytes.len() as u64).unwrap();
        let table = Format::WebDataset.index_shard(&file).unwrap();
        assert_eq!((table.format(), table.num_samples()), (Format::WebDataset, 2));
        let mut loc = SampleLocation::default();
        let mut buf = b"prefix".to_vec();
        for i in 0..2 {
            let range = table.sample_range(i).unwrap();
            let sample = &bytes[range.start as usize..range.end as usize];
            let view = tar::parse_sample(sample).unwrap();
            table.locate_fields(&file, i, sample, 6, &mut loc).unwrap();
            assert_eq!(loc.key, view.key);
            let want: Vec<(String, Range<usize>)> =
                view.members.iter().map(|m| (m.field.to_string(), m.data.start + 6..m.data.end + 6)).collect();
            assert_eq!(loc.fields(), want.as_slice());
            buf.truncate(6);
            buf.extend_from_slice(sample);
            for (name, r) in loc.fields() {
                let key = if i == 0 { "a" } else { "b" };
                assert_eq!(&buf[r.clone()], format!("{key}-{name}").as_bytes());
            }
        }
        assert_eq!(loc.field("cls"), Some(loc.fields()[0].1.clone()));
        assert_eq!(loc.field("jpg"), None, "a field of the previous sample leaked");
        // A sample that does not parse names the shard and its absolute offset.
        let range = table.sample_range(1).unwrap();
        let mut damaged = bytes[range.start as usize..range.end as usize].to_vec();
        damaged[0] ^= 0xff;
        match table.locate_fields(&file, 1, &damaged, 0, &mut loc).unwrap_err() {
            Error::Shard { shard, offset, .. } => {
                assert!(shard.ends_with("s.tar"));
                assert_eq!(offset, Some(range.start));
            }
            other => panic!("{other:?}"),
        }
    }
}
