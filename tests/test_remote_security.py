"""The remote (TCP) endpoint: TLS, bearer tokens, `--insecure` only on loopback, the `allow` list
for remote clients, brace patterns that try to leave their directory, and per-RPC request bounds.

The daemon and the trainer run on two "hosts" (tests/netns.py): two network namespaces joined by
a veth pair, so the trainer reaches the daemon over another interface, and, as a second variant
that always runs, both on loopback. Certificates are made by the test with the openssl command
(never committed). Every refusal is checked for its exception type and for the secret it must
not show: neither the exception text nor the daemon's log may contain a token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tlsutil
from netns import Hosts, two_hosts_fixture  # noqa: F401  (registers the `two_hosts` fixture)
from test_disconnect import big_tars
from tlsutil import TOKEN_A, TOKEN_B, WRONG

import shardstream
from conftest import SHARDSTREAM, Daemon, hold_streams, wait_for, write_dataset

pytestmark = pytest.mark.skipif(tlsutil.available() is not None, reason=str(tlsutil.available()))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tlsutil.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("remote-data")
    samples = write_dataset(root / "a", n=120, per_shard=40, seed=3)
    write_dataset(root / "b", n=40, per_shard=40, seed=4)
    return root / "a", root / "b", samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Remote:
    """`shardstream serve` on a TCP address of the daemon's host, its log in a file."""

    def __init__(self, hosts: Hosts, tmp: Path, args: list[str], ip: str | None = None, scheme: str = "tls") -> None:
        self.hosts = hosts
        self.port = free_port()
        self.ip = ip or hosts.daemon_ip
        self.addr = f"{scheme}://{self.ip}:{self.port}"
        self.log = tmp / f"daemon-{self.port}.log"
        cmd = [SHARDSTREAM, "serve", "--listen", f"tcp://{self.ip}:{self.port}", "--cache-dir", str(tmp / "cache"),
               "--log", "info", *args]  # fmt: skip
        with open(self.log, "wb") as log:
            self.proc = hosts.popen_daemon(cmd, stdout=log, stderr=subprocess.STDOUT)

    def wait(self) -> Remote:
        if not self.hosts.wait_port(self.ip, self.port, timeout=30):
            self.stop()
            raise AssertionError(f"daemon did not listen: {self.log.read_text()}")
        return self

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.log.read_text()


# Runs on the trainer's host: opens and streams a dataset, prints what happened as JSON.
TRAINER = textwrap.dedent(
    """
    import json, sys, shardstream
    url, addr = sys.argv[1], sys.argv[2]
    try:
        # rank/world_size given: the default would import torch.distributed (seconds per trainer).
        loader = shardstream.Loader(url, batch_size=16, connect=addr, rank=0, world_size=1)
        keys = [k for b in loader for k in b["__key__"]]
        print(json.dumps({"ok": True, "keys": keys}))
    except Exception as e:
        print(json.dumps({"ok": False, "type": type(e).__name__, "msg": str(e)}))
    """
)


