"""What libfabric costs a process before its first rdma stream: loading the library, then the
first `fi_getinfo` (the providers' initialisation), each in a fresh process, under settings that
might have avoided part of it. Not part of `make bench`; the figures behind "libfabric's start-up"
in bench/INLINE.md.

    python bench/fabric_startup.py --rounds 3

Needs `libfabric.so.1` (scripts/libfabric.sh). Wall and CPU seconds per step, median of the
rounds; `kallsyms reads` counts the `/proc/kallsyms` opens of the step that does them (strace,
when installed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

CHILD = r"""
import ctypes, json, os, time
t0, c0 = time.perf_counter(), time.process_time()
lib = ctypes.CDLL("libfabric.so.1", mode=os.RTLD_NOW)
t1, c1 = time.perf_counter(), time.process_time()
info = ctypes.c_void_p()
rc = lib.fi_getinfo(ctypes.c_uint32((1 << 16) | 17), None, None, ctypes.c_uint64(0), None, ctypes.byref(info))
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"load_s": t1 - t0, "load_cpu": c1 - c0, "getinfo_s": t2 - t1, "getinfo_cpu": c2 - c1, "rc": rc}))
"""

SETTINGS = {
    "default": {},
    "FI_PROVIDER=tcp": {"FI_PROVIDER": "tcp"},
    "FI_PROVIDER=^verbs,psm,psm2": {"FI_PROVIDER": "^verbs,psm,psm2"},
    "FI_MR_CACHE_MONITOR=disabled": {"FI_MR_CACHE_MONITOR": "disabled"},
    "FI_HMEM_DISABLE_P2P=1": {"FI_HMEM_DISABLE_P2P": "1"},
}


def kallsyms_opens(env: dict[str, str]) -> int | None:
    strace = shutil.which("strace")
    if strace is None:
        return None
    out = subprocess.run(
        [strace, "-f", "-e", "trace=openat", sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    return out.stderr.count("/proc/kallsyms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, env in SETTINGS.items():
            out = subprocess.run(
                [sys.executable, "-c", CHILD], capture_output=True, text=True, env={**os.environ, **env}, check=True
            )
            r = json.loads(out.stdout)
            if r["rc"] != 0:
                raise SystemExit(f"{name}: fi_getinfo returned {r['rc']}")
            runs[name].append(r)
    print(f"{args.rounds} rounds, median; each in a fresh process\n")
    print("| setting | load: wall s | load: CPU s | first fi_getinfo: wall s | CPU s | kallsyms opens |")
    print("|---|---|---|---|---|---|")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("load_s", "load_cpu", "getinfo_s", "getinfo_cpu")}
        opens = kallsyms_opens(SETTINGS[name])
        print(
            f"| {name} | {med['load_s']:.3f} | {med['load_cpu']:.3f} | {med['getinfo_s']:.3f}"
            f" | {med['getinfo_cpu']:.3f} | {'-' if opens is None else opens} |"
        )


if __name__ == "__main__":
    main()
