"""shardstream: node-local data loading for ML training.

A per-node daemon indexes WebDataset shards once, computes a deterministic, exactly-once shuffled
order for every rank and DataLoader worker, and streams batches to trainer processes. This package
is its Python client (and ships the ``shardstream`` command line)::

    loader = shardstream.Loader("/data/train/", batch_size=256, shuffle=True, seed=0)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:          # {"__key__": [str], "jpg": [memoryview], "cls": [...]}
            ...
    state = loader.state_dict()       # resume exactly here, also after a crash

A directory of Parquet files is served row by row the same way; its batches are Arrow record
batches in shared memory, yielded as a dict of numpy arrays / memoryviews / str lists (the
default) or, with ``format="arrow"``, as ``pyarrow.RecordBatch`` (see ``shardstream._arrow``).
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from . import _native
from ._native import ShardError, ShardstreamError

__all__ = ["Batch", "Loader", "ShardError", "ShardstreamError", "resolve_address", "__version__"]
__version__: str = _native.__version__

STATE_VERSION = 1
_TRANSPORTS = ("auto", "shm", "rdma", "inline")
_COLLATES = (None, "stack")
_CACHE_MODES = ("auto", "direct", "copy")
_FORMATS = ("dict", "arrow")

_embedded_lock = threading.Lock()
_embedded_addr: str | None = None


# In an embedded server's private directory: "<pid> <start time> <pid namespace>" of the process
# that made it, so that a later one can tell a directory whose owner was killed (no atexit ran)
# from a live one. The namespace: a container sharing $TMPDIR sees other pids, or none.
_OWNER_FILE = "owner"


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22),
    which tells it from a later process given the same pid; None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its closing one.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[19].decode() if len(fields) > 19 else None


def _sweep_embedded(parent: str) -> None:
    """Removes the private directories (socket, node-cache copies) that embedded servers of this
    user left in ``parent`` when their process was killed: only those whose owner file names a
    process of this pid namespace that no longer runs. Anything else named alike is left alone."""
    uid, namespace = os.getuid(), _pid_namespace()
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return
    for entry in entries:
        if not entry.name.startswith("shardstream-"):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            with open(os.path.join(entry.path, _OWNER_FILE)) as f:
                pid, start, owner_namespace = f.read().split()
            owner = int(pid)
        except (OSError, ValueError):  # not ours to judge: a file of another make, or cut short
            continue
        if owner_namespace == namespace and _process_start(owner) != start:
            shutil.rmtree(entry.path, ignore_errors=True)


def _start_embedded() -> str:
    """Starts a daemon inside this process on a private socket (once per process tree: forked
    DataLoader workers inherit the address and connect to the parent's server). Its directory
    goes at exit; one a killed process left is removed by the next embedded server's start."""
    global _embedded_addr
    with _embedded_lock:
        if _embedded_addr is None:
            started, namespace = _process_start(os.getpid()), _pid_namespace()
            if started is not None and namespace is not None:
                _sweep_embedded(tempfile.gettempdir())
            private = tempfile.mkdtemp(prefix="shardstream-")  # mode 0700
            if started is not None and namespace is not None:
                with open(os.path.join(private, _OWNER_FILE), "w") as f:
                    f.write(f"{os.getpid()} {started} {namespace}\n")
            cache = os.environ.get("SHARDSTREAM_CACHE_DIR") or os.path.join(private, "cache")
            _embedded_addr = _native.start_embedded_server(os.path.join(private, "sock"), cache)
            owner = os.getpid()

            def _cleanup() -> None:
                if os.getpid() == owner:
                    shutil.rmtree(private, ignore_errors=True)

            atexit.register(_cleanup)
        return _embedded_addr


def resolve_address(connect: str = "auto") -> str:
    """Where to reach a daemon: ``connect`` itself if it is an address (``unix:///path``,
    ``tls://host:port`` for a daemon on another host, or ``tcp://127.0.0.1:port`` for one started
    with ``--insecure``); for ``"auto"``, ``$SHARDSTREAM_ADDR``, else the node daemon's default
    socket if one answers there, else an embedded server started in this process.

    ``tls://`` takes its credentials from the environment, which ranks and DataLoader workers
    inherit: ``SHARDSTREAM_TLS_CA`` (the daemon's CA, PEM), ``SHARDSTREAM_TOKEN_FILE`` (a file
    holding the bearer token), and for mutual TLS ``SHARDSTREAM_TLS_CLIENT_CERT`` /
    ``SHARDSTREAM_TLS_CLIENT_KEY``. A refused token is a ``PermissionError``."""
    if connect != "auto":
        return connect
    env = os.environ.get("SHARDSTREAM_ADDR")
    if env:
        return env
    default = _native.DEFAULT_SOCKET
    if os.path.exists(default) and _native.probe("unix://" + default):
        return "unix://" + default
    return _start_embedded()


def _default_rank_world() -> tuple[int | None, int]:
    """The process group's rank and world size, else RANK and WORLD_SIZE's (rank None when RANK
    is not set)."""
    # A process group exists only if the trainer imported torch.distributed: look it up instead
    # of importing torch, which costs a trainer without torch 1.5-2 s per Loader.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank = _env_int("RANK", 0) if os.environ.get("RANK") is not None else None
    return rank, _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} in the environment is not an integer") from None


