"""What a shared-memory client holds of the shards its stream has used: the figures behind the
SHARD_FORGET changes (README, "Transports" and "Clairvoyant"; bench/PROFILES.md section 4). Not
part of `make bench`.

- `evicted`: one epoch of run.py's dataset (40 shards, 0.89 GB) with `cache="copy"` through a
  node cache of `--cache-size` (400 MiB: the daemon evicts during the epoch). Every 10 batches
  the client's /proc/self/maps is read: node-cache copies still mapped, and of those the ones
  the daemon has unlinked (evicted, their disk space still taken). Also the page tables
  (`VmPTE`) at the end of the epoch.
- `fds`: one epoch of `--shards` shards of 2 tiny samples each, in a process whose open-file
  soft limit is `--nofile`: whether it completes, or the error it ends with.

    python bench/held_shards.py
    python bench/held_shards.py --variant before=SITE   # another build, in the same run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import daemon  # noqa: E402
import gen  # noqa: E402

EVICTED_CHILD = """
import json, sys, shardstream
def held():
    with open("/proc/self/maps") as f:
        paths = {l.split(maxsplit=5)[-1].strip() for l in f if "/cache/shards/" in l}
    return len(paths), sum(p.endswith("(deleted)") for p in paths)
peak = [0, 0]
loader = shardstream.Loader(sys.argv[1], batch_size=256, seed=0, cache="copy", connect=sys.argv[2])
n = 0
for i, b in enumerate(loader):
    n += len(b["__key__"])
    del b
    if i % 10 == 0:
        peak = [max(a, b) for a, b in zip(peak, held())]
pte = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmPTE"))
print(json.dumps({"samples": n, "peak_mapped": peak[0], "peak_evicted_mapped": peak[1], "vm_pte_kib": pte}))
"""

FDS_CHILD = """
import json, resource, sys, shardstream
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
n = 0
try:
    for b in shardstream.Loader(sys.argv[1], batch_size=32, seed=0, connect=sys.argv[2]):
        n += len(b["__key__"])
    print(json.dumps({"samples": n, "error": None}))
except Exception as e:
    print(json.dumps({"samples": n, "error": f"{type(e).__name__}: {e}"}))
"""


def tiny_shards(root: Path, shards: int) -> Path:
    """`shards` WebDataset shards of 2 samples of 100 bytes (written once)."""
    import webdataset as wds

    if len(list(root.glob("*.tar"))) != shards:
        root.mkdir(parents=True, exist_ok=True)
        with wds.ShardWriter(str(root / "tiny-%06d.tar"), maxcount=2, verbose=0) as sink:
            for i in range(2 * shards):
                sink.write({"__key__": f"{i:08d}", "bin": bytes(100)})
    return root


def child(code: str, args: list[str], site: str | None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=daemon.env_for(site), capture_output=True, text=True, timeout=600
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache-size", default="400MiB")
    ap.add_argument("--shards", type=int, default=1500)
    ap.add_argument("--nofile", type=int, default=1024)
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parent / "data")
    ap.add_argument("--variant", action="append", default=[], type=daemon.variant, help="NAME=SITE")
    args = ap.parse_args()
    wds_dir = gen.ensure(args.data, gen.Spec(samples=40_000), ["wds"]) / "wds"
    tiny = tiny_shards(args.data / f"tiny-{args.shards}", args.shards)
    print("| build | evicted: samples, peak copies mapped, of them evicted, VmPTE KiB | fds: samples, error |")
    print("|---|---|---|")
    for name, site in [("this", None), *args.variant]:
        with tempfile.TemporaryDirectory(prefix="held-shards-") as tmp:
            env = {"SHARDSTREAM_CACHE_SIZE": args.cache_size}
            srv = daemon.Daemon.start(Path(tmp), env=env, site=site)
            try:
                ev = child(EVICTED_CHILD, [str(wds_dir), srv.addr], site)
                fd = child(FDS_CHILD, [str(tiny), srv.addr, str(args.nofile)], site)
            finally:
                srv.stop()
        evicted = (
            f"{ev['samples']}, {ev['peak_mapped']}, {ev['peak_evicted_mapped']}, {ev['vm_pte_kib']}"
            if "samples" in ev
            else ev["error"]
        )
        print(f"| {name} | {evicted} | {fd.get('samples', '-')}, {fd['error'] or 'none'} |", flush=True)
    print(f"\ncache {args.cache_size}; {args.shards} tiny shards under an open-file limit of {args.nofile}")


if __name__ == "__main__":
    os.environ.setdefault("SHARDSTREAM_LOG", "warn")
    main()
