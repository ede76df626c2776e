"""`make bench`: shardstream against the readers a user would otherwise pick, on the same generated
data, in the same run, with this machine's own limits (page-cache read, memcpy) measured alongside
so results also read as ratios.

Each reader runs one shuffled epoch per DataLoader worker count in a fresh interpreter
(`bench/peers.py`); this process watches it from outside (PSS, CPU from /proc), starts and stops the
shardstream daemon, and writes the table. A reader that fails or hangs gives a row with its error.

The runs are repeated in `--rounds` rounds; within a round every (reader, workers) pair runs once,
interleaved, the order rotated by one reader per round, so a burst of load on the shared machine
hits one run of several readers rather than every run of one. The table gives medians with their
spread (min-max), and ratios to the best peer taken within each round, then median'ed.

    python bench/run.py [--samples N] [--rounds R] [--only R1,R2] [--workers 0,2]
                        [--out bench/RESULTS.md] [--keep-data] [--timeout S] [--extra-json FILE ...]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import daemon
import gen
import measure
import peers
import report

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
DEFAULT_TIMEOUT_S = 900
# 3 rounds of 40k samples read about as many samples as the single round of 100k this bench used to
# run, so the repetitions fit in roughly the same time.
DEFAULT_SAMPLES = 40_000
DEFAULT_ROUNDS = 3
STDERR_LINES_SHOWN = 15
# How long processes a reader left behind may take to finish on their own: multiprocessing's
# resource tracker unlinks leaked shared memory when its parent exits, and must not be cut short.
LEFTOVER_GRACE_S = 10.0
# Packages whose version is printed in the report: the peers' APIs and formats change between them.
PACKAGES = ("torch", "numpy", "webdataset", "mosaicml-streaming", "litdata", "shardstream")
DESCRIPTION = __doc__.split("\n\n", 1)[0]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help=f"dataset size (default {DEFAULT_SAMPLES})")
    ap.add_argument(
        "--rounds",
        type=int,
        default=DEFAULT_ROUNDS,
        help=f"times every (reader, workers) run is repeated, interleaved (default {DEFAULT_ROUNDS})",
    )
    ap.add_argument("--only", default=",".join(peers.READERS), help="readers to run, comma-separated")
    ap.add_argument("--workers", default="0,2", help="DataLoader worker counts, comma-separated")
    ap.add_argument("--out", type=Path, default=BENCH / "RESULTS.md", help="Markdown report to write")
    ap.add_argument("--data", type=Path, default=BENCH / "data", help="where generated datasets are cached")
    ap.add_argument(
        "--keep-data",
        action="store_true",
        help="keep cached datasets of outdated specs and this run's scratch directory "
        "(daemon logs, reader output) under bench/out/",
    )
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per reader run")
    ap.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs each reader runs in its interpreter, the last one measured (default 1: its first; "
        "from 2, a trainer's later epochs, every library's first-use costs behind it)",
    )
    ap.add_argument(
        "--extra-json",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="append the sections in these JSON files to the report (see bench/report.py)",
    )
    args = ap.parse_args(argv)
    args.readers = [r for r in args.only.split(",") if r]
    unknown = [r for r in args.readers if r not in peers.READERS]
    if unknown:
        ap.error(f"unknown reader(s) {', '.join(unknown)}; known: {', '.join(peers.READERS)}")
    args.worker_counts = [int(w) for w in args.workers.split(",") if w]
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.epochs < 1:
        ap.error("--epochs must be at least 1")
    return args


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def command_line(argv: list[str]) -> str:
    cmd = shlex.join(["python", "bench/run.py", *argv])
    return f"make bench ({cmd})" if os.environ.get("MAKELEVEL") else cmd


def last_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def mismatch(result: dict[str, Any], samples: int, payload_bytes: int) -> str:
    """What is wrong with a finished epoch, "" if it delivered every sample exactly once."""
    problems = []
    if result["samples"] != samples:
        problems.append(f"delivered {result['samples']:,} of {samples:,} samples")
    for what in ("missing", "duplicated", "out_of_range"):
        if result[what]:
            problems.append(f"{result[what]:,} ids {what.replace('_', ' ')}")
    if result["bytes"] != payload_bytes:
        problems.append(f"{result['bytes']:,} payload bytes, expected {payload_bytes:,}")
    return "; ".join(problems)


def reap_leftovers(sampler: measure.TreeSampler, exclude: set[int]) -> None:
    """Waits for processes of a finished reader that outlived it (a resource tracker cleaning up,
    orphaned workers) to exit; kills the ones still running after LEFTOVER_GRACE_S."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := [p for p in sampler.alive() if p not in exclude]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        print(f"    killed process {pid}, left running by the reader", flush=True)


