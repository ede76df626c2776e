# daemon with BOTH --tokens and --tls-client-ca (17012): which credentials are needed, and who is "the client" for --max-streams-per-client 1?
import subprocess, os, sys
C = "/tmp/trial-tcp/certs/"
CODE = r'''
import shardstream, sys
try:
    L = [shardstream.Loader("/tmp/trial-tcp/wdsbig2/", batch_size=2, connect="tls://127.0.0.1:17012") for _ in range(int(sys.argv[1]))]
    its = [iter(l) for l in L]
    for i, it in enumerate(its): next(it); print(f"stream{i} OK", end="; ")
except BaseException as e: print(type(e).__name__, str(e)[:260])
'''
base = dict(os.environ, PYTHONPATH="/tmp/trial/pkg", SHARDSTREAM_TLS_CA=C+"ca.pem")
cert = dict(SHARDSTREAM_TLS_CLIENT_CERT=C+"client.pem", SHARDSTREAM_TLS_CLIENT_KEY=C+"client.key")
for label, extra, n in [("token only", dict(SHARDSTREAM_TOKEN_FILE="/tmp/trial-tcp/alice.token"), 1),
                        ("cert only", cert, 1),
                        ("token+cert", dict(cert, SHARDSTREAM_TOKEN_FILE="/tmp/trial-tcp/alice.token"), 1),
                        ("cert + wrong token", dict(cert, SHARDSTREAM_TOKEN_FILE="/tmp/trial-tcp/wrong.token"), 1),
                        ("token+cert, 2 streams (limit 1)", dict(cert, SHARDSTREAM_TOKEN_FILE="/tmp/trial-tcp/alice.token"), 2)]:
    out = subprocess.run([sys.executable, "-c", CODE, str(n)], env=dict(base, **extra), capture_output=True, text=True, timeout=60)
    print(label, "->", out.stdout.strip(), out.stderr.strip()[-200:])
