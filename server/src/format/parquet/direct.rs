//! Rows of decoded row groups gathered straight into Arrow IPC bytes (a ring slot), without first
//! building the gathered record batch.
//!
//! [`super::ipc::gather`] followed by [`super::ipc::write_slot`] copies every delivered byte twice:
//! `interleave` into new arrays, then the IPC writer into the slot. With large rows (images) that
//! second copy and the fresh pages of the first were most of the daemon's time once row groups are
//! decoded (bench/PARQUET_PROFILE.md). Here each row's bytes are copied once, from the decoded row
//! group to their place in the slot.
//!
//! Only flat columns are written this way: fixed-width primitives (integers, floats, decimals,
//! dates, times, timestamps, durations, intervals), booleans, `binary`/`string` and their `large_`
//! forms, `fixed_size_binary`, and structs of flat columns (a Hugging Face image is
//! `{bytes, path}`). A delivered schema with any other column (lists, maps, dictionaries, view
//! types) is [`Direct::plan`]'s `None`, and the caller gathers as before. The
//! sources may hold binary and string columns as views (the decoded row groups of a flat
//! projection do, see [`super::schema`]): each row is written as the delivered type.
//!
//! A batch may end with a column of its rows' ids (`uint64`, no nulls; the `__row__` column the
//! client would otherwise append to every batch, see [`super::dataset::ROW_COLUMN`]), written from
//! the ids rather than gathered from a source.
//!
//! The bytes written are exactly what arrow-ipc's `StreamWriter` writes for the gathered batch
//! (schema message, one record batch message, end-of-stream marker; metadata V5, uncompressed,
//! buffers 64-byte aligned): the tests compare them byte for byte, so a client cannot tell the two
//! paths apart. One freedom is taken: the bits past a bitmap's last row, which Arrow leaves
//! undefined, are always zero here, where a gathered batch may carry a source's neighbouring bits
//! there and the stream writer writes them as it finds them.

use arrow_array::cast::AsArray;
use arrow_array::{Array, RecordBatch};
use arrow_ipc::{FieldNode, MessageBuilder, MessageHeader, MetadataVersion, RecordBatchBuilder};
use arrow_schema::{DataType, Schema};

use super::ParquetError;
use super::ipc::IPC_ALIGN;

const ALIGN: usize = IPC_ALIGN;
const CONTINUATION: [u8; 4] = [0xff; 4];
/// The end-of-stream marker: a continuation and a zero metadata length.
const EOS: [u8; 8] = [0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0];

fn pad(len: usize) -> usize {
    len.div_ceil(ALIGN) * ALIGN
}

/// How one column's values are laid out (Arrow columnar format, one buffer besides validity, two
/// for variable-width bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    /// `width` bytes per row.
    Fixed(usize),
    /// One bit per row.
    Bool,
    /// Offsets (`i32`, or `i64` when `wide`) and values.
    Bytes { wide: bool },
    /// A struct of flat children (a Hugging Face image is `{bytes, path}`): its validity, then
    /// each child as a column of its own.
    Struct(Vec<Kind>),
    /// A binary column delivered as views ([`super::dataset::VIEW_KEY`]): 16 bytes a row, each an
    /// Arrow binary view whose buffer index is the row's source (the batch's `view_slots`
    /// follow the sources' order). The sources' columns are `BinaryView` over one arena each.
    View,
}

/// Whether `dt` is a flat column type (see the module docs), which [`Direct`] writes.
pub fn is_flat(dt: &DataType) -> bool {
    kind(dt).is_some()
}

/// Whether a source column of type `got` holds values of the delivered type `want`: the same
/// type, or a view of the same kind of bytes (decoded row groups hold views; see
/// [`super::schema`]).
fn holds(want: &DataType, got: &DataType) -> bool {
    match (want, got) {
        (DataType::Binary | DataType::LargeBinary, DataType::BinaryView) => true,
        (DataType::Utf8 | DataType::LargeUtf8, DataType::Utf8View) => true,
        (DataType::Struct(w), DataType::Struct(g)) => {
            w.len() == g.len() && w.iter().zip(g.iter()).all(|(w, g)| w.name() == g.name() && fits(w, g.data_type()))
        }
        _ => want == got,
    }
}

/// Whether a source column of type `got` holds the delivered field `want`: a view field (see
/// [`Kind::View`]) holds `BinaryView` sources, any other as [`holds`].
fn fits(want: &arrow_schema::Field, got: &DataType) -> bool {
    match field_kind(want) {
        Some(Kind::View) => *got == DataType::BinaryView,
        _ => holds(want.data_type(), got),
    }
}

/// A delivered field's [`Kind`]: a view column by its metadata, else by its type.
fn field_kind(f: &arrow_schema::Field) -> Option<Kind> {
    if f.metadata().contains_key(super::dataset::VIEW_KEY) {
        return (f.data_type() == &DataType::FixedSizeBinary(16)).then_some(Kind::View);
    }
    kind(f.data_type())
}

