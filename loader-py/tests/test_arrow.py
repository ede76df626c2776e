"""The dict form of Arrow batches (shardstream._arrow) on record batches read by the real pyarrow IPC
reader from one buffer, as the Loader reads them from a ring slot: values must be views of that
buffer (zero copy), nulls masked (never filled), keys and row ids as documented."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from shardstream import _arrow


def ipc_bytes(batch: pa.RecordBatch) -> np.ndarray:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    # A 64-byte aligned copy, read-only like the ring mapping.
    raw = sink.getvalue().to_pybytes()
    store = np.zeros(len(raw) + 64, np.uint8)
    start = (-store.ctypes.data) % 64
    region = store[start : start + len(raw)]
    region[:] = np.frombuffer(raw, np.uint8)
    region.flags.writeable = False
    return region


def reopen(region: np.ndarray) -> pa.RecordBatch:
    return pa.ipc.open_stream(pa.py_buffer(region)).read_next_batch()


def inside(region: np.ndarray, address: int, size: int = 0) -> bool:
    base = region.ctypes.data
    return base <= address and address + size <= base + region.nbytes


def sample_batch() -> pa.RecordBatch:
    return pa.record_batch(
        {
            "label": pa.array([1, 2, 3, 4], pa.int64()),
            "score": pa.array([0.5, None, 1.5, None], pa.float32()),
            "ok": pa.array([True, None, False, True]),
            "img": pa.array([b"ab", None, b"", b"xyz"], pa.large_binary()),
            "txt": pa.array(["a", "bé", None, "d"], pa.string()),
            "emb": pa.array([[1, 2], [3, 4], [5, 6], [7, 8]], pa.list_(pa.float32(), 2)),
            "tok": pa.array([[1], [2, 3], None, []], pa.list_(pa.int32())),
            "cat": pa.array(["x", "y", "x", None]).dictionary_encode(),
        }
    )


def test_dict_form_is_zero_copy_for_fixed_width_and_binary_and_masks_nulls() -> None:
    region = ipc_bytes(sample_batch())
    rb = reopen(region)
    rows = np.array([10, 11, 12, 13], np.uint64)
    d = _arrow.to_dict(rb, rows)
    assert d["__key__"] == ["10", "11", "12", "13"]
    assert d["__row__"].tolist() == [10, 11, 12, 13]
    label = d["label"]
    assert type(label) is np.ndarray and label.tolist() == [1, 2, 3, 4]
    assert inside(region, label.ctypes.data, label.nbytes), "label was copied"
    score = d["score"]
    assert isinstance(score, np.ma.MaskedArray)
    assert score.mask.tolist() == [False, True, False, True]
    assert score.compressed().tolist() == [0.5, 1.5]
    assert inside(region, score.data.ctypes.data, score.data.nbytes), "the masked array's data was copied"
    assert d["ok"].mask.tolist() == [False, True, False, False]
    img = d["img"]
    assert [None if v is None else bytes(v) for v in img] == [b"ab", None, b"", b"xyz"]
    assert isinstance(img[0], memoryview) and img[0].readonly
    addr = np.frombuffer(img[3], np.uint8).ctypes.data
    assert inside(region, addr, 3), "binary values were copied"
    assert d["txt"] == ["a", "bé", None, "d"]
    emb = d["emb"]
    assert emb.shape == (4, 2) and emb.dtype == np.float32 and emb[3].tolist() == [7, 8]
    assert inside(region, emb.ctypes.data, emb.nbytes)
    tok = d["tok"]
    assert [None if t is None else t.tolist() for t in tok] == [[1], [2, 3], None, []]
    assert inside(region, tok[1].ctypes.data, tok[1].nbytes)
    assert d["cat"] == ["x", "y", "x", None]


def test_copy_gives_owned_values() -> None:
    region = ipc_bytes(sample_batch())
    d = _arrow.to_dict(reopen(region), np.arange(4, dtype=np.uint64), copy=True)
    assert not inside(region, d["label"].ctypes.data)
    assert d["img"][0] == b"ab" and isinstance(d["img"][0], bytes)


def test_key_column_and_slices() -> None:
    rb = pa.record_batch({"key": pa.array(["k0", "k1", "k2"]), "v": pa.array([1, 2, 3], pa.int16())})
    region = ipc_bytes(rb)
    d = _arrow.to_dict(reopen(region).slice(1), np.array([5, 6], np.uint64))
    assert d["__key__"] == ["k1", "k2"]
    assert d["v"].tolist() == [2, 3]


def test_a_null_key_is_none_not_the_string_none() -> None:
    # str(None) made a null key "None", the same as a row whose key is the string "None".
    for keys in (pa.array(["a", None, "None"]), pa.array([b"a", None, b"None"], pa.binary()), pa.array([7, None, 9])):
        batch = pa.record_batch({"__key__": keys, "v": pa.array([0, 1, 2])})
        got = _arrow.to_dict(reopen(ipc_bytes(batch)), np.arange(3, dtype=np.uint64))["__key__"]
        assert got[1] is None and got[0] in ("a", "7") and got[2] in ("None", "9"), got


def test_a_binary_key_that_is_not_utf8_keeps_its_bytes() -> None:
    # Decoded with replacement characters, b"caf\xe9" and b"caf\xe8" were both the key "caf\ufffd".
    # As Python names undecodable file names (os.fsdecode), each key stays distinct and gives
    # its bytes back with .encode("utf-8", "surrogateescape").
    raw = [b"caf\xe9", b"caf\xe8", "café".encode()]
    batch = pa.record_batch({"__key__": pa.array(raw, pa.binary()), "v": pa.array([0, 1, 2])})
    got = _arrow.to_dict(reopen(ipc_bytes(batch)), np.arange(3, dtype=np.uint64))["__key__"]
    assert [k.encode("utf-8", "surrogateescape") for k in got] == raw and got[2] == "café", got


def test_values_read_from_buffers_match_pyarrow_at_every_slice_offset() -> None:
    # The dict form reads Arrow buffers itself (pyarrow's to_numpy imports pandas): offsets into
    # bitmaps and value buffers are where that goes wrong, so every slice start and length is
    # checked against pyarrow's own reading of the same rows.
    rng = np.random.default_rng(3)
    n = 37

    def maybe(values: list) -> list:
        return [None if rng.random() < 0.3 else v for v in values]

    rb = pa.record_batch(
        {
            "i8": pa.array(maybe(rng.integers(-100, 100, n).tolist()), pa.int8()),
            "u32": pa.array(maybe(rng.integers(0, 1 << 31, n).tolist()), pa.uint32()),
            "f16": pa.array(rng.standard_normal(n).astype(np.float16), pa.float16()),
            "f64": pa.array(maybe(rng.standard_normal(n).tolist()), pa.float64()),
            "ok": pa.array(maybe((rng.random(n) < 0.5).tolist()), pa.bool_()),
            "dur": pa.array(maybe(rng.integers(0, 10**6, n).tolist()), pa.duration("us")),
            "ts": pa.array(maybe(rng.integers(0, 10**12, n).tolist()), pa.timestamp("ns", tz="UTC")),
            "tok": pa.array(maybe([list(range(int(k))) for k in rng.integers(0, 5, n)]), pa.large_list(pa.int64())),
            "img": pa.array(maybe([bytes([k]) * int(k % 7) for k in range(n)]), pa.binary()),
        }
    )
    region = ipc_bytes(rb)
    whole = reopen(region)
    for start in range(0, n, 3):
        for length in (0, 1, 8, 9, n - start):
            part = whole.slice(start, length)
            d = _arrow.to_dict(part, np.arange(length, dtype=np.uint64))
            for name in ("i8", "u32", "f16", "f64", "ok", "dur", "ts"):
                col = part.column(name)
                # Times compared as their integer ticks (to_pylist gives pandas/datetime objects).
                timed = name in ("dur", "ts")
                want = col.cast(pa.int64()).to_pylist() if timed else col.to_pylist()
                got = d[name]
                mask = np.ma.getmaskarray(got).tolist()
                assert mask == [v is None for v in want], (name, start, length)
                data = np.ma.getdata(got)
                values = (data.view(np.int64) if timed else data).tolist()
                for v, m, w in zip(values, mask, want, strict=True):
                    assert m or v == w or (np.isnan(v) and np.isnan(w)), (name, start, length, v, w)
            tok = [None if t is None else t.tolist() for t in d["tok"]]
            assert tok == part.column("tok").to_pylist(), (start, length)
            img = [None if v is None else bytes(v) for v in d["img"]]
            assert img == part.column("img").to_pylist(), (start, length)


def test_stack_makes_2d_views_and_refuses_ragged_or_null() -> None:
    rb = pa.record_batch(
        {
            "tok": pa.array([[1, 2, 3], [4, 5, 6]], pa.list_(pa.int32())),
            "raw": pa.array([b"abcd", b"efgh"], pa.binary()),
            "emb": pa.array([[1.0], [2.0]], pa.list_(pa.float64(), 1)),
            "y": pa.array([0, 1], pa.uint8()),
        }
    )
    region = ipc_bytes(rb)
    rec = reopen(region)
    rows = np.array([0, 1], np.uint64)
    out = _arrow.stack(rec, _arrow.to_dict(rec, rows))
    assert out["tok"].shape == (2, 3) and out["tok"].dtype == np.int32
    assert out["tok"].tolist() == [[1, 2, 3], [4, 5, 6]]
    assert inside(region, out["tok"].ctypes.data, out["tok"].nbytes)
    assert out["raw"].shape == (2, 4) and bytes(out["raw"][1]) == b"efgh"
    assert inside(region, out["raw"].ctypes.data, out["raw"].nbytes)
    assert out["emb"].shape == (2, 1)
    assert out["y"].tolist() == [0, 1]
    ragged = pa.record_batch({"tok": pa.array([[1], [2, 3]], pa.list_(pa.int32()))})
    with pytest.raises(ValueError, match="equal-length 'tok'.*row 8 has 2, row 7 has 1"):
        _arrow.stack(ragged, _arrow.to_dict(ragged, np.array([7, 8], np.uint64)))
    nulls = pa.record_batch({"y": pa.array([1, None], pa.int8())})
    with pytest.raises(ValueError, match="'y' is null in row 4"):
        _arrow.stack(nulls, _arrow.to_dict(nulls, np.array([3, 4], np.uint64)))


def test_stack_refuses_a_null_inside_a_list_rather_than_serve_what_lies_under_it() -> None:
    # A list's elements have a validity bitmap of their own: a null token inside a row is no
    # null row, and the values buffer holds whatever the writer put under it (0 from Parquet).
    rb = pa.record_batch(
        {
            "tok": pa.array([[1, 2], [3, None], [5, 6], [7, 8]], pa.list_(pa.int32())),
            "big": pa.array([[1, 2], [3, 4], [5, None], [7, 8]], pa.large_list(pa.int64())),
            "emb": pa.array([[1.0, 2.0], [None, 4.0], [5.0, 6.0], [7.0, 8.0]], pa.list_(pa.float32(), 2)),
        }
    )
    rec = reopen(ipc_bytes(rb))
    rows = np.array([6, 7, 8, 9], np.uint64)
    for name, row in (("tok", 7), ("big", 8), ("emb", 7)):
        part = rec.select([name])
        with pytest.raises(ValueError, match=rf"'{name}' has a null inside its lists in row {row}"):
            _arrow.stack(part, _arrow.to_dict(part, rows))
    # Only the batch's own rows count: a slice past the nulls stacks.
    tail = rec.slice(3, 1)
    out = _arrow.stack(tail, _arrow.to_dict(tail, rows[3:]))
    assert out["tok"].tolist() == [[7, 8]] and out["big"].tolist() == [[7, 8]] and out["emb"].tolist() == [[7.0, 8.0]]


def test_nested_lists_are_n_dimensional_views_at_every_slice_offset() -> None:
    # Lists of lists (Hugging Face Array2D/Array3D, Sequence(Sequence)) walk offsets level by
    # level, each list type its own way (a fixed-size list's child ignores the parent's offset):
    # every slice of every nesting is checked against pyarrow's reading of the same rows.
    rng = np.random.default_rng(5)
    n = 23
    cube = [rng.integers(0, 255, (int(k % 3), 2, 3)).tolist() for k in range(n)]
    rb = pa.record_batch(
        {
            "cube": pa.array(cube, pa.list_(pa.list_(pa.list_(pa.uint8())))),
            "boxes": pa.array(
                [[[k, j, 0, 1] for j in range(int(k % 4))] for k in range(n)], pa.large_list(pa.list_(pa.int32(), 4))
            ),
            "grid": pa.array(
                [[[k, k + 1], [k + 2, k + 3]] if k % 5 else None for k in range(n)],
                pa.list_(pa.list_(pa.float32(), 2), 2),
            ),
            "ragged": pa.array([[[1], [2, 3]] if k == 7 else [[k]] for k in range(n)], pa.list_(pa.list_(pa.int64()))),
            "holes": pa.array([[[1, None]] if k == 3 else [[k, k]] for k in range(n)], pa.list_(pa.list_(pa.int64()))),
        }
    )
    region = ipc_bytes(rb)
    whole = reopen(region)
    for start in range(0, n, 2):
        for length in (0, 1, 5, n - start):
            part = whole.slice(start, length)
            d = _arrow.to_dict(part, np.arange(length, dtype=np.uint64))
            for name in ("cube", "boxes", "grid"):
                want = part.column(name).to_pylist()
                got = d[name]
                assert [None if g is None else g.tolist() for g in got] == want, (name, start, length)
                for g in got:
                    assert g is None or inside(region, g.ctypes.data, g.nbytes), name
            assert all(g is None or g.ndim == 3 for g in d["cube"])
            # A ragged row is a list of 1-D views, whatever batch it comes in; the others are
            # N-D arrays.
            for g, w in zip(d["ragged"], part.column("ragged").to_pylist(), strict=True):
                if w == [[1], [2, 3]]:
                    assert type(g) is list and [x.tolist() for x in g] == w, (start, length)
                    assert all(inside(region, x.ctypes.data, x.nbytes) for x in g)
                else:
                    assert isinstance(g, np.ndarray) and g.ndim == 2 and g.tolist() == w, (start, length)
    rows = np.arange(n, dtype=np.uint64) + 100
    rec = whole.slice(10, 10)
    sub = rows[10:20]
    out = _arrow.stack(
        rec.select(["grid"]).filter(pa.array([k % 5 != 0 for k in range(10, 20)])),
        {"__row__": sub[[k % 5 != 0 for k in range(10, 20)]]},
    )
    assert out["grid"].shape == (8, 2, 2) and out["grid"][0].tolist() == [[11, 12], [13, 14]]
    with pytest.raises(
        ValueError, match=r"equal-shaped 'cube' within a batch: row 111 has 2 at dimension 1, row 110 has 1"
    ):
        _arrow.stack(rec.select(["cube"]), {"__row__": sub})
    with pytest.raises(ValueError, match=r"'holes' has a null inside its lists in row 103"):
        _arrow.stack(whole.slice(2, 3).select(["holes"]), {"__row__": rows[2:5]})
    same = whole.slice(3, 6).select(["cube"]).filter(pa.array([k % 3 == 2 for k in range(3, 9)]))
    stacked = _arrow.stack(reopen(ipc_bytes(same)), {"__row__": np.array([5, 8], np.uint64)})["cube"]
    assert stacked.shape == (2, 2, 2, 3) and stacked.tolist() == [cube[5], cube[8]]


def test_a_null_inside_lists_of_lists_keeps_the_columns_form_at_every_slice_offset() -> None:
    """A null element (or a null inner fixed-size list) inside lists of lists made that batch
    `to_pylist()` where every other batch had N-D arrays. Each row is now an N-D array in every
    batch; a row holding a null inside is a MaskedArray (an ndarray too) masked there, the
    others stay views of the batch."""
    n = 17
    rb = pa.record_batch(
        {
            # A null element two levels down.
            "holes": pa.array(
                [[[k, None], [k, k]] if k % 4 == 1 else [[k, k], [k, k]] if k % 7 else None for k in range(n)],
                pa.list_(pa.list_(pa.int64())),
            ),
            # A null inner fixed-size list keeps its slots: its whole row of the shape is masked.
            "boxes": pa.array(
                [[[k, 0, 1, 2], None] if k % 3 == 2 else [[k, 0, 1, 2], [k, 3, 4, 5]] for k in range(n)],
                pa.large_list(pa.list_(pa.float32(), 4)),
            ),
            # Three levels, a null at the bottom of one row, fixed sizes at every level.
            "cube": pa.array(
                [[[[k, None if k == 11 else k]] * 2] for k in range(n)],
                pa.list_(pa.list_(pa.list_(pa.uint8(), 2), 2), 1),
            ),
        }
    )
    region = ipc_bytes(rb)
    whole = reopen(region)

    def flat(v: object) -> list[object]:
        return [x for item in v for x in flat(item)] if isinstance(v, list) else [v]

    for start in range(n):
        for length in range(n - start + 1):
            part = whole.slice(start, length)
            d = _arrow.to_dict(part, np.arange(length, dtype=np.uint64))
            for name, ndim in (("holes", 2), ("boxes", 2), ("cube", 3)):
                got, want = d[name], part.column(name).to_pylist()
                assert len(got) == length, (name, start, length)
                for g, w in zip(got, want, strict=True):
                    if w is None:
                        assert g is None, (name, start, length)
                        continue
                    assert isinstance(g, np.ndarray) and g.ndim == ndim, (name, start, length, type(g))
                    if name == "boxes":
                        # A null inner fixed-size list keeps its 4 slots, all masked.
                        w = [[None] * 4 if inner is None else inner for inner in w]
                    values = flat(w)
                    assert isinstance(g, np.ma.MaskedArray) == (None in values), (name, start, length, w)
                    mask = np.ma.getmaskarray(g).ravel().tolist()
                    data = np.ma.getdata(g).ravel().tolist()
                    assert [None if m else v for v, m in zip(data, mask, strict=True)] == values
                    if not isinstance(g, np.ma.MaskedArray):
                        assert inside(region, g.ctypes.data, g.nbytes), (name, start, length)
    # Copies own their data, masks included.
    copied = _arrow.column_value(whole.column("holes").slice(1, 1), copy=True)[0]
    assert isinstance(copied, np.ma.MaskedArray) and not inside(region, copied.data.ctypes.data)
    assert copied.mask.tolist() == [[False, True], [False, False]]


def test_ragged_rows_of_lists_of_lists_are_lists_of_views_at_every_slice_offset() -> None:
    """A row whose inner lists differ in length made its whole batch `to_pylist()` (Python ints,
    slow, and another form than the batches without one). Such a row is now lists down to 1-D
    views of its innermost lists, whatever batch it comes in; nulls at every level (a null row,
    a null inner list, a null value) and every nesting of the three list types are checked
    against pyarrow's reading of the same rows."""
    rng = np.random.default_rng(11)
    n = 19

    def inner(k: int, j: int) -> list[int | None] | None:
        if (k + j) % 9 == 4:
            return None
        return [None if (k * j + v) % 13 == 5 else k * 10 + v for v in range(int(rng.integers(0, 4)))]

    rows2 = [None if k % 8 == 6 else [inner(k, j) for j in range(int(rng.integers(0, 4)))] for k in range(n)]
    rows3 = [None if k % 7 == 3 else [[[k, j], [j, k]] if j % 2 else [[k]] for j in range(k % 3)] for k in range(n)]
    rb = pa.record_batch(
        {
            "turns": pa.array(rows2, pa.list_(pa.list_(pa.int32()))),
            "large": pa.array(rows2, pa.large_list(pa.large_list(pa.int64()))),
            "deep": pa.array(rows3, pa.list_(pa.list_(pa.list_(pa.uint8())))),
        }
    )
    region = ipc_bytes(rb)
    whole = reopen(region)

    def plain(v: object) -> object:
        if isinstance(v, np.ndarray):
            return v.tolist()
        return None if v is None else [plain(x) for x in v]  # type: ignore[attr-defined]

    def leaves(v: object) -> list[np.ndarray]:
        if isinstance(v, np.ndarray) or v is None:
            return [] if v is None else [v]
        return [leaf for x in v for leaf in leaves(x)]  # type: ignore[attr-defined]

    for start in range(n):
        for length in range(n - start + 1):
            part = whole.slice(start, length)
            d = _arrow.to_dict(part, np.arange(length, dtype=np.uint64))
            for name in ("turns", "large", "deep"):
                got, want = d[name], part.column(name).to_pylist()
                assert [plain(g) for g in got] == want, (name, start, length)
                for g in got:
                    for leaf in leaves(g):
                        if not isinstance(leaf, np.ma.MaskedArray):
                            assert inside(region, leaf.ctypes.data, leaf.nbytes), (name, start, length)
            # Each row's form is the same in every batch: the one it has alone.
            for i, g in enumerate(d["turns"]):
                alone = _arrow.to_dict(whole.slice(start + i, 1), np.zeros(1, np.uint64))["turns"][0]
                assert type(g) is type(alone), (start, length, i)
    copied = _arrow.column_value(whole.column("turns"), copy=True)
    assert [plain(g) for g in copied] == whole.column("turns").to_pylist()
    assert not any(inside(region, leaf.ctypes.data) for g in copied for leaf in leaves(g) if leaf.size)


