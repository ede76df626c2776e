"""Shared helpers of the deployment tests: where the repository, the built `shardstream` binary
and the deployment tools (installed by scripts/deploy-tools.sh) are."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CACHE = Path(os.environ.get("SHARDSTREAM_CACHE", Path.home() / ".cache" / "shardstream"))


def _is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def shardstream_binary() -> Path:
    """The compiled `shardstream` (an ELF file: the deployment files run it directly, and a
    non-root job user cannot run the venv's console script, whose interpreter may be private)."""
    candidates = [os.environ.get("SHARDSTREAM_BIN", "")]
    target = os.environ.get("CARGO_TARGET_DIR") or str(REPO / "target")
    candidates += [f"{target}/debug/shardstream", f"{target}/release/shardstream"]
    for c in candidates:
        if c and _is_elf(Path(c)):
            return Path(c)
    pytest.fail(f"no compiled shardstream binary (tried {candidates}); run `cargo build -p shardstream`")


# What a stop needs beyond the daemon's drain: the node cache's syncfs, and the exit.
STOP_HEADROOM = 5


def drain_timeout(*serve_args: str) -> int:
    """The daemon's drain timeout (seconds) with these `serve` options, as it reports it."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    r = subprocess.run(
        [str(shardstream_binary()), "serve", *serve_args, "--print-config"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean,
    )
    assert r.returncode == 0, r.stderr
    return int(tomllib.loads(r.stdout)["drain-timeout"])


def tool(name: str) -> str:
    """A deployment tool: from the venv of this interpreter, the tool cache, or PATH."""
    for c in (
        Path(sys.executable).with_name(name),
        CACHE / "tools" / "prometheus" / "usr" / "bin" / name,
    ):
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: run `bash scripts/deploy-tools.sh` (make test-deploy does)")
    return found


def require_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"this test needs root ({why}); CI runs it as root")
