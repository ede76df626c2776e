"""A shard of a dataset read in place (local or parallel file system) truncated by someone else
while a trainer uses it: the trainer gets `ShardError` naming the shard, and never dies of SIGBUS
(which a mapping of the file would give it). The trainer runs in a subprocess so that a SIGBUS
shows as its exit status instead of killing the test run."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

# Inline, the daemon sends batches ahead of the trainer: up to the stream's HTTP/2 window (64 MiB,
# client/src/lib.rs) plus the client's queue. A dataset smaller than that may be sent whole before
# the truncation, and the epoch then ends without an error. At 3 x 100 samples of 400 KiB (117 MiB)
# at least ~40 MiB are read after it, whatever the timing.
SAMPLE_BYTES = 400 << 10


def write_large_dataset(root: Path) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(21)
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=100, verbose=0) as sink:
        for i in range(300):
            payload = rng.integers(0, 256, SAMPLE_BYTES, dtype=np.uint8).tobytes()
            sink.write({"__key__": f"s/{i:06d}", "jpg": payload, "cls": str(i % 7).encode()})


TRAINER = textwrap.dedent(
    """
    import json, os, sys, shardstream
    root, addr, transport, when = sys.argv[1:5]
    loader = shardstream.Loader(root, batch_size=4, shuffle=False, transport=transport, connect=addr)
    it = iter(loader)
    held = next(it)
    payload = [bytes(v) for v in held["jpg"]]
    def truncate():
        for name in sorted(os.listdir(root)):
            os.truncate(os.path.join(root, name), 1024)
    out = {"transport": loader.stats()["transport"]}
    truncate()
    if when == "held":
        # The batch taken before the truncation stays readable, and the same.
        out["held_ok"] = [bytes(v) for v in held["jpg"]] == payload
    try:
        for batch in it:
            for v in batch["jpg"]:
                bytes(v)
        out["error"] = None
    except shardstream.ShardError as e:
        out["error"] = "ShardError"
        out["message"] = str(e)
        out["shard"] = e.shard
    except Exception as e:
        out["error"] = type(e).__name__
        out["message"] = str(e)
    print(json.dumps(out), flush=True)
    """
)


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("when", ["held", "before_read"])
def test_truncated_shard_is_shard_error_not_sigbus(daemon, tmp_path: Path, transport: str, when: str) -> None:
    root = tmp_path / "ds"
    write_large_dataset(root)
    assert sum(f.stat().st_size for f in root.iterdir()) > 100 << 20
    r = subprocess.run(
        [sys.executable, "-c", TRAINER, str(root), daemon.addr, transport, when],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != -signal.SIGBUS, "the trainer was killed by SIGBUS"
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["transport"] == transport
    assert out["error"] == "ShardError", out
    # Names the shard (which one depends on how far the daemon read ahead before the truncation).
    assert re.search(r"/ds/train-00000[0-2]\.tar", out["message"]), out
    assert out["shard"] and re.search(r"train-00000[0-2]\.tar$", out["shard"]), out
    if when == "held":
        assert out["held_ok"]