def test_stack_keeps_dictionary_strings_as_strings_and_names_an_all_null_column() -> None:
    # A pandas categorical of strings is `dictionary<string>` in Parquet's Arrow schema: the dict
    # form decodes it to str like any string column, so stack must keep it as one too.
    rb = pa.record_batch(
        {
            "cat": pa.array(["x", "y", "x"]).dictionary_encode(),
            "big": pa.array(["p", "q", "p"], pa.large_string()).dictionary_encode(),
            "codes": pa.array([3, 4, 3], pa.int64()).dictionary_encode(),
            "raw": pa.array([b"ab", b"cd", b"ab"], pa.binary()).dictionary_encode(),
        }
    )
    rec = reopen(ipc_bytes(rb))
    out = _arrow.stack(rec, _arrow.to_dict(rec, np.array([5, 6, 7], np.uint64)))
    assert out["cat"] == ["x", "y", "x"] and out["big"] == ["p", "q", "p"]
    assert type(out["codes"]) is np.ndarray and out["codes"].tolist() == [3, 4, 3]
    assert out["raw"].shape == (3, 2) and [bytes(r) for r in out["raw"]] == [b"ab", b"cd", b"ab"]
    # A column of Arrow's null type has no validity buffer, yet every row is null.
    nothing = pa.record_batch({"y": pa.array([1, 2], pa.int8()), "gone": pa.nulls(2)})
    with pytest.raises(ValueError, match="'gone' is null in row 8"):
        _arrow.stack(nothing, _arrow.to_dict(nothing, np.array([8, 9], np.uint64)))


