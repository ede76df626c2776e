"""A fault-injecting HTTP proxy for the chaos suite: put in front of the real S3 server (s3s-fs),
it forwards every request unchanged (the Host header too, so SigV4 signatures still verify) and
spoils a share of them, picked at random, in one of the ways real networks and stores do:

- ``reset``: the connection is reset (RST) before any response;
- ``slowdown``: ``503 SlowDown``, S3's throttling answer;
- ``truncate``: the response promises its full length and the connection closes halfway;
- ``corrupt``: the full length arrives, with one byte inverted: only a checksum can tell.

``truncate`` and ``corrupt`` only apply to responses with an object body (GET of an object, not a
listing: a listing's XML has no checksum for anyone to check, and S3 itself signs nothing there).
What was injected is counted by kind in ``counts``.

``kms`` answers as S3 does for objects encrypted with SSE-KMS (or SSE-C): every ETag, in headers
and listings, is 32 hex digits that are not the MD5 of the bytes, and object responses carry
``x-amz-server-side-encryption: aws:kms``; the bytes pass unchanged. ``multipart`` gives every
ETag, in headers and listings, the form of a multipart upload's (``"<32 hex>-2"``), which says
nothing of the bytes either; given a predicate of the object's path (``/bucket/key``) rather than
``True``, only the objects it picks (the others answer and list as the store does: a dataset
uploaded partly in one part, partly in several).

``etag_per_range`` answers every object GET with an ETag of its own range (32 hex digits), as
if the object were rewritten between any two GETs of it; listings pass as they are.

``refuse`` (a predicate of an object GET's ``"/bucket/key Range"``, as ``object_gets`` counts
it) answers the GETs it picks ``403 AccessDenied``, every time: a read no retry gets through.

``tls`` (a certificate and its key, PEM files) makes the proxy an ``https://`` endpoint: the
store as S3 itself is reached, over TLS (each connection's handshake runs in its own thread).

``hold`` keeps every object GET that long before forwarding it (or refusing it with ``slowdown``),
and ``peak_gets`` is the most object GETs that were in the proxy at once: with a hold longer than
a request takes, it tells how many requests a client makes concurrently, without timing anything.
``object_gets`` counts the object GETs by path and range. ``first_try`` (a kind, settable at
any time) spoils, besides the random share, the first GET of each object and range from then on:
every download meets the fault once, and its next try gets through. ``flip_at`` (an index into
the body, negative from its end) makes ``corrupt`` invert that byte rather than one at random."""

from __future__ import annotations

import hashlib
import html
import http.client
import random
import re
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

KINDS = ("reset", "slowdown", "truncate", "corrupt")

# Headers that belong to one hop, not to the request or response being forwarded.
HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}

SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>'
)


def kms_etag(etag: str) -> str:
    """An ETag as SSE-KMS gives it: 32 hex digits, stable for the object, not its MD5."""
    return '"' + hashlib.md5(b"kms:" + etag.strip('"').encode()).hexdigest() + '"'


def kms_answer(status: int, headers: list[tuple[str, str]], data: bytes) -> tuple[list[tuple[str, str]], bytes]:
    out = [(k, kms_etag(v) if k.lower() == "etag" else v) for k, v in headers]
    if status in (200, 206) and any(k.lower() == "etag" for k, _ in headers):
        out.append(("x-amz-server-side-encryption", "aws:kms"))
    if b"<ListBucketResult" in data[:400]:
        data = re.sub(
            rb"<ETag>([^<]*)</ETag>",
            lambda m: b"<ETag>" + kms_etag(m.group(1).decode().replace("&quot;", '"')).encode() + b"</ETag>",
            data,
        )
    return out, data


def multipart_etag(path: str) -> str:
    """The ETag of the object at `path` (`/bucket/key`) as if it was a multipart upload: a digest
    and a part count, derived here from the path (the store behind lists no ETags to derive it
    from), so listings and GETs agree."""
    return '"' + hashlib.md5(b"parts:" + path.encode()).hexdigest() + '-2"'


