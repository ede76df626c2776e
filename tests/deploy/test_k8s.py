"""deploy/k8s: every kustomization renders with `kubectl kustomize`, validates offline against the
Kubernetes 1.30 schemas (`kubernetes-validate --strict`, warnings are failures), follows the
security and labelling rules operators rely on, its monitoring uses only metrics the daemon
exports, and what the manifests say actually runs: the DaemonSet's init and daemon containers as
their users with their mounts, its probes, a scrape of its `metrics` port, then the example
training Job's trainer streaming a dataset through the socket, as the Job's user."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from podsim import Pod, container_env, wait_until
from s3server import S3Server

from conftest import write_dataset

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
TARGETS = ["base", "overlays/example-site", "overlays/monitoring", "examples/training-job", "examples/sidecar-job"]
CRD_KINDS = {"PodMonitor", "PrometheusRule"}
K8S_VERSION = "1.30.0"


def render(target: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize) is needed to render deploy/k8s"
    r = subprocess.run([kubectl, "kustomize", str(K8S / target)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def validator() -> str:
    exe = shutil.which("kubernetes-validate") or str(Path(sys.executable).with_name("kubernetes-validate"))
    assert os.access(exe, os.X_OK), "kubernetes-validate (requirements-test.txt) is not installed"
    return exe


@pytest.mark.parametrize("target", TARGETS)
def test_renders_and_validates_strictly(target: str) -> None:
    docs = render(target)
    core = [d for d in docs if d["kind"] not in CRD_KINDS]
    r = subprocess.run(
        [validator(), "--strict", "-k", K8S_VERSION, "-"],
        input=yaml.safe_dump_all(core),
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    problems = [line for line in out.splitlines() if not line.startswith("INFO")]
    assert not problems, out
    assert out.count("passed for resource") == len(core), out


CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


@pytest.mark.parametrize("target", TARGETS)
def test_objects_render_into_one_namespace(target: str) -> None:
    """`kubectl apply -k` puts an object without a namespace into the current context's: a
    PodMonitor or PrometheusRule there selects (or alerts on) nothing of the DaemonSet's pods."""
    docs = render(target)
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] not in CLUSTER_SCOPED}
    assert len(namespaces) == 1, {d["kind"]: d["metadata"].get("namespace") for d in docs}
    daemonsets = [d for d in docs if d["kind"] == "DaemonSet"]
    if daemonsets:
        assert namespaces == {daemonsets[0]["metadata"].get("namespace")}


CRITICAL_PRIORITY = {"system-node-critical", "system-cluster-critical"}


@pytest.mark.parametrize("target", TARGETS)
def test_critical_priority_outside_kube_system_has_its_quota(target: str) -> None:
    """Clusters that limit the critical priority classes (GKE; `limitedResources` in the
    ResourceQuota admission configuration) refuse such pods outside kube-system ("insufficient
    quota to match these scopes") unless the namespace has a ResourceQuota selecting the class."""
    docs = render(target)
    for doc in docs:
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        cls = spec.get("priorityClassName")
        ns = doc["metadata"].get("namespace")
        if cls not in CRITICAL_PRIORITY or ns == "kube-system":
            continue
        quotas = [
            q
            for q in docs
            if q["kind"] == "ResourceQuota"
            and q["metadata"].get("namespace") == ns
            and "pods" in q["spec"].get("hard", {})
            and any(
                e["scopeName"] == "PriorityClass" and e["operator"] == "In" and cls in e["values"]
                for e in q["spec"].get("scopeSelector", {}).get("matchExpressions", [])
            )
        ]
        assert quotas, f"{doc['kind']} {doc['metadata']['name']}: {cls} in namespace {ns} without its ResourceQuota"


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def only(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


@pytest.mark.parametrize("target", ["base", "overlays/example-site"])
def test_daemonset_follows_the_rules(target: str) -> None:
    docs = render(target)
    ds = only(docs, "DaemonSet")
    spec = pod_spec(ds)
    # Selectors: stable labels only (immutable on a DaemonSet).
    sel = ds["spec"]["selector"]["matchLabels"]
    assert sel == {"app.kubernetes.io/name": "shardstream", "app.kubernetes.io/component": "node-daemon"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    daemon = only_container(spec, "shardstream")
    sc = daemon["securityContext"]
    assert isinstance(sc["runAsUser"], int) and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert "memory" in daemon["resources"]["limits"] and daemon["resources"]["requests"]
    assert {p["name"]: p["containerPort"] for p in daemon["ports"]} == {"metrics": 9464}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert daemon[probe]["exec"]["command"][:2] == ["shardstream", "status"]
        assert daemon[probe]["timeoutSeconds"] >= 5
    # Cache and socket on the node, never an emptyDir; the config from the generated ConfigMap.
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["cache"]["hostPath"]["type"] == "DirectoryOrCreate"
    assert vols["socket-dir"]["hostPath"] == {"path": "/run/shardstream", "type": "DirectoryOrCreate"}
    cm = only(docs, "ConfigMap")
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]
    config = tomllib.loads(cm["data"]["shardstream.toml"])
    assert config["drain-timeout"] < spec["terminationGracePeriodSeconds"]
    assert config["listen"] == "unix:///run/shardstream/sock"
    assert only(docs, "ServiceAccount")["automountServiceAccountToken"] is False


SIZE_KEYS = {"cache-size", "packed-budget", "s3-part-size", "decoded-budget", "rdma-budget", "inline-budget"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40})


