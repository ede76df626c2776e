"""Size and count flags out of range are refused at parse time, naming the flag and the range."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import SHARDSTREAM


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SHARDSTREAM, *args], capture_output=True, text=True, timeout=60)


def test_size_and_count_flags_out_of_range_are_refused(tmp_path: Path) -> None:
    serve = ["serve", "--listen", f"unix://{tmp_path / 'sock'}", "--cache-dir", str(tmp_path / "cache")]
    cases = [
        ([*serve, "--s3-part-size", "1"], "--s3-part-size must be at least 64 KiB and at most 1 GiB"),
        ([*serve, "--s3-concurrency", "0"], "--s3-concurrency must be from 1 to 256, not 0"),
        ([*serve, "--prefetch-parallel", "100000"], "--prefetch-parallel must be from 1 to 256, not 100000"),
        ([*serve, "--max-streams-per-client", "0"], "--max-streams-per-client must be from 1 to 16384, not 0"),
        # Were accepted: every rdma stream then failed ("--rdma-budget is 0 MiB"), or rdma was
        # silently not served.
        ([*serve, "--rdma", "--rdma-budget", "0"], "--rdma-budget must be at least 1 MiB"),
        (["index", str(tmp_path), "--threads", "0"], "--threads must be from 1 to 1024, not 0"),
        (["prefetch", "s3://b/p/", "--shards", "0"], "--shards must be from 1 to"),
        # Was sent to the daemon and refused there, exit code 1.
        (["prefetch", "s3://b/p/", "--cache", "bogus"], "invalid value 'bogus' for '--cache <CACHE>'"),
        (["pack", str(tmp_path), "--output", str(tmp_path / "o"), "--s3-part-size", "1"], "at least 5 MiB"),
        (["pack", str(tmp_path), "--output", str(tmp_path / "o"), "--shard-size", "10"], "--shard-size must be"),
    ]
    for args, needle in cases:
        p = run(*args)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert needle in p.stderr, (args, p.stderr)
    # Nothing was started or created by a refused command line.
    assert not (tmp_path / "sock").exists() and not (tmp_path / "cache").exists() and not (tmp_path / "o").exists()


def test_an_rdma_provider_without_rdma_is_refused(tmp_path: Path) -> None:
    # Was ignored: the daemon started and served no rdma, as the operator had not asked.
    env = {**os.environ, "SHARDSTREAM_RDMA_PROVIDER": "tcp"}
    serve = [SHARDSTREAM, "serve", "--listen", f"unix://{tmp_path / 'sock'}", "--cache-dir", str(tmp_path / "c")]
    p = subprocess.run(serve, capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 1 and "rdma is not served without --rdma" in p.stderr, p.stderr
    assert not (tmp_path / "sock").exists()


def test_an_error_prints_each_cause_once(tmp_path: Path) -> None:
    # An I/O error's message holds its OS reason, and the CLI printed the cause chain after it:
    # "File exists (os error 17): File exists (os error 17)". A directory below a file gives an
    # OS error (a --cache-dir that is itself a file is named as such, without one).
    (tmp_path / "a-file").write_text("")
    p = run("serve", "--listen", f"unix://{tmp_path / 'sock'}", "--cache-dir", str(tmp_path / "a-file" / "sub"))
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("Not a directory") == 1 and str(tmp_path / "a-file") in p.stderr, p.stderr
    p = run("index", str(tmp_path / "a-file" / "x"))
    assert p.returncode == 1 and p.stderr.count("\n") == 1, p.stderr


def test_a_reader_that_goes_away_ends_the_output_quietly(daemon, dataset, tmp_path) -> None:
    """`shardstream status | head -1` (and `index ... | true`) panicked, exit 101 with a
    backtrace ("failed printing to stdout: Broken pipe"), and `index` failed after writing its
    manifest. A closed stdout ends a command's output as it ends any shell tool's."""
    import shutil

    root, _ = dataset
    copy = tmp_path / "ds"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns("manifest.json", "_shardstream"))
    for args in (
        ["status", "--connect", daemon.addr, "--json"],
        ["status", "--connect", daemon.addr],
        ["index", str(copy)],
        ["serve", "--print-config"],
    ):
        r, w = os.pipe()
        os.close(r)  # nobody reads: the first write fails with EPIPE
        try:
            p = subprocess.run([SHARDSTREAM, *args], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
        finally:
            os.close(w)
        assert p.returncode == 0 and "panicked" not in p.stderr, (args, p.returncode, p.stderr[-2000:])
    assert (copy / "manifest.json").exists()


def test_status_shows_a_small_node_cache_in_megabytes(tmp_path: Path) -> None:
    # A cache of a few MB read "node cache 0.0 of 0.0 GB".
    from conftest import Daemon

    d = Daemon(tmp_path, args=["--cache-size", "8MB"]).start()
    try:
        out = run("status", "--connect", d.addr).stdout
        assert "node cache      0.0 of 8.0 MB in 0 shards" in out, out
    finally:
        d.stop()
