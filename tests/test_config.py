"""`shardstream serve --config FILE`: keys, precedence (flags > SHARDSTREAM_* > file > defaults),
errors naming the key, and `--print-config`."""

from __future__ import annotations

import os
import subprocess
import textwrap
import tomllib
from pathlib import Path

from conftest import SHARDSTREAM, Daemon


def print_config(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    return subprocess.run(
        [SHARDSTREAM, "serve", *args, "--print-config"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**clean, **(env or {})},
    )


def test_precedence_flag_env_file_default(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        textwrap.dedent("""
        cache-size = "3GiB"
        prefetch-horizon = 45
        s3-concurrency = 4
        log = "debug"
        """)
    )
    r = print_config(
        "--config", str(cfg), "--s3-concurrency", "9", env={"SHARDSTREAM_LOG": "warn", "SHARDSTREAM_CACHE_SIZE": "1GiB"}
    )
    assert r.returncode == 0, r.stderr
    eff = tomllib.loads(r.stdout)
    assert eff["s3-concurrency"] == 9  # flag beats file
    assert eff["log"] == "warn"  # env beats file
    assert eff["cache-size"] == str(1 << 30)  # env beats file
    assert eff["prefetch-horizon"] == 45  # file beats default
    assert eff["cache-policy"] == "belady"  # default
    # The printed configuration is itself a valid config file that yields the same result.
    again = tmp_path / "again.toml"
    again.write_text(r.stdout)
    r2 = print_config("--config", str(again))
    assert r2.returncode == 0, r2.stderr
    assert tomllib.loads(r2.stdout) == eff


def test_config_from_environment_variable(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("ring-slots = 7\n")
    r = print_config(env={"SHARDSTREAM_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stderr
    assert tomllib.loads(r.stdout)["ring-slots"] == 7


def test_unknown_key_and_bad_value_stop_the_daemon(tmp_path: Path) -> None:
    for text, key in [
        ('cache-sise = "1GiB"\n', "cache-sise"),
        ('prefetch-parallel = "many"\n', "prefetch-parallel"),
        ('[[allow]]\nuid = 1\nroot = ["/x"]\n', "root"),
    ]:
        cfg = tmp_path / "bad.toml"
        cfg.write_text(text)
        r = subprocess.run(
            [SHARDSTREAM, "serve", "--config", str(cfg), "--listen", f"unix://{tmp_path}/sock"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert r.returncode != 0
        assert key in r.stderr and str(cfg) in r.stderr, r.stderr
        assert not (tmp_path / "sock").exists()


def test_daemon_runs_from_a_config_file(dataset, tmp_path: Path) -> None:
    import shardstream

    root, samples = dataset
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'cache-size = "1GiB"\nsocket-mode = "0660"\nlisten = "unix://{tmp_path}/from-file.sock"\n')
    d = Daemon(tmp_path, args=["--config", str(cfg)])
    d.start()  # Daemon passes --listen: the flag wins over the file's listen
    try:
        assert not (tmp_path / "from-file.sock").exists()
        assert oct((tmp_path / "sock").stat().st_mode & 0o777) == "0o660"
        assert d.status()["cache"]["capacity_bytes"] == 1 << 30
        got = sum(len(b["__key__"]) for b in shardstream.Loader(str(root), batch_size=64, connect=d.addr))
        assert got == len(samples)
    finally:
        assert d.stop() == 0


def test_every_serve_option_has_its_environment_variable() -> None:
    """The README and deploy/README promise that every option is also SHARDSTREAM_<NAME> (a
    container's env, a systemd EnvironmentFile); --rdma-provider had none, and its variable was
    ignored without a word."""
    import re

    r = subprocess.run([SHARDSTREAM, "serve", "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    # Each option's block runs from its `--name` line to the next option's.
    blocks = re.split(r"\n(?=\s+(?:-\w, )?--[a-z])", r.stdout)
    missing = []
    for block in blocks:
        m = re.match(r"\s+(?:-\w, )?--([a-z0-9-]+)", block)
        if not m or m.group(1) in ("help", "print-config", "version"):
            continue
        want = "SHARDSTREAM_" + m.group(1).upper().replace("-", "_")
        if f"[env: {want}" not in block:
            missing.append(m.group(1))
    assert not missing, f"options without their SHARDSTREAM_* variable: {missing}"


def test_a_bad_variable_is_named_and_switches_read_as_a_shell_writes_them() -> None:
    """A value from the environment was refused as if it were a flag ("invalid value '0' for
    '--ring-slots'"), though the operator had set SHARDSTREAM_RING_SLOTS in a unit file or a pod
    spec and passed no flag; and a switch took only "true"/"false", refusing the 1 such files
    often hold."""
    r = print_config(env={"SHARDSTREAM_RING_SLOTS": "0"})
    assert r.returncode == 2 and "SHARDSTREAM_RING_SLOTS=0" in r.stderr, r.stderr
    # Given as a flag, the flag is what is named.
    r = print_config("--ring-slots", "0", env={"SHARDSTREAM_RING_SLOTS": "4"})
    assert r.returncode == 2 and "--ring-slots" in r.stderr and "SHARDSTREAM_RING_SLOTS" not in r.stderr, r.stderr
    for text, value in (("1", True), ("yes", True), ("on", True), ("true", True), ("0", False), ("off", False)):
        r = print_config(env={"SHARDSTREAM_NO_KEEP_DECODED": text})
        assert r.returncode == 0, r.stderr
        assert tomllib.loads(r.stdout)["no-keep-decoded"] is value, text
    r = print_config(env={"SHARDSTREAM_INSECURE": "maybe"})
    assert r.returncode == 2 and "SHARDSTREAM_INSECURE=maybe" in r.stderr, r.stderr
