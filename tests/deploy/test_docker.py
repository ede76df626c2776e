"""deploy/docker: hadolint finds nothing, and the image keeps the promises the Kubernetes manifests
and README rely on. No container engine is available here, so the image itself is not built: these
checks are what can be run without one (deploy/README.md says so)."""

from __future__ import annotations

import re
import subprocess

from deployutil import DEPLOY, REPO, tool

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
    import json
    import shutil

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
