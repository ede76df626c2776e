"""The bench's repeated-rounds table (bench/report.py, bench/run.py): medians, spreads, and ratios
to the best peer taken within each round before the median."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import parquet_bench  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402
import shm_bench  # noqa: E402


def row(reader: str, sps: float, workers: int = 0, **kw: object) -> report.Row:
    return report.Row(reader, workers, samples=int(sps), bytes=int(sps) * 1000, seconds=1.0, ttfb=0.1, **kw)


def cells(text: str, reader: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {reader} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_ratio_is_taken_within_each_round_then_medianed() -> None:
    # Round 2 ran under load: everything halved. Per-round ratios stay 2.0; a ratio of medians
    # would too here, but round 3's peer alone is slow, which only the per-round ratio shows.
    rounds = [
        [row("litdata", 100), row("shardstream", 200)],
        [row("litdata", 50), row("shardstream", 100)],
        [row("litdata", 20), row("shardstream", 200)],
    ]
    text = report.rounds_table(rounds, cat_gbps=1.0)
    ss = cells(text, "shardstream")
    assert ss[2] == "200 (100-200)"
    assert ss[7] == "2.00 (2.00-10.00)"
    assert cells(text, "litdata")[7] == "1.00 (1.00-1.00)"


def test_a_failed_round_is_named_and_the_others_still_count() -> None:
    rounds = [
        [row("webdataset", 100), row("shardstream", 150)],
        [row("webdataset", 100), report.Row("shardstream", 0, error="timed out")],
    ]
    ss = cells(report.rounds_table(rounds, cat_gbps=1.0), "shardstream")
    assert ss[2] == "150"
    assert ss[-1].startswith("**failed**") and "round 2: timed out" in ss[-1]


def test_report_without_rounds_renders_the_single_run_table() -> None:
    doc = report.Report("t", [], [row("webdataset", 100)], 1.0)
    assert "samples/s vs best peer |" in doc.render()


def test_round_order_rotates_by_one_reader() -> None:
    runs = [(r, w) for r in ("a", "b", "c") for w in (0, 2)]
    assert run.round_order(runs, 2, 0) == runs
    assert run.round_order(runs, 2, 1)[0] == ("b", 0)
    assert run.round_order(runs, 2, 3) == runs
    assert sorted(run.round_order(runs, 2, 2)) == sorted(runs)


@contextlib.contextmanager
def child_burning(code: str) -> Iterator[int]:
    """The pid of a Python child running `code`, once it has printed `done`; on leaving, the child
    is told to go on (a line for each of up to two waits on its stdin) and reaped."""
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "done"
        yield child.pid
    finally:
        if child.stdin is not None:
            child.stdin.write("\n\n")
            child.stdin.close()
        child.wait()


def test_a_process_cpu_is_read_to_below_a_clock_tick_and_counts_threads_that_ended() -> None:
    import time

    import measure

    # A child burns CPU in a thread that then ends, and waits to be read.
    code = (
        "import threading, time, sys\n"
        "def burn():\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < 0.123: pass\n"
        "th = threading.Thread(target=burn); th.start(); th.join()\n"
        "print('done', flush=True); sys.stdin.readline()\n"
    )
    with child_burning(code) as pid:
        cpu = measure.cpu_seconds(pid)
        assert cpu is not None and cpu >= 0.123
        # Clock ticks (10 ms) would give a multiple of 0.01; the CPU clock gives nanoseconds.
        assert round(cpu * 100) != cpu * 100
        time.sleep(0.05)
        assert measure.cpu_seconds(pid) == pytest.approx(cpu, abs=0.005)
    assert measure.cpu_seconds(pid) is None, "a reaped process has no CPU time"


def test_a_named_thread_s_cpu_is_read_apart_from_its_process() -> None:
    import measure

    # A child's thread named `burner` burns CPU and stays alive; its main thread burns more.
    code = (
        "import threading, time, sys\n"
        "def spin(s):\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < s: pass\n"
        "def burner():\n"
        "    open(f'/proc/self/task/{threading.get_native_id()}/comm', 'w').write('burner')\n"
        "    spin(0.123); print('done', flush=True); sys.stdin.readline()\n"
        "threading.Thread(target=burner, daemon=True).start()\n"
        "spin(0.2); sys.stdin.readline()\n"
    )
    with child_burning(code) as pid:
        burner = measure.thread_cpu_seconds(pid, "burner")
        assert 0.123 <= burner < 0.2, burner
        assert measure.thread_cpu_seconds(pid, "no-such-thread") == 0.0
    assert measure.thread_cpu_seconds(pid, "burner") == 0.0, "a reaped process has no threads"


def test_cpu_is_compared_with_the_same_rounds_fastest_peer() -> None:
    # The fastest peer of each round is the reference, not the cheapest one.
    rounds = [
        [row("litdata", 100, cpu_s=0.4), row("webdataset", 50, cpu_s=0.2), row("shardstream", 300, cpu_s=0.1)],
        [row("litdata", 100, cpu_s=0.5), row("webdataset", 50, cpu_s=0.2), row("shardstream", 300, cpu_s=0.1)],
    ]
    ss = cells(report.rounds_table(rounds, cat_gbps=1.0), "shardstream")
    assert ss[6] == "0.100 (0.100-0.100)"
    assert ss[8] == "0.23 (0.20-0.25)"
    assert cells(report.rounds_table(rounds, cat_gbps=1.0), "litdata")[8] == "1.00 (1.00-1.00)"


def test_shm_results_keep_the_runs_they_held(tmp_path: Path) -> None:
    out = tmp_path / "SHM_RESULTS.md"
    assert shm_bench.earlier_runs(out) == ""
    out.write_text("# Shared memory\n\nMeasured 2026-01-01 10:00 UTC with x.\n\n| a |\n\nA note by hand.\n")
    out.write_text("# Shared memory\n\nMeasured 2026-01-02 11:00 UTC with x.\n\n| b |\n" + shm_bench.earlier_runs(out))
    out.write_text("# Shared memory\n\nMeasured 2026-01-03 12:00 UTC with x.\n\n| c |\n" + shm_bench.earlier_runs(out))
    text = out.read_text()
    assert text.count("# Shared memory") == 1
    assert text.count("## Earlier runs") == 1
    # Newest first, each under its own date, the hand-written note with its run.
    second, first = text.index("### Run of 2026-01-02 11:00 UTC"), text.index("### Run of 2026-01-01 10:00 UTC")
    assert text.index("| c |") < text.index("## Earlier runs") < second < text.index("| b |") < first
    assert first < text.index("| a |") < text.index("A note by hand.")


def test_parquet_ratios_are_taken_within_each_repeat() -> None:
    # Repeat 2 ran under load (both slow, the peer more) and repeat 3's reader alone was slow: the
    # ratio of the medians (200 / 100) says 2.00; repeat by repeat the reader was 3, 4 and 1.5x.
    def run_(rps: float) -> dict:
        return {"rows": 10, "rows_per_s": rps, "seconds": 1.0, "cpu_s": 0.1, "ttfb_s": 0.0, "check": "ok"}

    results = {
        "tab": {
            "pa_seq": [run_(400), run_(400), run_(400)],
            "pa_shuffle": [run_(100), run_(50), run_(100)],
            "ss_arrow": [run_(300), run_(200), run_(150)],
            "ss_dict": [{"error": "boom"}, run_(100), run_(200)],
        }
    }
    meta = {"repeats": {"tab": 3}, "machine": "m", "daemon_rss_mib": 0.0, "rows": {"tab": 10}, "layout": "snappy"}
    text = parquet_bench.report(results, meta)
    assert "3 interleaved repeats" in text
    ss = cells(text, "ss_arrow")
    assert ss[2] == "3.00 (1.50-4.00)", ss
    assert ss[3] == "0.50 (0.38-0.75)", ss
    # A failed repeat has no ratio; the others still count.
    assert cells(text, "ss_dict")[2] == "2.00 (2.00-2.00)"
    assert cells(text, "pa_shuffle")[2] == "1.00 (1.00-1.00)"
    meta["repeats"] = {"image": 3, "tab": 9}
    assert "interleaved repeats (image 3, tab 9)" in parquet_bench.report(results, meta)
