"""What a deployment relies on from `shardstream serve`: it never destroys a file that is not its
own socket, `status` is a usable readiness probe, sd_notify READY/STOPPING, a bounded drain on
SIGTERM, and logs an operator can filter or ship as JSON."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tlsutil
from s3server import free_port

import shardstream
from conftest import BIG_SAMPLES, SHARDSTREAM, Daemon, ctrl_c_as_at_a_terminal, wait_for, write_big

# An S3 endpoint where nothing listens: the store is retried for ~20 s before it fails.
UNREACHABLE_STORE = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "AWS_ACCESS_KEY_ID": "a",
    "AWS_SECRET_ACCESS_KEY": "b",
    "AWS_REGION": "us-east-1",
}


def serve(tmp: Path, listen: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [SHARDSTREAM, "serve", "--listen", f"unix://{listen}", "--cache-dir", str(tmp / "cache"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("which", ["sock", "sock.shm"])
def test_serve_refuses_to_replace_a_regular_file(tmp_path: Path, which: str) -> None:
    victim = tmp_path / which
    victim.write_text("precious")
    r = serve(tmp_path, tmp_path / "sock")
    assert r.returncode != 0, r.stderr
    assert str(victim) in r.stderr
    assert victim.read_text() == "precious"


def test_serve_refuses_to_replace_a_directory(tmp_path: Path) -> None:
    (tmp_path / "sock").mkdir()
    (tmp_path / "sock" / "keep").write_text("x")
    r = serve(tmp_path, tmp_path / "sock")
    assert r.returncode != 0
    assert str(tmp_path / "sock") in r.stderr
    assert (tmp_path / "sock" / "keep").read_text() == "x"


def test_a_cache_dir_that_is_a_file_is_named_as_such(tmp_path: Path) -> None:
    # It said "cannot create cache directory ...: File exists (os error 17)".
    (tmp_path / "cache").write_text("not a directory\n")
    out = serve(tmp_path, tmp_path / "sock")
    assert out.returncode != 0 and f"{tmp_path / 'cache'} is a file, not a directory" in out.stderr, out.stderr
    assert not (tmp_path / "sock").exists()


def test_a_start_that_fails_after_binding_leaves_no_socket_behind(tmp_path: Path) -> None:
    # With its metrics port taken the daemon exited but left its socket: `status` then said
    # "Connection refused" until the next start replaced it as stale.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = serve(tmp_path, tmp_path / "sock", "--metrics-addr", f"127.0.0.1:{port}")
    assert out.returncode != 0 and "metrics" in out.stderr, out.stderr
    assert not (tmp_path / "sock").exists() and not (tmp_path / "sock.shm").exists()


def a_socket_path(tmp: Path, length: int) -> Path:
    """A path of `length` bytes ending in `/sock`, its directory made."""
    pad = length - len(str(tmp)) - len("/sock") - 1
    assert pad > 0, tmp
    (tmp / ("d" * pad)).mkdir()
    path = tmp / ("d" * pad) / "sock"
    assert len(str(path)) == length
    return path


def test_a_socket_path_too_long_for_a_unix_address_is_named_with_the_limit(tmp_path: Path) -> None:
    # It said "socket path too long <dir>/.ss1a2b3c4d/s: File name too long", naming a temporary
    # directory of the daemon's, not the path given or how long it may be.
    path = a_socket_path(tmp_path, 104)
    out = serve(tmp_path, path)
    assert out.returncode != 0, out.stderr
    assert f"{path} is 104 bytes" in out.stderr and "at most 103" in out.stderr, out.stderr
    assert ".ss" not in out.stderr, out.stderr
    assert list(path.parent.iterdir()) == [] and not (tmp_path / "cache").exists()


def test_the_longest_socket_path_that_fits_is_served(tmp_path: Path) -> None:
    # The socket is bound in a temporary directory beside its final path, 9 bytes longer than
    # `sock`: a path that fits was refused when that one did not.
    path = a_socket_path(tmp_path, 103)
    d = Daemon(tmp_path, addr=f"unix://{path}").start()
    try:
        out = subprocess.run([SHARDSTREAM, "status", "--connect", d.addr], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert sorted(p.name for p in path.parent.iterdir()) == ["sock", "sock.shm"]
    finally:
        assert d.stop() == 0


def test_serve_refuses_a_live_socket_of_another_program(tmp_path: Path) -> None:
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(tmp_path / "sock"))
    other.listen()
    try:
        r = serve(tmp_path, tmp_path / "sock")
        assert r.returncode != 0
        assert str(tmp_path / "sock") in r.stderr
        assert (tmp_path / "sock").is_socket()
    finally:
        other.close()


def test_serve_replaces_stale_sockets(tmp_path: Path) -> None:
    """A socket nobody listens on (a daemon killed with SIGKILL) is ours to replace."""
    d = Daemon(tmp_path).start()
    d.kill()
    assert (tmp_path / "sock").is_socket() and (tmp_path / "sock.shm").is_socket()
    d2 = Daemon(tmp_path).start()
    assert d2.status()["active_streams"] == 0
    assert d2.stop() == 0


def status(addr: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHARDSTREAM, "status", "--connect", addr, *args], capture_output=True, text=True, timeout=30)


def test_status_is_a_readiness_probe(tmp_path: Path) -> None:
    addr = f"unix://{tmp_path / 'sock'}"
    r = status(addr)
    assert r.returncode != 0 and "sock" in r.stderr  # nothing there yet
    d = Daemon(tmp_path).start()
    try:
        r = status(addr)
        assert r.returncode == 0, r.stderr
        assert "shardstream" in r.stdout
    finally:
        assert d.stop() == 0
    r = status(addr)
    assert r.returncode != 0 and r.stderr
    (tmp_path / "sock").write_text("not a socket")
    r = status(addr)
    assert r.returncode != 0 and r.stderr


def test_status_timeout_on_a_daemon_that_does_not_answer(tmp_path: Path) -> None:
    d = Daemon(tmp_path).start()
    try:
        d.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        r = status(d.addr, "--timeout", "1")
        assert r.returncode != 0 and "did not answer" in r.stderr
        assert time.monotonic() - t0 < 5
    finally:
        d.proc.send_signal(signal.SIGCONT)
        assert d.stop() == 0


def test_prefetch_gives_up_on_a_daemon_that_stops_answering(dataset, tmp_path: Path) -> None:
    """`prefetch` bounded only its connect, which on a Unix socket succeeds without the daemon
    doing anything: against a stopped (or frozen) daemon it waited for good, holding up the
    SLURM prolog or init container that ran it. A ping left unanswered for --timeout ends it."""
    root, _ = dataset
    d = Daemon(tmp_path).start()
    try:
        d.proc.send_signal(signal.SIGSTOP)
        r = subprocess.run(
            [SHARDSTREAM, "prefetch", "--connect", d.addr, "--timeout", "1", "--cache", "copy", str(root)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1 and "stopped answering" in r.stderr, r.stderr
    finally:
        d.proc.send_signal(signal.SIGCONT)
        assert d.stop() == 0


def test_prefetch_says_a_daemon_killed_under_it_is_gone_not_silent(tmp_path: Path) -> None:
    """A daemon killed (SIGKILL, OOM) during `prefetch` cut the connection at once, and prefetch
    said "stopped answering (no reply to a ping within 20 s; stopped, frozen ...)" 1.5 s later:
    an operator went looking for a frozen daemon."""
    env = UNREACHABLE_STORE
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path, env=env, log=log).start()
    staging = subprocess.Popen(
        [SHARDSTREAM, "prefetch", "--connect", d.addr, "s3://bucket/staged/"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    try:
        assert wait_for(lambda: "bucket/staged/" in log.read_text(), timeout=60)
    except BaseException:
        staging.kill()
        d.kill()
        raise
    d.kill()
    _, err = staging.communicate(timeout=30)
    assert staging.returncode == 1, err
    assert "connection to the daemon" in err and "was lost" in err, err
    assert "ping" not in err, err


@pytest.mark.parametrize("scheme", ["tcp", "tls"])
def test_a_remote_connect_to_a_frozen_daemon_is_a_connection_error_within_the_tcp_timeout(
    dataset, tmp_path: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen daemon's kernel still completes TCP connects from the listen backlog. The
    client's connect timeout bounded the TCP connect alone, so a tls:// trainer (or `status`)
    waited for the TLS handshake for good; the README promises a ConnectionError within twice
    SHARDSTREAM_TCP_TIMEOUT. (tcp:// was bounded by the HTTP/2 pings: kept as the reference.)"""
    if why := tlsutil.available():
        pytest.fail(why)
    root, _ = dataset
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pki = tlsutil.make_pki(tmp_path / "pki")
    security = tlsutil.serve_args(pki) if scheme == "tls" else ["--insecure"]
    for k, v in tlsutil.client_env(pki).items():
        monkeypatch.setenv(k, v)  # the fixture's readiness probe connects as a trainer does
    d = Daemon(tmp_path / "d", addr=f"{scheme}://127.0.0.1:{port}", args=security)
    d.tmp.mkdir()
    try:
        d.start()  # inside: a start that fails still has its process stopped below
        d.proc.send_signal(signal.SIGSTOP)
        code = (
            "import shardstream, sys, time\n"
            "t = time.monotonic()\n"
            "try:\n"
            f"    next(iter(shardstream.Loader({str(root)!r}, batch_size=4, connect={d.addr!r})))\n"
            "except ConnectionError as e:\n"
            "    print(round(time.monotonic() - t, 1), e)\n"
            "    sys.exit(3)\n"
        )
        env = {**os.environ, "SHARDSTREAM_TCP_TIMEOUT": "2"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 3, (r.stdout, r.stderr)
        waited = float(r.stdout.split()[0])
        assert waited < 8, r.stdout
    finally:
        if d.proc is not None:
            d.proc.send_signal(signal.SIGCONT)
            assert d.stop() == 0


EMBEDDED_ON_A_HELD_CACHE = """
import sys, shardstream
url = sys.argv[1]
try:
    shardstream.Loader(url, batch_size=4)
except ValueError as e:
    print("refused:", e, flush=True)
sys.stdin.readline()  # the test stops the daemon that holds the cache
print("then:", sum(len(b["__key__"]) for b in shardstream.Loader(url, batch_size=4)), flush=True)
"""


def trainer(script: str, root: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """`script` run with the dataset `root` as its argument, its standard streams piped (text)."""
    return subprocess.Popen(
        [sys.executable, "-c", script, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_an_embedded_server_on_a_held_cache_says_so_and_a_retry_works(dataset, tmp_path: Path) -> None:
    """Two trainers with one SHARDSTREAM_CACHE_DIR and no node daemon: the second one's embedded
    server was refused the cache after it had bound its socket, so the trainer got a
    ConnectionError (the reason on stderr only), and every retry in that process failed too, even
    after the first trainer had exited."""
    root, samples = dataset
    d = Daemon(tmp_path / "d")
    d.tmp.mkdir()
    d.start()
    env = {k: v for k, v in os.environ.items() if k != "SHARDSTREAM_ADDR"}
    env["SHARDSTREAM_CACHE_DIR"] = str(d.cache_dir)
    proc = trainer(EMBEDDED_ON_A_HELD_CACHE, root, env)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        assert line.startswith("refused:") and "in use by another shardstream daemon" in line, line
    finally:
        assert d.stop() == 0
    out, err = proc.communicate("\n", timeout=120)
    assert proc.returncode == 0 and f"then: {len(samples)}" in out, (out, err)


EMBEDDED_THEN_KILLED = """
import sys, shardstream
next(iter(shardstream.Loader(sys.argv[1], batch_size=4, cache="copy")))
print("streaming", flush=True)
sys.stdin.readline()  # killed here: no atexit runs
"""


def test_the_directory_a_killed_trainers_embedded_server_left_goes_at_the_next_ones_start(
    dataset, tmp_path: Path
) -> None:
    """A trainer without a node daemon runs an embedded server in a private directory of $TMPDIR
    (its socket, and node-cache copies with cache="copy"), removed at exit; a SIGKILLed trainer's
    stayed there for good, one per killed run."""
    root, _ = dataset
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("SHARDSTREAM_ADDR", "SHARDSTREAM_CACHE_DIR")}
    env["TMPDIR"] = str(tmp)
    proc = trainer(EMBEDDED_THEN_KILLED, root, env)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == "streaming\n", proc.stderr
        (left,) = tmp.glob("shardstream-*")
        assert any((left / "cache").rglob("*.tar")), "the embedded server copied no shard"
    finally:
        proc.kill()
        proc.wait()
    assert left.exists(), "nothing removes it at a SIGKILL"
    # Named alike but no embedded server's (no owner file), and one whose owner still runs: kept.
    (tmp / "shardstream-other").mkdir()
    alive = tmp / "shardstream-alive"
    alive.mkdir()
    namespace = os.readlink("/proc/self/ns/pid")
    (alive / "owner").write_text(f"{os.getpid()} {shardstream._process_start(os.getpid())} {namespace}\n")
    # A trainer given the same pid later is not the owner: its start time differs.
    reused = tmp / "shardstream-reused"
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} 1 {namespace}\n")
    # Another container's (another pid namespace, sharing $TMPDIR): its pids are not ours to judge.
    elsewhere = tmp / "shardstream-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "owner").write_text("1 1 pid:[1]\n")
    # An owner file that does not read as one (not a pid): left alone, and no reason to fail
    # the start (the int() of its pid was outside the guard).
    garbled = tmp / "shardstream-garbled"
    garbled.mkdir()
    (garbled / "owner").write_text(f"x 1 {namespace}\n")
    r = subprocess.run(
        [sys.executable, "-c", "import sys, shardstream; shardstream.Loader(sys.argv[1], batch_size=4)", str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # The killed one's and the stale one's went at that start; its own at its exit.
    assert sorted(p.name for p in tmp.iterdir()) == [
        "shardstream-alive",
        "shardstream-elsewhere",
        "shardstream-garbled",
        "shardstream-other",
    ]


def recv(sock: socket.socket, timeout: float = 20.0) -> str:
    sock.settimeout(timeout)
    return sock.recv(4096).decode()


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify_ready_and_stopping(tmp_path: Path, abstract: bool) -> None:
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"shardstream-test-{os.getpid()}-{time.monotonic_ns()}"
        rx.bind("\0" + name)
        target = "@" + name
    else:
        target = str(tmp_path / "notify")
        rx.bind(target)
    with rx:
        d = Daemon(tmp_path / "d", env={"NOTIFY_SOCKET": target})
        d.tmp.mkdir()
        d.start()
        assert recv(rx) == "READY=1"
        # READY means served: status answers at once.
        assert status(d.addr).returncode == 0
        d.proc.send_signal(signal.SIGTERM)
        assert recv(rx) == "STOPPING=1"
        assert d.proc.wait(timeout=30) == 0


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_drain_timeout_bounds_shutdown_with_a_stuck_client(tmp_path: Path, listen: str) -> None:
    """A client that stops reading mid-stream holds its stream open; the daemon still exits 0
    within --drain-timeout, and the client's iteration ends with ConnectionError, never a hang.
    Over TCP, such a client was cut a second after the stop (taken for one stopped with Ctrl-Z),
    though its HTTP/2 layer answered the stop: it lost the batches it would still have read."""
    import shardstream

    root = write_big(tmp_path)
    n = BIG_SAMPLES
    if listen == "tcp":
        d = Daemon(tmp_path / "d", args=["--drain-timeout", "2", "--insecure"], addr=f"tcp://127.0.0.1:{free_port()}")
    else:
        d = Daemon(tmp_path / "d", args=["--drain-timeout", "2"])
    d.tmp.mkdir()
    d.start()
    loader = shardstream.Loader(str(root), batch_size=1, connect=d.addr, transport="inline")
    it = iter(loader)
    next(it)
    time.sleep(1.0)  # the daemon fills the flow-control window and waits for the client
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 0
    took = time.monotonic() - t0
    assert 1.5 < took < 2 + 5, took  # it waited for the stuck client, but not for ever
    got = 1
    with pytest.raises(ConnectionError):
        for _ in it:
            got += 1
    assert got < n


def test_log_json_and_shardstream_only_filter(tmp_path: Path) -> None:
    d = Daemon(tmp_path, args=["--log", "debug", "--log-format", "json"])
    cmd = [
        SHARDSTREAM,
        "serve",
        "--listen",
        d.addr,
        "--cache-dir",
        str(d.cache_dir),
        "--log",
        "debug",
        "--log-format",
        "json",
        "--drain-timeout",
        "1",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        from conftest import wait_for

        assert wait_for(lambda: status(d.addr).returncode == 0, timeout=30)
        for _ in range(3):
            assert status(d.addr).returncode == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert lines, err
    assert any(e.get("message") == "serving" for e in lines), err[:2000]
    targets = {e["target"] for e in lines}
    # debug asked: shardstream's debug lines may appear, but no h2/hyper/tonic debug noise.
    noisy = [e for e in lines if not e["target"].startswith("shardstream") and e["level"] in ("DEBUG", "TRACE")]
    assert not noisy, noisy[:3]
    assert any(t.startswith("shardstream") for t in targets)


@pytest.mark.parametrize("level", ["warning", "verbose"])
def test_a_log_level_that_is_not_one_is_refused_not_taken_as_a_target(tmp_path: Path, level: str) -> None:
    # tracing reads a bare word as a target name: `--log warning` logged nothing at all, warnings
    # included, and the daemon ran on.
    out = serve(tmp_path, tmp_path / "sock", "--log", level)
    assert out.returncode != 0 and level in out.stderr and "warn, info" in out.stderr, out
    config = tmp_path / "d.toml"
    config.write_text(f'log = "{level}"\n')
    out = serve(tmp_path, tmp_path / "sock", "--config", str(config), "--print-config")
    assert out.returncode != 0 and "log" in out.stderr and level in out.stderr, out


def test_ctrl_c_stops_serve_as_sigterm_does(tmp_path: Path) -> None:
    # The console script is Python: its SIGINT handler ran beside the daemon's, so after a clean
    # drain the process died of a KeyboardInterrupt traceback (status -2), not 0.
    d = Daemon(tmp_path, log=tmp_path / "d.log", level="info")
    d.start()
    assert d.proc is not None
    d.proc.send_signal(signal.SIGINT)
    assert d.proc.wait(timeout=30) == 0
    log = (tmp_path / "d.log").read_text()
    assert "stopped" in log and "Traceback" not in log and "KeyboardInterrupt" not in log, log


def test_ctrl_c_stops_a_command_at_once(tmp_path: Path) -> None:
    # Python's SIGINT handler only sets a flag while native code runs: Ctrl-C did nothing to
    # `index` (or a long `pack`) until the command ended by itself, then printed a traceback.
    env = {**os.environ, **UNREACHABLE_STORE}
    proc = subprocess.Popen(
        [SHARDSTREAM, "index", "s3://bucket/x/"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    time.sleep(1.5)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 5, err
    assert proc.returncode != 0 and "KeyboardInterrupt" not in err, (proc.returncode, err)


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_stream_ended_by_a_shutdown_says_so(tmp_path: Path, transport: str) -> None:
    # deploy/README promises "daemon is shutting down"; a shm stream whose build saw the
    # shutdown first ended with "stream cancelled". A client far behind finds its queue full of
    # batches, where the last word did not fit: its stream ended short of its batch count, and
    # the client could only guess ("daemon stopped?"). The word comes after the batches queued.
    said = "daemon is shutting down"
    import numpy as np
    import webdataset as wds

    import shardstream

    root = tmp_path / "ds"
    root.mkdir()
    # 160 MB: more than an inline stream's 64 MiB flow-control window, so it cannot all be sent
    # before the shutdown.
    blob = np.random.default_rng(0).integers(0, 256, 400_000, dtype=np.uint8).tobytes()
    with wds.ShardWriter(str(root / "s-%04d.tar"), maxcount=50, verbose=0) as sink:
        for i in range(400):
            sink.write({"__key__": f"{i:05d}", "bin": blob})
    for attempt in range(3):
        d = Daemon(tmp_path / f"d{attempt}")
        d.tmp.mkdir()
        d.start()
        assert d.proc is not None
        loader = shardstream.Loader(str(root), batch_size=4, connect=d.addr, transport=transport)
        it = iter(loader)
        next(it)
        time.sleep(0.2)
        d.proc.send_signal(signal.SIGTERM)
        with pytest.raises(ConnectionError, match=said):
            for _ in it:
                time.sleep(0.05)
        assert d.proc.wait(timeout=30) == 0


def ten_800k_shards(tmp_path: Path) -> Path:
    """Ten TAR shards of four 200 KiB samples (~800 KiB each), in `tmp_path`/ds."""
    import webdataset as wds

    root = tmp_path / "ds"
    root.mkdir()
    blob = bytes(range(256)) * 800  # 200 KiB
    with wds.ShardWriter(str(root / "s-%04d.tar"), maxcount=4, verbose=0) as sink:
        for i in range(40):
            sink.write({"__key__": f"{i:05d}", "bin": blob})
    return root


def test_a_stream_waiting_for_cache_room_ends_with_the_shutdown(tmp_path: Path) -> None:
    """A stream whose shuffle window does not fit the node cache waits for room (until a minute
    passes in which no pin is let go of). A SIGTERM did not end that wait: the drain ran out after
    `--drain-timeout` and the client saw a broken connection instead of "daemon is shutting down"."""
    import threading

    import shardstream

    root = ten_800k_shards(tmp_path)
    # Ten shards of ~800 KiB; the cache holds one, the stream's window is eight.
    d = Daemon(tmp_path / "d", args=["--cache-size", "1MiB", "--drain-timeout", "60"])
    d.tmp.mkdir()
    d.start()
    assert d.proc is not None
    loader = shardstream.Loader(str(root), batch_size=4, connect=d.addr, cache="copy")
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            for _ in loader:
                pass
        except BaseException as e:  # noqa: BLE001 - whatever ends it is the finding
            errors.append(e)

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    time.sleep(3)
    assert reader.is_alive() and not errors, errors
    asked = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    reader.join(timeout=30)
    assert not reader.is_alive(), "the stream still waits after the shutdown began"
    assert time.monotonic() - asked < 15
    assert len(errors) == 1 and isinstance(errors[0], ConnectionError), errors
    assert "daemon is shutting down" in str(errors[0]), errors[0]
    assert d.proc.wait(timeout=30) == 0


def test_a_stream_waiting_for_cache_room_lets_go_of_its_pins_when_its_client_leaves(tmp_path: Path) -> None:
    """A stream waiting for room in a full node cache holds the shards it has pinned. Its trainer
    killed, the wait went on for a minute (until no pin was let go of for that long) for a client
    that was gone, and another job's stream could not get the room those pins held."""
    import shardstream

    root = ten_800k_shards(tmp_path)
    # Ten shards of ~800 KiB; the cache holds one.
    d = Daemon(tmp_path / "d", args=["--cache-size", "1MiB"])
    d.tmp.mkdir()
    d.start()
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, shardstream\n"
            "next(iter(shardstream.Loader(sys.argv[1], batch_size=16, connect=sys.argv[2], cache='copy')))",
            str(root),
            d.addr,
        ],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        try:
            # Its first batch draws on four shards: it pins the one that fits and waits for room.
            assert wait_for(lambda: d.status()["cache"]["used_bytes"] > 0, timeout=30), "no shard was fetched"
            time.sleep(1)
            assert waiting.poll() is None, "the first trainer was not left waiting for room"
        finally:
            waiting.kill()
            waiting.wait()
        started = time.monotonic()
        it = iter(shardstream.Loader(str(root), batch_size=1, connect=d.addr, cache="copy", shuffle_window=1))
        assert len(next(it)["__key__"]) == 1
        assert time.monotonic() - started < 20, "the gone trainer's stream kept its pin"
        del it
    finally:
        d.stop()


def test_unix_socket_connections_that_never_speak_are_closed_and_hold_no_stop(tmp_path: Path) -> None:
    """The Unix socket's connections were taken as they came: one that never sent the HTTP/2
    preface was held for good (a launcher connecting in a loop used up the daemon's open files for
    every job on the node), and one that answered nothing (a client stopped with Ctrl-Z) held every
    stop for the whole drain timeout. They get what TCP connections get: --tcp-timeout to speak,
    none once the daemon stops, and a second to answer the stop once they have spoken."""
    d = Daemon(tmp_path, args=["--tcp-timeout", "2"]).start()
    assert d.proc is not None
    path = str(tmp_path / "sock")

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        return s

    def closed_within(s: socket.socket, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                if not s.recv(4096):  # the daemon's SETTINGS come first
                    return True
            except ConnectionResetError:
                return True
            except TimeoutError:
                return False
        return False

    silent = connect()
    try:
        assert closed_within(silent, 8), "a connection that never spoke is still open"
    finally:
        silent.close()
    # One says the preface and then nothing, as a client stopped with Ctrl-Z: the stop's GOAWAY and
    # PING are never answered. Another has not spoken yet.
    stopped, quiet = connect(), connect()
    stopped.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
    try:
        time.sleep(0.5)
        started = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - started < 10, "the stop waited for the silent connections"
    finally:
        stopped.close()
        quiet.close()


def test_an_open_and_a_prefetch_under_way_end_with_the_shutdown(tmp_path: Path) -> None:
    """An open that takes long (a store that retries; indexing a dataset without a manifest) and a
    `prefetch` run (a SLURM epilog stops staging with the daemon) did not watch the shutdown: they
    ran on until their connection was cut, then said "no shardstream daemon answered ... is it a
    tls:// listener" and "stopped answering (no reply to a ping within 20 s)"."""
    import threading

    env = UNREACHABLE_STORE
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path, env=env, log=log).start()
    assert d.proc is not None
    said: dict[str, BaseException] = {}

    def open_loader() -> None:
        try:
            shardstream.Loader("s3://bucket/opened/", batch_size=4, connect=d.addr)
        except BaseException as e:  # noqa: BLE001 - whatever ends it is the finding
            said["open"] = e

    opener = threading.Thread(target=open_loader, daemon=True)
    opener.start()
    staging = subprocess.Popen(
        [SHARDSTREAM, "prefetch", "--connect", d.addr, "s3://bucket/staged/"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    # Both under way: the daemon retries the store for each (a warning per retry).
    assert wait_for(lambda: all(f"bucket/{u}/" in log.read_text() for u in ("opened", "staged")), timeout=60)
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    opener.join(timeout=30)
    _, err = staging.communicate(timeout=30)
    assert time.monotonic() - started < 8, "they ran on past the stop"
    assert isinstance(said.get("open"), ConnectionError), said
    assert "daemon is shutting down" in str(said["open"]), said["open"]
    assert staging.returncode == 1 and "is shutting down" in err, err
    assert d.proc.wait(timeout=30) == 0


def test_a_second_signal_exits_at_once_and_removes_the_sockets(tmp_path: Path) -> None:
    """A second signal during the drain exited at once but left the socket and its side channel
    behind: until the next daemon replaced them, they read as a daemon that refuses connections."""
    root = write_big(tmp_path)
    d = Daemon(tmp_path / "d")
    d.tmp.mkdir()
    d.start()
    assert d.proc is not None
    sockets = [tmp_path / "d" / "sock", tmp_path / "d" / "sock.shm"]
    assert all(p.exists() for p in sockets)
    # A reader that stops reading: the drain waits for it (up to --drain-timeout, 20 s).
    it = iter(shardstream.Loader(str(root), batch_size=1, connect=d.addr, transport="inline"))
    next(it)
    time.sleep(0.5)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert d.proc.poll() is None, "draining"
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=10) == 130
    assert time.monotonic() - started < 5
    assert not any(p.exists() for p in sockets), [p for p in sockets if p.exists()]


def test_a_loader_used_after_its_daemon_stopped_says_its_socket_is_gone(dataset, tmp_path: Path) -> None:
    """A loader made before a stop and iterated after it read "lost the connection ...:
    Unavailable: No such file or directory (os error 2)", which names no socket and no stop."""
    root, _ = dataset
    d = Daemon(tmp_path).start()
    loader = shardstream.Loader(str(root), batch_size=4, connect=d.addr)
    assert d.stop() == 0
    with pytest.raises(ConnectionError, match="socket is gone"):
        next(iter(loader))


FROZEN_TRAINER = """
import sys, time, shardstream
it = iter(shardstream.Loader(sys.argv[1], batch_size=1, connect=sys.argv[2], transport="inline"))
next(it)
print("first batch", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_a_trainer_frozen_mid_stream_does_not_hold_the_stop(tmp_path: Path, listen: str) -> None:
    """A trainer stopped with Ctrl-Z mid-stream answers nothing, and the daemon's writes to it
    block once the socket's buffers are full: hyper then reads nothing more, and the stop, which
    only looked at reads, waited out the whole drain timeout (20 s)."""
    root = write_big(tmp_path)
    if listen == "tcp":
        d = Daemon(tmp_path / "d", args=["--insecure"], addr=f"tcp://127.0.0.1:{free_port()}")
    else:
        d = Daemon(tmp_path / "d")
    d.tmp.mkdir()
    d.start()
    assert d.proc is not None
    trainer = subprocess.Popen(
        [sys.executable, "-c", FROZEN_TRAINER, str(root), d.addr], stdout=subprocess.PIPE, text=True
    )
    try:
        assert trainer.stdout is not None and trainer.stdout.readline().strip() == "first batch"
        trainer.send_signal(signal.SIGSTOP)
        time.sleep(1.0)  # the daemon writes on until the socket's buffers are full
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 8, "the stop waited for the frozen trainer"
    finally:
        trainer.send_signal(signal.SIGCONT)
        trainer.kill()
        trainer.wait()


def open_file_limits(pid: int) -> tuple[str, str]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return soft, hard
    raise AssertionError("no open-file limit in /proc/PID/limits")


@pytest.mark.parametrize("hard", [8192, 2048])
def test_serve_raises_its_open_file_limit_to_the_hard_one(tmp_path: Path, hard: int) -> None:
    """A daemon holds a descriptor per shard its streams have open: a soft limit of 1,024 (many
    shells, SLURM jobs, container runtimes) fails streams the hard limit would allow. `serve`
    raises it (and warns when even the hard limit is low, below 4096)."""
    d = Daemon(tmp_path, wrap=["prlimit", f"--nofile=256:{hard}"])
    d.start()
    try:
        assert d.proc is not None
        assert open_file_limits(d.proc.pid) == (str(hard), str(hard))
    finally:
        d.stop()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_trainer_that_leaves_mid_epoch_is_no_warning(dataset, tmp_path: Path, transport: str) -> None:
    """A trainer that stops early (a step budget, a `break` out of the loop) drops its loader
    mid-epoch: its streams end because their client left, which is no failure for the operator's
    log. The daemon serves the next loader as before."""
    root, samples = dataset
    log = tmp_path / "daemon.log"
    d = Daemon(tmp_path, log=log, level="info").start()
    try:
        for _ in range(3):
            loader = shardstream.Loader(str(root), batch_size=16, seed=1, connect=d.addr, transport=transport)
            it = iter(loader)
            for _ in range(2):
                next(it)
            del it, loader
            gc.collect()
        # Its streams gone, the daemon serves a whole epoch.
        keys = [k for b in shardstream.Loader(str(root), batch_size=64, seed=1, connect=d.addr) for k in b["__key__"]]
        assert sorted(keys) == sorted(samples)
        deadline = time.monotonic() + 10
        while d.status()["active_streams"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.status()["active_streams"] == 0
    finally:
        assert d.stop() == 0
    warnings = [line for line in log.read_text().splitlines() if "WARN" in line or "ERROR" in line]
    assert not warnings, "\n".join(warnings)


def test_a_cache_dir_inside_another_daemons_cache_is_refused_and_left_unmade(tmp_path: Path) -> None:
    """`--cache-dir` set to a running daemon's shards directory (or below it) was taken: the two
    locks did not see each other, and the outer daemon counted the inner one's lock as a cached
    shard, evicting it first under pressure."""
    d = Daemon(tmp_path / "outer").start()
    try:
        nested = d.cache_dir / "shards" / "job2"
        cmd = [SHARDSTREAM, "serve", "--listen", f"unix://{tmp_path / 's2'}", "--cache-dir", str(nested)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert r.returncode != 0
        assert f"--cache-dir {nested} is inside the node cache {d.cache_dir}" in r.stderr, r.stderr
        assert not nested.exists() and not (tmp_path / "s2").exists()
    finally:
        d.stop()


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_read_time_counts_no_trainer_that_does_not_read(dataset, tmp_path: Path, transport: str) -> None:
    """`status`'s read time is the daemon's stall for storage: a trainer that sleeps between batches
    (the daemon waiting for its credits, or for room in the stream) is its own pace. It counted
    the sleep: 651 s of "read time" for 5 MB served after a trainer's pauses."""
    root, samples = dataset
    d = Daemon(tmp_path / "d").start()
    try:
        it = iter(shardstream.Loader(str(root), batch_size=4, transport=transport, connect=d.addr))
        n = len(next(it)["__key__"])
        time.sleep(2.0)
        n += sum(len(b["__key__"]) for b in it)
        assert n == len(samples)
        out = json.loads(status(d.addr, "--json").stdout)
        assert out["samples_served"] == len(samples)
        assert out["read_wait_ms"] < 500, out["read_wait_ms"]
    finally:
        assert d.stop() == 0
