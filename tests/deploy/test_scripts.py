"""Every shell script of the deployment (and the scripts that set up its tests) is shellcheck
clean. (That the hooks need no PATH is tested by running them with a useless one: test_slurm.py.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from deployutil import DEPLOY, REPO, STOP_HEADROOM, drain_timeout, tool

HOOKS = ("prolog", "epilog", "task-prolog")


def test_shellcheck_clean() -> None:
    scripts = [DEPLOY / "slurm" / n for n in (*HOOKS, "common.sh", "example.sbatch")]
    scripts += [REPO / "scripts" / "slurm-up.sh", REPO / "scripts" / "deploy-tools.sh"]
    r = subprocess.run([tool("shellcheck"), "-x", *map(str, scripts)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hooks_are_executable_and_strict() -> None:
    for name in HOOKS:
        path = DEPLOY / "slurm" / name
        assert os.access(path, os.X_OK), f"{name} is not executable"
        assert "\nset -u\n" in path.read_text(), f"{name}: set -u"


def test_epilog_waits_out_the_drain_before_sigkill() -> None:
    """The Epilog's SIGTERM-to-SIGKILL wait outlasts the drain of a daemon the Prolog started (its
    default drain timeout): a daemon still ending its streams is not killed."""
    text = (DEPLOY / "slurm" / "epilog").read_text()
    loop = text[text.index("kill -TERM") : text.index("kill -KILL")]
    rounds = int(re.search(r"seq 1 (\d+)", loop).group(1))
    pause = float(re.search(r"sleep ([0-9.]+)", loop).group(1))
    drain = drain_timeout("--listen", "unix:///run/shardstream-test/sock", "--cache-dir", "/nonexistent")
    assert rounds * pause >= drain + STOP_HEADROOM, f"waits {rounds * pause} s, drain-timeout is {drain} s"


def test_per_job_state_is_outside_the_units_directories(tmp_path: Path) -> None:
    """The hooks and the node-wide systemd unit may run on one node. systemd removes the unit's
    RuntimeDirectory= at every stop and restart, and makes its exec directories the unit user's
    (0750): per-job sockets, pidfiles and caches inside them would vanish or become unreachable
    to the job's user."""
    script = f". {DEPLOY / 'slurm' / 'common.sh'}; ss_load_settings; SLURM_JOB_ID=1; ss_job_paths; "
    script += 'printf "%s\\n" "$JOB_DIR" "$JOB_PIDFILE" "$JOB_CACHE" "$JOB_LOG"'
    r = subprocess.run(
        ["/bin/bash", "-c", script], env={"SLURM_CONF": str(tmp_path / "slurm.conf")}, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    job_paths = [Path(p) for p in r.stdout.split()]
    assert len(job_paths) == 4, r.stdout
    roots = {"RuntimeDirectory": "/run", "StateDirectory": "/var/lib", "CacheDirectory": "/var/cache"}
    roots["LogsDirectory"] = "/var/log"
    owned = []
    for line in (DEPLOY / "systemd" / "shardstream.service").read_text().splitlines():
        key, _, value = line.partition("=")
        if key in roots:
            owned += [Path(roots[key]) / d for d in value.split()]
    assert owned
    for path in job_paths:
        assert not any(path.is_relative_to(d) for d in owned), f"{path} is in the unit's {owned}"
