"""Memory that DataLoader workers reuse for the batches their transform's results are stacked into.

``default_collate`` in a worker stacks each batch's tensors into a new shared-memory segment. A
segment of tens of MiB comes from the kernel as fresh pages: the worker pays for zeroing and
mapping them, and the trainer, dropping the last mapping, for freeing them. For 224x224 images in
batches of 256 that was ~1.3 CPU-s an epoch of 8,000 images on the 2-core bench machine, more than
everything else the loader did (``bench/DECODE_RESULTS.md``). Here each worker keeps a few slots
(shared segments) and stacks a batch's large tensors into a free one: the pages stay mapped in the
worker, so the stack is a plain copy, and the trainer's unmapping frees nothing.

A slot is free again once the trainer holds no reference to its memory. The trainer watches the
storage of every pooled tensor it receives with torch's ``StorageWeakRef``, which expires when the
last tensor, view or numpy array over that memory in the trainer is gone, and then clears the
slot's flag in a small array shared with the workers; a worker only takes slots whose flag is
clear. A trainer that keeps batches keeps their slots, and a worker with no free slot stacks into a
new segment, as ``default_collate`` would.

What the trainer cannot see: a batch's tensor sent on to a third process (a ``torch.multiprocessing``
queue, say) maps the same segment, and once the trainer drops its own reference the worker may
reuse it. ``.clone()`` what is sent on, or build the DataLoader with ``reuse_batch_memory=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

# Below this a batch tensor comes from malloc's arenas or a small segment, and reusing it saves
# little; labels, ids and other per-sample scalars stay with default_collate.
MIN_BYTES = 1 << 20
# Slots a worker keeps beyond its prefetched batches: the one it is building, the one the trainer
# holds while asking for the next, and the one just received (see `DataLoader.__iter__`).
SPARE_SLOTS = 3


class Pooled:
    """A collated batch whose large tensors lie in slots, on its way from a worker to the trainer;
    ``shardstream.torch.DataLoader`` unwraps it (`BatchMemory.receive`) before the user sees it."""

    __slots__ = ("data", "tensors", "reused", "allocated", "unpooled")

    def __init__(self, data: Any, tensors: list[tuple[int, torch.Tensor]], counts: list[int]) -> None:
        self.data = data
        # (slot, tensor): pickled with `data` in one pickle, so in the trainer each tensor here is
        # the very object inside `data`, over the same storage.
        self.tensors = tensors
        self.reused, self.allocated, self.unpooled = counts


class BatchMemory:
    """Slots of ``slots_per_worker`` per worker, with their flags (1 = holds a batch the trainer
    may still use) in an array shared by the trainer and its workers.

    The storages live only in the worker that fills them (dropped when pickled to a spawned
    worker); what the trainer tracks lives only in the trainer."""

    def __init__(self, context: Any, workers: int, prefetch_factor: int) -> None:
        if workers < 1:
            raise ValueError("batch memory is for DataLoader workers; without them nothing crosses processes")
        self.slots_per_worker = prefetch_factor + SPARE_SLOTS
        # A lock of its own: the flags are written by one process and read by another, and the
        # lock's acquire and release order those accesses with the tensors' reads and writes.
        self._flags = context.Array("b", workers * self.slots_per_worker)
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._held: list[tuple[int, StorageWeakRef]] = []
        self.reused = self.allocated = self.unpooled = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"slots_per_worker": self.slots_per_worker, "_flags": self._flags}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._storages, self._held = {}, []
        self.reused = self.allocated = self.unpooled = 0

    # --- in a worker ---

    def collate_fn(self, worker: int) -> Callable[[list[Any]], Pooled]:
        """``default_collate`` for worker ``worker``, with large tensors stacked into its slots."""

        def collate_pooled(samples: list[Any]) -> Pooled:
            taken: list[tuple[int, torch.Tensor]] = []
            counts = [0, 0, 0]

            def stack(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
                return self._stack(batch, worker, taken, counts)

            fns = {**default_collate_fn_map, torch.Tensor: stack}
            try:
                data = collate(samples, collate_fn_map=fns)
            except BaseException:
                self._release([slot for slot, _ in taken])
                raise
            return Pooled(data, taken, counts)

        return collate_pooled

    def _stack(
        self, batch: list[torch.Tensor], worker: int, taken: list[tuple[int, torch.Tensor]], counts: list[int]
    ) -> torch.Tensor:
        elem = batch[0]
        nbytes = len(batch) * elem.numel() * elem.element_size()
        poolable = (
            elem.device.type == "cpu"
            and elem.layout == torch.strided
            and not elem.is_nested
            and not any(x.requires_grad for x in batch)
        )
        got = self._take(worker, nbytes) if nbytes >= MIN_BYTES and poolable else None
        if got is None:
            counts[2] += nbytes >= MIN_BYTES and poolable
            fresh: torch.Tensor = collate_tensor_fn(batch)
            return fresh
        slot, storage, reused = got
        try:
            out = torch.empty(0, dtype=elem.dtype)
            # torch's stubs type set_'s source as a TypedStorage; an UntypedStorage is what
            # Tensor.untyped_storage() itself returns and set_ takes it (the tests run this path).
            out.set_(storage, 0, (len(batch), *elem.shape))  # type: ignore[call-overload]
            torch.stack(batch, 0, out=out)
        except BaseException:
            self._release([slot])
            raise
        taken.append((slot, out))
        counts[0 if reused else 1] += 1
        return out

    def _take(self, worker: int, nbytes: int) -> tuple[int, torch.UntypedStorage, bool] | None:
        """A free slot of this worker, flagged as taken: one whose segment is large enough, else
        one to (re)allocate; None if the trainer holds them all."""
        base = worker * self.slots_per_worker
        with self._flags.get_lock():
            flags = self._flags.get_obj()
            free = [s for s in range(base, base + self.slots_per_worker) if not flags[s]]
            if not free:
                return None
            fits = [s for s in free if s in self._storages and self._storages[s].nbytes() >= nbytes]
            slot = fits[0] if fits else free[0]
            flags[slot] = 1
        if not fits:
            self._storages[slot] = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
        return slot, self._storages[slot], bool(fits)

    def _release(self, slots: list[int]) -> None:
        if not slots:
            return
        with self._flags.get_lock():
            flags = self._flags.get_obj()
            for slot in slots:
                flags[slot] = 0

    # --- in the trainer ---

    def receive(self, batch: Pooled) -> Any:
        """The batch for the user; its slots are watched until the trainer lets go of them."""
        self.reused += batch.reused
        self.allocated += batch.allocated
        self.unpooled += batch.unpooled
        for slot, tensor in batch.tensors:
            self._held.append((slot, StorageWeakRef(tensor.untyped_storage())))  # type: ignore[no-untyped-call]
        return batch.data

    def collect(self) -> None:
        """Frees the slots whose memory the trainer no longer references."""
        done = [i for i, (_, ref) in enumerate(self._held) if ref.expired()]  # type: ignore[no-untyped-call]
        if not done:
            return
        self._release([self._held[i][0] for i in done])
        gone = set(done)
        self._held = [h for i, h in enumerate(self._held) if i not in gone]

    def counts(self) -> dict[str, int]:
        return {"reused": self.reused, "allocated": self.allocated, "unpooled": self.unpooled}
