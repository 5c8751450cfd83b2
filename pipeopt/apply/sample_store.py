"""One store of samples, shared by the main process and every loader worker: an index beside a data file, both
mapped into memory, sized by a budget.

Layout (``directory/``): ``index`` holds a header of counters and, for each dataset position, the offset and length
of its bytes in ``data`` (a length of 0: not stored); ``data`` is written once per position, never rewritten.
Writers reserve their bytes and claim the position under an ``flock`` on ``lock`` (the header's counters change only
there; a process making the same sample meanwhile stores nothing, unless the claim's process has died), write them
with ``pwrite`` and publish the position's length last, so a reader sees a position either absent or whole.
Readers take no lock and make no system call: they copy from the mapped data file (from the page cache; a ``pread``
of a 150 KB sample from shared memory costs ~2x the copy). The process that made the store maps in each record it
stores, while it is fresh: its first read of a page not yet mapped would fault (an epoch's first read of its
batches took twice the next one's). The files are never truncated while in use: a new store replaces them (a
process still mapping the old ones reads those). Every process opens the files itself (on first use after a fork
or a spawn): no file description - and so no lock - is shared between processes. The process that made (or
opened) the store holds a shared ``flock`` on ``alive`` until it closes it: a store nobody holds is left over from
a process that died (``sweep``).

Why not LMDB: an LMDB environment must not be used after ``fork()`` in the child it was inherited by, and a
DataLoader forks its workers from a main process that itself reads the store (``num_workers=0``) - closing the
inherited handle in a worker may release the parent's reader slots. This store has no such state: a position's
bytes are immutable once published.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import mmap
import os
import pickle
import shutil
import struct
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeopt import _dataloader

_MAGIC = 0x70697065_6F707403  # "pipeopt" + version 3 (records: a frame, the pickle, its buffers out of band)
#: Processes of one node that share a store count what they make apart (a slot each: a rank's loaders).
SLOTS = 64
#: int64 header: magic, data end, fill ns, stored, not stored (full), dataset length, budget, spare, then the items
#: each slot made (on a miss: stored or not).
_HEADER = 8 + SLOTS
_END, _FILL_NS, _STORED, _UNSTORED, _LENGTH, _BUDGET, _MADE = 1, 2, 3, 4, 5, 6, 8
#: ``madvise`` advice that maps a range's pages into the calling process's page tables (Linux 5.14 and later; Python
#: names it from 3.13 only). None: not on Linux.
_POPULATE_READ: int | None = getattr(mmap, "MADV_POPULATE_READ", 22) if sys.platform == "linux" else None


@dataclass(frozen=True)
class StoreStats:
    """The store's counters, as every process sees them."""

    stored: int  # positions stored
    length: int  # positions the dataset has
    bytes_used: int
    budget_bytes: int
    fill_s: float  # CPU time spent encoding and writing samples, summed over the processes that filled it
    unstored: int  # samples not stored because the budget was spent
    made: int = 0  # items this store's slot (a rank's loaders) made because the store did not have them

    @property
    def full(self) -> bool:
        return self.unstored > 0


