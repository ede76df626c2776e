"""A/B of the shared-memory read paths between two builds of the Python package, alternated on
one warm daemon: `Loader(collate="stack")` (numpy) and `shardstream.torch.DataLoader` without
workers, 65,536 records of 4 KiB in batches of 512, one byte a page touched; and `views`, the same
records as a plain `Loader` gives them (a memoryview per field of every sample, the view mode of
small samples), one byte of each touched. Best of epochs 2-4 per run, and the run's minor faults.
Used for the copy-on-write ring (bench/SHM_RESULTS.md, modes loader,torch) and the field views'
slices (bench/SHM_RESULTS.md, mode views):

    maturin build --release -m loader-py/Cargo.toml -o /tmp/ab/new   # and the same at the old commit
    (cd /tmp/ab/new && mkdir pkg && cd pkg && python -m zipfile -e ../shardstream-*.whl .)
    cargo build --release -p shardstream --bin shardstream
    python bench/ring_ab.py --variant old=/tmp/ab/old/pkg --variant new=/tmp/ab/new/pkg --rounds 4

`--daemon-per-variant` runs each variant against a daemon of its own package (`shardstream serve`
from the wheel's native module) instead of one `--daemon` for all: for changes on both sides (the
checks of shards read in place, bench/SHM_RESULTS.md). Mode `inline` reads the `views` records
over gRPC (`transport="inline"`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
mode, addr, url = sys.argv[1:4]
import shardstream
if mode == "loader":
    it = shardstream.Loader(url, batch_size=512, seed=1, fields=["tok"], collate="stack", connect=addr)
    set_epoch = it.set_epoch
elif mode in ("views", "inline"):
    transport = "inline" if mode == "inline" else "auto"
    it = shardstream.Loader(url, batch_size=512, seed=1, connect=addr, transport=transport)
    set_epoch = it.set_epoch
else:
    import torch, shardstream.torch as sst
    torch.set_num_threads(1)
    ds = sst.IterableDataset(url, batch_size=512, seed=1, fields=["tok"], collate="stack", connect=addr)
    it, set_epoch = sst.DataLoader(ds, num_workers=0), ds.set_epoch
best = 0.0
for epoch in range(4):
    set_epoch(epoch)
    n, t0 = 0, time.perf_counter()
    for b in it:
        if mode in ("views", "inline"):
            n += sum(len(v) for v in b["tok"] if v[0] >= 0) + sum(len(v) for v in b["lbl"])
            continue
        a = b["tok"]
        a = a.numpy() if hasattr(a, "numpy") else a
        n += int(a[:, ::4096].sum() >= 0) * a.nbytes
    if epoch:
        best = max(best, n / (time.perf_counter() - t0) / 1e9)
print(json.dumps({"gbps": best, "minflt": resource.getrusage(resource.RUSAGE_SELF).ru_minflt}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, help="name=directory holding the package")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", default="loader,torch")
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data/ring-ab")
    ap.add_argument("--daemon", default=str(ROOT / "target/release/shardstream"))
    ap.add_argument("--daemon-per-variant", action="store_true", help="each variant's own package serves it")
    args = ap.parse_args()
    variants = dict(v.split("=", 1) for v in args.variant)
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import write_token_blocks

    if not args.data.exists():
        args.data.mkdir(parents=True)
        write_token_blocks(args.data, 65536, 4096, per_shard=4096, seed=1, label_mod=10)
    tmp = Path(tempfile.mkdtemp())

    def serve(name: str, env: dict[str, str] | None, command: list[str]) -> tuple[str, subprocess.Popen[bytes]]:
        addr = f"unix://{tmp}/{name}.sock"
        serve = ["serve", "--listen", addr, "--cache-dir", str(tmp / f"cache-{name}"), "--log", "warn"]
        return addr, subprocess.Popen([*command, *serve], env=env)

    cli = [sys.executable, "-c", "from shardstream._cli import main; main()"]
    if args.daemon_per_variant:
        daemons = {n: serve(n, dict(os.environ, PYTHONPATH=pkg), cli) for n, pkg in variants.items()}
    else:
        one = serve("all", None, [args.daemon])
        daemons = dict.fromkeys(variants, one)
    time.sleep(1.5)
    got: dict[tuple[str, str], list[tuple[float, int]]] = {}
    try:
        for rnd in range(args.rounds):
            for name, pkg in variants.items():
                addr = daemons[name][0]
                for mode in args.modes.split(","):
                    env = dict(os.environ, PYTHONPATH=pkg)
                    cmd = [sys.executable, "-c", CHILD, mode, addr, str(args.data)]
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
                    if out.returncode:
                        raise SystemExit(f"{name} {mode}: exit {out.returncode}\n{out.stderr[-2000:]}")
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    got.setdefault((name, mode), []).append((r["gbps"], r["minflt"]))
                    print(rnd, name, mode, f"{r['gbps']:.2f} GB/s", r["minflt"], "minor faults", flush=True)
    finally:
        for _, daemon in {id(d[1]): d for d in daemons.values()}.values():
            daemon.terminate()
            daemon.wait()
    print("load", os.getloadavg())
    for (name, mode), runs in sorted(got.items()):
        gbps = [g for g, _ in runs]
        print(f"{name} {mode}: median {statistics.median(gbps):.2f} GB/s ({min(gbps):.2f}-{max(gbps):.2f})")


if __name__ == "__main__":
    main()