def _flag(name: str, value: object) -> bool:
    """A yes/no argument: ``bool()`` would make any non-empty string true (``shuffle="False"``)."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise ValueError(f"{name} must be True or False, not {value!r}")


def _checked_int(name: str, value: object, bits: int, low: int = 0, high: int | None = None) -> int:
    """``value`` as a Python int in ``low .. high`` (by default the wire's range ``0 ..
    2**bits-1``). Any integer type is one (``operator.index``: numpy's too, as configs and
    checkpoints hold them); a bool or a float is refused, never truncated."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = low - 1
    top = (1 << bits) - 1 if high is None else high
    if isinstance(value, bool) or not low <= number <= top:
        shown = f"2**{bits}-1" if high is None else str(high)
        raise ValueError(f"{name} must be an integer from {low} to {shown}, not {value!r}")
    return number


def _as_plain_int(value: object) -> object:
    """``value``, but an integer of another type (a 0-d tensor, a numpy scalar: what checkpoint
    helpers make of a state's ints) as a Python int; a bool tensor as a bool."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value
    dtype = getattr(value, "dtype", None)
    return bool(number) if dtype is not None and "bool" in str(dtype) else number


def _checked_epoch(epoch: object) -> int:
    """An epoch as the plan takes it (a u64): refused when set, not as an ``OverflowError`` when
    the next iteration begins."""
    return _checked_int("epoch", epoch, 64)


#: How many Loaders of each dataset URL this process made with a process group: the n-th of one
#: rank is compared with the n-th of the others (every rank runs the same program).
_opened_with_group: dict[str, int] = {}


def _ranks_agree(url: str, fingerprint: str, rank: int, world_size: int) -> None:
    """Refuses to go on with a dataset this rank opened otherwise than the rank that opened it
    first: each node's daemon lists the dataset when its rank opens it, and a directory that
    changes between two listings (a writer still adding shards) would give the ranks different
    plans, whose union repeats or drops samples. Through the torch.distributed process group's
    store, when there is one over exactly these ranks: the first rank's fingerprint (and rank) is
    set (``compare_set``, no waiting on the others), and every later one compares its own with it.
    Not in DataLoader workers: a forked worker must not use its parent's store connection."""
    dist = sys.modules.get("torch.distributed")
    if world_size < 2 or dist is None or not dist.is_available() or not dist.is_initialized():
        return
    data = sys.modules.get("torch.utils.data")
    if dist.get_world_size() != world_size or (data is not None and data.get_worker_info() is not None):
        return
    from torch.distributed import distributed_c10d

    n = _opened_with_group[url] = _opened_with_group.get(url, 0) + 1
    # torchrun's agent may keep its store across the restarts of a job's workers, which start
    # counting again: a restart's keys are its own.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"shardstream/fingerprint/{attempt}/{n}/{url}"
    mine = f"{fingerprint} {rank}"
    stored = distributed_c10d._get_default_store().compare_set(key, "", mine)
    first, _, first_rank = (stored.decode() if isinstance(stored, bytes) else str(stored)).partition(" ")
    if first != fingerprint:
        raise ValueError(
            f"rank {rank} opened {url} with fingerprint {fingerprint}, but rank {first_rank} opened it with {first}: "
            "its shards changed between the ranks' listings (a writer still adding files?), and ranks that read "
            "different shards would repeat or drop samples. Let the writer finish, or write a manifest "
            f"(shardstream index {url}) that every rank then reads, and start the job again"
        )


