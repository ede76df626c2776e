"""The shardstream daemon as the bench runs it: a separate process on a private Unix socket with
its own cache directory, started before a shardstream reader and stopped (SIGTERM) after it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0
POLL_S = 0.1


class DaemonError(RuntimeError):
    pass


# Runs the package's console entry point with this interpreter: how a build installed elsewhere
# (`pip install --target SITE`, put first on PYTHONPATH) is started.
CLI = "import sys; sys.argv[0] = 'shardstream'; from shardstream._cli import main; main()"


def variant(spec: str) -> tuple[str, str]:
    """The argparse type of the benches' `--variant NAME=SITE`: another build of the package, a
    directory its wheel was installed into with `pip install --target SITE`. Refuses a spec
    without a name or a site, or a site without the package: it would otherwise measure this
    build under the variant's name."""
    import argparse

    name, sep, site = spec.partition("=")
    if not sep or not name or not site:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=SITE")
    if not (Path(site) / "shardstream" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{site}: no shardstream package there (pip install --target {site} WHEEL)")
    return name, site


def env_for(site: str | None) -> dict[str, str]:
    """The environment of a process that must import `site`'s build of the package (None: the
    one installed in this interpreter)."""
    env = {**os.environ, "SHARDSTREAM_LOG": os.environ.get("SHARDSTREAM_LOG", "warn")}
    if site:
        env["PYTHONPATH"] = os.pathsep.join([site, *filter(None, [env.get("PYTHONPATH")])])
    return env


def executable() -> Path:
    """The `shardstream` command the package installs next to this interpreter."""
    beside = Path(sys.executable).with_name("shardstream")
    if beside.exists():
        return beside
    found = shutil.which("shardstream")
    if found:
        return Path(found)
    raise DaemonError(f"no `shardstream` command in {beside.parent} or on PATH: the package is not installed")


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " / ".join(text[-lines:])


class Daemon:
    def __init__(self, proc: subprocess.Popen[bytes], addr: str, log: Path) -> None:
        self.proc, self.addr, self.log = proc, addr, log

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    def start(cls, workdir: Path, env: dict[str, str] | None = None, site: str | None = None) -> Daemon:
        """Starts `shardstream serve` in workdir (with `env` added to the environment, e.g. an S3
        endpoint) and waits until it answers `shardstream status`. With `site`, the build of the
        package installed there (see `env_for`) instead of this interpreter's."""
        exe = [sys.executable, "-c", CLI] if site else [str(executable())]
        sock = workdir / "sock"
        addr = f"unix://{sock}"
        log = workdir / "daemon.log"
        cmd = [*exe, "serve", "--listen", addr, "--cache-dir", str(workdir / "cache")]
        env = {**env_for(site), **(env or {})}
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        except OSError as e:
            raise DaemonError(f"cannot start {exe[0]}: {e}") from e
        daemon = cls(proc, addr, log)
        try:
            daemon._wait_ready(exe, sock, env)
        except BaseException:
            daemon.stop()
            raise
        return daemon

    def _wait_ready(self, exe: list[str], sock: Path, env: dict[str, str]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        status = [*exe, "status", "--connect", self.addr]
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DaemonError(f"daemon exited with {self.proc.returncode}: {_tail(self.log)}")
            if sock.exists() and subprocess.run(status, capture_output=True, check=False, env=env).returncode == 0:
                return
            time.sleep(POLL_S)
        raise DaemonError(f"daemon not ready within {READY_TIMEOUT_S:.0f} s: {_tail(self.log)}")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT_S; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, lines: int = 3) -> str:
        return _tail(self.log, lines)
