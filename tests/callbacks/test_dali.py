"""DALI as a candidate of the loader search, on real Lightning fits over a torchvision ImageFolder (DALI's CPU
backend): the trial happens on the live run, the model sees every image once per epoch in the user's order, and a
DALI failure is discarded like any failed trial."""

import sys
from pathlib import Path

import psutil
import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from tests.dali.images import Classifier, solid_folder, torchvision
from tests.helpers import (
    controlled_rates,
    controlled_wait,
    quiet_pipeopt,
    quiet_trainer_kwargs,
    run_ddp,
    synchronous_backfill,
)

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed (`pip install 'pipeopt[dali]'`; `make test` "
                    "runs these tests in .venv-vision)")

T = torchvision.transforms


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    # 96 images large enough that decoding them in the main process keeps the step waiting (input-bound)
    return solid_folder(tmp_path_factory.mktemp("solid"), per_class=32, scale=8)


def fit(callbacks, root, *, epochs=3, chain=None):
    pl.seed_everything(5, verbose=False)
    model = Classifier()
    dataset = torchvision.datasets.ImageFolder(root, transform=chain or T.Compose([T.Resize((16, 16)), T.ToTensor()]))
    trainer = pl.Trainer(max_epochs=epochs, callbacks=callbacks, **quiet_trainer_kwargs())
    trainer.fit(model, DataLoader(dataset, batch_size=4, shuffle=True))
    return model, trainer


def dali_trials(callback):
    return [t for t in callback.report.trials if t.settings.get("dali")]


def test_dali_is_tried_on_the_live_run_and_the_model_sees_what_it_would_have(images, monkeypatch):
    from pipeopt.dali import DaliLoader

    plain, _ = fit([], images)
    controlled_rates(monkeypatch, lambda s: 1000.0 if s.dali else 100.0)  # a world where DALI must be kept
    controlled_wait(monkeypatch, 0.5)  # and the run is input-bound, however busy the machine is
    callback = quiet_pipeopt(tune=("dali",), window=4)
    tuned, trainer = fit([callback], images)
    (trial, *again) = dali_trials(callback)
    assert trial.status == "ok" and trial.samples_per_s > 0 and trial.settings["dali"] == "cpu"
    assert tuned.seen == plain.seen  # every image once per epoch, in the user's shuffled order
    # single-colour images: DALI's pixels are torchvision's up to float rounding (it multiplies by 1/255 where
    # ToTensor divides by 255: ~1e-8 a pixel), so the weights are the same but for that rounding, carried over 72 steps
    for name, value in plain.state_dict().items():
        assert torch.allclose(value, tuned.state_dict()[name], rtol=0, atol=1e-4), name
    # kept, applied to the running fit, and reported with the code to keep it
    assert {c.knob: c.after for c in callback.report.changes} == {"dali": "cpu"}
    assert isinstance(trainer.train_dataloader, DaliLoader)
    assert callback.report.suggestions == ["pipeopt.dali.loader_from(train_loader, device='cpu')"]
    assert psutil.Process().children() == []


def test_dali_fed_from_the_sample_cache_is_kept_where_fastest_and_sees_every_image_once_per_epoch(
        images, monkeypatch, tmp_path):
    from pipeopt.dali import DaliLoader

    chain = T.Compose([T.Resize((16, 16)), T.RandomHorizontalFlip(), T.ToTensor()])  # decode + resize cached
    plain, _ = fit([], images, epochs=8, chain=chain)
    controlled_rates(monkeypatch, lambda s: (1000.0 if s.cache else 500.0) if s.dali else 300.0 if s.cache else 100.0)
    controlled_wait(monkeypatch, 0.5)
    synchronous_backfill(monkeypatch)
    callback = quiet_pipeopt(tune=("loader", "dali", "cache"), report_dir=tmp_path, cache=False)
    tuned, trainer = fit([callback], images, epochs=8, chain=chain)
    # every image once per epoch; the first epoch in the user's order. From DALI's trial on the flips are DALI's,
    # not drawn from torch's global generator, so the next epochs' shuffles (drawn from it) differ - as with DALI alone
    assert tuned.seen[:96] == plain.seen[:96]
    assert all(sorted(tuned.seen[e * 96:(e + 1) * 96]) == list(range(96)) for e in range(8))
    changes = {c.knob: c.after for c in callback.report.changes}
    assert changes["dali"] == "cpu" and changes["cache"] is True, callback.report.notes
    assert isinstance(trainer.train_dataloader, DaliLoader) and trainer.train_dataloader._images is not None
    cache = callback.report.sample_cache
    assert cache.kept and cache.epochs[-1]["misses"] == 0  # nothing decoded in the last epoch: DALI read the store
    assert any("cache trial: DALI (cpu, reading the sample cache)" == w.label for w in callback.windows)
    assert psutil.Process().children() == []


