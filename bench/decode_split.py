"""Where a decode-pipeline epoch's CPU goes with the batch memory reused and not (not part of
`make bench`; the figures in bench/DECODE_RESULTS.md's notes come from it)::

    python bench/decode_split.py [--workers 2] [--rounds 2] [--samples 8000] [--data bench/data]

1. **Epochs**: shardstream's reader of `bench/decode_peers.py` (transform in the workers, default
   collate) on the bench's images, `reuse_batch_memory` on and off alternating, each epoch in a
   fresh interpreter with a fresh daemon. Per epoch: samples/s; the trainer's CPU and system time
   and minor faults (`getrusage(RUSAGE_SELF)`); the workers' (`RUSAGE_CHILDREN`, counted once the
   DataLoader has joined them; without workers the trainer decodes, so its CPU less the decode is
   the loader's part); the daemon's CPU (`/proc`); the decode's own CPU as the bench measures it.
   With the memory not reused, the collate's own CPU too (the thread CPU clock around
   `default_collate` in the worker): passing a `collate_fn` is what turns the reuse off anyway.
2. **The stack alone**: `torch.stack` of one batch of decoded-image-sized tensors (256 x 3x224x224
   uint8), 32 times in one process: into new shared memory (what `default_collate` does in a
   worker) against one reused shared buffer, and into new private memory (in the trainer) against
   one reused buffer handed out through DLPack, with the user and system CPU of each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import daemon
import decode_bench
import decode_gen
import decode_peers
import measure

BENCH = Path(__file__).resolve().parent
STACK_BATCHES = 32


def _cpu(who: int) -> tuple[float, float, int]:
    ru = resource.getrusage(who)
    return ru.ru_utime, ru.ru_stime, ru.ru_minflt


def one_epoch(base: Path, workers: int, samples: int, addr: str, reuse: bool) -> dict[str, Any]:
    """One epoch in this (fresh) interpreter; the trainer's loop is decode_peers.epoch."""
    import torch

    import shardstream.torch as sst

    torch.set_num_threads(1)  # as decode_peers.main
    # Each worker appends each batch's collate CPU to a file (one line a batch): the batch itself
    # carries only the decode's.
    log = Path(tempfile.gettempdir()) / f"decode-split-collate-{os.getpid()}.log"

    def logged_collate(batch: list[Any]) -> Any:
        t0 = time.thread_time_ns()
        out = decode_peers.collate(batch)
        with open(log, "a") as f:
            f.write(f"{time.thread_time_ns() - t0}\n")
        return out

    def make(data: Path, n_workers: int, address: str) -> Any:
        ds = sst.IterableDataset(
            str(data / "wds"),
            batch_size=decode_peers.BATCH,
            shuffle=True,
            seed=decode_peers.SEED,
            connect=address,
            transform=decode_peers._ss_decode,
            # A collate_fn of its own turns the reuse off, as reuse_batch_memory=False does.
            collate_fn=None if reuse else logged_collate,
        )
        return sst.DataLoader(ds, num_workers=n_workers, worker_init_fn=decode_peers.seed_worker)

    decode_peers.seed_worker(-1)
    self0, kids0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    res = decode_peers.epoch(make, base, workers, addr, samples)
    self1, kids1 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    collate_s = sum(int(x) for x in log.read_text().split()) / 1e9 if log.exists() else None
    log.unlink(missing_ok=True)
    return {
        "samples_per_s": res["samples"] / res["seconds"],
        "check": "ok" if not any(res[k] for k in ("missing", "duplicated", "out_of_range")) else "MISMATCH",
        "trainer_cpu": self1[0] + self1[1] - self0[0] - self0[1],
        "trainer_sys": self1[1] - self0[1],
        "trainer_minflt": self1[2] - self0[2],
        "workers_cpu": kids1[0] + kids1[1] - kids0[0] - kids0[1],
        "workers_sys": kids1[1] - kids0[1],
        "workers_minflt": kids1[2] - kids0[2],
        "decode_cpu": res["decode_cpu_s"],
        "collate_cpu": collate_s,
    }


def epochs(args: argparse.Namespace, base: Path) -> list[dict[str, Any]]:
    rows = []
    for rnd in range(args.rounds):
        for reuse in (True, False):
            with tempfile.TemporaryDirectory(prefix="decode-split-") as tmp:
                srv = daemon.Daemon.start(Path(tmp))
                try:
                    cpu0 = measure.cpu_seconds(srv.pid) or 0.0
                    cmd = [sys.executable, __file__, "--one", str(base), str(args.workers), str(args.samples)]
                    cmd += [srv.addr, "reused" if reuse else "new"]
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    row["daemon_cpu"] = (measure.cpu_seconds(srv.pid) or cpu0) - cpu0
                finally:
                    srv.stop()
            row["memory"] = "reused" if reuse else "new"
            row["round"] = rnd + 1
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def stack_alone() -> list[tuple[str, float, float]]:
    import torch

    from shardstream._batch_memory import BatchMemory

    torch.set_num_threads(1)
    images = [torch.randint(0, 255, (3, 224, 224), dtype=torch.uint8) for _ in range(decode_peers.BATCH)]
    shape = (len(images), *images[0].shape)
    shared = torch.empty(shape, dtype=torch.uint8).share_memory_()
    memory = BatchMemory(None, 1, 0)  # the trainer's own, DLPack and all
    private = memory.collate_fn(0)

    def reused_private() -> Any:
        memory.collect()  # as the DataLoader does before each batch
        return memory.receive(private(images))

    def new_shared() -> Any:
        out = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(shared.nbytes), 0, shape)
        return torch.stack(images, 0, out=out)

    cases = {
        "new shared memory (default_collate in a worker)": new_shared,
        "one reused shared buffer": lambda: torch.stack(images, 0, out=shared),
        "new private memory (default_collate in the trainer)": lambda: torch.stack(images, 0),
        "reused private slots through DLPack (the trainer's batch memory)": reused_private,
    }
    out = []
    for name, fn in cases.items():
        u0, s0, _ = _cpu(resource.RUSAGE_SELF)
        for _ in range(STACK_BATCHES):
            batch = fn()
            int(batch.reshape(-1)[::4096].sum())  # one byte a page, as the bench's trainer
            del batch
        u1, s1, _ = _cpu(resource.RUSAGE_SELF)
        out.append((name, u1 - u0, s1 - s0))
        print(f"{name}: user {u1 - u0:.2f} s, system {s1 - s0:.2f} s for {STACK_BATCHES} batches", flush=True)
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        base, workers, samples, addr, memory = sys.argv[2:7]
        print(json.dumps(one_epoch(Path(base), int(workers), int(samples), addr, memory == "reused")))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=decode_bench.DEFAULT_SAMPLES)
    ap.add_argument("--data", type=Path, default=BENCH / "data")
    args = ap.parse_args()
    base = decode_gen.ensure(args.data, decode_gen.Spec(samples=args.samples), ["wds"])
    measure.warm(sorted((base / "wds").glob("*.tar")))
    print(f"==> load {os.getloadavg()[0]:.2f}, {args.workers} workers, {args.rounds} rounds", flush=True)
    epochs(args, base)
    stack_alone()


if __name__ == "__main__":
    main()
