"""Where a training step's memory goes, counted on the live run: parameters, gradients, optimizer state, the input
batch and the activations one micro-batch saves for backward.

Everything is read, nothing is called or copied. Activations are counted in the autograd graph of the step's own
loss, just before its backward (Lightning's ``on_before_backward``): every node's saved tensors are reached through
``_raw_saved_*`` (torch's ``SavedTensor``), whose ``data`` is the packed tensor itself, so no unpack hook runs, no
version check is touched and no saved-tensor hook is installed around the user's code (those would break a
``torch.func`` transform or a compiled step inside ``training_step``). A tensor packed by the program's own hooks
(activation checkpointing, ``save_on_cpu``) is not in device memory as such: it is counted as *held by the program's
hooks*, not sized. Storages are counted once, whatever number of nodes or views share them; a storage that holds a
parameter or a batch tensor is counted under that heading, not as an activation.

The count repeats whenever the micro-batch size or the precision changes, so the breakdown describes the
configuration the run ended with. On CUDA the allocator's peak is the ground truth it is checked against.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

_FLOAT32 = (torch.float32, torch.float64)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes held by one rank's training, by what holds them. None where it was not measured on this run."""

    params_bytes: int
    grads_bytes: int | None
    optimizer_bytes: int | None
    activations_bytes: int | None  # saved for backward by one micro-batch
    activations_fp32_bytes: int | None  # of them, in 32- or 64-bit floating point (what 16-bit precision halves)
    batch_bytes: int | None  # the micro-batch on the device
    micro_batch: int | None  # samples in that micro-batch
    precision: str | None  # Lightning's precision the activations were counted under
    saved_tensors: int = 0  # distinct storages counted as activations
    hook_packed: int = 0  # saved tensors packed by the program's own hooks: held elsewhere, not sized

    @property
    def counted_bytes(self) -> int:
        """Everything counted: parameters, gradients, optimizer state, activations and the batch."""
        parts = (self.params_bytes, self.grads_bytes, self.optimizer_bytes, self.activations_bytes, self.batch_bytes)
        return sum(p for p in parts if p is not None)

    @property
    def per_sample_bytes(self) -> float | None:
        """Activations and input of one sample: what a micro-batch one sample larger adds."""
        if self.activations_bytes is None or not self.micro_batch:
            return None
        return (self.activations_bytes + (self.batch_bytes or 0)) / self.micro_batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the memory a tensor lives in; None for a tensor without one of its own (meta, sparse,
    a subclass that does not expose it)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_bytes(tensors: Iterable[Any], exclude: frozenset[int] = frozenset()) -> tuple[int, set[int]]:
    """Bytes of the distinct storages of the tensors among ``tensors`` (other items ignored), leaving out the
    storages at the addresses in ``exclude``; and the addresses counted."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        found = _storage(tensor)
        if found is None or found[0] == 0 or found[0] in exclude or found[0] in seen:
            continue
        seen.add(found[0])
        total += found[1]
    return total, seen


def _saved(loss: torch.Tensor) -> Iterator[Any]:
    """Every ``SavedTensor`` in the graph behind ``loss``, each node visited once."""
    names: dict[type, list[str]] = {}
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kind = type(node)
        if kind not in names:
            names[kind] = [n for n in dir(node) if n.startswith("_raw_saved_")]
        for name in names[kind]:
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed (a graph already backpropagated through)
                continue
            yield from value if isinstance(value, (list, tuple)) else (value,)
        stack.extend(fn for fn, _ in node.next_functions)


@dataclass(frozen=True)
class ActivationCount:
    bytes: int
    fp32_bytes: int
    tensors: int
    hook_packed: int


def count_activations(loss: torch.Tensor, exclude: frozenset[int]) -> ActivationCount:
    """The storages saved for backward in ``loss``'s graph, less those at the addresses in ``exclude``."""
    seen: set[int] = set(exclude)
    total = fp32 = tensors = hooked = 0
    for saved in _saved(loss):
        if getattr(saved, "unpack_hook", None) is not None:
            hooked += 1
            continue
        try:
            data = saved.data
        except RuntimeError:
            continue
        found = _storage(data) if isinstance(data, torch.Tensor) else None
        if found is None or found[0] == 0 or found[0] in seen:
            continue
        seen.add(found[0])
        total += found[1]
        tensors += 1
        if data.dtype in _FLOAT32:
            fp32 += found[1]
    return ActivationCount(total, fp32, tensors, hooked)