@dataclass
class Finished:
    """A reader subprocess after it exited (or was killed)."""

    returncode: int
    timed_out: bool
    stdout: str
    stderr: str
    cpu_s: float  # the reader's process tree over its whole life, imports included
    reaped_cpu_s: float  # the part of cpu_s known exactly: the reader and the children it waited for
    peak_pss_kib: int  # also covers the processes in `also`
    pss_samples: int


def _cpu(ru: resource.struct_rusage) -> float:
    return ru.ru_utime + ru.ru_stime


def watch(cmd: list[str], scratch: Path, timeout: float, also: list[int]) -> Finished:
    """Runs cmd in its own session and follows it (and the processes `also`) until it exits; kills
    its whole process group on timeout or when the harness itself is interrupted."""
    out_path, err_path = scratch / "reader.out", scratch / "reader.err"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
    sampler = measure.TreeSampler([proc.pid, *also])
    sampler.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        sampler.stop()
    sampler.sample(pss=False)  # the last CPU times of whatever outlived the reader
    reaped = _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu(before)
    reap_leftovers(sampler, set(also))
    return Finished(
        returncode=proc.returncode,
        timed_out=timed_out,
        stdout=out_path.read_text(errors="replace"),
        stderr=err_path.read_text(errors="replace"),
        # Waited-for descendants are exact in rusage; orphans only in the samples: take the larger.
        cpu_s=max(reaped, sampler.cpu_except(set(also))),
        reaped_cpu_s=reaped,
        peak_pss_kib=sampler.peak_pss_kib,
        pss_samples=sampler.pss_samples,
    )


@contextmanager
def daemon_for(reader: str, scratch: Path) -> Iterator[daemon.Daemon | None]:
    """A fresh shardstream daemon for a shardstream run (stopped afterwards), None for the peers."""
    if not reader.startswith("shardstream"):
        yield None
        return
    srv = daemon.Daemon.start(scratch)
    try:
        yield srv
    finally:
        code = srv.stop()
        if code not in (0, -signal.SIGTERM):
            print(f"    daemon exited with {code}: {srv.log_tail()}", flush=True)


@contextmanager
def epochs_env(srv: daemon.Daemon | None, epochs: int) -> Iterator[None]:
    """The environment a reader subprocess started inside reads (bench/peers.py,
    bench/decode_peers.py): `BENCH_EPOCHS`, and with untimed epochs first the daemon whose CPU it
    counts around the measured one (`BENCH_DAEMON_PID`)."""
    os.environ["BENCH_EPOCHS"] = str(epochs)
    if srv and epochs > 1:
        os.environ["BENCH_DAEMON_PID"] = str(srv.pid)
    try:
        yield
    finally:
        os.environ.pop("BENCH_EPOCHS", None)
        os.environ.pop("BENCH_DAEMON_PID", None)


def epoch_cpu(done: Finished, result: dict[str, Any]) -> float:
    """The reader's CPU seconds from the start of its clock to the end of its epoch: without the
    imports before (`cpu_before`) nor tearing the interpreter down after (what the reader and its
    waited-for children used past `cpu_at_exit`: ~0.045 s with torch loaded, the same for every
    reader, and paid once per training job, not per epoch)."""
    teardown = max(0.0, done.reaped_cpu_s - result["cpu_at_exit"])
    return done.cpu_s - result["cpu_before"] - teardown


def fill(row: report.Row, done: Finished, samples: int, payload_bytes: int) -> None:
    """Row figures from a finished reader, or the error it failed with."""
    row.peak_pss_mib, row.pss_samples = done.peak_pss_kib / 1024, done.pss_samples
    results = [line for line in done.stdout.splitlines() if line.startswith(peers.RESULT_PREFIX)]
    if done.timed_out:
        row.error = "timed out"
    elif done.returncode != 0 or not results:
        row.error = last_error_line(done.stderr) or f"exit code {done.returncode}, no result"
    if row.error:
        return
    result = json.loads(results[-1][len(peers.RESULT_PREFIX) :])
    row.samples, row.bytes, row.seconds = result["samples"], result["bytes"], result["seconds"]
    row.ttfb = result["ttfb"]
    row.cpu_s = epoch_cpu(done, result)
    row.daemon_cpu = result.get("daemon_cpu")
    row.mismatch = mismatch(result, samples, payload_bytes)


