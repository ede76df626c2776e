"""Arrow batches (rows of a Parquet dataset) as Python values.

The daemon sends each message as one Arrow IPC stream (schema + one record batch): one batch, or
for small rows several consecutive batches of the stream whose rows follow one another (the
message names each one's index and row count; ``Loader`` cuts them with ``RecordBatch.slice``).
Over shared memory it lies in a slot of the stream's ring, which this process maps read-only:
``BatchReader`` opens it with ``pyarrow`` over that buffer (or, with views, in native code over the
mapping, handed to pyarrow through the Arrow C data interface), so every Arrow buffer of the
record batch points into the mapping (no copy). The buffer object (the exported arrays) holds the
message's lease on its slot; the slot goes back to the daemon once the record batch and every
slice, array or memoryview made from it are gone.

``to_dict`` is the default form (what ``Loader(..., format="dict")`` yields):

- fixed-width columns (integers, floats, timestamps, durations): a 1-D numpy array over the Arrow
  buffer, without a copy. A column that may hold a null anywhere in the dataset is a
  ``numpy.ma.MaskedArray`` in every batch (in those without a null too, its mask all false), so
  its form never changes mid-epoch: its data is still the Arrow buffer (zero copy; the values
  under masked entries are whatever the writer left there), its mask a new boolean array. Nothing
  is filled in silently. The daemon knows which columns may hold one from the files' footers
  (each column chunk's statistics count its nulls) and names them (``NULLS_KEY`` in the schema's
  metadata); a file written without statistics cannot show a column null-free. Booleans are
  bit-packed in Arrow, so they become a new ``bool`` array (a copy), masked the same way.
- ``fixed_size_list`` of a fixed-width type (embeddings, token blocks): one 2-D array
  ``(rows, list_size)`` over the values buffer, masked the same way (a null row's whole row, a
  null element its own place).
- ``list``/``large_list`` of a fixed-width type: a list of 1-D array views (None for a null list;
  a row holding a null element a ``MaskedArray``, an ndarray too, masked there).
- lists of lists (any of the three list types, at any depth) of a fixed-width type, as Hugging Face
  ``Array2D``/``Array3D`` and ``Sequence(Sequence(...))`` features are stored (their extension
  type or not): each row an N-D array view of the values buffer (None for a null row); a row
  holding a null inside (an element, or an inner fixed-size list) a ``MaskedArray`` masked there.
  A row whose inner lists differ in length (a null inner variable-size list shorter than its
  siblings too) is no N-D array: it is a list (of lists...) of 1-D array views, one for each
  innermost list (None for a null list, a ``MaskedArray`` where a value is null). A row's form
  depends on the row alone, never on the batch it comes in.
- binary columns (``binary``, ``large_binary``, ``fixed_size_binary``): a list of read-only
  memoryviews into the batch (``bytes`` with ``copy=True``), None for nulls.
- ``binary_view`` columns (``binary_views=True``): read-only memoryviews into the mapped decoded
  row groups, the same way; a struct with such a child: a dict a row (None for a null row), each
  child's value as its own column would give it (a Hugging Face image: ``{"bytes": memoryview,
  "path": str}``).
- strings: a list of ``str`` (None for nulls). Dictionary columns are decoded first. Anything
  else (structs, maps, lists of non-fixed-width types): ``to_pylist()``.
- ``"__key__"``: the ``__key__`` or ``key`` column as ``str`` when the dataset has one (see
  ``keys``; ``Loader`` fetches it for the keys alone when ``fields=`` leaves it out), else each
  row's id as ``str``; ``"__row__"``: the rows' ids (global row numbers), a ``uint64`` array.

The daemon writes the rows' ids into each batch as a last ``__row__`` column. A dataset with a
``__row__`` column of its own is a ``ValueError`` when the Loader is made, unless ``fields=``
leaves that column out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _native
from ._native import ShardstreamError

if TYPE_CHECKING:
    import pyarrow as pa  # type: ignore[import-untyped]

KEY_COLUMNS = ("__key__", "key")
ROW = "__row__"


class BatchReader:
    """Opens the Arrow batches of one stream, zero copy over their IPC bytes (the ring slot with
    shared memory).

    Every batch of a stream begins with the same schema message. Parsing it again for each batch
    (``pyarrow.ipc.open_stream``) was a fixed cost per batch, large beside a batch of small rows; so
    the first batch is opened as a stream and its schema message kept (a copy: the first batch's
    slot goes back to the daemon with the batch), and each later batch whose bytes begin with that
    same message is read past it (``pyarrow.ipc.read_record_batch`` with the kept schema). A batch
    that begins otherwise, or a schema with dictionary columns (their dictionaries travel in the
    stream, between schema and batch), is opened as a whole stream.

    A stream with views (``views=True``: ``binary_views``) is opened in native code instead
    (``_native.ArrowReader``): it decodes the stream the same way, rebuilds the view columns as
    ``binary_view`` arrays over the mapped row groups they point into (every view checked against
    its segment first: a bad batch is an error, never a read outside a mapping) and exports the
    batch through the Arrow C data interface. Rebuilding the views with pyarrow in Python cost
    60-90 us a batch; exporting a batch of many small columns costs more than pyarrow's own
    ``read_record_batch`` (bench/PARQUET_PROFILE.md), so streams without views stay on it.
    """

    def __init__(self, views: bool = False) -> None:
        self._schema: Any = None
        self._prefix: Any = None  # the schema message's bytes (a pyarrow.Buffer of its own)
        self._schema_has_row = False
        self._native = _native.ArrowReader() if views else None
        self._generation = -1  # the native reader's schema generation `_schema` is of
        #: Whether the batch ``open`` returned last has a ``__row__`` column (the daemon writes
        #: one into every batch; an older daemon did not, and the client appends it then).
        self.has_row = False
        #: The columns of the batch ``open`` returned last that may hold a null somewhere in the
        #: dataset (``nulls_of``), found once per schema: ``to_dict`` takes them from here.
        self.nulls: frozenset[str] = frozenset()

    def open(self, native: _native.Batch) -> pa.RecordBatch:
        import pyarrow as pa

        if self._native is not None:
            return self._open_native(self._native, native)
        buf = pa.py_buffer(native.ipc())
        try:
            prefix = self._prefix
            if prefix is not None and buf.size > prefix.size and buf.slice(0, prefix.size).equals(prefix):
                batch = pa.ipc.read_record_batch(buf.slice(prefix.size), self._schema)
                self.has_row = self._schema_has_row
            else:
                batch = pa.ipc.open_stream(buf).read_next_batch()
                self.has_row = ROW in batch.schema.names
                self.nulls = nulls_of(batch.schema)
                self._remember(buf, batch.schema)
        except (pa.ArrowInvalid, StopIteration) as e:
            raise ShardstreamError(f"arrow batch {native.index}: not a valid Arrow IPC stream: {e}") from None
        if batch.num_rows != len(native):
            raise ShardstreamError(
                f"arrow batch {native.index}: record batch has {batch.num_rows} rows, the message names {len(native)}"
            )
        return batch

    def _open_native(self, reader: _native.ArrowReader, native: _native.Batch) -> pa.RecordBatch:
        import pyarrow as pa

        out = reader.open(native)
        if reader.schema_generation != self._generation:
            self._schema, self._generation = pa.schema(out), reader.schema_generation
            self.nulls = nulls_of(self._schema)
        self.has_row = reader.has_row
        # The arrays alone, with the schema imported once per schema: the whole batch through
        # the public PyCapsule interface (`pa.record_batch(out)`) exported and imported its
        # schema with every batch. `_import_from_c` is pyarrow's C data interface entry point for
        # a struct's address; the capsule owns the struct until pyarrow has moved it out.
        holder, address = out.export_array()
        batch = pa.RecordBatch._import_from_c(address, self._schema)
        del holder
        return batch

    def _remember(self, buf: pa.Buffer, schema: pa.Schema) -> None:
        import pyarrow as pa

        if any(pa.types.is_dictionary(f.type) for f in schema):
            return
        # The stream's first message: continuation marker 0xFFFFFFFF, its metadata length, the
        # metadata (the schema message has no body).
        head = np.frombuffer(buf, dtype="<i4", count=2) if buf.size >= 8 else None
        if head is None or head[0] != -1 or head[1] <= 0 or 8 + int(head[1]) >= buf.size:
            return
        # A copy (a few hundred bytes once a stream): a slice of `buf` would hold the first
        # message's ring slot, one of the stream's credits, for as long as the stream lasts.
        self._schema, self._prefix = schema, pa.py_buffer(buf.slice(0, 8 + int(head[1])).to_pybytes())
        self._schema_has_row = ROW in schema.names


def row_ids(native: _native.Batch) -> np.ndarray[Any, np.dtype[np.uint64]]:
    return np.frombuffer(native.row_id_bytes(), dtype="<u8").astype(np.uint64, copy=False)


def copied(batch: pa.RecordBatch) -> pa.RecordBatch:
    """``batch`` in memory of this process: its rows' values written once into one buffer (Arrow
    IPC, which writes only a slice's own rows), and read back over it without another copy."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return pa.ipc.open_stream(sink.getvalue()).read_next_batch()


