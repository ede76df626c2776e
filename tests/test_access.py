"""Who may connect: --socket-mode/--socket-group let another user of the group reach the daemon,
the socket never exists with a wider mode, and the config file's `allow` list restricts the
datasets a peer (SO_PEERCRED) may open: a refused dataset is a PermissionError naming the URL."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardstream
from conftest import SHARDSTREAM, Daemon, hold_streams, wait_for, write_dataset

NOBODY = 65534  # nobody:nogroup on Debian


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is root's, mode 0700)."""
    d = Path(tempfile.mkdtemp(prefix="shardstream-access-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


CLIENT = textwrap.dedent(
    """
    # Imports first (the Python environment lives under root's 0700 home), then become the
    # given user: setuid from root drops every capability, so connecting is checked by the kernel
    # exactly as for that user.
    import sys, os, shardstream
    uid, gid = int(sys.argv[3]), int(sys.argv[4])
    if uid != os.getuid():
        os.setgroups([]); os.setgid(gid); os.setuid(uid)
    try:
        n = sum(len(b["__key__"]) for b in shardstream.Loader(sys.argv[1], batch_size=16, connect=sys.argv[2]))
        print("ok", os.getuid(), n)
    except PermissionError as e:
        print("PermissionError", e)
    except ConnectionError as e:
        print("ConnectionError", e)
    """
)


def run_client(url: str, addr: str, uid: int = 0, gid: int = 0) -> str:
    r = subprocess.run(
        [sys.executable, "-c", CLIENT, url, addr, str(uid), str(gid)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root (setpriv)")


def test_socket_mode_and_group_are_set(tmp_path: Path) -> None:
    d = Daemon(tmp_path / "run", args=["--socket-mode", "0660", "--socket-group", str(os.getgid())]).start()
    try:
        for p in (tmp_path / "run" / "sock", tmp_path / "run" / "sock.shm"):
            st = p.stat()
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()
        # The daemon created the directory: group-traversable, since the group may connect.
        assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o750
        # No staging leftovers beside the sockets.
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["cache", "sock", "sock.shm"]
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("bad", ["0444", "rw", "01777"])
def test_bad_socket_mode_is_refused(tmp_path: Path, bad: str) -> None:
    r = subprocess.run(
        [SHARDSTREAM, "serve", "--listen", f"unix://{tmp_path}/sock", "--socket-mode", bad],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode != 0 and "socket-mode" in r.stderr
    assert not (tmp_path / "sock").exists()


@needs_root
def test_group_member_of_another_uid_connects_only_with_group_access(shared_dir: Path) -> None:
    data = shared_dir / "data"
    write_dataset(data, n=50, per_shard=10)
    # Owner-only (the default): nobody is refused by the kernel, which is a PermissionError
    # (it was a ConnectionError, as for a daemon that is down) that says who decides.
    d = Daemon(shared_dir / "a").start()
    try:
        out = run_client(str(data), d.addr, NOBODY, NOBODY)
        assert out.startswith("PermissionError") and "--socket-mode" in out, out
        assert "not serving" not in out and d.addr in out, out
    finally:
        assert d.stop() == 0
    # Group access for nogroup: nobody (primary group nogroup) streams the dataset.
    d = Daemon(shared_dir / "b", args=["--socket-mode", "0660", "--socket-group", "nogroup"]).start()
    try:
        out = run_client(str(data), d.addr, NOBODY, NOBODY)
        assert out.startswith(f"ok {NOBODY} "), out
    finally:
        assert d.stop() == 0


@needs_root
def test_one_client_past_its_streams_is_refused_and_another_is_served(shared_dir: Path) -> None:
    """--max-streams bounds streams over all clients, so one client holding streams it never
    reads could take every one of them. With --max-streams-per-client each client (a uid on the
    Unix socket) gets its own bound: the next stream of the client at it is refused by name,
    another uid's stream is served meanwhile, and an ended stream frees its place."""
    data = shared_dir / "data"
    samples = write_dataset(data, n=50, per_shard=10)
    args = ["--socket-mode", "0660", "--socket-group", "nogroup", "--max-streams-per-client", "2"]
    d = Daemon(shared_dir / "run", args=args).start()
    try:
        held = hold_streams(str(data), 2, connect=d.addr)
        refused = r"at most 2 streams at once \(--max-streams-per-client\), and uid 0 holds as many"
        with pytest.raises(shardstream.ShardstreamError, match=refused):
            hold_streams(str(data), 1, connect=d.addr)
        assert run_client(str(data), d.addr, NOBODY, NOBODY) == f"ok {NOBODY} {len(samples)}"
        held.pop().close()  # type: ignore[attr-defined]
        assert wait_for(lambda: d.status()["active_streams"] < 2)
        got = sum(len(b["__key__"]) for b in shardstream.Loader(str(data), batch_size=16, connect=d.addr))
        assert got == len(samples)
    finally:
        assert d.stop() == 0


PACKED_CLIENT = textwrap.dedent(
    """
    # numpy too: the packed arrays need it, and the environment is under root's 0700 home.
    import sys, os, numpy, shardstream
    uid, gid = int(sys.argv[3]), int(sys.argv[4])
    if (uid, gid) != (os.getuid(), os.getgid()):
        os.setgroups([]); os.setgid(gid); os.setuid(uid)
    loader = shardstream.Loader(sys.argv[1], batch_size=8, fields=["tok"], collate="stack", connect=sys.argv[2])
    print("ok", os.getuid(), sum(len(b["__key__"]) for b in loader))
    """
)


@needs_root
def test_a_kept_ring_goes_only_to_a_client_with_the_same_uid_and_gid(shared_dir: Path) -> None:
    """A ring kept after a stream holds that client's batches: the next stream of another user
    (who may be refused those datasets) gets a ring of its own."""
    import webdataset as wds

    data = shared_dir / "tokens"
    data.mkdir()
    with wds.ShardWriter(str(data / "tok-%04d.tar"), maxcount=20, verbose=0) as sink:
        for i in range(40):
            sink.write({"__key__": f"t{i:04d}", "tok": i.to_bytes(4, "little") * 64})
    d = Daemon(shared_dir / "c", args=["--socket-mode", "0660", "--socket-group", "nogroup"]).start()

    def epoch(uid: int, gid: int) -> tuple[int, int]:
        r = subprocess.run(
            [sys.executable, "-c", PACKED_CLIENT, str(data), d.addr, str(uid), str(gid)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and r.stdout.strip() == f"ok {uid} 40", r.stderr or r.stdout
        assert wait_for(lambda: d.status()["shm_sessions"] == 0, timeout=10)
        st = d.status()
        return st["rings_made"], st["rings_reused"]

    try:
        assert epoch(0, 0) == (1, 0)
        assert epoch(NOBODY, NOBODY) == (2, 0), "another user makes its own ring"
        assert epoch(0, 0) == (2, 1), "root's ring back for root"
        assert epoch(0, NOBODY) == (3, 1), "same user, another group: its own"
    finally:
        assert d.stop() == 0


def write_config(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def own_uid_daemon(tmp: Path, *roots: str | Path) -> Daemon:
    """A daemon whose allow list gives this process's uid `roots` only."""
    listed = ", ".join(f'"{r}"' for r in roots)
    cfg = write_config(tmp / "shardstream.toml", f"[[allow]]\nuid = {os.getuid()}\nroots = [{listed}]\n")
    d = Daemon(tmp / "d", args=["--config", str(cfg)])
    d.tmp.mkdir()
    return d.start()


def two_users_daemon(shared_dir: Path) -> tuple[Path, Path, Daemon]:
    """Datasets a and b; nobody may open a, root everything: the daemon serving them."""
    a, b = shared_dir / "a-data", shared_dir / "b-data"
    write_dataset(a, n=30, per_shard=10)
    write_dataset(b, n=30, per_shard=10, seed=1)
    cfg = write_config(
        shared_dir / "cfg.toml",
        f"""
        socket-mode = "0666"
        [[allow]]
        uid = {NOBODY}
        roots = ["{a}"]
        [[allow]]
        uid = 0
        roots = ["{shared_dir}"]
        """,
    )
    return a, b, Daemon(shared_dir / "d", args=["--config", str(cfg)]).start()


def test_dataset_outside_the_allow_list_is_a_permission_error(dataset, tmp_path: Path) -> None:
    root, samples = dataset
    other = tmp_path / "other"
    write_dataset(other, n=20, per_shard=10)
    d = own_uid_daemon(tmp_path, root, "s3://allowed-bucket/datasets")
    try:
        got = sum(len(b["__key__"]) for b in shardstream.Loader(str(root), batch_size=64, connect=d.addr))
        assert got == len(samples)
        for refused in [str(other), f"{root}/../{other.name}", f"{root}ing", "s3://allowed-bucket/datasets-private/"]:
            with pytest.raises(PermissionError, match=refused.replace("/", ".")[:40]):
                next(iter(shardstream.Loader(refused, batch_size=4, connect=d.addr)))
        # prefetch is checked too (the CLI reports the refusal and fails).
        r = subprocess.run(
            [SHARDSTREAM, "prefetch", str(other), "--connect", d.addr], capture_output=True, text=True, timeout=60
        )
        assert r.returncode != 0 and str(other) in r.stderr
    finally:
        assert d.stop() == 0


@needs_root
def test_allow_list_is_per_uid(shared_dir: Path) -> None:
    a, b, d = two_users_daemon(shared_dir)
    try:
        assert run_client(str(a), d.addr, NOBODY, NOBODY).startswith(f"ok {NOBODY}")
        out = run_client(str(b), d.addr, NOBODY, NOBODY)
        assert out.startswith("PermissionError") and str(b) in out, out
        assert run_client(str(b), d.addr).startswith("ok 0")
    finally:
        assert d.stop() == 0


def test_shards_linked_from_inside_a_root_to_outside_it_are_refused(tmp_path: Path) -> None:
    # The allow list checks the URL, but the daemon reads the shards the listing finds: a link to
    # a shard (or a partition directory, or a manifest's entry) outside the root, made by anyone
    # who may write inside it, must not serve the files it leads to.
    allowed, secret = tmp_path / "allowed", tmp_path / "secret"
    write_dataset(secret, n=20, per_shard=10, seed=5)
    own = write_dataset(allowed / "own", n=20, per_shard=10, seed=1)
    links = {"evil": secret, "inside": allowed / "own"}
    for name, target in links.items():
        (allowed / name).mkdir()
        for shard in sorted(target.glob("*.tar")):
            (allowed / name / shard.name).symlink_to(shard)
    # Partitions are Parquet's: a linked `key=value` directory of Parquet files.
    secret_pq = tmp_path / "secret-pq"
    secret_pq.mkdir()
    pq.write_table(pa.table({"id": list(range(10))}), secret_pq / "part-0.parquet")
    (allowed / "parts").mkdir()
    (allowed / "parts" / "split=a").symlink_to(secret_pq, target_is_directory=True)
    (allowed / "listed").mkdir()
    (allowed / "listed" / "sub").symlink_to(secret, target_is_directory=True)
    # The secret dataset's own manifest, its shards named through the link.
    subprocess.run([SHARDSTREAM, "index", str(secret)], check=True, capture_output=True, timeout=60)
    manifest = json.loads((secret / "manifest.json").read_text())
    for shard in manifest["shards"]:
        shard["name"] = f"sub/{shard['name']}"
        shard.pop("index", None)
    (allowed / "listed" / "manifest.json").write_text(json.dumps(manifest))
    d = own_uid_daemon(tmp_path, allowed)
    try:

        def keys(url: str) -> set[str]:
            return {k for b in shardstream.Loader(url, batch_size=8, connect=d.addr) for k in b["__key__"]}

        assert keys(str(allowed / "own")) == set(own)
        # Links that stay inside the roots are as good as the files.
        assert keys(str(allowed / "inside")) == set(own)
        refused = [
            (allowed / "evil", secret),
            (f"{allowed / 'evil'}/*.tar", secret),
            (allowed / "parts", secret_pq),
            (allowed / "listed", secret),
        ]
        for url, target in refused:
            with pytest.raises(PermissionError, match=str(target)):
                keys(str(url))
            # Nothing of it is described either: no sample count, no size.
            with pytest.raises(PermissionError):
                shardstream._native.Connection(d.addr).open(str(url), "auto")
    finally:
        assert d.stop() == 0


def test_a_brace_pattern_of_a_million_names_does_not_hold_up_the_daemon(tmp_path: Path) -> None:
    # Every name of a pattern is checked against the allow list. A 77-byte URL naming a million
    # files (within the pattern limits) took 28 s to check, on the daemon's async workers: with
    # two such requests in flight, no other client's request was answered for a minute.
    allowed = tmp_path / "allowed"
    write_dataset(allowed, n=10, per_shard=10)
    d = own_uid_daemon(tmp_path, allowed)
    try:
        url = f"{allowed}/x{{0..9}}{{0..9}}{{0..9}}{{0..9}}{{0..9}}{{0..9}}.tar"

        def open_many() -> object:
            try:
                return shardstream._native.Connection(d.addr).open(url, "auto")
            except FileNotFoundError as e:
                return e

        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            opens = [pool.submit(open_many) for _ in range(2)]
            time.sleep(0.3)
            t0 = time.monotonic()
            status = d.status()
            answered = time.monotonic() - t0
            assert status["version"], status
            assert answered < 2, f"status took {answered:.1f} s while two opens were checked"
            for f in opens:
                assert isinstance(f.result(timeout=120), FileNotFoundError)
        assert time.monotonic() - started < 30
    finally:
        assert d.stop() == 0


STATUS_CLIENT = textwrap.dedent(
    """
    import sys, os, json, shardstream
    uid = int(sys.argv[2])
    if uid != os.getuid():
        os.setgroups([]); os.setgid(uid); os.setuid(uid)
    s = shardstream._native.Connection(sys.argv[1]).status()
    print(json.dumps(sorted(d[0] if isinstance(d, (list, tuple)) else d["url"] for d in s["datasets"])))
    """
)


@needs_root
def test_status_names_only_the_datasets_the_peer_may_open(shared_dir: Path) -> None:
    # The daemon's status listed every dataset any peer had opened: a user the allow list keeps
    # out of another's data still learned its paths, sizes and sample counts.
    a, b, d = two_users_daemon(shared_dir)
    try:
        assert run_client(str(a), d.addr, NOBODY, NOBODY).startswith(f"ok {NOBODY}")
        assert run_client(str(b), d.addr).startswith("ok 0")

        def status_as(uid: int) -> list[str]:
            r = subprocess.run(
                [sys.executable, "-c", STATUS_CLIENT, d.addr, str(uid)], capture_output=True, text=True, timeout=60
            )
            assert r.returncode == 0, r.stderr
            return json.loads(r.stdout)

        assert status_as(NOBODY) == [str(a)]
        assert status_as(0) == sorted([str(a), str(b)])
    finally:
        assert d.stop() == 0


CLI_AS = textwrap.dedent(
    """
    import sys, os, shardstream._native as native
    uid = int(sys.argv[1])
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
    sys.exit(native.cli_main(["shardstream", *sys.argv[2:]]))
    """
)


@needs_root
def test_status_of_a_user_the_socket_refuses_says_so_at_once(shared_dir: Path) -> None:
    # It said "daemon at ... is not serving", and with --wait retried until the wait ran out.
    d = Daemon(shared_dir / "a").start()
    try:
        started = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-c", CLI_AS, str(NOBODY), "status", "--connect", d.addr, "--wait", "20"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and time.monotonic() - started < 10, r.stderr
        assert "not serving" not in r.stderr and "permission denied" in r.stderr.lower(), r.stderr
        assert "--socket-mode" in r.stderr, r.stderr
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("linked", ["manifest", "sidecar"])
def test_metadata_linked_out_of_the_roots_is_refused_not_read(tmp_path: Path, linked: str) -> None:
    """Shards are checked against the roots where they really lie; a dataset's manifest.json
    and the sidecars it names were read wherever a link led. Anyone who may write inside a root
    could point them at another user's dataset: its shard names came back in errors, its counts
    and fields were served as this dataset's."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    write_dataset(outside / "ds", n=20, per_shard=10)
    subprocess.run([SHARDSTREAM, "index", str(outside / "ds")], check=True, capture_output=True, timeout=120)
    mine = allowed / "mine"
    write_dataset(mine, n=20, per_shard=10)  # the same shard names, inside the root
    subprocess.run([SHARDSTREAM, "index", str(mine)], check=True, capture_output=True, timeout=120)
    if linked == "manifest":
        (mine / "manifest.json").unlink()
        (mine / "manifest.json").symlink_to(outside / "ds" / "manifest.json")
    else:
        side = next((mine / "_shardstream").glob("*.idx"))
        side.unlink()
        side.symlink_to(outside / "ds" / "_shardstream" / side.name)
    d = own_uid_daemon(tmp_path, allowed)
    try:
        with pytest.raises(PermissionError, match="leads out of the dataset's directory"):
            next(iter(shardstream.Loader(str(mine), batch_size=4, connect=d.addr)))
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("how", ["linked", "relative"])
def test_a_node_cache_named_through_a_link_or_relatively_serves_under_an_allow_list(tmp_path: Path, how: str) -> None:
    """Confined opens compare where a descriptor leads with the path opened, and node-cache
    copies were opened by the path `--cache-dir` gave: a cache directory named through a link
    (`/var/cache` linked to a larger disk) or relatively had every copy refused as "replaced by a
    link", so no S3 dataset (nor `cache="copy"`) could be read under an allow list."""
    allowed = tmp_path / "allowed"
    samples = write_dataset(allowed, n=20, per_shard=10)
    cfg = write_config(tmp_path / "shardstream.toml", f'[[allow]]\nuid = {os.getuid()}\nroots = ["{allowed}"]\n')
    d = Daemon(tmp_path / "d", args=["--config", str(cfg)], cwd=tmp_path)
    d.tmp.mkdir()
    (tmp_path / "disk").mkdir(mode=0o700)
    if how == "linked":
        (tmp_path / "cache-link").symlink_to(tmp_path / "disk")
        d.cache_dir = tmp_path / "cache-link"
    else:
        d.cache_dir = Path("disk")
    d.start()
    try:
        loader = shardstream.Loader(str(allowed), batch_size=4, connect=d.addr, cache="copy")
        keys = [k for b in loader for k in b["__key__"]]
        assert sorted(keys) == sorted(samples)
        assert list((tmp_path / "disk" / "shards").iterdir()), "the copies are in the cache's real directory"
    finally:
        assert d.stop() == 0


def test_metadata_linked_inside_the_dataset_is_read_under_an_allow_list(tmp_path: Path) -> None:
    """Metadata is read by its real location once the allow list has checked it; a manifest
    linked to a file inside the dataset's directory still serves."""
    allowed = tmp_path / "allowed"
    mine = allowed / "mine"
    samples = write_dataset(mine, n=20, per_shard=10)
    subprocess.run([SHARDSTREAM, "index", str(mine)], check=True, capture_output=True, timeout=120)
    manifest = json.loads((mine / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][:1]  # it lists one shard of two: what it serves shows it was read
    first = manifest["shards"][0]
    manifest["total_samples"], manifest["total_bytes"] = first["samples"], first["bytes"]
    (mine / "_shardstream" / "kept.json").write_text(json.dumps(manifest))
    (mine / "manifest.json").unlink()
    (mine / "manifest.json").symlink_to(mine / "_shardstream" / "kept.json")
    d = own_uid_daemon(tmp_path, allowed)
    try:
        keys = [k for b in shardstream.Loader(str(mine), batch_size=4, connect=d.addr) for k in b["__key__"]]
        assert len(keys) == 10 and set(keys) < set(samples)
    finally:
        assert d.stop() == 0


def test_a_refusal_naming_a_long_brace_pattern_is_a_permission_error(dataset, tmp_path: Path) -> None:
    """A brace pattern of 1,300 shards (9 KB, inside the open's request limit) that the allow list
    refuses: the URL went into the status message (percent-encoded: `{` and `,` three bytes each)
    and again into its path metadata, the reply's headers outgrew the client's 16 KiB limit, and
    the trainer got "no shardstream daemon answered" (h2 protocol error) for a PermissionError."""
    root, _ = dataset
    d = own_uid_daemon(tmp_path, tmp_path / "only-this")
    try:
        names = ",".join(f"{i:06d}" for i in range(1300))
        with pytest.raises(PermissionError, match=r"bytes left out"):
            shardstream.Loader(f"{root}/train-{{{names}}}.tar", batch_size=4, connect=d.addr)
        # The daemon keeps serving.
        with pytest.raises(PermissionError):
            shardstream.Loader(str(root), batch_size=4, connect=d.addr)
    finally:
        assert d.stop() == 0