class MemoryMeter:
    """Fed by the callback's hooks; ``breakdown()`` is the last configuration's figures. Never raises into the
    fit: what it cannot count it leaves as None and says why (``unavailable``)."""

    def __init__(self) -> None:
        self._key: tuple[int | None, str] | None = None  # (micro-batch, precision) of the batch in progress
        self._counted: set[tuple[int | None, str]] = set()
        self._batch: tuple[int, frozenset[int]] | None = None  # bytes and storages of the batch in progress
        self._pending = False  # count this batch's activations before its backward
        self._activations: dict[tuple[int | None, str], tuple[ActivationCount, int]] = {}
        self._params: tuple[int, frozenset[int]] | None = None
        self._grads: int | None = None
        self._optimizer: int | None = None
        self._state_pending = False
        self.unavailable: str | None = None

    def batch_started(self, batch: Any, micro_batch: int | None, precision: str) -> None:
        key = (micro_batch, precision)
        self._key = key
        self._pending = key not in self._counted
        if self._pending:
            size, addresses = storage_bytes(tree_leaves(batch))
            self._batch = (size, frozenset(addresses))

    def before_backward(self, loss: Any, module: torch.nn.Module) -> None:
        if not self._pending or self._key is None:
            return
        self._pending = False
        self._counted.add(self._key)
        if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            self.unavailable = "the loss handed to backward has no autograd graph to count"
            return
        params = self._params = self._params or self._parameters(module)
        batch_bytes, batch_storages = self._batch or (0, frozenset())
        self._activations[self._key] = (count_activations(loss, params[1] | batch_storages), batch_bytes)
        self._state_pending = True  # gradients and optimizer state for this configuration, at its first step

    @staticmethod
    def _parameters(module: torch.nn.Module) -> tuple[int, frozenset[int]]:
        held = storage_bytes([*module.parameters(), *module.buffers()])[1]  # buffers are not activations either
        return storage_bytes(module.parameters())[0], frozenset(held)

    def before_optimizer_step(self, module: torch.nn.Module) -> None:
        if self._state_pending:
            self._grads = storage_bytes(p.grad for p in module.parameters())[0]

    def after_step(self, optimizers: Iterable[Any]) -> None:
        if not self._state_pending:
            return
        self._state_pending = False
        params = self._params[1] if self._params else frozenset()
        self._optimizer = storage_bytes(_state_tensors(optimizers), exclude=params)[0]

    def breakdown(self) -> MemoryBreakdown | None:
        """The figures of the configuration the run ended with (the last micro-batch size and precision counted)."""
        if self._params is None or self._key is None:
            return None
        key = self._key if self._key in self._activations else next(reversed(self._activations), None)
        count, batch_bytes = self._activations[key] if key is not None else (None, None)
        return MemoryBreakdown(
            params_bytes=self._params[0], grads_bytes=self._grads, optimizer_bytes=self._optimizer,
            activations_bytes=count.bytes if count else None,
            activations_fp32_bytes=count.fp32_bytes if count else None,
            batch_bytes=batch_bytes, micro_batch=key[0] if key else None, precision=key[1] if key else None,
            saved_tensors=count.tensors if count else 0, hook_packed=count.hook_packed if count else 0)


def _state_tensors(optimizers: Iterable[Any]) -> Iterator[Any]:
    for optimizer in optimizers:
        for state in getattr(optimizer, "state", {}).values():
            yield from tree_leaves(state)
