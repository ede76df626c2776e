"""Two "hosts" on one machine: two network namespaces joined by a veth pair.

The daemon runs in one namespace and the trainer in the other, each with its own address on its
own interface, so traffic between them crosses a real (virtual) link and never the host's loopback:
what a test calls "remote" really is another interface. The test creates the pair itself and
removes it afterwards, also when the test fails (and a later run removes pairs left by a run that
was killed).

Use from a test module (pytest finds fixtures imported into the module):

    from netns import Hosts, two_hosts_fixture  # noqa: F401  (registers the `two_hosts` fixture)

    def test_remote(two_hosts: Hosts, tmp_path):
        daemon = two_hosts.popen_daemon([SHARDSTREAM, "serve", "--listen",
                                         f"tcp://{two_hosts.daemon_ip}:7000", ...])
        assert two_hosts.wait_port(two_hosts.daemon_ip, 7000)
        trainer = two_hosts.popen_trainer([sys.executable, "train.py", ...])

Fixtures:
- `netns_pair`: a `NetnsPair`; skips (naming why) where namespaces cannot be made: not root, no
  `ip` command (scripts/netns-tools.sh installs iproute2), or the kernel refuses.
- `two_hosts`: parametrized `netns` / `loopback`. The `netns` variant is a `NetnsPair` and skips
  like `netns_pair`; the `loopback` variant always runs, both "hosts" being 127.0.0.1 in the test's
  own namespace. A test written against `Hosts` runs unchanged on both.

Namespaces share the file system, so local datasets and Unix sockets (by path) are visible from
both; they do not share network services: a server on the host's 127.0.0.1 (the S3 fixture) is not
reachable from inside either namespace. Processes in a namespace cannot be reached from the test
process over TCP either: probe them with `wait_port` (which probes from the trainer side) or give
the daemon a Unix socket too.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

# Namespace names carry the creating pid, so a later run can tell a pair left behind by a killed
# run (pid gone) from one in use by a parallel run.
PREFIX = "ssnet-"
# The link's subnet. Each pair is isolated in its own namespaces, so pairs may reuse it.
DAEMON_IP = "10.231.0.1"
TRAINER_IP = "10.231.0.2"
PREFIX_LEN = 24
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be created here, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2): install it with scripts/netns-tools.sh"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (running as uid {os.geteuid()})"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


def _remove_stale() -> None:
    """Deletes pairs whose creating process no longer runs (a run killed before its cleanup)."""
    listed = _ip("netns", "list", check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)


class Hosts:
    """Where the daemon and the trainer run: their addresses, and how to start a process on each
    side. The base class is the loopback variant (both in the test's own namespace)."""

    kind = "loopback"

    def __init__(self) -> None:
        self.daemon_ip = "127.0.0.1"
        self.trainer_ip = "127.0.0.1"

    def daemon_wrap(self) -> list[str]:
        """Prefix for a command line that must run on the daemon's side (`conftest.Daemon(wrap=)`)."""
        return []

    def trainer_wrap(self) -> list[str]:
        """Prefix for a command line that must run on the trainer's side."""
        return []

    def popen_daemon(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen([*self.daemon_wrap(), *cmd], **kwargs)

    def popen_trainer(self, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen([*self.trainer_wrap(), *cmd], **kwargs)

    def run_trainer(self, cmd: Sequence[str], timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Runs `cmd` to completion on the trainer's side (output captured as text)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.trainer_wrap(), *cmd], timeout=timeout, **kwargs)

    def wait_port(self, host: str, port: int, timeout: float = 30.0) -> bool:
        """True once a TCP connection from the trainer's side to host:port succeeds."""
        code = (
            "import socket,sys,time\n"
            f"d=time.monotonic()+{timeout}\n"
            "while time.monotonic()<d:\n"
            "    try:\n"
            f"        socket.create_connection(({host!r},{port}),timeout=1).close(); sys.exit(0)\n"
            "    except OSError: time.sleep(0.05)\n"
            "sys.exit(1)\n"
        )
        return self.run_trainer([sys.executable, "-c", code], timeout=timeout + 30).returncode == 0

    def close(self) -> None:
        pass

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}: daemon {self.daemon_ip}, trainer {self.trainer_ip})"


class NetnsPair(Hosts):
    """Two fresh network namespaces (`daemon_ns`, `trainer_ns`) joined by a veth pair: the daemon's
    end has DAEMON_IP, the trainer's end TRAINER_IP; each namespace's loopback is up and nothing
    else is configured (no default route, no way to the host's network)."""

    kind = "netns"

    def __init__(self) -> None:
        super().__init__()
        _remove_stale()
        n = next(_counter)
        self.daemon_ns = f"{PREFIX}{os.getpid()}-{n}-d"
        self.trainer_ns = f"{PREFIX}{os.getpid()}-{n}-t"
        self.daemon_ip = DAEMON_IP
        self.trainer_ip = TRAINER_IP
        self._made: list[str] = []
        try:
            for ns in (self.daemon_ns, self.trainer_ns):
                _ip("netns", "add", ns)
                self._made.append(ns)
            # Made inside the daemon's namespace with its peer placed straight into the trainer's,
            # so the link's names never exist in (or collide in) the host's namespace.
            _ip("-n", self.daemon_ns, "link", "add", "veth-d", "type", "veth", "peer", "name", "veth-t",
                "netns", self.trainer_ns)  # fmt: skip
            for ns, dev, addr in ((self.daemon_ns, "veth-d", DAEMON_IP), (self.trainer_ns, "veth-t", TRAINER_IP)):
                _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            self._wait_running()
        except BaseException:
            self.close()
            raise

    def _wait_running(self, timeout: float = 10.0) -> None:
        """Waits until both ends of the link report operstate UP. The kernel sets it (and
        IFF_RUNNING) up to a second after the carrier, while packets already flow; libfabric's
        tcp provider lists only running interfaces, so a trainer started in that second offered
        the daemon its loopback address (the first rdma stream of a fresh pair stalled)."""
        deadline = time.monotonic() + timeout
        ends = ((self.daemon_ns, "veth-d"), (self.trainer_ns, "veth-t"))
        while True:
            states = [_ip("-n", ns, "-o", "link", "show", "dev", dev).stdout for ns, dev in ends]
            if all(" state UP " in st for st in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the veth pair did not come up within {timeout:.0f} s: {states}")
            time.sleep(0.05)

    def daemon_wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.daemon_ns]

    def trainer_wrap(self) -> list[str]:
        return ["ip", "netns", "exec", self.trainer_ns]

    def close(self) -> None:
        """Deletes both namespaces (which deletes the veth pair). Processes still running inside
        keep their namespace alive until they exit; the caller stops its processes first."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)

    def exists(self) -> bool:
        listed = _ip("netns", "list", check=False).stdout.split()
        return self.daemon_ns in listed or self.trainer_ns in listed


@pytest.fixture(name="netns_pair")
def netns_pair_fixture() -> Iterator[NetnsPair]:
    """A fresh `NetnsPair`, removed after the test; skips (naming why) where none can be made."""
    why = unavailable()
    if why:
        pytest.skip(f"no network namespaces: {why}")
    with NetnsPair() as pair:
        yield pair


@pytest.fixture(name="two_hosts", params=["netns", "loopback"])
def two_hosts_fixture(request: pytest.FixtureRequest) -> Iterator[Hosts]:
    """The daemon's and the trainer's hosts: a `NetnsPair` (skipped, naming why, where namespaces
    cannot be made) or both on loopback."""
    if request.param == "loopback":
        yield Hosts()
        return
    why = unavailable()
    if why:
        pytest.skip(f"no network namespaces (the loopback variant runs instead): {why}")
    with NetnsPair() as pair:
        yield pair