def run_reader(
    reader: str, workers: int, base: Path, scratch: Path, timeout: float, epochs: int = 1
) -> tuple[report.Row, str]:
    """One measured epoch of one reader in a subprocess (after `epochs - 1` untimed ones there).
    Returns the row and the subprocess's stderr."""
    row = report.Row(reader, workers)
    samples = json.loads((base / "spec.json").read_text())["spec"]["samples"]
    cmd = [sys.executable, str(BENCH / "peers.py"), reader, str(workers), str(base), str(samples)]
    try:
        with daemon_for(reader, scratch) as srv:
            also = [srv.pid] if srv else []
            daemon_cpu0 = (measure.cpu_seconds(srv.pid) or 0.0) if srv else 0.0
            if srv and reader in peers.WARM_DAEMON:
                warm_up = [*cmd[:2], peers.WARM_DAEMON[reader], *cmd[3:], srv.addr]
                subprocess.run(warm_up, check=True, capture_output=True, timeout=timeout)
                daemon_cpu0 = measure.cpu_seconds(srv.pid) or 0.0
            with epochs_env(srv, epochs):
                done = watch(cmd + ([srv.addr] if srv else []), scratch, timeout, also)
            daemon_cpu = (measure.cpu_seconds(srv.pid) or daemon_cpu0) - daemon_cpu0 if srv else 0.0
            daemon_log = srv.log_tail() if srv else ""
    except daemon.DaemonError as e:
        row.error = f"daemon: {e}"
        return row, ""
    except OSError as e:
        row.error = f"could not run {reader}: {e}"
        return row, ""
    fill(row, done, samples, gen.expected_payload_bytes(base))
    # Counted by the reader around its measured epoch when it ran untimed ones first.
    daemon_cpu = row.daemon_cpu if row.daemon_cpu is not None else daemon_cpu
    if done.timed_out:
        row.error = f"timed out after {timeout:g} s"
    if row.error and daemon_log:
        row.error += f" (daemon log: {daemon_log})"
    row.cpu_s += daemon_cpu
    return row, done.stderr


def print_row(row: report.Row, stderr: str) -> None:
    if row.error:
        print(f"    FAILED: {row.error}", flush=True)
        tail = stderr.strip().splitlines()[-STDERR_LINES_SHOWN:]
        print("\n".join("    | " + line for line in tail), flush=True)
        return
    print(
        f"    {row.samples_per_s:,.0f} samples/s, {row.mb_per_s:,.0f} MB/s, first batch {row.ttfb or 0:.2f} s, "
        f"peak PSS {row.peak_pss_mib:,.0f} MiB ({row.pss_samples} samples), {row.cpu_s:.1f} CPU-s",
        flush=True,
    )
    if row.mismatch:
        print(f"    !!! MISMATCH: {row.mismatch}", flush=True)


def rust_sections(base: Path, shards: int, per_shard: int) -> list[tuple[str, str]]:
    """Index memory and shuffle quality from the Rust examples `make bench` builds; a section for
    an example that is not built says so."""
    runs = [
        ("Index memory (`index_memory`)", "index_memory", [str(base / "wds")]),
        (
            "Shuffle quality, 8 ranks, window 8 shards (`plan_quality`)",
            "plan_quality",
            [str(shards), str(per_shard), "8", "8"],
        ),
        # A Parquet dataset's plan units are row groups; figures per file, next to what whole
        # files as units would give on the same shape.
        (
            "Shuffle quality, Parquet: 8 files x 20 row groups, 8 ranks, window 8 row groups",
            "plan_quality",
            ["8", "20000", "8", "8", "20"],
        ),
        (
            "Shuffle quality, the same 8 files as whole-file units, window 8 files",
            "plan_quality",
            ["8", "20000", "8", "8", "1"],
        ),
    ]
    out = []
    for title, name, args in runs:
        exe = ROOT / "target" / "release" / "examples" / name
        if not exe.exists():
            # Said in the report, not skipped: a table without these sections reads as complete.
            build = f"cargo build --release -p shardstream --example {name}"
            print(f"==> {name} not built; its section says so (`{build}`, which `make bench` runs)", flush=True)
            out.append((title, f"not run: `{exe.relative_to(ROOT)}` is not built (`{build}`; `make bench` builds it)."))
            continue
        p = subprocess.run([str(exe), *args], capture_output=True, text=True, check=False)
        try:
            out.append(report.section({"title": title, "data": json.loads(p.stdout)}))
        except ValueError:
            out.append((title, f"failed (exit {p.returncode}): {last_error_line(p.stderr) or 'no output'}"))
    return out


