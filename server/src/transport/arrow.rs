//! Arrow batches (Parquet datasets) on the wire, as `ArrowBatch` messages: inline, the IPC stream
//! travels in `data`; with shared memory, it lies in a slot of the stream's packed-mode ring
//! (slot header with `n_fields = 0`, `n_samples` = rows, `payload_bytes` = stream length; the
//! stream from `ring::ARROW_DATA_OFFSET`) and the message names ring, slot and length. The slot is
//! the client's until it releases the batch, as for packed batches; the ring, its budget and its
//! slot state machine are the packed mode's own ([`super::shm`]). With rdma the stream is written
//! at the start of a staging buffer ([`write_rows`]) that the daemon RDMA-writes into a slot of
//! the client's ring, and the message names that slot and the length.

use arrow_array::RecordBatch;
use shardstream_proto::ArrowBatch;
use shardstream_proto::ring::ARROW_DATA_OFFSET;

use crate::format::parquet::dataset::{BatchAssembler, BatchRows};
use crate::format::parquet::ipc;
use crate::transport::shm::SlotGuard;
use crate::{Error, Result};

fn ipc_error(e: crate::format::parquet::ParquetError) -> Error {
    Error::Internal(format!("cannot encode an Arrow batch: {e}"))
}

/// The inline form of batch `batch_index` (rows `row_ids`) from a gathered record batch.
pub fn inline_batch(batch_index: u64, row_ids: Vec<u64>, batch: &RecordBatch) -> Result<ArrowBatch> {
    Ok(inline_message(batch_index, row_ids, ipc::encode(batch).map_err(ipc_error)?))
}

fn inline_message(batch_index: u64, row_ids: Vec<u64>, data: Vec<u8>) -> ArrowBatch {
    ArrowBatch { batch_index, row_ids, length: data.len() as u64, data: data.into(), ..Default::default() }
}

/// Writes batch `batch_index` into a ring slot that `acquire` gives for the bytes it needs, and
/// returns the slot (to publish when the message is sent) with the message naming it.
pub fn shm_batch<'s>(
    batch_index: u64,
    row_ids: Vec<u64>,
    batch: &RecordBatch,
    acquire: impl FnOnce(u64) -> Result<SlotGuard<'s>>,
) -> Result<(SlotGuard<'s>, ArrowBatch)> {
    // Measured first (no copy), then written straight into the slot: one copy of the batch.
    let need = ipc::stream_len(batch).map_err(ipc_error)? as u64;
    let mut guard = acquire(ARROW_DATA_OFFSET + need)?;
    let length = ipc::write_slot(guard.bytes(), batch_index, batch).map_err(ipc_error)?;
    if length != need {
        return Err(Error::Internal(format!("an Arrow batch measured {need} bytes but wrote {length}")));
    }
    let msg = ArrowBatch { batch_index, row_ids, ring: guard.ring(), slot: guard.slot(), length, ..Default::default() };
    Ok((guard, msg))
}

/// Writes the rows of batch `batch_index` into a ring slot that `acquire` gives: straight from
/// the decoded row groups when every column is flat (one copy of each byte), else gathered into
/// a record batch first ([`shm_batch`]).
pub fn shm_rows<'s>(
    batch_index: u64,
    row_ids: Vec<u64>,
    asm: &BatchAssembler,
    rows: &BatchRows,
    acquire: impl FnOnce(u64) -> Result<SlotGuard<'s>>,
) -> Result<(SlotGuard<'s>, ArrowBatch)> {
    let schema = asm.schema();
    rows.with_direct(schema, asm.schema_message(), |plan| {
        let Some(plan) = plan else {
            return shm_batch(batch_index, row_ids, &rows.gather(schema, asm.schema_message())?, acquire);
        };
        let need = plan.stream_len() as u64;
        let mut guard = acquire(ARROW_DATA_OFFSET + need)?;
        let slot = guard.bytes();
        let length = match slot.get_mut(ARROW_DATA_OFFSET as usize..) {
            Some(body) => plan.write(body).map_err(ipc_error)? as u64,
            None => return Err(Error::Internal(format!("a ring slot of {} bytes holds no Arrow data", slot.len()))),
        };
        ipc::write_slot_header(slot, batch_index, rows.rows.len() as u64, length);
        let msg =
            ArrowBatch { batch_index, row_ids, ring: guard.ring(), slot: guard.slot(), length, ..Default::default() };
        Ok((guard, msg))
    })
}

