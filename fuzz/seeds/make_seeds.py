"""Writes the committed seed inputs of the fuzz targets (fuzz/seeds/<target>/), small and valid,
so fuzzing starts from the structures the readers accept. Run from anywhere; rewrites the files.

The TAR seeds are written by Python's tarfile (what webdataset reads and writes with), in the three
header dialects the parser handles: ustar, GNU (long names) and PAX.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def put(target: str, name: str, data: bytes) -> None:
    d = HERE / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def tar_bytes(members: list[tuple[str, bytes]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(payload))
    data = buf.getvalue()
    # Keep the two zero blocks of the end marker, drop tarfile's padding to a 10 KiB record.
    end = len(data.rstrip(b"\0"))
    end = -(-end // 512) * 512 + 1024
    return data[:end]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def main() -> None:
    wds = [("s/000.jpg", b"\xff\xd8jpeg"), ("s/000.cls", b"7"), ("s/001.jpg", b"\xff\xd8x" * 100), ("s/001.cls", b"3")]
    put("tar_index", "ustar.tar", tar_bytes(wds, tarfile.USTAR_FORMAT))
    long = [("d/" + "x" * 150 + "/k.seg.png", b"png"), ("d/" + "x" * 150 + "/k.JSON", b"{}")]
    put("tar_index", "gnu_longname.tar", tar_bytes(long, tarfile.GNU_FORMAT))
    put("tar_index", "pax.tar", tar_bytes(long + [("__dir__/meta", b"m"), ("a/b.txt", b"t")], tarfile.PAX_FORMAT))
    put("tar_sample", "ustar.tar", tar_bytes(wds[:2], tarfile.USTAR_FORMAT)[:-1024])
    put("tar_sample", "pax.tar", tar_bytes(long, tarfile.PAX_FORMAT)[:-1024])

    # Sidecar body after the identity: fields, sample count, boundary deltas.
    fields = [b"cls", b"jpg"]
    body = varint(len(fields)) + b"".join(varint(len(f)) + f for f in fields)
    body += varint(2) + varint(0) + varint(1536) + varint(1536)
    put("sidecar", "two_samples.bin", body)
    put("sidecar", "empty.bin", varint(0) + varint(0))

    shards = [
        {"name": "a-000000.tar", "bytes": 3072, "samples": 2, "crc32c": "0a1b2c3d"},
        {"name": "a-000001.tar", "bytes": 2048, "samples": 1, "crc32c": "ffffffff", "index": "_shardstream/x.idx"},
    ]
    manifest = {
        "format": "shardstream-manifest",
        "version": 1,
        "shard_format": "webdataset",
        "checksum": "crc32c",
        "created_by": "seed",
        "total_samples": 3,
        "total_bytes": 5120,
        "fields": ["cls", "jpg"],
        "shards": shards,
    }
    put("manifest", "two_shards.json", json.dumps(manifest, indent=1).encode())
    # Each shard's largest sample (optional keys, given together, checked against the shard).
    shards[0] |= {"max_sample": 1, "max_sample_bytes": 2048}
    shards[1] |= {"max_sample": 0, "max_sample_bytes": 1536}
    put("manifest", "largest_sample.json", json.dumps(manifest, indent=1).encode())

    def frame(kind: int, a: int, b: int, payload: bytes = b"") -> bytes:
        return struct.pack("<4sHHQQ40s", b"SSHM", 1, kind, a, b, payload)

    put("shm_frame", "hello.bin", frame(1, 0, 0, bytes(range(16))))
    put("shm_frame", "shard_fd.bin", frame(3, 5, 1 << 20))
    put("shm_frame", "error.bin", frame(5, 4, 0, "malformed frame é".encode()))

    # A ring of two 4 KiB slots; slot 0 holds batch 3: 2 samples, fields of 4 and 1 bytes.
    page = 4096
    header = struct.pack("<4sHHIIQQQ24s", b"SRNG", 1, 64, 2, 0, page, page, 9, b"")
    seg = bytearray(page * 3)
    seg[:64] = header
    n_fields, n_samples = 2, 2
    cols = 64 + 32 * n_fields  # 128, already 64-aligned
    slot = struct.pack("<4sHHQQQ32s", b"SSLT", n_fields, 0, 3, n_samples, 2 * 4 + 2 * 1, b"")
    slot += struct.pack("<QQQQ", cols, 4, n_samples, 0) + struct.pack("<QQQQ", cols + 64, 1, n_samples, 0)
    seg[page : page + len(slot)] = slot
    seg[page + cols : page + cols + 8] = b"abcdefgh"
    seg[page + cols + 64 : page + cols + 66] = b"xy"
    put("ring", "two_slots.bin", bytes(seg))

    header = {"journal": "shardstream-pack", "version": 1, "fingerprint": "0" * 32, "created_by": "seed"}
    rec = {
        "shard": 0,
        "name": "s-000000.tar",
        "first": 0,
        "end": 3,
        "bytes": 10240,
        "samples": 3,
        "files": 6,
        "payload": 4000,
        "crc32c": "0a1b2c3d",
        "fields": ["cls", "jpg"],
        "bad_inputs": 0,
    }
    rec2 = dict(rec, shard=1, name="s-000001.tar", first=3, end=5, samples=2)
    lines = [json.dumps(header), json.dumps(rec), json.dumps(rec2), '{"shard": 2, "trunc']
    put("journal", "two_shards.jsonl", "\n".join(lines).encode())
    parquet_seeds()
    parquet_footers_seeds()


def parquet_seeds() -> None:
    """Parquet files as pyarrow writes them (what most datasets are): small, several codecs,
    dictionary and plain encodings, nulls, a list column, a binary column, two row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": pa.array(range(12), pa.int64()),
            "label": pa.array([i % 3 if i % 5 else None for i in range(12)], pa.int32()),
            "caption": pa.array([f"c{i % 4}" for i in range(12)]),
            "image": pa.array([bytes([i]) * (i + 1) for i in range(12)], pa.binary()),
            "tokens": pa.array([list(range(i % 4)) for i in range(12)], pa.list_(pa.int32())),
        }
    )
    for codec in ("none", "snappy", "zstd"):
        buf = io.BytesIO()
        pq.write_table(table, buf, compression=codec, row_group_size=6, use_dictionary=["caption"])
        put("parquet_footer", f"pyarrow_{codec}.parquet", buf.getvalue())
        put("parquet_row_group", f"pyarrow_{codec}.parquet", buf.getvalue())
    parquet_page_seeds()


