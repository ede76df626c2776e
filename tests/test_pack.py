"""`shardstream pack` end to end: the installed command packs a generated ImageNet-style tree, and
the result is read back through the daemon, by the real `webdataset` library, by GNU `tar -t` and
(Parquet output) by pyarrow, with identical bytes and keys. Also: resume after `kill -9`, every
kind of bad input, reported with its path, skipped, or fatal with `--strict`, and packing straight
into a bucket of a real S3 server (s3s-fs), multipart uploads included."""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from s3server import S3Server
from test_parquet import view_homes

import shardstream
from conftest import SHARDSTREAM, Daemon, ctrl_c_as_at_a_terminal

Samples = dict[str, dict[str, bytes]]


def make_tree(root: Path, classes: int, per_class: int, seed: int = 0, max_bytes: int = 4000) -> Samples:
    """`cNNN/xxxxxx.jpg` (+ `xxxxxx.json` for two samples in three); returns {key: {field: bytes}}."""
    rng = np.random.default_rng(seed)
    samples: Samples = {}
    for c in range(classes):
        d = root / f"c{c:03d}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            n = c * per_class + i
            key = f"c{c:03d}/{n:06d}"
            fields = {"jpg": rng.integers(0, 256, int(rng.integers(1, max_bytes)), dtype=np.uint8).tobytes()}
            if n % 3:
                fields["json"] = json.dumps({"n": n}).encode()
            for f, data in fields.items():
                (root / f"{key}.{f}").write_bytes(data)
            samples[key] = fields
    return samples


