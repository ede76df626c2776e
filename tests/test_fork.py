"""What a forked child (a DataLoader worker) inherits from its parent: connections, loaders and
open streams made in the parent belong to the parent's runtime, whose threads the child does not
have. Dropping them in the child must neither touch that runtime nor block; it used to deadlock on
a scheduler lock that a parent runtime thread held at the moment of fork, so that a DataLoader
worker hung for ever in its first garbage collection."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import shardstream

FORKS = 60
CHILD_DEADLINE = 20.0


def _wait_child(pid: int, deadline: float) -> int | None:
    """The child's exit status, or None if it is still running after `deadline` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    return None


def test_a_child_drops_what_it_inherited_without_hanging(daemon, dataset) -> None:
    root, _ = dataset
    # The parent's runtime is kept busy, so that its threads hold their locks at some of the forks.
    stop = threading.Event()

    def churn() -> None:
        conn = shardstream._native.Connection(daemon.addr)
        while not stop.is_set():
            conn.status()
            shardstream._native.Connection(daemon.addr).status()

    threads = [threading.Thread(target=churn, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    hung = []
    try:
        for i in range(FORKS):
            conns = [shardstream._native.Connection(daemon.addr) for _ in range(3)]
            loader = shardstream.Loader(str(root), batch_size=8, connect=daemon.addr, transport="inline")
            it = iter(loader)
            next(it)
            pid = os.fork()
            if pid == 0:  # the child: drop everything inherited, as a worker's gc would
                code = 0
                try:
                    del conns, it, loader
                    gc.collect()
                except BaseException:  # noqa: BLE001 - reported through the exit code
                    code = 1
                os._exit(code)
            status = _wait_child(pid, CHILD_DEADLINE)
            if status is None:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                hung.append(i)
            else:
                assert os.waitstatus_to_exitcode(status) == 0, f"fork {i}: the child failed dropping"
            del conns, it, loader
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert not hung, f"{len(hung)} of {FORKS} children hung dropping what they inherited (forks {hung})"


def test_threads_of_a_child_first_using_an_inherited_connection_do_not_deadlock(daemon, dataset) -> None:
    """After fork, a child's first call on an inherited connection connects anew. It did so
    holding the connection's lock through a wait that gives up the GIL: a second thread, holding
    the GIL and waiting for that lock, hung the child for good (17 of 20 children, with two
    threads each). Every child must finish."""
    root, _ = dataset
    code = textwrap.dedent(
        """
        import os, sys, threading, time
        import shardstream
        loader = shardstream.Loader(sys.argv[1], batch_size=32, connect=sys.argv[2])
        conn = loader._conn
        hung = 0
        for _ in range(10):
            pid = os.fork()
            if pid == 0:
                go = threading.Barrier(3)
                def call():
                    go.wait()
                    conn.status()
                threads = [threading.Thread(target=call) for _ in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                os._exit(0)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.01)
            else:
                hung += 1
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        print(hung)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), daemon.addr], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "0", f"{out.stdout.strip()} of 10 children hung"
