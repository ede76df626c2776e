"""Ranks on two nodes (two daemons) list a dataset directory each: when the directory changes
between their listings (a writer still adding shards as the job starts), their plans differ and
the epoch repeats or drops samples without a word. With a torch.distributed process group, the
Loaders compare what they opened through its store and refuse to disagree."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import webdataset as wds
from test_bounds import free_port

from conftest import Daemon, write_dataset

RANK = textwrap.dedent(
    """
    import os, sys, time
    import torch.distributed as dist
    import shardstream

    rank, port, url, addr, go = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        while not os.path.exists(go):
            time.sleep(0.01)
    try:
        loader = shardstream.Loader(url, batch_size=4, connect=addr)
        print("OPENED", loader.info["num_samples"], flush=True)
    except ValueError as e:
        print("REFUSED", e, flush=True)
    if rank == 0:
        open(go + ".opened", "w").close()
    dist.barrier()
    dist.destroy_process_group()
    """
)


def two_ranks(tmp_path: Path, url: str, between) -> list[str]:
    """Rank 0 opens `url` on one daemon, then `between()` runs, then rank 1 opens it on another
    daemon; returns each rank's output."""
    daemons = [Daemon(tmp_path / f"node{i}").start() for i in range(2)]
    go = tmp_path / "go"
    port = free_port()
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(r), str(port), url, daemons[r].addr, str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        deadline = time.monotonic() + 120
        while not Path(f"{go}.opened").exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.01)
        between()
        go.touch()
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            outs.append(out)
        return outs
    finally:
        for d in daemons:
            assert d.stop() == 0


def test_ranks_that_list_the_same_directory_open_it(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_dataset(root, n=40, per_shard=10)
    outs = two_ranks(tmp_path, str(root), lambda: None)
    assert [o.split()[:2] for o in outs] == [["OPENED", "40"], ["OPENED", "40"]], outs


def test_a_shard_added_between_the_ranks_listings_is_refused_on_the_rank_that_sees_it(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    write_dataset(root, n=40, per_shard=10)

    def add_a_shard() -> None:
        tmp = tmp_path / "new.tar"
        with wds.TarWriter(str(tmp)) as sink:
            sink.write({"__key__": "late", "cls": b"1"})
        os.rename(tmp, root / "train-000004.tar")

    outs = two_ranks(tmp_path, str(root), add_a_shard)
    assert outs[0].split()[:2] == ["OPENED", "40"], outs
    assert outs[1].startswith("REFUSED"), outs
    assert "rank 0" in outs[1] and "shardstream index" in outs[1], outs[1]
