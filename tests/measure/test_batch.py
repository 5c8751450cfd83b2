"""The batch walker: every batch shape a collate_fn produces is counted, sliced and joined sample by sample."""

import dataclasses
from collections import UserDict

import pytest
import torch

from pipeopt.measure.batch import RaggedBatches, batch_size, concat_batches, slice_batch
from tests.batches import KINDS, Encoding, make


def every_sample_leaf(batch, ids):
    """Every batched leaf of ``batch`` holds exactly the samples ``ids``, in order."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 2 and batch.shape[1] == 2:
            assert batch[:, 0].tolist() == ids and batch[:, 1].tolist() == [10 * i for i in ids]
        elif batch.dim() == 1:
            assert batch.tolist() == ids
        else:
            assert batch.shape[0] == len(ids)
        return
    if isinstance(batch, list) and batch and isinstance(batch[0], str):
        assert batch == [f"s{i}" for i in ids]
        return
    if isinstance(batch, (dict, UserDict)):
        for value in batch.values():
            if not isinstance(value, str):
                every_sample_leaf(value, ids)
        return
    if dataclasses.is_dataclass(batch):
        for field in dataclasses.fields(batch):
            value = getattr(batch, field.name)
            if not isinstance(value, str):
                every_sample_leaf(value, ids)
        return
    for value in batch:
        every_sample_leaf(value, ids)


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_is_counted_sliced_and_joined_in_its_own_structure(kind):
    batch = make(kind, list(range(8)))
    assert batch_size(batch) == 8
    parts = [slice_batch(batch, i, i + 3) for i in range(0, 8, 3)]  # 3 + 3 + 2
    assert [batch_size(p) for p in parts] == [3, 3, 2]
    for start, part in zip(range(0, 8, 3), parts):
        assert type(part) is type(batch)
        every_sample_leaf(part, list(range(start, min(start + 3, 8))))
    joined = concat_batches(parts)
    assert type(joined) is type(batch)
    every_sample_leaf(joined, list(range(8)))


def test_what_belongs_to_the_whole_batch_is_kept_as_it_is():
    part = slice_batch(make("dict", list(range(8))), 2, 4)
    assert part["tag"] == "shared"
    encoding = slice_batch(make("userdict", list(range(8))), 0, 2)
    assert isinstance(encoding, Encoding) and encoding.note == "tok" and encoding["attention_mask"].shape == (2, 3)
    assert slice_batch(make("dataclass", list(range(8))), 0, 2).split == "train"
    assert slice_batch(make("defaultdict", list(range(8))), 0, 2).default_factory is list


def test_ragged_batches_are_sliced_but_never_joined():
    # a padding collate_fn pads each batch to its own longest sample: slices keep the batch's padding
    first, second = torch.zeros(4, 7), torch.zeros(4, 5)
    assert slice_batch({"tokens": first, "lengths": [7, 3, 2, 1]}, 1, 3)["lengths"] == [3, 2]
    assert slice_batch(first, 1, 3).shape == (2, 7)
    with pytest.raises(RaggedBatches, match="cannot be joined"):
        concat_batches([first, second])


def test_a_list_of_ragged_tensors_is_one_value_per_sample():
    samples = [torch.zeros(n) for n in (3, 5, 2, 4)]
    batch = (torch.arange(4), samples)
    part = slice_batch(batch, 1, 3)
    assert part[0].tolist() == [1, 2] and [len(s) for s in part[1]] == [5, 2]
    joined = concat_batches([slice_batch(batch, 0, 2), slice_batch(batch, 2, 4)])
    assert [len(s) for s in joined[1]] == [3, 5, 2, 4]
