"""deploy/monitoring: the alert rules pass `promtool check rules` and their `promtool test rules`
cases; the Grafana dashboard is provisionable as is (datasource variable, fixed uid, no export
placeholders) and every panel query is valid PromQL; and every metric the rules and the dashboard
name is exported by a real daemon, scraped after it served epochs from a real S3 server with a
cache too small for the dataset, a storage outage mid-download, and a packed-mode stream."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
import yaml
from deployutil import DEPLOY, tool
from s3server import S3Server, free_port

import shardstream
from conftest import Daemon

MON = DEPLOY / "monitoring"
RULES = MON / "alerts.yaml"
DASHBOARD = MON / "grafana-dashboard.json"
# Synthesised by Prometheus for every target, not exported by the daemon.
NOT_EXPORTED = {"up"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_rules_check_and_unit_tests() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("test", "rules", "alerts.test.yaml", cwd=MON)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MON / "alerts.test.yaml").read_text()))
    alerts = {rule["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for rule in g["rules"]}
    assert alerts == tested, f"alerts without a test case: {alerts - tested}"


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    return exprs


def test_dashboard_is_provisionable() -> None:
    text = DASHBOARD.read_text()
    dash = json.loads(text)
    # Exported-for-sharing dashboards carry __inputs and ${DS_...}, which file provisioning and the
    # Grafana Helm sidecar do not resolve ("Datasource named ${DS_PROMETHEUS} was not found").
    assert "__inputs" not in dash and "${DS_" not in text
    assert dash["id"] is None and dash["uid"] == "shardstream-node"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert 'instance=~"$instance"' in t["expr"], f"{panel['title']}: not filtered by the node variable"


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Grafana has no offline linter; promtool parses each query as a recording rule, with the
    Grafana variables replaced by what Grafana would substitute."""
    rules = []
    for i, expr in enumerate(dashboard_exprs()):
        concrete = expr.replace("$__rate_interval", "5m").replace("$instance", ".*")
        assert "$" not in concrete, expr
        rules.append({"record": f"shardstream:dashboard_panel_{i}", "expr": concrete})
    f = tmp_path / "dashboard-rules.yaml"
    f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = promtool("check", "rules", str(f))
    assert r.returncode == 0, r.stdout + r.stderr


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers not followed by `(` that are not label
    names inside braces, keywords or durations; ours all start with shardstream_ (or `up`)."""
    no_labels = re.sub(r"\{[^}]*\}", "", expr)
    no_by = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", no_labels)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", no_by))
    keywords = {"and", "or", "unless", "bool", "offset"}
    return {n for n in names if n not in keywords and not re.fullmatch(r"\d+[smhdwy]?", n)}


def test_metric_name_extraction() -> None:
    assert metric_names('sum by (instance, rank) (rate(a_total{instance=~"x"}[5m])) / b > 0.5 and on (i) c') == {
        "a_total",
        "b",
        "c",
    }


def used_metric_names() -> set[str]:
    names: set[str] = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            names |= metric_names(rule["expr"])
    for expr in dashboard_exprs():
        names |= metric_names(expr.replace("$__rate_interval", "5m"))
    dash = json.loads(DASHBOARD.read_text())
    for v in dash["templating"]["list"]:
        m = re.search(r"label_values\((\w+)", v.get("definition", ""))
        if m:
            names.add(m.group(1))
    return names


def write_fixed_size_dataset(root: Path, shards: int, per_shard: int, size: int) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(11)
    out: dict[str, bytes] = {}
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i in range(shards * per_shard):
            key = f"mon/{i:05d}"
            out[key] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            sink.write({"__key__": key, "bin": out[key]})
    return out


@pytest.fixture()
def s3(tmp_path: Path):
    server = S3Server(tmp_path / "s3").start()
    yield server
    server.stop()


def test_every_metric_used_is_exported_by_a_real_daemon(tmp_path: Path, s3: S3Server) -> None:
    used = used_metric_names()
    assert {"shardstream_consumer_wait_seconds_total", "shardstream_cache_evictions_total"} <= used
    url = "s3://data/mon/"
    samples = write_fixed_size_dataset(s3.bucket("data") / "mon", shards=32, per_shard=4, size=64 << 10)
    total = sum(p.stat().st_size for p in (s3.root / "data" / "mon").glob("*.tar"))
    port = free_port()
    d = Daemon(
        tmp_path / "daemon",
        args=[
            "--metrics-addr",
            f"127.0.0.1:{port}",
            # Half the dataset (16 of 32 shards; a consumer pins a few at a time): the epochs evict.
            "--cache-size",
            str(total // 2),
            # Small parts, one at a time: the outage below lands mid-download.
            "--s3-part-size",
            "64KiB",
            "--s3-concurrency",
            "1",
            "--prefetch-parallel",
            "1",
            # Read back from the budgets' gauges below.
            "--packed-budget",
            "96MiB",
            "--inline-budget",
            "40MiB",
            "--decoded-budget",
            "24MiB",
        ],
        env=s3.env(),
    ).start()
    try:
        seen: dict[str, int] = {}
        errors: list[BaseException] = []

        def epoch(e: int) -> None:
            try:
                loader = shardstream.Loader(url, batch_size=4, seed=1, connect=d.addr, shuffle_window=2)
                loader.set_epoch(e)
                for batch in loader:
                    for i, key in enumerate(batch["__key__"]):
                        assert bytes(batch["bin"][i]) == samples[key]
                        seen[key] = seen.get(key, 0) + 1
                del loader, batch  # the stream belongs to this thread: drop it here
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        t = threading.Thread(target=epoch, args=(0,))
        t.start()
        deadline = time.monotonic() + 60
        while d.status()["storage_bytes"] == 0:
            assert time.monotonic() < deadline, "no download started"
            time.sleep(0.002)
        s3.stop()  # a storage outage mid-download: the daemon retries
        time.sleep(0.5)
        s3.start()
        t.join(timeout=300)
        assert not t.is_alive() and not errors, errors
        epoch(1)
        assert not errors, errors
        assert seen == {k: 2 for k in samples}, "two epochs, each sample exactly once per epoch"
        # Packed mode: the ring gauge.
        packed = shardstream.Loader(
            url, batch_size=4, fields=["bin"], collate="stack", shuffle_window=2, connect=d.addr
        )
        n = sum(len(b["bin"]) for b in packed)
        assert n == len(samples)
        # The packed stream's ring goes to the kept pool once its stream has ended, a moment
        # after its last batch.
        deadline = time.monotonic() + 20
        while (status := d.status())["ring_bytes"] or not status["kept_ring_bytes"]:
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        assert status["storage_retries"] > 0, "the outage did not interrupt a request"
        assert status["cache"]["evictions"] > 0, status["cache"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        assert d.stop() == 0
    exported = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))
    missing = used - exported - NOT_EXPORTED
    assert not missing, f"used by the rules or the dashboard but not exported: {sorted(missing)}"
    gauges = {name: float(v) for name, v in re.findall(r"^(\w+) (\S+)$", text, re.M)}
    assert gauges["shardstream_packed_budget_bytes"] == 96 << 20
    assert gauges["shardstream_inline_budget_bytes"] == 40 << 20
    assert gauges["shardstream_parquet_decoded_budget_bytes"] == 24 << 20
    assert gauges["shardstream_rdma_budget_bytes"] == 0, "no --rdma: no staging budget, as status says"
    # Every stream ended: no inline batch is queued, and what the packed budget still holds is
    # the ring kept for this user's next packed stream.
    assert gauges["shardstream_inline_queued_bytes"] == 0
    assert gauges["shardstream_packed_budget_used_bytes"] == status["kept_ring_bytes"]
