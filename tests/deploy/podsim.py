"""Runs the containers of a rendered Kubernetes pod spec on this machine, the way a kubelet would
as far as a test without a cluster can: one private mount namespace per pod (`unshare -m`), each
volume a host directory created as the kubelet creates it (hostPath DirectoryOrCreate: root,
0755; emptyDir: 0777; configMap: the ConfigMap's files, read-only) and bind-mounted at the
container's mountPath (read-only when the mount says so), and every process started as the
container's runAsUser/runAsGroup/supplementalGroups with only the capabilities its
securityContext leaves (setpriv). The network is the host's (the test's S3 server listens on
127.0.0.1).

What is not emulated: images (the command's first word is mapped to a host executable), cgroups
(resources), seccomp, and a read-only root file system (the mounts it needs are checked instead).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class User:
    uid: int
    gid: int
    groups: list[int] = field(default_factory=list)


def user_of(pod_spec: dict, container: dict) -> User:
    """The effective user of a container: its securityContext over the pod's."""
    pod = pod_spec.get("securityContext", {})
    own = container.get("securityContext", {})
    uid = own.get("runAsUser", pod.get("runAsUser"))
    if uid is None:
        raise AssertionError(f"container {container['name']} has no numeric runAsUser")
    gid = own.get("runAsGroup", pod.get("runAsGroup", 0))
    groups = list(pod.get("supplementalGroups", []))
    if "fsGroup" in pod:
        groups.append(pod["fsGroup"])
    return User(uid, gid, groups)


def setpriv(user: User, container: dict) -> list[str]:
    """setpriv arguments for the container's user and capabilities (drop ALL + add)."""
    caps = container.get("securityContext", {}).get("capabilities", {})
    dropped_all = "ALL" in caps.get("drop", [])
    added = [c.lower() for c in caps.get("add", [])]
    cmd = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}"]
    cmd += [f"--groups={','.join(map(str, user.groups))}"] if user.groups else ["--clear-groups"]
    if dropped_all:
        bounding = ",".join(["-all", *[f"+{c}" for c in added]])
        cmd += [f"--bounding-set={bounding}", "--inh-caps=-all"]
    if container.get("securityContext", {}).get("allowPrivilegeEscalation") is False:
        cmd += ["--no-new-privs"]
    return cmd


