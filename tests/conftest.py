"""End-to-end fixtures: datasets written by the real `webdataset` library, and a real
`shardstream serve` process (the command installed by the Python package, or $SHARDSTREAM_BIN) on a
private socket."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from s3server import S3Server

import shardstream

# SHARDSTREAM_BIN runs the tests against another build of the command (e.g. a worktree's
# target/debug/shardstream) without installing it into the shared venv.
SHARDSTREAM = os.environ.get("SHARDSTREAM_BIN") or str(Path(sys.executable).with_name("shardstream"))


# Room for the suite's temporary files (datasets, node caches, S3 buckets): a full run peaked at
# ~470 MiB (`du` of /tmp every 30 s). Checked before any test, so a nearly full disk is one clear message instead of a
# hundred errors from half-written fixtures.
DISK_NEEDED = 1 << 30


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def pytest_report_header(config: pytest.Config) -> str:
    tmp = tempfile.gettempdir()
    return f"free disk: {_free_bytes(tmp) >> 20} MiB in {tmp}, {_free_bytes('/dev/shm') >> 20} MiB in /dev/shm"


def pytest_sessionstart(session: pytest.Session) -> None:
    # The venv is shared by every clone on the machine (scripts/venv.sh), so the package it
    # imports, and the daemon beside it, are what the last `make develop` anywhere installed.
    here = Path(__file__).resolve().parents[1] / "loader-py" / "python"
    imported = Path(shardstream.__file__).resolve().parents[1]
    if imported != here:
        pytest.exit(
            f"these tests would run another checkout's build: the shardstream package comes from {imported}, "
            f"not {here} (the venv is shared by the checkouts on this machine); run `make develop` here",
            returncode=3,
        )
    tmp = tempfile.gettempdir()
    free = _free_bytes(tmp)
    if free < DISK_NEEDED:
        pytest.exit(
            f"only {free >> 20} MiB free in {tmp}; the tests need about {DISK_NEEDED >> 20} MiB "
            "for their datasets and caches (set TMPDIR to a larger disk)",
            returncode=3,
        )


def write_dataset(
    root: Path, n: int, per_shard: int, seed: int = 0, extra_every: int = 0
) -> dict[str, dict[str, bytes]]:
    """Writes `n` samples with webdataset.ShardWriter; returns {key: {field: bytes}}."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    samples: dict[str, dict[str, bytes]] = {}
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            key = f"s{seed}/{i:06d}"
            size = int(rng.integers(1, 3000))
            fields = {"jpg": rng.integers(0, 256, size, dtype=np.uint8).tobytes(), "cls": str(i % 7).encode()}
            if extra_every and i % extra_every == 0:
                fields["json"] = b'{"i": %d}' % i
            samples[key] = fields
            sink.write({"__key__": key, **fields})
    return samples


BIG_SAMPLES = 400  # of 512 KiB: 200 MB, far more than a stream's 64 MiB flow-control window


def write_big(tmp_path: Path) -> Path:
    """A WebDataset of BIG_SAMPLES samples of 512 KiB, for streams the daemon cannot send at once."""
    root = tmp_path / "big"
    root.mkdir()
    blob = np.random.default_rng(0).integers(0, 256, 512 << 10, dtype=np.uint8).tobytes()
    with wds.ShardWriter(str(root / "big-%04d.tar"), maxcount=50, verbose=0) as sink:
        for i in range(BIG_SAMPLES):
            sink.write({"__key__": f"{i:05d}", "bin": blob})
    return root


