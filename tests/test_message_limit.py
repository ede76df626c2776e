"""The inline transport's message-size limit: it applies to inline streams only (over shared
memory no sample byte enters a message), it is checked against the batches a stream can really
hold, and a single sample too large for any message is refused when the stream opens, naming the
sample, instead of failing mid-epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
import webdataset as wds

import shardstream

MIB = 1 << 20
# The daemon's inline message limit (shardstream_proto::MAX_MESSAGE_BYTES).
LIMIT = 512 * MIB


@pytest.fixture(scope="module")
def big_samples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four samples of 1 MiB: with batch_size 1000 the average-based estimate is ~1 GB per batch,
    but no batch can hold more than the four samples there are."""
    root = tmp_path_factory.mktemp("big")
    with wds.ShardWriter(str(root / "big-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(4):
            sink.write({"__key__": f"b{i}", "bin": bytes([i]) * MIB})
    return root


@pytest.fixture(scope="module")
def outlier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many small samples and one larger than any message: the average is tiny."""
    root = tmp_path_factory.mktemp("outlier")
    with wds.ShardWriter(str(root / "o-%06d.tar"), maxcount=1000, verbose=0) as sink:
        for i in range(3000):
            sink.write({"__key__": f"s{i:05d}", "bin": b"x" * 100})
        sink.write({"__key__": "huge", "bin": b"\0" * (LIMIT + MIB)})
    return root


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_limit_is_checked_against_real_batches(daemon, big_samples: Path, transport: str) -> None:
    loader = shardstream.Loader(str(big_samples), batch_size=1000, transport=transport, connect=daemon.addr)
    batches = list(loader)
    assert len(batches) == 1 and len(batches[0]["__key__"]) == 4
    assert sorted(bytes(v)[:1] for v in batches[0]["bin"]) == [bytes([i]) for i in range(4)]
    assert loader.stats()["transport"] == transport


def test_shm_streams_are_not_limited(daemon, outlier: Path) -> None:
    loader = shardstream.Loader(str(outlier), batch_size=64, shuffle=False, transport="shm", connect=daemon.addr)
    sizes = {}
    for batch in loader:
        for key, v in zip(batch["__key__"], batch["bin"], strict=True):
            sizes[key] = len(v)
        batch.release()
    assert sizes["huge"] == LIMIT + MIB and len(sizes) == 3001


def test_inline_outlier_is_refused_at_open_naming_it(daemon, outlier: Path) -> None:
    loader = shardstream.Loader(str(outlier), batch_size=64, shuffle=False, transport="inline", connect=daemon.addr)
    with pytest.raises(ValueError) as err:
        next(iter(loader))
    msg = str(err.value)
    assert "o-000003.tar" in msg and "sample" in msg and "shm" in msg, msg
