//! Arrow messages (rows of a Parquet dataset) opened as record batches, zero copy.
//!
//! Each message is one Arrow IPC stream: a schema message, any dictionary batches, then one record
//! batch. [`ArrowReader`] decodes it over the [`Buffer`] it is handed (a ring slot or a received
//! message, both aligned to [`IPC_ALIGN`]): every array of the batch points into those bytes, and
//! misaligned bytes are an error rather than a silent copy.
//!
//! Every message of a stream begins with the same schema message. Decoding it again for each
//! batch was a fixed cost a batch, large beside a batch of small rows; so the reader keeps the
//! first one's bytes and its schema, and reads each later message that begins with those same
//! bytes from past them. Schemas with dictionary columns are decoded whole each time (their
//! dictionaries travel between the schema and the batch).
//!
//! Columns the daemon sends as views ([`ARROW_VIEW_KEY`]: `fixed_size_binary(16)`, at the top or
//! inside structs) come out as `binary_view` arrays over the decoded row groups they point into
//! (the views' buffers, mapped read-only): no value is copied. Each view is checked against its
//! buffer first, so a bad batch is an error, never a read outside a mapping.
//!
//! The Python package opens batches with views this way and exports them through the Arrow C
//! data interface: rebuilding the view columns with pyarrow in Python cost 60-90 us a batch of
//! the consumer's core (bench/PARQUET_PROFILE.md). Batches without views it reads with pyarrow's
//! own IPC reader, which is cheaper than an export of many small columns.
//!
//! [`IPC_ALIGN`]: shardstream_proto::ring::IPC_ALIGN
//! [`ARROW_VIEW_KEY`]: shardstream_proto::ARROW_VIEW_KEY

use std::collections::HashMap;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, BinaryViewArray, FixedSizeBinaryArray, RecordBatch, StructArray};
use arrow_buffer::{Buffer, ScalarBuffer};
use arrow_ipc::{Message, MessageHeader};
use arrow_schema::{ArrowError, DataType, Field, FieldRef, Fields, Schema, SchemaRef};
use shardstream_proto::ARROW_VIEW_KEY;

/// The name of the rows' ids column the daemon writes into every batch.
pub const ROW_COLUMN: &str = "__row__";

/// Why a message could not be opened as a record batch.
#[derive(Debug, thiserror::Error)]
pub enum ArrowReadError {
    #[error("not a valid Arrow IPC stream: {0}")]
    Stream(String),
    #[error("record batch has {got} rows, the message names {expected}")]
    Rows { got: usize, expected: usize },
    #[error("column {column:?}: {reason}")]
    Views { column: String, reason: String },
}

fn stream_err(e: impl std::fmt::Display) -> ArrowReadError {
    ArrowReadError::Stream(e.to_string())
}

/// A stream's schema as received and as delivered.
#[derive(Debug)]
struct Known {
    /// The schema message's bytes: continuation marker, length, flatbuffer.
    prefix: Buffer,
    received: SchemaRef,
    delivered: SchemaRef,
    /// Whether any column (or struct child) is sent as views.
    views: bool,
    /// Whether the schema has the daemon's `__row__` column.
    has_row: bool,
}

/// Opens the Arrow messages of one stream; see the module docs.
#[derive(Debug, Default)]
pub struct ArrowReader {
    known: Option<Known>,
}

/// One opened message.
#[derive(Debug)]
pub struct Opened {
    pub batch: RecordBatch,
    /// Whether the batch has the daemon's `__row__` column (an older daemon wrote none).
    pub has_row: bool,
}

impl ArrowReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens `ipc` (one IPC stream of `rows` rows) as its record batch, with view columns over
    /// `views` (the views' buffer indices index it).
    ///
    /// A damaged stream is an error. arrow's decoder still panics on some damage no check here
    /// foresees (a negative fixed size in a schema, say: found by this module's property test),
    /// so a panic inside it is caught and returned as the stream's error too.
    pub fn open(&mut self, ipc: &Buffer, views: &[Buffer], rows: usize) -> Result<Opened, ArrowReadError> {
        let known = self.known.take();
        // Unwind safety: after a panic `self.known` is `None` (read the next schema afresh), and
        // nothing else the closure touches outlives it.
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| open(known, ipc, views, rows)))
            .unwrap_or_else(|panic| {
                let why = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("a panic");
                (None, Err(stream_err(format!("arrow's decoder failed on it: {why}"))))
            });
        self.known = opened.0;
        opened.1
    }
}

/// [`ArrowReader::open`] with the reader's kept schema: returns the schema to keep.
fn open(
    known: Option<Known>,
    ipc: &Buffer,
    views: &[Buffer],
    rows: usize,
) -> (Option<Known>, Result<Opened, ArrowReadError>) {
    let known = match known {
        Some(k) if ipc.len() > k.prefix.len() && ipc.as_slice().starts_with(k.prefix.as_slice()) => k,
        _ => match read_head(ipc) {
            Err(e) => return (None, Err(e)),
            // Not kept: each message carries its own dictionaries.
            Ok((known, at, Some(dictionaries))) => return (None, finish(&known, ipc, at, &dictionaries, views, rows)),
            Ok((known, _, None)) => known,
        },
    };
    let opened = finish(&known, ipc, known.prefix.len(), &HashMap::new(), views, rows);
    (Some(known), opened)
}

