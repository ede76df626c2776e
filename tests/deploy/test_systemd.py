"""deploy/systemd: the unit passes `systemd-analyze verify` without a warning, its hardening scores
an exposure <= 5 in `systemd-analyze security --offline=true`, and the sysusers.d and tmpfiles.d
snippets create what they promise in a scratch root."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml
from deployutil import DEPLOY, STOP_HEADROOM, drain_timeout, shardstream_binary, tool

UNIT = DEPLOY / "systemd" / "shardstream.service"


def unit_with_binary(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at the binary built here: `verify` checks that the
    command exists, and /usr/local/bin/shardstream is where an install puts it, not a test."""
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/shardstream serve" in text
    out = tmp_path / UNIT.name
    out.write_text(text.replace("/usr/local/bin/shardstream", str(shardstream_binary())))
    return out


def test_unit_verifies_without_warnings(tmp_path: Path) -> None:
    unit = unit_with_binary(tmp_path)
    r = subprocess.run([tool("systemd-analyze"), "verify", str(unit)], capture_output=True, text=True, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # Unknown keys and bad values are only warnings (rc 0): any line about our unit is a defect.
    assert UNIT.name not in out, out


def test_unit_exposure_at_most_5(tmp_path: Path) -> None:
    unit = unit_with_binary(tmp_path)
    r = subprocess.run(
        [tool("systemd-analyze"), "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    assert float(m.group(1)) <= 5.0, r.stdout


def test_unit_contract() -> None:
    """What the README and the other deployments rely on, so an edit cannot drop it unnoticed."""
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().replace("\\\n", " ").splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            keys.setdefault(k.strip(), []).append(v.strip())
    assert keys["Type"] == ["notify"]
    assert keys["User"] == ["shardstream"] and "DynamicUser" not in keys
    assert keys["RuntimeDirectory"] == ["shardstream"] and keys["CacheDirectory"] == ["shardstream"]
    assert keys["ProtectSystem"] == ["strict"] and keys["NoNewPrivileges"] == ["yes"]
    assert keys["CapabilityBoundingSet"] == [""]
    assert keys["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert "@system-service" in keys["SystemCallFilter"]
    exec_start = keys["ExecStart"][0].split()
    assert exec_start[0].startswith("/"), "ExecStart must be absolute"
    assert "unix:///run/shardstream/sock" in exec_start
    # The daemon drains on SIGTERM, then syncs its cache: systemd must wait longer before SIGKILL.
    drain = drain_timeout(*exec_start[2:])
    assert int(keys["TimeoutStopSec"][0]) >= drain + STOP_HEADROOM, f"drain-timeout is {drain} s"
    # READY=1 comes after the cache is adopted: as long as the DaemonSet's startupProbe allows it.
    daemonset = yaml.safe_load((DEPLOY / "k8s" / "base" / "daemonset.yaml").read_text())
    daemon = next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "shardstream")
    startup = daemon["startupProbe"]["periodSeconds"] * daemon["startupProbe"]["failureThreshold"]
    assert int(keys["TimeoutStartSec"][0]) >= startup, f"the startupProbe allows {startup} s"


def test_sysusers_and_tmpfiles_in_a_scratch_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for kind, src in (("sysusers.d", "shardstream.sysusers.conf"), ("tmpfiles.d", "shardstream.tmpfiles.conf")):
        (root / "usr" / "lib" / kind).mkdir(parents=True)
        shutil.copy(DEPLOY / "systemd" / src, root / "usr" / "lib" / kind / "shardstream.conf")
    (root / "etc").mkdir()
    r = subprocess.run([tool("systemd-sysusers"), f"--root={root}", "shardstream.conf"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    passwd = (root / "etc" / "passwd").read_text()
    group = (root / "etc" / "group").read_text()
    user = next(line.split(":") for line in passwd.splitlines() if line.startswith("shardstream:"))
    assert int(user[2]) < 1000, "a system uid"
    assert user[6].endswith("nologin")
    gid = next(line.split(":")[2] for line in group.splitlines() if line.startswith("shardstream:"))
    assert user[3] == gid
    r = subprocess.run(
        [tool("systemd-tmpfiles"), f"--root={root}", "--create", "shardstream.conf"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    logs = root / "var" / "log" / "shardstream"
    assert logs.is_dir() and (logs.stat().st_mode & 0o777) == 0o755
