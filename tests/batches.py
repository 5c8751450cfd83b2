"""Batches of every shape a collate_fn produces, built from sample ids, for the batch-walker, re-cut and handover
tests (module level, so DataLoader worker processes can pickle ``ShapedCollate``)."""

import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple

import torch

Pair = namedtuple("Pair", "x y")


class Encoding(UserDict):
    """Like Hugging Face's ``BatchEncoding``: a ``UserDict`` with attributes of its own."""

    def __init__(self, data=None, note="tok"):
        super().__init__(data)
        self.note = note


@dataclasses.dataclass
class Example:
    x: torch.Tensor
    ids: list
    split: str = "train"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


def ids_of(batch):
    """The sample ids a batch carries, read from its structure (every shape here stores them in a tensor x)."""
    return [int(i) for i in _ids(batch)]


def _ids(batch):
    if isinstance(batch, torch.Tensor):
        return batch if batch.dim() == 1 else batch[:, 0]
    if isinstance(batch, (tuple, list)):
        return _ids(batch[0])
    if isinstance(batch, (dict, UserDict)):
        return _ids(batch["x"])
    return _ids(batch.x)


def make(kind, ids):
    t = torch.tensor(ids, dtype=torch.float32)
    x = torch.stack([t, t * 10], dim=1)  # sample i: [i, 10 i]
    names = [f"s{i}" for i in ids]
    return {
        "tensor": lambda: x,
        "tuple": lambda: (x, t.long()),
        "list": lambda: [x, t.long()],
        "namedtuple": lambda: Pair(x, t.long()),
        "dict": lambda: {"x": x, "y": t.long(), "tag": "shared"},
        "ordereddict": lambda: OrderedDict(x=x, names=names),
        "defaultdict": lambda: defaultdict(list, x=x, names=names),
        "userdict": lambda: Encoding({"x": x, "attention_mask": torch.ones(len(ids), 3)}),
        "dataclass": lambda: Example(x, names),
        "frozen": lambda: Frozen(x),
        "nested": lambda: ({"x": x, "meta": {"names": names, "n": Pair(t.long(), t.long())}}, [names, t.long()]),
    }[kind]()


KINDS = ["tensor", "tuple", "list", "namedtuple", "dict", "ordereddict", "defaultdict", "userdict", "dataclass",
         "frozen", "nested"]


class ShapedCollate:
    """A ``collate_fn`` that turns samples ``tensor([i])`` into a batch of the shape ``kind``."""

    def __init__(self, kind):
        self.kind = kind

    def __call__(self, samples):
        return make(self.kind, [int(s) for s in samples])