class Batch(dict[str, Any]):
    """One batch: ``"__key__"`` -> list of str, each field -> list of bytes-like objects.

    With the shared-memory transport the values are read-only memoryviews straight into the
    daemon's node-cache copies of the shards (zero copy), or, for a dataset read in place (which
    anyone may truncate: a mapping would then kill the process with SIGBUS), into a buffer the
    batch's samples were read into; either way the batch holds a lease on its shards until every
    view is gone; ``release()`` returns the lease at once (the views stay readable).

    With ``collate="stack"`` each field is one read-only ``(samples, record_bytes)`` uint8 numpy
    array; over shared memory it lies in a slot of the stream's ring, held until every array is
    gone. ``release()`` hands the slot back at once: the daemon then reuses it, so the arrays must
    not be used afterwards (copy what you keep, e.g. ``torch.from_numpy(a.copy())``).
    ``shardstream.torch`` hands the same memory out as tensors, which may be written in place:
    the ring is copy-on-write in this process, and what was written is dropped before the slot
    goes back.

    A Parquet batch (the dict form) lies in a ring slot the same way: its zero-copy values
    (fixed-width arrays, binary memoryviews) are views of the record batch's buffers, which hold
    the slot until every one of them is gone; after ``release()`` (once every batch cut from the
    same message has been released) they must not be used either.
    """

    __slots__ = ("_native",)
    _native: _native.Batch | _LeaseShare

    def release(self, at_once: bool = True) -> None:
        """Returns the batch's lease now. ``at_once=False``: the release may travel with the next
        few (as when a batch is dropped), which saves the daemon a wake-up per batch."""
        native = getattr(self, "_native", None)
        if native is not None:
            native.release(at_once)

    def _may_be_written(self) -> None:
        """The batch's ring memory is handed out as torch tensors, which may be written in place:
        the client drops those writes before the slot goes back (``shardstream.torch``)."""
        native = getattr(self, "_native", None)
        if isinstance(native, _LeaseShare):
            native = native._shared._native
        if native is not None:
            native.may_be_written()

    def to(self, *args: Any, **kwargs: Any) -> Batch:
        """The batch with its tensors (a field's, or in a field's list) moved as ``Tensor.to(*args,
        **kwargs)`` moves them; memoryviews, strings and arrays stay as they are, holding the same
        lease. Frameworks move a batch to its device by calling ``to`` where an object has one
        (Lightning's ``transfer_batch_to_device``, accelerate's ``send_to_device``); without it
        they rebuilt each memoryview as a sequence, which fails (``memoryview: a bytes-like object
        is required, not 'list'``)."""

        def moved(v: Any) -> Any:
            if isinstance(v, list):
                return [moved(x) for x in v] if any(_movable(x) for x in v) else v
            return v.to(*args, **kwargs) if _movable(v) else v

        out = Batch({k: moved(v) for k, v in self.items()})
        native = getattr(self, "_native", None)
        if native is not None:
            out._native = native
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        # Crossing a process boundary (DataLoader workers) copies the data; the lease stays here.
        return (Batch, (dict(self),))


def _movable(v: object) -> bool:
    """Whether ``v`` is moved by ``Batch.to``: a tensor (anything but a container with ``to``)."""
    return callable(getattr(v, "to", None)) and not isinstance(v, (dict, list, str, bytes, memoryview))


#: Most batches of small rows one Arrow message may carry (the daemon caps it too): the record
#: batch is read once and cut, where each message costs a fixed amount on both sides.
_BATCHES_PER_MESSAGE = 16


class _SharedLease:
    """The lease of one Arrow message, shared by the batches cut from it."""

    __slots__ = ("_native", "_left")

    def __init__(self, native: _native.Batch, parts: int) -> None:
        self._native, self._left = native, parts

    def release(self, at_once: bool = True) -> None:
        self._left -= 1
        if self._left == 0:
            self._native.release(at_once)


class _LeaseShare:
    """One batch's share of a ``_SharedLease``, returned once however often it is released
    (``Batch.release``). Until every share is returned the slot stays held, and it is held
    anyway while any batch's views are alive."""

    __slots__ = ("_shared", "_done")

    def __init__(self, shared: _SharedLease) -> None:
        self._shared, self._done = shared, False

    def release(self, at_once: bool = True) -> None:
        if not self._done:
            self._done = True
            self._shared.release(at_once)


def _stack_fields(batch: dict[str, Any]) -> None:
    """``collate="stack"`` where the daemon did not pack (inline transport): the same arrays, made
    here with one copy, and the same rule (every sample has the field, all of one length)."""
    import numpy as np

    keys = batch["__key__"]
    for name, values in batch.items():
        if name == "__key__":
            continue
        lengths = {len(v) if v is not None else None for v in values}
        if None in lengths:
            key = keys[next(i for i, v in enumerate(values) if v is None)]
            raise ValueError(
                f'collate="stack" needs field {name!r} in every sample, but sample {key!r} has none; '
                "select fields every sample has, or use collate=None"
            )
        if len(lengths) > 1:
            first = len(values[0])
            i = next(i for i, v in enumerate(values) if len(v) != first)
            raise ValueError(
                f'collate="stack" needs equal-length {name!r} within a batch: sample {keys[i]!r} has '
                f"{len(values[i])} bytes, sample {keys[0]!r} has {first}"
            )
        record = len(values[0]) if values else 0
        # One copy in C (join), read-only like the ring's arrays since it is over bytes.
        batch[name] = np.frombuffer(b"".join(values), np.uint8).reshape(len(values), record)


def _warn_same_order(owner: Any, epoch: int, shuffle: bool, start: int) -> None:
    """Warns, once per loader, when an iteration starts an epoch that the one before read to its
    end with neither ``set_epoch`` nor ``load_state_dict`` between: it yields the same order again.
    webdataset reshuffles by itself each epoch, and a training loop ported from it (or one that
    forgot the call) trained every epoch in one order without a word. ``set_epoch`` with the same
    epoch says the repeat is meant."""
    if not shuffle or start != 0 or owner._finished_epoch != epoch or owner._warned_same_order:
        return
    owner._warned_same_order = True
    warnings.warn(
        f"shardstream: epoch {epoch} again without set_epoch(), in the same order as the iteration before; "
        "call set_epoch(epoch) at the start of each epoch for a new order (as with torch's DistributedSampler), "
        "or set_epoch with the same epoch to repeat it on purpose",
        UserWarning,
        stacklevel=3,
    )