class _Files:
    """One process's view of a store: the index and the data file mapped into memory (the index as int64s, the data
    as bytes: a read is a copy from the page cache, no system call), the data file's and the lock file's
    descriptors (for writes)."""

    def __init__(self, index_file: Any, index_map: mmap.mmap, data_fd: int, data_map: mmap.mmap,
                 lock_fd: int) -> None:
        self._index_file, self._index_map, self._data_map = index_file, index_map, data_map
        self.data_fd, self.lock_fd = data_fd, lock_fd
        self.index = memoryview(index_map).cast("q")
        self.data = memoryview(data_map)
        self._rows: dict[int, torch.Tensor] = {}  # row size -> the file as rows of that size, from every byte on
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # the index and the data file as NumPy arrays

    @classmethod
    def open(cls, directory: Path) -> _Files:
        index_file = open(directory / "index", "r+b")  # held for the process's lifetime
        data_fd = os.open(directory / "data", os.O_RDWR)
        return cls(index_file, mmap.mmap(index_file.fileno(), 0), data_fd,
                   mmap.mmap(data_fd, 0, prot=mmap.PROT_READ), os.open(directory / "lock", os.O_RDWR))

    def map_in(self, offset: int, length: int) -> None:
        """Map the data file's pages of ``length`` bytes at ``offset`` into this process's page tables now (where the
        kernel can: else its first read of them does)."""
        if _POPULATE_READ is None:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            self._data_map.madvise(_POPULATE_READ, start, offset + length - start)
        except (OSError, ValueError):  # a kernel without the advice
            pass

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The index as int64s and the data file as bytes, NumPy arrays over the maps (made on first use): a batch's
        offsets and its records' frames are read a batch at a time, not record by record."""
        if self._arrays is None:
            self._arrays = (np.frombuffer(self.index, dtype=np.int64), np.frombuffer(self._data_map, dtype=np.uint8))
        return self._arrays

    def gather(self, offsets: Sequence[int] | np.ndarray, out: torch.Tensor) -> None:
        """Copy the bytes of each row of ``out`` (a contiguous tensor, a row per offset) from the data file, row
        ``r``'s from ``offsets[r]``: one ``torch.index_select`` over a view of the file whose row ``k`` is the bytes
        from offset ``k`` on (outside the GIL, on torch's threads: ~0.37 ms for 32 rows of 150 KB where copying row
        by row took 0.57-0.73 ms)."""
        size = out.numel() * out.element_size() // max(1, len(offsets))
        if size == 0:
            return
        rows = self._rows.get(size)
        if rows is None:
            with warnings.catch_warnings():  # the map is read-only: torch warns that a tensor over it would be too
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.frombuffer(self._data_map, dtype=torch.uint8)
            rows = self._rows[size] = whole.as_strided((whole.numel() - size + 1, size), (1, 1))
        into = out.view(-1).view(torch.uint8).view(len(offsets), size)  # out's bytes, a row per offset
        torch.index_select(rows, 0, torch.as_tensor(offsets), out=into)

    def close(self) -> None:
        self._arrays = None  # before the maps close: the row views and the arrays hold views of them
        self._rows.clear()
        self.index.release()
        self.data.release()
        for mapped in (self._index_map, self._data_map):
            try:
                mapped.close()
            except BufferError:  # a record's view (``SampleStore.view``) is still alive: the map is unmapped with it
                pass
        self._index_file.close()
        os.close(self.data_fd)
        os.close(self.lock_fd)


def _stored_positions(positions: Sequence[int] | np.ndarray, length: int) -> np.ndarray | None:
    """``positions`` as int64, or None where one names no record of a store of ``length``: below 0, at or past the
    end, or past any int64."""
    try:
        at = np.asarray(positions, dtype=np.int64)
    except OverflowError:  # a Python int past any int64: past the end
        return None
    return at if at.view(np.uint64).max() < length else None  # (below 0, as a uint64, is past any length)


