"""The inline transport to a trainer on "another host": the daemon in one network namespace on a
TCP listener, two ranks of DataLoader workers in another (tests/netns.py; the loopback variant
runs where namespaces cannot be made). Every sample exactly once across 2 ranks x 2 workers, bytes
identical to what webdataset wrote, with the large HTTP/2 frames and split batches the inline path
uses."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from netns import Hosts, two_hosts_fixture  # noqa: F401  (registers `two_hosts`)
from tlsutil import available, client_env, make_pki, serve_args

from conftest import SHARDSTREAM

# The daemon's port in its own namespace (nothing else listens there); on loopback a free one.
PORT = 17431


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One rank's epoch through a DataLoader with two workers; prints {key: [sha256 of each field]}.
TRAINER = """
import hashlib, json, sys
import torch.utils.data
import shardstream.torch as sst

addr, root, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ds = sst.IterableDataset(root, batch_size=32, seed=11, rank=rank, world_size=world, connect=addr,
                         transport="inline")
ds.set_epoch(2)
seen = {}
for batch in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
    for i, key in enumerate(batch["__key__"]):
        digest = {f: None if batch[f][i] is None else hashlib.sha256(bytes(batch[f][i])).hexdigest()
                  for f in ("cls", "jpg", "json")}
        seen.setdefault(key, []).append(digest)
print(json.dumps({"seen": seen, "batches": len(ds)}))
"""


def digests(fields: dict[str, bytes]) -> dict[str, str | None]:
    return {f: hashlib.sha256(fields[f]).hexdigest() if f in fields else None for f in ("cls", "jpg", "json")}


@pytest.mark.parametrize("message_bytes", [None, 16 << 10], ids=["whole", "split"])
def test_two_ranks_two_workers_exactly_once_over_tcp(
    two_hosts: Hosts, dataset, tmp_path: Path, message_bytes: int | None
) -> None:
    root, samples = dataset
    port = PORT if two_hosts.kind == "netns" else free_port()
    listen = f"tcp://{two_hosts.daemon_ip}:{port}"
    # Plaintext is for loopback only (--insecure); the daemon on the namespace pair's own address
    # serves TLS with bearer tokens, as a remote endpoint must.
    trainer_env = None
    if two_hosts.kind == "netns":
        if why := available():
            pytest.skip(why)
        pki = make_pki(tmp_path / "pki")
        security, addr = serve_args(pki), f"tls://{two_hosts.daemon_ip}:{port}"
        trainer_env = {**os.environ, **client_env(pki)}
    else:
        security, addr = ["--insecure"], listen
    env = None
    if message_bytes:
        env = {**os.environ, "SHARDSTREAM_INLINE_MESSAGE_BYTES": str(message_bytes)}
    cmd = [SHARDSTREAM, "serve", "--listen", listen, "--cache-dir", str(tmp_path / "cache"), "--log", "warn", *security]
    daemon = two_hosts.popen_daemon(cmd, env=env)
    try:
        assert two_hosts.wait_port(two_hosts.daemon_ip, port), "the daemon never listened"
        world = 2
        trainers = [
            two_hosts.popen_trainer(
                [sys.executable, "-c", TRAINER, addr, str(root), str(rank), str(world)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=trainer_env,
            )
            for rank in range(world)
        ]
        outs = []
        for t in trainers:
            out, err = t.communicate(timeout=180)
            assert t.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
        assert daemon.poll() is None, "the daemon died"
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
    seen: dict[str, list] = {}
    for o in outs:
        for key, got in o["seen"].items():
            seen.setdefault(key, []).extend(got)
    # 1003 samples over 2 ranks: the padding rule repeats one sample to even the ranks out.
    repeated = {k: len(v) for k, v in seen.items() if len(v) > 1}
    assert set(seen) == set(samples), "samples missing or unknown"
    assert sum(len(v) for v in seen.values()) == 1004 and len(repeated) == 1, repeated
    for key, got in seen.items():
        assert all(g == digests(samples[key]) for g in got), f"{key}: bytes differ"