def _dataset_url(url: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """A local path as the daemon must get it: absolute, from this process's working directory and
    home (a daemon has its own, and refuses relative paths). URLs (``s3://``, ``file://``) as given."""
    if not isinstance(url, (str, bytes, os.PathLike)):
        # str() would make a path of anything: Loader(None) looked for "./None".
        hint = ""
        if isinstance(url, (list, tuple)):
            # webdataset takes a list of shard URLs; a Loader reads one dataset.
            hint = (
                ": a Loader reads one dataset, a directory, prefix or pattern: name its shards with a brace "
                "pattern (train-{000000..000099}.tar, {a,b}.tar) or a glob (train-*.tar)"
            )
        raise TypeError(f"url must be a path or URL (str, bytes or os.PathLike), not {type(url).__name__}{hint}")
    text = os.fsdecode(os.fspath(url))
    if not text:
        raise ValueError("url is empty: give the dataset's directory, pattern or s3:// URL")
    if "://" in text or text.startswith("pipe:"):
        # A pipe: URL (webdataset's) as it is too: the daemon says why it does not read one.
        return text
    text = os.path.expanduser(text)
    # Joined, not normalised: `..` after a symlink is the kernel's to resolve, as for any path.
    return text if os.path.isabs(text) else os.path.join(os.getcwd(), text)


class Loader:
    """Iterates one rank's batches of a dataset, shuffled the same way on every machine.

    ``url``: a directory (or ``s3://bucket/prefix/``) of ``*.tar`` or ``*.parquet`` shards, or some
    of them by a pattern in the file name: ``train-{000000..000099}.tar`` or a glob such as
    ``data/train-*.parquet``. A directory whose shards belong to several splits (``train-*`` beside
    ``test-*``) is a ``ValueError`` naming them: pick one with a glob. ``fields``: the fields to
    deliver (WebDataset extensions such as ``["jpg", "cls"]``, or Parquet columns); ``None`` for
    all of them (an empty list is a ``ValueError``, not "all").

    Every sample is delivered exactly once per epoch across all ranks (without ``drop_last`` the
    last ranks get up to one repeated sample each so every rank has the same number of batches; see
    the README). Batches are dicts: ``"__key__"`` -> list of str, each field -> list of read-only
    memoryviews (None where a sample lacks the field).

    Parquet datasets (a sample is a row; ``fields`` selects columns): with ``format="dict"`` (the
    default) each column is a numpy array (fixed-width types, zero copy; a ``numpy.ma.MaskedArray``
    in every batch when it may hold a null anywhere in the dataset, never a silent fill), a list
    of memoryviews (binary), or a list of str, plus
    ``"__key__"`` (a ``__key__``/``key`` column, fetched for the keys alone when ``fields`` leaves
    it out; else the row id as str) and ``"__row__"`` (the rows' ids, ``uint64``). With
    ``format="arrow"`` each batch is a ``pyarrow.RecordBatch`` whose buffers lie in the
    shared-memory ring slot the daemon wrote (zero copy), with a ``__row__``
    column of the rows' ids appended; the slot is the batch's until the record batch and every
    array made from it are gone. Batches of small rows arrive several to a message and are cut
    from its record batch (``RecordBatch.slice``, sharing its slot until all of them are gone);
    pickling such a slice writes the whole message's buffers, so with ``copy=True`` (for batches
    that are pickled: ``shardstream.torch``'s workers set it) each batch comes alone. ``copy=True``
    copies every batch out of its ring slot (once; Arrow IPC for a record batch) and gives the
    slot back at once.
    ``collate="stack"`` makes each column one array: 2-D for
    ``fixed_size_list`` columns and for lists or binary values of equal length (see
    ``shardstream._arrow.stack``).

    ``binary_views=True`` (Parquet over shared memory): ``binary``/``large_binary`` columns (also
    inside structs, as a Hugging Face image's ``bytes``) arrive as ``pyarrow.binary_view`` arrays
    whose values stay in the daemon's decoded row groups (sealed shared memory this process maps
    read-only): a batch then carries 16 bytes a row for them instead of a copy of every value,
    which is most of a warm epoch of large values such as images. The dict form gives the same
    memoryviews. The type differs from the dataset's (``binary_view``, pyarrow 14 or later); the
    values do not. Not with ``copy=True`` (pickling a view column writes every row group it points
    into) or ``collate="stack"``.
    """

    def __init__(
        self,
        url: str,
        batch_size: int = 256,
        *,
        shuffle: bool = True,
        seed: int = 0,
        fields: Sequence[str] | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        connect: str = "auto",
        # "shm" (same host, Unix socket), "rdma" (libfabric; daemon --rdma), "inline", or "auto"
        # (shm when possible; over TCP rdma when the daemon serves it over a hardware provider
        # this host opens too, else inline)
        transport: str = "auto",
        shuffle_window: int = 0,
        cache: str = "auto",  # "copy" (through the node cache), "direct" (in place), "auto"
        copy: bool = False,
        collate: str | None = None,  # "stack": each field as one (samples, record_bytes) array
        format: str = "dict",  # Parquet datasets: "dict" or "arrow" (pyarrow.RecordBatch)
        binary_views: bool = False,  # Parquet over shm: binary columns as views, no copy
        _worker: tuple[int, int] = (0, 1),
    ) -> None:
        if isinstance(fields, str):
            raise ValueError("fields must be a list of field names, e.g. ['jpg', 'cls'], not a string")
        if fields is not None:
            fields = list(fields)
            if not fields:
                # The wire's empty list means "every field"; an empty selection is a mistake upstream.
                raise ValueError("fields=[] selects no field; pass fields=None for all of them")
            for name in fields:
                if not isinstance(name, str):
                    raise ValueError(f"fields must be a list of field names (str), but it holds {name!r}")
        if cache not in _CACHE_MODES:
            raise ValueError(f"cache must be one of {_CACHE_MODES}, not {cache!r}")
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {_TRANSPORTS}, not {transport!r}")
        if collate not in _COLLATES:
            raise ValueError(f"collate must be one of {_COLLATES}, not {collate!r}")
        if format not in _FORMATS:
            raise ValueError(f"format must be one of {_FORMATS}, not {format!r}")
        if format == "arrow" and collate == "stack":
            raise ValueError(
                'collate="stack" makes one array of each column of the dict form; format="arrow" yields each '
                "pyarrow.RecordBatch as it is (its columns are arrays already): pass one or the other"
            )
        shuffle, drop_last = _flag("shuffle", shuffle), _flag("drop_last", drop_last)
        copy, binary_views = _flag("copy", copy), _flag("binary_views", binary_views)
        if rank is None or world_size is None:
            r, w = _default_rank_world()
            if world_size is None and w < 1:
                raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} in the environment must be at least 1")
            world_size = w if world_size is None else world_size
            if rank is None and r is None and _checked_int("world_size", world_size, 32) > 1:
                # Every process would take rank 0: each read the same share, three quarters of the
                # data never read with 4 of them, and nothing said.
                raise ValueError(
                    f"world_size is {world_size} but no rank is given (rank=, a torch.distributed process group, "
                    "or RANK in the environment): every process would read rank 0's share; set RANK in each "
                    "process (torchrun does; under srun, RANK=$SLURM_PROCID) or pass rank="
                )
            rank = (r or 0) if rank is None else rank
        # Types and wire ranges are checked here; the daemon checks the meaning (rank < world
        # size, limits) so every client gets the same rules.
        # The daemon checks the limits; these two the Loader's own arithmetic (len()) depends on.
        batch_size = _checked_int("batch_size", batch_size, 32, 1, _native.MAX_BATCH_SIZE)
        seed = _checked_int("seed", seed, 64)
        rank = _checked_int("rank", rank, 32)
        world_size = _checked_int("world_size", world_size, 32, 1, _native.MAX_WORLD_SIZE)
        shuffle_window = _checked_int("shuffle_window", shuffle_window, 32)
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size} (ranks are 0 to world_size-1)")
        self.url = _dataset_url(url)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.fields = fields if fields is not None else []
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.transport = transport
        if transport == "rdma":
            # libfabric's start-up (~0.3 s with Debian's build) is paid here, in the process that
            # builds the Loader: DataLoader workers forked from it inherit the loaded library and
            # only open their own endpoints. Raises at once if libfabric cannot be had.
            _native.fabric_warm_up()
        self.shuffle_window = shuffle_window
        self.cache = cache
        self.copy = copy
        self.collate = collate
        self._worker, self._num_workers = _worker
        self.address = resolve_address(connect)
        # What the stream would refuse at its first batch (in a DataLoader worker, wrapped) is
        # refused here, where the arguments are given.
        over_tcp = self.address.startswith(("tcp://", "tls://"))
        if over_tcp and transport == "shm":
            raise ValueError(
                f'transport "shm" needs a client on the daemon\'s host connected over its Unix socket, and '
                f'{self.address} is a TCP address: use transport="inline" or "auto"'
            )
        if over_tcp and binary_views:
            raise ValueError(
                f"binary_views needs the shared-memory transport (same host, Unix socket), and {self.address} "
                "is a TCP address: use binary_views=False"
            )
        self._conn = _native.Connection(self.address)
        if transport == "rdma" or (transport == "auto" and over_tcp):
            provider = str(self._conn.status().get("rdma_provider", ""))
            if transport == "rdma" and not provider:
                raise ValueError(
                    f'transport "rdma": the daemon at {self.address} does not serve rdma (start it with '
                    '`shardstream serve --rdma`); use transport="inline" or "auto"'
                )
            # auto takes rdma toward a daemon serving it over a hardware provider: load libfabric
            # here, as for "rdma", so forked DataLoader workers do not each pay its start-up. If
            # it cannot be had, the stream finds out again and goes inline.
            if transport == "auto" and provider and _native.rdma_auto_picks(provider):
                with contextlib.suppress(ShardstreamError):
                    _native.fabric_warm_up()
        self.info: dict[str, Any] = self._conn.open(self.url, self.cache)
        # Checked now, not at the first batch (in a DataLoader worker, an epoch later), against
        # the fields the daemon's open found, as its stream checks them.
        known = [str(f) for f in self.info.get("fields") or []]
        unknown = [f for f in self.fields if f not in known]
        if unknown:
            raise ValueError(f"field {unknown[0]!r} is not in dataset {self.url} (fields: {', '.join(known)})")
        if _worker == (0, 1):
            _ranks_agree(self.url, str(self.info["fingerprint"]), rank, world_size)
        self.format = format
        # Arrow batches (Parquet): the daemon describes the dataset with an Arrow schema.
        self.arrow = bool(self.info.get("arrow_schema")) or self.info.get("format") == "parquet"
        if format == "arrow" and not self.arrow:
            raise ValueError(
                f'format="arrow" is for Parquet datasets; {self.url} is a {self.info.get("format") or "sample"} '
                'dataset: use format="dict"'
            )
        # The dict form's keys come from the dataset's key column whatever `fields=` selects (a
        # TAR dataset's keys never depend on it): one left out is fetched for them alone. The
        # Arrow form is exactly the selected columns.
        self._key_only: str | None = None
        self._stream_fields = self.fields
        if self.arrow and format == "dict" and self.fields:
            from ._arrow import key_column

            # The open's description lists every column of a Parquet dataset.
            key = key_column([str(n) for n in self.info.get("fields") or []])
            if key is not None and key not in self.fields:
                self._key_only = key
                self._stream_fields = [*self.fields, key]
        if self.arrow and "__row__" in known and (not self.fields or "__row__" in self.fields):
            raise ValueError(
                f'the Parquet dataset {self.url} has a column "__row__", the name of the row ids every batch '
                "gets; leave it out with fields=[...] or rename it in the files"
            )
        self.binary_views = binary_views
        if self.binary_views:
            if not self.arrow:
                raise ValueError(
                    f"binary_views is for Parquet datasets; {self.url} is a "
                    f"{self.info.get('format') or 'sample'} dataset"
                )
            if transport in ("inline", "rdma"):
                raise ValueError(f'binary_views needs transport="shm" (or "auto" on the same host), not {transport!r}')
            if copy:
                raise ValueError(
                    "binary_views shares the daemon's decoded row groups, and copy=True batches are pickled "
                    "whole (shardstream.torch's workers without a transform): use binary_views=False, or "
                    "decode in the workers with transform= (they read the views where they lie)"
                )
            if collate == "stack":
                raise ValueError('binary_views cannot be stacked (collate="stack"): its values are not contiguous')
        self.epoch = 0
        self._start_batch = 0  # where the next iteration starts (set by load_state_dict)
        # The epoch the last iteration read to its end, until set_epoch or load_state_dict says
        # which comes next (see _warn_same_order).
        self._finished_epoch: int | None = None
        self._warned_same_order = False
        self._consumed = 0  # batches of the rank consumed in the current epoch
        self._stream: Any = None
        # Which iteration is the current one: an earlier one whose stream a later one closed
        # raises at its next batch instead of ending as if its epoch were over.
        self._iterations = 0
        self._header: dict[str, Any] = {}
        self._stats = {"samples": 0, "bytes": 0, "batches": 0, "wait_s": 0.0, "elapsed_s": 0.0}
        self._first_batch_s: float | None = None
        self._iter_started: float | None = None

    def __len__(self) -> int:
        """Batches per rank per epoch (the same on every rank)."""
        if self._header:
            return int(self._header["batches_per_rank"])
        n, w, b = int(self.info["num_samples"]), self.world_size, self.batch_size
        if self.drop_last:
            return (n // w) // b
        per_rank = -(-n // w)  # ceil(n / w): the padding rule
        return -(-per_rank // b)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next iteration follows (like DistributedSampler)."""
        epoch = _checked_epoch(epoch)
        if epoch != self.epoch:
            self._start_batch = 0
            self._consumed = 0
        self.epoch = epoch
        self._finished_epoch = None

    def _open_stream(self) -> Any:
        return self._conn.stream(
            self.url,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self.epoch,
            rank=self.rank,
            world_size=self.world_size,
            worker=self._worker,
            num_workers=self._num_workers,
            start_batch=self._start_batch,
            drop_last=self.drop_last,
            fields=self._stream_fields,
            shuffle_window=self.shuffle_window,
            transport=self.transport,
            # The dataset every rank agreed on when the loaders were made (and a resumed state
            # names): a change since would give ranks different batches.
            expected_fingerprint=str(self.info["fingerprint"]),
            cache=self.cache,
            # Arrow batches are stacked here, over the record batch's buffers.
            collate=None if self.arrow else self.collate,
            # A slice pickles its parent's whole buffers: batches to pickle come one a message.
            batches_per_message=1 if self.format == "arrow" and self.copy else _BATCHES_PER_MESSAGE,
            binary_views=self.binary_views,
        )

    _arrow_reader: Any = None

    def _arrow_batches(self, native: _native.Batch) -> list[tuple[int, int, Any]]:
        """The batches of an Arrow message as ``format`` asks (RecordBatches, or the dict form),
        each as ``(index, rows, batch)``. A message of small rows may carry several consecutive
        batches of the stream in one record batch; each is a slice of it, sharing its buffers."""
        # numpy and pyarrow are needed for Parquet datasets only.
        import numpy as np

        from . import _arrow

        if self._arrow_reader is None:
            self._arrow_reader = _arrow.BatchReader(views=self.binary_views)
        rb = self._arrow_reader.open(native)
        parts = native.parts()
        cut = len(parts) > 1
        if self.format == "arrow":
            # The daemon writes the rows' ids into the batch as its `__row__` column.
            if not self._arrow_reader.has_row:
                rb = _arrow.with_row_ids(rb, _arrow.row_ids(native))
            out: list[tuple[int, int, Any]] = []
            at = 0
            for index, n in parts:
                piece = rb.slice(at, n) if cut else rb
                out.append((index, n, _arrow.copied(piece) if self.copy else piece))
                at += n
            if self.copy:
                # Nothing of the slot is referenced any more: the daemon may reuse it.
                del rb
                native.release(at_once=False)
            return out
        rows = _arrow.row_ids(native)
        # Each batch cut from the message returns its share of the message's lease: the slot goes
        # back once every one of them has (or is gone), never under a batch not yet handed out.
        shared = _SharedLease(native, len(parts)) if cut else None
        batches: list[tuple[int, int, Any]] = []
        at = 0
        for index, n in parts:
            piece = rb.slice(at, n) if cut else rb
            out_dict = Batch(
                _arrow.to_dict(
                    piece, rows[at : at + n] if cut else rows, self.copy, self._key_only, self._arrow_reader.nulls
                )
            )
            if self.collate == "stack":
                _arrow.stack(piece, out_dict, self._key_only)
            if self.copy:
                for name, value in out_dict.items():
                    if isinstance(value, np.ndarray) and name != _arrow.ROW:
                        out_dict[name] = value.copy()
            out_dict._native = _LeaseShare(shared) if shared is not None else native
            batches.append((index, n, out_dict))
            at += n
        if self.copy:
            # Nothing of the slot is referenced any more: the daemon may reuse it.
            native.release(at_once=False)
        return batches

    def __iter__(self) -> Iterator[Any]:
        # One position (state_dict), so one stream: a new iteration ends the one before, which
        # then raises (see _cut_short).
        if self._stream is not None:
            self._stream.close()
        self._iterations += 1
        mine = self._iterations
        if self._start_batch and self._start_batch >= len(self):
            # Resumed from a state saved after the epoch's last batch: the epoch is done.
            self._consumed = self._start_batch
            self._start_batch = 0
            return
        _warn_same_order(self, self.epoch, self.shuffle, self._start_batch)
        # Bound here: the generator's cleanup may run in the interpreter's teardown, after the
        # module's globals (``time``) are None.
        perf_counter = time.perf_counter
        started = perf_counter()
        self._iter_started = started
        stream = self._stream = self._open_stream()
        self._header = stream.header
        if self.binary_views and not self._header.get("binary_views"):
            stream.close()
            raise ShardstreamError(
                f"the daemon at {self.address} does not serve binary_views (it predates them): upgrade it, "
                "or use binary_views=False"
            )
        self._arrow_reader = None  # per stream: it keeps the stream's schema message
        # The position is counted in the rank's batches: a worker's stream delivers every
        # num_workers-th of them and torch re-interleaves the workers in that order.
        self._consumed = self._start_batch
        self._start_batch = 0
        try:
            while True:
                if self._iterations != mine:
                    raise self._cut_short()
                t0 = perf_counter()
                try:
                    batch = stream.next_batch()
                except ConnectionError:
                    # The daemon went away (a restart, a crash): the position stays where this
                    # iteration stopped, so iterating again once it is back continues with the
                    # next batch, as load_state_dict(state_dict()) would; starting the epoch over
                    # would repeat every batch taken. A break, by contrast, is the caller's: the
                    # next iteration begins the epoch, as a DataLoader's does.
                    if self._iterations == mine:
                        self._start_batch = self._consumed
                    raise
                t1 = perf_counter()
                self._stats["wait_s"] += t1 - t0
                if batch is None:
                    if self._iterations != mine:
                        raise self._cut_short()
                    self._finished_epoch = self.epoch
                    break
                if self._first_batch_s is None:
                    self._first_batch_s = t1 - started
                if batch.arrow:
                    outs = self._arrow_batches(batch)
                else:
                    out = Batch(batch.to_dict(self.copy))
                    # Copied out, a batch needs nothing of the native one, which holds its bytes:
                    # over rdma a ring slot, which the daemon waits for (a shared-memory lease
                    # went back in to_dict).
                    if not self.copy or batch.packed:
                        out._native = batch
                    if self.collate == "stack" and not batch.packed:
                        _stack_fields(out)
                    outs = [(batch.index, len(batch), out)]
                rows, nbytes = max(len(batch), 1), batch.nbytes
                del batch
                for index, n, out in outs:
                    self._stats["samples"] += n
                    self._stats["bytes"] += nbytes * n // rows
                    self._stats["batches"] += 1
                    # A batch cut from a message resumes at the next batch, in the same message.
                    self._consumed = index + 1
                    yield out
                del outs, out
        finally:
            stream.close()
            if self._stream is stream:
                self._stream = None
            self._stats["elapsed_s"] += perf_counter() - started
            self._iter_started = None

    def _cut_short(self) -> RuntimeError:
        return RuntimeError(
            "this iteration was cut short by another iteration of the same Loader (a Loader has one "
            "position, its state_dict(), so it streams one iteration at a time): make a Loader for each "
            "consumer, or finish or close() one iteration before starting the next"
        )

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: pass to ``load_state_dict`` (in a new process too) to continue
        with the next batch, none lost or repeated. Saved after an epoch's last batch, it resumes
        at the end of that epoch: iterating it yields nothing, and ``set_epoch(epoch + 1)`` starts
        the next epoch (a training loop that calls ``set_epoch`` for every epoch needs no special
        case)."""
        return {
            "version": STATE_VERSION,
            "url": self.url,
            "fingerprint": self.info["fingerprint"],
            "epoch": self.epoch,
            "batches_consumed": self._consumed,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_window": self.shuffle_window,
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from a ``state_dict``: the next iteration starts at the following batch."""
        if not isinstance(state, dict):
            raise ValueError(f"a loader state is a dict from state_dict(), not {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported state version {state.get('version')!r} (expected {STATE_VERSION})")
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ValueError(f"the state is missing {', '.join(missing)}: it is not from a Loader's state_dict()")
        state = dict(state)
        for key in ("epoch", "batches_consumed"):
            state[key] = _checked_int(f"the state's {key}", state[key], 64)
        for key in ("batch_size", "seed", "shuffle", "shuffle_window", "world_size", "drop_last", "rank"):
            state[key] = _as_plain_int(state[key])
            saved, mine = state[key], getattr(self, key)
            if key == "shuffle_window":
                # 0 is the daemon's default window: the same order as that window given.
                saved, mine = (w or _native.DEFAULT_SHUFFLE_WINDOW if isinstance(w, int) else w for w in (saved, mine))
            if saved != mine:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r} but this loader has {getattr(self, key)!r}; "
                    "the order would differ"
                )
        if state["fingerprint"] != self.info["fingerprint"] and state["url"] != self.url:
            raise ValueError(
                f"state was saved for {state['url']} (fingerprint {state['fingerprint']}), but this loader reads "
                f"{self.url} ({self.info['fingerprint']}): another dataset, or a copy of it whose shards differ"
            )
        if state["fingerprint"] != self.info["fingerprint"]:
            raise ValueError(
                f"state was saved for dataset fingerprint {state['fingerprint']} but {self.url} now has "
                f"{self.info['fingerprint']}: the shards changed, or a manifest.json was written or removed since "
                "(`shardstream index` changes the fingerprint of an unchanged dataset)"
            )
        # A state saved after the epoch's last batch resumes at the end of that epoch: iterating
        # it yields nothing, and the next set_epoch() starts the following epoch from its start.
        # No state_dict() says more: such a state would skip the epoch without a word.
        consumed = int(state["batches_consumed"])
        if consumed > len(self):
            raise ValueError(
                f"the state's batches_consumed ({consumed}) is more than this rank's {len(self)} batches an "
                "epoch: it is not from this loader's state_dict()"
            )
        self.epoch = int(state["epoch"])
        self._finished_epoch = None
        self._start_batch = consumed
        self._consumed = consumed

    def stats(self) -> dict[str, Any]:
        """Throughput so far: samples/s and bytes/s over the wall time spent iterating, and the
        time spent waiting for data (``wait_s``: the figure that shows a starving GPU)."""
        s: dict[str, Any] = dict(self._stats)
        if self._iter_started is not None:
            s["elapsed_s"] += time.perf_counter() - self._iter_started
        busy = max(s["elapsed_s"], 1e-9)
        s["samples_per_s"] = s["samples"] / busy
        s["bytes_per_s"] = s["bytes"] / busy
        s["time_to_first_batch_s"] = self._first_batch_s
        s["transport"] = self._header.get("transport", "inline")
        s["packed"] = bool(self._header.get("packed", False))
        s["address"] = self.address
        return s

    def close(self) -> None:
        """Ends the current iteration's stream. Safe from any thread: an iteration blocked on
        another thread wakes up and ends (as if the epoch were over)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down modules
            pass