/// Decodes the record batch at `at` and delivers it.
fn finish(
    known: &Known,
    ipc: &Buffer,
    at: usize,
    dictionaries: &HashMap<i64, ArrayRef>,
    views: &[Buffer],
    rows: usize,
) -> Result<Opened, ArrowReadError> {
    let (message, body, _) = message_at(ipc, at)?.ok_or_else(|| stream_err("it ends before its record batch"))?;
    let fb = message
        .header_as_record_batch()
        .ok_or_else(|| stream_err(format!("expected a record batch message, found {:?}", message.header_type())))?;
    within_body(fb.buffers(), &body)?;
    let batch = arrow_ipc::reader::RecordBatchDecoder::try_new(
        &body,
        fb,
        known.received.clone(),
        dictionaries,
        &message.version(),
    )
    .and_then(|d| d.with_require_alignment(true).read_record_batch())
    .map_err(stream_err)?;
    if batch.num_rows() != rows {
        return Err(ArrowReadError::Rows { got: batch.num_rows(), expected: rows });
    }
    let batch = if known.views { delivered(batch, &known.delivered, views)? } else { batch };
    Ok(Opened { batch, has_row: known.has_row })
}

/// Reads the stream's schema message and the dictionary batches after it: the schema, where the
/// record batch's message begins, and the dictionaries when the schema has dictionary columns.
#[allow(clippy::type_complexity)]
fn read_head(ipc: &Buffer) -> Result<(Known, usize, Option<HashMap<i64, ArrayRef>>), ArrowReadError> {
    let (message, _, mut at) = message_at(ipc, 0)?.ok_or_else(|| stream_err("it is empty"))?;
    let fb = message
        .header_as_schema()
        .ok_or_else(|| stream_err(format!("expected a schema message first, found {:?}", message.header_type())))?;
    let received = Arc::new(arrow_ipc::convert::try_fb_to_schema(fb).map_err(stream_err)?);
    // A copy (a few hundred bytes once a stream): a slice would hold the first message's buffer,
    // its ring slot, for as long as the stream lasts.
    let prefix = Buffer::from(ipc.as_slice().get(..at).ok_or_else(|| stream_err("its schema message overruns it"))?);
    let mut views = false;
    let fields: Fields = received.fields().iter().map(|f| delivered_field(f, &mut views)).collect();
    let delivered = Arc::new(Schema::new_with_metadata(fields, received.metadata().clone()));
    let has_row = delivered.column_with_name(ROW_COLUMN).is_some();
    let known = Known { prefix, received, delivered, views, has_row };
    if !known.received.fields().iter().any(|f| has_dictionary(f.data_type())) {
        return Ok((known, at, None));
    }
    let mut dictionaries = HashMap::new();
    loop {
        let (message, body, next) =
            message_at(ipc, at)?.ok_or_else(|| stream_err("it ends before its record batch"))?;
        match message.header_type() {
            MessageHeader::DictionaryBatch => {
                let fb = message.header_as_dictionary_batch().ok_or_else(|| stream_err("bad dictionary batch"))?;
                within_body(fb.data().and_then(|d| d.buffers()), &body)?;
                arrow_ipc::reader::read_dictionary(&body, fb, &known.received, &mut dictionaries, &message.version())
                    .map_err(stream_err)?;
                at = next;
            }
            _ => return Ok((known, at, Some(dictionaries))),
        }
    }
}

/// Checks that every buffer a batch message names lies inside its body: arrow's decoder slices
/// them without a check, and would panic on a damaged message.
fn within_body(
    buffers: Option<flatbuffers::Vector<'_, arrow_ipc::Buffer>>,
    body: &Buffer,
) -> Result<(), ArrowReadError> {
    let buffers = buffers.ok_or_else(|| stream_err("a batch message without buffers"))?;
    for (i, b) in buffers.iter().enumerate() {
        let fits = u64::try_from(b.offset())
            .ok()
            .zip(u64::try_from(b.length()).ok())
            .and_then(|(o, l)| o.checked_add(l))
            .is_some_and(|end| end <= body.len() as u64);
        if !fits {
            return Err(stream_err(format!(
                "buffer {i} ({} bytes at {}) lies outside its body of {} bytes",
                b.length(),
                b.offset(),
                body.len()
            )));
        }
    }
    Ok(())
}

fn has_dictionary(t: &DataType) -> bool {
    match t {
        DataType::Dictionary(..) => true,
        DataType::Struct(fields) => fields.iter().any(|f| has_dictionary(f.data_type())),
        DataType::List(f) | DataType::LargeList(f) | DataType::FixedSizeList(f, _) | DataType::Map(f, _) => {
            has_dictionary(f.data_type())
        }
        _ => false,
    }
}

