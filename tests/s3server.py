"""A real S3-compatible server on 127.0.0.1 for the end-to-end tests: s3s-fs (built once per
machine by scripts/s3-server.sh, whose path `make test` passes in SHARDSTREAM_S3_SERVER). Buckets
are directories under its root and objects are files, so tests write shards with the real
`webdataset` library straight into a bucket, and can alter an object behind the daemon's back."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

ACCESS_KEY = "shardstream-test"
SECRET_KEY = "shardstream-test-secret"


def server_binary() -> str:
    path = os.environ.get("SHARDSTREAM_S3_SERVER")
    if not path:
        found = subprocess.run(["bash", "scripts/s3-server.sh"], capture_output=True, text=True, check=True)
        path = found.stdout.strip()
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"S3 server {path!r} is not executable (run `bash scripts/s3-server.sh`)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)

    def env(self, secret: str = SECRET_KEY) -> dict[str, str]:
        """What a daemon (or `shardstream index`) needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_REGION": "us-east-1",
            # Nothing from the machine's own AWS setup may leak into a test.
            "AWS_CONFIG_FILE": "/dev/null",
            "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def bucket(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def start(self) -> S3Server:
        self.proc = subprocess.Popen(
            [
                server_binary(),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--access-key",
                ACCESS_KEY,
                "--secret-key",
                SECRET_KEY,
                str(self.root),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"s3s-fs exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.01)
        raise RuntimeError("s3s-fs did not listen within 30 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
