"""Cold S3 epochs against the plain concurrent GET client, interleaved and repeated, with the CPU of
every party: the tool behind the cold-S3 section of bench/PROFILES.md (issue 12).

Each round runs the plain client (`s3_fetch`, N concurrent ranged GETs, bytes discarded) and then
one cold epoch per daemon configuration (`--config name="daemon args"`), each on a fresh daemon
with an empty cache, so every ratio compares runs seconds apart on the same server. Per run it
records MB/s of shards, the ratio to the plain client of the same round, CPU-seconds of the S3
server, of the daemon and of the trainer process (the consumer and the native client), S3
requests and bytes, and the load average. `--perf-record DIR` samples the daemon of the first
round's cold epochs with `perf record -g` (one `perf.data` per config) for `perf report`.
`--warm` adds, after each cold epoch, the next epoch on the same daemon, from its node cache (the
copies that cold epoch wrote), with its samples/s and CPU: what the way a download writes its
copy costs the epochs after it. `--plain-write` adds, after the plain client, the same client
keeping the bytes (`s3_fetch ... WRITE_DIR`: a file per object written a MiB at a time and
fsynced, as the daemon writes its copies, on the same disk): what storing alone costs, the
least any node cache pays; each cold epoch is then also quoted against it (`x plain+write`).
`--plain-write 1048576,65536` runs it once per write size given (the first is the reference);
size 0 writes around the page cache (`O_DIRECT`, a whole part per write, `plain+write direct`).

Run it against a release build (`maturin develop --release`, `cargo build --release --example
s3_fetch`); it prints a markdown table and writes the raw rows as JSON next to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import gen  # noqa: E402
import measure  # noqa: E402
import s3_bench  # noqa: E402
from s3server import S3Server  # noqa: E402


def plain_curl(server: S3Server, prefix: str, names: list[str], concurrency: int) -> dict[str, Any]:
    """The plain client when `s3_fetch` is not built: one `curl --parallel` process GETting every
    shard object whole (SigV4 by curl), `concurrency` transfers at once, bytes to /dev/null."""
    env = server.env()
    user = f"{env['AWS_ACCESS_KEY_ID']}:{env['AWS_SECRET_ACCESS_KEY']}"
    cfg = "".join(f'url = "{server.endpoint}/bench/{prefix}{n}"\noutput = "/dev/null"\n' for n in names)
    cmd = [
        "curl", "-sf", "--parallel", "--parallel-max", str(concurrency), "--aws-sigv4", "aws:amz:us-east-1:s3",
        "--user", user, "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD", "-w", "%{size_download}\\n", "-K", "-",
    ]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, input=cfg, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - t0
    got = sum(int(x) for x in out.stdout.split())
    return {"bytes": got, "seconds": seconds, "mb_per_s": got / 1e6 / seconds, "requests": len(names)}


def cold_epoch(
    tmp: Path,
    env: dict[str, str],
    server_pid: int,
    url: str,
    samples: int,
    args: list[str],
    perf: Path | None,
    warm: bool = False,
) -> dict[str, Any]:
    # `@NAME=VALUE` tokens set the daemon's environment (e.g. `@PYTHONPATH=DIR` with an older build).
    extra = dict(t[1:].split("=", 1) for t in args if t.startswith("@"))
    proc, addr = s3_bench.daemon(tmp, {**env, **extra}, *[t for t in args if not t.startswith("@")])
    recorder = None
    try:
        if perf is not None:
            recorder = subprocess.Popen(
                ["perf", "record", "-g", "-F", "499", "-o", str(perf), "-p", str(proc.pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(0.5)
        server0, daemon0 = measure.cpu_seconds(server_pid) or 0.0, measure.cpu_seconds(proc.pid) or 0.0
        trainer0 = time.process_time()
        r = s3_bench.loader_epoch(addr, url, 0, samples)
        r["trainer_cpu"] = time.process_time() - trainer0
        r["server_cpu"] = (measure.cpu_seconds(server_pid) or 0.0) - server0
        r["daemon_cpu"] = (measure.cpu_seconds(proc.pid) or 0.0) - daemon0
        st = s3_bench.status(addr)
        r["requests"], r["storage_bytes"] = st["storage_requests"], st["storage_bytes"]
        if warm:
            daemon0, trainer0 = measure.cpu_seconds(proc.pid) or 0.0, time.process_time()
            w = s3_bench.loader_epoch(addr, url, 1, samples)
            w["trainer_cpu"] = time.process_time() - trainer0
            w["daemon_cpu"] = (measure.cpu_seconds(proc.pid) or 0.0) - daemon0
            w["downloaded"] = s3_bench.status(addr)["storage_bytes"] - st["storage_bytes"]
            r["warm"] = w
    finally:
        if recorder is not None:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=60)
        s3_bench.stop(proc)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16, help="ranged GETs in flight for the plain client")
    ap.add_argument("--part-bytes", type=int, default=s3_bench.DAEMON_PART_BYTES, help="the plain client's GET size")
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        help='name="daemon args" (repeatable; default: one default config); @K=V tokens set its environment',
    )
    ap.add_argument("--data", type=Path, default=Path(s3_bench.ROOT) / "bench/data")
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "s3_profile.md")
    ap.add_argument("--perf-record", type=Path, help="directory for perf.data of the first round's cold epochs")
    ap.add_argument("--warm", action="store_true", help="also the next epoch on each daemon, from its node cache")
    ap.add_argument(
        "--plain-write",
        nargs="?",
        const=str(WRITE_CHUNK),
        type=lambda v: [int(x) for x in v.split(",")],
        help="also the plain client keeping what it downloads (s3_fetch WRITE_DIR), optionally at these"
        " comma-separated write sizes in bytes (default: the daemon's MiB; 0: around the page cache)",
    )
    a = ap.parse_args()
    configs = [(c.split("=", 1)[0], shlex.split(c.split("=", 1)[1])) for c in a.config] or [("default", [])]

    spec = gen.Spec(samples=a.samples)
    base = gen.ensure(a.data, spec, ["wds"])
    bucket = a.data / "s3" / "bench"
    s3_bench.link_tree(base / "wds", bucket / f"{spec.key()}/wds")
    s3_bench.shardstream_index(bucket / f"{spec.key()}/wds")
    shards = sorted((bucket / f"{spec.key()}/wds").glob("*.tar"))
    shard_bytes = sum(p.stat().st_size for p in shards)
    measure.warm(shards)
    server = S3Server(a.data / "s3").start()
    env, url, prefix = server.env(), f"s3://bench/{spec.key()}/wds/", f"{spec.key()}/wds/"
    scratch = Path(tempfile.mkdtemp(prefix="s3prof-"))
    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        for rnd in range(a.repeat):
            s0, c0 = measure.cpu_seconds(server.proc.pid) or 0.0, children_cpu()
            if (Path(s3_bench.ROOT) / "target/release/examples/s3_fetch").exists():
                plain = s3_bench.plain_client(env, "bench", prefix, a.concurrency, a.part_bytes)
            else:
                plain = plain_curl(server, prefix, [p.name for p in shards], a.concurrency)
            plain["server_cpu"] = (measure.cpu_seconds(server.proc.pid) or 0.0) - s0
            plain["client_cpu"] = children_cpu() - c0
            rows.append({"round": rnd, "run": "plain", **plain, "load": os.getloadavg()[0]})
            print(f"round {rnd} plain: {plain['mb_per_s']:.0f} MB/s", flush=True)
            stored = None
            for size in a.plain_write or []:
                out_dir = scratch / f"plain-write-{rnd}"
                out_dir.mkdir()
                s0, c0 = measure.cpu_seconds(server.proc.pid) or 0.0, children_cpu()
                w = s3_bench.plain_client(env, "bench", prefix, a.concurrency, a.part_bytes, out_dir, size)
                w["server_cpu"] = (measure.cpu_seconds(server.proc.pid) or 0.0) - s0
                w["client_cpu"] = children_cpu() - c0
                w["ratio"] = w["mb_per_s"] / plain["mb_per_s"]
                run = write_run(size)
                shutil.rmtree(out_dir, ignore_errors=True)
                # Every other run is quoted against the first size given (the daemon's, by default).
                stored = stored or w
                w["ratio_stored"] = w["mb_per_s"] / stored["mb_per_s"]
                rows.append({"round": rnd, "run": run, **w, "load": os.getloadavg()[0]})
                print(f"round {rnd} {run}: {w['mb_per_s']:.0f} MB/s ({w['ratio']:.2f}x)", flush=True)
            for name, args in configs:
                d = scratch / f"{name}-{rnd}"
                d.mkdir()
                perf = a.perf_record / f"{name}.perf.data" if a.perf_record and rnd == 0 else None
                r = cold_epoch(d, env, server.proc.pid, url, spec.samples, args, perf, a.warm)
                r["mb_per_s"] = shard_bytes / 1e6 / r["seconds"]
                r["ratio"] = r["mb_per_s"] / plain["mb_per_s"]
                if stored is not None:
                    r["ratio_stored"] = r["mb_per_s"] / stored["mb_per_s"]
                rows.append({"round": rnd, "run": name, **r, "load": os.getloadavg()[0]})
                print(f"round {rnd} {name}: {r['mb_per_s']:.0f} MB/s ({r['ratio']:.2f}x), {r['check']}", flush=True)
                if "warm" in r:
                    w = r["warm"]
                    print(
                        f"round {rnd} {name} warm: {w['samples'] / w['seconds']:,.0f} samples/s, {w['check']}",
                        flush=True,
                    )
                shutil.rmtree(d, ignore_errors=True)
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    report(a, configs, rows, shard_bytes, len(shards), load_before)


# The daemon's write size (`WRITE_CHUNK` in server/src/storage/s3.rs).
WRITE_CHUNK = 1 << 20


def write_run(size: int) -> str:
    """The row of the plain client storing with writes of `size` bytes."""
    if size == 0:
        return "plain+write direct"
    return "plain+write" if size == WRITE_CHUNK else f"plain+write {size >> 10} KiB"


def children_cpu() -> float:
    """User+system CPU seconds of this process's reaped children (the plain client)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def report(a, configs, rows, shard_bytes: int, shards: int, load_before) -> None:
    lines = [
        f"`python bench/s3_profile.py --samples {a.samples} --repeat {a.repeat} --concurrency {a.concurrency}"
        + "".join(f" --config {shlex.quote(c)}" for c in a.config)
        + (" --warm" if a.warm else "")
        + (f" --plain-write {','.join(map(str, a.plain_write))}" if a.plain_write else "")
        + f"`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {shards} shards, {shard_bytes / 1e9:.2f} GB;"
        f" load average before {' '.join(f'{x:.2f}' for x in load_before)},"
        f" after {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "",
        "| run | MB/s (median, min-max) | x plain, same round (median, min-max) |"
        + (" x plain+write, same round |" if a.plain_write else "")
        + " server CPU-s | client or daemon CPU-s | trainer CPU-s | GETs | check |",
        "|---|---|---|" + ("---|" if a.plain_write else "") + "---|---|---|---|---|",
    ]

    def span(xs: list[float], d: int = 0) -> str:
        return f"{statistics.median(xs):,.{d}f} ({min(xs):,.{d}f}-{max(xs):,.{d}f})"

    def med(rs: list[dict[str, Any]], k: str) -> str:
        return f"{statistics.median(r[k] for r in rs):.2f}" if k in rs[0] else ""

    plains = ["plain", *(write_run(size) for size in a.plain_write or [])]
    for name in plains + [n for n, _ in configs]:
        rs = [r for r in rows if r["run"] == name]
        ratio = span([r["ratio"] for r in rs], 2) if name != "plain" else "1.00"
        stored = ""
        if a.plain_write:
            stored = " - |" if name == "plain" else f" {span([r['ratio_stored'] for r in rs], 2)} |"
        checks = ",".join(sorted({r.get("check", "-") for r in rs}))
        lines.append(
            f"| {name} | {span([r['mb_per_s'] for r in rs])} | {ratio} |{stored} {med(rs, 'server_cpu')} |"
            f" {med(rs, 'client_cpu') or med(rs, 'daemon_cpu')} |"
            f" {med(rs, 'trainer_cpu')} | {int(statistics.median(r['requests'] for r in rs))} | {checks} |"
        )
    warm = {n: [r["warm"] for r in rows if r["run"] == n and "warm" in r] for n, _ in configs}
    if any(warm.values()):
        lines += [
            "",
            "The next epoch on each daemon, from its node cache:",
            "",
            "| run | samples/s (median, min-max) | daemon CPU-s | trainer CPU-s | MB downloaded | check |",
            "|---|---|---|---|---|---|",
        ]
        for name, ws in warm.items():
            checks = ",".join(sorted({w.get("check", "-") for w in ws}))
            lines.append(
                f"| {name} | {span([w['samples'] / w['seconds'] for w in ws])} | {med(ws, 'daemon_cpu')} |"
                f" {med(ws, 'trainer_cpu')} | {max(w['downloaded'] for w in ws) / 1e6:.0f} | {checks} |"
            )
    text = "\n".join(lines) + "\n"
    a.out.write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
