"""deploy/slurm on a real single-node Slurm (slurm-wlm + munge from Debian, started privately by
scripts/slurm-up.sh with deploy/slurm.conf.example's hook lines): a job submitted as a non-root
user gets a daemon started by the Prolog as that user, its dataset staged from a real S3 server
(`--comment=shardstream:URL`), SHARDSTREAM_ADDR from the TaskProlog, and its step streams the
dataset through that daemon exactly once per key; after the Epilog no process, socket, pidfile or
cache of the job is left, while another daemon of the same user survives. A job whose dataset
cannot be staged still runs. Needs root (useradd, slurmd runs hooks as root): CI runs as root."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deployutil import DEPLOY, REPO, require_root, shardstream_binary
from s3server import S3Server

import shardstream
from conftest import write_dataset

JOB_USER = "shardstream-test"
RUN_DIR = Path("/run/shardstream-jobs")
# Before the node cache is warm a debug build may be slow; the job itself takes seconds.
JOB_TIMEOUT = 240

STEP = r"""
import json, os, sys
import shardstream
from shardstream import _native

url, out = sys.argv[1], sys.argv[2]
addr = os.environ.get("SHARDSTREAM_ADDR", "")
job = os.environ["SLURM_JOB_ID"]
result = {"addr": addr, "uid": os.getuid(), "counts": {}}
sock = addr.removeprefix("unix://")
st = os.stat(sock)
result["sock_uid"] = st.st_uid
result["sock_dir_mode"] = os.stat(os.path.dirname(sock)).st_mode & 0o777
# connect="auto" (the default): the address comes from the TaskProlog's SHARDSTREAM_ADDR.
for batch in shardstream.Loader(url, batch_size=16, seed=5):
    for key in batch["__key__"]:
        result["counts"][key] = result["counts"].get(key, 0) + 1
result["status"] = _native.Connection(addr).status()
with open(out, "w") as f:
    json.dump(result, f)