def round_order(runs: list[tuple[str, int]], per_reader: int, rnd: int) -> list[tuple[str, int]]:
    """Round rnd's order of the (reader, workers) runs: rotated by one reader per round, so no
    reader is always first (right after the machine-limit measurements) or last."""
    if not runs:
        return runs
    shift = (rnd * per_reader) % len(runs)
    return runs[shift:] + runs[:shift]


def header(
    args: argparse.Namespace,
    argv: list[str],
    base: Path,
    host: dict[str, str],
    limits: tuple[float, float],
    round_loads: list[tuple[str, str]],
) -> list[str]:
    shards = len(list((base / "wds").glob("*.tar")))
    spec = gen.Spec(samples=args.samples)
    payload = gen.expected_payload_bytes(base)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions = ", ".join(f"{p} {version(p)}" for p in PACKAGES)
    return [
        f"Measured {now} with `{command_line(argv)}`.",
        "",
        f"- Machine: {host['nproc']} CPUs ({host['cpu']}), {host['ram']} RAM, Linux {host['kernel']}, "
        f"Python {host['python']}; load average (1, 5, 15 min) before the runs {host['load']}, after "
        f"{host['load_after']} (other work on the machine shows here).",
        f"- Dataset: {args.samples:,} samples of {spec.min_bytes >> 10}-{spec.max_bytes >> 10} KiB random "
        f"bytes (mean {payload / args.samples / 1024:.1f} KiB, {payload / 1e9:.2f} GB of payload) plus an "
        f"integer label; {shards} WebDataset shards of {spec.per_shard} samples (read by webdataset and "
        "shardstream), MDS and LitData at 64 MiB per shard, raw files for torch-files.",
        f"- Machine limits, same run: `cat` of the WebDataset shards to /dev/null **{limits[0]:.2f} GB/s** "
        f"(hot page cache, best of 3); memcpy **{limits[1]:.2f} GB/s** (numpy copy of 1 GiB, best of 3).",
        f"- Versions: {versions}.",
        f"- Method: {args.rounds} round(s); in each, one shuffled epoch per (reader, workers) pair, "
        "interleaved (the order rotated by one reader per round), each in a fresh interpreter"
        + (
            f" after {args.epochs - 1} untimed epoch(s) of the same reader in that interpreter (a trainer's "
            "later epochs: each library's first-use costs behind it; the warm rows' daemon warmed as well)"
            if args.epochs > 1
            else " (the reader's first epoch: the `-warm` rows' daemon has served one before, the peers have not)"
        )
        + ", batch "
        "size 256, data hot in the page cache (the reader's files read once just before each run, and "
        "dropped from it once before the first run, so that they sit there as a read from storage "
        "leaves them); "
        "library imports are not timed. Each cell is the median over the rounds, (min-max) the spread; "
        "the ratio to the best peer is computed within each round, then median'ed. The consumer is "
        "the same for every reader: per sample `np.frombuffer(v, np.uint8)[::4096].sum()`, its length, "
        "and the sample index written in the payload, so each row is checked for every sample exactly "
        "once (`check`).",
        "- Load average (1 min) before -> after each round: "
        + "; ".join(f"round {i + 1}: {a} -> {b}" for i, (a, b) in enumerate(round_loads))
        + ".",
    ]