def multipart_answer(
    path: str, headers: list[tuple[str, str]], data: bytes, picked: Callable[[str], bool]
) -> tuple[list[tuple[str, str]], bytes]:
    """An answer as if the objects `picked` (by path) were multipart uploads; the others' ETags
    pass as the store gave them (none, in its listings)."""
    # Path-style requests (`/bucket/key`, `/bucket?list-type=2`), as the daemon makes them here.
    out = [(k, multipart_etag(path) if k.lower() == "etag" and picked(path) else v) for k, v in headers]
    if b"<ListBucketResult" in data[:400]:
        bucket = path.strip("/").split("/")[0]

        def listed(m: re.Match[bytes]) -> bytes:
            key = f"/{bucket}/{html.unescape(m.group(1).decode())}"
            return m.group(0) + (b"<ETag>" + multipart_etag(key).encode() + b"</ETag>" if picked(key) else b"")

        data = re.sub(rb"<ETag>[^<]*</ETag>", b"", data)
        data = re.sub(rb"<Key>([^<]*)</Key>", listed, data)
    return out, data


class _TlsServer(ThreadingHTTPServer):
    """An HTTPS server on 127.0.0.1: each accepted connection is wrapped in its own thread, so a
    handshake that stalls (or fails: a client that does not trust the certificate) holds up no
    other connection."""

    def __init__(self, tls: tuple[Path, Path], handler: type[BaseHTTPRequestHandler]) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(tls[0]), str(tls[1]))
        super().__init__(("127.0.0.1", 0), handler)

    def finish_request(self, request, client_address) -> None:  # noqa: ANN001 - socketserver's signature
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        try:
            super().finish_request(tls, client_address)
        except (ssl.SSLError, ConnectionError):
            pass  # the client went mid-request (a daemon stopping, a stream cancelled)
        finally:
            # The accepted socket's descriptor is the TLS socket's now: socketserver closes only
            # the emptied one.
            tls.close()