"""

JOB = """#!/bin/bash
#SBATCH --job-name=shardstream-test
#SBATCH --comment=shardstream:{dataset}
#SBATCH --output={out}/%j.out
#SBATCH --time=5
set -eu
srun /usr/bin/python3 {step} {url} {out}/result-$SLURM_JOB_ID.json
"""


@dataclass
class World:
    root: Path
    slurm: Path
    out: Path
    bin: Path
    log: Path
    job_cache: Path
    user: pwd.struct_passwd
    samples: dict
    s3: S3Server

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.slurm / "slurm.conf")}

    def diag(self, job: str = "") -> str:
        parts = []
        for f in [
            self.slurm / "log" / "slurmd.log",
            self.slurm / "log" / "slurmctld.log",
            self.log / "slurm-hooks.log",
            self.log / f"job-{job}.log",
            self.out / f"{job}.out",
        ]:
            if f.is_file():
                parts.append(f"--- {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)


def ensure_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(JOB_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", JOB_USER], check=True)
        return pwd.getpwnam(JOB_USER)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    require_root("useradd, and slurmd running the Prolog as root")
    user = ensure_user()
    # Not under pytest's tmp_path (0700 under /tmp/pytest-of-root): the job user reads the
    # Python package and the step script, and writes its results.
    root = Path(tempfile.mkdtemp(prefix="shardstream-slurm-"))
    root.chmod(0o755)
    s3 = S3Server(root / "s3").start()
    slurm = root / "slurm"
    try:
        samples = write_dataset(s3.bucket("data") / "slurm", n=400, per_shard=50, seed=21)
        # The trainer's Python: the system interpreter (the venv's may live in root's home) with
        # a copy of the built package.
        py = root / "py"
        shutil.copytree(
            Path(shardstream.__file__).parent, py / "shardstream", ignore=shutil.ignore_patterns("__pycache__")
        )
        binary = root / "bin" / "shardstream"
        binary.parent.mkdir()
        shutil.copy(shardstream_binary(), binary)
        out = root / "out"
        out.mkdir()
        os.chown(out, user.pw_uid, user.pw_gid)
        (root / "step.py").write_text(STEP)
        for d in (py, root / "bin"):
            for p in [d, *d.rglob("*")]:
                p.chmod(0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644)
        (root / "step.py").chmod(0o644)
        slurm.mkdir()
        log = root / "log"
        job_cache = root / "jobcache"
        # Site settings, where the hooks look for them: next to slurm.conf.
        settings = {
            "SHARDSTREAM_BIN": str(binary),
            "SHARDSTREAM_JOB_CACHE_DIR": str(job_cache),
            "SHARDSTREAM_LOG_DIR": str(log),
            "SHARDSTREAM_PREFETCH_WAIT": "120",
            "SHARDSTREAM_START_TIMEOUT": "60",
            **s3.env(),
        }
        env_file = slurm / "shardstream.env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
        # Readable by all: the TaskProlog (job user) reads it too (deploy/README.md says why secrets
        # here are no secret from the job's user anyway).
        env_file.chmod(0o644)
        up = subprocess.run(
            ["bash", str(REPO / "scripts" / "slurm-up.sh"), "up", str(slurm), str(DEPLOY / "slurm")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert up.returncode == 0, up.stderr
        yield World(root, slurm, out, binary, log, job_cache, user, samples, s3)
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "slurm-up.sh"), "down", str(slurm)], timeout=120)
        # Whatever a failed test left behind: every daemon of this module runs the binary copied
        # under `root`, and every job directory it made names one of its jobs.
        for pid in processes_naming(str(root)):
            os.kill(pid, signal.SIGKILL)
        for leftover in RUN_DIR.glob("job-*"):
            if leftover.name.removeprefix("job-").removesuffix(".pid") in JOBS_STARTED:
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink()
        # The socket directories of jobs that ran their own daemon (example.sbatch's recipe).
        for job in JOBS_STARTED:
            shutil.rmtree(f"/tmp/shardstream-{job}", ignore_errors=True)
        s3.stop()
        shutil.rmtree(root, ignore_errors=True)


def submit(
    world: World,
    dataset: str,
    url: str,
    step: str | None = None,
    tasks_per_node: int = 1,
    env: dict[str, str] | None = None,
) -> str:
    """Submits the job as JOB_USER; `step` replaces the streaming step (the srun line), `env` is
    added to the job's environment."""
    script = world.root / f"job-{len(list(world.root.glob('job-*.sbatch')))}.sbatch"
    text = JOB.format(dataset=dataset, url=url, out=world.out, step=world.root / "step.py")
    if step is not None:
        text = text[: text.index("srun ")] + step + "\n"
    if tasks_per_node != 1:
        text = text.replace("#SBATCH --time", f"#SBATCH --ntasks-per-node={tasks_per_node}\n#SBATCH --time", 1)
    script.write_text(text)
    script.chmod(0o644)
    job_env = {
        "PATH": "/usr/bin:/bin",
        "HOME": world.user.pw_dir,
        "SLURM_CONF": str(world.slurm / "slurm.conf"),
        "PYTHONPATH": str(world.root / "py"),
        **(env or {}),
    }
    r = subprocess.run(
        ["runuser", "-u", JOB_USER, "--", "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in job_env.items())]
        + ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=world.out,
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    JOBS_STARTED.add(job)
    return job


def job_state(world: World, job: str) -> dict[str, str]:
    r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, env=world.env())
    fields = {}
    for word in r.stdout.split():
        k, _, v = word.partition("=")
        fields[k] = v
    return fields


JOBS_STARTED: set[str] = set()


def job_processes(job: str) -> list[int]:
    """Processes whose command line names the job's socket directory."""
    return processes_naming(f"{RUN_DIR}/job-{job}/")


def processes_naming(text: str) -> list[int]:
    needle = text.encode()
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if needle in (p / "cmdline").read_bytes():
                    found.append(int(p.name))
            except OSError:
                pass
    return found


def wait_done(world: World, job: str) -> dict[str, str]:
    """Waits for the job to end and its Epilog to finish (the node idle again)."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while True:
        state = job_state(world, job)
        if state.get("JobState") in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
            break
        assert time.monotonic() < deadline, f"job {job} still {state.get('JobState')}\n{world.diag(job)}"
        time.sleep(0.5)
    # The Epilog runs after the job state is final; the node is idle again once it finished.
    while True:
        r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=world.env())
        if r.stdout.strip() == "idle" and not job_processes(job) and not (RUN_DIR / f"job-{job}").exists():
            return state
        assert time.monotonic() < deadline, f"epilog of {job} did not finish ({r.stdout!r})\n{world.diag(job)}"
        time.sleep(0.5)


@pytest.fixture()
def decoy(world: World) -> Iterator[subprocess.Popen[bytes]]:
    """Another daemon of the same user on the node (as another job's would be): the Epilog must
    leave it alone."""
    d = world.root / "decoy"
    d.mkdir(exist_ok=True)
    os.chown(d, world.user.pw_uid, world.user.pw_gid)
    proc = subprocess.Popen(
        [
            "/usr/bin/setpriv",
            f"--reuid={world.user.pw_uid}",
            f"--regid={world.user.pw_gid}",
            "--init-groups",
            "--",
            str(world.bin),
            "serve",
            "--listen",
            f"unix://{d}/sock",
            "--cache-dir",
            str(d / "cache"),
            "--log",
            "warn",
        ],
        env={"PATH": "/usr/bin:/bin", "HOME": world.user.pw_dir},
    )
    deadline = time.monotonic() + 30
    while not (d / "sock").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "decoy daemon did not start"
        time.sleep(0.05)
    yield proc
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_job_streams_through_the_prologs_daemon_and_leaves_nothing(world: World, decoy) -> None:
    url = "s3://data/slurm/"
    job = submit(world, url, url)
    state = wait_done(world, job)
    diag = world.diag(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", f"{state}\n{diag}"

    result = json.loads((world.out / f"result-{job}.json").read_text())
    assert result["addr"] == f"unix://{RUN_DIR}/job-{job}/sock", "the TaskProlog's SHARDSTREAM_ADDR"
    assert result["uid"] == world.user.pw_uid
    assert result["sock_uid"] == world.user.pw_uid, "the Prolog's daemon runs as the job's user"
    assert result["sock_dir_mode"] == 0o700
    assert result["counts"] == {k: 1 for k in world.samples}, "every sample exactly once"
    # The Prolog staged the named dataset before the step ran: the step's epoch found it cached.
    job_log = (world.log / f"job-{job}.log").read_text()
    assert "staged 8 of 8 shards of s3://data/slurm/" in job_log, diag

    # Nothing of the job is left: no process, no socket directory, no pidfile, no cache.
    assert not job_processes(job)
    assert not (RUN_DIR / f"job-{job}").exists()
    assert not (RUN_DIR / f"job-{job}.pid").exists()
    assert not (world.job_cache / f"job-{job}").exists()
    hooks = (world.log / "slurm-hooks.log").read_text()
    assert f"job {job}: stopping" in hooks and f"job {job}: cleaned up" in hooks, hooks
    assert "SIGKILL" not in hooks, "the daemon drains on SIGTERM"
    assert decoy.poll() is None, "the Epilog stopped another daemon of the same user"


def test_a_dataset_that_cannot_be_staged_does_not_fail_the_job(world: World) -> None:
    """A failed prefetch is logged; the Prolog exits 0 (a failing Prolog drains the node and holds
    the job), and the job runs against the daemon as usual."""
    job = submit(world, "s3://data/no-such-dataset/", "s3://data/slurm/")
    state = wait_done(world, job)
    assert state["JobState"] == "COMPLETED", f"{state}\n{world.diag(job)}"
    result = json.loads((world.out / f"result-{job}.json").read_text())
    assert result["counts"] == {k: 1 for k in world.samples}
    assert "no-such-dataset" in (world.log / f"job-{job}.log").read_text()
    r = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=world.env())
    assert r.stdout.strip() == "idle", "the node was drained"
    assert not job_processes(job) and not (RUN_DIR / f"job-{job}").exists()


def test_a_cancelled_job_leaves_nothing(world: World) -> None:
    """scancel of a running job: Slurm kills its steps, never the Prolog's daemon (it is in no
    step); the Epilog, which also runs for cancelled jobs, must."""
    job = submit(world, "s3://data/slurm/", "s3://data/slurm/", step="srun /usr/bin/sleep 600")
    deadline = time.monotonic() + JOB_TIMEOUT
    while job_state(world, job).get("JobState") != "RUNNING" or not job_processes(job):
        assert time.monotonic() < deadline, f"job {job} never ran with its daemon\n{world.diag(job)}"
        time.sleep(0.2)
    r = subprocess.run(["scancel", job], env=world.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    state = wait_done(world, job)
    assert state["JobState"] == "CANCELLED", state
    assert not job_processes(job)
    assert not (RUN_DIR / f"job-{job}").exists() and not (RUN_DIR / f"job-{job}.pid").exists()
    assert not (world.job_cache / f"job-{job}").exists()


def run_hook(world: World, hook: str, job: str, uid: int, **extra: str) -> subprocess.CompletedProcess[str]:
    """The hook as slurmd runs it: the job's identity and SLURM_CONF, and no usable PATH (bash
    would otherwise fall back to a default one), so a command named without its path fails."""
    env = {
        "PATH": "/nonexistent",
        "SLURM_JOB_ID": job,
        "SLURM_JOB_UID": str(uid),
        "SLURM_JOB_GID": str(uid),
        "SLURM_JOB_USER": JOB_USER,
        "SLURM_CONF": str(world.slurm / "slurm.conf"),
        **extra,
    }
    r = subprocess.run(
        ["/bin/bash", str(DEPLOY / "slurm" / hook)], env=env, capture_output=True, text=True, timeout=120
    )
    assert "command not found" not in r.stderr and "No such file" not in r.stderr, r.stderr
    return r


def test_hooks_run_without_path(world: World) -> None:
    """Prolog, TaskProlog (as the job user) and Epilog run by hand, one after the other."""
    job = "990000001"  # above any id slurm-up.sh's FirstJobId hands out
    uid = world.user.pw_uid
    JOBS_STARTED.add(job)
    r = run_hook(world, "prolog", job, uid, SLURM_JOB_COMMENT="shardstream:s3://data/slurm/")
    sock = RUN_DIR / f"job-{job}" / "sock"
    assert r.returncode == 0, r.stderr
    try:
        assert sock.is_socket() and sock.stat().st_uid == uid
        assert job_processes(job), "the daemon runs"
        assert "staged 8 of 8 shards" in (world.log / f"job-{job}.log").read_text()
        task = subprocess.run(
            [
                "/usr/bin/setpriv",
                f"--reuid={uid}",
                f"--regid={world.user.pw_gid}",
                "--init-groups",
                "--",
                "/bin/bash",
                str(DEPLOY / "slurm" / "task-prolog"),
            ],
            env={
                "PATH": "/nonexistent",
                "SLURM_JOB_ID": job,
                "SLURM_CONF": str(world.slurm / "slurm.conf"),
                # A job's own way to name its dataset: staged by the TaskProlog, once per job.
                "SHARDSTREAM_DATASET": "s3://data/slurm/",
            },
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert task.returncode == 0 and task.stdout == f"export SHARDSTREAM_ADDR=unix://{sock}\n", task
        staged = sock.parent / "prefetch.log"
        deadline = time.monotonic() + 60
        while "staged 8 of 8 shards" not in (staged.read_text() if staged.exists() else ""):
            assert time.monotonic() < deadline, staged.read_text() if staged.exists() else "no prefetch.log"
            time.sleep(0.1)
    finally:
        r = run_hook(world, "epilog", job, uid)
    assert r.returncode == 0, r.stderr
    assert not job_processes(job) and not sock.parent.exists()


def test_epilog_without_a_daemon_and_with_a_forged_pidfile(world: World, decoy) -> None:
    """The Epilog also runs for jobs whose Prolog never ran, and must exit 0; a pidfile naming a
    process that is not this job's daemon (here: the user's other daemon) is not obeyed."""
    job = "990000002"
    JOBS_STARTED.add(job)
    r = run_hook(world, "epilog", job, world.user.pw_uid)
    assert r.returncode == 0, r.stderr
    pidfile = RUN_DIR / f"job-{job}.pid"
    RUN_DIR.mkdir(exist_ok=True)
    pidfile.write_text(f"{decoy.pid}\n")
    r = run_hook(world, "epilog", job, world.user.pw_uid)
    assert r.returncode == 0, r.stderr
    time.sleep(0.5)
    assert decoy.poll() is None, "the Epilog killed a process that was not the job's daemon"
    assert not pidfile.exists()


# A trainer for the job that runs its own daemon. It is given the address: this Slurm's TaskProlog
# sets SHARDSTREAM_ADDR to the Prolog's daemon in every task, over the recipe's own.
TRAINER = r"""
import json, os, sys
import shardstream