class SampleStore:
    """Bytes per dataset position, in ``directory``; at most ``budget_bytes`` of them (the budget of whoever created
    the store). ``slot``: which of the processes sharing it (a node's ranks) counts its misses. Picklable: a worker
    opens its own view of the files on first use."""

    def __init__(self, directory: str | os.PathLike[str], length: int, budget_bytes: int, slot: int = 0) -> None:
        if length < 1 or budget_bytes < 1 or not 0 <= slot < SLOTS:
            raise ValueError(f"a sample store needs a dataset length and a budget > 0 and a slot in [0, {SLOTS}) "
                             f"(got {length}, {budget_bytes}, {slot})")
        self.directory, self.length, self.slot = Path(directory), int(length), int(slot)
        self.directory.mkdir(parents=True, exist_ok=True)
        index = self.directory / "index"
        size = 8 * (_HEADER + 2 * self.length)
        lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with _locked(lock_fd):  # the node's ranks open it at once: one of them creates it
                if not index.exists() or index.stat().st_size != size or self._magic(index) != _MAGIC:
                    # a new (or foreign) store: empty files, put in place of any old ones - never truncated while
                    # another process maps them (reading a mapped page cut off a file is a SIGBUS, a crash)
                    fresh_data, fresh_index = self.directory / ".data.new", self.directory / ".index.new"
                    with open(fresh_data, "wb") as f:
                        f.truncate(budget_bytes)
                    with open(fresh_index, "w+b") as f:
                        f.truncate(size)
                        with mmap.mmap(f.fileno(), size) as mm:
                            header = memoryview(mm).cast("q")
                            header[_LENGTH], header[_BUDGET], header[0] = self.length, budget_bytes, _MAGIC
                            header.release()
                    os.replace(fresh_data, self.directory / "data")
                    os.replace(fresh_index, index)
                with open(index, "rb") as f:
                    header_bytes = f.read(8 * _HEADER)
        finally:
            os.close(lock_fd)
        self.budget_bytes = int.from_bytes(header_bytes[8 * _BUDGET:8 * _BUDGET + 8], "little", signed=True)
        self._pid: int | None = None
        self._files: _Files | None = None
        self._batches = _dataloader.BatchBuffers()  # the memory of the batches get_rows reads, used again
        self._layout: _Layout | None = None  # how the records of whole items lie, learnt by get_rows
        # The data file's bytes up to here are mapped into this process, or were stored before it opened the store
        # (a kept store, reopened: ``map_in_stored`` maps what is stored from now on)
        self._mapped_to = int.from_bytes(header_bytes[8 * _END:8 * _END + 8], "little", signed=True)
        alive = os.open(self.directory / "alive", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(alive, fcntl.LOCK_SH)  # held (until this process closes it), the store is in use
        self._alive: tuple[int, int] | None = (os.getpid(), alive)

    @staticmethod
    def _magic(index: Path) -> int:
        with open(index, "rb") as f:
            return int.from_bytes(f.read(8), "little", signed=True)

    def __getstate__(self) -> dict[str, Any]:
        return {"directory": self.directory, "length": self.length, "budget_bytes": self.budget_bytes,
                "slot": self.slot}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pid=None, _files=None, _alive=None, _batches=_dataloader.BatchBuffers(),
                             _layout=None, _mapped_to=0)

    def _open(self) -> _Files:
        """This process's view of the store's files (opened on first use in each process)."""
        files = self._files
        if files is None or self._pid != os.getpid():  # a view inherited across a fork: never used nor closed here
            files = self._files = _Files.open(self.directory)
            self._pid = os.getpid()
        return files

    def get(self, position: int) -> bytearray | None:
        """The bytes stored for ``position`` - copied into a buffer of their own, which ``decode`` lends to the
        tensors it makes - or None."""
        files = self._open()
        slot = _HEADER + 2 * position
        length, offset = files.index[slot + 1], files.index[slot]
        if not length:
            return None
        return bytearray(files.data[offset:offset + length])

    def view(self, position: int) -> memoryview | None:
        """The bytes stored for ``position`` where they lie in the mapped data file (read-only, no copy), or None.
        Valid while this store is open: copy what is to be kept (DALI's ``feed_input`` does)."""
        files = self._open()
        slot = _HEADER + 2 * position
        length, offset = files.index[slot + 1], files.index[slot]
        return files.data[offset:offset + length] if length else None

    def get_rows(self, positions: Sequence[int] | np.ndarray) -> Sequence[Any] | None:
        """The items stored at ``positions``, each tensor in them copied straight from the store into its row of one
        tensor per field of the batch (one gather a field), which ``_dataloader.collate_rows`` hands on whole instead
        of stacking: one copy of each sample's bytes in all, none of them through buffers of their own, into memory
        used for batches before where it is free (``_dataloader.BatchBuffers``: fresh memory faults on each page).
        The records' offsets and frames are read for the whole batch at once. None when a position is not stored (one
        below 0 or past the end names no record), or the items are not alike (a field that is not a plain tensor, or
        whose dtype or shape differs between them): the caller reads them one by one. Records of a tensor alone, or
        of tensors and numbers (an image and its label), are learnt once each (``_Layout``): a batch of them all
        learnt is read by position, nothing unpickled, and comes ``Collated`` as torch's default collate makes it."""
        if not len(positions):
            return []
        at = _stored_positions(positions, self.length)
        if at is None:
            return None
        files = self._open()
        layout = self._layout
        if layout is not None and layout.seen[at].all():  # every record known: nothing to check
            return layout.read(files, at, self._batches)
        index, data = files.arrays()
        slots = _HEADER + 2 * at
        if not index[slots + 1].all():  # (the length first: it is published after the offset)
            return None
        offsets = index[slots]
        if layout is not None and layout.fits(data, at, offsets):
            return layout.read(files, at, self._batches)
        return self._unpickled(files, data, at, offsets)

    def _unpickled(self, files: _Files, data: np.ndarray, at: np.ndarray, offsets: np.ndarray) -> Sequence[Any] | None:
        """``get_rows`` of a batch not all learnt, at ``offsets``: each record's pickle loaded, its tensors the rows
        of one tensor a field, its bytes gathered into them - and the records learnt on the way (a first batch
        finds the layout)."""
        layout = self._layout
        first = int(offsets[0])
        count, length = _FRAME.unpack_from(files.data, first)
        head = _FRAME.size + 8 * count
        frames = data[offsets[:, None] + np.arange(head)]  # each record's frame and buffer sizes, a row each
        if (frames[:, :4] != frames[0, :4]).any() or (frames[:, 8:] != frames[0, 8:]).any():
            return None  # not alike the first: another count of buffers, or one of another size
        lengths = np.ascontiguousarray(frames[:, 4:8]).view("<u4").ravel().astype(np.int64)  # each pickle's
        sizes = struct.unpack_from(f"<{count}Q", files.data, first + _FRAME.size)
        pickled = bytes(files.data[first + head:first + head + length])
        kinds = _fields(pickled, count)
        if kinds is None:
            return None
        batch = [self._batches.tensor(len(at), dtype, shape) for dtype, shape in kinds]
        views = list(zip(*(t.unbind(0) for t in batch))) if batch else [()] * len(at)  # each row's fields
        try:  # each tensor a pickle makes is its row of the batch (``_tensor``), its bytes read in below
            items = [pickle.loads(pickled, buffers=views[0])]
            if layout is None:
                layout = self._layout = _Layout.of(items[0], views[0], kinds, self.length,
                                                   bytes(files.data[first:first + head + length]),
                                                   _buffer_starts(head + length, sizes)[0])
                if layout is not None and layout.fits(data, at, offsets):  # a tensor alone, and so is every other
                    return layout.read(files, at, self._batches)
            for view, start, size in zip(views[1:], (offsets[1:] + head).tolist(), lengths[1:].tolist()):
                items.append(pickle.loads(bytes(files.data[start:start + size]), buffers=view))
        except Exception:  # not alike the first (a field of another shape; a NumPy array's buffer): one by one
            return None
        starts = [offsets + start for start in _buffer_starts(head + lengths, sizes)]
        for tensor, start in zip(batch, starts):
            files.gather(start, tensor)
        if layout is not None:
            layout.learn(at, items, views, kinds, starts)
        return items

    def map_in_stored(self) -> None:
        """Map the records stored since the last call - by any process, since this one opened the store - into this
        process's page tables now (``_Files.map_in``): the training process, which reads the store where it loads in
        the main process, calls it while the store fills, so that its first epoch reading the records loader workers
        or ``apply.backfill`` stored takes no page fault on each of their pages (reading 600 MB a 4.8 MB batch at a
        time took 0.65 ms a batch from pages not mapped, 0.18 ms once mapped; mapping them took 54 ms in all). Its
        own records are mapped as it stores them (``put``). Only for a store held in memory: on a disk store larger
        than the memory, mapping in would read back from the disk what the page cache let go."""
        files = self._open()
        end = files.index[_END]  # (claimed: a record being written is mapped too - the same pages as the file's)
        if end > self._mapped_to:
            files.map_in(self._mapped_to, end - self._mapped_to)
            self._mapped_to = end

    def has(self, position: int) -> bool:
        return self._open().index[_HEADER + 2 * position + 1] > 0

    def taken(self, position: int) -> bool:
        """Stored, or being stored by some process."""
        return _taken(self._open().index, _HEADER + 2 * position)

    def missing(self) -> list[int]:
        """The positions not stored (yet, or ever: the budget may be spent)."""
        lengths = self._open().arrays()[0][_HEADER + 1::2]
        return [int(p) for p in np.flatnonzero(lengths == 0)]

    def put(self, position: int, value: bytes, started_ns: int) -> bool:
        """Store ``value`` for ``position`` (made on a miss, counted in this store's slot); False when the budget has
        no room for it, or the file system under the store none before the budget is spent (counted as not stored:
        nothing is published of a record written in part), or another process stored it meanwhile or is storing it
        (``taken``: each position's bytes are written once, and counted once). The CPU time of this thread from
        ``started_ns`` (``time.thread_time_ns()`` before the sample was encoded) to its bytes being written is added
        to the fill cost."""
        files = self._open()
        index, lock_fd = files.index, files.lock_fd
        slot = _HEADER + 2 * position
        with _locked(lock_fd):
            index[_MADE + self.slot] += 1
            if _taken(index, slot):
                return False
            offset = index[_END]
            if offset + len(value) > self.budget_bytes or not value:
                index[_UNSTORED] += 1
                return False
            index[_END], index[slot] = offset + len(value), -os.getpid()  # claimed
        try:
            written = os.pwrite(files.data_fd, value, offset)
        except OSError as error:
            written = 0
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                self._unclaim(slot, full=False)
                raise
        if written != len(value):  # the file system filled up before the budget: as if the budget were spent
            self._unclaim(slot, full=True)
            return False
        index[slot] = offset
        index[slot + 1] = len(value)  # published last: a reader sees the position absent or whole
        if self._alive is not None and self._alive[0] == os.getpid():  # the training process, which reads it again
            files.map_in(offset, len(value))  # now, not in a training step: the pages' first read faults each one
        spent = time.thread_time_ns() - started_ns
        with _locked(lock_fd):
            index[_FILL_NS] += spent
            index[_STORED] += 1
        return True

    def _unclaim(self, slot: int, *, full: bool) -> None:
        """The position at ``slot`` was not written after all: free for another process to store (``full``: counted
        as not stored)."""
        files = self._open()
        with _locked(files.lock_fd):
            files.index[slot] = 0
            files.index[_UNSTORED] += int(full)

    def note_unstored(self) -> None:
        """A miss this slot's process made and did not offer (it saw the budget spent): counted, not stored."""
        files = self._open()
        with _locked(files.lock_fd):
            files.index[_MADE + self.slot] += 1
            files.index[_UNSTORED] += 1

    def stats(self) -> StoreStats:
        index = self._open().index
        return StoreStats(stored=index[_STORED], length=self.length, bytes_used=index[_END],
                          budget_bytes=self.budget_bytes, fill_s=index[_FILL_NS] / 1e9, unstored=index[_UNSTORED],
                          made=index[_MADE + self.slot])

    def close(self) -> None:
        if self._pid == os.getpid() and self._files is not None:
            self._files.close()
        if self._alive is not None and self._alive[0] == os.getpid():  # a forked copy leaves it to its owner
            os.close(self._alive[1])
            self._alive = None
        self._files, self._pid = None, None
        self._batches.clear()

    def remove(self) -> None:
        """Close and delete the store's files."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def sweep(root: Path, *, older_than_s: float = 60.0) -> list[Path]:
    """Remove the stores under ``root`` that no process holds (their process died before removing them: killed, say)
    and that are older than ``older_than_s`` (one being made has no holder yet); the removed ones."""
    removed = []
    for directory in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            if time.time() - directory.stat().st_mtime < older_than_s:
                continue
            fd = os.open(directory / "alive", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while any process holds the store
            finally:
                os.close(fd)
        except OSError:
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


@contextlib.contextmanager
def _locked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


# -- the samples' bytes -----------------------------------------------------------------------------------------
def _tensor(dtype: str, shape: tuple[int, ...], raw: Any, cls: type = torch.Tensor,
            attrs: dict[str, Any] | None = None) -> torch.Tensor:
    """``raw``: the tensor's bytes - a writable view into the record ``decode`` was given (the tensor then shares its
    memory: no copy), or read-only bytes (copied: a tensor the user's code may write to) - or, for a batch read
    straight from the store (``SampleStore.get_rows``), the tensor itself: a row of the batch, its bytes read in."""
    if isinstance(raw, torch.Tensor):
        if cls is not torch.Tensor or raw.dtype != getattr(torch, dtype) or raw.shape != shape:
            raise ValueError(f"a {cls.__name__} {dtype} {shape} does not fit the batch's row")
        return raw
    if isinstance(raw, _Probe):
        return raw.take(dtype, shape, cls)
    view = memoryview(raw)
    if view.nbytes == 0:
        return _subclass(torch.empty(0, dtype=getattr(torch, dtype)).reshape(shape), cls, attrs)
    flat = torch.frombuffer(view if not view.readonly else bytearray(view), dtype=getattr(torch, dtype))
    return _subclass(flat.reshape(shape), cls, attrs)


def _taken(index: Any, slot: int) -> bool:
    """The position at ``slot`` is stored (its length published) or claimed: while a process writes its bytes, the
    position's offset is minus that process's id, and another process making the same sample meanwhile stores nothing.
    A claim whose process is gone (killed mid-write: a worker of a trial that hung, say) is void - its reserved
    bytes stay unused, and the next process to make the sample stores it."""
    return index[slot + 1] > 0 or (index[slot] < 0 and _running(-index[slot]))


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # sends nothing: raises when no process has the id
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def _contained(item: Any) -> list[Any] | None:
    """The values of a tuple, list or dict (in order), or None for any other item."""
    if type(item) is dict:
        return list(item.values())
    return list(item) if type(item) in (tuple, list) else None


@dataclass
class _Layout:
    """How the records of whole items alike lie, learnt as ``SampleStore.get_rows`` reads them: an item that is a
    tensor alone (``container`` None), or a tuple, list or dict of tensors and numbers - ``int`` (within int64) and
    ``float``, collated as torch's default collate makes them: an int64 tensor, a float64 one. ``seen``: which
    positions' records are learnt. A position's bytes are written once, where they stay, so each record is learnt
    once: where each of its tensors' bytes start in the data file (``starts``, a column a tensor field) and its
    numbers (``numbers``, an array a number field). A batch of positions all learnt is then read with one lookup and
    one gather a field.

    A record that is a tensor alone is learnt without unpickling it: it begins with ``head`` (frame, buffer size,
    pickle), compared once, and its tensor's bytes start ``start`` bytes in. Any other is learnt from its item, once
    unpickled; one not alike (another container, other keys, a number of another type, a tensor that is not its
    row of the batch) is not learnt, and a batch with it is read as before."""

    kinds: list[tuple[torch.dtype, tuple[int, ...]]]  # each tensor field's dtype and shape, in the pickle's order
    fields: list[int]  # each of the item's values, in order: tensor field k (k >= 0) or number field ~k
    container: type | None  # tuple, list or dict; None: the item is its tensor
    keys: tuple[Any, ...]  # a dict's keys, in order
    numbers: list[np.ndarray]  # a number field's value at each position
    seen: np.ndarray  # a flag per position of the store
    starts: np.ndarray  # (positions, tensor fields): where each tensor's bytes start in the data file
    head: bytes = b""  # a record that is a tensor alone: the bytes it begins with
    start: int = 0  # ... and where its tensor's bytes start within it

    @classmethod
    def of(cls, item: Any, rows: Sequence[torch.Tensor], kinds: list[tuple[torch.dtype, tuple[int, ...]]],
           length: int, head: bytes, start: int) -> _Layout | None:
        """The layout of records like ``item``'s (its tensors ``rows``, of ``kinds``), in a store of ``length``
        positions - ``head`` and ``start`` as its record has them - or None if it is not such an item."""
        if len(rows) == 1 and item is rows[0]:
            return cls(kinds, [0], None, (), [], *cls._unseen(length, kinds), head, start)
        values = _contained(item)
        if values is None:
            return None
        fields: list[int] = []
        numbers: list[type] = []
        tensors = 0
        for value in values:
            if tensors < len(rows) and value is rows[tensors]:
                fields.append(tensors)
                tensors += 1
            elif type(value) in (int, float):
                fields.append(~len(numbers))
                numbers.append(type(value))
            else:
                return None
        if not rows or tensors != len(rows):  # (an item of numbers alone: nothing to gather)
            return None
        columns = [np.zeros(length, dtype=np.int64 if kind is int else np.float64) for kind in numbers]
        return cls(kinds, fields, type(item), tuple(item) if type(item) is dict else (), columns,
                   *cls._unseen(length, kinds))

    @staticmethod
    def _unseen(length: int, kinds: list[Any]) -> tuple[np.ndarray, np.ndarray]:
        """``seen`` and ``starts`` of a store of ``length`` positions whose records are not learnt yet."""
        return np.zeros(length, dtype=bool), np.zeros((length, len(kinds)), dtype=np.int64)

    def fits(self, data: np.ndarray, positions: np.ndarray, offsets: np.ndarray) -> bool:
        """Every record at ``offsets`` (those of ``positions``) is learnt - records that are a tensor alone by
        beginning with ``head``: such a tensor, pickled alike."""
        new = ~self.seen[positions]
        if not new.any():
            return True
        if self.container is not None:
            return False
        span, fresh = len(self.head), offsets[new]
        if int(fresh.max()) + span > len(data):
            return False
        if not (data[fresh[:, None] + np.arange(span)] == np.frombuffer(self.head, np.uint8)).all():
            return False
        self.seen[positions[new]] = True
        self.starts[positions[new], 0] = fresh + self.start
        return True

    def learn(self, positions: np.ndarray, items: Sequence[Any], rows: Sequence[Sequence[torch.Tensor]],
              kinds: list[tuple[torch.dtype, tuple[int, ...]]], starts: Sequence[np.ndarray]) -> None:
        """Learn the records of ``items`` (read at ``positions``, their tensors ``rows`` of ``kinds``, whose bytes
        start at ``starts``, an array a tensor field) that are alike: their numbers and where their tensors lie."""
        if kinds != self.kinds:  # tensors of another dtype or shape: never read as these
            return
        for r, (position, item) in enumerate(zip(positions.tolist(), items)):
            values = self._values(item)
            if values is None or len(values) != len(self.fields):
                continue
            if any(value is not rows[r][f] for value, f in zip(values, self.fields) if f >= 0):
                continue
            numbers = [(~f, value) for value, f in zip(values, self.fields) if f < 0]
            if not all(self._fits(k, value) for k, value in numbers):
                continue
            for k, value in numbers:
                self.numbers[k][position] = value
            self.starts[position] = [start[r] for start in starts]
            self.seen[position] = True

    def _fits(self, k: int, value: Any) -> bool:
        """``value`` is a number of field ``k``'s type - an int within int64 (past it, torch's collate fails too, as
        it should), or a float."""
        if self.numbers[k].dtype == np.int64:
            return type(value) is int and -(2**63) <= value < 2**63
        return type(value) is float

    def _values(self, item: Any) -> list[Any] | None:
        """``item``'s values in order, where it is in this layout's container (a dict with its keys), else None."""
        if self.container is None:
            return [item]
        kind: type = type(item)
        if kind is not self.container or (kind is dict and tuple(item) != self.keys):
            return None
        return _contained(item)

    def read(self, files: _Files, positions: np.ndarray, batches: _dataloader.BatchBuffers) -> Sequence[Any]:
        """The items at ``positions``, all learnt: each tensor field gathered into one batch tensor, each number
        field picked - ``Collated`` with the batch as torch's default collate makes it of them."""
        tensors = [batches.tensor(len(positions), dtype, shape) for dtype, shape in self.kinds]
        for k, tensor in enumerate(tensors):
            files.gather(self.starts[positions, k], tensor)
        if self.container is None:
            return _dataloader.Collated(lambda: tensors[0].unbind(0), tensors[0], len(positions))
        numbers = [column[positions] for column in self.numbers]  # (new arrays: the batch's tensors are made over them)
        values = [tensors[f] if f >= 0 else torch.from_numpy(numbers[~f]) for f in self.fields]
        batch = dict(zip(self.keys, values)) if self.container is dict else values  # (a tuple's batch: a list)
        return _dataloader.Collated(lambda: self._items(tensors, numbers), batch, len(positions))

    def _items(self, tensors: list[torch.Tensor], numbers: list[np.ndarray]) -> list[Any]:
        """The items of a batch read by ``read``: each tensor a row of its field's batch tensor."""
        rows, values = [t.unbind(0) for t in tensors], [n.tolist() for n in numbers]
        items = [[rows[f][r] if f >= 0 else values[~f][r] for f in self.fields] for r in range(len(rows[0]))]
        if self.container is dict:
            return [dict(zip(self.keys, item)) for item in items]
        return items if self.container is list else [tuple(item) for item in items]


