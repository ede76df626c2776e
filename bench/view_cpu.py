"""View mode, small samples: where the CPU of an epoch goes, shardstream against LitData (the best
peer of `run.py` with 0 workers), with and without the bench's consumer. Not part of
`make bench`; the figures behind the view-mode section of bench/PROFILES.md.

`run.py`'s CPU-s/epoch includes its consumer (per sample `np.frombuffer(v)[::4096].sum()`, the
length and the index read back), the same for every reader. This separates it out: each reader
runs `--rounds` interleaved rounds of one epoch per mode, each epoch in a fresh interpreter:

- `bare`: iterate the batches and take each batch's list of payloads (nothing per sample);
- `consume`: the bench's consumer on every payload (what `run.py` measures).

Readers: `litdata`, and shardstream on a warm daemon (one untimed epoch first) as `ss-pread`
(the default for a local directory: each batch's samples read into one buffer), `ss-mapped`
(`SHARDSTREAM_MAP_IN_PLACE=1`: zero-copy views into mapped shards) and `ss-cache` (the shards
copied into the node cache and mapped from there, the path of an S3 dataset). CPU-s per epoch
is the reader process's user+system time (`getrusage`) plus the daemon's delta.

    python bench/view_cpu.py --samples 20000 --rounds 3

`--epochs N` runs N epochs in each interpreter, as a trainer does with 0 workers: the epochs
after the first get rows of their own (`bare later`, `consume later`), where what a process keeps
from one stream to the next (its shard mappings) shows.

`--variant NAME=SITE` (repeatable) measures another build of the package (a directory where its
wheel was installed with `pip install --target SITE`) in the same rounds, with its own daemon:
its shardstream readers appear as `ss-...@NAME`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import consumer  # noqa: E402
import daemon  # noqa: E402
import gen  # noqa: E402
import measure  # noqa: E402

BATCH = 256
SEED = 0
READERS = ("litdata", "ss-pread", "ss-mapped", "ss-cache")


def batches(reader: str, data: Path, addr: str):
    if reader == "litdata":
        import litdata as ld

        ds = ld.StreamingDataset(str(data / "litdata"), shuffle=True, seed=SEED)
        dl = ld.StreamingDataLoader(ds, batch_size=BATCH, num_workers=0, collate_fn=list)
        return ([s["jpg"] for s in batch] for batch in dl)
    import shardstream as ss

    cache = "copy" if reader == "ss-cache" else "auto"
    loader = ss.Loader(str(data / "wds"), batch_size=BATCH, shuffle=True, seed=SEED, connect=addr, cache=cache)
    return (batch["jpg"] for batch in loader)


def child(reader: str, mode: str, data: Path, addr: str, epochs: int, daemon_pid: int) -> None:
    """Runs `epochs` epochs in this interpreter, one JSON line each (the daemon's CPU counted
    around each epoch here, so that each line has its own)."""
    if reader == "ss-mapped":
        os.environ["SHARDSTREAM_MAP_IN_PLACE"] = "1"
    if reader == "litdata":
        import litdata  # noqa: F401
    else:
        import shardstream.torch  # noqa: F401 - as run.py: the loader looks for torch.distributed
    for _ in range(epochs):
        d0 = (measure.cpu_seconds(daemon_pid) or 0.0) if daemon_pid else 0.0
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if mode == "consume":
            r = consumer.consume(batches(reader, data, addr), t0)
            n, ids = r["samples"], r["ids"]
        else:
            n = 0
            for payloads in batches(reader, data, addr):
                n += len(payloads)
            ids = None
        seconds = time.perf_counter() - t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
        daemon_cpu = (measure.cpu_seconds(daemon_pid) or 0.0) - d0 if daemon_pid else 0.0
        print(
            json.dumps({"samples": n, "seconds": seconds, "cpu": cpu, "daemon_cpu": daemon_cpu, "ids": ids}), flush=True
        )


def spread(xs: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], Path(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--modes", default="bare,consume")
    ap.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs per interpreter; from 2, the later epochs get rows of their own (`... later`)",
    )
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        type=daemon.variant,
        help="NAME=SITE: another build, measured alongside",
    )
    args = ap.parse_args()
    # Build of each reader as run (`ss-mapped@NAME`): "" for this one, else "@NAME".
    builds: dict[str, str | None] = {"": None, **{f"@{name}": site for name, site in args.variant}}
    base_readers = args.readers.split(",")
    # A reader as run: its name, with `@NAME` for a variant's shardstream readers.
    readers = [r + b for r in base_readers for b in (builds if r.startswith("ss-") else [""])]
    modes = args.modes.split(",")
    spec = gen.Spec(samples=args.samples)
    data = gen.ensure(args.data, spec, ["wds", "litdata"])
    measure.warm(sorted((data / "wds").glob("*.tar")) + sorted((data / "litdata").glob("*")))
    rows: dict[tuple[str, str], list[dict]] = {}
    loads = []
    with tempfile.TemporaryDirectory(prefix="view-cpu-") as tmp:
        daemons: dict[str, daemon.Daemon] = {}

        def build_of(r: str) -> str:
            return r[r.index("@") :] if "@" in r else ""

        def run_child(r: str, m: str, epochs: int = 1) -> list[dict]:
            srv = daemons[build_of(r)]
            pid = srv.pid if r.startswith("ss-") else 0
            cmd = [
                sys.executable,
                __file__,
                "--child",
                r.partition("@")[0],
                m,
                str(data),
                srv.addr,
                str(epochs),
                str(pid),
            ]
            env = daemon.env_for(builds[build_of(r)])
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

        try:
            for i, (b, site) in enumerate(builds.items()):
                work = Path(tmp) / f"d{i}"
                work.mkdir()
                daemons[b] = daemon.Daemon.start(work, site=site)
            for r in readers:  # warm the daemons: index, verify, node-cache copies
                if r.startswith("ss-"):
                    run_child(r, "bare")
            for rnd in range(args.rounds):
                loads.append(os.getloadavg()[0])
                order = readers[rnd % len(readers) :] + readers[: rnd % len(readers)]
                for r in order:
                    for m in modes:
                        for e, run in enumerate(run_child(r, m, args.epochs)):
                            ids = run.pop("ids")
                            run["check"] = (
                                consumer.verdict(ids, args.samples)
                                if ids is not None
                                else (
                                    "ok" if run["samples"] == args.samples else f"MISMATCH ({run['samples']} samples)"
                                )
                            )
                            mode = m if e == 0 else f"{m} later"
                            rows.setdefault((r, mode), []).append(run)
                            print(
                                f"round {rnd} {r} {mode}: {run['samples'] / run['seconds']:,.0f} samples/s,"
                                f" cpu {run['cpu']:.3f} + daemon {run['daemon_cpu']:.3f} s, {run['check']}",
                                flush=True,
                            )
        finally:
            for srv in daemons.values():
                srv.stop()
    print()
    print(
        f"{args.samples:,} samples of 16-20 KiB (run.py's dataset), batch {BATCH}, 0 workers, {args.rounds} rounds,"
        f" {args.epochs} epoch(s) per interpreter (`later`: the epochs after its first);"
        f" load average (1 min) at each round's start: {', '.join(f'{x:.1f}' for x in loads)}"
    )
    print()
    print("| reader | mode | samples/s | reader CPU-s/epoch | daemon CPU-s/epoch | total CPU µs/sample | check |")
    print("|---|---|---|---|---|---|---|")
    for (r, m), runs in rows.items():
        rate = [x["samples"] / x["seconds"] for x in runs]
        total = [(x["cpu"] + x["daemon_cpu"]) / x["samples"] * 1e6 for x in runs]
        print(
            f"| {r} | {m} | {spread(rate, '{:,.0f}')} | {spread([x['cpu'] for x in runs], '{:.3f}')}"
            f" | {spread([x['daemon_cpu'] for x in runs], '{:.3f}')} | {spread(total, '{:.1f}')}"
            f" | {'; '.join(sorted({x['check'] for x in runs}))} |"
        )


if __name__ == "__main__":
    main()
