"""Where a remote stream's time goes, per transport: several epochs of the small inline dataset
(30,000 samples of ~18 KiB, batch 256; or a Parquet set's rows as Arrow record batches,
`--parquet DIR`) streamed one after the other in one consumer process
against one warm daemon on tcp://127.0.0.1, so the first stream (which pays loading libfabric, for
rdma) and the later ones (each still opening its own endpoint and ring) are told apart, and each
stream's first batch from the rest. Not part of `make bench` (inline_bench.py is): the loop behind
bench/RDMA_E2E.md's figures on set-up against steady state.

    python bench/stream_setup.py --rounds 3 --streams 4
    python bench/stream_setup.py --parquet bench/data/parquet/tab-1000000 --rounds 3

Prints, per transport and stream position (1st, later), the median over rounds and later streams
of: seconds for the epoch, seconds to its first batch, and the rest (epoch minus first batch)
as samples/s; every epoch is checked exactly once."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import consumer  # noqa: E402
import inline_bench  # noqa: E402
import shm_bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def arrow_epoch(loader: Any, t0: float) -> dict[str, Any]:
    """An Arrow (Parquet) epoch: record batches as they come, rows counted, each row id kept."""
    ttfb = None
    ids: list[int] = []
    for rb in loader:
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        ids.extend(rb.column("__row__").to_pylist())
    return {"samples": len(ids), "ids": ids, "ttfb": ttfb, "seconds": time.perf_counter() - t0}


def child(addr: str, url: str, transport: str, streams: int, expected: int, batch: int, form: str) -> None:
    """`streams` epochs in this process; prints one JSON line per epoch."""
    import torch.distributed  # noqa: F401 - imported before any clock, as inline_bench.py does

    import shardstream

    for i in range(streams):
        t0 = time.perf_counter()
        arrow = form == "arrow"
        loader = shardstream.Loader(
            url, batch_size=batch, seed=i, connect=addr, transport=transport, format="arrow" if arrow else "dict"
        )
        r = arrow_epoch(loader, t0) if arrow else consumer.consume((b[form] for b in loader), t0, 0)
        check = consumer.verdict(r.pop("ids"), expected)
        out = {"seconds": r["seconds"], "ttfb": r["ttfb"], "samples": r["samples"], "check": check}
        print(json.dumps({**out, "bytes": r.get("bytes", 0)}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        addr, url, transport, streams, expected, batch, form = sys.argv[2:9]
        child(addr, url, transport, int(streams), int(expected), int(batch), form)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=30_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=4, help="epochs per consumer process")
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data")
    ap.add_argument(
        "--parquet", type=Path, help="a Parquet dataset directory instead (parquet_bench.py's image or tab sets)"
    )
    ap.add_argument(
        "--large",
        type=int,
        help="that many 1 MiB samples instead (inline_bench.py's large set, batch 16), in GB/s against"
        " an iperf3 floor measured in each round",
    )
    ap.add_argument("--batch", type=int)
    args = ap.parse_args()
    field = "jpg"
    if args.parquet:
        import pyarrow.parquet as pq

        url, field = str(args.parquet), "arrow"
        args.samples = sum(pq.ParquetFile(f).metadata.num_rows for f in sorted(args.parquet.glob("*.parquet")))
    elif args.large:
        files = shm_bench.tar_dataset(args.data / f"inline-large-{args.large}", args.large, 1 << 20, 64, "bin", True)
        url, field, args.samples = str(files[0].parent), "bin", args.large
    else:
        files = shm_bench.tar_dataset(
            args.data / f"inline-small-{args.samples}", args.samples, 18 << 10, 1000, "jpg", True
        )
        url = str(files[0].parent)
    if args.batch is None:
        args.batch = inline_bench.LARGE_BATCH if args.large else inline_bench.SMALL_BATCH
    floors: list[float] = []
    results: dict[str, dict[str, list[dict]]] = {t: {"first": [], "later": []} for t in ("inline", "rdma")}
    with tempfile.TemporaryDirectory() as td:
        d = inline_bench.TcpDaemon(None, Path(td), rdma=True)
        try:
            for _ in range(args.rounds):
                if args.large:
                    floors.append(inline_bench.iperf3_gbps()[0])
                for transport in results:
                    cmd = [sys.executable, __file__, "--child", d.addr, url, transport, str(args.streams)]
                    cmd += [str(args.samples), str(args.batch), field]
                    out = subprocess.run(cmd, env=d.env, capture_output=True, text=True)
                    if out.returncode != 0:
                        raise RuntimeError(f"{transport} consumer failed: {out.stderr[-2000:]}")
                    epochs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
                    results[transport]["first"].append(epochs[0])
                    results[transport]["later"].extend(epochs[1:])
        finally:
            d.stop()
    if floors:
        floor = statistics.median(floors)
        print(f"TCP floor (iperf3, 1 stream, -l 1M): {floor:.2f} GB/s ({min(floors):.2f}-{max(floors):.2f})")
        print()
    head = "| transport | stream | epoch s | first batch s | samples/s after the first batch |"
    rule = "|---|---|---|---|---|"
    if floors:
        head += " GB/s after the first batch | x TCP floor |"
        rule += "---|---|"
    print(head + " check |")
    print(rule + "---|")
    for transport, by in results.items():
        for which, epochs in by.items():
            seconds = statistics.median(e["seconds"] for e in epochs)
            ttfb = statistics.median(e["ttfb"] for e in epochs)
            # The first batch's samples leave the count with its time.
            rate = statistics.median((e["samples"] - args.batch) / max(e["seconds"] - e["ttfb"], 1e-9) for e in epochs)
            row = f"| {transport} | {which} ({len(epochs)}) | {seconds:.3f} | {ttfb:.3f} | {rate:,.0f} |"
            if floors:
                # Likewise its bytes: the batches are of equal size.
                gbps = statistics.median(
                    e["bytes"] * (1 - args.batch / e["samples"]) / max(e["seconds"] - e["ttfb"], 1e-9) / 1e9
                    for e in epochs
                )
                row += f" {gbps:.2f} | {gbps / floor:.2f} |"
            checks = {e["check"] for e in epochs}
            print(f"{row} {', '.join(sorted(checks))} |")


if __name__ == "__main__":
    main()