def with_row_ids(batch: pa.RecordBatch, rows: np.ndarray[Any, Any]) -> pa.RecordBatch:
    """``batch`` with a ``__row__`` column of the rows' ids appended (its other columns shared):
    for batches of an older daemon, which did not write that column itself."""
    import pyarrow as pa

    if ROW in batch.schema.names:
        return batch
    # From the buffer, not `pa.array(rows)`: that asks pandas whether `rows` is a pandas object,
    # importing pandas (0.37 s of CPU) before the first batch of every process that has it.
    ids = np.ascontiguousarray(rows, dtype="<u8")
    return batch.append_column(ROW, pa.Array.from_buffers(pa.uint64(), len(ids), [None, pa.py_buffer(ids)]))


def _fixed_width(t: pa.DataType) -> bool:
    """Types numpy can view in place: integers, floats, timestamps and durations (dates and
    times of day have no zero-copy numpy form; they come as Python objects)."""
    import pyarrow as pa

    return bool(
        pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_timestamp(t) or pa.types.is_duration(t)
    )


# numpy views are made from the Arrow buffers here, not with pyarrow's `to_numpy`/`pa.array`:
# those import pandas when it is installed (0.37 s of CPU, before the first batch of every
# process, DataLoader workers included).


def _numpy_dtype(t: pa.DataType) -> np.dtype[Any]:
    """The numpy dtype of a fixed-width Arrow type's values buffer (see `_fixed_width`)."""
    import pyarrow as pa

    if pa.types.is_integer(t):
        return np.dtype(f"<{'i' if pa.types.is_signed_integer(t) else 'u'}{t.bit_width // 8}")
    if pa.types.is_floating(t):
        return np.dtype(f"<f{t.bit_width // 8}")
    if pa.types.is_timestamp(t):
        return np.dtype(f"<M8[{t.unit}]")
    return np.dtype(f"<m8[{t.unit}]")