class Pod:
    """One pod's mount namespace, held open by a pause process (like the pod's pause container)."""

    def __init__(self, spec: dict, host_root: Path, host_paths: dict[str, Path], configmaps: dict[str, dict]) -> None:
        self.spec = spec
        self.host_root = host_root
        self.volumes: dict[str, Path] = {}
        for vol in spec.get("volumes", []):
            self.volumes[vol["name"]] = self._make_volume(vol, host_paths, configmaps)
        self.pause: subprocess.Popen[bytes] | None = None
        self.mounted: list[dict] | None = None

    def _make_volume(self, vol: dict, host_paths: dict[str, Path], configmaps: dict[str, dict]) -> Path:
        if "hostPath" in vol:
            hp = vol["hostPath"]
            d = host_paths.setdefault(hp["path"], self.host_root / "node" / hp["path"].lstrip("/"))
            if not d.exists():
                if hp.get("type") != "DirectoryOrCreate":
                    raise FileNotFoundError(f"hostPath {hp['path']} ({hp.get('type')}) does not exist on the node")
                d.mkdir(parents=True)  # as the kubelet: owned by root, mode 0755
                d.chmod(0o755)
            return d
        d = self.host_root / "pods" / str(id(self)) / vol["name"]
        d.mkdir(parents=True)
        if "emptyDir" in vol:
            d.chmod(0o777)
        elif "configMap" in vol:
            data = configmaps[vol["configMap"]["name"]]["data"]
            for name, text in data.items():
                (d / name).write_text(text)
                (d / name).chmod(0o644)
            d.chmod(0o755)
        elif "ephemeral" in vol:
            d.chmod(0o755)
        else:
            raise NotImplementedError(f"volume {vol}")
        fs_group = self.spec.get("securityContext", {}).get("fsGroup")
        if fs_group is not None and ("ephemeral" in vol or "emptyDir" in vol):
            # Volumes the kubelet manages are given to fsGroup: group-owned, setgid, group-writable.
            os.chown(d, 0, fs_group)
            d.chmod(0o2777 if "emptyDir" in vol else 0o2775)
        return d

    def start(self, containers: list[dict]) -> Pod:
        """Creates the pod's namespace with every mount point of `containers`. Each container
        then gets its own namespace below it with only its own mounts (see `command`)."""
        lines = ["set -eu"]
        tops = set()
        for m in (m for c in containers for m in c.get("volumeMounts", [])):
            top = "/" + Path(m["mountPath"]).parts[1]
            if top not in tops and not Path(m["mountPath"]).exists():
                tops.add(top)
                upper = self.host_root / "overlay" / str(id(self)) / top.strip("/")
                (upper / "up").mkdir(parents=True)
                (upper / "work").mkdir(parents=True)
                # An overlay over e.g. /etc lets the namespace create the mount point without
                # touching the machine's real /etc.
                opts = f"lowerdir={top},upperdir={upper}/up,workdir={upper}/work"
                lines.append(f"mount -t overlay overlay -o {opts} {top}")
            lines.append(f"mkdir -p {shlex.quote(m['mountPath'])}")
        lines.append("echo ready")
        lines.append("exec sleep 100000")
        self.pause = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines)],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.pause.stdout is not None
        line = self.pause.stdout.readline()
        if line.strip() != b"ready":
            self.pause.kill()
            raise RuntimeError(f"pod namespace setup failed: {self.pause.wait()}")
        return self

    def enter(self, container: dict) -> list[str]:
        """A command prefix that runs (as root) in a fresh mount namespace of this pod holding
        `container`'s volume mounts, read-only where the mount says so."""
        assert self.pause is not None
        lines = ["set -eu"]
        for m in container.get("volumeMounts", []):
            src, dst = shlex.quote(str(self.volumes[m["name"]])), shlex.quote(m["mountPath"])
            lines.append(f"mount --bind {src} {dst}")
            if m.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {dst}")
        lines.append('exec "$@"')
        return [
            "nsenter",
            "-t",
            str(self.pause.pid),
            "-m",
            "--",
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            "\n".join(lines),
            "sh",
        ]

    def command(self, container: dict, argv: list[str], exe: dict[str, str]) -> list[str]:
        """argv run in this pod as `container` and its user; `exe` maps image commands to host paths."""
        argv = [exe.get(argv[0], argv[0]), *argv[1:]]
        user = user_of(self.spec, container)
        return [*self.enter(container), *setpriv(user, container), *argv]

    def popen(self, container: dict, argv: list[str], exe: dict[str, str], env: dict[str, str], **kw):
        return subprocess.Popen(self.command(container, argv, exe), env=env, **kw)

    def run(self, container: dict, argv: list[str], exe: dict[str, str], env: dict[str, str], timeout: float = 60):
        return subprocess.run(
            self.command(container, argv, exe), env=env, capture_output=True, text=True, timeout=timeout
        )

    def stop(self) -> None:
        if self.pause is not None and self.pause.poll() is None:
            os.killpg(self.pause.pid, signal.SIGKILL)
            self.pause.wait()


def container_env(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment: envFrom secrets (optional ones may be missing), then env."""
    env: dict[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    for src in container.get("envFrom", []):
        ref = src.get("secretRef") or src.get("configMapRef")
        if ref["name"] in secrets:
            env.update(secrets[ref["name"]])
        elif not ref.get("optional"):
            raise KeyError(f"envFrom {ref['name']} is missing")
    for e in container.get("env", []):
        env[e["name"]] = e["value"]
    return env


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()