/// The message at `at` of `ipc`: its flatbuffer, its body and where the next one begins; `None`
/// at the stream's end (its end marker, or no bytes left).
fn message_at(ipc: &Buffer, at: usize) -> Result<Option<(Message<'_>, Buffer, usize)>, ArrowReadError> {
    let bytes = ipc.as_slice();
    let word = |at: usize| -> Result<u32, ArrowReadError> {
        bytes
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
            .ok_or_else(|| stream_err(format!("it ends inside a message header at byte {at}")))
    };
    if at == bytes.len() {
        return Ok(None);
    }
    let mut at = at;
    let mut len = word(at)?;
    at += 4;
    if len == u32::MAX {
        // The continuation marker of the current format; the length follows.
        len = word(at)?;
        at += 4;
    }
    if len == 0 {
        return Ok(None);
    }
    let end = at
        .checked_add(len as usize)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| stream_err(format!("a message of {len} bytes at byte {at} runs past its end")))?;
    let message = arrow_ipc::root_as_message(&bytes[at..end]).map_err(stream_err)?;
    let body_len = usize::try_from(message.bodyLength()).map_err(|_| stream_err("a negative message body length"))?;
    let body_end = end
        .checked_add(body_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| stream_err(format!("a message body of {body_len} bytes at byte {end} runs past its end")))?;
    Ok(Some((message, ipc.slice_with_length(end, body_len), body_end)))
}

fn is_view(f: &Field) -> bool {
    f.metadata().contains_key(ARROW_VIEW_KEY)
}

/// The field as the user sees it: view columns as `binary_view` (their marker dropped). Sets
/// `any` when it changed one.
fn delivered_field(f: &FieldRef, any: &mut bool) -> FieldRef {
    if is_view(f) {
        *any = true;
        let mut meta = f.metadata().clone();
        meta.remove(ARROW_VIEW_KEY);
        return Arc::new(Field::new(f.name(), DataType::BinaryView, f.is_nullable()).with_metadata(meta));
    }
    if let DataType::Struct(children) = f.data_type() {
        let mut inner = false;
        let children: Fields = children.iter().map(|c| delivered_field(c, &mut inner)).collect();
        if inner {
            *any = true;
            return Arc::new(f.as_ref().clone().with_data_type(DataType::Struct(children)));
        }
    }
    f.clone()
}

/// `batch` with its view columns as `binary_view` arrays over `buffers`.
fn delivered(batch: RecordBatch, schema: &SchemaRef, buffers: &[Buffer]) -> Result<RecordBatch, ArrowReadError> {
    let received = batch.schema();
    let columns = batch
        .columns()
        .iter()
        .zip(received.fields().iter().zip(schema.fields()))
        .map(|(array, (from, to))| {
            rebuilt(array, from, to, buffers)
                .map_err(|reason| ArrowReadError::Views { column: from.name().clone(), reason })
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(schema.clone(), columns).map_err(stream_err)
}

/// `array` (of field `from`, as received) as field `to` delivers it.
fn rebuilt(array: &ArrayRef, from: &Field, to: &Field, buffers: &[Buffer]) -> Result<ArrayRef, String> {
    if from.data_type() == to.data_type() {
        return Ok(array.clone());
    }
    if is_view(from) {
        let views = array
            .as_any()
            .downcast_ref::<FixedSizeBinaryArray>()
            .filter(|a| a.value_length() == 16)
            .ok_or_else(|| format!("a view column of type {}, not fixed_size_binary(16)", array.data_type()))?;
        return Ok(Arc::new(view_array(views, buffers)?));
    }
    let (DataType::Struct(from_children), DataType::Struct(to_children)) = (from.data_type(), to.data_type()) else {
        return Err(format!("cannot deliver {} as {}", from.data_type(), to.data_type()));
    };
    let array = array.as_any().downcast_ref::<StructArray>().ok_or("a struct field without a struct array")?;
    let children = array
        .columns()
        .iter()
        .zip(from_children.iter().zip(to_children.iter()))
        .map(|(c, (f, t))| rebuilt(c, f, t, buffers).map_err(|e| format!("{}: {e}", f.name())))
        .collect::<Result<Vec<_>, _>>()?;
    StructArray::try_new(to_children.clone(), children, array.nulls().cloned())
        .map(|a| Arc::new(a) as ArrayRef)
        .map_err(|e| e.to_string())
}

/// Binary views over `buffers`, each checked to lie inside the buffer it names.
fn view_array(views: &FixedSizeBinaryArray, buffers: &[Buffer]) -> Result<BinaryViewArray, String> {
    let data = views.values().slice_with_length(views.offset() * 16, views.len() * 16);
    let views_buf: ScalarBuffer<u128> = if data.as_ptr().align_offset(std::mem::align_of::<u128>()) == 0 {
        ScalarBuffer::new(data, 0, views.len())
    } else {
        // Not from an aligned stream (IPC buffers are 64-byte aligned): 16 bytes a row, copied.
        data.as_slice().chunks_exact(16).map(|c| u128::from_le_bytes(c.try_into().unwrap_or_default())).collect()
    };
    BinaryViewArray::try_new(views_buf, buffers.to_vec(), views.nulls().cloned()).map_err(|e| match e {
        ArrowError::InvalidArgumentError(m) => m,
        e => e.to_string(),
    })
}

#[cfg(test)]
mod tests;