fn kind(dt: &DataType) -> Option<Kind> {
    match dt {
        DataType::Boolean => Some(Kind::Bool),
        DataType::Binary | DataType::Utf8 => Some(Kind::Bytes { wide: false }),
        DataType::LargeBinary | DataType::LargeUtf8 => Some(Kind::Bytes { wide: true }),
        DataType::FixedSizeBinary(w) => usize::try_from(*w).ok().map(Kind::Fixed),
        DataType::Struct(fields) if !fields.is_empty() => {
            fields.iter().map(|f| field_kind(f)).collect::<Option<Vec<_>>>().map(Kind::Struct)
        }
        DataType::Dictionary(..) => None,
        other => other.primitive_width().map(Kind::Fixed),
    }
}

/// One batch's rows, measured and ready to be written: the record batch message's metadata and
/// the layout of its body.
pub struct Direct<'a> {
    sources: &'a [&'a RecordBatch],
    rows: &'a [(usize, usize)],
    /// The rows' ids, written as the batch's last column.
    ids: Option<&'a [u64]>,
    kinds: Vec<Kind>,
    /// Per Arrow node (each column, then a struct's children, in the message's order): its null
    /// count and, for bytes columns, the total length of its values.
    nodes: Vec<Node>,
    /// The schema message as the stream writer frames it (continuation, length, metadata,
    /// padding).
    schema_message: &'a [u8],
    /// The record batch message's flatbuffer.
    meta: Vec<u8>,
    body_len: usize,
}

/// The schema message of a stream of `schema` (what [`Direct::plan`] needs; made once per stream).
pub fn schema_message(schema: &Schema) -> Result<Vec<u8>, ParquetError> {
    let mut stream = super::ipc::schema_message(schema)?;
    if !stream.ends_with(&EOS) {
        return Err(ParquetError::Ipc("a schema-only stream did not end with the end-of-stream marker".into()));
    }
    stream.truncate(stream.len() - EOS.len());
    Ok(stream)
}

