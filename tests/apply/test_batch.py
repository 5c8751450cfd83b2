"""Re-cutting a loader's batches into another micro-batch keeps every sample once, in order, for every batch shape;
the re-cut loader tells Lightning its true length and lets it set the sampler's epoch."""

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from pipeopt.apply.batch import Recut, RecutLoader, recut_length
from tests.apply.datasets import Indexed
from tests.batches import KINDS, ShapedCollate, ids_of


def _loader(n=44, size=4, drop_last=False, **kwargs):
    data = TensorDataset(torch.arange(float(n)), torch.arange(n))
    return DataLoader(data, batch_size=size, shuffle=True, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(5), **kwargs)


@pytest.mark.parametrize(("n", "size", "drop_last"), [(100, 8, False), (100, 8, True), (96, 8, False), (13, 4, False)])
@pytest.mark.parametrize("micro", [1, 2, 4, 16, 24])
def test_a_recut_loader_yields_the_same_samples_in_the_same_order_and_says_how_many_batches(n, size, drop_last,
                                                                                          micro):
    if micro > size and micro % size:
        return  # not a plan: folds join whole batches only
    user = [i for b in _loader(n, size, drop_last) for i in b[1].tolist()]
    recut = [b[1].tolist() for b in RecutLoader(_loader(n, size, drop_last), micro)]
    assert [i for b in recut for i in b] == user
    assert all(len(b) <= micro for b in recut) and all(len(b) == micro for b in recut[:-1])
    assert len(RecutLoader(_loader(n, size, drop_last), micro)) == recut_length(_loader(n, size, drop_last), micro)
    assert len(recut) == recut_length(_loader(n, size, drop_last), micro)


def test_a_recut_loader_reads_through_to_the_loader_lightning_sets_the_epoch_on():
    data = TensorDataset(torch.arange(20.0))
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    recut = RecutLoader(loader, 2)
    assert recut.sampler is sampler and recut.batch_sampler is loader.batch_sampler and recut.batch_size == 2
    recut._iterator = "kept"  # where a loader with persistent workers keeps its iterator: in the loader
    assert loader._iterator == "kept"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("micro", [2, 3, 8])
def test_a_recut_epoch_sees_every_sample_once_in_order_for_every_batch_shape(kind, micro):
    def user():
        return DataLoader(Indexed(44), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                          collate_fn=ShapedCollate(kind))

    expected = [i for b in user() for i in ids_of(b)]
    recut = [ids_of(b) for b in Recut(iter(user()), 4, micro)]
    assert [i for b in recut for i in b] == expected  # every sample once, in the user's order
    assert all(len(b) == micro for b in recut[:-1]) if micro != 3 else all(len(b) in (1, 3) for b in recut)


def test_a_recut_gives_back_its_iterator_only_between_whole_batches():
    recut = Recut(iter(_loader()), 4, 2)
    next(recut)
    with pytest.raises(RuntimeError, match="half trained"):
        recut.unwrap()
    next(recut)
    inner = recut.unwrap()
    assert [i for b in inner for i in b[1].tolist()] == [i for b in _loader() for i in b[1].tolist()][4:]