/// What [`write_rows`] did with a staging buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    /// The IPC stream's length, written at the buffer's start.
    Bytes(usize),
    /// The stream needs this many bytes, more than the buffer has: nothing was written.
    Outgrows(usize),
}

/// Writes the rows' IPC stream at the start of `buf` (an rdma staging buffer) and says its
/// length: straight from the decoded row groups when every column is flat (one copy of each
/// byte), else gathered, encoded and copied. Rows that do not fit are not an error here: a caller
/// that grouped several batches sends fewer ([`outgrows_slot`] is the error otherwise).
pub fn write_rows(asm: &BatchAssembler, rows: &BatchRows, buf: &mut [u8]) -> Result<Written> {
    let slot = buf.len();
    let schema = asm.schema();
    rows.with_direct(schema, asm.schema_message(), |plan| match plan {
        Some(plan) if plan.stream_len() > slot => Ok(Written::Outgrows(plan.stream_len())),
        Some(plan) => plan.write(buf).map(Written::Bytes).map_err(ipc_error),
        None => {
            let bytes = rows.encode(schema, asm.schema_message())?;
            let Some(dst) = buf.get_mut(..bytes.len()) else { return Ok(Written::Outgrows(bytes.len())) };
            dst.copy_from_slice(&bytes);
            Ok(Written::Bytes(bytes.len()))
        }
    })
}

/// The error for a batch of `need` bytes that the client's `slot`-byte ring slots cannot hold.
pub fn outgrows_slot(need: usize, slot: usize) -> Error {
    Error::invalid(format!(
        "an Arrow batch of {need} bytes does not fit the client's {slot}-byte rdma ring slots; raise \
         SHARDSTREAM_RDMA_SLOT_BYTES or lower batch_size"
    ))
}

/// What [`inline_rows`] made of a batch.
#[derive(Debug)]
pub enum Inline {
    /// The batch's messages: one, or (split) several with `more` set on all but the last.
    Sent(Vec<ArrowBatch>),
    /// The row with id `row` is `bytes` long as Arrow by itself, beyond any message.
    RowTooLarge { row: u64, bytes: u64 },
    /// The batch is `bytes` long, beyond one message, and the client joins no parts.
    BatchTooLarge { bytes: u64 },
}

/// The inline form of batch `batch_index` (rows `row_ids`) from its decoded rows: one message when
/// its IPC stream is at most `limit` bytes, else, when the client joins parts (`split`), runs of
/// its rows in order, each its own IPC stream of at most `limit` bytes (a run that turns out
/// longer is split again: rows differ in size). A split costs a copy of the batch per part's
/// encoding and no more memory than the batch itself, which the messages hold until sent.
pub fn inline_rows(
    batch_index: u64,
    row_ids: Vec<u64>,
    asm: &BatchAssembler,
    rows: &BatchRows,
    limit: u64,
    split: bool,
) -> Result<Inline> {
    let (schema, schema_message) = (asm.schema(), asm.schema_message());
    // Flat columns are measured before they are written, so a batch to split is not also
    // written whole (Err: its length, beyond the limit); others are gathered and encoded.
    let flat = rows.with_direct(schema, schema_message, |plan| {
        let Some(plan) = plan else { return Ok(None) };
        let len = plan.stream_len();
        if len as u64 > limit {
            return Ok(Some(Err(len as u64)));
        }
        let mut out = vec![0u8; len];
        plan.write(&mut out).map_err(ipc_error)?;
        Ok(Some(Ok(out)))
    })?;
    let whole = match flat {
        Some(whole) => whole,
        None => Ok(rows.encode(schema, schema_message)?),
    };
    let bytes = match whole {
        Ok(data) if data.len() as u64 <= limit => {
            return Ok(Inline::Sent(vec![inline_message(batch_index, row_ids, data)]));
        }
        Ok(data) => data.len() as u64,
        Err(len) => len,
    };
    if let [row] = row_ids[..] {
        return Ok(Inline::RowTooLarge { row, bytes });
    }
    if !split {
        return Ok(Inline::BatchTooLarge { bytes });
    }
    let mut parts = Vec::new();
    if let Some(too_large) = split_runs(batch_index, &row_ids, rows, 0..row_ids.len(), bytes, limit, asm, &mut parts)? {
        return Ok(too_large);
    }
    let last = parts.len().saturating_sub(1);
    for part in &mut parts[..last] {
        part.more = true;
    }
    Ok(Inline::Sent(parts))
}

