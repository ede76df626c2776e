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


def run_hook(name: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A hook as Slurm runs it: no PATH, only the variables given (and settings beside SLURM_CONF)."""
    base = {"SLURM_CONF": str(tmp_path / "slurm.conf")}
    return subprocess.run(
        [str(DEPLOY / "slurm" / name)], env={**base, **env}, capture_output=True, text=True, timeout=60
    )


def test_a_hook_without_a_job_id_exits_0(tmp_path: Path) -> None:
    """ss_job_paths expanded $SLURM_JOB_ID under `set -u` before the hooks' own check: 'unbound
    variable', exit 1; a failed Prolog or Epilog drains the node."""
    for name in HOOKS:
        r = run_hook(name, tmp_path, {"SLURM_JOB_UID": "65534"})
        assert r.returncode == 0 and "unbound" not in r.stderr, (name, r.stderr)


def test_settings_that_are_no_number_of_seconds_are_logged_and_the_defaults_used(tmp_path: Path) -> None:
    """SHARDSTREAM_START_TIMEOUT=60s (or 08) ended the Prolog in shell arithmetic ('value too
    great for base', exit 1), though nothing of shardstream may fail it."""
    logs = tmp_path / "log"
    (tmp_path / "shardstream.env").write_text(
        f"SHARDSTREAM_LOG_DIR={logs}\nSHARDSTREAM_START_TIMEOUT=60s\nSHARDSTREAM_PREFETCH_WAIT=08\n"
    )
    logs.mkdir()
    script = f". {DEPLOY / 'slurm' / 'common.sh'}; ss_load_settings; "
    script += 'printf "%s %s\\n" "$SHARDSTREAM_START_TIMEOUT" "$SHARDSTREAM_PREFETCH_WAIT"'
    r = subprocess.run(
        ["/bin/bash", "-c", script], env={"SLURM_CONF": str(tmp_path / "slurm.conf")}, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.split() == ["60", "0"], r.stdout + r.stderr
    log = (logs / "slurm-hooks.log").read_text()
    assert "SHARDSTREAM_START_TIMEOUT='60s' in" in log and "using 60" in log, log
    assert "SHARDSTREAM_PREFETCH_WAIT='08' in" in log and "using 0" in log, log
    (tmp_path / "shardstream.env").write_text(f"SHARDSTREAM_LOG_DIR={logs}\nSHARDSTREAM_START_TIMEOUT=5\n")
    r = subprocess.run(
        ["/bin/bash", "-c", script], env={"SLURM_CONF": str(tmp_path / "slurm.conf")}, capture_output=True, text=True
    )
    assert r.stdout.split() == ["5", "0"], r.stdout + r.stderr


# A job of user nobody whose daemon binary is missing: the Prolog runs up to the daemon's start.
NOBODYS_JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_UID": "65534", "SLURM_JOB_GID": "65534", "SLURM_JOB_USER": "nobody"}


def settings_without_a_daemon(tmp_path: Path) -> Path:
    """shardstream.env beside tmp_path's slurm.conf, every directory under tmp_path, the daemon
    binary missing; returns the log directory."""
    logs, run, cache = tmp_path / "log", tmp_path / "run", tmp_path / "cache"
    settings = [
        f"SHARDSTREAM_LOG_DIR={logs}",
        f"SHARDSTREAM_RUN_DIR={run}",
        f"SHARDSTREAM_JOB_CACHE_DIR={cache}",
        f"SHARDSTREAM_BIN={tmp_path / 'no-such-binary'}",
        "SHARDSTREAM_START_TIMEOUT=5",
    ]
    (tmp_path / "shardstream.env").write_text("\n".join(settings) + "\n")
    return logs


def test_a_daemon_that_exits_at_start_is_not_also_logged_as_a_timeout(tmp_path: Path) -> None:
    logs = settings_without_a_daemon(tmp_path)
    r = run_hook("prolog", tmp_path, NOBODYS_JOB)
    assert r.returncode == 0, r.stderr
    log = (logs / "slurm-hooks.log").read_text()
    assert "daemon exited at start-up" in log and "not serving after" not in log, log


def test_task_prolog_stages_once_and_again_after_a_step_ended_its_staging(tmp_path: Path) -> None:
    """The staging a task starts runs in its step, whose end ends it (Slurm's process tracking);
    a marker made when it started kept every later step from starting it again, so a job whose
    first step was short (a `shardstream status` check) never had its dataset staged."""
    import signal
    import socket
    import time

    run, logs = tmp_path / "run", tmp_path / "log"
    job_dir = run / "job-7"
    job_dir.mkdir(parents=True)
    logs.mkdir()
    calls = tmp_path / "calls"
    fake = tmp_path / "shardstream"
    # `prefetch` that records its call, then finishes, or lasts while `hold` exists.
    fake.write_text(f'#!/bin/bash\necho "$*" >>{calls}\nwhile [ -e {tmp_path}/hold ]; do /usr/bin/sleep 0.05; done\n')
    fake.chmod(0o755)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(job_dir / "sock"))
    settings = [f"SHARDSTREAM_LOG_DIR={logs}", f"SHARDSTREAM_RUN_DIR={run}", f"SHARDSTREAM_BIN={fake}"]
    (tmp_path / "shardstream.env").write_text("\n".join(settings) + "\n")
    env = {"SLURM_JOB_ID": "7", "SHARDSTREAM_DATASET": "s3://b/d/"}

    def task() -> None:
        r = run_hook("task-prolog", tmp_path, env)
        assert r.returncode == 0 and r.stdout == f"export SHARDSTREAM_ADDR=unix://{job_dir / 'sock'}\n", r

    def started() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    def wait(cond) -> None:
        deadline = time.monotonic() + 10
        while not cond():
            assert time.monotonic() < deadline, calls.read_text() if calls.exists() else "never started"
            time.sleep(0.05)

    try:
        (tmp_path / "hold").touch()
        task()
        wait(lambda: started() == 1)
        task()  # another task of the step: the staging under way is left alone
        assert started() == 1
        # The step ends: Slurm kills its processes, the staging with them.
        os.killpg(int((job_dir / "prefetch.pid").read_text()), signal.SIGKILL)
        wait(lambda: not Path(f"/proc/{(job_dir / 'prefetch.pid').read_text().strip()}").exists())
        (tmp_path / "hold").unlink()
        task()  # the next step's first task starts it again; it finishes
        wait(lambda: (job_dir / "prefetch-done").exists())
        assert (
            started() == 2
            and calls.read_text().splitlines()[-1] == f"prefetch --connect unix://{job_dir / 'sock'} s3://b/d/"
        )
        task()  # staged: nothing more
        time.sleep(0.3)
        assert started() == 2 and not (job_dir / "prefetch-lock").exists()
        # A lock a killed task left behind is stale after a minute; a pid that is no longer the
        # job's staging (reused by another process: this one) does not count as staging.
        (job_dir / "prefetch-done").unlink()
        (job_dir / "prefetch-lock").mkdir()
        task()
        time.sleep(0.3)
        assert started() == 2, "a fresh lock is another task deciding"
        os.utime(job_dir / "prefetch-lock", (time.time() - 120, time.time() - 120))
        (job_dir / "prefetch.pid").write_text(f"{os.getpid()}\n")
        task()
        wait(lambda: started() == 3 and (job_dir / "prefetch-done").exists())
    finally:
        (tmp_path / "hold").unlink(missing_ok=True)
        listener.close()


def test_the_settings_file_is_read_as_lines_not_run_as_shell(tmp_path: Path) -> None:
    """The hooks sourced shardstream.env as shell, as root in the Prolog: an unquoted
    `SHARDSTREAM_SERVE_ARGS=--metrics-addr 127.0.0.1:19465` (documented as "VAR=value lines", the
    options "split on spaces") ran `127.0.0.1:19465` as a command and left the options unset,
    logged nowhere; `$(...)` in a value ran too."""
    logs, marker = tmp_path / "log", tmp_path / "ran"
    logs.mkdir()
    lines = [
        f"SHARDSTREAM_LOG_DIR={logs}",
        "SHARDSTREAM_SERVE_ARGS=--metrics-addr 127.0.0.1:19465",
        "# a comment, and a blank line",
        "",
        'export SHARDSTREAM_CACHE_SIZE="2 GiB"',
        "  AWS_REGION='eu-west-1'  ",
        f"SHARDSTREAM_BIN=$(touch {marker})",
        "not a setting",
    ]
    (tmp_path / "shardstream.env").write_text("\n".join(lines) + "\n")
    script = f". {DEPLOY / 'slurm' / 'common.sh'}; ss_load_settings; "
    script += 'printf "%s\\n" "$SHARDSTREAM_SERVE_ARGS" "$SHARDSTREAM_CACHE_SIZE" "$SHARDSTREAM_BIN"; '
    script += "/usr/bin/printenv AWS_REGION"
    r = subprocess.run(
        ["/bin/bash", "-c", script], env={"SLURM_CONF": str(tmp_path / "slurm.conf")}, capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines() == [
        "--metrics-addr 127.0.0.1:19465",
        "2 GiB",
        f"$(touch {marker})",
        "eu-west-1",
    ], r.stdout
    assert not marker.exists(), "a value was run as a command"
    log = (logs / "slurm-hooks.log").read_text()
    assert "line 8 of" in log and "not a setting" in log, log


def test_an_address_the_job_set_is_kept_and_said(tmp_path: Path) -> None:
    """The TaskProlog exported the job's socket over a SHARDSTREAM_ADDR the job had set itself (the
    no-admin recipe of example.sbatch, `SHARDSTREAM_ADDR=unix://$sock srun python train.py`): its
    trainer silently used the Prolog's daemon, not the one it had started and staged. An address
    of another job's daemon (a job submitted from inside another inherits its environment) is
    stale, not a choice: the job's own replaces it."""
    run = tmp_path / "run"
    (tmp_path / "shardstream.env").write_text(f"SHARDSTREAM_LOG_DIR={tmp_path}\nSHARDSTREAM_RUN_DIR={run}\n")
    own = f"unix://{run / 'job-7' / 'sock'}"
    for inherited, out in [
        (None, f"export SHARDSTREAM_ADDR={own}\n"),
        (own, f"export SHARDSTREAM_ADDR={own}\n"),
        (f"unix://{run / 'job-6' / 'sock'}", f"export SHARDSTREAM_ADDR={own}\n"),
    ]:
        env = {"SLURM_JOB_ID": "7"} | ({"SHARDSTREAM_ADDR": inherited} if inherited else {})
        r = run_hook("task-prolog", tmp_path, env)
        assert r.returncode == 0 and r.stdout == out, (inherited, r)
    mine = "unix:///tmp/mine/sock"
    r = run_hook("task-prolog", tmp_path, {"SLURM_JOB_ID": "7", "SHARDSTREAM_ADDR": mine})
    assert r.returncode == 0 and "export" not in r.stdout, r
    said = r.stdout.splitlines()
    assert len(said) == 1 and said[0].startswith("print shardstream: ") and mine in said[0] and own in said[0], r


def test_the_job_log_is_the_job_users_alone(tmp_path: Path) -> None:
    """The daemon's job-$ID.log and the hooks' log were world-readable (0644), and a job-$ID.log
    left by an earlier job of that id (ids repeat after a wrap or a reset of Slurm's state) was
    handed to the new job's user with the old contents: another user's dataset URLs and errors."""
    logs = settings_without_a_daemon(tmp_path)
    logs.mkdir()
    old = logs / "job-7.log"
    old.write_text("OLD LOG OF ANOTHER USER\n")
    old.chmod(0o644)
    r = run_hook("prolog", tmp_path, NOBODYS_JOB)
    assert r.returncode == 0, r.stderr
    st = old.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (65534, 0o600), oct(st.st_mode)
    assert "OLD LOG" not in old.read_text()
    assert (logs / "slurm-hooks.log").stat().st_mode & 0o777 == 0o600
    # The same job's Prolog again (a requeue): its log is kept and appended to.
    old.write_text("THIS JOB'S FIRST RUN\n")
    r = run_hook("prolog", tmp_path, NOBODYS_JOB)
    assert r.returncode == 0 and "THIS JOB'S FIRST RUN" in old.read_text(), r.stderr
