"""deploy/docker: hadolint finds nothing, the image keeps the promises the Kubernetes manifests
and README rely on, the build stage's context is a complete workspace, and the image's command
runs as its user against directories made as the image makes them. No container engine is
available here, so the image itself is not built (deploy/README.md says so)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from deployutil import DEPLOY, REPO, require_root, shardstream_binary, tool
from s3server import free_port

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def test_hadolint_clean() -> None:
    r = subprocess.run(
        [tool("hadolint"), "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def stages() -> list[list[str]]:
    out: list[list[str]] = []
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            out.append([])
        out[-1].append(line)
    return out


def test_bases_pinned_and_final_stage_minimal() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2, "multi-stage"
    for stage in all_stages:
        image = stage[0].split()[1]
        # An exact tag (with a version or a date) or a digest; never latest or a floating major.
        assert "@sha256:" in image or re.search(r":[^:]*\d+\.\d+\.\d+|:[a-z]+-\d{8}", image), image
    final = all_stages[-1]
    assert not any(line.upper().startswith("RUN ") for line in final), "the final stage runs nothing"
    copies = [line for line in final if line.upper().startswith("COPY ")]
    sources = {line.split()[-2] for line in copies}
    assert sources == {
        "/etc/ssl/certs/ca-certificates.crt",
        "/out/usr/local/bin/shardstream",
        "/out/run/shardstream",
        "/out/var/cache/shardstream",
    }, sources
    user = next(line.split()[1] for line in final if line.upper().startswith("USER "))
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit(), f"USER must be a numeric non-root uid, got {user}"
    assert any(line.startswith('ENTRYPOINT ["/usr/local/bin/shardstream"]') for line in final)


def test_dockerignore_keeps_the_build_inputs_and_drops_target() -> None:
    """The context must hold every path the build stage COPYs, and not target/ (gigabytes)."""
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    rules = [r.strip() for r in ignore if r.strip() and not r.startswith("#")]
    assert rules[0] == "*", "allow-list style: only what the build needs"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    build = stages()[0]
    for line in build:
        if line.upper().startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert src.rstrip("/") in allowed, f"{src} is copied but not in the context"
                assert (REPO / src).exists(), src
    assert "**/target/" in rules


def test_build_stage_context_is_a_complete_workspace(tmp_path) -> None:
    """What the build stage COPYs (and nothing else) is a workspace cargo accepts with --locked,
    holding the binary it builds: the closest to `docker build` this machine allows."""
    for line in stages()[0]:
        if line.upper().startswith("COPY ") and "--from" not in line:
            *sources, dest = line.split()[1:]
            for src in sources:
                target = tmp_path / (src if dest in (".", "./") else dest)
                if (REPO / src).is_dir():
                    shutil.copytree(REPO / src, target, ignore=shutil.ignore_patterns("target", "__pycache__"))
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(REPO / src, target)
    r = subprocess.run(
        ["cargo", "metadata", "--locked", "--offline", "--format-version", "1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    meta = json.loads(r.stdout)
    daemon = next(p for p in meta["packages"] if p["name"] == "shardstream")
    assert any(t["name"] == "shardstream" and "bin" in t["kind"] for t in daemon["targets"])


@pytest.fixture()
def open_tmp():
    """A temporary directory other uids can enter (pytest's tmp_path sits in a 0700 directory)."""
    d = Path(tempfile.mkdtemp(prefix="shardstream-image-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_image_command_runs_as_its_user(open_tmp: Path) -> None:
    """The final stage's ENTRYPOINT + CMD run as its numeric USER, with the image's socket and
    cache directories mapped onto temporary ones made as the COPY --chown makes them (uid 65532,
    0750 and 0700): the daemon serves, `status` (the probe command) answers, /metrics answers, and SIGTERM
    stops it cleanly. The metrics port is moved to a free one, nothing else is changed."""
    require_root("running the daemon as the image's uid")
    final = stages()[-1]
    uid, _, gid = next(line.split()[1] for line in final if line.upper().startswith("USER ")).partition(":")
    entry = json.loads(next(line[len("ENTRYPOINT ") :] for line in final if line.startswith("ENTRYPOINT ")))
    cmd = json.loads(next(line[len("CMD ") :] for line in final if line.startswith("CMD ")))
    assert entry == ["/usr/local/bin/shardstream"]
    port = free_port()
    tmp_path = open_tmp
    mapping = {"/run/shardstream": tmp_path / "run", "/var/cache/shardstream": tmp_path / "cache"}
    for d, mode in zip(mapping.values(), (0o750, 0o700), strict=True):
        d.mkdir(mode=mode)
        os.chown(d, int(uid), int(gid))
    args = []
    for a in cmd:
        for image_path, host_path in mapping.items():
            a = a.replace(image_path, str(host_path))
        args.append(a.replace("0.0.0.0:9464", f"127.0.0.1:{port}"))
    assert args[0] == "serve" and args != cmd
    # A copy the image's uid can run (the build's may sit under a directory it cannot enter).
    binary = tmp_path / "shardstream"
    shutil.copy(shardstream_binary(), binary)
    as_user = ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    env = {"PATH": "/usr/bin:/bin", "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    proc = subprocess.Popen([*as_user, str(binary), *args], env=env)
    try:
        addr = next(a for a in args if a.startswith("unix://"))
        deadline = time.monotonic() + 60
        while True:
            probe = subprocess.run(
                [*as_user, str(binary), "status", "--connect", addr], env=env, capture_output=True, timeout=30
            )
            if probe.returncode == 0:
                break
            assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
            assert time.monotonic() < deadline, probe.stderr
            time.sleep(0.2)
        sock = mapping["/run/shardstream"] / "sock"
        assert sock.stat().st_uid == int(uid)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "shardstream_cache_capacity_bytes" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0