FOOTER = [
    "samples/s and MB/s (payload bytes, 10^6) cover the epoch from constructing the loader to its last "
    "batch. First batch: constructing the loader to the first batch. Peak PSS: the largest sum of the "
    "proportional set size of the reader process, its DataLoader workers and (for shardstream) the "
    "daemon, sampled every 50 ms (less often when reading it would cost over 5% of a core). "
    "CPU-s/epoch: user+system seconds of the same processes during the epoch (from constructing the "
    "loader to the last batch: imports before and the interpreter's teardown after are left out). "
    "`samples/s vs best peer`: "
    "in each round, over the fastest non-shardstream row of that round; the median (min-max) of those "
    "per-round ratios. `CPU-s vs best peer's`: the row's CPU-s over that same peer's, per round, "
    "median (min-max). Peak PSS: the largest of the rounds. `MB/s vs cat`: the median MB/s over the "
    "`cat` figure above: payload bytes delivered, not bytes moved (the consumer reads one byte per 4 KiB "
    "page, and the zero-copy rows copy none of the rest, where `cat` copies every byte). `floor`: the "
    "consumer alone over the payloads already in memory, not a peer: the most any reader can reach here. "
    "`check`: every round delivered every sample exactly once, or which did not.",
]


def title(rows: list[report.Row]) -> str:
    if any(r.reader.startswith("shardstream") and not r.error for r in rows):
        return "Benchmark: shardstream and its peers"
    return "Benchmark: peers only (shardstream's rows are not yet measured)"


def scratch_dir(keep: bool) -> AbstractContextManager[str]:
    if keep:
        d = BENCH / "out" / datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
        d.mkdir(parents=True)
        return nullcontext(str(d))
    return tempfile.TemporaryDirectory(prefix="shardstream-bench-")


def prepare_data(args: argparse.Namespace) -> Path:
    spec = gen.Spec(samples=args.samples)
    if not args.keep_data:
        for d in gen.prune(args.data, spec):
            print(f"==> removed outdated dataset {d}", flush=True)
    formats = sorted({peers.READERS[r][0] for r in args.readers} | {"wds"})  # wds: the cat baseline
    return gen.ensure(args.data, spec, formats)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    base = prepare_data(args)
    host = measure.machine()
    shards = gen.data_files(base / "wds")
    measure.warm(shards)
    limits = (measure.cat_gbps(shards), measure.memcpy_gbps())
    print(f"==> machine: cat of the shards {limits[0]:.2f} GB/s, memcpy {limits[1]:.2f} GB/s", flush=True)
    # `floor` is the consumer in this process: workers would only add their own cost.
    runs = [(r, w) for r in args.readers for w in args.worker_counts if not (r == "floor" and w)]
    rounds: list[list[report.Row]] = []
    round_loads: list[tuple[str, str]] = []
    with scratch_dir(args.keep_data) as tmp:
        for rnd in range(args.rounds):
            load_before = f"{os.getloadavg()[0]:.2f}"
            print(f"==> round {rnd + 1} of {args.rounds} (load {load_before})", flush=True)
            rows: list[report.Row] = []
            for reader, workers in round_order(runs, len(args.worker_counts), rnd):
                fmt = peers.READERS[reader][0]
                t0 = time.perf_counter()
                # Every run, not once per reader: other readers' runs in between may have pushed
                # these files out of the page cache (re-reading hot files costs a fraction of a second).
                warmed = measure.warm(gen.data_files(base / fmt))
                print(
                    f"==> {reader}, {workers} workers (load {os.getloadavg()[0]:.2f}; read {warmed / 1e9:.2f} GB "
                    f"of {fmt} in {time.perf_counter() - t0:.1f} s to warm the page cache)",
                    flush=True,
                )
                scratch = Path(tmp) / f"{reader}-{workers}-r{rnd + 1}"
                scratch.mkdir()
                row, stderr = run_reader(reader, workers, base, scratch, args.timeout, args.epochs)
                print_row(row, stderr)
                rows.append(row)
            rounds.append(rows)
            round_loads.append((load_before, f"{os.getloadavg()[0]:.2f}"))
    host["load_after"] = measure.machine()["load"]
    sections = (
        rust_sections(base, len(shards), gen.Spec(samples=args.samples).per_shard)
        if "shardstream" in args.readers
        else []
    )
    for path in args.extra_json:
        sections += report.sections_from_json(path)
    all_rows = [r for rows in rounds for r in rows]
    doc = report.Report(
        title(all_rows),
        header(args, argv, base, host, limits, round_loads),
        all_rows,
        limits[0],
        FOOTER,
        sections,
        rounds=rounds,
    )
    text = doc.render()
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"==> wrote {args.out}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
