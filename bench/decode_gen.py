"""Data of the decode bench: real JPEGs, generated once and cached, in every reader's own format.

Image i is drawn from `numpy.random.default_rng([seed, i])` alone (any image can be regenerated on
its own): a smooth colour field (a few random pixels upscaled bicubically), 5-25 filled ellipses and
rectangles, and a little per-pixel noise, 256-512 px a side, encoded by Pillow at quality 90:
~14-60 KiB, median ~30 KiB, a photo's size at that resolution and quality (pure noise would be
several times larger and decode slower than any real image). Its key is `f"{i:08d}"` (the reader
turns it back into the index, to check every image arrives exactly once) and its label `i % 100`.

Layouts, under `<root>/<spec key>/`::

    raw/<label:03d>/<key>.jpg       files, read by a torch map-style Dataset (ImageFolder's layout)
    wds/shard-000000.tar ...        webdataset.ShardWriter, `PER_SHARD` images each (webdataset, shardstream)
    mds/                            streaming.MDSWriter, columns key/jpg/cls (MosaicML)
    litdata/                        litdata.optimize, fields key/jpg/cls (LitData)

The raw files are written first; the other formats copy their bytes. Each format is written under
`<fmt>.tmp` and renamed when complete, with a `.complete` marker naming the library version that
wrote it (as bench/gen.py does).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import io
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gen
import numpy as np

SPEC_VERSION = 1
FORMATS = ("raw", "wds", "mds", "litdata")
WRITER_PACKAGE = {"raw": "pillow", "wds": "webdataset", "mds": "mosaicml-streaming", "litdata": "litdata"}


@dataclass(frozen=True)
class Spec:
    samples: int
    seed: int = 0
    min_px: int = 256
    max_px: int = 512  # inclusive
    quality: int = 90
    classes: int = 100
    per_shard: int = 500  # WebDataset shards of ~15 MB: enough shards for 4 workers at small sizes
    shard_bytes: int = 64 << 20  # MDS shards and LitData chunks (both libraries' default)
    version: int = SPEC_VERSION

    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()
        return f"jpeg-n{self.samples}-{digest[:10]}"


def jpeg(spec: Spec, i: int) -> bytes:
    """The JPEG of image i."""
    from PIL import Image, ImageChops, ImageDraw

    rng = np.random.default_rng([spec.seed, i])
    w, h = (int(x) for x in rng.integers(spec.min_px, spec.max_px + 1, 2))
    grid = int(rng.integers(4, 16))
    field = rng.integers(0, 256, (grid, grid, 3), dtype=np.uint8)
    img = Image.fromarray(field, "RGB").resize((w, h), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(5, 25))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = (x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2)))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    amp = int(rng.integers(3, 9))
    noise = Image.fromarray(rng.integers(128 - amp, 129 + amp, (h, w, 3), dtype=np.uint8), "RGB")
    img = ImageChops.add(img, noise, 1.0, -128)  # img + noise - 128, clipped
    out = io.BytesIO()
    img.save(out, "JPEG", quality=spec.quality)
    return out.getvalue()


def key_of(i: int) -> str:
    return f"{i:08d}"


def label_of(spec: Spec, i: int) -> int:
    return i % spec.classes


def raw_path(spec: Spec, root: Path, i: int) -> Path:
    return root / f"{label_of(spec, i):03d}" / f"{key_of(i)}.jpg"


def _raw_images(spec: Spec, raw: Path) -> Iterator[tuple[str, bytes, int]]:
    for i in range(spec.samples):
        yield key_of(i), raw_path(spec, raw, i).read_bytes(), label_of(spec, i)


def write_raw(spec: Spec, d: Path, _raw: Path) -> None:
    for label in range(spec.classes):
        (d / f"{label:03d}").mkdir()
    t0 = time.perf_counter()
    for i in range(spec.samples):
        raw_path(spec, d, i).write_bytes(jpeg(spec, i))
        if i and i % 2000 == 0:
            rate = i / (time.perf_counter() - t0)
            print(f"    {i:,} of {spec.samples:,} images ({rate:.0f}/s)", flush=True)


def write_wds(spec: Spec, d: Path, raw: Path) -> None:
    import webdataset as wds

    with wds.ShardWriter(str(d / "shard-%06d.tar"), maxcount=spec.per_shard, verbose=0) as sink:
        for key, data, label in _raw_images(spec, raw):
            sink.write({"__key__": key, "jpg": data, "cls": str(label).encode()})


def write_mds(spec: Spec, d: Path, raw: Path) -> None:
    from streaming import MDSWriter

    columns = {"key": "str", "jpg": "bytes", "cls": "int"}
    with MDSWriter(out=str(d), columns=columns, size_limit=spec.shard_bytes) as out:
        for key, data, label in _raw_images(spec, raw):
            out.write({"key": key, "jpg": data, "cls": label})


def litdata_item(item: tuple[Spec, str, int]) -> dict[str, object]:
    """One LitData sample; `litdata.optimize` calls this in its own (spawned) worker processes."""
    spec, raw, i = item
    return {"key": key_of(i), "jpg": raw_path(spec, Path(raw), i).read_bytes(), "cls": label_of(spec, i)}


def write_litdata(spec: Spec, d: Path, raw: Path) -> None:
    import litdata

    litdata.optimize(
        fn=litdata_item,
        inputs=[(spec, str(raw), i) for i in range(spec.samples)],
        output_dir=str(d),
        chunk_bytes=spec.shard_bytes,
        num_workers=1,  # the chunk layout depends on the worker count: keep it fixed
        verbose=False,
    )


WRITERS: dict[str, Callable[[Spec, Path, Path], None]] = {
    "raw": write_raw,
    "wds": write_wds,
    "mds": write_mds,
    "litdata": write_litdata,
}


def _marker(fmt: str) -> dict[str, str]:
    package = WRITER_PACKAGE[fmt]
    return {"format": fmt, "writer": f"{package} {importlib.metadata.version(package)}", "gen": str(SPEC_VERSION)}


def _is_complete(d: Path, fmt: str) -> bool:
    try:
        return json.loads((d / ".complete").read_text()) == _marker(fmt)
    except (OSError, ValueError):
        return False


def ensure(root: Path, spec: Spec, formats: list[str]) -> Path:
    """Writes whichever of `formats` is missing or stale (raw first: the others copy it); returns
    the dataset directory."""
    base = root / spec.key()
    base.mkdir(parents=True, exist_ok=True)
    (base / "spec.json").write_text(json.dumps({"spec": dataclasses.asdict(spec)}, indent=1) + "\n")
    for fmt in ["raw", *(f for f in formats if f != "raw")]:
        d = base / fmt
        if not _is_complete(d, fmt):
            write = functools.partial(lambda w, tmp: w(spec, tmp, base / "raw"), WRITERS[fmt])
            gen.write_tree(d, f"{spec.samples:,} JPEGs as {fmt}", write, _marker(fmt))
    return base


def prune(root: Path, keep: Spec) -> list[Path]:
    """Deletes cached JPEG datasets of another spec (other sample counts of this one stay)."""
    return gen.prune_specs(list(root.glob("jpeg-n*/spec.json")), dataclasses.asdict(keep))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    print(ensure(Path(__file__).resolve().parent / "data", Spec(samples=n), list(FORMATS)))


if __name__ == "__main__":
    main()
