"""The inline transport (sample bytes inside the gRPC messages, what a trainer on another host
gets) over loopback TCP, against a TCP bulk-transfer floor measured in the same run, written to
bench/INLINE_RESULTS.md:

1. **small samples**: ~18 KiB samples (16-20 KiB payload + a label), batch 256: samples/s;
2. **large samples**: 1 MiB samples, batch 16: MB/s, and its ratio to the TCP floor;
3. **TCP floor**: `iperf3`, one stream, `-l 1M`, over the same loopback interface (a Python socket
   pair when iperf3 is not installed);
4. **CPU per GB** delivered, on the daemon (its /proc/<pid>/stat delta) and the client (the
   consumer process's own getrusage, its tokio threads included);
5. **small samples through a torch DataLoader with 2 workers**, 2 epochs per process (workers
   started afresh each epoch, the DataLoader's default; the consumer runs in the workers on the
   views): what a trainer runs, where each worker opens its own stream every epoch.

Each dataset is measured over `transport="inline"` and, where the build has `serve --rdma` and
libfabric loads, over `transport="rdma"` with libfabric's tcp provider (the daemon RDMA-writes
each batch into the ring the client registered), from the same daemon in the same rounds.

Every round runs each measurement once, interleaved (so load from other work on the machine hits
all of them alike), each round starting at another row (so no row is always the one after
iperf3); the table gives the median over rounds with the min-max spread, and ratios are
medians of per-round ratios. Each epoch runs in a fresh consumer process against a warm daemon
listening on tcp://127.0.0.1 (one untimed epoch of each dataset first). Every epoch is checked:
each sample exactly once.

`--variant NAME=SITE` adds another build of the package (a directory where its wheel was installed
with `pip install --target`), measured in the same rounds: how a before/after comparison of two
builds is made in one run (bench/INLINE.md)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import consumer  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402
import shm_bench  # noqa: E402
from daemon import CLI, env_for, variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL_BATCH = 256
LARGE_BATCH = 16
READY_TIMEOUT_S = 60.0
IPERF_SECONDS = 3
# rdma: libfabric's tcp provider on both ends; ring slots that hold a large-sample batch (the
# daemon wants a batch to fill at most half a slot).
# The trainer's case: a torch DataLoader whose workers each open a stream, started afresh every
# epoch (persistent_workers=False, the DataLoader's default), WORKER_EPOCHS epochs per process.
DATALOADER_WORKERS = 2
WORKER_EPOCHS = 2
WORKERS_ROW = f"small, {DATALOADER_WORKERS} workers x {WORKER_EPOCHS} epochs"
RDMA_ENV = {"SHARDSTREAM_FI_PROVIDER": "tcp", "SHARDSTREAM_RDMA_SLOT_BYTES": str(48 << 20)}


def rdma_unavailable() -> str | None:
    """Why the rdma rows cannot run here, or None."""
    import ctypes

    try:
        ctypes.CDLL(os.environ.get("SHARDSTREAM_LIBFABRIC", "libfabric.so.1"))
    except OSError as e:
        return f"libfabric.so.1 does not load ({e}): bash scripts/libfabric.sh"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpDaemon:
    """`shardstream serve` of one build on a loopback TCP port, run through that build's own
    console entry point (the daemon lives in the native module)."""

    def __init__(self, site: str | None, workdir: Path, rdma: bool = False) -> None:
        self.env = {**env_for(site), **RDMA_ENV}
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        base = [sys.executable, "-c", CLI]
        help_text = subprocess.run([*base, "serve", "--help"], env=self.env, capture_output=True, text=True).stdout
        # Builds with the remote-endpoint security refuse plaintext TCP unless told.
        extra = ["--insecure"] if "--insecure" in help_text else []
        self.rdma = rdma and "--rdma" in help_text
        if self.rdma:
            extra += ["--rdma", "--rdma-provider", "tcp"]
        cmd = [*base, "serve", "--listen", self.addr, "--cache-dir", str(workdir / "cache"), *extra]
        self.log = workdir / "daemon.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        status = [*base, "status", "--connect", self.addr]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.log.read_text()[-500:]}")
            if subprocess.run(status, env=self.env, capture_output=True, check=False).returncode == 0:
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"daemon not ready within {READY_TIMEOUT_S:.0f} s")

    def cpu(self) -> float:
        return measure.cpu_seconds(self.proc.pid) or 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def child_main(addr: str, url: str, field: str, batch: int, transport: str, workers: int, expected: int) -> None:
    """One epoch (with DataLoader workers: WORKER_EPOCHS) in this (fresh) process; prints the
    result as JSON."""
    # Library imports are not timed (as in run.py): builds before fcb583d imported torch inside
    # Loader() to ask torch.distributed for the rank, 1.5-2 s that would swamp the transport.
    import torch.distributed  # noqa: F401

    import shardstream

    if workers:
        r = workers_epochs(addr, url, field, batch, transport, workers, expected)
        print(json.dumps(r))
        return
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    loader = shardstream.Loader(url, batch_size=batch, seed=0, connect=addr, transport=transport)
    r = consumer.consume((b[field] for b in loader), t0, 0)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    r["client_cpu"] = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    r["transport"] = loader.stats().get("transport")
    print(json.dumps(r))


def _consume_in_worker(batch: dict[str, Any], field: str) -> dict[str, Any]:
    """The common consumer, run in the DataLoader worker on the batch's zero-copy views: only its
    small result crosses to the trainer process."""
    return consumer.consume([batch[field]], None, 0)


def workers_epochs(
    addr: str, url: str, field: str, batch: int, transport: str, workers: int, expected: int
) -> dict[str, Any]:
    """WORKER_EPOCHS epochs through a torch DataLoader with `workers` workers, which the DataLoader
    starts afresh every epoch (persistent_workers=False, its default): what a trainer runs. The
    clock starts before the dataset is built. Each epoch's ids are offset by `expected`, so one
    check covers every epoch exactly once."""
    import torch.utils.data

    import shardstream.torch as sst

    ru0 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    t0 = time.perf_counter()
    ds = sst.IterableDataset(
        url,
        batch_size=batch,
        seed=0,
        connect=addr,
        transport=transport,
        batch_transform=functools.partial(_consume_in_worker, field=field),
    )
    out: dict[str, Any] = {"samples": 0, "bytes": 0, "ids": [], "ttfb": None}
    for ep in range(WORKER_EPOCHS):
        ds.set_epoch(ep)
        for r in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers):
            if out["ttfb"] is None:
                out["ttfb"] = time.perf_counter() - t0
            out["samples"] += r["samples"]
            out["bytes"] += r["bytes"]
            out["ids"] += [i + ep * expected for i in r["ids"]]
    out["seconds"] = time.perf_counter() - t0
    # The workers' CPU too: they are reaped when each epoch's DataLoader iterator ends.
    ru1 = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    out["client_cpu"] = sum(
        (b.ru_utime - a.ru_utime) + (b.ru_stime - a.ru_stime) for a, b in zip(ru0, ru1, strict=True)
    )
    out["transport"] = transport
    return out


def runs_in_workers(env: dict[str, str]) -> bool:
    """Whether the build `env` imports runs the consumer in DataLoader workers (its
    `shardstream.torch.IterableDataset` takes `batch_transform`; builds before 524bb26 do not)."""
    probe = (
        "import inspect, shardstream.torch as t;"
        " print('batch_transform' in inspect.signature(t.IterableDataset).parameters)"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def epoch(
    d: TcpDaemon, url: str, field: str, batch: int, expected: int, transport: str = "inline", workers: int = 0
) -> dict[str, Any]:
    cpu0 = d.cpu()
    cmd = [sys.executable, __file__, "--child", d.addr, url, field, str(batch), transport, str(workers), str(expected)]
    out = subprocess.run(cmd, env=d.env, capture_output=True, text=True, check=False)
    daemon_cpu = d.cpu() - cpu0
    if out.returncode != 0:
        raise RuntimeError(f"consumer failed ({out.returncode}): {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["daemon_cpu"] = daemon_cpu
    r["check"] = consumer.verdict(r.pop("ids"), expected * (WORKER_EPOCHS if workers else 1))
    if r["transport"].split("/")[0] != transport:
        r["check"] += f" (transport {r['transport']})"
    return r


def iperf3_gbps() -> tuple[float, str]:
    """Single-stream loopback TCP, 1 MiB writes, GB/s (10^9 B/s)."""
    exe = shutil.which("iperf3")
    if exe is None:
        return socket_pair_gbps(), "Python socket pair, 1 MiB sendall/recv_into"
    port = free_port()
    srv = subprocess.Popen([exe, "-s", "-1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            out = subprocess.run(
                [exe, "-c", "127.0.0.1", "-p", str(port), "-l", "1M", "-t", str(IPERF_SECONDS), "-J"],
                capture_output=True,
                text=True,
                check=False,
            )
            try:
                report = json.loads(out.stdout)
            except json.JSONDecodeError:
                report = {}
            # Before the server listens, iperf3 reports an error (sometimes with status 0).
            received = report.get("end", {}).get("sum_received")
            if out.returncode == 0 and received and "error" not in report:
                return received["bits_per_second"] / 8e9, "iperf3, 1 stream, -l 1M"
            time.sleep(0.1)  # the server not listening yet
        raise RuntimeError(f"iperf3 failed: {out.stderr or out.stdout[-500:]}")
    finally:
        srv.kill()
        srv.wait()


def socket_pair_gbps(total: int = 4 << 30) -> float:
    chunk = 1 << 20
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]

    def sink() -> None:
        conn, _ = lsock.accept()
        buf = bytearray(chunk)
        while conn.recv_into(buf):
            pass
        conn.close()

    t = threading.Thread(target=sink)
    t.start()
    data = bytes(chunk)
    with socket.create_connection(("127.0.0.1", port)) as c:
        t0 = time.perf_counter()
        for _ in range(total // chunk):
            c.sendall(data)
        c.shutdown(socket.SHUT_WR)
        t.join()
    lsock.close()
    return total / 1e9 / (time.perf_counter() - t0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child_main(
            sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], int(sys.argv[7]), int(sys.argv[8])
        )
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=30_000, help="~18 KiB samples")
    # 2.4 GiB: an epoch of over a second at the TCP floor's rate, so connecting, opening the
    # dataset and the first batch (~0.1 s) weigh little, as iperf3's 3 s of steady state.
    ap.add_argument("--large", type=int, default=2400, help="1 MiB samples")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--variant", action="append", default=[], type=variant, help="NAME=SITE: another build, measured alongside"
    )
    ap.add_argument("--transport", action="append", choices=["inline", "rdma"], help="default: inline and rdma")
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/INLINE_RESULTS.md")
    args = ap.parse_args()

    make = shm_bench.tar_dataset
    small_files = make(args.data / f"inline-small-{args.samples}", args.samples, 18 << 10, 1000, "jpg", True)
    large_files = make(args.data / f"inline-large-{args.large}", args.large, 1 << 20, 64, "bin", True)
    datasets = {
        "small": (str(small_files[0].parent), "jpg", SMALL_BATCH, args.samples, 0),
        "large": (str(large_files[0].parent), "bin", LARGE_BATCH, args.large, 0),
        WORKERS_ROW: (str(small_files[0].parent), "jpg", SMALL_BATCH, args.samples, DATALOADER_WORKERS),
    }
    measure.warm(small_files)
    measure.warm(large_files)
    builds: dict[str, str | None] = {"this build": None, **dict(args.variant)}
    transports = args.transport or ["inline", "rdma"]
    rdma_note = ""
    if "rdma" in transports and (why := rdma_unavailable()):
        transports = [t for t in transports if t != "rdma"]
        rdma_note = f"- rdma rows skipped: {why}."
        print(rdma_note, flush=True)
    load_before = os.getloadavg()
    # (build, transport, dataset): a build whose daemon has no --rdma gets no rdma rows.
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    skipped: set[str] = set()
    floors: list[float] = []
    floor_how = ""
    with tempfile.TemporaryDirectory(prefix="inline-bench-") as tmp:
        daemons: dict[str, TcpDaemon] = {}
        try:
            for i, (name, site) in enumerate(builds.items()):
                work = Path(tmp) / f"d{i}"
                work.mkdir()
                daemons[name] = TcpDaemon(site, work, rdma="rdma" in transports)
                in_workers = runs_in_workers(daemons[name].env)
                for t in transports:
                    if t == "rdma" and not daemons[name].rdma:
                        continue
                    for ds, (url, field, batch, n, workers) in datasets.items():
                        if workers and not in_workers:
                            skipped.add(f"- {name}: no {WORKERS_ROW!r} row (its client cannot run a batch_transform).")
                            continue
                        results[(name, t, ds)] = []
                        epoch(daemons[name], url, field, batch, n, t)  # warm-up: index and verify once
            for rnd in range(args.rounds):
                g, floor_how = iperf3_gbps()
                floors.append(g)
                line = [f"round {rnd + 1}: tcp {g:.2f} GB/s"]
                # Each round starts at another row: the row right after iperf3 ran slow in every
                # round (inline small 0.80x the same code in another build), a position effect.
                rows = list(results)
                shift = rnd * len(rows) // args.rounds
                for name, t, ds in rows[shift:] + rows[:shift]:
                    url, field, batch, n, workers = datasets[ds]
                    r = epoch(daemons[name], url, field, batch, n, t, workers)
                    results[(name, t, ds)].append(r)
                    per_s, gb_s = r["samples"] / r["seconds"], r["bytes"] / 1e9 / r["seconds"]
                    line.append(f"{name}/{t}/{ds} {per_s:,.0f}/s {gb_s:.2f} GB/s")
                print("; ".join(line), flush=True)
        finally:
            for d in daemons.values():
                d.stop()

    def rate(r: dict[str, Any]) -> float:
        return r["samples"] / r["seconds"]

    def gbps(r: dict[str, Any]) -> float:
        return r["bytes"] / 1e9 / r["seconds"]

    def steady(r: dict[str, Any], batch: int) -> float:
        """samples/s after the first batch: without what a process pays once (libfabric's start
        for rdma, connecting, opening the dataset), as a trainer's later epochs see it."""
        return (r["samples"] - batch) / max(r["seconds"] - r["ttfb"], 1e-9)

    lines = [
        "# Inline transport over loopback TCP",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `python bench/inline_bench.py`"
        f" (part of `make bench`): {args.rounds} interleaved rounds, median (min-max).",
        "",
        f"- Machine: {os.cpu_count()} CPUs; load average before {' '.join(f'{x:.2f}' for x in load_before)},"
        f" after {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        f"- Daemon on tcp://127.0.0.1, warm; consumer in a fresh process per epoch (library imports, torch"
        " included, before the clock starts), no DataLoader unless the row says so, the common consumer"
        " (bench/consumer.py)."
        f" Small: {args.samples:,} samples of 18 KiB + label, batch {SMALL_BATCH};"
        f" large: {args.large:,} samples of 1 MiB + label, batch {LARGE_BATCH}. GB = 10^9 B of payload.",
        f'- "{WORKERS_ROW}": the small dataset through a torch DataLoader with {DATALOADER_WORKERS} workers'
        " (started afresh each epoch, the DataLoader's default), the consumer run in the workers on the"
        f" views; the clock covers building the dataset and {WORKER_EPOCHS} epochs, client CPU includes"
        " the workers'.",
        f"- TCP floor: {floor_how}, {IPERF_SECONDS} s per round: {report.spread(floors, '.2f')} GB/s.",
        f"- rdma: libfabric's tcp provider (`{RDMA_ENV['SHARDSTREAM_FI_PROVIDER']}`), ring slots of"
        f" {int(RDMA_ENV['SHARDSTREAM_RDMA_SLOT_BYTES']) >> 20} MiB, same daemon as inline.",
        *([rdma_note] if rdma_note else []),
        *sorted(skipped),
        "",
        "- first batch: seconds from the start of the clock to the first batch; after the first batch:"
        " the rest of the samples over the rest of the time.",
        "",
        "| build | transport | dataset | samples/s | GB/s | x TCP floor | first batch s"
        " | samples/s after the first batch | daemon CPU-s/GB | client CPU-s/GB | check |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, t, ds), runs in results.items():
        ratios = [gbps(r) / f for r, f in zip(runs, floors, strict=True)]
        checks = "; ".join(sorted({r["check"] for r in runs}))
        daemon_cpu = statistics.median(r["daemon_cpu"] * 1e9 / r["bytes"] for r in runs)
        client_cpu = statistics.median(r["client_cpu"] * 1e9 / r["bytes"] for r in runs)
        batch = datasets[ds][2]
        lines.append(
            f"| {name} | {t} | {ds} | {report.spread([rate(r) for r in runs], ',.0f')}"
            f" | {report.spread([gbps(r) for r in runs], '.2f')}"
            f" | {statistics.median(ratios):.2f} | {statistics.median(r['ttfb'] for r in runs):.3f}"
            f" | {report.spread([steady(r, batch) for r in runs], ',.0f')}"
            f" | {daemon_cpu:.2f} | {client_cpu:.2f} | {checks} |"
        )
    ratio_lines: list[str] = []
    for name in builds:
        for ds in datasets:
            if (name, "rdma", ds) in results and (name, "inline", ds) in results:
                pairs = zip(results[(name, "rdma", ds)], results[(name, "inline", ds)], strict=True)
                rs = [rate(a) / rate(b) for a, b in pairs]
                ratio_lines.append(f"- {name}, {ds}: rdma / inline = {report.spread(rs, '.2f')}")
    for name in list(builds)[1:]:
        for t in transports:
            for ds in datasets:
                this, other = results.get(("this build", t, ds)), results.get((name, t, ds))
                if this and other:
                    rs = [rate(a) / rate(b) for a, b in zip(this, other, strict=True)]
                    ratio_lines.append(f"- {t}, {ds}: this build / {name} = {report.spread(rs, '.2f')}")
                    batch = datasets[ds][2]
                    rs = [steady(a, batch) / steady(b, batch) for a, b in zip(this, other, strict=True)]
                    ratio_lines.append(
                        f"- {t}, {ds}, after the first batch: this build / {name} = {report.spread(rs, '.2f')}"
                    )
        # The gate: this build's rdma against the other build's inline.
        for ds in datasets:
            this, other = results.get(("this build", "rdma", ds)), results.get((name, "inline", ds))
            if this and other:
                rs = [rate(a) / rate(b) for a, b in zip(this, other, strict=True)]
                ratio_lines.append(f"- {ds}: this build's rdma / {name}'s inline = {report.spread(rs, '.2f')}")
                batch = datasets[ds][2]
                rs = [steady(a, batch) / steady(b, batch) for a, b in zip(this, other, strict=True)]
                ratio_lines.append(
                    f"- {ds}, after the first batch: this build's rdma / {name}'s inline = {report.spread(rs, '.2f')}"
                )
    if ratio_lines:
        lines += ["", "Per-round ratios of samples/s (median, min-max):", "", *ratio_lines]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