url, addr, out = sys.argv[1:4]
counts = {}
loader = shardstream.Loader(url, batch_size=16, seed=5, connect=addr)
for batch in loader:
    for key in batch["__key__"]:
        counts[key] = counts.get(key, 0) + 1
with open(f"{out}/result-{os.environ['SLURM_JOB_ID']}-{os.environ['SLURM_PROCID']}.json", "w") as f:
    json.dump({"address": loader.address, "counts": counts}, f)
"""


def no_admin_example() -> str:
    """The commented commands of example.sbatch for a job without the Prolog, uncommented."""
    lines = [
        line.removeprefix("#   ")
        for line in (DEPLOY / "slurm" / "example.sbatch").read_text().splitlines()
        if line.startswith("#   ")
    ]
    assert lines, "example.sbatch shows no daemon run by the job itself"
    return "\n".join(lines)


def job_output(world: World, job: str) -> str:
    return (world.out / f"{job}.out").read_text(errors="replace")


def test_no_admin_example_runs_one_daemon_per_node_that_drains(world: World) -> None:
    """example.sbatch's job without the Prolog, run as written in a job of two tasks on the node:
    its steps run once per node, not once per task (srun takes the job's task count unless given
    one); at the end its daemon gets SIGTERM and drains (srun itself would SIGKILL it), and no
    socket or cache of it is left. Its cache names the job (a cache directory serves one daemon
    at a time), and a daemon that never serves fails the job instead of holding it until
    walltime."""
    recipe = no_admin_example()
    caches = re.findall(r"\bcache=(\S+)", recipe)
    assert caches and all("$SLURM_JOB_ID" in c for c in caches), caches
    waits = [line for line in recipe.splitlines() if "shardstream status" in line]
    assert waits and all(re.search(r"--wait[ =]\d+", line) for line in waits), waits
    assert not re.search(r"\b(until|while)\b", recipe), "an unbounded wait loop"

    url = "s3://data/slurm/"
    nvme = world.root / "nvme"
    nvme.mkdir(exist_ok=True)
    nvme.chmod(0o1777)
    trainer = world.root / "trainer.py"
    trainer.write_text(TRAINER)
    trainer.chmod(0o644)
    script, n = re.subn(r"\bcache=\S*/(shardstream-)", rf"cache={nvme}/\1", recipe)
    assert n == 1, recipe
    script = script.replace("s3://my-bucket/datasets/laion-wds/", url)
    # The trainer takes its address from SHARDSTREAM_ADDR, as the recipe's line sets it (connect="auto"),
    # though the Prolog's TaskProlog hands every task the Prolog's daemon.
    script, n = re.subn(r"\bpython train\.py .*", f"/usr/bin/python3 {trainer} {url} auto {world.out}", script)
    assert n == 1 and "SHARDSTREAM_ADDR=unix://$sock srun /usr/bin/python3" in script, recipe
    env = {**world.s3.env(), "PATH": f"{world.bin.parent}:/usr/bin:/bin"}
    # The Prolog's dataset does not exist: its daemon stages nothing, and stays out of the way.
    job = submit(world, "s3://data/no-such-dataset/", url, step=script, tasks_per_node=2, env=env)
    state = wait_done(world, job)
    out = job_output(world, job)
    diag = f"{state}\n{script}\n--- {job}.out\n{out}"
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", diag

    assert "can't honor" not in out and "already listening" not in out, diag
    assert out.count("staged 8 of 8 shards") == 1, f"one prefetch per node\n{diag}"
    for task in range(2):
        result = json.loads((world.out / f"result-{job}-{task}.json").read_text())
        assert result["address"] == f"unix:///tmp/shardstream-{job}/sock", f"task {task}: the job's own daemon"
        assert result["counts"] == {k: 1 for k in world.samples}, f"task {task}: every sample once"
    assert out.count("shardstream: this task keeps SHARDSTREAM_ADDR=") == 2, f"said once a task\n{diag}"
    # The daemon drained: asked to once, no SIGKILL from srun, no task ended in error.
    assert out.count("shutdown requested, draining") == 1, diag
    assert len(re.findall(r"\bstopped$", out, re.MULTILINE)) == 1, f"the daemon did not exit cleanly\n{diag}"
    for sign in ("forcing job termination", "Killed", "srun: error", "did not finish in time"):
        assert sign not in out, f"{sign!r}\n{diag}"
    assert not processes_naming(f"/tmp/shardstream-{job}/"), "a daemon outlived the job"
    assert not Path(f"/tmp/shardstream-{job}").exists(), "socket directory left behind"
    assert not (nvme / f"shardstream-{job}").exists(), "cache left behind"


def test_node_wide_staging_runs_once_per_node(world: World) -> None:
    """deploy/README.md's staging line for the node-wide daemon, in a job of two tasks on the
    node (the TaskProlog's daemon stands in for the node's): one prefetch per node."""
    readme = " ".join((DEPLOY / "README.md").read_text().split())
    m = re.search(r"Staging is then `(srun [^`]*)`", readme)
    assert m, "README.md shows no staging command for the node-wide daemon"
    url = "s3://data/slurm/"
    step = m.group(1).replace("URL", url)
    env = {"PATH": f"{world.bin.parent}:/usr/bin:/bin"}
    job = submit(world, "s3://data/no-such-dataset/", url, step=step, tasks_per_node=2, env=env)
    state = wait_done(world, job)
    out = job_output(world, job)
    diag = f"{state}\n{step}\n--- {job}.out\n{out}"
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", diag
    assert "can't honor" not in out, diag
    assert out.count("staged 8 of 8 shards") == 1, f"one prefetch per node\n{diag}"