impl<'a> Direct<'a> {
    /// The batch of rows `rows` (each `(source, row)`) of `sources`, all with the schema whose
    /// message is `schema_message`; `None` when a column is not flat (see the module docs) or the
    /// sources' columns do not match. Rows must exist (the caller checks them, as `gather` does).
    /// With `ids` (one per row), `schema`'s last field is a `uint64` column the sources do not
    /// have, written from `ids`.
    pub fn plan(
        schema: &Schema,
        schema_message: &'a [u8],
        sources: &'a [&'a RecordBatch],
        rows: &'a [(usize, usize)],
        ids: Option<&'a [u64]>,
    ) -> Result<Option<Self>, ParquetError> {
        let fields = schema.fields();
        let gathered = match ids {
            Some(ids) => {
                if ids.len() != rows.len() {
                    return Err(ParquetError::Ipc(format!("{} row ids for {} rows", ids.len(), rows.len())));
                }
                match fields.last() {
                    Some(f) if f.data_type() == &DataType::UInt64 => &fields[..fields.len() - 1],
                    _ => return Err(ParquetError::Ipc("a batch with row ids needs a last uint64 column".into())),
                }
            }
            None => &fields[..],
        };
        let kinds: Option<Vec<Kind>> = gathered.iter().map(|f| field_kind(f)).collect();
        let Some(kinds) = kinds else { return Ok(None) };
        if sources.iter().any(|b| b.num_columns() != kinds.len()) {
            return Ok(None);
        }
        for (c, f) in gathered.iter().enumerate() {
            if sources.iter().any(|b| !fits(f, b.column(c).data_type())) {
                return Ok(None);
            }
        }
        if let Some(&(s, r)) = rows.iter().find(|&&(s, r)| sources.get(s).is_none_or(|b| r >= b.num_rows())) {
            return Err(ParquetError::Ipc(format!("row {r} of source {s} does not exist")));
        }
        let n = rows.len();
        let mut layout = Layout { rows, nodes: Vec::new(), fb_nodes: Vec::new(), buffers: Vec::new(), offset: 0 };
        for (c, k) in kinds.iter().enumerate() {
            let cols: Vec<&dyn Array> = sources.iter().map(|b| b.column(c).as_ref()).collect();
            layout.column(&cols, k)?;
        }
        if ids.is_some() {
            layout.id_column();
        }
        let Layout { nodes, fb_nodes, buffers, offset, .. } = layout;
        // Built in the stream writer's order (buffers, nodes, batch, message), so the metadata
        // is byte for byte what it writes.
        let mut fbb = flatbuffers::FlatBufferBuilder::new();
        let buffers = fbb.create_vector(&buffers);
        let fb_nodes = fbb.create_vector(&fb_nodes);
        let mut batch = RecordBatchBuilder::new(&mut fbb);
        batch.add_length(n as i64);
        batch.add_nodes(fb_nodes);
        batch.add_buffers(buffers);
        let batch = batch.finish();
        let mut message = MessageBuilder::new(&mut fbb);
        message.add_version(MetadataVersion::V5);
        message.add_header_type(MessageHeader::RecordBatch);
        message.add_bodyLength(offset as i64);
        message.add_header(batch.as_union_value());
        let root = message.finish();
        fbb.finish(root, None);
        let meta = fbb.finished_data().to_vec();
        Ok(Some(Self { sources, rows, ids, kinds, nodes, schema_message, meta, body_len: offset }))
    }

    /// Bytes of the record batch message's framing: continuation, length, metadata, padding.
    fn header_len(&self) -> usize {
        pad(8 + self.meta.len())
    }

    /// The stream's length: what [`Self::write`] writes.
    pub fn stream_len(&self) -> usize {
        self.schema_message.len() + self.header_len() + self.body_len + EOS.len()
    }

    /// Writes the stream into `out[..self.stream_len()]`; returns its length. `out` shorter than that
    /// is an error and leaves it partly written.
    pub fn write(&self, out: &mut [u8]) -> Result<usize, ParquetError> {
        let len = self.stream_len();
        let Some(out) = out.get_mut(..len) else {
            return Err(ParquetError::Ipc(format!("a {len}-byte stream does not fit {} bytes", out.len())));
        };
        let (schema, rest) = out.split_at_mut(self.schema_message.len());
        schema.copy_from_slice(self.schema_message);
        let (header, rest) = rest.split_at_mut(self.header_len());
        let padded_meta = self.header_len() - 8;
        header[..4].copy_from_slice(&CONTINUATION);
        header[4..8].copy_from_slice(&(padded_meta as i32).to_le_bytes());
        header[8..8 + self.meta.len()].copy_from_slice(&self.meta);
        header[8 + self.meta.len()..].fill(0);
        let (mut body, eos) = rest.split_at_mut(self.body_len);
        eos.copy_from_slice(&EOS);
        let mut nodes = self.nodes.iter();
        for (c, k) in self.kinds.iter().enumerate() {
            let cols: Vec<&dyn Array> = self.sources.iter().map(|b| b.column(c).as_ref()).collect();
            body = self.write_column(&cols, k, &mut nodes, body).map_err(|e| {
                let name = self.sources.first().map(|b| b.schema().field(c).name().clone()).unwrap_or_default();
                ParquetError::Ipc(format!("column {name:?}: {e}"))
            })?;
        }
        if let Some(ids) = self.ids {
            nodes.next().ok_or_else(|| ParquetError::Ipc("a batch's layout lost its row ids".into()))?;
            let (dst, _) = take(body, ids.len() * 8);
            if dst.len() != ids.len() * 8 {
                return Err(ParquetError::Ipc(format!("no room for {} row ids in a batch", ids.len())));
            }
            for (d, id) in dst.chunks_exact_mut(8).zip(ids) {
                d.copy_from_slice(&id.to_le_bytes());
            }
        }
        Ok(len)
    }

    /// Writes the buffers of one column (`cols`: its array in each source; `nodes`: this column's
    /// node first) at the start of `body`; returns the rest of `body`.
    fn write_column<'b>(
        &self,
        cols: &[&dyn Array],
        k: &Kind,
        nodes: &mut std::slice::Iter<'_, Node>,
        body: &'b mut [u8],
    ) -> Result<&'b mut [u8], ParquetError> {
        let n = self.rows.len();
        let node = *nodes.next().ok_or_else(|| ParquetError::Ipc("a batch's layout lost a column".into()))?;
        let body = if node.nulls > 0 {
            let (bits, rest) = take(body, n.div_ceil(8));
            set_bits(bits, self.rows.iter().map(|&(s, r)| cols[s].is_valid(r)));
            rest
        } else {
            body
        };
        match k {
            &Kind::Fixed(w) => {
                let (dst, rest) = take(body, n * w);
                let values: Vec<&[u8]> = cols.iter().map(|a| fixed_bytes(*a)).collect();
                match w {
                    1 => copy_fixed::<1>(dst, &values, self.rows),
                    2 => copy_fixed::<2>(dst, &values, self.rows),
                    4 => copy_fixed::<4>(dst, &values, self.rows),
                    8 => copy_fixed::<8>(dst, &values, self.rows),
                    16 => copy_fixed::<16>(dst, &values, self.rows),
                    _ => copy_width(dst, &values, self.rows, w),
                }
                .ok_or_else(short)?;
                Ok(rest)
            }
            Kind::Bool => {
                let (bits, rest) = take(body, n.div_ceil(8));
                let bools: Vec<_> = cols.iter().map(|a| a.as_boolean_opt()).collect();
                let mut values = Vec::with_capacity(n);
                for &(s, r) in self.rows {
                    values.push(bools[s].ok_or_else(short)?.value(r));
                }
                set_bits(bits, values.into_iter());
                Ok(rest)
            }
            &Kind::Bytes { wide } => {
                let width = if wide { 8 } else { 4 };
                let (offsets, rest) = take(body, (n + 1) * width);
                let (values, rest) = take(rest, node.value_bytes);
                let bytes = byte_columns(cols);
                let valid = validity(cols, node.nulls);
                let mut at = 0usize;
                for (i, &(s, r)) in self.rows.iter().enumerate() {
                    // A null row is empty: a view array leaves whatever view was there under a
                    // null, where the offsets of binary arrays make it empty.
                    let v = if valid(s, r) { bytes[s].value(r).ok_or_else(short)? } else { &[] };
                    write_offset(offsets, i, at, wide)?;
                    values.get_mut(at..at + v.len()).ok_or_else(short)?.copy_from_slice(v);
                    at += v.len();
                }
                write_offset(offsets, n, at, wide)?;
                Ok(rest)
            }
            Kind::Struct(children) => {
                let mut body = body;
                for (i, child) in children.iter().enumerate() {
                    let kids = struct_children(cols, i)?;
                    body = self.write_column(&kids, child, nodes, body)?;
                }
                Ok(body)
            }
            Kind::View => {
                let (dst, rest) = take(body, n * 16);
                let views: Vec<&arrow_array::BinaryViewArray> =
                    cols.iter().map(|a| a.as_binary_view_opt().ok_or_else(short)).collect::<Result<_, _>>()?;
                if let Some(s) = views.iter().position(|v| v.data_buffers().len() > 1) {
                    return Err(ParquetError::Ipc(format!("source {s} of a view column is not over one arena")));
                }
                let valid = validity(cols, node.nulls);
                if dst.len() != n * 16 {
                    return Err(short());
                }
                for (d, &(s, r)) in dst.chunks_exact_mut(16).zip(self.rows) {
                    let v = if valid(s, r) { *views[s].views().get(r).ok_or_else(short)? } else { 0 };
                    d.copy_from_slice(&view_for_source(v, s).to_le_bytes());
                }
                Ok(rest)
            }
        }
    }
}