def test_row_ids_column_is_appended_once() -> None:
    rb = pa.record_batch({"v": pa.array([1, 2], pa.int32())})
    out = _arrow.with_row_ids(rb, np.array([8, 9], np.uint64))
    assert out.schema.names == ["v", "__row__"]
    assert out.column("__row__").to_pylist() == [8, 9]
    assert _arrow.with_row_ids(out, np.array([0, 0], np.uint64)) is out


def test_timestamps_are_views_and_dates_python_objects() -> None:
    import datetime

    rb = pa.record_batch(
        {
            "ts": pa.array([1, 2, None], pa.timestamp("ms")),
            "day": pa.array([datetime.date(2020, 1, 1), None, datetime.date(2021, 2, 3)], pa.date32()),
        }
    )
    region = ipc_bytes(rb)
    d = _arrow.to_dict(reopen(region), np.array([0, 1, 2], np.uint64))
    ts = d["ts"]
    assert ts.dtype == np.dtype("datetime64[ms]") and ts.mask.tolist() == [False, False, True]
    assert inside(region, ts.data.ctypes.data, ts.data.nbytes)
    assert d["day"] == [datetime.date(2020, 1, 1), None, datetime.date(2021, 2, 3)]


class FakeBatch:
    """What BatchReader reads of a native batch: its IPC bytes, index and row count."""

    def __init__(self, region: np.ndarray, rows: int, index: int = 0) -> None:
        self.region, self.rows, self.index = region, rows, index

    def ipc(self) -> np.ndarray:
        return self.region

    def __len__(self) -> int:
        return self.rows


