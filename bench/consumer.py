"""The one consumer every bench row feeds, whatever the reader: per sample, touch the payload
(`np.frombuffer(v, np.uint8)[::4096].sum()`, one byte per page, as a decoder would start), take its
length, and read the sample index the generator wrote into it, so a run can tell "every sample
exactly once" from "the right count"."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import gen
import numpy as np


def consume(batches: Iterable[Iterable[Any]], t0: float | None = None, id_offset: int = gen.ID_OFFSET) -> dict:
    """Feeds every payload of `batches` (an iterable of batches of bytes-like payloads) through the
    consumer. `t0`: when the clock started (default: now), so constructing the reader can count.
    Returns samples, bytes, touched, ids, ttfb and seconds (both from `t0`)."""
    t0 = time.perf_counter() if t0 is None else t0
    ttfb = None
    n = nbytes = touched = 0
    ids: list[int] = []
    for payloads in batches:
        if ttfb is None:
            ttfb = time.perf_counter() - t0
        for v in payloads:
            a = np.frombuffer(v, np.uint8)
            touched += int(a[::4096].sum())
            nbytes += len(a)
            ids.append(int.from_bytes(a[id_offset : id_offset + gen.ID_BYTES], "little"))
            n += 1
    seconds = time.perf_counter() - t0
    return {"samples": n, "bytes": nbytes, "touched": touched, "ids": ids, "ttfb": ttfb, "seconds": seconds}


def check_ids(ids: list[int], expected: int) -> dict[str, int]:
    """How far `ids` is from 0..expected-1 each exactly once."""
    arr = np.asarray(ids, dtype=np.int64)
    bad = int(((arr < 0) | (arr >= expected)).sum())
    counts = np.bincount(arr[(arr >= 0) & (arr < expected)], minlength=expected)
    return {"missing": int((counts == 0).sum()), "duplicated": int((counts > 1).sum()), "out_of_range": bad}


def verdict(ids: list[int], expected: int) -> str:
    """`ok`, or what is wrong, for a report's check column."""
    c = check_ids(ids, expected)
    if not any(c.values()):
        return "ok"
    return (
        f"MISMATCH ({len(ids)} samples, {c['missing']} missing, {c['duplicated']} repeated,"
        f" {c['out_of_range']} out of range)"
    )
