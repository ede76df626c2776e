//! Indexing a shard: [`index_tar`] walks the headers only (payloads are skipped with seeks) and
//! records where each sample starts, giving a [`TarIndex`].

use std::borrow::Cow;
use std::collections::{BTreeSet, HashSet};
use std::hash::{BuildHasher, RandomState};
use std::io::{Read, Seek};

use super::entry::*;
use super::layout::LayoutBuilder;
use super::naming::*;
use super::{SplitKeys, TarError, TarIndex};

/// The fields of the sample being indexed, in one reused string (no allocation per member).
#[derive(Default)]
pub(super) struct FieldList {
    pub(super) names: String,
    pub(super) ends: Vec<usize>,
}

impl FieldList {
    fn clear(&mut self) {
        self.names.clear();
        self.ends.clear();
    }

    fn contains(&self, field: &str) -> bool {
        let mut start = 0;
        self.ends.iter().any(|&end| {
            let hit = self.names.get(start..end) == Some(field);
            start = end;
            hit
        })
    }

    fn push(&mut self, field: &str) {
        self.names.push_str(field);
        self.ends.push(self.names.len());
    }
}

/// Indexes a shard from its headers alone; payloads are skipped with seeks.
///
/// `shard_len` is the shard's size (from the listing or manifest) and bounds every member; the
/// reader is read within `0..shard_len` only. A `BufReader` around a file reads its whole buffer
/// at each header: pass the file itself (or a small buffer) when payloads are large.
pub fn index_tar<R: Read + Seek>(reader: R, shard_len: u64) -> Result<TarIndex, TarError> {
    index_source(&mut ReaderSource::new(reader, shard_len))
}

/// [`index_tar`] of a shard whose bytes are in memory (a mapped node-cache copy): the same
/// index, without the two system calls per header that reading it from the file costs (a
/// seek and a 512-byte read for every member, ~15% of the daemon's CPU in a cold S3 epoch of
/// 18 KiB samples; bench/PROFILES.md).
pub fn index_tar_bytes(shard: &[u8]) -> Result<TarIndex, TarError> {
    index_source(&mut SliceSource { buf: shard, scope: "shard" })
}

fn index_source(src: &mut impl Source) -> Result<TarIndex, TarError> {
    let mut scan = Scan::default();
    scan.run(src, 0)?;
    Ok(scan.finish())
}

/// The most distinct fields (extensions) a shard may have.
pub const MAX_SHARD_FIELDS: usize = 1024;

/// The state of indexing one shard, kept between calls so a shard can be indexed in parts, in
/// order: whole ([`index_source`]) or one sample at a time as it is written
/// ([`ScanAsWritten`]). The same walk either way, so the two give the same index.
#[derive(Default)]
struct Scan {
    boundaries: Vec<u64>,
    fields: BTreeSet<String>,
    key: String,
    sample_fields: FieldList,
    layout: LayoutBuilder,
    end: u64,
    /// Hashes of the keys of the samples so far (a sample is a run of members with one key; a
    /// key that comes back after others is a sample whose files are not together).
    keys_seen: HashSet<u64>,
    hasher: RandomState,
    split: SplitKeys,
}

impl Scan {
    /// Walks the members of `src` from `offset` to the end of its data (or of the archive).
    fn run(&mut self, src: &mut impl Source, mut offset: u64) -> Result<(), TarError> {
        while let Some(e) = next_entry(src, offset, offset == 0)? {
            offset = e.next;
            if let Some(name) = e.sparse {
                if split_key(&name).is_some() {
                    return Err(TarError::Sparse { offset: e.header, name });
                }
                continue;
            }
            if !e.regular {
                continue;
            }
            let name = resolve_name(&e.name, |slot, r| src.loaded(slot, r));
            let Some((k, field)) = split_key(&name) else { continue };
            if let Cow::Owned(_) = name
                && let Some(name) = non_utf8_name(&e.name, |slot, r| src.loaded(slot, r))
            {
                return Err(TarError::NotUtf8Name { offset: e.header, name });
            }
            let field = normalize_field(Cow::Borrowed(field));
            if self.boundaries.is_empty() || k != self.key {
                if !self.keys_seen.insert(self.hasher.hash_one(k)) {
                    self.split.count += 1;
                    self.split.first.get_or_insert_with(|| k.to_owned());
                }
                self.boundaries.push(e.start);
                self.key.clear();
                self.key.push_str(k);
                self.sample_fields.clear();
                self.layout.sample(e.start, key_range(&e.name, matches!(name, Cow::Borrowed(_)), k.len()));
            } else if self.sample_fields.contains(&field) {
                return Err(TarError::DuplicateField {
                    offset: e.header,
                    key: self.key.clone(),
                    field: field.into_owned(),
                });
            }
            if let Some(&start) = self.boundaries.last() {
                self.layout.member(start, &field, e.data, e.size);
            }
            self.sample_fields.push(&field);
            if !self.fields.contains(&*field) {
                // Every sample's locations take a slot per field of the shard (the layout), and
                // every batch a column per field of the dataset: unbounded, a small shard of
                // distinct names had the daemon allocate samples x fields and abort.
                if self.fields.len() >= MAX_SHARD_FIELDS {
                    return Err(TarError::TooManyFields {
                        offset: e.header,
                        name: name.to_string(),
                        max: MAX_SHARD_FIELDS,
                    });
                }
                self.fields.insert(field.into_owned());
            }
            self.end = e.next;
        }
        Ok(())
    }

    fn finish(mut self) -> TarIndex {
        if !self.boundaries.is_empty() {
            self.boundaries.push(self.end);
        }
        self.boundaries.shrink_to_fit();
        let fields: Vec<String> = self.fields.into_iter().collect();
        let layout = self.layout.finish(&fields);
        TarIndex { boundaries: self.boundaries, fields, layout, split_keys: self.split }
    }
}

/// Indexes a shard while it is written, from the bytes of each sample as the writer appends
/// them: the index a scan of the finished file would give, without reading its headers back
/// (which, once the shard was written around the page cache, would be one disk read each).
#[derive(Default)]
pub struct ScanAsWritten {
    scan: Scan,
}

impl ScanAsWritten {
    /// The sample that occupies shard bytes `start..end`: `parts` are its bytes at their
    /// absolute offsets, in order, with holes where payloads are written from elsewhere (a
    /// streamed file). Every header must lie within a part; payloads may fall in holes.
    pub fn sample(&mut self, start: u64, end: u64, parts: &[(u64, &[u8])]) -> Result<(), TarError> {
        self.scan.run(&mut PartsSource { parts, end }, start)
    }

    pub fn finish(self) -> TarIndex {
        self.scan.finish()
    }
}

/// The shard bytes of a key that is the first `key_len` bytes of the member name at `loc`, when
/// the name is one contiguous UTF-8 range of the shard (not a ustar `prefix` + `name`, which is
/// joined, nor a name made valid by lossy decoding).
/// `as_is`: the name was valid UTF-8 as stored.
fn key_range(loc: &NameLoc, as_is: bool, key_len: usize) -> Option<std::ops::Range<u64>> {
    if !as_is {
        return None;
    }
    let r = match loc {
        NameLoc::Header { prefix: None, name } => name,
        NameLoc::Long(r) | NameLoc::Pax(r) => r,
        NameLoc::Header { prefix: Some(_), .. } => return None,
    };
    Some(r.start..r.start.checked_add(key_len as u64)?)
}