def trainer(hosts: Hosts, url: str, addr: str, **env: str | None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_TLS") and k != "SHARDSTREAM_TOKEN_FILE"}
    e.update({k: v for k, v in env.items() if v is not None})
    r = hosts.run_trainer([sys.executable, "-c", TRAINER, url, addr], env=e, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), f"trainer failed: {r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def creds(pki: Path, token: str | None = "a", ca: str = "ca") -> dict[str, str | None]:
    return {"SHARDSTREAM_TOKEN_FILE": None, **tlsutil.client_env(pki, token, ca)}


def tls_args(pki: Path) -> list[str]:
    return tlsutil.serve_args(pki)


@pytest.fixture
def tls_daemon(two_hosts: Hosts, tmp_path: Path, pki: Path) -> Iterator[Remote]:
    d = Remote(two_hosts, tmp_path, tls_args(pki)).wait()
    yield d
    log = d.stop()
    for secret in (TOKEN_A, TOKEN_B, WRONG):
        assert secret not in log, "a token appeared in the daemon's log"


def test_tls_with_a_token_streams_every_sample_once(two_hosts: Hosts, tls_daemon: Remote, pki: Path, datasets) -> None:
    a, _, samples = datasets
    got = trainer(two_hosts, str(a), tls_daemon.addr, **creds(pki))
    assert got["ok"], got
    assert sorted(got["keys"]) == sorted(samples), "every sample exactly once over TLS"
    # The daemon saw the trainer's own address (another interface in the netns variant).
    assert tls_daemon.addr.startswith(f"tls://{two_hosts.daemon_ip}:")


def test_a_wrong_ca_is_refused(two_hosts: Hosts, tls_daemon: Remote, pki: Path, datasets) -> None:
    a, _, _ = datasets
    got = trainer(two_hosts, str(a), tls_daemon.addr, **creds(pki, ca="other-ca"))
    assert not got["ok"] and got["type"] == "ConnectionError", got
    assert "certificate" in got["msg"].lower() or "issuer" in got["msg"].lower(), got


@pytest.mark.parametrize("token", ["wrong", None])
def test_a_wrong_or_missing_token_is_refused(
    two_hosts: Hosts, tls_daemon: Remote, pki: Path, datasets, token: str | None
) -> None:
    a, _, _ = datasets
    got = trainer(two_hosts, str(a), tls_daemon.addr, **creds(pki, token=token))
    assert not got["ok"] and got["type"] == "PermissionError", got
    assert "bearer token" in got["msg"], got
    for secret in (TOKEN_A, TOKEN_B, WRONG):
        assert secret not in got["msg"]
    assert "request refused" in tls_daemon.log.read_text(), "the refusal is logged (without the token)"


def test_plaintext_tcp_to_a_tls_daemon_fails(two_hosts: Hosts, tls_daemon: Remote, pki: Path, datasets) -> None:
    a, _, _ = datasets
    plain = tls_daemon.addr.replace("tls://", "tcp://")
    got = trainer(two_hosts, str(a), plain, **creds(pki, token=None))
    assert not got["ok"] and got["type"] == "ConnectionError", got
    # It said "lost the connection to the shardstream daemon: Unknown: transport error".
    assert plain in got["msg"] and "tls://" in got["msg"], got


def _serve_refused(args: list[str], want: str) -> None:
    r = subprocess.run([SHARDSTREAM, "serve", "--cache-dir", "/tmp/shardstream-never", *args],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and want in r.stderr, r.stderr


def test_plaintext_is_refused_without_insecure(pki: Path) -> None:
    _serve_refused(["--listen", f"tcp://127.0.0.1:{free_port()}"], "refusing plaintext TCP")
    # TLS alone does not say who may connect.
    _serve_refused(
        ["--listen", f"tcp://127.0.0.1:{free_port()}", "--tls-cert", str(pki / "daemon.pem"),
         "--tls-key", str(pki / "daemon.key")], "--tokens",
    )  # fmt: skip


def test_insecure_on_a_non_loopback_address_is_refused(two_hosts: Hosts, tmp_path: Path) -> None:
    for ip in {"0.0.0.0", two_hosts.daemon_ip} - {"127.0.0.1"}:
        d = Remote(two_hosts, tmp_path, ["--insecure"], ip=ip, scheme="tcp")
        assert d.proc.wait(timeout=30) != 0
        log = d.stop()
        assert "only on a loopback address" in log, log


def test_insecure_on_loopback_serves_plaintext(tmp_path: Path, datasets) -> None:
    a, _, samples = datasets
    d = Remote(Hosts(), tmp_path, ["--insecure"], ip="127.0.0.1", scheme="tcp").wait()
    try:
        keys = [k for b in shardstream.Loader(str(a), batch_size=32, connect=d.addr) for k in b["__key__"]]
        assert sorted(keys) == sorted(samples)
    finally:
        d.stop()


def test_bad_certificate_files_are_named_at_start(tmp_path: Path, pki: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    _serve_refused(
        ["--listen", f"tcp://127.0.0.1:{free_port()}", "--tls-cert", str(bad), "--tls-key", str(pki / "daemon.key"),
         "--tokens", str(pki / "tokens")], "bad TLS certificate or key",
    )  # fmt: skip
    _serve_refused(
        ["--listen", f"tcp://127.0.0.1:{free_port()}", "--insecure", "--tokens", str(tmp_path / "missing")],
        "missing",
    )


def test_a_token_past_its_streams_is_refused_and_another_token_is_served(
    tmp_path: Path, pki: Path, datasets, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-streams-per-client over TCP: a client is its token's name, so one team's trainer at
    its bound is refused by name while another token's trainer is served."""
    a, _, samples = datasets
    # A stream counts while the daemon produces it. Over TCP the client's receive window (64 MiB a
    # stream) takes a small epoch whole, so the daemon ends such a stream before its trainer reads a
    # batch: the held stream must be larger than what its client takes without reading.
    held_url = big_tars(tmp_path / "large")
    d = Remote(Hosts(), tmp_path, [*tls_args(pki), "--max-streams-per-client", "1"], ip="127.0.0.1").wait()
    try:
        for var, value in creds(pki, token="a").items():
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        opts = {"connect": d.addr, "rank": 0, "world_size": 1}
        (held,) = hold_streams(str(held_url), 1, **opts)
        time.sleep(1.0)  # time for the daemon to send all it can, as a trainer busy elsewhere gives it
        refused = r'at most 1 streams at once \(--max-streams-per-client\), and client "trainer-a" holds as many'
        with pytest.raises(shardstream.ShardstreamError, match=refused):
            hold_streams(str(a), 1, **opts)
        got = trainer(Hosts(), str(a), d.addr, **creds(pki, token="b"))
        assert got["ok"] and sorted(got["keys"]) == sorted(samples), got
        held.close()  # type: ignore[attr-defined]
    finally:
        log = d.stop()
    assert TOKEN_A not in log and TOKEN_B not in log


def test_allow_list_applies_to_remote_clients(two_hosts: Hosts, tmp_path: Path, pki: Path, datasets) -> None:
    a, b, samples = datasets
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[[allow]]\nclient = "trainer-a"\nroots = ["{a}"]\n\n[[allow]]\nclient = "trainer-b"\nroots = ["{b}"]\n'
    )
    d = Remote(two_hosts, tmp_path, [*tls_args(pki), "--config", str(config)]).wait()
    try:
        ok = trainer(two_hosts, str(a), d.addr, **creds(pki, token="a"))
        assert ok["ok"] and sorted(ok["keys"]) == sorted(samples), ok
        assert trainer(two_hosts, str(b), d.addr, **creds(pki, token="b"))["ok"]
        for url, token in [
            (str(b), "a"),  # another client's dataset
            (str(a), "b"),
            (f"{a}/../b", "a"),  # `..` out of the root
            (f"{a}/{{train-000000.tar,../b/train-000000.tar}}", "a"),  # cannot even name another directory
            (f"{a}/{{..,train-000000.tar}}", "a"),  # a pattern expanding to `..`
            (f"{a}/{{.}}{{.}}", "a"),
        ]:
            got = trainer(two_hosts, url, d.addr, **creds(pki, token=token))
            assert not got["ok"] and got["type"] == "PermissionError", (url, got)
            assert TOKEN_A not in got["msg"] and TOKEN_B not in got["msg"]
    finally:
        log = d.stop()
    assert "dataset refused by the allow list" in log and TOKEN_A not in log and TOKEN_B not in log


FLOOD = textwrap.dedent(
    """
    import sys, shardstream._native as n
    url, addr, times = sys.argv[1], sys.argv[2], int(sys.argv[3])
    refused = 0
    for _ in range(times):
        try:
            n.Connection(addr).open(url)
        except (PermissionError, ValueError):
            refused += 1
    print(refused)
    """
)


def test_refused_requests_do_not_flood_the_daemons_log(tmp_path: Path, pki: Path, datasets) -> None:
    """A warning line for each request refused by the allow list or for a missing token let one
    client grow the daemon's log as fast as it could send (68 MB/s with 16 KB URLs in a trial):
    one line per kind every 10 s now, saying how many were left out, and a URL cut to 256
    characters."""
    a, b, _ = datasets
    config = tmp_path / "serve.toml"
    config.write_text(f'[[allow]]\nclient = "trainer-a"\nroots = ["{a}"]\n')
    d = Remote(Hosts(), tmp_path, [*tls_args(pki), "--config", str(config)], ip="127.0.0.1").wait()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    long_url = f"{b}/{'x' * 16_000}.tar"
    try:
        for url, token in [(long_url, "a"), (str(b), None)]:
            e = {**env, **{k: v for k, v in creds(pki, token=token).items() if v is not None}}
            r = subprocess.run(
                [sys.executable, "-c", FLOOD, url, d.addr, "200"], env=e, capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 0 and r.stdout.strip() == "200", (r.stdout, r.stderr)
    finally:
        log = d.stop()
    refusals = [line for line in log.splitlines() if "refused by the allow list" in line]
    tokens = [line for line in log.splitlines() if "missing or wrong bearer token" in line]
    assert 1 <= len(refusals) <= 2 and 1 <= len(tokens) <= 2, (len(refusals), len(tokens))
    assert max(len(line) for line in refusals) < 1000, refusals[0][:300]


def test_brace_patterns_cannot_leave_the_dataset_without_an_allow_list(tmp_path: Path, datasets) -> None:
    a, _, _ = datasets
    d = Remote(Hosts(), tmp_path, ["--insecure"], ip="127.0.0.1", scheme="tcp").wait()
    try:
        conn = shardstream._native.Connection(d.addr)
        for url in [f"{a}/{{.,x}}.", f"{a}/{{.}}.", f"{a}/{{..,x}}", f"{a}/t-{{0..9999999}}-{'x' * 2000}"]:
            with pytest.raises(ValueError, match="not a shard file name|bad range|bytes of names"):
                conn.open(url)
    finally:
        d.stop()


def test_oversized_requests_are_refused(tmp_path: Path, datasets) -> None:
    a, _, samples = datasets
    d = Remote(Hosts(), tmp_path, ["--insecure"], ip="127.0.0.1", scheme="tcp").wait()
    try:
        conn = shardstream._native.Connection(d.addr)
        # Beyond OpenDataset's own bound (16 KiB), and beyond every RPC's (the decoding limit).
        for size in (20 << 10, 1 << 20):
            with pytest.raises(ValueError, match="larger than|too large"):
                conn.open(f"{a}/{'x' * size}")
        # The daemon is unharmed.
        keys = [k for b in shardstream.Loader(str(a), batch_size=32, connect=d.addr) for k in b["__key__"]]
        assert sorted(keys) == sorted(samples)
    finally:
        d.stop()


def test_mutual_tls_without_tokens(two_hosts: Hosts, tmp_path: Path, pki: Path, datasets) -> None:
    """Client certificates instead of tokens: a client is known by its certificate's subject CN
    (`trainer`), which the allow list matches; without a certificate the handshake fails."""
    a, b, samples = datasets
    config = tmp_path / "serve.toml"
    config.write_text(f'[[allow]]\nclient = "trainer"\nroots = ["{a}"]\n')
    args = ["--tls-cert", str(pki / "daemon.pem"), "--tls-key", str(pki / "daemon.key"),
            "--tls-client-ca", str(pki / "ca.pem"), "--config", str(config)]  # fmt: skip
    d = Remote(two_hosts, tmp_path, args).wait()
    try:
        with_cert = {
            **creds(pki, token=None),
            "SHARDSTREAM_TLS_CLIENT_CERT": str(pki / "trainer.pem"),
            "SHARDSTREAM_TLS_CLIENT_KEY": str(pki / "trainer.key"),
        }
        got = trainer(two_hosts, str(a), d.addr, **with_cert)
        assert got["ok"] and sorted(got["keys"]) == sorted(samples), got
        other = trainer(two_hosts, str(b), d.addr, **with_cert)
        assert not other["ok"] and other["type"] == "PermissionError", other
        assert 'remote client "trainer"' in other["msg"], "known by its certificate's CN"
        refused = trainer(two_hosts, str(a), d.addr, **creds(pki, token=None))
        assert not refused["ok"] and refused["type"] in ("ConnectionError", "PermissionError"), refused
    finally:
        d.stop()


# `--tcp-timeout` of the idle-connection tests: short, so they take seconds.
IDLE_TIMEOUT = 2


def _closed_after(sock: socket.socket, limit: float) -> float | None:
    """Seconds until the daemon closes `sock` (end of stream or a reset), reading and dropping
    whatever it sends first (a plaintext HTTP/2 server sends its SETTINGS unasked); None if the
    socket is still open after `limit` seconds."""
    started = time.monotonic()
    while (left := started + limit - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(4096):
                break
        except ConnectionResetError:
            break
        except TimeoutError:
            return None
    else:
        return None
    return time.monotonic() - started


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "insecure"])
def test_a_connection_that_never_speaks_is_closed(tmp_path: Path, pki: Path, datasets, tls: bool) -> None:
    """A TCP connection that never starts TLS (or, in plaintext, never sends the HTTP/2 preface)
    was kept open for good: 400 of them from a client with no credentials exhausted the daemon's
    open-file limit. Now it gets --tcp-timeout from its accept, and real clients are served
    meanwhile."""
    a, _, samples = datasets
    security = tls_args(pki) if tls else ["--insecure"]
    args = [*security, "--tcp-timeout", str(IDLE_TIMEOUT)]
    d = Remote(Hosts(), tmp_path, args, ip="127.0.0.1", scheme="tls" if tls else "tcp").wait()
    idle: list[socket.socket] = []
    try:
        # Serving, not only bound: a connection's deadline starts when the daemon accepts it.
        assert wait_for(lambda: "serving" in d.log.read_text(), timeout=30), d.log.read_text()
        idle = [socket.create_connection(("127.0.0.1", d.port)) for _ in range(8)]
        with ThreadPoolExecutor(len(idle)) as pool:
            closing = [pool.submit(_closed_after, s, 4 * IDLE_TIMEOUT) for s in idle]
            got = trainer(Hosts(), str(a), d.addr, **(creds(pki) if tls else {}))
            took = [c.result() for c in closing]
        assert got["ok"] and sorted(got["keys"]) == sorted(samples), got
        assert all(t is not None and IDLE_TIMEOUT / 2 <= t <= 2 * IDLE_TIMEOUT for t in took), took
    finally:
        for s in idle:
            s.close()
        log = d.stop()
    assert any("WARN" in line and "127.0.0.1:" in line for line in log.splitlines()), log


def test_a_refused_client_certificate_is_logged(tmp_path: Path, pki: Path, datasets, monkeypatch) -> None:
    """A mutual-TLS daemon refusing a client without a certificate logged nothing at its default
    level (tonic logs handshake failures at debug): neither side named the certificate problem."""
    a, _, _ = datasets
    # The test's own connections (the fixture's start-up probe) present the trainer certificate.
    monkeypatch.delenv("SHARDSTREAM_TOKEN_FILE", raising=False)
    monkeypatch.setenv("SHARDSTREAM_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("SHARDSTREAM_TLS_CLIENT_CERT", str(pki / "trainer.pem"))
    monkeypatch.setenv("SHARDSTREAM_TLS_CLIENT_KEY", str(pki / "trainer.key"))
    log = tmp_path / "daemon.log"
    args = ["--tls-cert", str(pki / "daemon.pem"), "--tls-key", str(pki / "daemon.key"),
            "--tls-client-ca", str(pki / "ca.pem")]  # fmt: skip
    d = Daemon(tmp_path, args=args, addr=f"tls://127.0.0.1:{free_port()}", log=log).start()
    try:
        refused = trainer(Hosts(), str(a), d.addr, **creds(pki, token=None))
        assert not refused["ok"] and refused["type"] in ("ConnectionError", "PermissionError"), refused
        # The trainer's side names it too (it read "is it a tls:// listener, another service...").
        assert "client certificate" in refused["msg"] and "SHARDSTREAM_TLS_CLIENT_CERT" in refused["msg"], refused
    finally:
        d.stop()
    # e.g. "WARN ... TLS handshake failed: connection closed peer=127.0.0.1:PORT error=peer sent no certificates"
    text = log.read_text()
    words = ("WARN", "TLS handshake", "127.0.0.1:", "certificate")
    assert any(all(w in line for w in words) for line in text.splitlines()), text


@pytest.mark.parametrize("case", ["cert without PEM", "key without a key", "key of another certificate"])
def test_a_client_certificate_or_key_that_cannot_serve_is_a_value_error_naming_it(
    tmp_path: Path, pki: Path, datasets, monkeypatch, case: str
) -> None:
    """A client certificate file holding no certificate was skipped: the client connected without
    one and heard "peer sent no certificates", as if the daemon had sent none; a key file holding
    no key, or the key of another certificate, failed every handshake. All three were a
    ConnectionError naming no setting, which a loop retrying ConnectionError retries for good."""
    a, _, _ = datasets
    not_pem = tmp_path / "not-pem"
    not_pem.write_text("a token, not a certificate\n")
    cert, key = {
        "cert without PEM": (not_pem, pki / "trainer.key"),
        "key without a key": (pki / "trainer.pem", pki / "ca.pem"),
        "key of another certificate": (pki / "trainer.pem", pki / "daemon.key"),
    }[case]
    log = tmp_path / "daemon.log"
    args = ["--tls-cert", str(pki / "daemon.pem"), "--tls-key", str(pki / "daemon.key"),
            "--tls-client-ca", str(pki / "ca.pem")]  # fmt: skip
    monkeypatch.delenv("SHARDSTREAM_TOKEN_FILE", raising=False)
    monkeypatch.setenv("SHARDSTREAM_TLS_CA", str(pki / "ca.pem"))
    monkeypatch.setenv("SHARDSTREAM_TLS_CLIENT_CERT", str(pki / "trainer.pem"))
    monkeypatch.setenv("SHARDSTREAM_TLS_CLIENT_KEY", str(pki / "trainer.key"))
    d = Daemon(tmp_path, args=args, addr=f"tls://127.0.0.1:{free_port()}", log=log).start()
    try:
        monkeypatch.setenv("SHARDSTREAM_TLS_CLIENT_CERT", str(cert))
        monkeypatch.setenv("SHARDSTREAM_TLS_CLIENT_KEY", str(key))
        with pytest.raises(ValueError) as e:
            list(shardstream.Loader(str(a), batch_size=32, connect=d.addr))
        setting = "SHARDSTREAM_TLS_CLIENT_CERT" if case == "cert without PEM" else "SHARDSTREAM_TLS_CLIENT_KEY"
        assert setting in str(e.value) and str(key if "key" in case else cert) in str(e.value), e.value
    finally:
        d.stop()


def test_status_names_this_sides_mistakes_not_the_daemon(tmp_path: Path, pki: Path) -> None:
    """`shardstream status`, the probe people debug a connection with, said "daemon at ... is not
    serving" for a tls:// address without SHARDSTREAM_TLS_CA (the daemon was serving; the setting
    was missing) and retried it for all of --wait, and a bare "transport error" for plaintext
    spoken to the TLS port, which the Python client explains."""
    d = Remote(Hosts(), tmp_path, tls_args(pki), ip="127.0.0.1").wait()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    env.update({k: v for k, v in creds(pki).items() if v is not None})
    try:
        ok = subprocess.run([SHARDSTREAM, "status", "--connect", d.addr], env=env, capture_output=True, text=True)
        assert ok.returncode == 0, ok.stderr
        no_ca = {k: v for k, v in env.items() if k != "SHARDSTREAM_TLS_CA"}
        started = time.monotonic()
        r = subprocess.run(
            [SHARDSTREAM, "status", "--connect", d.addr, "--wait", "30"], env=no_ca, capture_output=True, text=True
        )
        assert r.returncode == 1 and "SHARDSTREAM_TLS_CA" in r.stderr and "not serving" not in r.stderr, r.stderr
        assert time.monotonic() - started < 10, "a missing setting is not waited out"
        plain = d.addr.replace("tls://", "tcp://")
        r = subprocess.run([SHARDSTREAM, "status", "--connect", plain], env=no_ca, capture_output=True, text=True)
        assert r.returncode == 1 and "is it a tls:// listener" in r.stderr, r.stderr
        # `prefetch` answered the same mistakes with tonic's bare "transport error".
        for addr, said in [(plain, "is it a tls:// listener"), (d.addr, "SHARDSTREAM_TLS_CA")]:
            cmd = [SHARDSTREAM, "prefetch", str(tmp_path), "--connect", addr]
            r = subprocess.run(cmd, env=no_ca, capture_output=True, text=True, timeout=60)
            assert r.returncode != 0 and said in r.stderr, (addr, r.stderr)
    finally:
        d.stop()


# One rank on the trainer's host: a torch DataLoader with 2 workers, each worker its own TLS
# connection (made after fork, with the credentials the environment hands down).
RANK = textwrap.dedent(
    """
    import json, sys, torch.utils.data, shardstream.torch as sst
    url, addr, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds = sst.IterableDataset(url, batch_size=8, seed=5, rank=rank, world_size=2, connect=addr)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    print(json.dumps([k for b in dl for k in b["__key__"]]))
    """
)


def test_two_ranks_of_two_workers_get_every_sample_once_over_tls(
    two_hosts: Hosts, tls_daemon: Remote, pki: Path, datasets
) -> None:
    a, _, samples = datasets
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    env.update(tlsutil.client_env(pki))
    ranks = [
        two_hosts.popen_trainer(
            [sys.executable, "-c", RANK, str(a), tls_daemon.addr, str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    keys: list[str] = []
    for p in ranks:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err
        keys += json.loads(out.strip().splitlines()[-1])
    assert sorted(keys) == sorted(samples), "120 samples, 2 ranks: each exactly once, none padded"


def test_connections_that_never_sent_a_request_do_not_hold_a_stop(tmp_path: Path) -> None:
    """hyper's graceful shutdown waits for a connection that has not sent its HTTP/2 preface, or
    has and then answers nothing: one port scan or silent client held every stop (a rolling
    update, a restart) for the whole drain timeout. They are closed as the stop begins (a second
    later once they spoke)."""
    d = Daemon(tmp_path, args=["--insecure", "--tcp-timeout", "60"], addr=f"tcp://127.0.0.1:{free_port()}").start()
    port = int(d.addr.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    # Half say the HTTP/2 preface and then nothing (as a client stopped with Ctrl-Z does): the
    # stop's GOAWAY is never answered.
    for s in idle[:3]:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
    try:
        time.sleep(0.5)  # accepted
        started = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - started < 10, "the stop waited for the silent connections"
    finally:
        for s in idle:
            s.close()