def _values(arr: pa.Array) -> np.ndarray[Any, Any]:
    """A fixed-width array's values as numpy over its data buffer, ignoring validity: zero copy."""
    dtype = _numpy_dtype(arr.type)
    buf = arr.buffers()[1]
    if buf is None or len(arr) == 0:
        return np.empty(0, dtype)
    return np.frombuffer(buf, dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _bits(buf: Any, offset: int, n: int) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Bits ``offset .. offset + n`` of an Arrow bitmap (least significant bit first) as bools."""
    if n == 0:
        return np.zeros(0, dtype=bool)
    raw = np.frombuffer(buf, np.uint8, count=(offset + n + 7) // 8 - offset // 8, offset=offset // 8)
    skip = offset % 8
    return np.unpackbits(raw, bitorder="little")[skip : skip + n].astype(bool)


def _null_mask(arr: pa.Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    if arr.null_count == 0:
        return np.zeros(len(arr), dtype=bool)
    validity = arr.buffers()[0]
    if validity is None:
        # Arrow's null type (pandas' all-None column) has no validity buffer: every value is null.
        return np.ones(len(arr), dtype=bool)
    return ~_bits(validity, arr.offset, len(arr))


def _offsets(arr: pa.Array) -> np.ndarray[Any, Any]:
    """The ``len(arr) + 1`` offsets of a list or binary array (32- or 64-bit), zero copy."""
    import pyarrow as pa

    t = arr.type
    wide = pa.types.is_large_list(t) or pa.types.is_large_binary(t) or pa.types.is_large_string(t)
    dtype = np.dtype("<i8" if wide else "<i4")
    buf = arr.buffers()[1]
    if buf is None:
        return np.zeros(1, dtype)
    return np.frombuffer(buf, dtype, count=len(arr) + 1, offset=arr.offset * dtype.itemsize)


def _is_list(t: pa.DataType) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t))


def _storage(arr: pa.Array) -> pa.Array:
    """An extension-typed column (Hugging Face's ``Array2D``..., registered where ``datasets`` is
    imported) as the arrays it is stored in."""
    import pyarrow as pa

    return arr.storage if isinstance(arr.type, pa.BaseExtensionType) else arr


def _nested_numbers(t: pa.DataType) -> bool:
    """Whether ``t`` is lists of lists (two levels or more) of a fixed-width type."""
    depth = 0
    while _is_list(t):
        t, depth = t.value_type, depth + 1
    return depth >= 2 and _fixed_width(t)


class _Nested:
    """A column of nested lists of a fixed-width type (``_nested_numbers``) walked down to its
    values, without a copy: for each list level, each row's range of elements there (``bounds``,
    ``rows + 1`` absolute indices) and each element's length (``lengths``, for the elements of all
    the rows); ``bounds[-1]`` are the rows' ranges in ``values``. ``null_inside`` holds the rows
    with a null inside their lists (a null row's own elements, which a fixed-size list keeps and
    writers null, are the row's: `column_value` gives None for it); ``hidden`` then marks the
    values under a null, an element's own or an inner list's (relative to ``bounds[-1][0]``), and
    is None when no row has one. ``offsets[level]``: each element's range in the level below
    (absolute, ``elements + 1``); ``nulls[level]``: the level's own nulls, relative to
    ``bounds[level][0]`` (None for none; level 0, the rows, has none here): a ragged row is built
    from these."""

    def __init__(self, arr: pa.Array) -> None:
        import pyarrow as pa

        a = arr
        bounds = np.arange(len(a) + 1, dtype=np.int64)
        self.bounds: list[np.ndarray[Any, Any]] = []
        self.lengths: list[np.ndarray[Any, Any]] = []
        self.sizes: list[int | None] = []
        self.offsets: list[np.ndarray[Any, Any]] = []
        self.nulls: list[np.ndarray[Any, np.dtype[np.bool_]] | None] = []
        self.null_inside = np.zeros(len(arr), dtype=bool)
        # The nulls of the elements of the level being walked, within the rows' range, and of
        # every list above them: a null inner list hides all it holds.
        hidden: np.ndarray[Any, np.dtype[np.bool_]] | None = None
        while _is_list(a.type):
            lo, hi = int(bounds[0]), int(bounds[-1])
            own = self._nulls(a, bounds) if a is not arr else None
            self.nulls.append(own)
            hidden = _either(hidden, own)
            if pa.types.is_fixed_size_list(a.type):
                size = a.type.list_size
                # `values` ignores the array's own offset: elements start at `offset * size`.
                offsets = (a.offset + np.arange(lo, hi + 1, dtype=np.int64)) * size
                self.sizes.append(size)
            else:
                offsets = _offsets(a)[lo : hi + 1].astype(np.int64)
                self.sizes.append(None)
            self.bounds.append(bounds)
            self.offsets.append(offsets)
            lengths = np.diff(offsets)
            self.lengths.append(lengths)
            if hidden is not None:
                hidden = np.repeat(hidden, lengths)
            bounds = offsets[bounds - lo]
            a = a.values
        own = self._nulls(a, bounds)
        self.nulls.append(own)
        self.hidden = _either(hidden, own)
        self.bounds.append(bounds)
        self.values = _values(a)

    def _nulls(self, a: pa.Array, bounds: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.bool_]] | None:
        """Marks the rows owning a null among ``a``'s elements in ``bounds``' range; those
        elements' nulls (None when there are none)."""
        lo, hi = int(bounds[0]), int(bounds[-1])
        part = a.slice(lo, hi - lo)
        if hi > lo and part.null_count:
            mask = _null_mask(part)
            owner = np.searchsorted(bounds, np.flatnonzero(mask) + lo, side="right") - 1
            self.null_inside[owner] = True
            return mask
        return None

    def level_row(self, level: int, element: int) -> int:
        """The row holding element ``element`` (relative to the level's first) of ``level``."""
        b = self.bounds[level]
        return int(np.searchsorted(b, int(b[0]) + element, side="right")) - 1

    def rows(self, valid: np.ndarray[Any, np.dtype[np.bool_]], copy: bool) -> list[Any]:
        """Each row as an N-D array view (None where not ``valid``); a row whose inner lists
        differ in length as lists down to 1-D arrays (``_ragged``)."""
        n = len(valid)
        dims = []
        ragged_rows = np.zeros(n, dtype=bool)
        for level, lengths in enumerate(self.lengths):
            b = self.bounds[level]
            owner = np.searchsorted(b, np.arange(int(b[0]), int(b[-1])), side="right") - 1
            ragged_rows[owner[1:][(lengths[1:] != lengths[:-1]) & (owner[1:] == owner[:-1])]] = True
            has = b[1:] > b[:-1]
            first = np.clip(b[:-1] - b[0], 0, max(len(lengths) - 1, 0))
            default = self.sizes[level] or 0
            dims.append(np.where(has, lengths[first] if len(lengths) else default, default).tolist())
        b = self.bounds[-1].tolist()
        shapes = list(zip(*dims, strict=True)) if dims else [()] * n
        ragged_rows &= valid
        out: list[Any] = []
        for i, ok in enumerate((valid & ~ragged_rows).tolist()):
            if not ok:
                out.append(None)
                continue
            row = self.values[b[i] : b[i + 1]].reshape(shapes[i])
            out.append(row.copy() if copy else row)
        for i in np.flatnonzero(ragged_rows).tolist():
            out[i] = self._ragged(0, i, copy)
        if self.hidden is not None:
            # Only a batch with a null inside pays for masks. Each mask is the row's own (a
            # copy), so a trainer may change it.
            for i in np.flatnonzero(self.null_inside & valid & ~ragged_rows).tolist():
                mask = self.hidden[b[i] - b[0] : b[i + 1] - b[0]].reshape(shapes[i]).copy()
                out[i] = np.ma.MaskedArray(out[i], mask=mask)
        return out

    def _ragged(self, level: int, k: int, copy: bool) -> Any:
        """Element ``k`` of ``level`` (absolute): for the innermost lists a 1-D array view of
        their values (a ``MaskedArray`` masked where a value is null), above them a list of the
        elements below (None for a null list)."""
        offsets = self.offsets[level]
        at = k - int(self.bounds[level][0])
        lo, hi = int(offsets[at]), int(offsets[at + 1])
        base = int(self.bounds[level + 1][0])
        nulls = self.nulls[level + 1]
        if level + 1 == len(self.offsets):
            leaf = self.values[lo:hi].copy() if copy else self.values[lo:hi]
            if nulls is not None and nulls[lo - base : hi - base].any():
                return np.ma.MaskedArray(leaf, mask=nulls[lo - base : hi - base].copy())
            return leaf
        return [
            None if nulls is not None and nulls[c - base] else self._ragged(level + 1, c, copy) for c in range(lo, hi)
        ]


def _either(
    a: np.ndarray[Any, np.dtype[np.bool_]] | None, b: np.ndarray[Any, np.dtype[np.bool_]] | None
) -> np.ndarray[Any, np.dtype[np.bool_]] | None:
    """The union of two masks over the same elements, None standing for all False."""
    if a is None:
        return b
    return a if b is None else a | b


def _binary(arr: pa.Array, copy: bool) -> list[Any]:
    import pyarrow as pa

    n = len(arr)
    bufs = arr.buffers()
    if pa.types.is_fixed_size_binary(arr.type):
        width = arr.type.byte_width
        starts = (np.arange(n, dtype=np.int64) + arr.offset) * width
        ends = starts + width
        data = bufs[1]
    else:
        offsets = _offsets(arr)
        starts, ends = offsets[:-1], offsets[1:]
        data = bufs[2]
    view = memoryview(data) if data is not None else memoryview(b"")
    valid = ~_null_mask(arr) if arr.null_count else None
    out: list[Any] = []
    for i, (a, z) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        if valid is not None and not valid[i]:
            out.append(None)
        elif copy:
            out.append(bytes(view[a:z]))
        else:
            out.append(view[a:z])
    return out


def _binary_views(arr: pa.Array, copy: bool) -> list[Any]:
    """A ``binary_view`` array's values: memoryviews into its data buffers (or ``bytes``), None
    for nulls. Values of up to 12 bytes live inside their views."""
    bufs = arr.buffers()
    n = len(arr)
    views = np.frombuffer(bufs[1], _VIEW, count=n, offset=arr.offset * 16)
    data = [memoryview(b) if b is not None else memoryview(b"") for b in bufs[2:]]
    raw = memoryview(bufs[1])
    valid = ~_null_mask(arr) if arr.null_count else None
    out: list[Any] = []
    first = arr.offset * 16
    for i, (length, buf, at) in enumerate(
        zip(views["len"].tolist(), views["buf"].tolist(), views["off"].tolist(), strict=True)
    ):
        if valid is not None and not valid[i]:
            out.append(None)
            continue
        if length <= 12:
            v = raw[first + 16 * i + 4 : first + 16 * i + 4 + length]
        else:
            v = data[buf][at : at + length]
        out.append(bytes(v) if copy else v)
    return out


#: One Arrow binary view: length, the value's first 4 bytes, buffer index, offset (for values of
#: up to 12 bytes, the value itself from byte 4).
_VIEW = np.dtype([("len", "<i4"), ("prefix", "S4"), ("buf", "<i4"), ("off", "<i4")])


def column_value(arr: pa.Array, copy: bool = False, nulls: bool = False) -> Any:
    """One column in the dict form (see the module docs). ``nulls``: the column may hold a null
    somewhere in the dataset (``nulls_of``), so its null-aware form is given even when this
    batch has none."""
    import pyarrow as pa

    arr = _storage(arr)
    masked = nulls or arr.null_count > 0
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if _nested_numbers(t):
        return _Nested(arr).rows(~_null_mask(arr), copy)
    if pa.types.is_boolean(t):
        # Arrow packs booleans into bits: numpy needs one byte each, so this is a new array.
        values = _bits(arr.buffers()[1], arr.offset, len(arr)) if len(arr) else np.zeros(0, dtype=bool)
        if arr.null_count:
            values &= ~_null_mask(arr)
        return np.ma.MaskedArray(values, mask=_null_mask(arr)) if masked else values
    if _fixed_width(t):
        values = _values(arr)
        if copy:
            values = values.copy()
        return np.ma.MaskedArray(values, mask=_null_mask(arr)) if masked else values
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return _binary(arr, copy)
    if pa.types.is_binary_view(t):
        return _binary_views(arr, copy)
    if pa.types.is_struct(t) and any(pa.types.is_binary_view(t.field(i).type) for i in range(t.num_fields)):
        # A struct with view children (``binary_views``, e.g. a Hugging Face image): a dict a row,
        # its values as their columns give them (memoryviews for the views), None for a null row.
        # `field(i)` gives each child sliced to this array's rows.
        names = [t.field(i).name for i in range(t.num_fields)]
        children = [column_value(arr.field(i), copy) for i in range(t.num_fields)]
        valid = (~_null_mask(arr)).tolist() if arr.null_count else [True] * len(arr)
        return [{n: c[j] for n, c in zip(names, children, strict=True)} if ok else None for j, ok in enumerate(valid)]
    if pa.types.is_fixed_size_list(t) and _fixed_width(t.value_type):
        size = t.list_size
        child = arr.values.slice(arr.offset * size, len(arr) * size)
        values = _values(child).reshape(len(arr), size)
        if copy:
            values = values.copy()
        if masked or child.null_count:
            # A null row masks its whole row, a null element its own place: still one 2-D array.
            mask = np.repeat(_null_mask(arr)[:, None], size, axis=1)
            if child.null_count:
                mask |= _null_mask(child).reshape(len(arr), size)
            return np.ma.MaskedArray(values, mask=mask)
        return values
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _fixed_width(t.value_type):
        flat = _values(arr.values)
        offsets = _offsets(arr).tolist()
        valid = (~_null_mask(arr)).tolist() if arr.null_count else [True] * len(arr)
        rows = [
            (flat[a:z].copy() if copy else flat[a:z]) if ok else None
            for a, z, ok in zip(offsets[:-1], offsets[1:], valid, strict=True)
        ]
        if arr.values.null_count:
            # A row holding a null element is a MaskedArray (an ndarray too) masked there; the
            # others stay plain views. Only batches with such a null pay for the mask.
            inner = _null_mask(arr.values)
            for i, (a, z) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
                if rows[i] is not None and inner[a:z].any():
                    rows[i] = np.ma.MaskedArray(rows[i], mask=inner[a:z].copy())
        return rows
    return arr.to_pylist()


def key_column(names: Sequence[str]) -> str | None:
    """Which of the columns ``names`` holds the keys: ``__key__``, else ``key``, else none."""
    return next((name for name in KEY_COLUMNS if name in names), None)


def keys(batch: pa.RecordBatch, rows: np.ndarray[Any, Any]) -> list[str | None]:
    """The batch's keys: its key column's values as str (None where null: str() would make it
    the key "None"), else the row ids. Binary keys that are not UTF-8 are decoded as Python
    decodes such file names (``surrogateescape``): distinct bytes stay distinct keys, and
    ``key.encode("utf-8", "surrogateescape")`` gives the bytes back."""
    name = key_column(batch.schema.names)
    if name is None:
        return [str(r) for r in rows.tolist()]
    return [
        None if v is None else v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
        for v in batch.column(name).to_pylist()
    ]


def to_dict(
    batch: pa.RecordBatch,
    rows: np.ndarray[Any, Any],
    copy: bool = False,
    hidden: str | None = None,
    nulls: frozenset[str] | None = None,
) -> dict[str, Any]:
    """The dict form of a record batch whose rows have ids ``rows``. ``hidden``: a column the
    batch carries only for its keys (the key column ``fields=`` left out), not delivered.
    ``nulls``: ``nulls_of(batch.schema)``, when the caller knows it already (``BatchReader.nulls``:
    walking a schema's fields costs a batch of small rows as much as two of its columns)."""
    if nulls is None:
        nulls = nulls_of(batch.schema)
    out: dict[str, Any] = {"__key__": keys(batch, rows), ROW: rows}
    for name, arr in zip(batch.schema.names, batch.columns, strict=True):
        if name in ("__key__", ROW) or name == hidden:
            continue
        out[name] = column_value(arr, copy, name in nulls)
    return out


#: The schema metadata where the daemon names (a JSON list) the columns that may hold a null
#: somewhere in the dataset (its footers' statistics do not show them null-free): such a column
#: has its null-aware form in every batch, so that its form does not change from batch to batch.
NULLS_KEY = b"shardstream.nulls"


def nulls_of(schema: pa.Schema) -> frozenset[str]:
    """The columns of ``schema`` the daemon names as possibly holding a null somewhere in the
    dataset (none for a schema that names none)."""
    named = (schema.metadata or {}).get(NULLS_KEY)
    if named is None:
        return frozenset()
    try:
        names = json.loads(named)
    except ValueError:
        raise ShardstreamError(
            f"the batch's schema names its columns with nulls as {named!r}, not a JSON list"
        ) from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ShardstreamError(f"the batch's schema names its columns with nulls as {named!r}, not a list of names")
    return frozenset(names)


def stack(batch: pa.RecordBatch, out: dict[str, Any], hidden: str | None = None) -> dict[str, Any]:
    """``collate="stack"`` for an Arrow batch: every column as one array of ``rows`` records.
    Fixed-width columns are 1-D already; ``fixed_size_list`` columns are 2-D; ``list`` columns of
    equal-length lists and binary columns of equal-length values become a 2-D view of their values
    buffer (``uint8`` for binary), lists of lists of equal shape an N-D one (Hugging Face
    ``Array2D``/``Array3D``: ``(rows, *shape)``), without a copy. A null (a row's, or one inside a
    row's lists), or lists/values of different lengths, is a ``ValueError`` naming the column and
    row. ``hidden`` as for ``to_dict``: not stacked, nor checked for nulls."""
    import pyarrow as pa

    rows = out[ROW]
    for name, arr in zip(batch.schema.names, batch.columns, strict=True):
        if name == "__key__" or name == hidden:
            continue
        arr = _storage(arr)
        t = arr.type
        if pa.types.is_dictionary(t):
            # Stacked as the dict form gives it: decoded (a categorical of strings stays str).
            arr = arr.dictionary_decode()
            t = arr.type
        if arr.null_count:
            row = int(np.flatnonzero(_null_mask(arr))[0])
            raise ValueError(
                f'collate="stack" needs a value in every row, but column {name!r} is null in row '
                f"{int(rows[row])}; fill it, select other fields, or use collate=None"
            )
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            continue
        if _nested_numbers(t):
            out[name] = _stack_nested(name, _Nested(arr), rows)
            continue
        if _is_list(t) and _fixed_width(t.value_type):
            # The elements' own nulls (a list's validity says only which rows are null): the
            # values buffer under them holds whatever the writer left there.
            _refuse_null_inside(name, _Nested(arr), rows)
        value = out[name]
        if isinstance(value, np.ma.MaskedArray):
            # Null-aware because the dataset may hold a null somewhere; none is in this batch
            # (refused above), and a stacked batch is plain.
            value = out[name] = value.data
        if isinstance(value, np.ndarray) or pa.types.is_fixed_size_binary(t):
            if pa.types.is_fixed_size_binary(t):
                data = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
                width = t.byte_width
                out[name] = data[arr.offset * width : (arr.offset + len(arr)) * width].reshape(len(arr), width)
            continue
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            offsets = _offsets(arr)
            data = np.frombuffer(arr.buffers()[2] or b"", dtype=np.uint8)
            flat = data[int(offsets[0]) : int(offsets[-1])]
        elif (pa.types.is_list(t) or pa.types.is_large_list(t)) and _fixed_width(t.value_type):
            offsets = _offsets(arr)
            flat = _values(arr.values)[int(offsets[0]) : int(offsets[-1])]
        else:
            raise ValueError(f'collate="stack" cannot stack column {name!r} of type {t}; use collate=None')
        lengths = np.diff(offsets)
        if len(lengths) and (lengths != lengths[0]).any():
            i = int(np.flatnonzero(lengths != lengths[0])[0])
            raise ValueError(
                f'collate="stack" needs equal-length {name!r} within a batch: row {int(rows[i])} has '
                f"{int(lengths[i])}, row {int(rows[0])} has {int(lengths[0])}"
            )
        out[name] = flat.reshape(len(arr), int(lengths[0]) if len(lengths) else 0)
    return out


def _refuse_null_inside(name: str, nested: _Nested, rows: np.ndarray[Any, Any]) -> None:
    if nested.null_inside.any():
        row = int(rows[int(np.flatnonzero(nested.null_inside)[0])])
        raise ValueError(
            f'collate="stack" needs a value in every row, but column {name!r} has a null inside its lists '
            f"in row {row}; fill it, select other fields, or use collate=None"
        )


def _stack_nested(name: str, nested: _Nested, rows: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A column of lists of lists of equal shape as one ``(rows, *shape)`` view of its values."""
    _refuse_null_inside(name, nested, rows)
    shape = [len(rows)]
    for level, lengths in enumerate(nested.lengths):
        if len(lengths) and (lengths != lengths[0]).any():
            e = int(np.flatnonzero(lengths != lengths[0])[0])
            bad, first = nested.level_row(level, e), nested.level_row(level, 0)
            raise ValueError(
                f'collate="stack" needs equal-shaped {name!r} within a batch: row {int(rows[bad])} has '
                f"{int(lengths[e])} at dimension {level + 1}, row {int(rows[first])} has {int(lengths[0])}"
            )
        shape.append(int(lengths[0]) if len(lengths) else (nested.sizes[level] or 0))
    b = nested.bounds[-1]
    return nested.values[int(b[0]) : int(b[-1])].reshape(shape)
