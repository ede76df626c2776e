"""Test certificates and tokens for a daemon's TCP listener (made with the openssl command at test
time; nothing secret is committed), and the flags and environment that use them.

    pki = make_pki(tmp_path)                       # or the module-scoped `pki` fixture below
    cmd = [SHARDSTREAM, "serve", "--listen", f"tcp://{hosts.daemon_ip}:{port}", *serve_args(pki)]
    env = {**os.environ, **client_env(pki)}        # for the trainer: tls://{hosts.daemon_ip}:{port}

The daemon's certificate is valid for 10.231.0.1 (the daemon's side of tests/netns.py's pair),
127.0.0.1 and localhost. A plaintext TCP listener is refused except with `--insecure` on
loopback, so a daemon in the netns pair needs these.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

TOKEN_A = "tok-A-9f8e7d6c5b4a39281706"
TOKEN_B = "tok-B-0a1b2c3d4e5f60718293"
WRONG = "tok-W-deadbeefdeadbeef0000"
# Subject CNs: the daemon's, and the client certificate's (what the allow list's `client` matches).
DAEMON_CN = "daemon"
CLIENT_CN = "trainer"


def available() -> str | None:
    """Why certificates cannot be made here, or None."""
    return None if shutil.which("openssl") else "no openssl command to make test certificates"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip


def make_pki(d: Path) -> Path:
    """Writes into `d`: ca.pem/.key, daemon.pem/.key (signed by ca), trainer.pem/.key (a client
    certificate signed by ca), other-ca.pem (a CA that signed nothing of ours), `tokens` (the
    daemon's --tokens file: trainer-a, trainer-b) and token-a, token-b, token-wrong (client token
    files). Returns `d`."""
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "other-ca")
    _leaf(d, DAEMON_CN, "ca", "subjectAltName=IP:10.231.0.1,IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _leaf(d, CLIENT_CN, "ca", "extendedKeyUsage=clientAuth\n")
    (d / "tokens").write_text(f"# name:token\ntrainer-a:{TOKEN_A}\ntrainer-b:{TOKEN_B}\n")
    (d / "tokens").chmod(0o600)
    for name, tok in (("a", TOKEN_A), ("b", TOKEN_B), ("wrong", WRONG)):
        (d / f"token-{name}").write_text(tok + "\n")
    return d


def serve_args(pki: Path) -> list[str]:
    """`serve` flags for TLS with the test tokens."""
    return [
        "--tls-cert",
        str(pki / "daemon.pem"),
        "--tls-key",
        str(pki / "daemon.key"),
        "--tokens",
        str(pki / "tokens"),
    ]


def client_env(pki: Path, token: str | None = "a", ca: str = "ca") -> dict[str, str]:
    """The trainer's environment for a `tls://` daemon: the CA and (unless None) a token file."""
    env = {"SHARDSTREAM_TLS_CA": str(pki / f"{ca}.pem")}
    if token:
        env["SHARDSTREAM_TOKEN_FILE"] = str(pki / f"token-{token}")
    return env