class FaultProxy:
    def __init__(
        self,
        upstream_port: int,
        rate: float = 0.10,
        seed: int = 0,
        kinds: tuple[str, ...] = KINDS,
        hold: float = 0.0,
        kms: bool = False,
        multipart: bool | Callable[[str], bool] = False,
        etag_per_range: bool = False,
        refuse: Callable[[str], bool] | None = None,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        self.refuse = refuse
        self.tls = tls
        self.upstream_port = upstream_port
        self.etag_per_range = etag_per_range
        self.hold = hold
        self.kms = kms
        self.multipart = multipart
        self.gets_in = 0
        self.peak_gets = 0
        self.rate = rate
        self.kinds = kinds
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        # Object GETs by path (bucket/key) and Range header ("" for none), faulted or not.
        self.object_gets: Counter[str] = Counter()
        self.first_try: str | None = None
        self.flip_at: int | None = None
        self.tried: set[str] = set()
        self.server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.server.server_address[1]}"

    def pick(self, object_get: bool, path: str = "") -> str | None:
        """The fault for the next request (of the object at `path` when `object_get`), or None."""
        with self.lock:
            self.counts["requests"] += 1
            if object_get:
                self.object_gets[path] += 1
                if self.first_try and path not in self.tried:
                    self.tried.add(path)
                    return self.first_try
            if self.rng.random() >= self.rate:
                return None
            kinds = [k for k in self.kinds if object_get or k in ("reset", "slowdown")]
            return self.rng.choice(kinds) if kinds else None

    def enter_get(self) -> None:
        with self.lock:
            self.gets_in += 1
            self.peak_gets = max(self.peak_gets, self.gets_in)

    def reset_peak(self) -> None:
        """Counts the peak from now on (from the GETs in flight now)."""
        with self.lock:
            self.peak_gets = self.gets_in

    def leave_get(self) -> None:
        with self.lock:
            self.gets_in -= 1

    def count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    def flip(self, data: bytes) -> bytes:
        with self.lock:
            at = self.rng.randrange(len(data)) if self.flip_at is None else self.flip_at % len(data)
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            upstream: http.client.HTTPConnection | None = None

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
                pass

            def do_GET(self) -> None:  # noqa: N802 - the base class's naming
                self.forward()

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET  # noqa: N815

            def reset(self) -> None:
                # SO_LINGER with a zero timeout: close() sends RST instead of FIN.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True

            def send(self, status: int, reason: str, headers: list[tuple[str, str]], body: bytes, length: int) -> None:
                self.send_response_only(status, reason)
                for k, v in headers:
                    if k.lower() not in HOP and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)
                self.wfile.flush()

            def forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                # Path style: /bucket/key?x-id=GetObject for an object, /bucket?list-type=2 a listing.
                target = urlsplit(self.path)
                object_get = self.command == "GET" and "list-type" not in target.query and "/" in target.path.strip("/")
                counted = f"{target.path} {self.headers.get('Range', '')}".rstrip()
                fault = proxy.pick(object_get, counted)
                if object_get and proxy.refuse and proxy.refuse(counted):
                    return self.send(403, "Forbidden", [("Content-Type", "application/xml")], DENIED, len(DENIED))
                if fault == "reset":
                    proxy.count(fault)
                    return self.reset()
                if fault == "slowdown":
                    proxy.count(fault)
                    if object_get and proxy.hold:
                        # An object GET takes its round trip to be refused too.
                        time.sleep(proxy.hold)
                    return self.send(503, "Slow Down", [("Content-Type", "application/xml")], SLOWDOWN, len(SLOWDOWN))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                if object_get:
                    proxy.enter_get()
                try:
                    if object_get and proxy.hold:
                        time.sleep(proxy.hold)
                    status, reason, resp_headers, data = self.ask_upstream(body, headers)
                except OSError:
                    return self.reset()
                finally:
                    if object_get:
                        proxy.leave_get()
                if fault == "truncate" and status in (200, 206) and len(data) > 1:
                    proxy.count(fault)
                    self.send(status, reason, resp_headers, data[: len(data) // 2], len(data))
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return None
                if fault == "corrupt" and status in (200, 206) and data:
                    proxy.count(fault)
                    data = proxy.flip(data)
                if proxy.kms:
                    resp_headers, data = kms_answer(status, resp_headers, data)
                elif proxy.multipart:
                    picked = proxy.multipart if callable(proxy.multipart) else lambda _: True
                    resp_headers, data = multipart_answer(unquote(target.path), resp_headers, data, picked)
                if proxy.etag_per_range and object_get:
                    rewritten = hashlib.md5(f"{target.path} {self.headers.get('Range', '')}".encode()).hexdigest()
                    resp_headers = [(k, f'"{rewritten}"' if k.lower() == "etag" else v) for k, v in resp_headers]
                length = int(dict((k.lower(), v) for k, v in resp_headers).get("content-length", len(data)))
                return self.send(status, reason, resp_headers, data, len(data) if self.command != "HEAD" else length)

            def ask_upstream(self, body: bytes | None, headers: dict[str, str]):
                for attempt in range(2):
                    if self.upstream is None:
                        self.upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                    try:
                        self.upstream.request(self.command, self.path, body=body, headers=headers)
                        resp = self.upstream.getresponse()
                        data = resp.read()
                        return resp.status, resp.reason, resp.getheaders(), data
                    except (OSError, http.client.HTTPException):
                        # A kept-alive upstream connection the server closed: once more on a new one.
                        self.upstream.close()
                        self.upstream = None
                        if attempt:
                            raise
                raise OSError("unreachable")

        self.server = _TlsServer(self.tls, Handler) if self.tls else ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def faults(self) -> dict[str, int]:
        with self.lock:
            return {k: self.counts[k] for k in KINDS}
