"""A daemon that dies (SIGKILL: no goodbye on the wire) surfaces as the documented
`ConnectionError`, on both transports and at every point of an epoch: before the first batch,
mid-epoch, and while the trainer holds a batch. Never `ShardstreamError("Unknown: h2 ...")`.
A remote daemon that stops answering without a reset (a host powered off or cut off, a frozen
process) is one too, within `SHARDSTREAM_TCP_TIMEOUT` seconds or two of them."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def big_tars(root: Path) -> Path:
    """160 samples of 1 MiB: more than the HTTP/2 windows and the client's queue hold."""
    import webdataset as wds

    root.mkdir()
    with wds.ShardWriter(str(root / "s-%04d.tar"), maxcount=20, verbose=0) as sink:
        for i in range(160):
            sink.write({"__key__": f"k{i:04d}", "bin": bytes([i % 251]) * (1 << 20)})
    return root


def outcome_within(seconds: float, work, unblock) -> tuple[BaseException | None, float]:
    """Runs `work` in a thread; after `seconds` calls `unblock` (so that a hang ends the test
    instead of blocking it). Returns what `work` raised and how long it took to end."""
    out: dict = {}

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out["error"] = e

    started = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    took = time.monotonic() - started
    unblock()
    t.join(30)
    return out.get("error"), took


def test_a_tcp_daemon_that_stops_answering_is_a_connection_error(tmp_path: Path, monkeypatch) -> None:
    # With no keepalive and no timeout the trainer waited forever on a frozen daemon (SIGSTOP,
    # as a partitioned or powered-off host: no reset ever comes).
    root = big_tars(tmp_path / "big")
    monkeypatch.setenv("SHARDSTREAM_TCP_TIMEOUT", "2")
    d = Daemon(tmp_path / "d", addr=f"tcp://127.0.0.1:{free_port()}", args=["--insecure"]).start()
    try:
        it = iter(shardstream.Loader(str(root), batch_size=2, connect=d.addr))
        next(it)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGSTOP)
        err, took = outcome_within(20, lambda: drain(it), d.kill)
        assert isinstance(err, ConnectionError) and took < 20, (err, took)
        assert not isinstance(err, shardstream.ShardstreamError)
    finally:
        if d.alive():
            d.kill()


def test_a_tcp_peer_that_accepts_but_never_answers_is_a_connection_error(dataset, monkeypatch) -> None:
    root, _ = dataset
    monkeypatch.setenv("SHARDSTREAM_TCP_TIMEOUT", "2")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshake; nobody ever reads or writes
    addr = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
    try:
        err, took = outcome_within(20, lambda: drain(shardstream.Loader(str(root), connect=addr)), silent.close)
        assert isinstance(err, ConnectionError) and took < 20, (err, took)
        assert addr in str(err), err
    finally:
        silent.close()


def test_a_remote_client_that_stops_answering_has_its_stream_ended(tmp_path: Path) -> None:
    # The daemon waited on a frozen client's full window for good, its stream still active.
    root = big_tars(tmp_path / "big")
    d = Daemon(tmp_path / "d", addr=f"tcp://127.0.0.1:{free_port()}", args=["--insecure", "--tcp-timeout", "2"]).start()
    client = subprocess.Popen(
        [sys.executable, "-c", FROZEN_CLIENT, str(root), d.addr], stdout=subprocess.PIPE, text=True
    )
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "streaming"
        assert d.status()["active_streams"] == 1
        client.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while d.status()["active_streams"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert d.status()["active_streams"] == 0
    finally:
        client.kill()
        client.wait()
        assert d.stop() == 0


# Takes one batch of the epoch and waits (to be frozen with SIGSTOP).
FROZEN_CLIENT = """
import sys, time, shardstream
it = iter(shardstream.Loader(sys.argv[1], batch_size=2, connect=sys.argv[2]))
next(it)
print("streaming", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize(("transport", "workers"), [("shm", None), ("inline", None), ("auto", 2)])
def test_iterating_again_after_a_restart_continues_where_the_daemon_was_lost(
    dataset, tmp_path, transport: str, workers: int | None
) -> None:
    """A retry loop around an epoch (catch ConnectionError, wait for the daemon, iterate again) gets
    every sample once: the position stays where the lost iteration stopped. It started the epoch
    over, repeating every batch taken before the daemon went away."""
    import shardstream.torch as sst

    root, samples = dataset
    d = Daemon(tmp_path).start()
    try:
        if workers is None:
            loader = shardstream.Loader(str(root), batch_size=8, seed=3, transport=transport, connect=d.addr)
            epoch = loader
        else:
            ds = sst.IterableDataset(str(root), batch_size=8, seed=3, connect=d.addr)
            epoch = loader = sst.DataLoader(ds, num_workers=workers)
        keys: list[str] = []
        lost = 0
        while True:
            try:
                for batch in epoch:
                    keys.extend(batch["__key__"])
                    if lost == 0 and len(keys) >= 80:
                        d.kill()
                break
            except ConnectionError:
                lost += 1
                assert lost == 1, "lost the daemon twice"
                assert loader.state_dict()["batches_consumed"] * 8 == len(keys)
                d = Daemon(tmp_path).start()
        assert lost == 1
        assert len(keys) == len(set(keys)), f"{len(keys) - len(set(keys))} samples repeated"
        assert sorted(keys) == sorted(samples)
        # A break is the caller's: the next iteration begins the epoch.
        first = next(iter(epoch))["__key__"]
        assert list(next(iter(epoch))["__key__"]) == list(first)
    finally:
        if d.alive():
            d.kill()