def test_batch_reader_reads_the_schema_once_and_past_it_zero_copy() -> None:
    def tab(first: int) -> pa.RecordBatch:
        return pa.record_batch({"id": pa.array(range(first, first + 3), pa.int64()), "x": pa.array([0.5] * 3)})

    reader = _arrow.BatchReader()
    regions = [ipc_bytes(tab(0)), ipc_bytes(tab(3))]
    got = [reader.open(FakeBatch(r, 3)) for r in regions]
    assert reader._prefix is not None, "the schema message was not kept"
    assert [b.column("id").to_pylist() for b in got] == [[0, 1, 2], [3, 4, 5]]
    ids = got[1].column("id").to_numpy()
    assert inside(regions[1], ids.ctypes.data, ids.nbytes), "the batch read past the schema was copied"
    # Another schema (other columns): opened as a whole stream, and remembered in its turn.
    other = reader.open(FakeBatch(ipc_bytes(pa.record_batch({"y": pa.array([1, 2], pa.int8())})), 2))
    assert other.schema.names == ["y"]
    assert reader.open(FakeBatch(ipc_bytes(tab(6)), 3)).column("id").to_pylist() == [6, 7, 8]
    # Dictionaries travel between schema and batch: such streams are always read whole.
    cats = pa.record_batch({"c": pa.array(["a", "b"]).dictionary_encode()})
    fresh = _arrow.BatchReader()
    for _ in range(2):
        assert fresh.open(FakeBatch(ipc_bytes(cats), 2)).column("c").to_pylist() == ["a", "b"]
    assert fresh._prefix is None
    # Bytes that are no stream, and a row count other than the message's, are named errors.
    with pytest.raises(_arrow.ShardstreamError, match="arrow batch 7: not a valid Arrow IPC stream"):
        _arrow.BatchReader().open(FakeBatch(np.zeros(64, np.uint8), 3, index=7))
    with pytest.raises(_arrow.ShardstreamError, match="record batch has 3 rows, the message names 4"):
        reader.open(FakeBatch(regions[0], 4))


