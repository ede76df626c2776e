"""A daemon that dies (SIGKILL: no goodbye on the wire) surfaces as the documented
`ConnectionError`, on both transports and at every point of an epoch: before the first batch,
mid-epoch, and while the trainer holds a batch. Never `ShardstreamError("Unknown: h2 ...")`."""

from __future__ import annotations

import pytest

import shardstream
from conftest import Daemon


def drain(it) -> int:
    n = 0
    for _ in it:
        n += 1
    return n


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("point", ["before_first_batch", "mid_epoch", "holding_batch"])
def test_sigkill_is_connection_error(dataset, tmp_path, transport: str, point: str) -> None:
    root, samples = dataset
    d = Daemon(tmp_path).start()
    try:
        # Small batches: the epoch is far from over when the daemon dies, whatever is queued.
        loader = shardstream.Loader(str(root), batch_size=2, transport=transport, connect=d.addr)
        held = None
        if point == "before_first_batch":
            it = iter(loader)
            d.kill()
        else:
            it = iter(loader)
            for _ in range(5):
                batch = next(it)
            if point == "holding_batch":
                held = batch
                payload = [bytes(v) for v in batch["jpg"]]
            d.kill()
        with pytest.raises(ConnectionError) as err:
            drain(it)
        assert not isinstance(err.value, shardstream.ShardstreamError)
        if held is not None:
            # What the trainer already holds stays readable after the daemon is gone.
            assert [bytes(v) for v in held["jpg"]] == payload
            held.release()
        # A new iteration fails the same way: the daemon is gone.
        with pytest.raises(ConnectionError):
            drain(iter(loader))
    finally:
        if d.alive():
            d.kill()
