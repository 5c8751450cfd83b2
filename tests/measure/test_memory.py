"""The memory breakdown, counted on the live run, against sizes computed by hand; reading the step's graph changes
nothing the step does."""

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from pipeopt.measure.memory import MemoryBreakdown, count_activations, storage_bytes
from tests.helpers import quiet_pipeopt, quiet_trainer_kwargs

B, IN, HIDDEN, CLASSES = 32, 64, 256, 10
F32 = 4


class Classifier(pl.LightningModule):
    def __init__(self, body: nn.Module, checkpointed: bool = False):
        super().__init__()
        self.body, self.head = body, nn.Linear(HIDDEN, CLASSES)
        self.checkpointed = checkpointed
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        x, y = batch
        h = checkpoint(self.body, x, use_reentrant=False) if self.checkpointed else self.body(x)
        return nn.functional.cross_entropy(self.head(h), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU())


def data(n: int = 8 * B) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)),
                      batch_size=B)


def fit(module: pl.LightningModule, **pipeopt) -> MemoryBreakdown:
    torch.manual_seed(0)
    callback = quiet_pipeopt(tune=(), **pipeopt)
    pl.Trainer(max_epochs=1, callbacks=[callback], **quiet_trainer_kwargs()).fit(module, data())
    assert module.calls == 8  # one training_step per batch: counting called nothing of the user's
    assert callback.report.fit is not None
    return callback.report.fit.memory


def params_of(*shapes: tuple[int, int]) -> int:
    return sum((i * o + o) * F32 for i, o in shapes)


def within(value, expected, share=0.05):
    return value == pytest.approx(expected, rel=share)


def test_mlp_breakdown_matches_hand_computed_sizes():
    memory = fit(Classifier(mlp()))
    params = params_of((IN, HIDDEN), (HIDDEN, CLASSES))
    assert memory.params_bytes == params
    assert memory.grads_bytes == params
    assert within(memory.optimizer_bytes, 2 * params)  # Adam's two moments (and a step count per tensor)
    # saved for backward: the hidden ReLU output (read by the ReLU's and the head's backward: one storage) and the
    # log-softmax output; the input batch and the weights are counted under their own headings
    assert within(memory.activations_bytes, B * HIDDEN * F32 + B * CLASSES * F32)
    assert memory.batch_bytes == B * IN * F32 + B * 8  # inputs and int64 targets
    assert memory.micro_batch == B and memory.precision == "32-true"
    assert memory.hook_packed == 0


def test_batchnorm_and_dropout_activations_are_counted_once_each():
    body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU(), nn.Dropout(0.5))
    memory = fit(Classifier(body))
    # BatchNorm's input and its saved mean and inverse std; the ReLU output; dropout's mask (a float tensor on CPU)
    # and output; the log-softmax output and the loss's weight total (a scalar)
    expected = (B * HIDDEN + 2 * HIDDEN + B * HIDDEN + B * HIDDEN + B * HIDDEN + B * CLASSES + 1) * F32
    assert within(memory.activations_bytes, expected)
    assert memory.saved_tensors >= 8  # the eight above, one storage each (a 0-d index may join them)
    assert memory.params_bytes == params_of((IN, HIDDEN), (HIDDEN, CLASSES)) + 2 * HIDDEN * F32  # BN's affine


def test_checkpointed_activations_are_left_to_the_programs_own_hooks():
    def deep() -> nn.Module:
        return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())

    plain, checkpointed = Classifier(deep()), Classifier(deep(), checkpointed=True)
    checkpointed.load_state_dict(plain.state_dict())
    counted = fit(plain)
    memory = fit(checkpointed)
    assert memory.hook_packed > 0  # held by torch.utils.checkpoint, recomputed in backward: not sized, not unpacked
    # the body's inner ReLU output is not held (recomputed); its last output is, saved by the head outside it
    assert memory.activations_bytes == pytest.approx(counted.activations_bytes - B * HIDDEN * F32, abs=16)
    for a, b in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(a, b)  # reading the graph consumed nothing the recomputation needed


def test_a_training_step_using_torch_func_runs_unchanged():
    # pipeopt installs no saved-tensor hooks around the user's code: torch.func transforms refuse to run under them
    class FuncStep(Classifier):
        def training_step(self, batch, batch_idx):
            x, y = batch
            jac_norm = torch.func.vmap(torch.func.jacrev(lambda v: torch.tanh(v).sum()))(x).pow(2).mean()
            return super().training_step(batch, batch_idx) + 0.0 * jac_norm

    memory = fit(FuncStep(mlp()))
    assert memory.activations_bytes is not None


def test_storages_shared_by_views_count_once_and_excluded_ones_not_at_all():
    base = torch.zeros(10, 10)
    size, seen = storage_bytes([base, base[0], base.t(), torch.zeros(3), "not a tensor"])
    assert size == 100 * F32 + 3 * F32 and len(seen) == 2
    assert storage_bytes([base, base[1]], exclude=frozenset(seen))[0] == 0


def test_counting_leaves_autograds_inplace_check_and_backward_as_they_were():
    x = torch.randn(4, 3, requires_grad=True)
    y = x.exp()
    loss = y.sum()
    count = count_activations(loss, frozenset())
    assert count.bytes == 4 * 3 * F32 and count.tensors == 1  # exp's output
    y.add_(1)  # the user's bug: modifying a tensor backward needs
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
