"""What the harness measures from outside a reader: memory and CPU of process trees (from /proc),
the machine's own limits (page-cache read, memcpy), and the machine itself.

Memory is PSS (proportional set size: shared pages split among the processes sharing them), so a
DataLoader worker's copy-on-write pages and a shared-memory ring are not counted twice. CPU is
user + system time from each process's CPU clock (see `cpu_seconds`). A thread of the harness
samples both (PSS less often when it is expensive, see PSS_MAX_DUTY); a process is followed from
the first time it is seen in the tree until it exits, also if it was re-parented on the way (a
worker orphaned by its parent's exit).
"""

from __future__ import annotations

import os
import platform
import subprocess
import threading
import time
from pathlib import Path

import numpy as np

# Process trees and CPU times are sampled this often (reading /proc/<pid>/stat costs ~20 us).
SAMPLE_INTERVAL_S = 0.05
# PSS too, unless reading it costs more than this share of one core: the kernel walks the page
# tables for smaps_rollup, ~10 ms for a process with torch imported, so sampling a reader, two
# workers and a daemon every 50 ms would take most of a core from the benchmark on a small machine.
PSS_MAX_DUTY = 0.05
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
MEMCPY_BYTES = 1 << 30
REPEATS = 3


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (field 3 onwards), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot: with the pid, it identifies a process (pids are reused)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def cpu_seconds(pid: int) -> float | None:
    """user + system CPU seconds of one process (its threads included, those that ended too; its
    children not), None if gone. Read from the process's CPU clock (what `clock_getcpuclockid`
    returns), to the nanosecond: /proc/<pid>/stat has the same sum in clock ticks, 10 ms, as much
    as a warm daemon spends in a whole epoch of the small-sample bench."""
    try:
        return time.clock_gettime(((~pid) << 3) | _CPUCLOCK_SCHED)
    except OSError:
        fields = _stat_fields(pid)
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS if fields else None


# The kernel's encoding of another process's CPU clock id (`MAKE_PROCESS_CPUCLOCK(pid,
# CPUCLOCK_SCHED)`, what glibc's `clock_getcpuclockid` returns; Python does not wrap it).
_CPUCLOCK_SCHED = 2


def thread_cpu_seconds(pid: int, name: str) -> float:
    """CPU seconds of process `pid`'s live threads named `name` (their `comm`), to the
    nanosecond (`/proc/<pid>/task/<tid>/schedstat`: another process's thread clocks are not
    readable); 0 when none is alive. What one thread of a daemon costs, where a profiler's samples
    only say its share."""
    total = 0.0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != name:
                    continue
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """Direct children of pid, whichever of its threads forked them."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    """pid and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


class TreeSampler:
    """Follows process trees (roots plus everything below them) until stopped: peak summed PSS and
    the last CPU time seen of every process that was ever part of them."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.peak_pss_kib = 0
        self.pss_samples = 0
        self.cpu: dict[tuple[int, int], float] = {}  # (pid, start time) -> CPU seconds
        self._pss_interval = SAMPLE_INTERVAL_S
        self._next_pss = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="tree-sampler")

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def sample(self, pss: bool = True) -> None:
        """Reads CPU times of the trees, and PSS if pss (then at most at PSS_MAX_DUTY)."""
        pids = {p for root in self.roots for p in descendants(root)}
        pids |= {pid for pid, _start in self.cpu}  # re-parented processes keep being followed
        live = []
        for pid in pids:
            start, cpu = start_time(pid), cpu_seconds(pid)
            if start is not None and cpu is not None:
                self.cpu[(pid, start)] = cpu
                live.append(pid)
        now = time.monotonic()
        if pss and now >= self._next_pss:
            self.peak_pss_kib = max(self.peak_pss_kib, sum(pss_kib(pid) for pid in live))
            self.pss_samples += 1
            cost = time.monotonic() - now
            self._pss_interval = max(SAMPLE_INTERVAL_S, cost / PSS_MAX_DUTY)
            self._next_pss = now + self._pss_interval

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_of(self, pids: set[int]) -> float:
        """Last CPU seconds seen of the followed processes with these pids."""
        return sum(s for (pid, _start), s in self.cpu.items() if pid in pids)

    def cpu_except(self, pids: set[int]) -> float:
        return sum(s for (pid, _start), s in self.cpu.items() if pid not in pids)

    def alive(self) -> list[int]:
        """Followed processes still running (the same process, not a reused pid)."""
        return [pid for pid, start in self.cpu if start_time(pid) == start]


def cat_gbps(files: list[Path]) -> float:
    """Sequential read of files with `cat` to /dev/null, GB/s, best of REPEATS (hot page cache)."""
    total = sum(p.stat().st_size for p in files)
    best = 0.0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        subprocess.run(["cat", *map(str, files)], stdout=subprocess.DEVNULL, check=True)
        best = max(best, total / (time.perf_counter() - t0) / 1e9)
    return best


def memcpy_gbps() -> float:
    """Copy of a 1 GiB array into a preallocated one (np.copyto), GB copied per second, best of
    REPEATS (each byte is read once and written once)."""
    src = np.ones(MEMCPY_BYTES, np.uint8)
    dst = np.zeros_like(src)  # zeros_like faults its pages in lazily: the first repeat pays for that
    best = 0.0
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = max(best, src.nbytes / (time.perf_counter() - t0) / 1e9)
    return best


# Files `warm` has already dropped from the page cache once in this process.
_settled: set[Path] = set()


def warm(files: list[Path]) -> int:
    """Reads every file once (like `cat`) so the page cache holds it; returns the bytes read.

    The first time a file is warmed in a process it is first dropped from the page cache
    (`fsync`, `POSIX_FADV_DONTNEED`), so that what the readers find is what a read from storage
    leaves there, whatever wrote the file and when. The page cache keeps a file the way it was
    written: a dataset just generated by Python's small writes sits in 4 KiB pages, the same file
    read back from disk in large folios, and mapping it (or faulting it in) cost twice the CPU
    per epoch in the former state (bench/PROFILES.md, section 4). A training node meets the
    latter; the former depended on whether the bench had just generated its data."""
    buf = bytearray(1 << 20)
    total = 0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            if p not in _settled:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                _settled.add(p)
            while n := f.readinto(buf):
                total += n
    return total


def _first_line_with(path: str, prefix: str) -> str:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def meminfo_gb(field: str) -> float:
    """A /proc/meminfo field (`MemTotal`, `Cached`, ...) in GB (10^9 B); NaN where there is none."""
    kib = _first_line_with("/proc/meminfo", field + ":").split()
    return int(kib[0]) * 1024 / 1e9 if kib else float("nan")


def machine() -> dict[str, str]:
    mem_kib = _first_line_with("/proc/meminfo", "MemTotal").split()
    load = os.getloadavg()
    return {
        "nproc": str(len(os.sched_getaffinity(0))),
        "cpu": _first_line_with("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "ram": f"{int(mem_kib[0]) / 2**20:.0f} GiB" if mem_kib else "?",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
    }