class _Probe:
    """``_tensor``'s buffer when reading an item's fields: it notes the tensor's dtype and shape, if a plain one."""

    def __init__(self) -> None:
        self.kind: tuple[torch.dtype, tuple[int, ...]] | None = None

    def take(self, dtype: str, shape: tuple[int, ...], cls: type) -> torch.Tensor:
        self.kind = (getattr(torch, dtype), tuple(shape)) if cls is torch.Tensor else None
        return torch.empty(0)


def _fields(payload: bytes | memoryview, count: int) -> list[tuple[torch.dtype, tuple[int, ...]]] | None:
    """The dtype and shape of each tensor the item ``payload`` pickles holds out of band, in order; None unless every
    out-of-band buffer is a plain tensor's."""
    probes = [_Probe() for _ in range(count)]
    try:
        pickle.loads(payload, buffers=probes)
    except Exception:  # a buffer of something else (a NumPy array's, say): read item by item
        return None
    kinds = [p.kind for p in probes if p.kind is not None]
    return kinds if len(kinds) == count else None


def _subclass(tensor: torch.Tensor, cls: type, attrs: dict[str, Any] | None) -> torch.Tensor:
    if cls is not torch.Tensor:  # a subclass (torchvision's Image, Mask, BoundingBoxes...), with its attributes
        tensor = tensor.as_subclass(cls)
        tensor.__dict__.update(attrs or {})
    return tensor


