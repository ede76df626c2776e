"""The shared-memory (view mode) transport beyond the small-sample table of `run.py`, in one run,
written to bench/SHM_RESULTS.md:

1. **large samples**: ~1 MiB samples (video clips, token blocks), one shuffled epoch on a warm
   daemon, the consumer touching every sample as in `run.py`; MB/s against `cat` of the same
   shards to /dev/null (hot page cache) measured in the same run;
2. **8 consumers at once**: 8 ranks of one job (8 processes, `world_size=8`) on one warm daemon
   over the small-sample dataset of `run.py`: aggregate samples/s and MB/s, the daemon's CPU per
   GB delivered, every sample exactly once across the 8;
3. **packed mode**: fixed-size 4 KiB records (token blocks) with `collate="stack"`: the daemon
   gathers each batch into a ring slot, the consumer gets one (batch, 4096) array per batch and
   touches one byte per page of it; GB/s against this machine's memcpy bandwidth measured in the
   same run;
4. **packed mode through DataLoader workers**: the same records through
   `shardstream.torch.DataLoader` with `TORCH_WORKERS` workers, each worker copying the batch out of
   the ring into memory it reuses (`reuse_batch_memory`, the default) or into torch's new segment
   per batch (`reuse_batch_memory=False`), alternating, each epoch in a fresh interpreter; the
   process tree's CPU per epoch.

Both use a daemon that has served the dataset once already (index resident, shards verified), as
the node's daemon has; see bench/README.md."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import consumer  # noqa: E402
import daemon  # noqa: E402
import gen  # noqa: E402
import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH = 256
LARGE_BATCH = 16
# Packed epochs measured (each ~0.1 s; the ratio is the best of them against the best memcpy).
PACKED_REPEATS = 5
TORCH_WORKERS = 2
TORCH_REPEATS = 3


def tar_dataset(d: Path, samples: int, size: int, per_shard: int, ext: str, label: bool) -> list[Path]:
    """`samples` random payloads of `size` bytes (field `ext`), each starting with its index
    (8 bytes LE), plus a label field `cls` when `label`, in shards of `per_shard` samples;
    generated once."""
    done = d / ".complete"
    if not done.exists():
        d.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        block = rng.integers(0, 256, size + 4096, dtype=np.uint8).tobytes()
        for s in range(0, samples, per_shard):
            with tarfile.open(d / f"{ext}-{s // per_shard:06d}.tar", "w") as tf:
                for i in range(s, min(s + per_shard, samples)):
                    off = (i * 61) % 4096
                    members = [(ext, i.to_bytes(8, "little") + block[off : off + size - 8])]
                    if label:
                        members.append(("cls", str(i % 10).encode()))
                    for name, data in members:
                        info = tarfile.TarInfo(f"{i:08d}.{name}")
                        info.size = len(data)
                        tf.addfile(info, BytesIO(data))
        done.write_text("")
    return sorted(d.glob("*.tar"))


def epoch(addr: str, url: str, field: str, batch: int, id_offset: int, rank: int = 0, world: int = 1) -> dict:
    """One shuffled epoch of `field` through the common consumer (bench/consumer.py)."""
    import shardstream

    t0 = time.perf_counter()
    loader = shardstream.Loader(url, batch_size=batch, seed=0, connect=addr, rank=rank, world_size=world)
    r = consumer.consume((b[field] for b in loader), t0, id_offset)
    r["transport"] = loader.stats().get("transport")
    return r


def packed_epoch(addr: str, url: str, batch: int, cache: str = "copy") -> dict:
    """One shuffled epoch with collate="stack": per batch, one byte per page of the array, its
    size, and the index in each record."""
    import shardstream

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    loader = shardstream.Loader(
        url, batch_size=batch, seed=0, fields=["tok"], collate="stack", connect=addr, cache=cache
    )
    n = nbytes = touched = 0
    ids: list[np.ndarray] = []
    for b in loader:
        a = b["tok"]
        touched += int(a[:, ::4096].sum())
        nbytes += a.nbytes
        ids.append(a[:, :8].copy().view(np.uint64)[:, 0])
        n += a.shape[0]
    seconds = time.perf_counter() - t0
    stats = loader.stats()
    all_ids = np.concatenate(ids).tolist() if ids else []
    return {
        "samples": n,
        "bytes": nbytes,
        "seconds": seconds,
        "client_cpu": time.process_time() - cpu0,
        "ids": all_ids,
        "transport": stats["transport"] + (" packed" if stats["packed"] else ""),
    }


def torch_packed_main(addr: str, url: str, batch: int, workers: int, reuse: bool) -> None:
    """One packed epoch through shardstream.torch.DataLoader (run as a subprocess, so that its
    workers' CPU is its own children's): prints one JSON line."""
    import resource

    import torch

    import shardstream.torch as sst

    torch.set_num_threads(1)  # as bench/decode_peers.py: no spinning intra-op pool in the trainer
    ds = sst.IterableDataset(url, batch_size=batch, seed=0, fields=["tok"], collate="stack", connect=addr, cache="copy")
    dl = sst.DataLoader(ds, num_workers=workers, reuse_batch_memory=reuse)
    before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    t0 = time.perf_counter()
    n = touched = 0
    ids: list[int] = []
    for b in dl:
        t = b["tok"]
        touched += int(t[:, ::4096].sum())
        ids += t[:, :8].contiguous().view(torch.int64)[:, 0].tolist()
        n += t.shape[0]
    seconds = time.perf_counter() - t0
    after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime for a, b in zip(after, before, strict=True))
    print(json.dumps({"samples": n, "seconds": seconds, "cpu": cpu, "ids": ids, "counts": dl.batch_memory_counts()}))


def torch_packed(addr: str, url: str, batch: int, records: int) -> dict[str, dict[str, Any]]:
    """TORCH_REPEATS epochs each with the batch memory reused and with new memory, alternating."""
    runs: dict[str, list[dict[str, Any]]] = {"reused": [], "new": []}
    for _ in range(TORCH_REPEATS):
        for name in runs:
            cmd = [sys.executable, __file__, "--torch-packed", addr, url, str(batch), str(TORCH_WORKERS), name]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["check"] = consumer.verdict(run.pop("ids"), records)
            runs[name].append(run)
    out = {}
    for name, rs in runs.items():
        rate = [r["samples"] / r["seconds"] for r in rs]
        out[name] = {
            "rate": statistics.median(rate),
            "rates": rate,
            "cpu": statistics.median(r["cpu"] for r in rs),
            "check": "; ".join(sorted({r["check"] for r in rs})),
            "counts": rs[-1]["counts"],
        }
    return out


def rank_main(addr: str, url: str, rank: int, world: int, out: Path) -> None:
    """One of the concurrent ranks (run as a subprocess), started together by a barrier file."""
    import shardstream  # noqa: F401 - imported before the clock, as in run.py

    out.with_suffix(".ready").write_text("")
    go = out.with_name("go")
    while not go.exists():
        time.sleep(0.001)
    r = epoch(addr, url, "jpg", BATCH, gen.ID_OFFSET, rank, world)
    r["end"] = time.time()
    out.write_text(json.dumps(r))


def concurrent(addr: str, url: str, world: int, scratch: Path, daemon_pid: int) -> dict[str, Any]:
    scratch.mkdir(parents=True, exist_ok=True)
    outs = [scratch / f"rank{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world), addr, url, str(o)])
        for r, o in enumerate(outs)
    ]
    # Every rank has imported its libraries and waits, so the clock covers only the epoch.
    while not all(o.with_suffix(".ready").exists() for o in outs):
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a rank exited before the start")
        time.sleep(0.01)
    cpu0 = measure.cpu_seconds(daemon_pid) or 0.0
    start = time.time()
    (scratch / "go").write_text("")
    for p in procs:
        p.wait()
    daemon_cpu = (measure.cpu_seconds(daemon_pid) or 0.0) - cpu0
    results = [json.loads(o.read_text()) for o in outs]
    seconds = max(r["end"] for r in results) - start
    ids = [i for r in results for i in r["ids"]]
    return {
        "world": world,
        "samples": sum(r["samples"] for r in results),
        "bytes": sum(r["bytes"] for r in results),
        "seconds": seconds,
        "daemon_cpu": daemon_cpu,
        "ids": ids,
        "transports": sorted({r["transport"] for r in results}),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank, world = int(sys.argv[2]), int(sys.argv[4])
        rank_main(sys.argv[5], sys.argv[6], rank, world, Path(sys.argv[7]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-packed":
        addr, url, batch, workers, reuse = sys.argv[2:7]
        torch_packed_main(addr, url, int(batch), int(workers), reuse == "reused")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=100_000, help="small-sample dataset (as run.py)")
    ap.add_argument("--large", type=int, default=2048, help="large samples")
    ap.add_argument("--large-size", type=int, default=1 << 20)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--packed", type=int, default=131072, help="4 KiB records for packed mode")
    ap.add_argument("--packed-batch", type=int, default=512)
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/SHM_RESULTS.md")
    args = ap.parse_args()

    spec = gen.Spec(samples=args.samples)
    small = gen.ensure(args.data, spec, ["wds"]) / "wds"
    large_files = tar_dataset(
        args.data / f"large-{args.large}x{args.large_size}", args.large, args.large_size, 64, "bin", label=True
    )
    large_url = str(large_files[0].parent)
    packed_files = tar_dataset(args.data / f"packed-{args.packed}x4096", args.packed, 4096, 4096, "tok", label=False)
    packed_url = str(packed_files[0].parent)
    measure.warm(packed_files)
    memcpy = measure.memcpy_gbps()
    measure.warm(large_files)
    measure.warm(sorted(small.glob("*.tar")))
    cat = measure.cat_gbps(large_files)
    load_before = os.getloadavg()

    with tempfile.TemporaryDirectory(prefix="shm-bench-") as tmp:
        srv = daemon.Daemon.start(Path(tmp))
        try:
            epoch(srv.addr, large_url, "bin", LARGE_BATCH, 0)  # warm-up: index and verify once
            large = epoch(srv.addr, large_url, "bin", LARGE_BATCH, 0)
            large["check"] = consumer.verdict(large.pop("ids"), args.large)
            print(f"large: {large['bytes'] / 1e9 / large['seconds']:.2f} GB/s, cat {cat:.2f} GB/s", flush=True)
            packed_epoch(srv.addr, packed_url, args.packed_batch)  # warm-up
            # Best of PACKED_REPEATS epochs, as the memcpy it is quoted against (each epoch is
            # checked); the median is shown too. One process, as a trainer's epochs.
            runs = []
            for _ in range(PACKED_REPEATS):
                cpu0 = measure.cpu_seconds(srv.pid) or 0.0
                run = packed_epoch(srv.addr, packed_url, args.packed_batch)
                run["daemon_cpu"] = (measure.cpu_seconds(srv.pid) or 0.0) - cpu0
                run["check"] = consumer.verdict(run.pop("ids"), args.packed)
                runs.append(run)
            packed = min(runs, key=lambda r: r["seconds"])
            packed["check"] = "; ".join(sorted({r["check"] for r in runs}))
            packed["all_gbps"] = [r["bytes"] / 1e9 / r["seconds"] for r in runs]
            packed["median_gbps"] = statistics.median(packed["all_gbps"])
            print(f"packed: {packed['bytes'] / 1e9 / packed['seconds']:.2f} GB/s, memcpy {memcpy:.2f} GB/s", flush=True)
            in_workers = torch_packed(srv.addr, packed_url, args.packed_batch, args.packed)
            print(
                f"packed, {TORCH_WORKERS} DataLoader workers: reused {in_workers['reused']['rate']:,.0f}, "
                f"new {in_workers['new']['rate']:,.0f} records/s",
                flush=True,
            )
            epoch(srv.addr, str(small), "jpg", BATCH, gen.ID_OFFSET)
            many = concurrent(srv.addr, str(small), args.world, Path(tmp) / "ranks", srv.pid)
            many["check"] = consumer.verdict(many.pop("ids"), args.samples)
            print(f"{args.world} ranks: {many['samples'] / many['seconds']:,.0f} samples/s", flush=True)
        finally:
            srv.stop()

    gb = many["bytes"] / 1e9
    pgbs = packed["bytes"] / 1e9 / packed["seconds"]
    lines = [
        "# Shared-memory transport: large samples, 8 consumers, packed mode",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `python bench/shm_bench.py`"
        " (part of `make bench`).",
        "",
        f"- Machine: {os.cpu_count()} CPUs; load average before {' '.join(f'{x:.2f}' for x in load_before)},"
        f" after {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "- Daemon: warm (it served each dataset once before the measured epoch). Consumer: per sample"
        " `np.frombuffer(v, np.uint8)[::4096].sum()`, its length and the index written in it"
        " (every sample checked exactly once).",
        "",
        "| measurement | value | ratio |",
        "|---|---|---|",
        f"| `cat` of the large-sample shards to /dev/null (hot page cache, best of 3) | {cat:.2f} GB/s | 1.00 |",
        f"| view mode, {args.large:,} samples of {args.large_size / 2**20:.0f} MiB, batch {LARGE_BATCH}"
        f" ({large['transport']}; {large['check']}) | {large['bytes'] / 1e9 / large['seconds']:.2f} GB/s,"
        f" {large['samples'] / large['seconds']:,.0f} samples/s |"
        f" {large['bytes'] / 1e9 / large['seconds'] / cat:.2f} of `cat` |",
        f"| {many['world']} ranks at once, {args.samples:,} samples of 16-20 KiB"
        f" ({', '.join(map(str, many['transports']))}; {many['check']}) |"
        f" {many['samples'] / many['seconds']:,.0f} samples/s, {gb / many['seconds']:.2f} GB/s in all | |",
        f"| daemon CPU for those {many['world']} ranks | {many['daemon_cpu']:.2f} s,"
        f" {many['daemon_cpu'] / gb:.2f} CPU-s per GB delivered | |",
        f"| memcpy of 1 GiB (np.copyto, best of 3) | {memcpy:.2f} GB/s | 1.00 |",
        f"| packed mode, {args.packed:,} records of 4 KiB, batch {args.packed_batch}, best of"
        f" {len(packed['all_gbps'])} epochs ({', '.join(f'{g:.2f}' for g in packed['all_gbps'])} GB/s)"
        f" ({packed['transport']}; {packed['check']}) | {pgbs:.2f} GB/s,"
        f" {packed['samples'] / packed['seconds']:,.0f} records/s; median {packed['median_gbps']:.2f} GB/s |"
        f" {pgbs / memcpy:.2f} of memcpy (median {packed['median_gbps'] / memcpy:.2f}) |",
        f"| CPU for that best packed epoch | daemon {packed['daemon_cpu']:.2f} s,"
        f" client {packed['client_cpu']:.2f} s | |",
    ]
    # Records of 4 KiB: the median packed epoch without workers, in records/s.
    packed_rate = packed["median_gbps"] * 1e9 / 4096
    for name, label in (("reused", "batch memory reused (default)"), ("new", "`reuse_batch_memory=False`")):
        r = in_workers[name]
        lines.append(
            f"| packed mode through `shardstream.torch.DataLoader`, {TORCH_WORKERS} workers, {label};"
            f" median of {TORCH_REPEATS} epochs ({', '.join(f'{x:,.0f}' for x in r['rates'])}), each in a"
            f" fresh interpreter ({r['check']}; slots {r['counts']}) | {r['rate']:,.0f} records/s,"
            f" {r['cpu']:.2f} CPU-s of the trainer and its workers |"
            f" {r['rate'] / packed_rate:.2f} of packed mode without workers (median) |"
        )
    lines.append(
        f"| reused against new memory, {TORCH_WORKERS} workers | "
        f"{in_workers['reused']['rate'] / in_workers['new']['rate']:.2f}x the records/s, "
        f"{in_workers['reused']['cpu'] / in_workers['new']['cpu']:.2f}x the CPU | |"
    )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text + earlier_runs(args.out))


def earlier_runs(out: Path) -> str:
    """The runs `out` already holds, as its "Earlier runs" section: the last run (its title
    dropped, its notes kept) first, then the runs that section held. Notes written under a run
    by hand stay with it."""
    if not out.exists():
        return ""
    last, _, before = out.read_text().partition("\n## Earlier runs\n")
    last = last.split("\n", 1)[1].strip("\n") if "\n" in last else last
    when = re.search(r"Measured (\S+ \S+ UTC)", last)
    return f"\n## Earlier runs\n\n### Run of {when.group(1) if when else 'an unknown date'}\n\n{last}\n{before}"


if __name__ == "__main__":
    main()
