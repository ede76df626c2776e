//! Joining an inline batch the daemon split over several messages: a batch whose bytes do not fit
//! one gRPC message arrives as consecutive `InlineBatch` parts with the same index, `more` set on
//! all but the last, each a run of whole samples with its own columns into its own `data`.
//!
//! Joining copies the parts' bytes into one buffer, so a batch is one contiguous buffer whatever
//! its size (the Python views and the `collate="stack"` path rely on that). Only batches beyond the
//! message limit (512 MiB) pay the copy.

use bytes::BytesMut;
use shardstream_proto::{FieldColumn, InlineBatch};

use crate::ClientError;
use crate::parts::Part;

impl Part for InlineBatch {
    const KIND: &'static str = "batch";

    fn batch_index(&self) -> u64 {
        self.batch_index
    }

    fn more(&self) -> bool {
        self.more
    }

    fn join(parts: Vec<Self>) -> Result<Self, ClientError> {
        join(parts)
    }
}

/// Joins a stream's split inline batches.
pub type Joiner = crate::parts::Joiner<InlineBatch>;

/// One batch from its parts, in order: keys and columns concatenated, each part's starts moved by
/// the bytes and its missing-sample indices by the samples of the parts before it.
fn join(parts: Vec<InlineBatch>) -> Result<InlineBatch, ClientError> {
    let batch_index = parts.first().map_or(0, |p| p.batch_index);
    let total = parts.iter().map(|p| p.data.len()).sum();
    let samples = parts.iter().map(|p| p.keys.len()).sum();
    let mut data = BytesMut::with_capacity(total);
    let mut keys = Vec::with_capacity(samples);
    let mut fields: Vec<FieldColumn> = parts
        .first()
        .map(|p| {
            p.fields
                .iter()
                .map(|f| FieldColumn {
                    name: f.name.clone(),
                    starts: Vec::with_capacity(samples),
                    lengths: Vec::with_capacity(samples),
                    missing: Vec::new(),
                })
                .collect()
        })
        .unwrap_or_default();
    for part in parts {
        let base = data.len() as u64;
        let first = u32::try_from(keys.len())
            .map_err(|_| ClientError::Protocol(format!("batch {batch_index} has more than 2^32 samples")))?;
        let same_columns =
            part.fields.len() == fields.len() && part.fields.iter().zip(&fields).all(|(p, f)| p.name == f.name);
        if !same_columns {
            return Err(ClientError::Protocol(format!("the parts of batch {batch_index} have different fields")));
        }
        for (col, p) in fields.iter_mut().zip(part.fields) {
            col.starts.extend(p.starts.iter().map(|s| s.saturating_add(base)));
            col.lengths.extend(p.lengths);
            col.missing.extend(p.missing.iter().map(|m| m.saturating_add(first)));
        }
        keys.extend(part.keys);
        data.extend_from_slice(&part.data);
    }
    Ok(InlineBatch { batch_index, keys, fields, data: data.freeze(), more: false })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn part(
        index: u64,
        keys: &[&str],
        data: &[u8],
        starts: &[u64],
        lengths: &[u64],
        missing: &[u32],
        more: bool,
    ) -> InlineBatch {
        InlineBatch {
            batch_index: index,
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            fields: vec![FieldColumn {
                name: "bin".into(),
                starts: starts.to_vec(),
                lengths: lengths.to_vec(),
                missing: missing.to_vec(),
            }],
            data: Bytes::copy_from_slice(data),
            more,
        }
    }

    fn field(b: &InlineBatch, i: usize) -> Option<&[u8]> {
        let col = &b.fields[0];
        if col.missing.contains(&(i as u32)) {
            return None;
        }
        let (s, l) = (col.starts[i] as usize, col.lengths[i] as usize);
        Some(&b.data[s..s + l])
    }

    #[test]
    fn a_whole_batch_passes_through() {
        let mut j = Joiner::default();
        let b = j.push(part(3, &["a"], b"xyz", &[1], &[2], &[], false)).unwrap().unwrap();
        assert_eq!((b.batch_index, field(&b, 0)), (3, Some(&b"yz"[..])));
    }

    #[test]
    fn parts_are_joined_with_offsets_and_missing_moved() {
        let mut j = Joiner::default();
        assert!(j.push(part(7, &["a", "b"], b"hAAtB", &[1, 4], &[2, 1], &[], true)).unwrap().is_none());
        assert!(j.push(part(7, &["c"], b"", &[0], &[0], &[0], true)).unwrap().is_none());
        let b = j.push(part(7, &["d", "e"], b"..DDEEE", &[2, 4], &[2, 3], &[], false)).unwrap().unwrap();
        assert_eq!(b.keys, ["a", "b", "c", "d", "e"]);
        assert!(!b.more && b.batch_index == 7);
        let got: Vec<_> = (0..5).map(|i| field(&b, i)).collect();
        assert_eq!(got, [Some(&b"AA"[..]), Some(b"B"), None, Some(b"DD"), Some(b"EEE")]);
        // The joiner is empty again: the next batch starts afresh.
        let next = j.push(part(8, &["f"], b"F", &[0], &[1], &[], false)).unwrap().unwrap();
        assert_eq!(field(&next, 0), Some(&b"F"[..]));
    }

    #[test]
    fn a_batch_cut_short_by_another_is_a_protocol_error() {
        let mut j = Joiner::default();
        assert!(j.push(part(1, &["a"], b"A", &[0], &[1], &[], true)).unwrap().is_none());
        let err = j.push(part(2, &["b"], b"B", &[0], &[1], &[], false)).unwrap_err();
        assert!(matches!(err, ClientError::Protocol(m) if m.contains("batch 1")));
    }
}