def size_bytes(v: object) -> int:
    """A size as the daemon's parser reads it: a byte count, or a number with a unit (2GiB)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(v))
    assert m, f"not a size: {v!r}"
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


@pytest.mark.parametrize("target", ["base", "overlays/example-site"])
def test_shipped_config_is_accepted_by_the_daemon(target: str, tmp_path: Path) -> None:
    """The ConfigMap's TOML passes the daemon's own checks (keys, values, allow list)."""
    cm = only(render(target), "ConfigMap")
    cfg = tmp_path / "shardstream.toml"
    cfg.write_text(cm["data"]["shardstream.toml"])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    r = subprocess.run(
        [daemon_binary(), "serve", "--config", str(cfg), "--print-config"],
        capture_output=True,
        text=True,
        timeout=30,
        env=clean,
    )
    assert r.returncode == 0, r.stderr
    effective = tomllib.loads(r.stdout)
    shipped = tomllib.loads(cm["data"]["shardstream.toml"])
    for key, value in shipped.items():
        if key in SIZE_KEYS:
            # --print-config shows sizes in bytes; the file may use units.
            assert size_bytes(effective[key]) == size_bytes(value), (key, effective[key], value)
        elif key != "allow":
            assert str(effective[key]) == str(value), (key, effective[key], value)
    assert effective.get("allow", []) == shipped.get("allow", [])


_QUANTITY = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_QUANTITY.update({"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40})
MEMORY_BUDGETS = ("packed-budget", "decoded-budget", "inline-budget")
# Beside the budgets: the index, gRPC buffers, the allocator's slack.
MEMORY_HEADROOM = 1 << 30


def quantity_bytes(q: object) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]i?)?", str(q))
    assert m, f"not a memory quantity: {q!r}"
    return int(float(m.group(1)) * _QUANTITY[m.group(2) or ""])


def daemon_containers(spec: dict) -> list[dict]:
    containers = spec["containers"] + spec.get("initContainers", [])
    return [c for c in containers if c.get("command", [])[:2] == ["shardstream", "serve"]]


def effective_config(docs: list[dict], spec: dict, daemon: dict, tmp_path: Path) -> tuple[dict, set[str]]:
    """What the container's daemon runs with (`--print-config` over its command, its config file
    from the ConfigMap, its environment), and the keys the manifests set rather than defaults."""
    argv = [*daemon["command"][1:], *daemon.get("args", [])]
    env = container_env(daemon, {})
    explicit = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    explicit |= {k.removeprefix("SHARDSTREAM_").lower().replace("_", "-") for k in env if k.startswith("SHARDSTREAM_")}
    if "--config" in argv:
        path = argv[argv.index("--config") + 1]
        mount = next(m for m in daemon["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
        text = cm["data"][path.removeprefix(mount["mountPath"] + "/")]
        explicit |= set(tomllib.loads(text))
        local = tmp_path / f"{daemon['name']}.toml"
        local.write_text(text)
        argv[argv.index("--config") + 1] = str(local)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SHARDSTREAM_")}
    r = subprocess.run(
        [daemon_binary(), *argv, "--print-config"], capture_output=True, text=True, timeout=30, env={**clean, **env}
    )
    assert r.returncode == 0, r.stderr
    return tomllib.loads(r.stdout), explicit


@pytest.mark.parametrize("target", TARGETS)
def test_memory_budgets_fit_the_memory_limit(target: str, tmp_path: Path) -> None:
    """A daemon container with a memory limit is told its budgets (a file that replaces the base
    config whole must carry them over), and they fit: the packed rings, about twice the decoded
    budget at peak (see base/shardstream.toml), the inline batches queued, and headroom stay under
    the limit."""
    docs = render(target)
    checked = 0
    for doc in docs:
        if doc["kind"] not in {"DaemonSet", "Job", "Deployment", "StatefulSet"}:
            continue
        spec = pod_spec(doc)
        for daemon in daemon_containers(spec):
            limit = daemon.get("resources", {}).get("limits", {}).get("memory")
            if limit is None:
                continue
            config, explicit = effective_config(docs, spec, daemon, tmp_path)
            where = f"{doc['kind']} {doc['metadata']['name']}, container {daemon['name']}"
            for key in MEMORY_BUDGETS:
                assert key in explicit, f"{where}: memory limit {limit} but no {key}"
            packed, decoded, inline = (size_bytes(config[k]) for k in MEMORY_BUDGETS)
            used = packed + 2 * decoded + inline + MEMORY_HEADROOM
            if config.get("rdma") is True:
                # rdma streams' staging buffers, registered memory of their own budget.
                assert "rdma-budget" in explicit, f"{where}: --rdma with a memory limit {limit} but no rdma-budget"
                used += size_bytes(config["rdma-budget"])
            assert used <= quantity_bytes(limit), f"{where}: budgets need {used} bytes, limit {limit}"
            checked += 1
    if target != "examples/training-job":
        assert checked, "no daemon container with a memory limit"


def only_container(spec: dict, name: str) -> dict:
    return next(c for c in spec["containers"] + spec.get("initContainers", []) if c["name"] == name)


def exported_metrics() -> set[str]:
    text = (REPO / "server" / "src" / "metrics.rs").read_text()
    return set(re.findall(r'"(shardstream_[a-z_]+)"', text))


def test_monitoring_uses_exported_metrics_and_selects_the_daemon(tmp_path: Path) -> None:
    docs = render("overlays/monitoring")
    ds = only(docs, "DaemonSet")
    pm = only(docs, "PodMonitor")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in pm["spec"]["selector"]["matchLabels"].items())
    ports = {p["name"] for c in pod_spec(ds)["containers"] for p in c.get("ports", [])}
    assert {e["port"] for e in pm["spec"]["podMetricsEndpoints"]} <= ports
    # ShardstreamDown tells the daemon's targets by the pod's name label, whatever the job is called.
    assert "app.kubernetes.io/name" in pm["spec"].get("podTargetLabels", [])
    prometheus_rule = only(docs, "PrometheusRule")
    rules = [r for g in prometheus_rule["spec"]["groups"] for r in g["rules"]]
    names = exported_metrics()
    assert len(names) >= 10, names
    alerts = {r["alert"] for r in rules}
    assert {"ShardstreamTrainerStalled", "ShardstreamCacheThrash", "ShardstreamStorageErrors"} <= alerts
    for r in rules:
        used = set(re.findall(r"shardstream_[a-z_]+", r["expr"]))
        assert used <= names, f"{r['alert']}: not exported: {used - names}"
        assert r["for"] and r["labels"]["severity"] and r["annotations"]["summary"]
    # Valid PromQL and rule structure, by Prometheus' own checker.
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": prometheus_rule["spec"]["groups"]}))
    r = subprocess.run([promtool(), "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # One set of alerts: the plain rules file (unit-tested with promtool) and the CRD agree.
    plain = REPO / "deploy" / "monitoring" / "alerts.yaml"
    if plain.exists():
        assert yaml.safe_load(plain.read_text())["groups"] == prometheus_rule["spec"]["groups"]


def promtool() -> str:
    """promtool: $PROMTOOL, on PATH, or where scripts/deploy-tools.sh extracts it."""
    cache = Path(os.environ.get("SHARDSTREAM_CACHE", Path.home() / ".cache" / "shardstream"))
    for c in [
        os.environ.get("PROMTOOL", ""),
        shutil.which("promtool") or "",
        str(cache / "tools" / "prometheus" / "usr" / "bin" / "promtool"),
    ]:
        if c and os.access(c, os.X_OK):
            return c
    raise AssertionError("promtool not found: run scripts/deploy-tools.sh (or set PROMTOOL)")


def test_sidecar_variant_is_a_native_sidecar() -> None:
    job = only(render("examples/sidecar-job"), "Job")
    spec = pod_spec(job)
    side = only_container(spec, "shardstream")
    assert side in spec["initContainers"] and side["restartPolicy"] == "Always"
    assert side["startupProbe"]["exec"]["command"][:2] == ["shardstream", "status"]
    trainer = only_container(spec, "trainer")
    assert {"name": "SHARDSTREAM_ADDR", "value": "unix:///run/shardstream/sock"} in trainer["env"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in vols["socket-dir"], "the socket directory must be private to the pod"


VOLUME = re.compile(r"((?:^ *#.*\n)+) *- name: (\S+)\n *(\w+):", re.MULTILINE)


def test_volume_comments_say_where_the_data_lives() -> None:
    """A generic ephemeral volume is a PersistentVolumeClaim from a StorageClass (by default often
    a network disk), not the node's ephemeral storage an emptyDir uses: a cache sized and placed
    by the comment's word would land elsewhere."""
    found = {}
    for path in K8S.rglob("*.yaml"):
        for comment, name, kind in VOLUME.findall(path.read_text()):
            found[f"{path.relative_to(K8S)}:{name}"] = kind
            comment = " ".join(line.strip().lstrip("#").strip() for line in comment.splitlines())
            where = f"{path.relative_to(K8S)}, volume {name}: {comment!r}"
            if "ephemeral storage" in comment:
                assert kind == "emptyDir", where
            if kind == "ephemeral":
                assert "PersistentVolumeClaim" in comment and "StorageClass" in comment, where
    assert "ephemeral" in found.values(), f"no commented generic ephemeral volume: {found}"


