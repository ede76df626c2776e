//! Batches as Arrow IPC: rows gathered from decoded row groups into one record batch, written as
//! one IPC stream (schema message, one record batch, end-of-stream marker; uncompressed; buffers
//! 64-byte aligned) into a ring slot or a `Vec`.
//!
//! In a ring slot the stream starts at [`ARROW_DATA_OFFSET`], after a slot header whose `n_fields`
//! is 0, `n_samples` the row count and `payload_bytes` the stream's length (the wire contract in
//! `shardstream_proto::ring`). The slot starts on a page and the offset is 64, so every Arrow
//! buffer in the stream is 64-byte aligned in the client's mapping, and `pyarrow.ipc.open_stream`
//! over the mapping yields arrays that point into it (zero-copy).
//!
//! Cost: one copy after the gather. The stream is measured first by writing it to a sink that only
//! counts ([`stream_len`]: arrow-ipc hands uncompressed buffers to the writer as they are, so this
//! copies nothing), then written straight into the slot ([`write_slot`]). Encoding into a `Vec` and
//! copying that into the slot cost two more copies of every batch and a fresh multi-MiB allocation
//! (page faults, zeroed pages) per batch: half the daemon's time on an image set
//! (bench/PARQUET_PROFILE.md).

use std::io::Write;

use arrow_array::RecordBatch;
use arrow_ipc::MetadataVersion;
use arrow_ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow_schema::{Schema, SchemaRef};
use shardstream_proto::ring::{ARROW_DATA_OFFSET, SLOT_HEADER_BYTES, SlotHeader};

use super::ParquetError;

pub use shardstream_proto::ring::IPC_ALIGN;

fn options() -> Result<IpcWriteOptions, ParquetError> {
    IpcWriteOptions::try_new(IPC_ALIGN, false, MetadataVersion::V5).map_err(ipc)
}

fn ipc(e: impl std::fmt::Display) -> ParquetError {
    ParquetError::Ipc(e.to_string())
}

/// The batch of rows `rows` (each `(source, row)`: row `row` of `sources[source]`), in that order;
/// every source has `schema`.
pub fn gather(
    schema: &SchemaRef,
    sources: &[&RecordBatch],
    rows: &[(usize, usize)],
) -> Result<RecordBatch, ParquetError> {
    if rows.is_empty() || sources.is_empty() {
        return Ok(RecordBatch::new_empty(schema.clone()));
    }
    if let Some(&(s, r)) = rows.iter().find(|&&(s, r)| sources.get(s).is_none_or(|b| r >= b.num_rows())) {
        return Err(ParquetError::Ipc(format!("row {r} of source {s} does not exist")));
    }
    // A batch of whole consecutive rows of one source is a slice, not a copy.
    if let Some(run) = contiguous(rows) {
        let (s, first) = rows[0];
        return Ok(sources[s].slice(first, run));
    }
    arrow_select::interleave::interleave_record_batch(sources, rows).map_err(ipc)
}

/// The length of `rows` when it is one source's consecutive rows.
fn contiguous(rows: &[(usize, usize)]) -> Option<usize> {
    let (s, first) = *rows.first()?;
    rows.iter().enumerate().all(|(i, &(si, r))| si == s && r == first + i).then_some(rows.len())
}

/// Writes `batch` as one IPC stream to `out`.
pub fn write_stream<W: Write>(batch: &RecordBatch, out: W) -> Result<W, ParquetError> {
    let mut w = StreamWriter::try_new_with_options(out, &batch.schema(), options()?).map_err(ipc)?;
    w.write(batch).map_err(ipc)?;
    w.into_inner().map_err(ipc)
}

/// `batch` as one IPC stream in a new buffer (the inline transport's `ArrowBatch.data`), allocated
/// once at its final size.
pub fn encode(batch: &RecordBatch) -> Result<Vec<u8>, ParquetError> {
    write_stream(batch, Vec::with_capacity(stream_len(batch)?))
}

/// The length of `batch`'s IPC stream (what [`encode`] and [`write_slot`] write), measured without
/// copying its buffers.
pub fn stream_len(batch: &RecordBatch) -> Result<usize, ParquetError> {
    Ok(write_stream(batch, Counter(0))?.0)
}

/// A sink that counts the bytes written to it.
struct Counter(usize);

impl Write for Counter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0 += data.len();
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The dataset's schema as an IPC stream holding only the schema message (`DatasetInfo.arrow_schema`;
/// `pyarrow.ipc.read_schema` and `pyarrow.ipc.open_stream(...).schema` both read it).
pub fn schema_message(schema: &Schema) -> Result<Vec<u8>, ParquetError> {
    let w = StreamWriter::try_new_with_options(Vec::new(), schema, options()?).map_err(ipc)?;
    w.into_inner().map_err(ipc)
}

