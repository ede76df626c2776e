//! Joining an inline Arrow batch the daemon split over several messages: a Parquet batch whose
//! IPC stream does not fit one gRPC message arrives as consecutive `ArrowBatch` parts with the
//! same index, `more` set on all but the last, each its own IPC stream of a run of the batch's
//! rows (`StreamRequest.arrow_parts_joined`).
//!
//! The parts are decoded, their rows concatenated and written again as one IPC stream, so the
//! layers above open the batch as any other message. That copies the batch twice; only batches
//! beyond the message limit (512 MiB) pay it.

use std::io::Cursor;

use arrow_array::RecordBatch;
use shardstream_proto::ArrowBatch;

use crate::ClientError;
use crate::parts::Part;

impl Part for ArrowBatch {
    const KIND: &'static str = "arrow batch";

    fn batch_index(&self) -> u64 {
        self.batch_index
    }

    fn more(&self) -> bool {
        self.more
    }

    fn check_part(&self) -> Result<(), ClientError> {
        if self.data.is_empty() || !self.part_indices.is_empty() {
            return Err(ClientError::Protocol(format!(
                "arrow batch {}: a part of a split batch must carry its rows inline and belong to one batch",
                self.batch_index
            )));
        }
        Ok(())
    }

    fn join(parts: Vec<Self>) -> Result<Self, ClientError> {
        join(parts)
    }
}

/// Joins a stream's split inline Arrow batches.
pub type ArrowJoiner = crate::parts::Joiner<ArrowBatch>;

/// One batch from its parts, in order: their rows concatenated into one record batch, written as
/// one IPC stream; the row ids likewise.
fn join(parts: Vec<ArrowBatch>) -> Result<ArrowBatch, ClientError> {
    let index = parts.first().map_or(0, |p| p.batch_index);
    let bad = |why: String| ClientError::Protocol(format!("arrow batch {index}: {why}"));
    let mut batches: Vec<RecordBatch> = Vec::with_capacity(parts.len());
    let mut row_ids = Vec::with_capacity(parts.iter().map(|p| p.row_ids.len()).sum());
    for (i, part) in parts.into_iter().enumerate() {
        let reader = arrow_ipc::reader::StreamReader::try_new(Cursor::new(&part.data[..]), None)
            .map_err(|e| bad(format!("part {i} is no Arrow IPC stream: {e}")))?;
        let mut rows = 0;
        for b in reader {
            let b = b.map_err(|e| bad(format!("part {i}: {e}")))?;
            rows += b.num_rows();
            batches.push(b);
        }
        if rows != part.row_ids.len() {
            return Err(bad(format!("part {i} holds {rows} rows but names {} row ids", part.row_ids.len())));
        }
        row_ids.extend(part.row_ids);
    }
    let schema =
        batches.first().map(RecordBatch::schema).ok_or_else(|| bad("its parts hold no record batch".into()))?;
    let joined = arrow_select::concat::concat_batches(&schema, &batches)
        .map_err(|e| bad(format!("its parts do not join (another schema?): {e}")))?;
    drop(batches);
    let mut data = Vec::with_capacity(joined.get_array_memory_size() + 4096);
    {
        let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut data, &schema)
            .map_err(|e| bad(format!("cannot write the joined batch: {e}")))?;
        w.write(&joined).map_err(|e| bad(format!("cannot write the joined batch: {e}")))?;
        w.finish().map_err(|e| bad(format!("cannot write the joined batch: {e}")))?;
    }
    Ok(ArrowBatch { batch_index: index, row_ids, length: data.len() as u64, data: data.into(), ..Default::default() })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{BinaryArray, Int64Array, StringArray};
    use arrow_schema::{DataType, Field, Schema};

    use super::*;

    fn rows(ids: std::ops::Range<i64>) -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("s", DataType::Utf8, true),
            Field::new("b", DataType::Binary, false),
        ]));
        let s: Vec<Option<String>> = ids.clone().map(|i| (i % 3 != 0).then(|| format!("row {i}"))).collect();
        let b: Vec<Vec<u8>> = ids.clone().map(|i| vec![i as u8; i as usize % 5]).collect();
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int64Array::from_iter_values(ids)),
                Arc::new(StringArray::from(s)),
                Arc::new(BinaryArray::from_iter_values(b)),
            ],
        )
        .unwrap()
    }

    fn part(index: u64, ids: std::ops::Range<i64>, more: bool) -> ArrowBatch {
        let mut data = Vec::new();
        let b = rows(ids.clone());
        let mut w = arrow_ipc::writer::StreamWriter::try_new(&mut data, &b.schema()).unwrap();
        w.write(&b).unwrap();
        w.finish().unwrap();
        drop(w);
        ArrowBatch {
            batch_index: index,
            row_ids: ids.map(|i| i as u64 + 1000).collect(),
            length: data.len() as u64,
            data: data.into(),
            more,
            ..Default::default()
        }
    }

    fn read(m: &ArrowBatch) -> RecordBatch {
        let mut r = arrow_ipc::reader::StreamReader::try_new(Cursor::new(&m.data[..]), None).unwrap();
        let b = r.next().unwrap().unwrap();
        assert!(r.next().is_none(), "one record batch");
        b
    }

    #[test]
    fn parts_join_into_one_stream_of_all_their_rows_in_order() {
        let mut j = ArrowJoiner::default();
        assert!(j.push(part(4, 0..3, true)).unwrap().is_none());
        assert!(j.push(part(4, 3..10, true)).unwrap().is_none());
        let whole = j.push(part(4, 10..11, false)).unwrap().unwrap();
        assert!(!whole.more && whole.batch_index == 4 && whole.length == whole.data.len() as u64);
        assert_eq!(whole.row_ids, (1000..1011).collect::<Vec<u64>>());
        assert_eq!(read(&whole), rows(0..11));
        // The joiner starts afresh, and a batch in one message passes as it came.
        let single = part(5, 0..2, false);
        assert_eq!(j.push(single.clone()).unwrap(), Some(single));
    }

    #[test]
    fn a_batch_that_ends_without_its_last_part_or_parts_that_disagree_are_refused() {
        let mut j = ArrowJoiner::default();
        j.push(part(1, 0..2, true)).unwrap();
        let e = j.push(part(2, 0..2, false)).unwrap_err().to_string();
        assert!(e.contains("ended without its last part"), "{e}");

        let mut j = ArrowJoiner::default();
        j.push(part(1, 0..2, true)).unwrap();
        let e = j.push(ArrowBatch { row_ids: vec![9], ..part(1, 2..4, false) }).unwrap_err().to_string();
        assert!(e.contains("part 1 holds 2 rows but names 1 row ids"), "{e}");

        let mut j = ArrowJoiner::default();
        let e = j.push(ArrowBatch { data: Default::default(), ..part(1, 0..2, true) }).unwrap_err().to_string();
        assert!(e.contains("must carry its rows inline"), "{e}");

        let mut j = ArrowJoiner::default();
        j.push(part(1, 0..2, true)).unwrap();
        let e = j.push(ArrowBatch { data: b"not arrow".to_vec().into(), ..part(1, 2..4, false) }).unwrap_err();
        assert!(e.to_string().contains("part 1 is no Arrow IPC stream"), "{e}");
    }
}
