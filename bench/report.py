"""The Markdown report: a header saying where and how it was measured, the results table, and any
extra sections (from `--extra-json` files or other scripts calling `append_sections`).

An extra section is a JSON object `{"title": str, "markdown": str}` (text used as is) or
`{"title": str, "data": {...}}` (rendered as a two-column table), or a list of such objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Rows that are not peers: shardstream (what the peers are compared with) and `floor` (the
# consumer alone, the most any reader can reach).
PEER_EXCLUDED = ("shardstream", "floor")


@dataclass
class Row:
    reader: str
    workers: int
    samples: int = 0
    bytes: int = 0
    seconds: float = 0.0
    ttfb: float | None = None
    peak_pss_mib: float = 0.0
    pss_samples: int = 0
    cpu_s: float = 0.0
    # The daemon's CPU during the measured epoch, when the reader counted it itself (untimed
    # epochs before it); None: the harness counts it around the whole reader process.
    daemon_cpu: float | None = None
    error: str = ""  # the run failed: no figures
    mismatch: str = ""  # the run finished but did not deliver the dataset exactly once

    @property
    def ok(self) -> bool:
        return not self.error and not self.mismatch

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds else 0.0


@dataclass
class Report:
    title: str
    header: list[str]  # Markdown lines under the title
    rows: list[Row]
    cat_gbps: float
    footer: list[str] = field(default_factory=list)
    sections: list[tuple[str, str]] = field(default_factory=list)  # (title, Markdown body)
    # Repeated runs: when given, the table shows medians over these rounds (`rounds_table`) and
    # `rows` is not rendered.
    rounds: list[list[Row]] = field(default_factory=list)

    def best_peer(self) -> float:
        peers = [r.samples_per_s for r in self.rows if not r.reader.startswith(PEER_EXCLUDED) and r.ok]
        return max(peers, default=0.0)

    def render(self) -> str:
        body = (
            rounds_table(self.rounds, self.cat_gbps)
            if self.rounds
            else table(self.rows, self.best_peer(), self.cat_gbps)
        )
        lines = [f"# {self.title}", "", *self.header, "", body]
        if self.footer:
            lines += ["", *self.footer]
        for title, body in self.sections:
            lines += ["", f"## {title}", "", body.rstrip()]
        return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _ratio(x: float, of: float, digits: int = 2) -> str:
    return f"{x / of:.{digits}f}" if of > 0 else "-"


COLUMNS = [
    "reader",
    "workers",
    "samples/s",
    "MB/s",
    "first batch (s)",
    "peak PSS (MiB)",
    "CPU-s/epoch",
    "samples/s vs best peer",
    "MB/s vs cat",
    "check",
]


def table(rows: list[Row], best_peer: float, cat_gbps: float) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        if r.error:
            cells = [
                r.reader,
                str(r.workers),
                "-",
                "-",
                "-",
                f"{r.peak_pss_mib:,.0f}" if r.peak_pss_mib else "-",
                "-",
                "-",
                "-",
                f"**failed**: {_cell(r.error)}",
            ]
        else:
            ttfb = f"{r.ttfb:.2f}" if r.ttfb is not None else "-"
            check = f"**MISMATCH**: {_cell(r.mismatch)}" if r.mismatch else "ok"
            cells = [
                r.reader,
                str(r.workers),
                f"{r.samples_per_s:,.0f}",
                f"{r.mb_per_s:,.0f}",
                ttfb,
                f"{r.peak_pss_mib:,.0f}",
                f"{r.cpu_s:.2f}",
                _ratio(r.samples_per_s, best_peer),
                _ratio(r.mb_per_s, cat_gbps * 1e3, 3),
                check,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _data_table(data: dict[str, Any]) -> str:
    lines = ["| | |", "|---|---|"]
    for k, v in data.items():
        shown = f"{v:,.3f}".rstrip("0").rstrip(".") if isinstance(v, float) else json.dumps(v).strip('"')
        lines.append(f"| {_cell(str(k))} | {_cell(shown)} |")
    return "\n".join(lines)


def section(obj: dict[str, Any]) -> tuple[str, str]:
    """(title, Markdown body) of one extra-section object."""
    title = str(obj.get("title", "Extra"))
    if "markdown" in obj:
        return title, str(obj["markdown"])
    if isinstance(obj.get("data"), dict):
        return title, _data_table(obj["data"])
    return title, "```json\n" + json.dumps(obj, indent=1) + "\n```"


def sections_from_json(path: Path) -> list[tuple[str, str]]:
    obj = json.loads(path.read_text())
    return [section(o) for o in (obj if isinstance(obj, list) else [obj])]


def append_sections(path: Path, sections: list[tuple[str, str]]) -> None:
    """Appends sections to an existing report (for scripts that measure something after run.py)."""
    text = path.read_text().rstrip("\n") + "\n"
    for title, body in sections:
        text += f"\n## {title}\n\n{body.rstrip()}\n"
    path.write_text(text)


# Repeated runs (`run.py --rounds`): one row per reader and worker count, each figure the median
# over the rounds with its spread (min-max), and the ratio to the best peer computed within each
# round (readers of one round ran minutes apart, under the same load) and then median'ed.


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return (s[n // 2] + s[(n - 1) // 2]) / 2 if n else 0.0


def spread(xs: list[float], fmt: str) -> str:
    """`median (min-max)` of xs, or just the value when there is one."""
    if not xs:
        return "-"
    med = format(median(xs), fmt)
    return med if len(xs) == 1 else f"{med} ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def best_peer_row(rows: list[Row]) -> Row | None:
    """The fastest successful non-shardstream row among rows, if any."""
    peers = [r for r in rows if not r.reader.startswith(PEER_EXCLUDED) and r.ok]
    return max(peers, key=lambda r: r.samples_per_s, default=None)


def best_peer_of(rows: list[Row]) -> float:
    """Samples/s of the fastest successful non-shardstream row among rows (0 if none)."""
    best = best_peer_row(rows)
    return best.samples_per_s if best else 0.0


ROUND_COLUMNS = [
    "reader",
    "workers",
    "samples/s median (min-max)",
    "MB/s median",
    "first batch (s) median",
    "peak PSS (MiB) max",
    "CPU-s/epoch median (min-max)",
    "samples/s vs best peer, per round, median (min-max)",
    "CPU-s vs best peer's, per round, median (min-max)",
    "MB/s vs cat",
    "check",
]


def rounds_table(rounds: list[list[Row]], cat_gbps: float) -> str:
    """The median-and-spread table of repeated runs: rounds[i] holds round i's rows (any order)."""
    groups: dict[tuple[str, int], list[tuple[Row, float]]] = {}
    # Each round's best peer's CPU-s, by the same rows' position in `groups`' lists.
    peer_cpu: dict[tuple[str, int], list[float]] = {}
    for rows in rounds:
        best = best_peer_of(rows)
        best_row = best_peer_row(rows)
        for r in rows:
            groups.setdefault((r.reader, r.workers), []).append((r, best))
            peer_cpu.setdefault((r.reader, r.workers), []).append(best_row.cpu_s if best_row else 0.0)
    lines = ["| " + " | ".join(ROUND_COLUMNS) + " |", "|" + "|".join("---" for _ in ROUND_COLUMNS) + "|"]
    for (reader, workers), runs in groups.items():
        done = [r for r, _ in runs if not r.error]
        failed = [r for r, _ in runs if r.error]
        ratios = [r.samples_per_s / best for r, best in runs if r.ok and best > 0]
        cpu_ratios = [
            r.cpu_s / c for (r, _), c in zip(runs, peer_cpu[(reader, workers)], strict=True) if r.ok and c > 0
        ]
        problems = [f"round {i + 1}: {_cell(r.error or r.mismatch)}" for i, (r, _) in enumerate(runs) if not r.ok]
        check = "ok" if not problems else ("**failed**: " if failed else "**MISMATCH**: ") + "; ".join(problems)
        if not done:
            cells = [reader, str(workers), "-", "-", "-", "-", "-", "-", "-", "-", check]
        else:
            ttfbs = [r.ttfb for r in done if r.ttfb is not None]
            cells = [
                reader,
                str(workers),
                spread([r.samples_per_s for r in done], ",.0f"),
                f"{median([r.mb_per_s for r in done]):,.0f}",
                f"{median(ttfbs):.2f}" if ttfbs else "-",
                f"{max(r.peak_pss_mib for r in done):,.0f}",
                spread([r.cpu_s for r in done], ".3f"),
                spread(ratios, ".2f") if ratios else "-",
                spread(cpu_ratios, ".2f") if cpu_ratios else "-",
                _ratio(median([r.mb_per_s for r in done]), cat_gbps * 1e3, 3),
                check,
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