# --- running what the manifests say ---------------------------------------------------------


def daemon_binary() -> str:
    """The standalone `shardstream` executable (what the image ships). `cargo test` builds it."""
    candidates = [os.environ.get("SHARDSTREAM_DAEMON_BIN", "")]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    candidates += [str(target / "debug" / "shardstream"), str(target / "release" / "shardstream")]
    found = [c for c in candidates if c and os.access(c, os.X_OK)]
    assert found, f"no shardstream executable in {candidates}: run `cargo build -p shardstream --bin shardstream`"
    return found[0]


@pytest.fixture
def node() -> Iterator[Path]:
    """The node's file system root for hostPaths and pod volumes (traversable by every uid)."""
    d = Path(tempfile.mkdtemp(prefix="shardstream-k8s-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


TRAINER = textwrap.dedent(
    """
    # Imports first (the Python environment is under root's home), then become the Job's user:
    # setuid from root drops every capability, so what follows runs exactly as that user.
    import json, os, sys
    import shardstream
    uid, gid, groups = int(sys.argv[2]), int(sys.argv[3]), [int(g) for g in sys.argv[4].split(",") if g]
    os.setgroups(groups); os.setgid(gid); os.setuid(uid)
    assert os.getuid() == uid and os.geteuid() == uid
    keys = []
    for batch in shardstream.Loader(sys.argv[1], batch_size=32):  # connect="auto": SHARDSTREAM_ADDR
        keys += batch["__key__"]
    print(json.dumps({"uid": os.getuid(), "keys": len(keys), "unique": len(set(keys))}))
    """
)


def died(proc: subprocess.Popen) -> str:
    """Why a daemon is not ready: its exit code and stderr if it exited."""
    if proc.poll() is None:
        return "still running, not ready"
    return f"exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(os.geteuid() != 0, reason="running containers as their runAsUser needs root (setpriv, unshare)")
def test_daemonset_and_training_job_run_as_written(node: Path, s3: S3Server) -> None:
    samples = write_dataset(s3.bucket("training") / "k8s", n=300, per_shard=40)
    docs = render("base")
    ds = only(docs, "DaemonSet")
    spec = pod_spec(ds)
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    exe = {"shardstream": daemon_binary(), "sh": "/bin/sh"}
    # The site's Secret `shardstream-s3` (envFrom): the test's S3 server.
    secrets = {"shardstream-s3": s3.env()}
    host_paths: dict[str, Path] = {}
    pod = Pod(spec, node, host_paths, configmaps)
    daemon = only_container(spec, "shardstream")
    config = tomllib.loads(configmaps[spec["volumes"][-1]["configMap"]["name"]]["data"]["shardstream.toml"])
    metrics_port = int(config["metrics-addr"].rsplit(":", 1)[1])
    env = container_env(daemon, secrets)
    if not port_free(metrics_port):
        # Another process on this shared machine holds the manifest's port; the environment
        # overrides the config file exactly as it would in the pod.
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            metrics_port = s.getsockname()[1]
        env["SHARDSTREAM_METRICS_ADDR"] = f"0.0.0.0:{metrics_port}"
        print(f"port {config['metrics-addr']} busy here: metrics on {metrics_port} instead")
    proc = None
    try:
        pod.start(spec["initContainers"] + spec["containers"])
        # Without the init container, the non-root daemon cannot create its socket in the
        # root-owned directory the kubelet made: that is why it exists.
        r = pod.run(daemon, [*daemon["command"], "--print-config"], exe, env)
        assert r.returncode == 0, r.stderr
        first = pod.popen(daemon, daemon["command"], exe, env, stderr=subprocess.PIPE, text=True)
        _, err = first.communicate(timeout=60)
        assert first.returncode != 0 and "/run/shardstream" in err, err
        for init in spec["initContainers"]:
            r = pod.run(init, [*init["command"]], exe, container_env(init, secrets))
            assert r.returncode == 0, r.stderr
        sock_dir = host_paths["/run/shardstream"]
        assert (sock_dir.stat().st_uid, sock_dir.stat().st_mode & 0o777) == (65532, 0o750)

        proc = pod.popen(daemon, daemon["command"], exe, env, stderr=subprocess.PIPE, text=True)
        probe = daemon["readinessProbe"]["exec"]["command"]
        assert wait_until(lambda: pod.run(daemon, probe, exe, env).returncode == 0, timeout=60), died(proc)
        for kind in ("startupProbe", "livenessProbe"):
            r = pod.run(daemon, daemon[kind]["exec"]["command"], exe, env)
            assert r.returncode == 0, r.stderr
        sock = sock_dir / "sock"
        assert (sock.stat().st_uid, sock.stat().st_gid, sock.stat().st_mode & 0o777) == (65532, 65532, 0o660)

        # The example training Job, as its user, through its own mounts.
        job_docs = render("examples/training-job")
        job_spec = pod_spec(only(job_docs, "Job"))
        job = Pod(job_spec, node, host_paths, {})
        trainer = only_container(job_spec, "trainer")
        try:
            job.start(job_spec.get("initContainers", []) + job_spec["containers"])
            for init in job_spec.get("initContainers", []):
                r = job.run(init, init["command"], exe, container_env(init, {}))
                assert r.returncode == 0, r.stderr
            user = job_spec["securityContext"]
            tenv = {**container_env(trainer, {}), "PYTHONPATH": os.pathsep.join(sys.path)}
            argv = [
                *job.enter(trainer),
                sys.executable,
                "-c",
                TRAINER,
                "s3://training/k8s/",
                str(user["runAsUser"]),
                str(user["runAsGroup"]),
                ",".join(map(str, user.get("supplementalGroups", []))),
            ]
            r = subprocess.run(argv, env=tenv, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            got = json.loads(r.stdout.strip().splitlines()[-1])
            assert got == {"uid": user["runAsUser"], "keys": len(samples), "unique": len(samples)}
            # A user outside the socket's group is refused by the kernel.
            argv[-1] = ""
            r = subprocess.run(argv, env=tenv, capture_output=True, text=True, timeout=300)
            assert r.returncode != 0 and ("PermissionError" in r.stderr or "ConnectionError" in r.stderr), r.stderr
        finally:
            job.stop()

        # The metrics port answers with the daemon's metrics.
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert "shardstream_samples_served_total" in body and "shardstream_storage_requests_total" in body

        # SIGTERM, as the kubelet stops the pod: the daemon drains and exits 0 within the grace.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=spec["terminationGracePeriodSeconds"]) == 0
        _, err = proc.communicate()
        lines = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
        assert any(e.get("message") == "serving" for e in lines), err[-2000:]
        assert not sock.exists()
        assert any(host_paths["/var/cache/shardstream"].iterdir()), "the S3 shards went to the node cache"
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        pod.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="running containers as their runAsUser needs root (setpriv, unshare)")
def test_sidecar_job_runs_as_written(node: Path, s3: S3Server) -> None:
    """The native-sidecar variant: the daemon (init container, restartPolicy: Always) and the
    trainer share the pod's uid and an emptyDir socket directory; the socket stays owner-only."""
    samples = write_dataset(s3.bucket("training") / "sidecar", n=120, per_shard=40)
    spec = pod_spec(only(render("examples/sidecar-job"), "Job"))
    exe = {"shardstream": daemon_binary()}
    side = only_container(spec, "shardstream")
    trainer = only_container(spec, "trainer")
    env = container_env(side, {"shardstream-s3": s3.env()})
    argv = [*side["command"], *side.get("args", [])]
    metrics = argv[argv.index("--metrics-addr") + 1]
    if not port_free(int(metrics.rsplit(":", 1)[1])):
        with socket.socket() as s:
            s.bind(("0.0.0.0", 0))
            port = s.getsockname()[1]
        argv[argv.index("--metrics-addr") + 1] = f"0.0.0.0:{port}"
        print(f"port {metrics} busy here: metrics on {port} instead")
    pod = Pod(spec, node, {}, {})
    proc = None
    try:
        pod.start(spec["initContainers"] + spec["containers"])
        proc = pod.popen(side, argv, exe, env, stderr=subprocess.PIPE, text=True)
        startup = side["startupProbe"]["exec"]["command"]
        assert wait_until(lambda: pod.run(side, startup, exe, env).returncode == 0, timeout=60), died(proc)
        assert pod.run(side, side["livenessProbe"]["exec"]["command"], exe, env).returncode == 0
        sock = pod.volumes["socket-dir"] / "sock"
        assert (sock.stat().st_uid, sock.stat().st_mode & 0o777) == (spec["securityContext"]["runAsUser"], 0o600)
        user = spec["securityContext"]
        tenv = {**container_env(trainer, {}), "PYTHONPATH": os.pathsep.join(sys.path)}
        groups = [user["fsGroup"]] if "fsGroup" in user else []
        r = subprocess.run(
            [
                *pod.enter(trainer),
                sys.executable,
                "-c",
                TRAINER,
                "s3://training/sidecar/",
                str(user["runAsUser"]),
                str(user["runAsGroup"]),
                ",".join(map(str, groups)),
            ],
            env=tenv,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got == {"uid": user["runAsUser"], "keys": len(samples), "unique": len(samples)}
        # The trainer exited: the kubelet stops the sidecar with SIGTERM; the Job can complete.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=spec["terminationGracePeriodSeconds"]) == 0
        assert not sock.exists()
        # The cache volume's root is fsGroup's (2775, root-owned): not the pod's to chmod. A
        # warning at every start to chmod it would be one no operator of the Job can act on.
        log = proc.stderr.read() if proc.stderr else ""
        assert "other users can read the cached copies" not in log, log
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        pod.stop()