def _image(mode: str, size: tuple[int, int], raw: Any, info: dict[Any, Any]) -> Any:
    """A PIL image of ``mode`` and ``size`` with the pixels ``raw`` (copied: PIL keeps them in its own layout) and
    ``info``, as PIL's own unpickling makes it."""
    from PIL import Image

    image = Image.frombytes(mode, size, raw)
    image.info = info
    return image


def _image_array(mode: str, size: tuple[int, int], raw: Any, info: dict[Any, Any]) -> np.ndarray | None:
    """``_image``'s pixels as a height x width x 3 uint8 array over ``raw`` (no copy), for an RGB image; else None."""
    return np.frombuffer(raw, dtype=np.uint8).reshape(size[1], size[0], 3) if mode == "RGB" else None


#: PIL image modes whose pixels ``Image.tobytes`` gives in full (no palette): stored as raw bytes, out of band.
_RAW_MODES = frozenset({"RGB", "L", "RGBA"})


class _Pickler(pickle.Pickler):
    """Plain pickle, except that a dense CPU tensor (of a subclass too) is stored as its dtype, shape and raw bytes
    (and its class and attributes): torch's own pickling writes a small archive per tensor, several times slower
    for a sample, and not the same bytes twice. A plain PIL image of mode RGB, L or RGBA is stored as its mode, size,
    info and raw pixels - out of band, so that DALI can be fed them straight from the store (``image_array``)."""

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.layout is torch.strided and obj.device.type == "cpu"
                and not obj.requires_grad and not obj.is_quantized):
            plain = obj.as_subclass(torch.Tensor) if type(obj) is not torch.Tensor else obj
            flat = plain.detach().contiguous().reshape(-1)
            extra = (type(obj), dict(obj.__dict__)) if type(obj) is not torch.Tensor else ()
            raw = pickle.PickleBuffer(flat.view(torch.uint8).numpy().data) if flat.numel() else b""
            return _tensor, (str(flat.dtype).removeprefix("torch."), tuple(obj.shape), raw, *extra)
        pil = sys.modules.get("PIL.Image")
        if pil is not None and type(obj) is pil.Image and obj.mode in _RAW_MODES:
            return _image, (obj.mode, obj.size, pickle.PickleBuffer(obj.tobytes()), dict(obj.info))
        return NotImplemented


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles a record's PIL image as its pixels' array (``_image_array``)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_image":
            return _image_array
        return super().find_class(module, name)