/// A source's view `v` as the batch's: a value kept outside its view (over 12 bytes) points into
/// buffer `source` (the batch's arena of that source; its offset there is unchanged).
fn view_for_source(v: u128, source: usize) -> u128 {
    if (v as u32) <= 12 {
        return v;
    }
    let keep = !(u128::from(u32::MAX) << 64);
    (v & keep) | ((source as u128) << 64)
}

/// What [`Layout`] measured of one Arrow node.
#[derive(Debug, Clone, Copy)]
struct Node {
    nulls: usize,
    value_bytes: usize,
}

/// The record batch message's nodes and buffers, measured column by column in the message's
/// order (a struct's node, then its children's).
struct Layout<'r> {
    rows: &'r [(usize, usize)],
    nodes: Vec<Node>,
    fb_nodes: Vec<FieldNode>,
    buffers: Vec<arrow_ipc::Buffer>,
    offset: usize,
}

impl Layout<'_> {
    fn push(&mut self, len: usize) {
        self.buffers.push(arrow_ipc::Buffer::new(self.offset as i64, len as i64));
        self.offset += pad(len);
    }

    /// The rows' ids: a `uint64` column without nulls.
    fn id_column(&mut self) {
        let n = self.rows.len();
        self.fb_nodes.push(FieldNode::new(n as i64, 0));
        self.push(0);
        self.nodes.push(Node { nulls: 0, value_bytes: 0 });
        self.push(n * 8);
    }

    fn column(&mut self, cols: &[&dyn Array], k: &Kind) -> Result<(), ParquetError> {
        let n = self.rows.len();
        let nulls = null_count(cols, self.rows);
        self.fb_nodes.push(FieldNode::new(n as i64, nulls as i64));
        self.push(if nulls > 0 { n.div_ceil(8) } else { 0 });
        let at = self.nodes.len();
        self.nodes.push(Node { nulls, value_bytes: 0 });
        match k {
            Kind::Fixed(w) => self.push(n * w),
            Kind::View => self.push(n * 16),
            Kind::Bool => self.push(n.div_ceil(8)),
            &Kind::Bytes { wide } => {
                let bytes = byte_columns(cols);
                let valid = validity(cols, nulls);
                let values = self
                    .rows
                    .iter()
                    .map(|&(s, r)| if valid(s, r) { bytes[s].value(r).map_or(0, <[u8]>::len) } else { 0 })
                    .sum();
                self.nodes[at].value_bytes = values;
                self.push((n + 1) * if wide { 8 } else { 4 });
                self.push(values);
            }
            Kind::Struct(children) => {
                for (i, child) in children.iter().enumerate() {
                    self.column(&struct_children(cols, i)?, child)?;
                }
            }
        }
        Ok(())
    }
}

/// Child `i` of a struct column in every source.
fn struct_children<'a>(cols: &[&'a dyn Array], i: usize) -> Result<Vec<&'a dyn Array>, ParquetError> {
    cols.iter().map(|a| Ok(a.as_struct_opt().ok_or_else(short)?.column(i).as_ref())).collect()
}

/// A bytes column of one source: its offsets (already the array's slice) and values.
enum ByteColumn<'a> {
    Narrow(&'a [i32], &'a [u8]),
    Wide(&'a [i64], &'a [u8]),
    BinaryView(&'a arrow_array::BinaryViewArray),
    StringView(&'a arrow_array::StringViewArray),
    /// Not a bytes column (`plan` checked the types; reads as too short).
    None,
}

impl ByteColumn<'_> {
    fn value(&self, r: usize) -> Option<&[u8]> {
        let (a, z, data) = match self {
            ByteColumn::Narrow(o, d) => (usize::try_from(*o.get(r)?).ok()?, usize::try_from(*o.get(r + 1)?).ok()?, d),
            ByteColumn::Wide(o, d) => (usize::try_from(*o.get(r)?).ok()?, usize::try_from(*o.get(r + 1)?).ok()?, d),
            ByteColumn::BinaryView(v) => return (r < v.len()).then(|| v.value(r)),
            ByteColumn::StringView(v) => return (r < v.len()).then(|| v.value(r).as_bytes()),
            ByteColumn::None => return None,
        };
        data.get(a..z)
    }
}

