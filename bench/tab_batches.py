"""The Parquet tab set (1M rows of 8 float32 + id + label) streamed with no consumer at all, by
batch size and form: what a batch costs the client and the daemon, and how often the daemon's
threads switch. Not part of `make bench`; the figures behind "Without any consumer" in
bench/PARQUET_PROFILE.md.

    python bench/tab_batches.py --rounds 3 [--variant before=SITE]

One warm daemon per build (a first, untimed epoch decodes the row groups); each epoch in a fresh
interpreter, its imports before the clock; the configurations (and builds, with `--variant`)
interleaved within each round.
Client CPU: the epoch's own (`process_time`). Daemon CPU and context switches: the daemon's
deltas over the epoch (switches summed over its threads in `/proc/PID/task/*/status`; a thread
that ended during the epoch, such as the stream's side-channel thread, is not counted).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon  # noqa: E402
import measure  # noqa: E402
import parquet_bench  # noqa: E402

CHILD = """
import json, sys, time
import numpy, pyarrow, torch, shardstream
path, addr, form, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cpu0, t0, rows = time.process_time(), time.perf_counter(), 0
for b in shardstream.Loader(path, batch_size=batch, seed=0, connect=addr, transport="shm", format=form):
    rows += len(b) if form == "arrow" else len(b["__key__"])
print(json.dumps({"rows": rows, "s": time.perf_counter() - t0, "cpu": time.process_time() - cpu0}))
"""


def switches(pid: int) -> int:
    """Voluntary and involuntary context switches of `pid`'s live threads so far."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            lines = status.read_text().splitlines()
        except OSError:
            continue  # the thread ended meanwhile
        total += sum(int(line.split()[1]) for line in lines if line.startswith(("voluntary_", "nonvoluntary_")))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="arrow:256,arrow:1024,arrow:4096,dict:256", help="FORM:BATCH,...")
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data/parquet")
    ap.add_argument("--variant", type=daemon.variant, action="append", default=[], help="NAME=SITE: another build")
    args = ap.parse_args()
    builds: list[tuple[str, str | None]] = [("this build", None), *args.variant]
    configs = [
        (name, site, form, int(batch))
        for name, site in builds
        for form, batch in (c.split(":") for c in args.configs.split(","))
    ]
    path = str(parquet_bench.make_tab(args.data / f"tab-{args.rows}", args.rows))
    runs: dict[tuple[str, str | None, str, int], list[dict[str, float]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="tab-batches-") as tmp:
        servers: dict[str, daemon.Daemon] = {}
        try:
            for i, (name, site) in enumerate(builds):
                (Path(tmp) / str(i)).mkdir()
                servers[name] = daemon.Daemon.start(Path(tmp) / str(i), site=site)

            def epoch(name: str, site: str | None, form: str, batch: int) -> dict[str, float]:
                srv = servers[name]
                cmd = [sys.executable, "-c", CHILD, path, srv.addr, form, str(batch)]
                cpu0, sw0 = measure.cpu_seconds(srv.pid) or 0.0, switches(srv.pid)
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=daemon.env_for(site))
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if r["rows"] != args.rows:
                    raise RuntimeError(f"{name} {form}:{batch} delivered {r['rows']} rows of {args.rows}")
                r["daemon_cpu"] = (measure.cpu_seconds(srv.pid) or 0.0) - cpu0
                r["switches"] = switches(srv.pid) - sw0
                return r

            for name, site in builds:
                epoch(name, site, *configs[0][2:])  # decodes the row groups
            for rnd in range(args.rounds):
                for c in configs[rnd % len(configs) :] + configs[: rnd % len(configs)]:
                    runs[c].append(epoch(*c))
                print(f"round {rnd + 1} done", file=sys.stderr, flush=True)
        finally:
            for srv in servers.values():
                srv.stop()

    def cell(xs: list[float], fmt: str) -> str:
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"

    print(f"{args.rows:,} rows, no consumer, {args.rounds} rounds; median (min-max)\n")
    print(
        "| build | form | batch | rows/s | client us/batch | daemon CPU-s/epoch | daemon us/batch"
        " | daemon switches/batch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (name, _, form, batch), rs in runs.items():
        n = args.rows / batch
        print(
            f"| {name} | {form} | {batch} | {cell([r['rows'] / r['s'] for r in rs], '{:,.0f}')}"
            f" | {cell([r['cpu'] / n * 1e6 for r in rs], '{:.0f}')} | {cell([r['daemon_cpu'] for r in rs], '{:.2f}')}"
            f" | {cell([r['daemon_cpu'] / n * 1e6 for r in rs], '{:.0f}')}"
            f" | {cell([r['switches'] / n for r in rs], '{:.1f}')} |"
        )


if __name__ == "__main__":
    main()
