"""pipeopt imports only the Lightning a program uses: a `lightning.pytorch` program never gets `pytorch_lightning`
imported (nor the reverse), so Lightning's own messages stay on the logger the user configured. Each case runs in a
fresh interpreter: this test session has both namespaces imported."""

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl

from pipeopt import PipeOpt

ROOT = Path(__file__).resolve().parents[2]

FIT = '''
import logging
import sys

{imports}
import torch
from torch.utils.data import DataLoader, TensorDataset

messages = []


class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())


logging.getLogger("{namespace}.utilities.rank_zero").addHandler(Keep())


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


callbacks = {callbacks}
trainer = L.Trainer(max_steps=8, callbacks=callbacks, accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4))
(callback,) = [c for c in trainer.callbacks if type(c).__name__ == "PipeOpt"]
print("other namespace imported:", "{other}" in sys.modules)
print("Callback base:", [c.__module__ for c in type(callback).__mro__ if c.__name__ == "Callback"])
print("Lightning's stop message on its logger:", any("`Trainer.fit` stopped" in m for m in messages))
print("measured:", callback.report is not None)
'''

NAMESPACES = {
    "lightning.pytorch": ("import lightning.pytorch as L", "pytorch_lightning"),
    "pytorch_lightning": ("import pytorch_lightning as L", "lightning.pytorch"),
}


def run_fit(tmp_path, namespace, *, pipeopt_first, cli=False):
    import_lightning, other = NAMESPACES[namespace]
    import_pipeopt = "from pipeopt import PipeOpt"
    imports = "\n".join([import_pipeopt, import_lightning] if pipeopt_first else [import_lightning, import_pipeopt])
    if cli:  # `pipeopt tune` attaches the PipeOpt; the script imports only its Lightning
        imports = import_lightning
    callbacks = "[]" if cli else "[PipeOpt(tune=(), window=3, warmup=1, report_dir=None, cache=False)]"
    script = tmp_path / "fit.py"
    script.write_text(FIT.format(imports=imports, namespace=namespace, other=other, callbacks=callbacks))
    command = [sys.executable, "-m", "pipeopt", "tune", str(script), "--only", "none", "--no-cache", "--full",
               "--report-dir", str(tmp_path / "reports")] if cli else [sys.executable, str(script)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.parametrize("namespace", list(NAMESPACES))
@pytest.mark.parametrize("pipeopt_first", [False, True], ids=["lightning-first", "pipeopt-first"])
def test_only_the_programs_lightning_is_imported(tmp_path, namespace, pipeopt_first):
    out = run_fit(tmp_path, namespace, pipeopt_first=pipeopt_first)
    assert "other namespace imported: False" in out
    assert f"Callback base: ['{namespace}.callbacks.callback']" in out
    assert "Lightning's stop message on its logger: True" in out
    assert "measured: True" in out


@pytest.mark.parametrize("namespace", list(NAMESPACES))
def test_pipeopt_tune_attaches_to_the_scripts_lightning_only(tmp_path, namespace):
    out = run_fit(tmp_path, namespace, pipeopt_first=False, cli=True)
    assert "other namespace imported: False" in out
    assert "Lightning's stop message on its logger: True" in out
    assert "measured: True" in out


def test_a_pipeopt_is_a_callback_of_the_lightning_in_use_and_survives_pickling():
    import io

    from rich.console import Console

    callback = PipeOpt(tune=(), report_dir=None, cache=False, console=Console(file=io.StringIO()))  # it has a lock
    assert isinstance(callback, PipeOpt) and isinstance(callback, pl.Callback)
    for copied in (copy.deepcopy(callback), pickle.loads(pickle.dumps(callback))):  # ddp_spawn pickles callbacks
        assert type(copied) is type(callback) and copied.config == callback.config


def test_a_subclass_of_pipeopt_is_a_callback_too():
    class Mine(PipeOpt):
        pass

    mine = Mine(tune=(), report_dir=None)
    assert isinstance(mine, Mine) and isinstance(mine, pl.Callback) and type(mine).__name__ == "Mine"