/// A column of every source as a [`ByteColumn`] (resolved once per batch, not per row).
fn byte_columns<'a>(cols: &[&'a dyn Array]) -> Vec<ByteColumn<'a>> {
    cols.iter()
        .map(|&a| {
            if let Some(x) = a.as_binary_opt::<i32>() {
                ByteColumn::Narrow(x.value_offsets(), x.value_data())
            } else if let Some(x) = a.as_string_opt::<i32>() {
                ByteColumn::Narrow(x.value_offsets(), x.value_data())
            } else if let Some(x) = a.as_binary_opt::<i64>() {
                ByteColumn::Wide(x.value_offsets(), x.value_data())
            } else if let Some(x) = a.as_string_opt::<i64>() {
                ByteColumn::Wide(x.value_offsets(), x.value_data())
            } else if let Some(x) = a.as_binary_view_opt() {
                ByteColumn::BinaryView(x)
            } else if let Some(x) = a.as_string_view_opt() {
                ByteColumn::StringView(x)
            } else {
                ByteColumn::None
            }
        })
        .collect()
}

fn short() -> ParquetError {
    ParquetError::Ipc("a column of a source does not match its rows".into())
}

/// Whether row `r` of source `s` holds a value, for a column (`cols`, one array per source) with
/// `nulls` nulls among the batch's rows (none: every row, without looking).
fn validity<'a>(cols: &[&'a dyn Array], nulls: usize) -> impl Fn(usize, usize) -> bool + 'a {
    let bitmaps: Vec<_> = if nulls == 0 { Vec::new() } else { cols.iter().map(|a| a.nulls()).collect() };
    move |s, r| bitmaps.get(s).is_none_or(|n| n.is_none_or(|n| n.is_valid(r)))
}

/// Nulls of a column among `rows`; no pass over the rows when no source has any.
fn null_count(cols: &[&dyn Array], rows: &[(usize, usize)]) -> usize {
    let nulls: Vec<_> = cols.iter().map(|a| a.nulls().filter(|n| n.null_count() > 0)).collect();
    if nulls.iter().all(Option::is_none) {
        return 0;
    }
    rows.iter().filter(|&&(s, r)| nulls.get(s).is_some_and(|n| n.is_some_and(|n| n.is_null(r)))).count()
}

/// The values bytes of a fixed-width array from its first row (the array's own slice of its
/// buffer); empty for another type (`plan` checked the types; reads as too short).
fn fixed_bytes(a: &dyn Array) -> &[u8] {
    arrow_array::downcast_primitive_array!(
        a => a.values().inner().as_slice(),
        DataType::FixedSizeBinary(_) => a.as_fixed_size_binary_opt().map_or(&[][..], |f| f.value_data()),
        _ => &[]
    )
}

/// Rows ahead of the one being copied whose value is prefetched. A shuffled batch of small
/// values reads one cache line per value, from a window of row groups larger than the caches:
/// the gather of the tab set (10 columns of 4-8 bytes) was a quarter of the daemon's time, nearly
/// all of it waiting for those loads. A copy takes a few nanoseconds and a miss to memory ~100:
/// 16 ahead saved 7% of the daemon's CPU on that set, 64 ahead 20% (bench/PARQUET_PROFILE.md).
const PREFETCH_AHEAD: usize = 64;