def write_token_blocks(
    root: Path, n: int, record_bytes: int, per_shard: int, seed: int, label_mod: int
) -> dict[str, bytes]:
    """Writes `n` fixed-size token blocks (int32, the first one the sample's index) and a 4-byte
    label (index % label_mod) with webdataset.ShardWriter; returns {key: block bytes}, keys t00000..."""
    rng = np.random.default_rng(seed)
    records: dict[str, bytes] = {}
    with wds.ShardWriter(str(root / "tok-%04d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(n):
            key = f"t{i:05d}"
            block = rng.integers(0, 50_000, record_bytes // 4, dtype=np.int32)
            block[0] = i
            records[key] = block.tobytes()
            sink.write({"__key__": key, "tok": block.tobytes(), "lbl": (i % label_mod).to_bytes(4, "little")})
    return records


def mapped_memfds(name: str = "") -> list[tuple[int, int]]:
    """Address ranges of this process's shared-memory segments (the ring is a memfd), of those
    whose name begins with `name`."""
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if f"memfd:{name}" in line:
            lo, hi = line.split()[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def run_child_ok(code: str, *args: str) -> None:
    """Runs `code` in a new interpreter (with this directory importable), where a crash (a
    signal) cannot take the test session down; it must exit 0 printing "ok"."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent
    )
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-3000:]}"
    assert out.stdout.strip() == "ok", out.stdout[-3000:]


def wait_for(cond, timeout: float = 5.0) -> bool:
    """Polls `cond` until it holds or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def kept_row_groups(d: Daemon, n: int, timeout: float = 30.0) -> set[str]:
    """Waits until the daemon `d` has kept `n` decoded row groups in its node cache, written in
    the background, and returns their file names. The status counts a row group from the start of
    its write and its file gets its name at the end, so both are awaited."""
    shards = d.cache_dir / "shards"

    def names() -> set[str]:
        return {p.name for p in shards.glob("derived-*")}

    assert wait_for(lambda: len(names()) == n, timeout), (sorted(names()), d.status())
    assert d.status()["cache"]["decoded_row_groups"] == n, d.status()
    return names()


def hold_streams(url: str, n: int, **opts: Any) -> list[Iterator[Any]]:
    """`n` streams of `url` (`shardstream.Loader` options `opts`, batches of one sample), each
    past its first batch and held open, as a client's idle DataLoader workers hold theirs."""
    held = []
    for _ in range(n):
        it = iter(shardstream.Loader(url, batch_size=1, **opts))
        next(it)
        held.append(it)
    return held


def hold_batches_until_warned(loader: object, wait: float = 30.0) -> tuple[list[str], list[str]]:
    """Iterates `loader` keeping every batch, as a loop (or a transform's results) that holds on
    to them does, until a warning comes (or `wait` s pass); then another thread lets the held
    batches go and the rest of the epoch is taken as it comes. Returns the RuntimeWarnings'
    messages and every batch's keys."""
    held: list[object] = []
    keys: list[str] = []

    def let_go_once_warned() -> None:
        deadline = time.monotonic() + wait
        while not caught and time.monotonic() < deadline:
            time.sleep(0.05)
        keys.extend(k for b in held for k in b["__key__"])  # type: ignore[index]
        held.clear()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        helper = threading.Thread(target=let_go_once_warned, daemon=True)
        helper.start()
        for batch in loader:  # type: ignore[attr-defined]
            if helper.is_alive():
                held.append(batch)
            else:
                keys.extend(batch["__key__"])
        helper.join(timeout=5)
    return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], keys


def within(deadline: float, f: Callable[[], object]) -> object:
    """Runs `f` on a thread: its result, or the exception it raised (for the caller to judge).
    Fails if it outlives `deadline` seconds: a hang is a failure, never a stuck test run."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(f())
        except BaseException as e:  # noqa: BLE001 - handed to the caller to judge
            # Without its traceback: the frames (and the Loader in them) are freed on this thread,
            # which made them, not on the thread that inspects the error.
            out.append(e.with_traceback(None))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(deadline)
    if t.is_alive():
        raise AssertionError(f"hung: no result and no error within {deadline} s")
    return out[0]


def ctrl_c_as_at_a_terminal() -> None:
    """A `preexec_fn` for a command a test sends Ctrl-C (SIGINT) as a terminal would: run from a
    background job of a non-interactive shell (`make test &`), the suite and its children inherit
    SIGINT ignored, and a command rightly keeps a signal ignored at its start."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Daemon:
    """`shardstream serve` as a real process. `args`: extra command-line options; `env`: extra
    environment (the S3 endpoint and credentials); `wrap`: a command to run it under; `binary`: another
    build of the command (the failpoint build, SHARDSTREAM_FAIL_BIN); `log`: a file for its stderr
    (its logs), for tests that read them; `level`: its `--log` level."""

    def __init__(
        self,
        tmp: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
        binary: str | None = None,
        addr: str | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
        level: str = "warn",
    ) -> None:
        self.tmp = tmp
        self.level = level
        self.cwd = cwd
        self.addr = addr or f"unix://{tmp / 'sock'}"
        self.cache_dir = tmp / "cache"
        self.args = args or []
        self.env = env or {}
        self.wrap = wrap or []
        self.binary = binary or SHARDSTREAM
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        cmd = [self.binary, "serve", "--listen", self.addr, "--cache-dir", str(self.cache_dir), "--log", self.level]
        with open(self.log, "ab") if self.log else contextlib.nullcontext() as stderr:
            self.proc = subprocess.Popen(
                [*self.wrap, *cmd, *self.args], env={**os.environ, **self.env}, stderr=stderr, cwd=self.cwd
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}")
            # The socket accepts connections as soon as it is bound, a moment before the daemon
            # serves: wait for an answer.
            if shardstream._native.probe(self.addr):
                try:
                    shardstream._native.Connection(self.addr).status()
                    return self
                except ConnectionError:
                    pass
            time.sleep(0.02)
        raise RuntimeError("daemon did not start within 30 s")

    def status(self) -> dict:
        return shardstream._native.Connection(self.addr).status()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A real S3-compatible server (s3s-fs) on 127.0.0.1, one per test module."""
    server = S3Server(tmp_path_factory.mktemp("s3")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, bytes]]]:
    root = tmp_path_factory.mktemp("wds")
    samples = write_dataset(root, n=1003, per_shard=97, extra_every=10)
    return root, samples


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    code = d.stop()
    assert code == 0, f"daemon exited with {code} on SIGTERM (expected a graceful 0)"


@pytest.fixture(autouse=True)
def _no_env_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDSTREAM_ADDR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


@pytest.fixture
def own_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that assert on the daemon's totals (leases), which a
    shared daemon's other clients (earlier tests' objects not yet collected) would add to."""
    d = Daemon(tmp_path).start()
    yield d
    d.stop()
