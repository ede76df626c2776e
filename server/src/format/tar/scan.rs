//! Indexing a shard: [`index_tar`] walks the headers only (payloads are skipped with seeks) and
//! records where each sample starts, giving a [`TarIndex`].

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::io::{Read, Seek};

use super::entry::*;
use super::layout::LayoutBuilder;
use super::naming::*;
use super::{TarError, TarIndex};

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
    let mut boundaries = Vec::new();
    let mut fields = BTreeSet::new();
    let mut key = String::new();
    let mut sample_fields = FieldList::default();
    let mut layout = LayoutBuilder::default();
    let mut end = 0;
    let mut offset = 0;
    while let Some(e) = next_entry(src, offset, offset == 0)? {
        offset = e.next;
        if !e.regular {
            continue;
        }
        let name = resolve_name(&e.name, |slot, r| src.loaded(slot, r));
        let Some((k, field)) = split_key(&name) else { continue };
        let field = normalize_field(Cow::Borrowed(field));
        if boundaries.is_empty() || k != key {
            boundaries.push(e.start);
            key.clear();
            key.push_str(k);
            sample_fields.clear();
            layout.sample(e.start, key_range(&e.name, matches!(name, Cow::Borrowed(_)), k.len()));
        } else if sample_fields.contains(&field) {
            return Err(TarError::DuplicateField { offset: e.header, key, field: field.into_owned() });
        }
        if let Some(&start) = boundaries.last() {
            layout.member(start, &field, e.data, e.size);
        }
        sample_fields.push(&field);
        if !fields.contains(&*field) {
            fields.insert(field.into_owned());
        }
        end = e.next;
    }
    if !boundaries.is_empty() {
        boundaries.push(end);
    }
    boundaries.shrink_to_fit();
    let fields: Vec<String> = fields.into_iter().collect();
    let layout = layout.finish(&fields);
    Ok(TarIndex { boundaries, fields, layout })
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
