//! Parsing one sample's bytes (a range of a [`TarIndex`](super::TarIndex), read into memory) into
//! its key and the payload range of each field, borrowing everything from the buffer.

use std::borrow::Cow;
use std::ops::Range;

use super::TarError;
use super::entry::*;
use super::naming::*;

/// Members a sample usually has (image, label, metadata, ...): the initial capacity of
/// [`SampleView::members`], so that typical samples allocate once.
pub(super) const TYPICAL_MEMBERS: usize = 4;

/// One sample as parsed from its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleView<'a> {
    pub key: Cow<'a, str>,
    /// The sample's members in shard order.
    pub members: Vec<Member<'a>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member<'a> {
    /// Lower-cased field name (`jpg`, `seg.png`).
    pub field: Cow<'a, str>,
    /// Payload range within the parsed buffer.
    pub data: Range<usize>,
}

/// Parses one sample's bytes (exactly a range of a [`TarIndex`], read into memory) into its key and
/// members. Payloads are not copied: each member says where its bytes lie in `buf`. Error offsets
/// are relative to `buf`; see [`TarError::with_base`].
pub fn parse_sample(buf: &[u8]) -> Result<SampleView<'_>, TarError> {
    let mut src = SliceSource { buf, scope: "sample's byte range" };
    let mut key: Option<Cow<'_, str>> = None;
    let mut members: Vec<Member<'_>> = Vec::with_capacity(TYPICAL_MEMBERS);
    let mut offset = 0;
    while let Some(e) = next_entry(&mut src, offset, false)? {
        offset = e.next;
        if !e.regular {
            continue;
        }
        let name = resolve_name(&e.name, |_, r| src.bytes(r));
        let decoded = matches!(name, Cow::Owned(_));
        // A member that is no sample member is skipped whatever its name's bytes, as the index
        // skips it.
        let Some((k, raw_field)) = split_name(name) else { continue };
        if decoded && let Some(name) = non_utf8_name(&e.name, |_, r| src.bytes(r)) {
            // Refused when the shard was indexed; an index from before that may still lead here.
            return Err(TarError::NotUtf8Name { offset: e.header, name });
        }
        match &key {
            None => key = Some(k),
            Some(existing) if *existing == k => {}
            Some(existing) => {
                return Err(TarError::KeyMismatch {
                    offset: e.header,
                    name: format!("{k}.{raw_field}"),
                    key: existing.to_string(),
                });
            }
        }
        let field = normalize_field(raw_field);
        if members.iter().any(|m| m.field == field) {
            return Err(TarError::DuplicateField {
                offset: e.header,
                key: key.as_deref().unwrap_or_default().to_owned(),
                field: field.into_owned(),
            });
        }
        // next_entry checked data + size <= buf.len().
        let data = usize::try_from(e.data).ok().zip(usize::try_from(e.size).ok()).map(|(d, s)| d..d + s);
        let data = data.ok_or(TarError::Truncated { offset: e.data, what: "payload larger than memory" })?;
        members.push(Member { field, data });
    }
    let key = key.ok_or(TarError::NoMembers { offset: 0 })?;
    Ok(SampleView { key, members })
}
