"""The two-host harness itself (tests/netns.py): the namespaces exist while the test runs, traffic
between them crosses the veth pair with each side's own address, the host's loopback is not
reachable from inside, and everything is removed afterwards, also when the body fails."""

from __future__ import annotations

import subprocess
import sys

import pytest
from netns import Hosts, NetnsPair, two_hosts_fixture, unavailable  # noqa: F401  (registers `two_hosts`)

# A one-connection TCP server that answers with the peer address it saw.
ECHO_PEER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)\n"
    "c,a=s.accept(); c.sendall(a[0].encode()); c.close()\n"
)
FETCH = (
    "import socket,sys\n"
    "c=socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)\n"
    "print(c.recv(100).decode())\n"
)


def test_traffic_crosses_the_link_with_each_sides_address(two_hosts: Hosts) -> None:
    port = 17321
    server = two_hosts.popen_daemon([sys.executable, "-c", ECHO_PEER, two_hosts.daemon_ip, str(port)])
    try:
        assert two_hosts.wait_port(two_hosts.daemon_ip, port), "server never listened"
        # wait_port consumed the single accept: start a fresh server for the real exchange.
        server.wait(timeout=10)
        server = two_hosts.popen_daemon([sys.executable, "-c", ECHO_PEER, two_hosts.daemon_ip, str(port)])
        got = None
        for _ in range(100):
            out = two_hosts.run_trainer([sys.executable, "-c", FETCH, two_hosts.daemon_ip, str(port)])
            if out.returncode == 0:
                got = out.stdout.strip()
                break
        assert got == two_hosts.trainer_ip, f"the daemon's side saw {got!r}, not the trainer's own address"
    finally:
        server.kill()
        server.wait()


def test_namespaces_are_isolated_and_removed() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"no network namespaces: {why}")
    # A listener on the host's loopback, which neither namespace may reach.
    host = subprocess.Popen([sys.executable, "-c", ECHO_PEER, "127.0.0.1", "17322"])
    try:
        with NetnsPair() as pair:
            assert pair.exists()
            assert not pair.wait_port("127.0.0.1", 17322, timeout=1.0), "the host's loopback leaked into the netns"
            # The daemon's side holds its address on its own interface, not the trainer's.
            links = subprocess.run(pair.daemon_wrap() + ["ip", "-o", "addr"], capture_output=True, text=True).stdout
            assert pair.daemon_ip in links and pair.trainer_ip not in links
        assert not pair.exists(), "namespaces left behind"
    finally:
        host.kill()
        host.wait()


def test_removed_when_the_body_fails() -> None:
    why = unavailable()
    if why:
        pytest.skip(f"no network namespaces: {why}")
    with pytest.raises(RuntimeError, match="boom"):
        with NetnsPair() as pair:
            assert pair.exists()
            raise RuntimeError("boom")
    assert not pair.exists()
