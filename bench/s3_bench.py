"""S3 datasets and the node cache, measured against a real S3-compatible server (s3s-fs, built by
scripts/s3-server.sh) on 127.0.0.1, in one run, written to bench/S3_RESULTS.md:

1. **cold epoch**: a fresh daemon with an empty cache streams one shuffled epoch of the bench's
   WebDataset shards from S3; its MB/s against what the same server delivers to a plain client
   (`s3_fetch`: aws-sdk-s3, N concurrent ranged GETs of the daemon's part size, bytes discarded)
   in the same round, over `--rounds` interleaved rounds (median, spread, per-round ratios);
2. **warm epoch**: the next epoch, served from the node cache (in each round);
3. **time to first batch** on a 10,000-shard dataset with a manifest, and S3 requests per epoch;
4. **epoch 2 with a cache of half the dataset**: bytes downloaded again, Belady (clairvoyant)
   against LRU;
5. **peers on the same server**: the `webdataset` library reading `pipe:curl` URLs (SigV4 by
   curl), AWS's `s3torchconnector` (custom endpoint, path style) and MosaicML `streaming` with
   an `s3://` remote (`S3_ENDPOINT_URL`).

Every epoch is checked exactly-once (sample ids written by the generator)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import consumer  # noqa: E402
import gen  # noqa: E402
import measure  # noqa: E402
import report  # noqa: E402
from s3server import SECRET_KEY as S3_SECRET  # noqa: E402
from s3server import S3Server  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARDSTREAM = str(Path(sys.executable).with_name("shardstream"))
BATCH = 256
# `serve --s3-part-size`'s default (server/src/storage/s3.rs): s3s-fs hashes the whole object on
# every GET, ranged or not, so the plain client must make the daemon's GETs for a fair comparison.
DAEMON_PART_BYTES = 32 << 20


def daemon(tmp: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen[bytes], str]:
    addr = f"unix://{tmp / 'sock'}"
    log = open(tmp / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    cmd = [SHARDSTREAM, "serve", "--listen", addr, "--cache-dir", str(tmp / "cache"), "--log", "warn", *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    import shardstream

    deadline = time.monotonic() + 30
    while not shardstream._native.probe(addr):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"daemon did not start: {(tmp / 'daemon.log').read_text()[-2000:]}")
        time.sleep(0.02)
    return proc, addr


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def status(addr: str) -> dict[str, Any]:
    import shardstream

    return shardstream._native.Connection(addr).status()


def consume(batches, expected: int | None, t0: float) -> dict[str, Any]:
    """The bench's common consumer (bench/consumer.py) with the check as a report string."""
    r = consumer.consume(batches, t0)
    ids = r.pop("ids")
    r["check"] = "ok" if expected is None else consumer.verdict(ids, expected)
    return r


def loader_epoch(addr: str, url: str, epoch: int, expected: int | None) -> dict[str, Any]:
    import shardstream

    t0 = time.perf_counter()  # constructing the loader counts
    loader = shardstream.Loader(url, batch_size=BATCH, shuffle=True, seed=0, connect=addr)
    loader.set_epoch(epoch)
    return consume((b["jpg"] for b in loader), expected, t0)


def fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def link_tree(src: Path, dst: Path) -> None:
    """The bench's shards as objects of a bucket: hard links, no copy."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.glob("*.tar")):
        if not (dst / p.name).exists():
            os.link(p, dst / p.name)


def tiny_shards(d: Path, shards: int, per_shard: int) -> int:
    """`shards` small TARs of `per_shard` samples each (the time-to-first-batch dataset)."""
    if (d / ".complete").exists():
        return shards * per_shard
    d.mkdir(parents=True, exist_ok=True)
    payload = bytes(1024)
    for s in range(shards):
        with tarfile.open(d / f"shard-{s:06d}.tar", "w") as tf:
            for i in range(per_shard):
                for ext, data in (("jpg", payload), ("cls", b"0")):
                    info = tarfile.TarInfo(f"{s:06d}-{i:03d}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, BytesIO(data))
    (d / ".complete").write_text("")
    return shards * per_shard


def shardstream_index(path: Path) -> None:
    if not (path / "manifest.json").exists():
        subprocess.run([SHARDSTREAM, "index", str(path)], check=True, capture_output=True)


def plain_client(
    env: dict[str, str],
    bucket: str,
    prefix: str,
    concurrency: int,
    part: int,
    write_dir: Path | None = None,
    write_bytes: int | None = None,
) -> dict[str, Any]:
    """`s3_fetch`: discards the bytes, or with `write_dir` keeps them there (a file per object,
    `write_bytes` gathered for each write, 0 for direct writes; the daemon's MiB when None)."""
    exe = ROOT / "target/release/examples/s3_fetch"
    store = [str(write_dir), *([str(write_bytes)] if write_bytes is not None else [])] if write_dir else []
    out = subprocess.run(
        [str(exe), bucket, prefix, str(concurrency), str(part), *store],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"s3_fetch failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def peer_webdataset(server: S3Server, prefix: str, names: list[str], expected: int) -> dict[str, Any]:
    import webdataset as wds

    env = server.env()
    user = f"{env['AWS_ACCESS_KEY_ID']}:{env['AWS_SECRET_ACCESS_KEY']}"
    urls = [
        # s3s-fs, like S3, wants the payload hash header, which curl's SigV4 does not add itself.
        f"pipe:curl -sf --aws-sigv4 aws:amz:us-east-1:s3 --user {user}"
        f" -H 'x-amz-content-sha256: UNSIGNED-PAYLOAD' {server.endpoint}/bench/{prefix}{n}"
        for n in names
    ]
    t0 = time.perf_counter()
    ds = wds.WebDataset(urls, shardshuffle=len(urls)).shuffle(1000).to_tuple("jpg").batched(BATCH)
    return consume(([x for x in b[0]] for b in ds), expected, t0)


def peer_s3torchconnector(server: S3Server, prefix: str, names: list[str], expected: int) -> dict[str, Any]:
    """AWS's connector as its README shows it for WebDataset shards: an `S3IterableDataset` over
    the shard objects (in a seeded random order), each streamed through `tarfile`, with the same
    1000-sample shuffle buffer the `webdataset` row uses."""
    import random
    import tarfile

    from s3torchconnector import S3ClientConfig, S3IterableDataset

    env = server.env()
    saved = dict(os.environ)
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    try:
        uris = [f"s3://bench/{prefix}{n}" for n in names]
        random.Random(0).shuffle(uris)
        t0 = time.perf_counter()
        ds = S3IterableDataset.from_objects(
            uris,
            region="us-east-1",
            endpoint=server.endpoint,
            s3client_config=S3ClientConfig(force_path_style=True),
        )

        def samples():
            rng = random.Random(0)
            buf: list[bytes] = []
            for reader in ds:
                with tarfile.open(fileobj=reader, mode="r|") as tf:
                    for m in tf:
                        if m.name.endswith(".jpg"):
                            f = tf.extractfile(m)
                            if f is not None:
                                buf.append(f.read())
                                if len(buf) >= 1000:
                                    i = rng.randrange(len(buf))
                                    buf[i], buf[-1] = buf[-1], buf[i]
                                    yield buf.pop()
            rng.shuffle(buf)
            yield from buf

        it = samples()
        return consume(iter(lambda: _take(it, BATCH), []), expected, t0)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def peer_mosaicml(server: S3Server, mds_prefix: str, expected: int) -> dict[str, Any]:
    env = server.env()
    saved = dict(os.environ)
    os.environ.update(
        {
            "S3_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": env["AWS_SECRET_ACCESS_KEY"],
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    try:
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        local = tempfile.mkdtemp(prefix="mds-cache-")
        t0 = time.perf_counter()
        ds = StreamingDataset(remote=f"s3://bench/{mds_prefix}", local=local, shuffle=True, batch_size=BATCH)
        # Iterated, as a training loop does (indexing would bypass its shuffle).
        it = iter(ds)
        batches = ([s["jpg"] for s in _take(it, BATCH)] for _ in range(-(-len(ds) // BATCH)))
        r = consume(batches, expected, t0)
        shutil.rmtree(local, ignore_errors=True)
        return r
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _take(it, n):
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--tiny-shards", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8, help="ranged GETs in flight for the plain client")
    ap.add_argument(
        "--part-bytes",
        type=int,
        default=DAEMON_PART_BYTES,
        help="the plain client's GET size (default: the daemon's default part size, so both make the same GETs)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of plain client and cold epoch")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/S3_RESULTS.md")
    ap.add_argument("--data", type=Path, default=ROOT / "bench/data")
    ap.add_argument("--skip-peers", action="store_true")
    args = ap.parse_args()

    spec = gen.Spec(samples=args.samples)
    base = gen.ensure(args.data, spec, ["wds"] + ([] if args.skip_peers else ["mds"]))
    s3root = args.data / "s3"
    bucket = s3root / "bench"
    link_tree(base / "wds", bucket / f"{spec.key()}/wds")
    shardstream_index(bucket / f"{spec.key()}/wds")
    if not args.skip_peers:
        mds_dst = bucket / f"{spec.key()}/mds"
        if not mds_dst.exists():
            shutil.copytree(base / "mds", mds_dst, copy_function=os.link)
    tiny = bucket / f"tiny-{args.tiny_shards}"
    tiny_samples = tiny_shards(tiny, args.tiny_shards, 4)
    shardstream_index(tiny)
    shard_files = sorted((bucket / f"{spec.key()}/wds").glob("*.tar"))
    shard_bytes = sum(p.stat().st_size for p in shard_files)
    measure.warm(shard_files)

    server = S3Server(s3root).start()
    env = server.env()
    url = f"s3://bench/{spec.key()}/wds/"
    load_before = os.getloadavg()
    rows: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="s3bench-"))
    try:
        # 1-2. Interleaved rounds: the server's own throughput to a plain client, then a cold and a
        # warm epoch on a fresh daemon with an empty cache. On a 2-core machine the server competes
        # with whatever else runs, so the ratio is taken within each round.
        def plain_run(write_dir: Path | None = None) -> dict[str, Any]:
            # The server's own CPU during the run: on a small machine it shares the cores with the
            # loader, and this says how much of them it needs to deliver what it does.
            before = measure.cpu_seconds(server.proc.pid) or 0.0
            r = plain_client(env, "bench", f"{spec.key()}/wds/", args.concurrency, args.part_bytes, write_dir)
            r["server_cpu"] = (measure.cpu_seconds(server.proc.pid) or 0.0) - before
            if write_dir is not None:
                shutil.rmtree(write_dir, ignore_errors=True)
            return r

        rounds: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            load = os.getloadavg()[0]
            # A cold epoch writes every byte it downloads into the node cache: with the page cache
            # already filling memory each new page costs a reclaim, which the plain client (bytes
            # discarded) never pays. Recorded so a run can be read against it.
            cached_gb = measure.meminfo_gb("Cached")
            plain = plain_run()
            print(f"round {rnd + 1}: plain client {plain['mb_per_s']:.0f} MB/s (load {load:.2f})", flush=True)
            # The same client keeping what it downloads, as any node cache must (a file per object,
            # a MiB a write, fsynced): what storing alone costs here, next to the cold epoch.
            (scratch / f"stored-{rnd}").mkdir()
            stored = plain_run(scratch / f"stored-{rnd}")
            print(f"round {rnd + 1}: plain client storing {stored['mb_per_s']:.0f} MB/s", flush=True)
            d = scratch / f"cold-{rnd}"
            d.mkdir()
            proc, addr = daemon(d, env)
            try:
                server_before = measure.cpu_seconds(server.proc.pid) or 0.0
                cold = loader_epoch(addr, url, 0, spec.samples)
                cold["server_cpu"] = (measure.cpu_seconds(server.proc.pid) or 0.0) - server_before
                st = status(addr)
                warm = loader_epoch(addr, url, 1, spec.samples)
                st2 = status(addr)
            finally:
                stop(proc)
                # Each round starts from the same state: the next round's cold epoch must not pay
                # the writeback of this round's 2 GB of cache copies (deleted before they are
                # flushed, they never are).
                shutil.rmtree(d, ignore_errors=True)
            cold["storage_bytes"], cold["requests"] = st["storage_bytes"], st["storage_requests"]
            warm["downloaded"] = st2["storage_bytes"] - st["storage_bytes"]
            cold_mbps = shard_bytes / 1e6 / cold["seconds"]
            print(
                f"round {rnd + 1}: cold epoch {cold_mbps:.0f} MB/s of shards"
                f" ({cold_mbps / plain['mb_per_s']:.2f}x plain), {cold['check']}",
                flush=True,
            )
            rounds.append(
                {"plain": plain, "stored": stored, "cold": cold, "warm": warm, "load": load, "cached_gb": cached_gb}
            )
        rows["rounds"] = rounds

        # 3. Time to first batch, 10,000 shards with a manifest; requests per epoch.
        d = scratch / "tiny"
        d.mkdir()
        proc, addr = daemon(d, env)
        try:
            import shardstream

            t0 = time.perf_counter()
            loader = shardstream.Loader(f"s3://bench/{tiny.name}/", batch_size=BATCH, seed=0, connect=addr)
            it = iter(loader)
            next(it)
            ttfb = time.perf_counter() - t0
            n = BATCH + sum(len(b["__key__"]) for b in it)
            st = status(addr)
        finally:
            stop(proc)
        one_shard = (tiny / "shard-000000.tar").stat().st_size
        rows["tiny"] = {
            "ttfb": ttfb,
            "samples": n,
            "expected": tiny_samples,
            "requests": st["storage_requests"],
            "shards": args.tiny_shards,
            "shard_bytes": one_shard,
        }
        print(f"10k shards: first batch {ttfb:.2f} s, {st['storage_requests']} requests", flush=True)

        # 4. Epoch 2 with a cache of half the dataset: Belady vs LRU.
        for policy in ("belady", "lru"):
            d = scratch / policy
            d.mkdir()
            proc, addr = daemon(d, env, "--cache-size", str(shard_bytes // 2), "--cache-policy", policy)
            try:
                e1 = loader_epoch(addr, url, 0, spec.samples)
                after1 = status(addr)["storage_bytes"]
                e2 = loader_epoch(addr, url, 1, spec.samples)
                after2 = status(addr)
            finally:
                stop(proc)
            rows[policy] = {
                "epoch1": e1,
                "epoch2": e2,
                "redownloaded": after2["storage_bytes"] - after1,
                "high_water": after2["cache"]["high_water_bytes"],
                "capacity": after2["cache"]["capacity_bytes"],
            }
            print(f"{policy}: epoch 2 downloaded {rows[policy]['redownloaded'] / 1e6:.0f} MB", flush=True)

        # 5. Peers on the same server.
        if not args.skip_peers:
            try:
                rows["webdataset"] = peer_webdataset(
                    server, f"{spec.key()}/wds/", [p.name for p in shard_files], spec.samples
                )
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows["webdataset"] = {"error": repr(e)}
            try:
                rows["s3torchconnector"] = peer_s3torchconnector(
                    server, f"{spec.key()}/wds/", [p.name for p in shard_files], spec.samples
                )
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows["s3torchconnector"] = {"error": repr(e)}
            try:
                rows["mosaicml"] = peer_mosaicml(server, f"{spec.key()}/mds", spec.samples)
            except Exception as e:  # noqa: BLE001 - reported in the table
                rows["mosaicml"] = {"error": repr(e)}
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    write_report(args, spec, rows, shard_bytes, len(shard_files), load_before)


def write_report(args, spec, rows, shard_bytes: int, shards: int, load_before) -> None:
    rounds, tiny = rows["rounds"], rows["tiny"]
    # The round whose cold epoch is the median one stands for the rows quoted once (peers, checks).
    cold = sorted((r["cold"] for r in rounds), key=lambda c: c["seconds"])[len(rounds) // 2]
    plain_mbps = [r["plain"]["mb_per_s"] for r in rounds]
    cold_mbps = [shard_bytes / 1e6 / r["cold"]["seconds"] for r in rounds]
    ratios = [c / p for c, p in zip(cold_mbps, plain_mbps, strict=True)]
    stored_mbps = [r["stored"]["mb_per_s"] for r in rounds]
    stored_ratios = [s / p for s, p in zip(stored_mbps, plain_mbps, strict=True)]
    cold_to_stored = [c / s for c, s in zip(cold_mbps, stored_mbps, strict=True)]
    checks = sorted({r["cold"]["check"] for r in rounds} | {r["warm"]["check"] for r in rounds})
    plain_busy = [r["plain"]["server_cpu"] / r["plain"]["seconds"] for r in rounds]
    cold_busy = [r["cold"]["server_cpu"] / r["cold"]["seconds"] for r in rounds]
    plain_gets = [r["plain"]["requests"] for r in rounds]
    cold_gets = [r["cold"]["requests"] for r in rounds]
    warm_sps = [r["warm"]["samples"] / r["warm"]["seconds"] for r in rounds]
    warm_x = [r["cold"]["seconds"] / r["warm"]["seconds"] for r in rounds]
    downloaded = max(r["warm"]["downloaded"] for r in rounds)
    lines = [
        "# S3 datasets and the node cache",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with `python bench/s3_bench.py"
        f" --samples {args.samples}` (part of `make bench`).",
        "",
        f"- Machine: {os.cpu_count()} CPUs; load average before {' '.join(f'{x:.2f}' for x in load_before)},"
        f" after {' '.join(f'{x:.2f}' for x in os.getloadavg())}.",
        "- Server: s3s-fs 0.14.1 on 127.0.0.1 (SigV4 checked; objects are files, hot in the page cache).",
        f"- Dataset: {spec.samples:,} samples of 16-20 KiB in {shards} WebDataset shards"
        f" ({shard_bytes / 1e9:.2f} GB), manifest written by `shardstream index`.",
        "",
        f"- Method: {len(rounds)} interleaved rounds of (plain client, the same keeping the bytes, then a cold"
        " and a warm epoch on a fresh daemon with an empty cache); load average (1 min) and the kernel's page"
        " cache (GB of"
        f" {measure.meminfo_gb('MemTotal'):.0f}) at the start of each round: "
        + ", ".join(f"{r['load']:.2f} and {r['cached_gb']:.1f} GB" for r in rounds)
        + ". Cells: median (min-max) over the rounds; the ratio is taken within each round. The plain client"
        f" makes {args.part_bytes >> 20} MiB ranged GETs, the daemon's default part size, so both make the same"
        " requests (s3s-fs hashes the whole object on every GET, so more, smaller GETs cost the server more).",
        "",
        "| measurement | value | ratio |",
        "|---|---|---|",
        f"| plain client, {args.concurrency} concurrent ranged GETs of {args.part_bytes >> 20} MiB (`s3_fetch`) |"
        f" {report.spread(plain_mbps, ',.0f')} MB/s; {report.median(plain_gets):.0f} GETs;"
        f" server busy {report.spread(plain_busy, ',.2f')} of {os.cpu_count()} cores | 1.00 |",
        f"| shardstream cold epoch (empty cache, shuffled, every sample checked: {', '.join(checks)}) |"
        f" {report.spread(cold_mbps, ',.0f')} MB/s of shards; {report.median(cold_gets):.0f} GETs;"
        f" server busy {report.spread(cold_busy, ',.2f')} cores | {report.spread(ratios, ',.2f')} of the plain"
        f" client, per round: {', '.join(f'{x:.2f}' for x in ratios)} |",
        "| the plain client keeping the bytes (`s3_fetch ... WRITE_DIR`: a file per object, a MiB a write,"
        f" fsynced, as the daemon writes its copies) | {report.spread(stored_mbps, ',.0f')} MB/s |"
        f" {report.spread(stored_ratios, ',.2f')} of the plain client; the cold epoch"
        f" {report.spread(cold_to_stored, ',.2f')} of it |",
        f"| S3 requests in the cold epoch | {report.median(cold_gets):.0f} for {shards} shards |"
        f" {report.median(cold_gets) / shards:.2f} per shard |",
        f"| shardstream warm epoch (node cache) | {report.spread(warm_sps, ',.0f')} samples/s,"
        f" {fmt(downloaded / 1e6)} MB downloaded (most of any round) |"
        f" {report.spread(warm_x, ',.1f')}x the cold epoch's speed |",
        f"| time to first batch, {tiny['shards']:,} shards with manifest ({tiny['shard_bytes']:,} B each) |"
        f" {tiny['ttfb']:.2f} s | |",
        f"| S3 requests for that epoch ({tiny['samples']:,} of {tiny['expected']:,} samples) |"
        f" {tiny['requests']:,} | {tiny['requests'] / tiny['shards']:.3f} per shard |",
    ]
    b, lru = rows["belady"], rows["lru"]
    lines += [
        "",
        "## Epoch 2 with a node cache of half the dataset",
        "",
        "Same daemon for epochs 1 and 2 (seed 0, one consumer); bytes fetched from S3 during epoch 2.",
        "",
        "| policy | epoch 2 re-downloaded | share of the dataset | cache high water / capacity | epoch 1, 2 check |",
        "|---|---|---|---|---|",
    ]
    for name, r in (("belady (clairvoyant)", b), ("lru", lru)):
        lines.append(
            f"| {name} | {fmt(r['redownloaded'] / 1e6)} MB | {r['redownloaded'] / shard_bytes:.2f} |"
            f" {fmt(r['high_water'] / 1e6)} / {fmt(r['capacity'] / 1e6)} MB |"
            f" {r['epoch1']['check']}, {r['epoch2']['check']} |"
        )
    if lru["redownloaded"]:
        lines.append(f"\nBelady re-downloads {b['redownloaded'] / lru['redownloaded']:.2f}x what LRU does.")
    if any(k in rows for k in ("webdataset", "s3torchconnector", "mosaicml")):
        lines += [
            "",
            "## Peers on the same server (one cold epoch, 0 workers)",
            "",
            "| reader | samples/s | MB/s of payload | first batch (s) | check |",
            "|---|---|---|---|---|",
        ]
        lines.append(
            f"| shardstream (cold) | {fmt(cold['samples'] / cold['seconds'])} |"
            f" {fmt(cold['bytes'] / 1e6 / cold['seconds'])} | {cold['ttfb']:.2f} | {cold['check']} |"
        )
        for name, how in (
            ("webdataset", "`pipe:curl` with SigV4"),
            ("s3torchconnector", "`S3IterableDataset` + `tarfile`"),
            ("mosaicml", "`streaming`, s3:// remote"),
        ):
            r = rows.get(name)
            if r is None:
                continue
            if "error" in r:
                # The test server's secret is in curl's command line: never in a report.
                error = r["error"].replace(S3_SECRET, "***")[:200]
                lines.append(f"| {name} ({how}) | error: {error} | | | |")
            else:
                lines.append(
                    f"| {name} ({how}) | {fmt(r['samples'] / r['seconds'])} | {fmt(r['bytes'] / 1e6 / r['seconds'])} |"
                    f" {r['ttfb']:.2f} | {r['check']} |"
                )
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
