"""A 2-rank CPU DDP fit (gloo) over a torchvision ImageFolder, run as its own process (see ddp_fit.py).

    python tests/scripts/ddp_dali_fit.py OUT_DIR {plain|pipeopt|loader_from} IMAGE_ROOT

``pipeopt`` tries DALI as a loader candidate on both ranks, in a controlled world where it measures ten times the
DataLoader's rate (``pipeopt.tuning.noise.window_rate``) and every window waits half its step for data
(``window_wait``), so it must be kept on both; ``loader_from`` trains on
``pipeopt.dali.loader_from(DataLoader(...))`` built in ``train_dataloader`` (after DDP started: it shards itself).
Each rank writes OUT_DIR/<mode>-rank<r>.json: the dataset indices it trained on, in order, and its trials.
"""

import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytorch_lightning as pl  # noqa: E402
from rich.console import Console  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from torchvision import datasets  # noqa: E402
from torchvision import transforms as T  # noqa: E402

from pipeopt import PipeOpt  # noqa: E402
from pipeopt.dali import loader_from  # noqa: E402
from pipeopt.tuning import noise  # noqa: E402
from pipeopt.tuning.noise import Rate  # noqa: E402
from tests.dali.images import Classifier  # noqa: E402
from tests.helpers import end_process_group, quiet_trainer_kwargs  # noqa: E402


class OwnLoader(Classifier):
    def __init__(self, root: Path, direct: bool) -> None:
        super().__init__()
        self.root, self.direct = root, direct

    def train_dataloader(self):
        dataset = datasets.ImageFolder(self.root, transform=T.Compose([T.Resize((16, 16)), T.ToTensor()]))
        loader = DataLoader(dataset, batch_size=4, shuffle=True)
        return loader_from(loader, device="cpu", num_threads=1) if self.direct else loader


def main() -> None:
    out, mode, root = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    pl.seed_everything(1, verbose=False)
    callbacks = []
    if mode == "pipeopt":
        noise.window_rate = lambda stats, settings: Rate(1000.0 if settings.dali else 100.0, 0.01)
        # input-bound however busy the machine is
        noise.window_wait = noise.window_supply_wait = lambda stats, settings: 0.5
        callbacks.append(PipeOpt(tune=("dali",), window=4, window_s=0, warmup=2, budget_s=10, report_dir=None,
                                 cache=False, console=Console(file=io.StringIO())))
    model = OwnLoader(root, direct=mode == "loader_from")
    trainer = pl.Trainer(max_epochs=2, strategy="ddp", callbacks=callbacks, **quiet_trainer_kwargs(devices=2))
    trainer.fit(model)
    report = callbacks[0].report if callbacks else None
    result = {
        "seen": model.seen,
        "trials": [t.settings for t in report.trials] if report else [],
        "changes": [[c.knob, c.after] for c in report.changes] if report else [],
        "loader": type(trainer.train_dataloader).__name__,
    }
    (out / f"{mode}-rank{trainer.global_rank}.json").write_text(json.dumps(result))
    end_process_group()


if __name__ == "__main__":
    main()