def parquet_page_seeds() -> None:
    """More of the page layer for the row-group decoder: data pages v2, dictionaries everywhere,
    several pages to a chunk, a page index, the wide and view-able types (large_binary,
    large_string, fixed_size_binary), a Hugging Face image struct and nested lists."""
    import decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 16
    image = pa.StructArray.from_arrays(
        [
            pa.array([bytes([i]) * (i % 5) if i % 4 else None for i in range(n)], pa.binary()),
            pa.array([f"img/{i}.jpg" if i % 3 else None for i in range(n)], pa.string()),
        ],
        names=["bytes", "path"],
        mask=pa.array([i % 7 == 0 for i in range(n)]),
    )
    wide = pa.table(
        {
            "ok": pa.array([i % 3 == 0 if i % 5 else None for i in range(n)], pa.bool_()),
            "big": pa.array([b"v" * (i % 6) for i in range(n)], pa.large_binary()),
            "text": pa.array([f"t{i % 3}" if i % 4 else None for i in range(n)], pa.large_string()),
            "hash": pa.array([bytes([i]) * 4 for i in range(n)], pa.binary(4)),
            "when": pa.array(range(n), pa.timestamp("ms")),
            "price": pa.array([decimal.Decimal(i) / 4 for i in range(n)], pa.decimal128(9, 2)),
            "image": image,
        }
    )
    buf = io.BytesIO()
    pq.write_table(wide, buf, compression="snappy", row_group_size=8, data_page_version="2.0", write_page_index=True)
    put("parquet_row_group", "pages_v2_wide.parquet", buf.getvalue())
    buf = io.BytesIO()
    pq.write_table(wide, buf, compression="none", row_group_size=n, data_page_size=64, use_dictionary=True)
    put("parquet_row_group", "small_pages_dictionary.parquet", buf.getvalue())
    nested = pa.table(
        {
            "id": pa.array(range(n), pa.int32()),
            "spans": pa.array(
                [[{"a": j, "b": f"s{j}"} for j in range(i % 3)] if i % 5 else None for i in range(n)],
                pa.list_(pa.struct([("a", pa.int16()), ("b", pa.string())])),
            ),
            "block": pa.array([[float(i)] * 4 for i in range(n)], pa.list_(pa.float32(), 4)),
        }
    )
    buf = io.BytesIO()
    pq.write_table(nested, buf, compression="zstd", row_group_size=5)
    put("parquet_row_group", "nested_zstd.parquet", buf.getvalue())


def parquet_footers_seeds() -> None:
    """Bodies of footers bundles (the target adds the magic, version and checksum): an entry
    count, then each entry's name and sidecar bytes, both behind a u32 length."""

    def entry(name: bytes, sidecar: bytes) -> bytes:
        return struct.pack("<I", len(name)) + name + struct.pack("<I", len(sidecar)) + sidecar

    put("parquet_footers", "empty.bin", struct.pack("<I", 0))
    two = entry(b"a.parquet", b"SSPQX\0\r\n" + bytes(20)) + entry(b"dir/b.parquet", b"")
    put("parquet_footers", "two_entries.bin", struct.pack("<I", 2) + two)


if __name__ == "__main__":
    main()
