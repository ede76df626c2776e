"""Packed mode (`collate="stack"`) of two or more builds against memcpy, interleaved: the loop
behind the packed section of bench/PROFILES.md. Not part of `make bench` (shm_bench.py is).

Each build is a directory holding a `shardstream` package (put first on PYTHONPATH; an empty
path means the installed one). One warm daemon per build, started from that build. A round
measures memcpy (`np.copyto` of 1 GiB, best of 3), then `--epochs` epochs per build, builds in
an order rotated by one each round, each build's epochs in a fresh interpreter of that build.
With `--one-process`, a build's epochs of a round run in one interpreter instead, as a trainer's
epochs do. Every epoch is checked exactly once (the index written in each record). Reported per
build:
GB/s (median, min-max), the ratio to the memcpy of the same round (median, min-max), the
daemon's and the client's CPU-s per epoch, and the load average of each round.

    python bench/packed_profile.py --build before=/tmp/old --build after= --records 65536
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import consumer  # noqa: E402
import daemon  # noqa: E402
import measure  # noqa: E402
import shm_bench  # noqa: E402


def child(addr: str, url: str, batch: int, epochs: int) -> None:
    """Runs `epochs` packed epochs in this interpreter and prints them as JSON lines."""
    import shardstream.torch  # noqa: F401 - imported before the clock (the loader looks for torch.distributed)

    for _ in range(epochs):
        print(json.dumps(shm_bench.packed_epoch(addr, url, batch)), flush=True)


def run_build(path: str, addr: str, url: str, batch: int, epochs: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": path} if path else dict(os.environ)
    out = subprocess.run(
        [sys.executable, __file__, "--child", addr, url, str(batch), str(epochs)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def spread(xs: list[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=PYTHONPATH (empty: installed)")
    ap.add_argument("--records", type=int, default=65536, help="4 KiB records")
    ap.add_argument("--per-shard", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=2, help="epochs per build and round")
    ap.add_argument("--one-process", action="store_true", help="a build's epochs of a round in one interpreter")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "packed-profile-data")
    args = ap.parse_args()
    builds = [tuple(b.split("=", 1)) for b in args.build]

    files = shm_bench.tar_dataset(
        args.data / f"packed-{args.records}x4096", args.records, 4096, args.per_shard, "tok", label=False
    )
    url = str(files[0].parent)
    measure.warm(files)
    results: dict[str, list[tuple[dict, float]]] = {name: [] for name, _ in builds}
    loads = []
    with tempfile.TemporaryDirectory(prefix="packed-profile-") as tmp:
        daemons = {}
        saved = os.environ.get("PYTHONPATH")
        try:
            for name, path in builds:
                os.environ.pop("PYTHONPATH", None)
                if path:
                    os.environ["PYTHONPATH"] = path
                (Path(tmp) / name).mkdir()
                daemons[name] = daemon.Daemon.start(Path(tmp) / name)
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved
            for name, path in builds:
                run_build(path, daemons[name].addr, url, args.batch, 1)  # warm-up: index, verify, map
            for r in range(args.rounds):
                load = os.getloadavg()[0]
                memcpy = measure.memcpy_gbps()
                order = builds[r % len(builds) :] + builds[: r % len(builds)]
                for name, path in order:
                    srv = daemons[name]
                    if args.one_process:
                        # The daemon's CPU over all of them, shared out evenly.
                        cpu0 = measure.cpu_seconds(srv.pid) or 0.0
                        runs = run_build(path, srv.addr, url, args.batch, args.epochs)
                        cpu = ((measure.cpu_seconds(srv.pid) or 0.0) - cpu0) / max(len(runs), 1)
                        for run in runs:
                            run["daemon_cpu"] = cpu
                    else:
                        runs = []
                        for _ in range(args.epochs):
                            cpu0 = measure.cpu_seconds(srv.pid) or 0.0
                            (run,) = run_build(path, srv.addr, url, args.batch, 1)
                            run["daemon_cpu"] = (measure.cpu_seconds(srv.pid) or 0.0) - cpu0
                            runs.append(run)
                    for run in runs:
                        run["check"] = consumer.verdict(run.pop("ids"), args.records)
                        results[name].append((run, memcpy))
                        gbps = run["bytes"] / 1e9 / run["seconds"]
                        print(
                            f"round {r} {name}: {gbps:.2f} GB/s ({gbps / memcpy:.2f}x memcpy {memcpy:.2f}),"
                            f" daemon {run['daemon_cpu']:.3f} CPU-s, client {run['client_cpu']:.3f}, {run['check']}",
                            flush=True,
                        )
                loads.append((load, os.getloadavg()[0]))
        finally:
            for srv in daemons.values():
                srv.stop()

    print()
    print(
        f"{args.records:,} records of 4 KiB in shards of {args.per_shard}, batch {args.batch}, {args.rounds} rounds"
        f" x {args.epochs} epochs per build ({'one interpreter' if args.one_process else 'an interpreter each'});"
        " load average (1 min) per round before/after:"
        f" {', '.join(f'{a:.1f}/{b:.1f}' for a, b in loads)}"
    )
    print()
    print("| build | GB/s (median, min-max) | x memcpy, same round | daemon CPU-s/epoch | client CPU-s/epoch | check |")
    print("|---|---|---|---|---|---|")
    for name, _ in builds:
        runs = results[name]
        gbps = [r["bytes"] / 1e9 / r["seconds"] for r, _ in runs]
        ratio = [g / m for g, (_, m) in zip(gbps, runs, strict=True)]
        checks = "; ".join(sorted({r["check"] for r, _ in runs}))
        print(
            f"| {name} | {spread(gbps)} | {spread(ratio)} | {spread([r['daemon_cpu'] for r, _ in runs], '{:.3f}')}"
            f" | {spread([r['client_cpu'] for r, _ in runs], '{:.3f}')} | {checks} |"
        )
    memcpys = [m for runs in results.values() for _, m in runs]
    print(f"\nmemcpy per round: {spread(sorted(set(memcpys)))} GB/s")


if __name__ == "__main__":
    main()
