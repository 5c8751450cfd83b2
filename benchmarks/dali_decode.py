"""The CPU-decode scenario as a torchvision ImageFolder: DALI's CPU backend against the best DataLoader setting.

    python -m benchmarks.dali_decode [--repeats 3] [--tuned-repeats 2]      (``make bench-dali``: needs torchvision
                                                                              and DALI, so it runs in .venv-vision)

The same 512 JPEGs (384 px) and the same chain - RandomResizedCrop(112, scale=(0.25, 1)), RandomHorizontalFlip,
ToTensor, Normalize - into the same small CNN, 32 images a step. Arms, interleaved and repeated in one run (medians):
the DataLoader with 0-4 workers, ``pipeopt.dali.loader_from(loader, device="cpu")``, and the naive loader under
``PipeOpt(tune=("loader", "dali"))``, measured after its tuning finished. Writes
``benchmarks/results/dali_cpu_decode.json`` and its rows in ``benchmarks/results/README.md`` and the README.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path
from typing import Any

from rich.progress import Progress

from benchmarks.harness import median, quiet_pipeopt, run_fit, spread
from benchmarks.run import RESULTS, keep_in_history, machine, write_markdown
from benchmarks.scenarios.base import Scenario, label
from benchmarks.scenarios.workloads import CACHE, Classifier, jpeg_folder, small_cnn

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
CLASSES = 10


def image_folder() -> Path:
    """``jpeg_folder()``'s files as an ImageFolder: ten class directories of links."""
    source = jpeg_folder()
    root = CACHE / "imagefolder-512-384"
    done = root / ".complete"
    if not done.exists():
        for i, path in enumerate(sorted(source.glob("*.jpg"))):
            target = root / f"class{i % CLASSES}" / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(path)
        done.write_text("ok")
    return root


def dataset() -> Any:
    from torchvision import datasets
    from torchvision import transforms as T

    chain = T.Compose([T.RandomResizedCrop(112, scale=(0.25, 1.0)), T.RandomHorizontalFlip(), T.ToTensor(),
                       T.Normalize(MEAN, STD)])
    return datasets.ImageFolder(image_folder(), transform=chain)


SCENARIO = Scenario(
    name="dali_cpu_decode",
    description="ImageFolder of 384 px JPEGs, torchvision RandomResizedCrop(112) + flip + normalise, 32/step, "
                "small CNN",
    make_dataset=dataset,
    make_model=lambda: Classifier(small_cnn(CLASSES)),
    batch_size=32,
    steps=100,  # DALI's pipeline builds at its first batch: 20 warm-up steps, then 80 measured
    warmup=20,
    tuned_steps=400,
)
GRID = ({"num_workers": 0},) + tuple(
    {"num_workers": n, "persistent_workers": True, "prefetch_factor": 2} for n in (1, 2, 3, 4))
DALI = {"dali": "cpu"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tuned-repeats", type=int, default=2)
    args = parser.parse_args(argv)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    from pipeopt.dali import loader_from

    s, data = SCENARIO, SCENARIO.make_dataset()
    arms = [*GRID, DALI]
    runs: dict[str, list[float]] = {label(a): [] for a in arms}
    tuned: list[dict[str, Any]] = []
    with Progress() as progress:
        task = progress.add_task(s.name, total=args.repeats * len(arms) + args.tuned_repeats)
        for r in range(args.repeats):
            for arm in arms[r % len(arms):] + arms[: r % len(arms)]:  # interleaved: the order rotates each round
                progress.update(task, description=f"{s.name}: {label(arm)}")
                loader = loader_from(s.loader(data), device="cpu") if arm is DALI else None
                runs[label(arm)].append(run_fit(s, data, arm, loader=loader)["samples_per_s"])
                progress.advance(task)
        for _ in range(args.tuned_repeats):
            progress.update(task, description=f"{s.name}: naive loader under PipeOpt")
            callback = quiet_pipeopt(tune=("loader", "dali"))
            figures = run_fit(s, data, GRID[0], callbacks=[callback], steps=s.tuned_steps, steady_from=0.5)
            report = callback.report
            tuned.append({"samples_per_s": figures["samples_per_s"], "wall_s": figures["wall_s"],
                          "kept": {c.knob: c.after for c in report.changes} if report else None,
                          "trials": [t.settings for t in report.trials] if report else []})
            progress.advance(task)
    rows = [{"settings": a, "samples_per_s": median(runs[label(a)]), "spread": spread(runs[label(a)]),
             "runs": runs[label(a)]} for a in arms]
    best = max(rows[:-1], key=lambda row: row["samples_per_s"])
    dali = rows[-1]
    tuned_rate = median([t["samples_per_s"] for t in tuned]) if tuned else None
    result = {
        "scenario": s.name,
        "description": s.description,
        "command": f"python -m benchmarks.dali_decode --repeats {args.repeats} --tuned-repeats {args.tuned_repeats}",
        "machine": machine(),
        "steps_per_run": s.steps,
        "warmup_steps": s.warmup,
        "batch_size": s.batch_size,
        "grid": rows,
        "best_dataloader": best["settings"],
        "dali_over_best_dataloader": dali["samples_per_s"] / best["samples_per_s"],
        "pipeopt": {"runs": tuned, "samples_per_s": tuned_rate,
                    "over_best_arm": tuned_rate / max(best["samples_per_s"], dali["samples_per_s"]) if tuned_rate
                    else None},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{s.name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    keep_in_history(result)
    write_markdown()
    print(f"best DataLoader ({label(best['settings'])}): {best['samples_per_s']:,.0f} images/s; DALI CPU: "
          f"{dali['samples_per_s']:,.0f} images/s ({result['dali_over_best_dataloader']:.2f}x); under PipeOpt: "
          f"{tuned_rate or 0:,.0f} images/s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
