"""Every shell script of the deployment (and the scripts that set up its tests) is shellcheck
clean. (That the hooks need no PATH is tested by running them with a useless one: test_slurm.py.)"""

from __future__ import annotations

import os
import subprocess

from deployutil import DEPLOY, REPO, tool

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
