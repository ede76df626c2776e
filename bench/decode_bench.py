"""The workload users run: DataLoader workers decode and augment real JPEGs (Pillow decode,
random-resized crop to 224, horizontal flip, uint8 CHW tensor) with 0, 2 and 4 workers,
shardstream against the same peers as `bench/run.py`, each reading its own format of the same
images (`bench/decode_gen.py`). Writes `bench/DECODE_RESULTS.md`.

Here the decoder, not the reader, is the bottleneck: every CPU-second the loader spends (reading,
framing, shuffling, pickling batches between processes) is one the decoder loses. So besides
samples/s the table splits each epoch's CPU into the decode's own (measured around it with the
thread CPU clock, in whichever process decodes) and the loader's (all the rest of the reader's
process tree and, for shardstream, its daemon).

Runs are interleaved in rounds like `run.py` (the order rotated by one reader per round); cells
are medians with their spread (min-max), and the ratio to the best peer is computed within each
round among runs with the same worker count, then median'ed.

    python bench/decode_bench.py [--samples N] [--rounds R] [--epochs N] [--only R1,R2] [--workers 0,2,4]
                                 [--out bench/DECODE_RESULTS.md] [--data DIR] [--timeout S]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import daemon
import decode_gen
import decode_peers
import gen
import measure
import report
import run

BENCH = Path(__file__).resolve().parent
# ~5 ms of one core per image on this machine: 8,000 images are ~40 s per epoch at 0 workers, so
# 6 readers x 3 worker counts x 2 rounds fit in ~20 minutes of `make bench`.
DEFAULT_SAMPLES = 8_000
DEFAULT_ROUNDS = 2
DEFAULT_TIMEOUT_S = 900
# Without workers, decoding in the trainer is what `shardstream` does with its transform: not run twice.
SAME_AS_ANOTHER_ROW = {("shardstream-main-decode", 0)}
PACKAGES = ("torch", "pillow", "numpy", "webdataset", "mosaicml-streaming", "litdata", "shardstream")


@dataclass
class Row(report.Row):
    """A reader run of the decode pipeline: `cpu_s` is the reader tree and the daemon during the
    epoch, of which `decode_cpu_s` went to decoding and augmenting."""

    decode_cpu_s: float = 0.0

    @property
    def loader_cpu_s(self) -> float:
        return max(self.cpu_s - self.decode_cpu_s, 0.0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help=f"images (default {DEFAULT_SAMPLES})")
    ap.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help=f"repetitions (default {DEFAULT_ROUNDS})")
    ap.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs each reader runs in its interpreter, the last one measured (default 1: its first; "
        "from 2, a trainer's later epochs, as `run.py --epochs`)",
    )
    ap.add_argument("--only", default=",".join(decode_peers.READERS), help="readers, comma-separated")
    ap.add_argument("--workers", default="0,2,4", help="DataLoader worker counts, comma-separated")
    ap.add_argument("--out", type=Path, default=BENCH / "DECODE_RESULTS.md")
    ap.add_argument("--data", type=Path, default=BENCH / "data", help="where generated images are cached")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per reader run")
    args = ap.parse_args(argv)
    args.readers = [r for r in args.only.split(",") if r]
    unknown = [r for r in args.readers if r not in decode_peers.READERS]
    if unknown:
        ap.error(f"unknown reader(s) {', '.join(unknown)}; known: {', '.join(decode_peers.READERS)}")
    args.worker_counts = [int(w) for w in args.workers.split(",") if w]
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.epochs < 1:
        ap.error("--epochs must be at least 1")
    return args


def run_one(reader: str, workers: int, base: Path, samples: int, scratch: Path, timeout: float, epochs: int = 1) -> Row:
    """One measured epoch of the pipeline through `reader` in a subprocess, after `epochs - 1`
    untimed ones there."""
    row = Row(reader, workers)
    cmd = [sys.executable, str(BENCH / "decode_peers.py"), reader, str(workers), str(base), str(samples)]
    try:
        with run.daemon_for(reader, scratch) as srv:
            also = [srv.pid] if srv else []
            daemon_cpu0 = (measure.cpu_seconds(srv.pid) or 0.0) if srv else 0.0
            with run.epochs_env(srv, epochs):
                done = run.watch(cmd + ([srv.addr] if srv else []), scratch, timeout * epochs, also)
            daemon_cpu = ((measure.cpu_seconds(srv.pid) or daemon_cpu0) - daemon_cpu0) if srv else 0.0
    except (daemon.DaemonError, OSError) as e:
        row.error = f"could not run {reader}: {e}"
        return row
    row.peak_pss_mib = done.peak_pss_kib / 1024
    lines = [line for line in done.stdout.splitlines() if line.startswith(decode_peers.RESULT_PREFIX)]
    if done.timed_out:
        row.error = f"timed out after {timeout:g} s"
    elif done.returncode != 0 or not lines:
        row.error = run.last_error_line(done.stderr) or f"exit code {done.returncode}, no result"
    if row.error:
        tail = done.stderr.strip().splitlines()[-run.STDERR_LINES_SHOWN :]
        print("\n".join("    | " + line for line in tail), flush=True)
        return row
    res: dict[str, Any] = json.loads(lines[-1][len(decode_peers.RESULT_PREFIX) :])
    row.samples, row.seconds, row.ttfb = res["samples"], res["seconds"], res["ttfb"]
    row.decode_cpu_s = res["decode_cpu_s"]
    # Counted by the reader around its measured epoch when it ran untimed ones first.
    row.cpu_s = run.epoch_cpu(done, res) + res.get("daemon_cpu", daemon_cpu)
    problems = []
    if res["samples"] != samples:
        problems.append(f"delivered {res['samples']:,} of {samples:,} images")
    for what in ("missing", "duplicated", "out_of_range", "bad_shape"):
        if res[what]:
            problems.append(f"{res[what]:,} {what.replace('_', ' ')}")
    row.mismatch = "; ".join(problems)
    return row


COLUMNS = [
    "reader",
    "workers",
    "samples/s median (min-max)",
    "vs best peer, same workers (min-max)",
    "CPU-s/epoch",
    "decode CPU-s",
    "loader CPU-s",
    "loader share of CPU",
    "first batch (s)",
    "peak PSS (MiB)",
    "check",
]


def table(rounds: list[list[Row]]) -> str:
    groups: dict[tuple[str, int], list[tuple[Row, float]]] = {}
    for rows in rounds:
        for r in rows:
            peers = [
                p.samples_per_s
                for p in rows
                if p.workers == r.workers and p.ok and not p.reader.startswith("shardstream")
            ]
            groups.setdefault((r.reader, r.workers), []).append((r, max(peers, default=0.0)))
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for (reader, workers), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        done = [r for r, _ in runs if not r.error]
        problems = [f"round {i + 1}: {r.error or r.mismatch}" for i, (r, _) in enumerate(runs) if not r.ok]
        check = "ok" if not problems else "**" + "; ".join(problems).replace("|", "/") + "**"
        if not done:
            lines.append("| " + " | ".join([reader, str(workers), *["-"] * (len(COLUMNS) - 3), check]) + " |")
            continue
        ratios = [r.samples_per_s / best for r, best in runs if r.ok and best > 0]
        shares = [r.loader_cpu_s / r.cpu_s for r in done if r.cpu_s > 0]
        ttfbs = [r.ttfb for r in done if r.ttfb is not None]
        cells = [
            reader,
            str(workers),
            report.spread([r.samples_per_s for r in done], ",.0f"),
            report.spread(ratios, ".2f") if ratios else "-",
            report.spread([r.cpu_s for r in done], ".1f"),
            f"{report.median([r.decode_cpu_s for r in done]):.1f}",
            report.spread([r.loader_cpu_s for r in done], ".1f"),
            f"{report.median(shares):.0%}" if shares else "-",
            f"{report.median(ttfbs):.2f}" if ttfbs else "-",
            f"{max(r.peak_pss_mib for r in done):,.0f}",
            check,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ceiling(rounds: list[list[Row]], cores: int) -> str:
    """What a loader that cost no CPU at all could reach, per worker count: every core that can
    decode (the workers, at most the machine's cores; one at 0 workers, where the trainer decodes)
    busy decoding at the best peer's measured decode CPU per image. A ratio to the best peer above
    this ceiling cannot come from the loader; only a cheaper decode could give it."""
    lines = [
        "| workers | best peer | its samples/s | its decode CPU per image (ms) | decoding cores | "
        "ceiling samples/s | ceiling / best peer | shardstream / best peer |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers in sorted({r.workers for rows in rounds for r in rows}):
        runs = [r for rows in rounds for r in rows if r.workers == workers and r.ok]
        by_reader: dict[str, list[Row]] = {}
        for r in runs:
            by_reader.setdefault(r.reader, []).append(r)
        peers = {k: v for k, v in by_reader.items() if not k.startswith("shardstream")}
        if not peers:
            continue
        best = max(peers, key=lambda k: report.median([r.samples_per_s for r in peers[k]]))
        best_sps = report.median([r.samples_per_s for r in peers[best]])
        per_image = report.median([r.decode_cpu_s / r.samples for r in peers[best] if r.samples])
        decoding = min(max(workers, 1), cores)
        top = decoding / per_image if per_image > 0 else 0.0
        ours = by_reader.get("shardstream", [])
        ss = f"{report.median([r.samples_per_s for r in ours]) / best_sps:.2f}" if ours and best_sps else "-"
        lines.append(
            f"| {workers} | {best} | {best_sps:,.0f} | {per_image * 1e3:.2f} | {decoding} | {top:,.0f} | "
            f"{top / best_sps:.2f} | {ss} |"
        )
    return "\n".join(lines)


def render(
    args: argparse.Namespace,
    argv: list[str],
    base: Path,
    host: dict[str, str],
    rounds: list[list[Row]],
    loads: list[tuple[str, str]],
) -> str:
    sizes = [p.stat().st_size for p in gen.data_files(base / "raw")]
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = ", ".join(f"{p} {run.version(p)}" for p in PACKAGES)
    cmd = run.command_line(argv).replace("bench/run.py", "bench/decode_bench.py")
    spec = decode_gen.Spec(samples=args.samples)
    lines = [
        "# Decode pipeline: shardstream and its peers with DataLoader workers decoding",
        "",
        f"Measured {now} with `{cmd}`.",
        "",
        f"- Machine: {host['nproc']} CPUs ({host['cpu']}), {host['ram']} RAM; load average (1 min) before -> "
        "after each round: " + "; ".join(f"round {i + 1}: {a} -> {b}" for i, (a, b) in enumerate(loads)) + ".",
        f"- Images: {args.samples:,} JPEGs generated with Pillow (quality {spec.quality}, "
        f"{spec.min_px}-{spec.max_px} px a side, {min(sizes) / 1024:.0f}-{max(sizes) / 1024:.0f} KiB, "
        f"median {report.median([float(s) for s in sizes]) / 1024:.0f} KiB, {sum(sizes) / 1e9:.2f} GB); "
        f"WebDataset shards of {spec.per_shard} images (webdataset, shardstream), MDS and LitData at 64 MiB, "
        "files in ImageFolder layout (torch-files). Hot page cache (each reader's files read just before each run).",
        f"- Versions: {versions}.",
        "- Pipeline, the same code for every reader, in the DataLoader workers (in the reader process with 0 "
        "workers): Pillow decode, random-resized crop (scale 0.08-1, aspect 3/4-4/3) resized to 224x224 "
        "bilinear, horizontal flip with p=1/2, contiguous uint8 CHW tensor; `default_collate` into batches of "
        "256. shardstream decodes in its worker-side `transform` on the zero-copy views, and its workers "
        "stack each batch into shared memory they reuse once the trainer has dropped it (without workers, "
        "the trainer its own); `shardstream-fresh-memory` is the same without that reuse (new memory per "
        "batch, as `default_collate` makes); `shardstream-main-decode` is the way before the transform "
        "hook: workers pickle raw bytes to the trainer, which decodes. The trainer touches one byte per page "
        "of each batch and checks every image arrived exactly once with the right shape (`check`). The "
        "trainer runs torch with one intra-op thread (the default pool's spinning threads would be charged "
        "to every loader).",
        f"- Method: {args.rounds} round(s), every (reader, workers) run once per round, interleaved, the "
        "order rotated by one reader per round; each run is one shuffled epoch in a fresh interpreter "
        "(shardstream: a fresh daemon)"
        + (
            f", measured after {args.epochs - 1} untimed epoch(s) of the same reader in that interpreter (a "
            "trainer's later epochs: each library's first-use costs behind it; the daemon's CPU counted "
            "around the measured epoch only)"
            if args.epochs > 1
            else ", its first (each library's first-use costs in it)"
        )
        + ". Cells: median (min-max) over the rounds.",
        "",
        table(rounds),
        "",
        "samples/s: constructing the loader to its last batch. `vs best peer`: within each round, over "
        "the fastest non-shardstream reader with the same worker count; median (min-max) of the rounds. "
        "CPU-s/epoch: user+system seconds of the reader's process tree (and the shardstream daemon) "
        "during the epoch. Decode CPU-s: the pipeline's own thread CPU time, summed over every image. "
        "Loader CPU-s: the difference, i.e. what reading, shuffling and moving batches cost; its share "
        "is of CPU-s/epoch. Peak PSS: the largest over the rounds of the summed PSS of the tree and "
        "daemon.",
        "",
        "## How far a loader can move this pipeline",
        "",
        "The decode costs the same whoever reads the bytes, so a loader can only give back its own CPU. "
        "The ceiling below is a loader that costs nothing: every core that can decode (the workers, at "
        "most the machine's cores; the trainer alone at 0 workers) decoding all the time at the best "
        "peer's measured decode CPU per image (medians of this run). A ratio above `ceiling / best peer` "
        "cannot come from reading, shuffling or moving batches, only from a cheaper decode.",
        "",
        ceiling(rounds, int(host["nproc"])),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    spec = decode_gen.Spec(samples=args.samples)
    for d in decode_gen.prune(args.data, spec):
        print(f"==> removed outdated image dataset {d}", flush=True)
    formats = sorted({decode_peers.READERS[r][0] for r in args.readers} | {"raw"})
    base = decode_gen.ensure(args.data, spec, formats)
    host = measure.machine()
    runs = [(r, w) for r in args.readers for w in args.worker_counts if (r, w) not in SAME_AS_ANOTHER_ROW]
    rounds: list[list[Row]] = []
    loads: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="shardstream-decode-bench-") as tmp:
        for rnd in range(args.rounds):
            before = f"{os.getloadavg()[0]:.2f}"
            print(f"==> round {rnd + 1} of {args.rounds} (load {before})", flush=True)
            rows = []
            for reader, workers in run.round_order(runs, len(args.worker_counts), rnd):
                measure.warm(gen.data_files(base / decode_peers.READERS[reader][0]))
                print(f"==> {reader}, {workers} workers (load {os.getloadavg()[0]:.2f})", flush=True)
                scratch = Path(tmp) / f"{reader}-{workers}-r{rnd + 1}"
                scratch.mkdir()
                t0 = time.perf_counter()
                row = run_one(reader, workers, base, args.samples, scratch, args.timeout, args.epochs)
                if row.error:
                    print(f"    FAILED: {row.error}", flush=True)
                else:
                    print(
                        f"    {row.samples_per_s:,.0f} samples/s, {row.cpu_s:.1f} CPU-s of which decode "
                        f"{row.decode_cpu_s:.1f}, peak PSS {row.peak_pss_mib:,.0f} MiB "
                        f"({time.perf_counter() - t0:.0f} s){' MISMATCH: ' + row.mismatch if row.mismatch else ''}",
                        flush=True,
                    )
                rows.append(row)
            rounds.append(rows)
            loads.append((before, f"{os.getloadavg()[0]:.2f}"))
    text = render(args, argv, base, host, rounds, loads)
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"==> wrote {args.out}", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # scratch directories are removed on stop
    main(sys.argv[1:])