def test_a_row_column_the_daemon_wrote_is_read_once_and_not_repeated() -> None:
    """Batches carry their rows' ids as a last ``__row__`` column: the dict form takes the ids
    once (the ``rows`` given), and the reader says the batch has them so nothing appends them."""
    rb = pa.record_batch({"v": pa.array([1, 2], pa.int32()), "__row__": pa.array([8, 9], pa.uint64())})
    d = _arrow.to_dict(rb, np.array([8, 9], np.uint64))
    assert list(d) == ["__key__", "__row__", "v"]
    assert d["__row__"].tolist() == [8, 9] and d["__key__"] == ["8", "9"]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rb.schema) as w:
        w.write_batch(rb)
    stream = sink.getvalue().to_pybytes()

    class Native:
        index = 0

        def ipc(self) -> bytes:
            return stream

        def __len__(self) -> int:
            return 2

    reader = _arrow.BatchReader()
    for _ in range(2):  # the first batch opens the stream, the next reads past the kept schema
        assert reader.open(Native()).column("__row__").to_pylist() == [8, 9]  # type: ignore[arg-type]
        assert reader.has_row
    plain = pa.record_batch({"v": pa.array([1, 2], pa.int32())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, plain.schema) as w:
        w.write_batch(plain)
    stream = sink.getvalue().to_pybytes()
    older = _arrow.BatchReader()  # an older daemon's batch: no ids, so the client appends them
    assert older.open(Native()).schema.names == ["v"] and not older.has_row  # type: ignore[arg-type]


def test_columns_the_schema_names_for_nulls_are_masked_in_every_batch() -> None:
    schema = pa.schema([("x", pa.float64()), ("y", pa.int32())], metadata={b"shardstream.nulls": b'["x"]'})
    rb = reopen(ipc_bytes(pa.record_batch([pa.array([1.0, 2.0]), pa.array([3, 4], pa.int32())], schema=schema)))
    assert _arrow.nulls_of(rb.schema) == {"x"}
    out = _arrow.to_dict(rb, np.array([0, 1], np.uint64))
    # No null in this batch, yet `x` may hold one elsewhere in the dataset: null-aware all the same.
    assert isinstance(out["x"], np.ma.MaskedArray) and not out["x"].mask.any()
    assert type(out["y"]) is np.ndarray
    # A schema without the entry (another writer's batch) decides by the batch's own nulls.
    assert _arrow.nulls_of(pa.schema([("x", pa.float64())])) == frozenset()
    for bad in (b"x", b'{"x": 1}', b"[1]"):
        with pytest.raises(_arrow.ShardstreamError, match="columns with nulls"):
            _arrow.nulls_of(pa.schema([("x", pa.float64())], metadata={b"shardstream.nulls": bad}))


def test_a_null_element_inside_a_list_keeps_the_columns_form_at_every_slice_offset() -> None:
    """A null element inside a list made that batch `to_pylist()` (Python lists of floats) where
    every other batch had arrays, so a trainer met the other form mid-epoch. A `fixed_size_list`
    column is a 2-D array in every batch (masked where an element or a row is null, and in every
    batch of a column the schema names for nulls); a `list` column a list of 1-D arrays, the rows
    holding a null element masked there (a MaskedArray is an ndarray)."""
    emb = pa.array([[1, 2], [3, None], None, [7, 8], [9, 10]], pa.list_(pa.float32(), 2))
    seq = pa.array([[1, 2, 3], [None, 5], [], None, [6]], pa.large_list(pa.int64()))
    whole = reopen(ipc_bytes(pa.record_batch({"emb": emb, "seq": seq})))
    for start in range(5):
        for length in range(5 - start + 1):
            part = whole.slice(start, length)
            d = _arrow.to_dict(part, np.arange(length, dtype=np.uint64))
            want = part.column("emb").to_pylist()
            got = d["emb"]
            assert isinstance(got, np.ndarray) and got.shape == (length, 2), (start, length)
            has_null = any(row is None or None in row for row in want)
            assert isinstance(got, np.ma.MaskedArray) == has_null, (start, length)
            flat = [
                None if m else v for v, m in zip(got.ravel().tolist(), np.ma.getmaskarray(got).ravel(), strict=True)
            ]
            assert flat == [v for row in want for v in (row or [None, None])], (start, length)
            rows = d["seq"]
            assert len(rows) == length
            for row, w in zip(rows, part.column("seq").to_pylist(), strict=True):
                if w is None:
                    assert row is None
                    continue
                assert isinstance(row, np.ndarray) and row.dtype == np.int64, (start, length, w)
                assert isinstance(row, np.ma.MaskedArray) == (None in w), (start, length, w)
                assert [None if m else v for v, m in zip(row.tolist(), np.ma.getmaskarray(row), strict=True)] == w
    # A fixed_size_list column the schema names for nulls is masked in a batch without one too.
    schema = pa.schema([("emb", emb.type)], metadata={b"shardstream.nulls": b'["emb"]'})
    clean = pa.record_batch([pa.array([[1, 2]], emb.type)], schema=schema)
    out = _arrow.to_dict(reopen(ipc_bytes(clean)), np.array([0], np.uint64))["emb"]
    assert isinstance(out, np.ma.MaskedArray) and out.shape == (1, 2) and not out.mask.any()