#: A record: this frame (how many out-of-band buffers, the pickle's length), each buffer's length, the pickle, then
#: the buffers - each at an offset that is a multiple of _ALIGN from the record's start.
_FRAME = struct.Struct("<II")
_ALIGN = 64


def _buffer_starts(at: Any, sizes: Sequence[int]) -> list[Any]:
    """Where each out-of-band buffer of a record starts, from the end of its pickle (``at``: an int, or an array of
    them - one per record of a batch)."""
    starts = []
    for size in sizes:
        at = at + -at % _ALIGN
        starts.append(at)
        at = at + size
    return starts


def encode(obj: Any) -> bytes:
    """A sample as bytes: what ``decode`` turns back into an equal object (tensors bit for bit; a PIL image as its
    mode, size and pixels). Tensors' (and NumPy arrays') bytes are kept out of the pickle, so that ``decode`` can
    lend them the record's own memory instead of copying them twice (pickle's bytes, then a writable copy)."""
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    payload, raws = stream.getvalue(), [b.raw() for b in buffers]
    record = bytearray(_FRAME.pack(len(raws), len(payload)))
    record += struct.pack(f"<{len(raws)}Q", *(r.nbytes for r in raws)) + payload
    for raw in raws:
        record += bytes(-len(record) % _ALIGN)
        record += raw
    return bytes(record)