def pack(*args: str | Path, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([SHARDSTREAM, "pack", *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"pack failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def with_labels(samples: Samples) -> Samples:
    classes = sorted({k.split("/")[0] for k in samples})
    return {k: {**v, "cls": str(classes.index(k.split("/")[0])).encode()} for k, v in samples.items()}


def tree_bytes(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Samples]:
    root = tmp_path_factory.mktemp("imagenet")
    samples = make_tree(root, classes=5, per_class=120)
    (root / "README").write_text("not a sample")
    return root, samples


@pytest.fixture(scope="module")
def packed(imagenet: tuple[Path, Samples], tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, _ = imagenet
    out = tmp_path_factory.mktemp("packed") / "out"
    p = pack(src, "--output", out, "--label-from-dir", "--samples-per-shard", "70")
    assert p.stdout.startswith("packed 600 samples (1000 files"), p.stdout
    assert "ignored 1 file (" in p.stdout and "README" in p.stderr
    return out


def test_read_back_through_the_daemon(daemon, imagenet, packed: Path) -> None:
    _, samples = imagenet
    expected = with_labels(samples)
    loader = shardstream.Loader(str(packed), batch_size=64, shuffle=True, seed=3, connect=daemon.addr)
    got: Samples = {}
    for batch in loader:
        for i, key in enumerate(batch["__key__"]):
            assert key not in got, f"{key} delivered twice"
            got[key] = {f: bytes(batch[f][i]) for f in ("jpg", "json", "cls") if batch[f][i] is not None}
    assert got == expected
    assert json.loads((packed / "classes.json").read_text()) == {f"c{c:03d}": c for c in range(5)}


def test_read_back_with_webdataset_and_tar(imagenet, packed: Path) -> None:
    _, samples = imagenet
    expected = with_labels(samples)
    manifest = json.loads((packed / "manifest.json").read_text())
    shards = [str(packed / s["name"]) for s in manifest["shards"]]
    assert shards == sorted(glob.glob(str(packed / "*.tar")))
    assert [s["samples"] for s in manifest["shards"]] == [70] * 8 + [40]
    got: Samples = {}
    for s in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
        got[s["__key__"]] = {k: v for k, v in s.items() if not k.startswith("__")}
    assert got == expected
    keys_in_order = []
    for shard in shards:
        names = subprocess.run(["tar", "-tf", shard], capture_output=True, text=True, check=True).stdout.split()
        keys_in_order += [n.rsplit(".", 1)[0] for n in names if n.endswith(".cls")]
        for name in names:
            key, field = name.split(".", 1)
            assert field in expected[key], name
        verbose = subprocess.run(["tar", "-tvf", shard], capture_output=True, text=True, check=True).stdout
        assert all(" 0/0 " in line and "2000-01-01 00:00" in line for line in verbose.splitlines())
    assert keys_in_order == sorted(expected), "default order is key order"


def test_manifest_records_each_shards_largest_sample(packed: Path) -> None:
    """`max_sample` / `max_sample_bytes` (what lets the daemon refuse an inline stream that cannot
    carry a sample before it starts) agree with the shards as Python's tarfile reads them: a sample
    spans from its first member's header to the next sample's, the last one to its padded end."""
    manifest = json.loads((packed / "manifest.json").read_text())
    for entry in manifest["shards"]:
        starts: list[tuple[str, int]] = []
        end = 0
        with tarfile.open(packed / entry["name"]) as tf:
            for m in tf:
                key = m.name.split(".", 1)[0]
                if not starts or starts[-1][0] != key:
                    starts.append((key, m.offset))
                end = m.offset_data + -(-m.size // 512) * 512
        bounds = [o for _, o in starts] + [end]
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        assert len(sizes) == entry["samples"]
        assert entry["max_sample_bytes"] == max(sizes), entry
        assert entry["max_sample"] == sizes.index(max(sizes)), entry


def test_parquet_read_by_pyarrow(imagenet, tmp_path: Path) -> None:
    src, samples = imagenet
    out = tmp_path / "pq"
    p = pack(src, "--output", out, "--format", "parquet", "--samples-per-shard", "250", "--row-group-size", "64")
    assert "parquet shards" in p.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["shard_format"] == "parquet"
    files = [out / s["name"] for s in manifest["shards"]]
    assert [f.name for f in files] == ["shard-000000.parquet", "shard-000001.parquet", "shard-000002.parquet"]
    got: Samples = {}
    for f in files:
        meta = pq.ParquetFile(f).metadata
        assert meta.num_row_groups == -(-meta.num_rows // 64)
        table = pq.read_table(f)
        assert table.column_names == ["__key__", "jpg", "json"]
        for row in table.to_pylist():
            got[row["__key__"]] = {k: v for k, v in row.items() if k != "__key__" and v is not None}
    assert got == samples


def parquet_layout(path: Path) -> dict[str, set[tuple[str, tuple[str, ...], bool, bool]]]:
    """Per column of a Parquet file: the set of (compression, encodings, statistics written, offset
    index written) over its row groups, as pyarrow reads them from the footer."""
    meta = pq.ParquetFile(path).metadata
    out: dict[str, set[tuple[str, tuple[str, ...], bool, bool]]] = {}
    for rg in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            col = meta.row_group(rg).column(c)
            layout = (col.compression, tuple(sorted(col.encodings)), col.is_stats_set, col.has_offset_index)
            out.setdefault(col.path_in_schema, set()).add(layout)
    return out


def test_parquet_layout_serves_payloads_as_plain_uncompressed_bytes(imagenet, tmp_path: Path) -> None:
    """The layout `pack` chooses (bench/PARQUET_LAYOUT.md): payload columns PLAIN, no dictionary,
    no compression, no statistics; the key column with chunk statistics; an offset index (page
    locations) for every column; `--parquet-compression` changes only the codec."""
    src, _ = imagenet
    out = tmp_path / "pq"
    pack(src, "--output", out, "--format", "parquet", "--samples-per-shard", "250", "--row-group-size", "64")
    files = sorted(out.glob("*.parquet"))
    assert files
    for f in files:
        layout = parquet_layout(f)
        assert set(layout) == {"__key__", "jpg", "json"}
        # RLE is the encoding of the definition/repetition levels that the writer lists for every
        # column, not a value encoding.
        assert layout["jpg"] == {("UNCOMPRESSED", ("PLAIN", "RLE"), False, True)}, layout
        assert layout["json"] == {("UNCOMPRESSED", ("PLAIN", "RLE"), False, True)}, layout
        assert layout["__key__"] == {("UNCOMPRESSED", ("PLAIN", "RLE"), True, True)}, layout

    zstd = tmp_path / "zstd"
    pack(src, "--output", zstd, "--format", "parquet", "--samples-per-shard", "250", "--parquet-compression", "zstd")
    for f in sorted(zstd.glob("*.parquet")):
        codecs = {lay[0] for col in parquet_layout(f).values() for lay in col}
        assert codecs == {"ZSTD"}


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_shuffle_is_deterministic_and_resume_after_kill_is_identical(tmp_path: Path, stop: signal.Signals) -> None:
    """Killed, or stopped by Ctrl-C or SIGTERM, which also say how to finish the pack (they were
    silent) and still end the process by the signal."""
    src = tmp_path / "src"
    make_tree(src, classes=10, per_class=150, max_bytes=3000)
    # ~90 shards: every shard is fsynced, so the pack takes long enough to be killed midway.
    common = ["--samples-per-shard", "16", "--shuffle", "--seed", "11", "--threads", "2"]
    clean = tmp_path / "clean"
    pack(src, "--output", clean, *common)

    out = tmp_path / "killed"
    journal = out / "_shardstream" / "pack-journal.jsonl"
    proc = subprocess.Popen(
        [SHARDSTREAM, "pack", str(src), "--output", str(out), *common],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists() and journal.read_text().count("\n") > 10:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "pack finished before it could be killed; make the tree larger"
    proc.send_signal(stop)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -stop, (proc.returncode, err)
    if stop != signal.SIGKILL:
        assert f"readers refuse {out} until it does: the same command with --resume finishes it" in err, err
    # Nothing presented as complete: no manifest, no shard in DEST itself.
    assert not (out / "manifest.json").exists()
    assert not list(out.glob("*.tar"))
    assert list((out / "_shardstream" / "staging").glob("shard-*.tar"))

    # Without --resume, a different pack into it is refused; with it, the result is identical.
    p = pack(src, "--output", out, "--samples-per-shard", "9", check=False)
    assert p.returncode == 1 and "different dataset" in p.stderr and str(out) in p.stderr
    # --resume over files that changed since says so, not only "a different dataset".
    extra = next(src.rglob("*.jpg")).with_name("added.jpg")
    extra.write_bytes(b"late")
    p = pack(src, "--output", out, *common, "--resume", check=False)
    assert p.returncode == 1 and "--resume" in p.stderr and "added, removed or renamed" in p.stderr, p.stderr
    extra.unlink()
    # Without --resume, the same pack starts over, and says what it packs again.
    if stop == signal.SIGKILL:
        again = tmp_path / "again"
        shutil.copytree(out, again)
        p = pack(src, "--output", again, *common)
        assert "an interrupted run had finished packed again (--resume keeps them)" in p.stdout, p.stdout
        assert tree_bytes(again) == tree_bytes(clean)
    p = pack(src, "--output", out, *common, "--resume")
    assert "kept from the interrupted run" in p.stdout
    assert tree_bytes(out) == tree_bytes(clean)

    # The same seed gives the same bytes, another seed another order.
    again = tmp_path / "again"
    pack(src, "--output", again, *common)
    assert tree_bytes(again) == tree_bytes(clean)
    other = tmp_path / "other"
    pack(src, "--output", other, *common[:-4], "--seed", "12", "--threads", "2")
    assert (other / "shard-000000.tar").read_bytes() != (clean / "shard-000000.tar").read_bytes()


def test_a_pack_started_with_ctrl_c_ignored_goes_on_after_one(tmp_path: Path) -> None:
    """A shell starts background jobs with SIGINT ignored (and `nohup` ignores SIGHUP): the
    terminal's Ctrl-C must leave such a pack running, not end it through the handler that says
    how to resume."""
    src = tmp_path / "src"
    make_tree(src, classes=10, per_class=150, max_bytes=3000)
    out = tmp_path / "out"
    journal = out / "_shardstream" / "pack-journal.jsonl"
    proc = subprocess.Popen(
        [SHARDSTREAM, "pack", str(src), "--output", str(out), "--samples-per-shard", "16", "--threads", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not journal.exists():
        time.sleep(0.002)
    assert proc.poll() is None, "pack finished before the signal; make the tree larger"
    proc.send_signal(signal.SIGINT)
    stdout, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, (proc.returncode, err)
    assert "interrupted" not in err, err
    assert (out / "manifest.json").exists() and "1500 samples" in stdout, stdout


def test_bad_inputs_reported_skipped_or_fatal(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, classes=2, per_class=5)
    outside = tmp_path / "outside.jpg"
    outside.write_bytes(b"secret")
    (src / "c000" / "escape.jpg").symlink_to(outside)
    (src / "c000" / "dangling.jpg").symlink_to(src / "c000" / "nothing")
    with open(os.path.join(os.fsencode(src / "c001"), b"bad\xffname.jpg"), "wb") as f:
        f.write(b"x")
    out = tmp_path / "out"
    p = pack(src, "--output", out)
    for path, why in [
        ("c000/escape.jpg", "symlink outside SRC"),
        ("c000/dangling.jpg", "vanished"),
        ("c001/bad\ufffdname.jpg", "name not UTF-8"),
    ]:
        assert f"skipped {path}: {why}" in p.stderr, p.stderr
    assert "skipped 3 bad inputs" in p.stdout
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 10

    p = pack(src, "--output", tmp_path / "strict", "--strict", check=False)
    assert p.returncode == 1 and "--strict" in p.stderr
    assert any(name in p.stderr for name in ("escape.jpg", "dangling.jpg", "bad\ufffdname.jpg")), p.stderr
    assert not (tmp_path / "strict").exists(), "a refused pack left the output directory it made"


def test_a_pack_refused_before_writing_leaves_no_output_directory_it_made(tmp_path: Path) -> None:
    # "nothing to pack" (a wrong source directory) left an empty output directory behind.
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "README").write_text("no field extension: ignored")
    p = pack(src, "--output", tmp_path / "out", check=False)
    assert p.returncode == 1 and "nothing to pack" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()
    # One that was there before stays, as do the parents a pack made for its output.
    (tmp_path / "mine").mkdir()
    assert pack(src, "--output", tmp_path / "mine", check=False).returncode == 1
    assert pack(src, "--output", tmp_path / "a" / "b", check=False).returncode == 1
    assert (tmp_path / "mine").is_dir() and (tmp_path / "a").is_dir() and not (tmp_path / "a" / "b").exists()


def test_a_sample_left_out_for_one_bad_file_is_named_with_the_files_it_takes_along(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.jpg").write_bytes(b"readable")
    (src / "a" / "x.json").symlink_to(src / "a" / "nothing")
    (src / "a" / "y.jpg").write_bytes(b"2")
    (src / "a" / "y.json").write_bytes(b"3")
    out = tmp_path / "out"
    p = pack(src, "--output", out)
    assert "skipped a/x.json: vanished" in p.stderr, p.stderr
    # a/x.jpg is readable, yet not packed: the report must say so, not only name a/x.json.
    assert "left out sample a/x (1 other file not packed)" in p.stderr, p.stderr
    assert "left out 1 sample for its bad inputs (1 other file not packed)" in p.stdout, p.stdout
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 1


def test_bad_entries_in_files_from(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=4)
    (tmp_path / "outside.jpg").write_bytes(b"o")
    good = ["c000/000000.jpg", "c000/000001.jpg", "./c000/000002.jpg"]
    bad = {
        "../outside.jpg": "path outside SRC",
        "c000/../c000/000003.jpg": "path outside SRC",
        "c000/missing.jpg": "vanished",
        "c000/000000.jpg/x.jpg": "unreadable",  # ENOTDIR: unreadable even when tests run as root
        "c000/000001.jpg": "duplicate key",  # listed twice
    }
    listing = "\n".join(good + list(bad)) + "\n"
    out = tmp_path / "out"
    p = subprocess.run(
        [SHARDSTREAM, "pack", str(src), "--output", str(out), "--files-from", "-"],
        input=listing,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    for entry, why in bad.items():
        assert f"skipped {entry}: {why}" in p.stderr, (entry, p.stderr)
    assert f"skipped {len(bad)} bad inputs" in p.stdout
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 3

    for i, entry in enumerate(bad):
        lst = tmp_path / f"list{i}"
        lst.write_text(f"c000/000001.jpg\n{entry}\n")
        p = pack(src, "--output", tmp_path / f"strict{i}", "--files-from", lst, "--strict", check=False)
        assert p.returncode == 1, (entry, p.stdout)
        assert "--strict" in p.stderr and (entry in p.stderr or "c000/000001.jpg" in p.stderr), p.stderr
        assert not (tmp_path / f"strict{i}" / "manifest.json").exists()


def test_a_list_relative_to_the_working_directory_or_of_files_all_gone_packs_nothing_and_says_so(
    tmp_path: Path,
) -> None:
    """`find raw | shardstream pack raw --files-from -` named every file from the working
    directory: each was reported "vanished" under SRC, a manifest of 0 samples was written, exit 0."""
    src = tmp_path / "raw"
    make_tree(src, classes=1, per_class=3)
    listing = "".join(f"raw/{p.relative_to(src)}\n" for p in sorted(src.rglob("*.jpg")))
    out = tmp_path / "out"
    p = subprocess.run(
        [SHARDSTREAM, "pack", "raw", "--output", str(out), "--files-from", "-"],
        input=listing, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 1, p.stdout
    assert "--files-from entries are relative to SRC" in p.stderr and '"raw/c000/' in p.stderr, p.stderr
    assert not out.exists(), "the output directory it made is removed"
    # A first entry gone from SRC whose name happens to exist from the working directory, outside
    # SRC (an older copy of the tree), is not that mistake: reported gone, the rest packed.
    (tmp_path / "c000").mkdir()
    (tmp_path / "c000" / "gone.jpg").write_bytes(b"old")
    p = subprocess.run(
        [SHARDSTREAM, "pack", "raw", "--output", str(out), "--files-from", "-"],
        input="c000/gone.jpg\nc000/000000.jpg\n", cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0 and "skipped c000/gone.jpg: vanished" in p.stderr, p.stderr
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 1
    shutil.rmtree(out)
    # Files named right but gone (or unreadable) by the time they are read: nothing to publish.
    lst = tmp_path / "gone"
    lst.write_text("c000/nope-1.jpg\nc000/nope-2.jpg\n")
    p = pack(src, "--output", out, "--files-from", lst, check=False)
    assert p.returncode == 1, p.stdout
    assert "nothing packed: none of the 2 files named in" in p.stderr and "(2 vanished)" in p.stderr, p.stderr
    assert not (out / "manifest.json").exists()
    # Its journal holds no shard: the list put right packs into the same output.
    lst.write_text("".join(f"{p.relative_to(src)}\n" for p in sorted(src.rglob("*.jpg"))))
    pack(src, "--output", out, "--files-from", lst)
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 3


def test_an_output_inside_src_that_holds_inputs_is_refused_not_left_out(tmp_path: Path) -> None:
    # The walk skips the output directory: `pack SRC --output SRC/c001` packed c000 alone and
    # said nothing of c001's 3 files.
    src = tmp_path / "src"
    make_tree(src, classes=2, per_class=3)
    p = pack(src, "--output", src / "c001", check=False)
    assert p.returncode != 0, p.stdout
    assert "inside the source directory" in p.stderr and "000003.jpg" in p.stderr, p.stderr
    assert not (src / "c001" / "manifest.json").exists()
    # An output of its own inside SRC is fine, and so is packing into it again.
    for _ in range(2):
        pack(src, "--output", src / "packed")
        assert json.loads((src / "packed" / "manifest.json").read_text())["total_samples"] == 6


def test_many_bad_inputs_of_a_kind_are_named_by_the_first_few_and_counted(tmp_path: Path) -> None:
    # `--label-from-dir` over a tree that has its `.cls` files already printed a line for each
    # of them (50,000 in the trial), burying everything else the pack said.
    src = tmp_path / "src"
    make_tree(src, classes=2, per_class=40)
    for jpg in src.rglob("*.jpg"):
        jpg.with_suffix(".cls").write_text("7")
    p = pack(src, "--output", tmp_path / "out", "--label-from-dir")
    skipped = [line for line in p.stderr.splitlines() if "pack: skipped" in line]
    assert len(skipped) == 20, p.stderr
    assert "further duplicate key inputs are only counted" in p.stderr, p.stderr
    assert "skipped 80 bad inputs (80 duplicate key)" in p.stdout + p.stderr, (p.stdout, p.stderr)


def test_an_s3_source_is_said_to_be_no_local_directory(tmp_path: Path) -> None:
    # `pack s3://bucket/prefix/ --output ...` said "path not found: s3://bucket/prefix/", as if
    # the prefix were missing.
    p = pack("s3://bkt/wds/", "--output", tmp_path / "out", check=False)
    assert p.returncode != 0
    assert "s3://bkt/wds/ is an S3 URL" in p.stderr and "local directory" in p.stderr, p.stderr
    assert "not found" not in p.stderr, p.stderr


def test_files_from_refuses_symlinked_directory_leaving_src(tmp_path: Path) -> None:
    # Issue #13 defect 7: `a` is a symlink to a directory outside SRC; `a/x.jpg` must be refused
    # (named in the error), and none of the outside bytes may end up in a shard.
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=3)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = b"secret-bytes-outside-src-" * 8
    (outside / "x.jpg").write_bytes(secret)
    (src / "a").symlink_to(outside, target_is_directory=True)
    (src / "deep").mkdir()
    (src / "deep" / "up").symlink_to("../..", target_is_directory=True)  # relative escape
    lst = tmp_path / "list"
    lst.write_text("c000/000000.jpg\nc000/000001.jpg\na/x.jpg\ndeep/up/outside/x.jpg\n")
    out = tmp_path / "out"
    p = pack(src, "--output", out, "--files-from", lst)
    for entry in ("a/x.jpg", "deep/up/outside/x.jpg"):
        assert f"skipped {entry}: symlink outside SRC" in p.stderr, (entry, p.stderr)
    assert "skipped 2 bad inputs" in p.stdout
    assert json.loads((out / "manifest.json").read_text())["total_samples"] == 2
    for shard in out.glob("*.tar"):
        assert secret not in shard.read_bytes()

    strict = tmp_path / "strict"
    lst.write_text("a/x.jpg\n")
    p = pack(src, "--output", strict, "--files-from", lst, "--strict", check=False)
    assert p.returncode == 1 and "a/x.jpg" in p.stderr, p.stderr
    assert not (strict / "manifest.json").exists()


def s3_env(s3: S3Server, home: Path) -> dict[str, str]:
    """The server's endpoint and credentials, and a private place for the pack's local state."""
    return {**os.environ, **s3.env(), "XDG_CACHE_HOME": str(home)}


def test_dest_with_another_dataset_and_s3(tmp_path: Path, s3: S3Server) -> None:
    src = tmp_path / "src"
    make_tree(src, classes=1, per_class=3)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train-000000.tar").write_bytes(b"made elsewhere")
    p = pack(src, "--output", foreign, check=False)
    assert p.returncode == 1 and "already holds" in p.stderr and "train-000000.tar" in p.stderr
    # The same refusal for a prefix of a bucket, and errors that name the bucket or URL.
    (s3.bucket("foreign") / "ds").mkdir()
    (s3.bucket("foreign") / "ds" / "train-000000.tar").write_bytes(b"made elsewhere")
    env = s3_env(s3, tmp_path / "cache")
    p = pack(src, "--output", "s3://foreign/ds/", check=False, env=env)
    assert p.returncode == 1 and "s3://foreign/ds/ already holds a dataset (train-000000.tar)" in p.stderr, p.stderr
    p = pack(src, "--output", "s3://no-such-bucket/ds/", check=False, env=env)
    assert p.returncode == 1 and "not found" in p.stderr and "s3://no-such-bucket/ds/" in p.stderr, p.stderr
    p = pack(src, "--output", "s3://foreign/new/", check=False, env={**env, **s3.env(secret="wrong")})
    assert p.returncode == 1 and "access denied to s3://foreign/new/" in p.stderr, p.stderr
    assert "wrong" not in p.stderr, "credentials never appear in errors"
    for bad in ("s3:///ds/", "s3://b/ds/x-{1..2}.tar"):
        p = pack(src, "--output", bad, check=False, env=env)
        assert p.returncode == 1 and bad in p.stderr, p.stderr
    p = pack(src, "--output", "s3://foreign/x/", "--s3-part-size", "1MiB", check=False, env=env)
    # Refused by the command-line parser now (a usage error: exit 2), before anything is touched.
    assert p.returncode == 2 and "--s3-part-size must be at least 5 MiB" in p.stderr, p.stderr
    p = subprocess.run([SHARDSTREAM, "pack", "--help"], capture_output=True, text=True, check=True)
    for flag in (
        "--files-from",
        "--shard-size",
        "--samples-per-shard",
        "--key-regex",
        "--label-from-dir",
        "--resume",
        "s3://",
        "--s3-part-size",
    ):
        assert flag in p.stdout


# ~6 MiB shards, so that every full shard is a multipart upload of a 5 MiB part (S3's smallest)
# and a last part, and the last shard of a pack a single PUT.
S3_OPTS = ["--shard-size", "6MiB", "--s3-part-size", "5MiB", "--s3-multipart-threshold", "5MiB", "--threads", "2"]


@pytest.fixture(scope="module")
def s3_tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Samples, Path]:
    """~36 MB of samples, and the same packed into a local directory (the bytes S3 must hold)."""
    root = tmp_path_factory.mktemp("s3tree")
    samples = make_tree(root / "src", classes=4, per_class=300, seed=5, max_bytes=60_000)
    local = root / "local"
    pack(root / "src", "--output", local, *S3_OPTS)
    return root / "src", samples, local


def test_pack_to_s3_holds_the_local_bytes_and_streams_back(tmp_path: Path, s3: S3Server, s3_tree) -> None:
    src, samples, local = s3_tree
    env = s3_env(s3, tmp_path / "cache")
    s3.bucket("out")
    p = pack(src, "--output", "s3://out/wds/", *S3_OPTS, env=env)
    assert "wrote s3://out/wds/manifest.json" in p.stdout, p.stdout
    # The wait for the last uploads is said (the bar stood at 100% for most of a run of large
    # shards), and without a terminal too.
    assert re.search(r"all files read; waiting for \d+ shards? \(\d+ MB\) to reach s3://out/wds/", p.stderr), p.stderr
    # Objects are files of the server's directory: the bucket holds exactly the local pack's tree
    # (shards, sidecars, journal, manifest), byte for byte.
    expected = tree_bytes(local)
    assert tree_bytes(s3.root / "out" / "wds") == expected
    shards = json.loads(expected["manifest.json"])["shards"]
    assert len(shards) >= 5 and max(s["bytes"] for s in shards) > 5 << 20 >= shards[-1]["bytes"]
    assert not list((tmp_path / "cache").rglob("*.tmp")), "scratch files are deleted once uploaded"

    d = Daemon(tmp_path / "daemon", env=s3.env()).start()
    try:
        loader = shardstream.Loader("s3://out/wds/", batch_size=64, shuffle=True, seed=2, connect=d.addr)
        got: Samples = {}
        for batch in loader:
            for i, key in enumerate(batch["__key__"]):
                assert key not in got, f"{key} delivered twice"
                got[key] = {f: bytes(batch[f][i]) for f in ("jpg", "json") if batch[f][i] is not None}
        assert got == samples
    finally:
        assert d.stop() == 0

    # A different dataset into the same prefix is refused, also without this machine's journal
    # (the bucket's copy tells), and the prefix is left as it was.
    other = tmp_path / "other"
    make_tree(other, classes=1, per_class=5, seed=9)
    for home in ("cache", "elsewhere"):
        p = pack(other, "--output", "s3://out/wds/", *S3_OPTS, check=False, env=s3_env(s3, tmp_path / home))
        assert p.returncode == 1 and "s3://out/wds/ already holds a complete different dataset" in p.stderr, p.stderr
    assert tree_bytes(s3.root / "out" / "wds") == expected


def test_pack_parquet_to_s3_serves_views_from_the_node_cache_copies(tmp_path: Path, s3: S3Server, s3_tree) -> None:
    """`pack --format parquet` to S3, then `binary_views`: the payloads pack wrote uncompressed are
    served from the node cache's copies of the files (the trainer maps the copies), and nothing
    is decoded into segments or kept."""
    src, samples, _ = s3_tree
    s3.bucket("pqout")
    pack(src, "--output", "s3://pqout/pq/", "--format", "parquet", *S3_OPTS, env=s3_env(s3, tmp_path / "cache"))
    manifest = json.loads((s3.root / "pqout" / "pq" / "manifest.json").read_text())
    assert manifest["footers"] == "_shardstream/footers.idx" and len(manifest["shards"]) > 2, manifest
    d = Daemon(tmp_path / "daemon", env=s3.env()).start()
    shards = d.cache_dir / "shards"
    try:
        # The open reads the manifest and the footers bundle pack wrote: two requests, not one
        # footer read per file.
        info = shardstream._native.Connection(d.addr).open("s3://pqout/pq/")
        assert info["num_samples"] == len(samples)
        assert d.status()["storage_requests"] == 2
        loader = shardstream.Loader(
            "s3://pqout/pq/", batch_size=64, seed=3, connect=d.addr, format="arrow", binary_views=True
        )
        got: Samples = {}
        for rb in loader:
            homes = view_homes(rb.column("jpg"), shards)
            assert homes, "a view column without data buffers"
            for home in homes:
                assert len(home) == 1 and home[0].endswith(".parquet"), homes
            cols = {f: rb.column(f).to_pylist() for f in ("__key__", "jpg", "json")}
            for i, key in enumerate(cols["__key__"]):
                assert key not in got, f"{key} delivered twice"
                got[key] = {f: cols[f][i] for f in ("jpg", "json") if cols[f][i] is not None}
        assert got == samples
        assert not list(shards.glob("derived-*")), "nothing kept"
    finally:
        assert d.stop() == 0


def test_a_killed_pack_to_s3_has_its_unfinished_uploads_aborted_by_the_next(tmp_path: Path, s3_tree) -> None:
    # A pack killed mid-upload left its multipart uploads in the bucket (the trial: 6 uploads,
    # ~300 MB of parts after two kills), and the resume that finished the dataset left them too:
    # parts nothing lists and the store bills for. A server of its own: its uploads are this
    # test's alone.
    src, _, local = s3_tree
    s3 = S3Server(tmp_path / "s3").start()
    try:
        s3.bucket("out")
        env = s3_env(s3, tmp_path / "cache")

        def unfinished() -> list[Path]:
            return list(s3.root.glob(".upload-*.json"))

        def noted() -> bool:
            # Every upload the server holds has a part on its way, so the pack has noted it (the
            # microseconds between the server's answer and the note are the lifecycle rule's to
            # catch, and not this test's).
            started = {p.name[len(".upload-") : -len(".json")] for p in unfinished()}
            sent = {p.name.split(".part-")[0][len(".upload_id-") :] for p in s3.root.glob(".upload_id-*.part-*")}
            return bool(started) and started <= sent

        killed = 0
        for _ in range(2):
            proc = subprocess.Popen(
                [SHARDSTREAM, "pack", str(src), "--output", "s3://out/wds/", *S3_OPTS, "--resume"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                if noted():
                    # Frozen, then looked at again once what it had sent has landed: a kill
                    # right after a look could fall between a new upload and its note.
                    proc.send_signal(signal.SIGSTOP)
                    time.sleep(0.05)
                    if noted():
                        break
                    proc.send_signal(signal.SIGCONT)
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed += len(unfinished())
        assert killed, "no pack was killed mid-upload; make the tree larger"
        p = pack(src, "--output", "s3://out/wds/", *S3_OPTS, "--resume", env=env)
        assert unfinished() == [], (p.stdout, p.stderr)
        assert tree_bytes(s3.root / "out" / "wds") == tree_bytes(local)
    finally:
        s3.stop()


@pytest.mark.parametrize("resume_on", ["this machine", "another machine"])
def test_pack_to_s3_resumes_after_kill(tmp_path: Path, s3: S3Server, s3_tree, resume_on: str) -> None:
    # Another machine has none of the pack's local state: only what the bucket holds.
    src, _, local = s3_tree
    env = s3_env(s3, tmp_path / "cache")
    out = f"s3://out/killed-{resume_on.split()[0]}/"
    s3.bucket("out")
    proc = subprocess.Popen(
        [SHARDSTREAM, "pack", str(src), "--output", out, *S3_OPTS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 120
    journal = None
    while time.monotonic() < deadline and proc.poll() is None:
        journal = journal or next((tmp_path / "cache").rglob("pack-journal.jsonl"), None)
        # The header and two uploaded shards: the rest is still being packed or uploaded.
        if journal and journal.read_text().count("\n") >= 3:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "pack finished before it could be killed; make the tree larger"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    prefix = s3.root / "out" / out.removeprefix("s3://out/").rstrip("/")
    assert not (prefix / "manifest.json").exists()
    if resume_on == "this machine":
        # Shards and no manifest: an unfinished pack, which a reader must not take for a dataset.
        # A glob over its shards lists only what the glob can match, and is refused the same way.
        d = Daemon(tmp_path / "daemon", env=s3.env()).start()
        try:
            for url in (out, f"{out}shard-*.tar"):
                with pytest.raises(ValueError, match="unfinished") as refused:
                    next(iter(shardstream.Loader(url, batch_size=4, connect=d.addr)))
            # The refusal names the shards uploaded so far (two at least), by a pattern that opens.
            named = re.search(r"shards there so far knowingly, name them \((s3://\S+\.tar)\)", str(refused.value))
            assert named, refused.value
            uploaded = sorted(p.name for p in prefix.glob("shard-*.tar"))
            assert named.group(1) == f"{out}shard-{{{uploaded[0][6:12]}..{uploaded[-1][6:12]}}}.tar", uploaded
            assert sum(len(b) for b in shardstream.Loader(named.group(1), batch_size=4, connect=d.addr)) > 0
        finally:
            d.stop()

    if resume_on == "this machine":
        p = pack(src, "--output", out, *S3_OPTS, "--resume", env=env)
        assert "kept from the interrupted run" in p.stdout, p.stdout
    else:
        p = pack(src, "--output", out, *S3_OPTS, "--resume", env=s3_env(s3, tmp_path / "elsewhere"), check=False)
        assert p.returncode == 0, p.stderr
        # The first machine's own journal (2 shards) is behind the bucket's now: --resume there
        # packed and uploaded again every shard the other machine had finished (same bytes).
        shards = sorted(prefix.glob("shard-*.tar"))
        stamps = {s.name: s.stat().st_mtime_ns for s in shards}
        p = pack(src, "--output", out, *S3_OPTS, "--resume", env=env)
        assert f"{len(shards)} shards kept from the interrupted run" in p.stdout, p.stdout
        assert {s.name: s.stat().st_mtime_ns for s in shards} == stamps, "shards uploaded again"
    assert tree_bytes(prefix) == tree_bytes(local)