/// Appends to `parts` the messages of the rows `run` (`bytes` long as one stream, beyond
/// `limit`): as many even runs as the bytes need with a tenth to spare, each split again should
/// it still not fit. `Some`: a single row beyond the limit.
#[allow(clippy::too_many_arguments)]
fn split_runs(
    batch_index: u64,
    row_ids: &[u64],
    rows: &BatchRows,
    run: std::ops::Range<usize>,
    bytes: u64,
    limit: u64,
    asm: &BatchAssembler,
    parts: &mut Vec<ArrowBatch>,
) -> Result<Option<Inline>> {
    let n = run.len();
    let pieces = usize::try_from((bytes + bytes / 10).div_ceil(limit.max(1))).unwrap_or(n).clamp(2, n.max(2));
    for k in 0..pieces {
        let sub = run.start + n * k / pieces..run.start + n * (k + 1) / pieces;
        if sub.is_empty() {
            continue;
        }
        let part = rows.run(sub.clone()).ok_or_else(|| Error::Internal(format!("rows {sub:?} of a batch of {n}")))?;
        let data = part.encode(asm.schema(), asm.schema_message())?;
        let ids = &row_ids[sub.clone()];
        if data.len() as u64 <= limit {
            parts.push(inline_message(batch_index, ids.to_vec(), data));
        } else if let [row] = ids[..] {
            return Ok(Some(Inline::RowTooLarge { row, bytes: data.len() as u64 }));
        } else if let Some(too_large) =
            split_runs(batch_index, row_ids, rows, sub, data.len() as u64, limit, asm, parts)?
        {
            return Ok(Some(too_large));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;
    use std::sync::Arc;

    use arrow_array::{Int32Array, StringArray};
    use arrow_schema::{DataType, Field, Schema};

    use super::*;

    fn batch() -> RecordBatch {
        let s =
            Arc::new(Schema::new(vec![Field::new("x", DataType::Int32, false), Field::new("s", DataType::Utf8, true)]));
        RecordBatch::try_new(
            s,
            vec![
                Arc::new(Int32Array::from(vec![1, 2, 3])),
                Arc::new(StringArray::from(vec![Some("a"), None, Some("c")])),
            ],
        )
        .unwrap()
    }

    fn read(bytes: &[u8]) -> RecordBatch {
        let mut r = arrow_ipc::reader::StreamReader::try_new(Cursor::new(bytes), None).unwrap();
        r.next().unwrap().unwrap()
    }

    #[test]
    fn inline_carries_the_stream_and_the_row_ids() {
        let m = inline_batch(4, vec![9, 1, 5], &batch()).unwrap();
        assert_eq!((m.batch_index, m.row_ids.as_slice(), m.length), (4, &[9, 1, 5][..], m.data.len() as u64));
        assert_eq!(read(&m.data), batch());
    }
}
