"""Rebatching keeps every index in order; probes survive an out-of-memory error and leave no trace."""

import pytest
import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from pipeopt.apply.batch import DeviceMemory, Rebatch, is_oom, plan_step, probe_plans
from pipeopt.tuning.batch import BatchPlan
from tests.batches import KINDS, ShapedCollate, ids_of


@pytest.mark.parametrize("n, size, drop_last", [(100, 8, False), (100, 8, True), (96, 8, False), (13, 4, False)])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 16, 24])
def test_rebatch_yields_the_same_indices_in_the_same_order(n, size, drop_last, micro):
    inner = BatchSampler(SequentialSampler(range(n)), size, drop_last)
    if micro > size and micro % size:
        return  # not a plan: merges fold whole batches only
    batches = list(Rebatch(inner, micro))
    assert [i for b in batches for i in b] == [i for b in inner for i in b]
    assert len(Rebatch(inner, micro)) == len(batches)
    assert all(len(b) <= micro for b in batches)


def test_rebatch_forwards_the_sampler_lightning_sets_the_epoch_on():
    sampler = RandomSampler(range(10))
    assert Rebatch(BatchSampler(sampler, 4, False), 2).sampler is sampler


class _Trainer:
    """What ``probe_plans`` reads of a trainer."""

    def __init__(self, module, optimizer):
        self.optimizers = [optimizer]
        self.strategy = type("S", (), {"root_device": torch.device("cpu")})()


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return (self.lin(x).squeeze(-1) - y).pow(2).mean()


class _OomAbove(DeviceMemory):
    def __init__(self, limit, error=None):
        self.limit, self.error = limit, error

    def peak(self, plan, run, device):
        if plan.micro > self.limit:
            raise self.error or torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        run()
        return plan.micro * 100


def _setup():
    torch.manual_seed(0)
    net = _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    batch = (torch.randn(16, 4), torch.randn(16))
    return net, optimizer, batch


def test_an_out_of_memory_probe_backs_off_without_crashing_and_leaves_no_trace():
    net, optimizer, batch = _setup()
    weights = {k: v.clone() for k, v in net.state_dict().items()}
    probes = probe_plans(_Trainer(net, optimizer), net, batch, BatchPlan(16, 1), memory=_OomAbove(4))
    by_micro = {p.plan.micro: p for p in probes}
    assert by_micro[16].oom and by_micro[8].oom and by_micro[16].rate is None
    assert not by_micro[4].oom and by_micro[4].peak_bytes == 400 and by_micro[4].rate.value > 0
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in weights.items())
    assert optimizer.state_dict()["state"] == {}  # the probes' optimizer steps were undone


def test_only_out_of_memory_is_caught():
    net, optimizer, batch = _setup()
    with pytest.raises(ValueError, match="not memory"):
        probe_plans(_Trainer(net, optimizer), net, batch, BatchPlan(16, 1), memory=_OomAbove(4, ValueError("not memory")))
    assert is_oom(RuntimeError("CUDA error: out of memory")) and not is_oom(RuntimeError("shape mismatch"))


def test_a_plan_step_accumulates_to_the_full_batch_gradient():
    net, optimizer, batch = _setup()
    full = plan_step(net, [], batch, BatchPlan(16, 1))
    full()
    whole = net.lin.weight.grad.clone()
    plan_step(net, [], batch, BatchPlan(4, 4))()
    assert torch.allclose(net.lin.weight.grad, whole, atol=1e-6)


@pytest.mark.parametrize("micro", [2, 3, 8, 16])
def test_the_running_epoch_recut_delivers_what_the_rebatched_loader_would(micro):
    from torch.utils.data import DataLoader, TensorDataset

    from pipeopt.apply.batch import Recut, rebatched

    data = TensorDataset(torch.arange(44.0), torch.arange(44))

    def user():
        return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5))

    if micro > 4 and micro % 4:
        return
    loader = user()
    recut = [b[1].tolist() for b in Recut(iter(loader), loader, 4, micro)]
    expected = [b[1].tolist() for b in rebatched(user(), micro)]
    assert recut == expected
    assert [i for b in recut for i in b] == [i for b in user() for i in b[1].tolist()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("micro", [2, 3, 8])
def test_a_recut_epoch_sees_every_sample_once_in_order_for_every_batch_shape(kind, micro):
    from torch.utils.data import DataLoader

    from pipeopt.apply.batch import Recut
    from tests.apply.datasets import Indexed

    def user():
        return DataLoader(Indexed(44), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                          collate_fn=ShapedCollate(kind))

    expected = [i for b in user() for i in ids_of(b)]
    loader = user()
    recut = [ids_of(b) for b in Recut(iter(loader), loader, 4, micro)]
    assert [i for b in recut for i in b] == expected  # every sample once, in the user's order
    assert all(len(b) == micro for b in recut[:-1]) if micro != 3 else all(len(b) in (1, 3) for b in recut)