def test_a_failing_dali_pipeline_is_discarded_and_training_goes_on(images, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no DALI today")

    monkeypatch.setattr("pipeopt.dali.pipeline.build", broken)
    controlled_wait(monkeypatch, 0.5)  # input-bound however busy the machine is: DALI is tried
    plain, _ = fit([], images, epochs=2)
    callback = quiet_pipeopt(tune=("dali",), window=4)
    tuned, _ = fit([callback], images, epochs=2)
    (trial,) = dali_trials(callback)
    assert trial.status == "failed" and "no DALI today" in trial.error
    assert tuned.seen == plain.seen  # the batches fed to the failed pipeline were loaded again, in order
    assert callback.report.changes == []


class DaliAtTheFirstEpochsEnd(pl.Callback):
    """At the first epoch's last batch: pipeopt's switcher switches to DALI, unsettled - a trial the next epoch
    begins on. Its pipeline is built when the next epoch's first batch is fed."""

    def __init__(self, pipeopt):
        self.pipeopt = pipeopt

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == trainer.num_training_batches - 1:
            from pipeopt.tuning.loader_search import LoaderSettings

            self.pipeopt._run.switcher.switch(LoaderSettings(0, None, False, False, dali="cpu"), timeout_s=10)


def test_a_dali_trial_the_next_epoch_begins_on_falls_back_when_its_pipeline_fails(images, monkeypatch):
    """Lightning starts the iterator of an epoch that begins on a DALI trial. Its pipeline failing in the epoch's
    first batch falls back to the settings before the trial, as mid-epoch: every image once, in order, and the
    weights those of a run without pipeopt (no batch came from DALI)."""
    def broken(*args, **kwargs):
        raise RuntimeError("no DALI today")

    monkeypatch.setattr("pipeopt.dali.pipeline.build", broken)
    plain, _ = fit([], images, epochs=2)
    controlled_wait(monkeypatch, 0.01)  # compute-bound: the search ends at once and leaves the switcher to the test
    callback = quiet_pipeopt(tune=("dali",), window=4)
    tuned, trainer = fit([callback, DaliAtTheFirstEpochsEnd(callback)], images, epochs=2)
    assert tuned.seen == plain.seen
    for name, value in plain.state_dict().items():
        assert torch.equal(value, tuned.state_dict()[name]), name
    assert type(trainer.train_dataloader).__name__ != "DaliLoader"  # the settings before the trial, from the failure
    assert psutil.Process().children() == []


def test_without_dali_the_group_is_skipped_with_how_to_install_it(images, monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # `import nvidia.dali` now fails as if not installed
    callback = quiet_pipeopt(tune=("loader", "dali"), window=4)
    with pytest.warns(UserWarning, match="not tuning the dali"):
        fit([callback], images, epochs=1)
    (skipped,) = callback.report.skipped
    assert skipped.group == "dali"
    assert "NVIDIA DALI is not installed" in skipped.reason and "pip install 'pipeopt[dali]'" in skipped.reason
    assert not dali_trials(callback)


DDP_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_dali_fit.py"


def test_under_ddp_every_rank_tries_dali_on_its_own_shard(images, tmp_path):
    plain = run_ddp(DDP_SCRIPT, tmp_path, "plain", str(images))
    tuned = run_ddp(DDP_SCRIPT, tmp_path, "pipeopt", str(images))
    for rank in (0, 1):  # the DistributedSampler Lightning injected: its shard, in its order, epoch after epoch
        assert tuned[rank]["seen"] == plain[rank]["seen"]
    assert any(t.get("dali") == "cpu" for t in tuned[0]["trials"])
    assert tuned[0]["trials"] == tuned[1]["trials"]
    assert tuned[0]["changes"] == tuned[1]["changes"] == [["dali", "cpu"]]  # the script's world: DALI wins
    assert tuned[0]["loader"] == tuned[1]["loader"] == "DaliLoader"  # applied on both ranks


def test_loader_from_under_ddp_shards_itself_once_per_epoch(images, tmp_path):
    ranks = run_ddp(DDP_SCRIPT, tmp_path, "loader_from", str(images))
    per_epoch = 96 // 2  # 96 images, two ranks
    for epoch in range(2):
        parts = [r["seen"][epoch * per_epoch:(epoch + 1) * per_epoch] for r in ranks]
        assert sorted(parts[0] + parts[1]) == list(range(96))  # disjoint shards covering every image once
    assert ranks[0]["seen"][:per_epoch] != ranks[0]["seen"][per_epoch:]  # set_epoch reshuffled the shard


def test_a_run_resumed_with_dali_kept_uses_it_at_once(images):
    from pipeopt.dali import DaliLoader
    from pipeopt.tuning.loader_search import LoaderSettings

    plain, _ = fit([], images, epochs=2)
    callback = quiet_pipeopt(tune=("dali",), window=4)
    # what a checkpoint of a run that kept DALI holds (``PipeOpt.state_dict()``)
    callback.load_state_dict({"version": 1, "tuned": {"loader": LoaderSettings.dali_on("cpu").as_kwargs()}})
    resumed, trainer = fit([callback], images, epochs=2)
    assert resumed.seen == plain.seen
    assert isinstance(trainer.train_dataloader, DaliLoader)
    assert [(c.knob, c.after) for c in callback.report.changes] == [("dali", "cpu")]
    assert not callback.report.trials  # no trials: applied from the checkpoint


@pytest.mark.parametrize("tune", [("loader", "dali", "cache"), ("loader", "cache")])
def test_a_run_resumed_with_dali_fed_from_the_cache_uses_it_at_once_where_dali_is_tuned(images, tune, tmp_path):
    import dataclasses

    from pipeopt.dali import DaliLoader
    from pipeopt.tuning.loader_search import LoaderSettings

    chain = T.Compose([T.Resize((16, 16)), T.RandomHorizontalFlip(), T.ToTensor()])
    dali = LoaderSettings.dali_on("cpu")
    callback = quiet_pipeopt(tune=tune, report_dir=tmp_path, cache=False)
    # what a checkpoint of a run that kept DALI fed from the store holds (``PipeOpt.state_dict()``)
    callback.load_state_dict({"version": 1, "tuned": {"loader": dali.as_kwargs(),
                                                      "cache": dataclasses.replace(dali, cache=True).as_kwargs()}})
    resumed, trainer = fit([callback], images, epochs=2, chain=chain)
    assert all(sorted(resumed.seen[e * 96:(e + 1) * 96]) == list(range(96)) for e in range(2))
    if "dali" in tune:  # applied without trials, the store refilled in the first epoch and read in the second
        assert isinstance(trainer.train_dataloader, DaliLoader) and trainer.train_dataloader._images is not None
        assert {(c.knob, c.after) for c in callback.report.changes} == {("dali", "cpu"), ("cache", True)}
        assert not callback.report.trials and callback.report.sample_cache.epochs[-1]["misses"] == 0
    else:  # DALI may not be used: neither is restored, and nothing fails
        assert not isinstance(trainer.train_dataloader, DaliLoader)
        assert "the cache is tuned afresh" in " ".join(callback.report.notes)
