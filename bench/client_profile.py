"""Where a remote consumer's CPU goes: one consumer process of `inline_bench.py`'s datasets
records itself with `perf record -p` once its imports are done, streams a few epochs from a warm
daemon on tcp://127.0.0.1, and the top of `perf report` is printed. Not part of `make bench`:
the profiles behind bench/INLINE.md's "Round of 2026-11-27" sections.

    python bench/client_profile.py                       # 18 KiB samples, inline, self time
    python bench/client_profile.py --large               # 1 MiB samples
    python bench/client_profile.py --event page-faults   # where the page faults are taken
    python bench/client_profile.py --call-graph -S __memmove_avx512_unaligned_erms
    python bench/client_profile.py --no-gc               # Python's collector off in the consumer
    python bench/client_profile.py --site SITE           # another build (pip install --target)

Needs `perf` (linux-perf) and permission to use it. Prints each epoch's samples/s and the
consumer's CPU seconds, then the report."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inline_bench  # noqa: E402
import shm_bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import gc, json, os, resource, signal, subprocess, sys, time
sys.path.insert(0, {bench!r})
import consumer, torch.distributed, shardstream
addr, url, field, batch, transport, epochs, perf_args, no_gc = {args!r}
if no_gc:
    gc.disable()
perf = subprocess.Popen(["perf", "record", "-q", *perf_args, "-p", str(os.getpid())])
time.sleep(0.5)  # perf attaches
for i in range(epochs):
    ru0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    loader = shardstream.Loader(url, batch_size=batch, seed=i, connect=addr, transport=transport)
    r = consumer.consume((b[field] for b in loader), t0, 0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    print(json.dumps({{"epoch": i, "samples_per_s": round(r["samples"] / r["seconds"]), "cpu_s": round(cpu, 3)}}))
perf.send_signal(signal.SIGINT)
perf.wait()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--large", action="store_true", help="2,400 samples of 1 MiB, batch 16 (else 30,000 of 18 KiB)")
    ap.add_argument("--transport", choices=["inline", "rdma"], default="inline")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--event", help="perf event to sample (default: cycles)")
    ap.add_argument("--call-graph", action="store_true", help="record DWARF call graphs (report callers)")
    ap.add_argument("-S", "--symbol", help="report only this symbol (with --call-graph: who calls it)")
    ap.add_argument("--no-gc", action="store_true", help="gc.disable() in the consumer after its imports")
    ap.add_argument("--site", help="a build installed with pip install --target SITE (default: this one)")
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    if not shutil.which("perf"):
        sys.exit("client_profile: perf is not installed (apt-get install linux-perf)")
    if args.large:
        files = shm_bench.tar_dataset(args.data / "inline-large-2400", 2400, 1 << 20, 64, "bin", True)
        field, batch = "bin", inline_bench.LARGE_BATCH
    else:
        files = shm_bench.tar_dataset(args.data / "inline-small-30000", 30000, 18 << 10, 1000, "jpg", True)
        field, batch = "jpg", inline_bench.SMALL_BATCH
    with tempfile.TemporaryDirectory(prefix="client-profile-") as tmp:
        out = Path(tmp) / "perf.data"
        perf_args = ["-F", "999" if args.call_graph else "4999", "-o", str(out)]
        if args.event:
            perf_args += ["-e", args.event]
        if args.call_graph:
            perf_args += ["--call-graph", "dwarf,16384"]
        d = inline_bench.TcpDaemon(args.site, Path(tmp), rdma=args.transport == "rdma")
        try:
            child_args = (
                d.addr,
                str(files[0].parent),
                field,
                batch,
                args.transport,
                args.epochs,
                perf_args,
                args.no_gc,
            )
            code = CHILD.format(bench=str(ROOT / "bench"), args=child_args)
            subprocess.run([sys.executable, "-c", code], env=d.env, check=True)
        finally:
            d.stop()
        report = ["perf", "report", "-i", str(out), "--stdio", "--no-children", "--sort", "dso,sym"]
        if args.symbol:
            report += ["-S", args.symbol]
        if args.call_graph:
            report += ["-g", "caller,0.5,callee"]
        text = subprocess.run(report, capture_output=True, text=True, check=True).stdout
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
        print("\n".join(lines[: args.top if not args.call_graph else args.top * 10]))


if __name__ == "__main__":
    main()