/// Writes batch `batch_index` into ring slot `slot` (its whole bytes): the IPC stream from
/// [`ARROW_DATA_OFFSET`], then the slot header. Returns the stream's length (`ArrowBatch.length`).
/// A batch larger than the slot is [`ParquetError::SlotTooSmall`] with the bytes it needs, and
/// leaves the slot header untouched.
pub fn write_slot(slot: &mut [u8], batch_index: u64, batch: &RecordBatch) -> Result<u64, ParquetError> {
    let start = ARROW_DATA_OFFSET as usize;
    let capacity = slot.len().saturating_sub(start);
    let body = slot.get_mut(start..).unwrap_or_default();
    let w = write_stream(batch, SlotWriter { buf: body, pos: 0 })?;
    if w.pos > capacity {
        return Err(ParquetError::SlotTooSmall { needed: w.pos + start, capacity: slot.len() });
    }
    let len = w.pos as u64;
    write_slot_header(slot, batch_index, batch.num_rows() as u64, len);
    Ok(len)
}

/// The slot header of an Arrow batch of `rows` rows whose stream of `len` bytes lies in the slot
/// from [`ARROW_DATA_OFFSET`] (`slot` is at least that long).
pub fn write_slot_header(slot: &mut [u8], batch_index: u64, rows: u64, len: u64) {
    let header = SlotHeader::new(0, batch_index, rows, len).encode();
    slot[..SLOT_HEADER_BYTES].copy_from_slice(&header);
}

/// A writer into a fixed buffer that keeps counting past its end (discarding), so that a batch
/// too large for its slot reports the size it needs instead of failing midway.
struct SlotWriter<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Write for SlotWriter<'_> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        if let Some(dst) = self.buf.get_mut(self.pos..self.pos + data.len()) {
            dst.copy_from_slice(data);
        }
        self.pos += data.len();
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use arrow_ipc::reader::StreamReader;

    use super::super::testdata;
    use super::*;

    fn read_back(bytes: &[u8]) -> Vec<RecordBatch> {
        StreamReader::try_new(Cursor::new(bytes), None).unwrap().collect::<Result<Vec<_>, _>>().unwrap()
    }

    #[test]
    fn gathered_rows_round_trip_through_ipc() {
        let a = testdata::mixed_batch(0..10);
        let b = testdata::mixed_batch(100..110);
        let schema = a.schema();
        let rows = [(1, 3), (0, 9), (0, 0), (1, 9), (1, 0)];
        let got = gather(&schema, &[&a, &b], &rows).unwrap();
        let want = arrow_select::concat::concat_batches(
            &schema,
            &[
                testdata::mixed_batch(103..104),
                testdata::mixed_batch(9..10),
                testdata::mixed_batch(0..1),
                testdata::mixed_batch(109..110),
                testdata::mixed_batch(100..101),
            ],
        )
        .unwrap();
        assert_eq!(got, want);
        let bytes = encode(&got).unwrap();
        assert_eq!(read_back(&bytes), vec![want]);
        // Consecutive rows of one source: a slice.
        assert_eq!(gather(&schema, &[&a, &b], &[(0, 2), (0, 3), (0, 4)]).unwrap(), testdata::mixed_batch(2..5));
        assert_eq!(gather(&schema, &[&a], &[]).unwrap().num_rows(), 0);
        assert!(gather(&schema, &[&a], &[(0, 10)]).is_err());
        assert!(gather(&schema, &[&a], &[(1, 0)]).is_err());
    }

    #[test]
    fn a_slot_holds_header_then_an_aligned_stream() {
        let batch = testdata::mixed_batch(0..50);
        let mut slot = vec![0u8; 1 << 20];
        let len = write_slot(&mut slot, 7, &batch).unwrap();
        let h = SlotHeader::decode(slot[..SLOT_HEADER_BYTES].try_into().unwrap());
        assert_eq!((h.n_fields, h.batch_index, h.n_samples, h.payload_bytes), (0, 7, 50, len));
        let start = ARROW_DATA_OFFSET as usize;
        assert_eq!(read_back(&slot[start..start + len as usize]), vec![batch.clone()]);
        assert_eq!(&slot[start..start + len as usize], encode(&batch).unwrap().as_slice());
        assert_eq!(stream_len(&batch).unwrap(), len as usize);
        assert_eq!(
            stream_len(&RecordBatch::new_empty(batch.schema())).unwrap(),
            encode(&batch.slice(0, 0)).unwrap().len()
        );

        let mut small = vec![0u8; 4096];
        match write_slot(&mut small, 1, &batch) {
            Err(ParquetError::SlotTooSmall { needed, capacity }) => {
                assert_eq!(needed, start + len as usize);
                assert_eq!(capacity, 4096);
            }
            other => panic!("{other:?}"),
        }
        assert!(small[..SLOT_HEADER_BYTES].iter().all(|&b| b == 0));
    }

    #[test]
    fn the_schema_message_reads_back_as_the_schema() {
        let batch = testdata::mixed_batch(0..1);
        let bytes = schema_message(&batch.schema()).unwrap();
        let r = StreamReader::try_new(Cursor::new(bytes), None).unwrap();
        assert_eq!(r.schema(), batch.schema());
    }
}