/// Starts loading the cache line of row `row` of `values[s]` (`W` bytes a row), if it exists.
#[inline(always)]
fn prefetch<const W: usize>(values: &[&[u8]], row: Option<&(usize, usize)>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(line) = row.and_then(|&(s, r)| values.get(s)?.get(r * W..)) {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is a hint: it never faults and never changes memory, and the
        // pointer lies in a live buffer anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (values, row);
}

/// Copies row `r` of source `s` (`W` bytes) for every `(s, r)` of `rows` into `dst`, in order;
/// `None` when a source is too short. `W` known at compile time makes each copy one move.
fn copy_fixed<const W: usize>(dst: &mut [u8], values: &[&[u8]], rows: &[(usize, usize)]) -> Option<()> {
    for (i, (d, &(s, r))) in dst.chunks_exact_mut(W).zip(rows).enumerate() {
        prefetch::<W>(values, rows.get(i + PREFETCH_AHEAD));
        let src: &[u8; W] = values.get(s)?.get(r * W..r * W + W)?.try_into().ok()?;
        d.copy_from_slice(src);
    }
    Some(())
}

fn copy_width(dst: &mut [u8], values: &[&[u8]], rows: &[(usize, usize)], w: usize) -> Option<()> {
    for (d, &(s, r)) in dst.chunks_exact_mut(w.max(1)).zip(rows) {
        d.copy_from_slice(values.get(s)?.get(r * w..r * w + w)?);
    }
    Some(())
}

/// The first `len` bytes of `body` (its padding to the alignment zeroed) and the rest after it.
fn take(body: &mut [u8], len: usize) -> (&mut [u8], &mut [u8]) {
    let at = pad(len).min(body.len());
    let (buf, rest) = body.split_at_mut(at);
    let (data, padding) = buf.split_at_mut(len.min(at));
    padding.fill(0);
    (data, rest)
}

/// Writes bits least significant first, as Arrow's bitmaps are.
fn set_bits(out: &mut [u8], bits: impl Iterator<Item = bool>) {
    out.fill(0);
    for (i, b) in bits.enumerate() {
        if b && let Some(byte) = out.get_mut(i / 8) {
            *byte |= 1 << (i % 8);
        }
    }
}

fn write_offset(offsets: &mut [u8], i: usize, at: usize, wide: bool) -> Result<(), ParquetError> {
    let short = || ParquetError::Ipc(format!("no room for offset {i} of a batch"));
    if wide {
        offsets.get_mut(i * 8..i * 8 + 8).ok_or_else(short)?.copy_from_slice(&(at as i64).to_le_bytes());
    } else {
        let v = i32::try_from(at)
            .map_err(|_| ParquetError::Ipc(format!("a batch's values ({at} bytes) overflow 32-bit offsets")))?;
        offsets.get_mut(i * 4..i * 4 + 4).ok_or_else(short)?.copy_from_slice(&v.to_le_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::{
        ArrayRef, BinaryArray, BooleanArray, Date32Array, Decimal128Array, FixedSizeBinaryArray, Float32Array,
        Int8Array, LargeStringArray, StringArray, StructArray, TimestampMicrosecondArray, UInt64Array,
    };
    use arrow_schema::{Field, TimeUnit};
    use proptest::prelude::*;

    use super::super::{ipc, testdata};
    use super::*;

    fn flat_schema() -> Arc<Schema> {
        Arc::new(Schema::new(vec![
            Field::new("i8", DataType::Int8, true),
            Field::new("u64", DataType::UInt64, false),
            Field::new("f32", DataType::Float32, true),
            Field::new("ok", DataType::Boolean, true),
            Field::new("day", DataType::Date32, true),
            Field::new("ts", DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())), true),
            Field::new("dec", DataType::Decimal128(20, 3), true),
            Field::new("fsb", DataType::FixedSizeBinary(3), true),
            Field::new("img", DataType::Binary, true),
            Field::new("txt", DataType::Utf8, true),
            Field::new("big", DataType::LargeUtf8, false),
            Field::new("pic", pic_type(), true),
        ]))
    }

    /// A Hugging Face image: `{bytes: binary, path: string}`.
    fn pic_type() -> DataType {
        DataType::Struct(
            vec![Field::new("bytes", DataType::Binary, true), Field::new("path", DataType::Utf8, true)].into(),
        )
    }

    /// A batch of `n` rows of [`flat_schema`] from `seed`; nulls where `seed + i` hits `every`.
    fn flat_batch(seed: u64, n: usize, every: u64) -> RecordBatch {
        let v = |i: usize| seed.wrapping_mul(31).wrapping_add(i as u64 * 7919);
        let keep = |i: usize| every == 0 || !(seed + i as u64).is_multiple_of(every);
        let cols: Vec<ArrayRef> = vec![
            Arc::new((0..n).map(|i| keep(i).then(|| v(i) as i8)).collect::<Int8Array>()),
            Arc::new((0..n).map(v).collect::<UInt64Array>()),
            Arc::new((0..n).map(|i| keep(i).then(|| v(i) as f32 / 3.0)).collect::<Float32Array>()),
            Arc::new((0..n).map(|i| keep(i).then(|| v(i) % 3 == 0)).collect::<BooleanArray>()),
            Arc::new((0..n).map(|i| keep(i).then(|| v(i) as i32)).collect::<Date32Array>()),
            Arc::new(
                (0..n)
                    .map(|i| keep(i).then(|| v(i) as i64))
                    .collect::<TimestampMicrosecondArray>()
                    .with_timezone("UTC"),
            ),
            Arc::new(
                (0..n)
                    .map(|i| keep(i).then(|| i128::from(v(i)) * -7))
                    .collect::<Decimal128Array>()
                    .with_precision_and_scale(20, 3)
                    .unwrap(),
            ),
            Arc::new(
                FixedSizeBinaryArray::try_from_sparse_iter_with_size(
                    (0..n).map(|i| keep(i).then(|| (v(i) as u32).to_le_bytes()[..3].to_vec())),
                    3,
                )
                .unwrap(),
            ),
            Arc::new((0..n).map(|i| keep(i).then(|| vec![v(i) as u8; (v(i) % 50) as usize])).collect::<BinaryArray>()),
            Arc::new((0..n).map(|i| keep(i).then(|| format!("r{}", v(i) % 1000))).collect::<StringArray>()),
            Arc::new((0..n).map(|i| Some("é".repeat((v(i) % 5) as usize))).collect::<LargeStringArray>()),
            {
                // Struct nulls on `keep`, child nulls of their own (a null path, no bytes).
                let bytes: BinaryArray =
                    (0..n).map(|i| (v(i) % 4 != 1).then(|| vec![i as u8; (v(i) % 30) as usize])).collect();
                let path: StringArray =
                    (0..n).map(|i| (v(i) % 3 != 2).then(|| format!("img/{}.jpg", v(i) % 97))).collect();
                let DataType::Struct(fields) = pic_type() else { unreachable!() };
                let valid: arrow_buffer::NullBuffer = (0..n).map(keep).collect();
                Arc::new(StructArray::new(fields, vec![Arc::new(bytes), Arc::new(path)], Some(valid)))
            },
        ];
        RecordBatch::try_new(flat_schema(), cols).unwrap()
    }

    /// `b` with the bits past each bitmap's length zeroed, as the direct writer writes them (Arrow
    /// leaves them undefined): `take` builds fresh, zero-filled bitmaps, where `interleave` (in
    /// [`ipc::gather`]) may copy a source's neighbouring bits into them.
    fn canonical(b: &RecordBatch) -> RecordBatch {
        let all = arrow_array::UInt32Array::from_iter_values(0..b.num_rows() as u32);
        let cols = b.columns().iter().map(|c| arrow_select::take::take(c.as_ref(), &all, None).unwrap()).collect();
        RecordBatch::try_new(b.schema(), cols).unwrap()
    }

    /// The direct bytes of `rows`, checked against gather + the stream writer: same bytes, but for
    /// the bits past a bitmap's length (see [`canonical`]).
    fn check(sources: &[&RecordBatch], rows: &[(usize, usize)]) {
        let schema = sources[0].schema();
        let message = schema_message(&schema).unwrap();
        let direct = Direct::plan(&schema, &message, sources, rows, None).unwrap().expect("flat schema");
        let mut out = vec![0xAAu8; direct.stream_len() + 100];
        assert_eq!(direct.write(&mut out).unwrap(), direct.stream_len());
        let want = ipc::encode(&canonical(&ipc::gather(&schema, sources, rows).unwrap())).unwrap();
        assert_eq!(direct.stream_len(), want.len());
        assert!(out[..want.len()] == want[..], "direct bytes differ from the stream writer's");
        assert!(out[want.len()..].iter().all(|&b| b == 0xAA), "wrote past its length");
    }

    #[test]
    fn view_columns_carry_each_row_s_view_with_its_source_as_buffer_index() {
        use super::super::arena::into_arena;
        use arrow_array::cast::AsArray;
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::UInt64, false),
            Field::new("blob", DataType::BinaryView, true),
        ]));
        let source = |first: u64| {
            let ids: Vec<u64> = (first..first + 20).collect();
            let blobs: Vec<Option<Vec<u8>>> = ids
                .iter()
                .map(|&i| match i % 4 {
                    0 => None,
                    1 => Some(vec![i as u8; 5]),
                    _ => Some(vec![i as u8; 20 + i as usize]),
                })
                .collect();
            let b = RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(UInt64Array::from(ids)),
                    Arc::new(arrow_array::BinaryViewArray::from_iter(blobs.iter().map(|b| b.as_deref()))),
                ],
            )
            .unwrap();
            into_arena(b, "t").unwrap().0
        };
        let (a, b) = (source(0), source(100));
        let mut meta = std::collections::HashMap::new();
        meta.insert(super::super::dataset::VIEW_KEY.to_owned(), "binary".to_owned());
        let delivered = Schema::new(vec![
            Field::new("id", DataType::UInt64, false),
            Field::new("blob", DataType::FixedSizeBinary(16), true).with_metadata(meta),
        ]);
        let message = schema_message(&delivered).unwrap();
        let rows: Vec<(usize, usize)> = (0..30).map(|i| (i % 2, (i * 7) % 20)).collect();
        let (sa, sb) = (&a, &b);
        let sources = [sa, sb];
        let direct = Direct::plan(&delivered, &message, &sources, &rows, None).unwrap().expect("a view column is flat");
        let mut out = vec![0u8; direct.stream_len()];
        direct.write(&mut out).unwrap();
        let got =
            arrow_ipc::reader::StreamReader::try_new(std::io::Cursor::new(out), None).unwrap().next().unwrap().unwrap();
        let views = got.column(1).as_fixed_size_binary();
        // The batch's views, over the sources' arenas in source order, read every row's value.
        let data: Vec<arrow_buffer::Buffer> =
            [&a, &b].iter().map(|s| s.column(1).as_binary_view().data_buffers()[0].clone()).collect();
        let raw: Vec<u128> = (0..rows.len()).map(|i| u128::from_le_bytes(views.value(i).try_into().unwrap())).collect();
        let rebuilt = arrow_array::BinaryViewArray::try_new(raw.into(), data, views.nulls().cloned()).unwrap();
        for (i, &(s, r)) in rows.iter().enumerate() {
            let want = sources[s].column(1).as_binary_view();
            assert_eq!(rebuilt.is_null(i), want.is_null(r), "row {i}");
            if want.is_valid(r) {
                assert_eq!(rebuilt.value(i), want.value(r), "row {i}");
            }
        }
        // A source whose view column is not over one arena is refused, not misread.
        let view = |byte: u8, buf: u128| 40u128 | (u128::from(u32::from_le_bytes([byte; 4])) << 32) | (buf << 64);
        let two_buffers = arrow_array::BinaryViewArray::try_new(
            vec![view(1, 0), view(2, 1)].into(),
            vec![arrow_buffer::Buffer::from(vec![1u8; 40]), arrow_buffer::Buffer::from(vec![2u8; 40])],
            None,
        )
        .unwrap();
        let plain = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(UInt64Array::from(vec![1u64, 2])), Arc::new(two_buffers)],
        )
        .unwrap();
        let srcs = [&plain];
        let d = Direct::plan(&delivered, &message, &srcs, &[(0, 0)], None).unwrap().unwrap();
        let mut out = vec![0u8; d.stream_len()];
        assert!(d.write(&mut out).is_err());
    }

    #[test]
    fn same_bytes_as_gather_then_the_stream_writer() {
        let a = flat_batch(1, 40, 3);
        let b = flat_batch(2, 25, 0);
        // Sliced sources: offsets into every buffer, bitmaps not on a byte boundary.
        let c = flat_batch(3, 60, 4).slice(13, 30);
        let rows: Vec<(usize, usize)> = (0..90).map(|i| (i % 3, (i * 7) % [40, 25, 30][i % 3])).collect();
        check(&[&a, &b, &c], &rows);
        check(&[&b], &[(0, 3), (0, 1)]);
        check(&[&a, &c], &[(1, 29)]);
        // No nulls anywhere: empty validity buffers.
        check(&[&b], &(0..25).map(|r| (0, r)).collect::<Vec<_>>());
    }

    /// The case proptest found (`proptest-regressions/format/parquet/direct.txt`): one row at a
    /// byte-aligned offset (16) of a sliced source. Gathering it, arrow's interleave copied the
    /// source's next bits into the bitmaps' bits past the row (a boolean, a struct child's
    /// validity), which the stream writer wrote as it found them; the direct writer writes them as
    /// zeros. Arrow leaves those bits undefined and readers ignore them: the oracle now zeroes them.
    #[test]
    fn a_row_at_a_byte_aligned_offset_leaves_no_stray_bits() {
        let d = flat_batch(33, 21, 0).slice(9, 12);
        let gathered = ipc::gather(&d.schema(), &[&d], &[(0, 7)]).unwrap();
        let stray = |b: &RecordBatch| ipc::encode(b).unwrap() != ipc::encode(&canonical(b)).unwrap();
        assert!(stray(&gathered), "the stream writer no longer writes stray bits: the canonical step may go");
        check(&[&d], &[(0, 7)]);
    }

    #[test]
    fn nested_or_dictionary_columns_are_left_to_gather() {
        let m = testdata::mixed_batch(0..5);
        let message = schema_message(&m.schema()).unwrap();
        assert!(Direct::plan(&m.schema(), &message, &[&m], &[(0, 1)], None).unwrap().is_none());
        let flat = flat_batch(0, 5, 2);
        let schema = flat.schema();
        let message = schema_message(&schema).unwrap();
        let sources = [&flat];
        let direct = Direct::plan(&schema, &message, &sources, &[(0, 4)], None).unwrap().unwrap();
        let mut small = vec![0u8; direct.stream_len() - 1];
        assert!(direct.write(&mut small).is_err());
        assert!(Direct::plan(&schema, &message, &[&flat], &[(0, 5)], None).is_err());
        assert!(Direct::plan(&schema, &message, &[&flat], &[(1, 0)], None).is_err());
    }

    /// [`check`] with the rows' ids as a last column: the same bytes as the gathered batch with
    /// that column appended, through the stream writer.
    fn check_with_ids(sources: &[&RecordBatch], rows: &[(usize, usize)], ids: &[u64]) {
        let gathered = ipc::gather(&sources[0].schema(), sources, rows).unwrap();
        let mut fields = gathered.schema().fields().to_vec();
        fields.push(Arc::new(Field::new("__row__", DataType::UInt64, true)));
        let schema = Arc::new(Schema::new(fields));
        let mut cols = gathered.columns().to_vec();
        cols.push(Arc::new(UInt64Array::from(ids.to_vec())));
        let want = ipc::encode(&canonical(&RecordBatch::try_new(schema.clone(), cols).unwrap())).unwrap();
        let message = schema_message(&schema).unwrap();
        let direct = Direct::plan(&schema, &message, sources, rows, Some(ids)).unwrap().expect("flat schema");
        let mut out = vec![0xAAu8; direct.stream_len() + 100];
        assert_eq!(direct.write(&mut out).unwrap(), want.len());
        assert!(out[..want.len()] == want[..], "direct bytes with row ids differ from the stream writer's");
        assert!(out[want.len()..].iter().all(|&b| b == 0xAA), "wrote past its length");
    }

    #[test]
    fn row_ids_are_a_last_column_written_as_the_stream_writer_would() {
        let a = flat_batch(1, 40, 3);
        let c = flat_batch(3, 60, 4).slice(13, 30);
        let rows: Vec<(usize, usize)> = (0..50).map(|i| (i % 2, (i * 7) % [40, 30][i % 2])).collect();
        let ids: Vec<u64> = (0..50).map(|i| 1_000_003 * i as u64 + 17).collect();
        check_with_ids(&[&a, &c], &rows, &ids);
        check_with_ids(&[&a], &[(0, 5)], &[u64::MAX]);
        // Ids must match the rows, and the last column must be able to hold them.
        let schema = a.schema();
        let message = schema_message(&schema).unwrap();
        assert!(Direct::plan(&schema, &message, &[&a], &[(0, 1), (0, 2)], Some(&[7])).is_err());
        assert!(Direct::plan(&schema, &message, &[&a], &[(0, 1)], Some(&[7])).is_err(), "last column is a struct");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn any_rows_of_any_slices(
            lens in proptest::collection::vec((1usize..70, 0usize..10, 0u64..5), 1..5),
            picks in proptest::collection::vec((0usize..100, 0usize..1000), 1..120),
        ) {
            let batches: Vec<RecordBatch> = lens
                .iter()
                .enumerate()
                .map(|(k, &(n, skip, every))| flat_batch(k as u64 * 11, n + skip, every).slice(skip, n))
                .collect();
            let refs: Vec<&RecordBatch> = batches.iter().collect();
            let rows: Vec<(usize, usize)> =
                picks.iter().map(|&(s, r)| (s % refs.len(), r % refs[s % refs.len()].num_rows())).collect();
            check(&refs, &rows);
        }
    }
}
