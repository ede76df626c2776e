"""A Loader (and its stream) used from several threads: iterated on one, closed or garbage-collected
on another. Nothing may raise `PanicException` (a BaseException that `except Exception` misses),
and no Rust panic may ever reach Python as anything but a `ShardstreamError`."""

from __future__ import annotations

import gc
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import shardstream
from conftest import wait_for


def status(addr: str) -> dict:
    return shardstream._native.Connection(addr).status()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_close_from_another_thread(daemon, dataset, transport: str) -> None:
    root, _ = dataset
    loader = shardstream.Loader(str(root), batch_size=4, transport=transport, connect=daemon.addr)
    errors: list[BaseException] = []
    started = threading.Event()

    def consume() -> None:
        try:
            for _ in loader:
                started.set()
        except BaseException as e:  # noqa: BLE001 - the point: nothing, not even a BaseException
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    closer_errors: list[BaseException] = []

    def close() -> None:
        try:
            loader.close()
        except BaseException as e:  # noqa: BLE001
            closer_errors.append(e)

    c = threading.Thread(target=close)
    c.start()
    c.join(30)
    assert not c.is_alive(), "close() from another thread must not block on the iterating thread"
    t.join(30)
    assert not t.is_alive(), "the iterating thread must end once the loader is closed"
    assert closer_errors == []
    # The iterating thread either stopped cleanly or got an ordinary exception, never a panic.
    for e in errors:
        assert isinstance(e, Exception), repr(e)
        assert "Panic" not in type(e).__name__, repr(e)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_an_iteration_cut_short_by_a_second_one_raises_not_ends(daemon, dataset, transport: str) -> None:
    # A Loader has one position (its state_dict) and so one stream: a new iteration closes the
    # one before. That one then ended as if its epoch were over, its remaining batches gone
    # without a word: zip(loader, loader) gave one pair, and a second thread iterating the same
    # loader cut the first thread's epoch short.
    root, samples = dataset
    loader = shardstream.Loader(str(root), batch_size=64, transport=transport, connect=daemon.addr)
    first = iter(loader)
    next(first)
    assert sum(len(b["__key__"]) for b in loader) == len(samples)
    with pytest.raises(RuntimeError, match="another iteration of the same Loader"):
        next(first)
    with pytest.raises(RuntimeError, match="another iteration of the same Loader"):
        list(zip(loader, loader, strict=True))

    errors: list[BaseException] = []
    started = threading.Event()

    def consume() -> None:
        try:
            for _ in loader:
                started.set()
                time.sleep(0.05)
        except BaseException as e:  # noqa: BLE001 - what the cut-short thread gets
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=consume)
    t.start()
    assert started.wait(30)
    assert sum(len(b["__key__"]) for b in loader) == len(samples)
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    assert "another iteration of the same Loader" in str(errors[0])
    # A loop left with `break` is finalized at once: the next iteration is not a second one.
    for _ in loader:
        break
    assert sum(len(b["__key__"]) for b in loader) == len(samples)


def test_stream_dropped_on_another_thread(own_daemon, dataset) -> None:
    daemon = own_daemon
    root, _ = dataset
    loader = shardstream.Loader(str(root), batch_size=4, connect=daemon.addr)
    it = iter(loader)
    batch = next(it)
    del batch
    box = [loader, it]
    del loader, it
    errors: list[BaseException] = []
    # Exceptions in finalizers (a generator's `finally`, `__del__`) are "ignored": printed, not
    # raised. Collect them instead.
    unraisable: list[str] = []
    old_hook = sys.unraisablehook
    sys.unraisablehook = lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")

    def drop() -> None:
        try:
            box.clear()  # last references: the generator, the stream and the Loader die here
            gc.collect()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        t = threading.Thread(target=drop)
        t.start()
        t.join(30)
    finally:
        sys.unraisablehook = old_hook
    assert errors == []
    assert unraisable == []
    gc.collect()
    assert wait_for(lambda: status(daemon.addr)["leased_shards"] == 0, 10)


SCRIPT = textwrap.dedent(
    """
    import gc, sys, threading, shardstream
    loader = shardstream.Loader(sys.argv[1], batch_size=4, connect=sys.argv[2])
    it = iter(loader)
    next(it)
    stream = loader._stream
    def other():
        stream.close()
        try:
            stream.next_batch()
        except Exception:
            pass
        stream.header
    t = threading.Thread(target=other)
    t.start(); t.join()
    # A cycle that only the collector frees, collected on another thread.
    cyc = [loader, it]
    cyc.append(cyc)
    del loader, it, stream, cyc
    t = threading.Thread(target=gc.collect)
    t.start(); t.join()
    print("ok", flush=True)
    """
)


def test_cross_thread_use_never_panics(daemon, dataset) -> None:
    root, _ = dataset
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), daemon.addr], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert "Panic" not in r.stderr and "panicked" not in r.stderr, r.stderr


@pytest.mark.parametrize("mode", ["view", "packed"])
def test_batches_dropped_on_another_thread_while_the_stream_waits(dataset, tmp_path, mode: str) -> None:
    """The client holds back a few releases to send them together. A thread that waits for the
    next batch while another drops the previous ones must still get it: the daemon (allowed two
    batches outstanding here) needs exactly those releases to make it."""
    from conftest import Daemon

    root, samples = dataset
    flag = "--shm-credits" if mode == "view" else "--ring-slots"
    d = Daemon(tmp_path, args=[flag, "2"]).start()
    try:
        kwargs = {"fields": ["cls"], "collate": "stack"} if mode == "packed" else {}
        loader = shardstream.Loader(str(root), batch_size=8, connect=d.addr, **kwargs)
        handoff: queue.Queue[object] = queue.Queue(maxsize=1)

        def produce() -> None:
            try:
                for batch in loader:
                    handoff.put(batch)
            finally:
                handoff.put(None)

        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        keys: list[str] = []
        while True:
            # Without the fix this waits forever: the producer waits for a batch, the daemon for a
            # slot whose release this thread's drop left held back.
            batch = handoff.get(timeout=30)
            if batch is None:
                break
            keys.extend(batch["__key__"])
            time.sleep(0.002)  # the producer is waiting by now, as in a trainer's step
            del batch
        producer.join(timeout=30)
        assert sorted(keys) == sorted(samples)
    finally:
        assert d.stop() == 0
