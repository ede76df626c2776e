"""What an rdma stream pays before its bytes flow, written to bench/RDMA_SETUP.md (the figures
bench/INLINE.md and the README quote):

1. **libfabric's start-up** in a fresh process: `dlopen("libfabric.so.1")`, the first
   `fi_getinfo`, and a `fi_getinfo` in a child forked after it (what a DataLoader worker forked
   from a process that built a `Loader(transport="rdma")` pays);
2. **per-stream set-up** with libfabric's rxm defaults and with `FI_OFI_RXM_BUFFER_SIZE=4096` on
   both ends: three rdma streams of the small inline dataset per fresh process, the first batch
   and the rest of the 2nd and 3rd (the 1st also pays the start-up);
3. **a torch DataLoader with 2 workers** over rdma, three epochs (workers started afresh each
   epoch): first batch and epoch time, for this build and any `--variant NAME=SITE`.

Rounds alternate the order of what they compare; medians over rounds (min-max)."""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inline_bench  # noqa: E402
import report  # noqa: E402
import shm_bench  # noqa: E402
from daemon import variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RXM_BUFFER = "FI_OFI_RXM_BUFFER_SIZE"
STREAMS = 3
EPOCHS = 3


def child_startup() -> dict[str, float]:
    """libfabric's start-up in this (fresh) process, and fi_getinfo in a child forked after it."""
    t0 = time.perf_counter()
    lib = ctypes.CDLL(os.environ.get("SHARDSTREAM_LIBFABRIC", "libfabric.so.1"))
    t1 = time.perf_counter()
    version = ctypes.c_uint32((1 << 16) | 17)

    def getinfo() -> float:
        info = ctypes.c_void_p()
        t = time.perf_counter()
        rc = lib.fi_getinfo(version, None, None, ctypes.c_uint64(0), None, ctypes.byref(info))
        took = time.perf_counter() - t
        if rc != 0:
            raise RuntimeError(f"fi_getinfo returned {rc}")
        lib.fi_freeinfo(info)
        return took

    first = getinfo()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, json.dumps(getinfo()).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    forked = json.loads(os.read(r, 100))
    return {"dlopen": t1 - t0, "first_getinfo": first, "forked_getinfo": forked}


def child_streams(addr: str, url: str) -> list[list[float]]:
    """STREAMS rdma streams in this process: [first batch s, rest s] of each."""
    import shardstream

    out = []
    for i in range(STREAMS):
        t0 = time.perf_counter()
        it = iter(shardstream.Loader(url, batch_size=inline_bench.SMALL_BATCH, seed=i, connect=addr, transport="rdma"))
        next(it)
        t1 = time.perf_counter()
        for _ in it:
            pass
        out.append([t1 - t0, time.perf_counter() - t1])
    return out


def child_dataloader(addr: str, url: str) -> list[list[float]]:
    """EPOCHS epochs of a DataLoader with 2 workers over rdma: [first batch s, epoch s] of each."""
    import torch.utils.data

    import shardstream.torch as sst

    ds = sst.IterableDataset(
        url,
        batch_size=inline_bench.SMALL_BATCH,
        connect=addr,
        transport="rdma",
        batch_transform=lambda b: len(b["jpg"]),
    )
    out = []
    for ep in range(EPOCHS):
        ds.set_epoch(ep)
        t0 = time.perf_counter()
        first = None
        for _ in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2):
            first = first if first is not None else time.perf_counter() - t0
        out.append([first or 0.0, time.perf_counter() - t0])
    return out


