"""Type stubs of the native module (Rust, PyO3). Use the ``shardstream`` package API instead."""

from typing import Any, Self, final

__all__ = [
    "Connection",
    "Stream",
    "Batch",
    "Buffer",
    "Region",
    "Column",
    "ArrowReader",
    "ArrowBatch",
    "start_embedded_server",
    "probe",
    "cli_main",
    "fabric_warm_up",
    "rdma_auto_picks",
    "ShardstreamError",
    "ShardError",
    "__version__",
    "DEFAULT_SOCKET",
    "MAX_BATCH_SIZE",
    "MAX_WORLD_SIZE",
    "DEFAULT_SHUFFLE_WINDOW",
    "_panic_for_tests",
]

__version__: str
DEFAULT_SOCKET: str
MAX_BATCH_SIZE: int
MAX_WORLD_SIZE: int
DEFAULT_SHUFFLE_WINDOW: int

class ShardstreamError(Exception): ...

class ShardError(ShardstreamError):
    shard: str | None
    offset: int | None

@final
class Buffer:
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

@final
class Region:
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

@final
class Column:
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

@final
class Batch:
    @property
    def index(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def packed(self) -> bool: ...
    @property
    def arrow(self) -> bool: ...
    def row_id_bytes(self) -> bytes: ...
    def parts(self) -> list[tuple[int, int]]: ...
    def ipc(self) -> Buffer | Column: ...
    def release(self, at_once: bool = True) -> None: ...
    def may_be_written(self) -> None: ...
    def __len__(self) -> int: ...
    def to_dict(self, copy: bool = False) -> dict[str, list[Any]]: ...

@final
class ArrowBatch:
    def __arrow_c_schema__(self) -> object: ...
    def export_array(self) -> tuple[object, int]: ...

@final
class ArrowReader:
    def __new__(cls) -> Self: ...
    @property
    def has_row(self) -> bool: ...
    @property
    def schema_generation(self) -> int: ...
    def open(self, batch: Batch) -> ArrowBatch: ...

@final
class Stream:
    @property
    def header(self) -> dict[str, Any]: ...
    def next_batch(self) -> Batch | None: ...
    def close(self) -> None: ...

@final
class Connection:
    def __new__(cls, address: str) -> Self: ...
    @property
    def address(self) -> str: ...
    def open(self, url: str, cache: str = "auto") -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...
    def stream(
        self,
        url: str,
        *,
        batch_size: int,
        shuffle: bool,
        seed: int,
        epoch: int,
        rank: int,
        world_size: int,
        worker: int,
        num_workers: int,
        start_batch: int,
        drop_last: bool,
        fields: list[str],
        shuffle_window: int,
        transport: str,
        expected_fingerprint: str,
        cache: str = "auto",
        collate: str | None = None,
        batches_per_message: int = 1,
        binary_views: bool = False,
    ) -> Stream: ...

def start_embedded_server(socket: str, cache_dir: str) -> str: ...
def probe(address: str) -> bool: ...
def cli_main(argv: list[str]) -> int: ...
def fabric_warm_up() -> None: ...
def rdma_auto_picks(provider: str) -> bool: ...
def _panic_for_tests() -> None: ...