def image_array(record: bytes | bytearray | memoryview) -> np.ndarray | None:
    """The RGB image a record holds (as ``encode`` stores a PIL image) as a height x width x 3 uint8 array over the
    record's own bytes - no copy: read-only where the record is, and valid as long as it is; None when the record
    holds something else (another mode, a tensor, an image stored by PIL's own pickling)."""
    view = memoryview(record)
    count, length = _FRAME.unpack_from(view)
    if count != 1:
        return None
    (size,) = struct.unpack_from("<Q", view, _FRAME.size)
    at = _FRAME.size + 8
    buffer = view[_buffer_starts(at + length, [size])[0]:][:size]
    try:
        image = _ArrayUnpickler(io.BytesIO(view[at:at + length]), buffers=[buffer]).load()
    except Exception:  # a buffer of something else (a tensor's, an array's): not an image
        return None
    return image if isinstance(image, np.ndarray) else None


def decode(record: bytes | bytearray | memoryview) -> Any:
    """The object ``encode`` made ``record`` from. A writable record (``SampleStore.get``'s) is lent to the tensors
    and arrays made: they share its memory - each read is a buffer of its own - and nothing is copied again (a
    read-only one is copied once, so that what is made is writable, as the user's own items are)."""
    view = memoryview(record if isinstance(record, bytearray) else bytearray(record))
    count, length = _FRAME.unpack_from(view)
    sizes = struct.unpack_from(f"<{count}Q", view, _FRAME.size)
    at = _FRAME.size + 8 * count
    payload = view[at:at + length]
    buffers = [view[start:start + size] for start, size in zip(_buffer_starts(at + length, sizes), sizes)]
    return pickle.loads(payload, buffers=buffers)