def run_child(env: dict[str, str], *args: str) -> Any:
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        what, rest = sys.argv[2], sys.argv[3:]
        fn = {"startup": child_startup, "streams": child_streams, "dataloader": child_dataloader}[what]
        print(json.dumps(fn(*rest)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=30_000, help="~18 KiB samples")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument(
        "--variant", action="append", default=[], type=variant, help="NAME=SITE: another build, DataLoader rows"
    )
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/RDMA_SETUP.md")
    args = ap.parse_args()
    if why := inline_bench.rdma_unavailable():
        # As inline_bench's rdma rows: skipped with the reason, not failing the rest of the bench.
        args.out.write_text(f"# rdma: what a stream pays before its bytes flow\n\nNot measured: {why}.\n")
        print(f"rdma_setup skipped: {why}")
        return
    files = shm_bench.tar_dataset(args.data / f"inline-small-{args.samples}", args.samples, 18 << 10, 1000, "jpg", True)
    url = str(files[0].parent)
    base = {k: v for k, v in os.environ.items() if k != RXM_BUFFER}
    startup: list[dict[str, float]] = []
    streams: dict[str, list[list[float]]] = {"rxm default": [], "rxm 4 KiB both ends": []}
    loaders: dict[str, list[list[float]]] = {"this build": []}
    with tempfile.TemporaryDirectory(prefix="rdma-setup-") as tmp:
        daemons: dict[str, inline_bench.TcpDaemon] = {}
        try:
            for i, (name, buf) in enumerate((("rxm default", None), ("rxm 4 KiB both ends", "4096"))):
                os.environ.pop(RXM_BUFFER, None)
                if buf:
                    os.environ[RXM_BUFFER] = buf
                work = Path(tmp) / f"s{i}"
                work.mkdir()
                daemons[name] = inline_bench.TcpDaemon(None, work, rdma=True)
            os.environ.clear()
            os.environ.update(base)
            builds = {"this build": None, **dict(args.variant)}
            for i, (name, site) in enumerate(builds.items()):
                loaders[name] = []
                work = Path(tmp) / f"b{i}"
                work.mkdir()
                daemons[f"build {name}"] = inline_bench.TcpDaemon(site, work, rdma=True)
            for d in daemons.values():
                run_child(d.env, "streams", d.addr, url)  # warm-up: index and verify once
            for rnd in range(args.rounds):
                startup.append(run_child(base, "startup"))
                order = list(streams) if rnd % 2 == 0 else list(streams)[::-1]
                for name in order:
                    d = daemons[name]
                    streams[name] += run_child(d.env, "streams", d.addr, url)[1:]
                order = list(loaders) if rnd % 2 == 0 else list(loaders)[::-1]
                for name in order:
                    d = daemons[f"build {name}"]
                    loaders[name] += run_child(d.env, "dataloader", d.addr, url)
                print(f"round {rnd + 1} done", flush=True)
        finally:
            for d in daemons.values():
                d.stop()

    def ms(values: list[float]) -> str:
        return report.spread([v * 1e3 for v in values], ".0f")

    lines = [
        "# rdma: what a stream pays before its bytes flow",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `python bench/rdma_setup.py`:"
        f" {args.rounds} rounds, median (min-max), milliseconds. libfabric's tcp provider on loopback;"
        f" {args.samples:,} samples of 18 KiB, batch {inline_bench.SMALL_BATCH}.",
        "",
        "## libfabric's start-up in a fresh process",
        "",
        "| dlopen | first fi_getinfo | fi_getinfo in a child forked after it |",
        "|---|---|---|",
        f"| {ms([s['dlopen'] for s in startup])} | {ms([s['first_getinfo'] for s in startup])}"
        f" | {ms([s['forked_getinfo'] for s in startup])} |",
        "",
        "## Per-stream set-up (the 2nd and later streams of a process)",
        "",
        "| rxm buffers | first batch | rest of the stream | samples/s of the stream |",
        "|---|---|---|---|",
    ]
    for name, runs in streams.items():
        rates = [args.samples / (a + b) for a, b in runs]
        lines.append(
            f"| {name} | {ms([a for a, _ in runs])} | {ms([b for _, b in runs])} | {report.spread(rates, ',.0f')} |"
        )
    lines += [
        "",
        f"## torch DataLoader, 2 workers, over rdma ({EPOCHS} epochs per process, workers started afresh)",
        "",
        "| build | first batch of an epoch | epoch |",
        "|---|---|---|",
    ]
    for name, runs in loaders.items():
        lines.append(f"| {name} | {ms([a for a, _ in runs])} | {ms([b for _, b in runs])} |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
