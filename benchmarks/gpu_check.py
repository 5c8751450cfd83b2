"""Every check that needs an NVIDIA GPU, in one script (about 6 minutes on one H200-class GPU; limit 8).

    python benchmarks/gpu_check.py [--out benchmarks/results] [--only gpu-cache.json ...]

Writes, into ``--out``:
- ``gpu-foundation.json``: CUDA timing correctness, NVML sampling, observation overhead;
- ``gpu-precision-batch.json``: the precision pipeopt chooses for a transformer and its measured speedup over fp32;
  a batch over the memory budget trained as accumulated micro-batches, with its peak memory;
- ``gpu-fit-and-cost.json``: the memory breakdown of a transformer against ``torch.cuda.max_memory_allocated``,
  NVML health per window;
- ``gpu-loader.json``: the loader search on CUDA, where it may also try ``pin_memory``;
- ``gpu-cache.json``: the sample cache and the loader search on CUDA, with the final weights compared bit for bit
  against a plain run;
- ``gpu-dali.json``: DALI ``mixed`` decoding against the best DataLoader setting on the CPU-decode ImageFolder
  (needs torchvision and DALI, else it records why it was skipped);
- ``gpu-validation-chain.json``: the sample cache's validation chain (``benchmarks.sample_cache``) with the model on
  the GPU: pipeopt against the resident ceiling, the items held in memory and DataLoader workers (needs torchvision);
- ``gpu-store-read.json``: ``benchmarks.store_read`` with the step on the GPU: whether a thread reading the kept
  cache's next batch ahead hides the copy while the training thread waits for the GPU (on 2 CPUs it cannot).
Each file also names the device and the torch and Lightning versions. A section that raises records its traceback
in its file, the others still run, and the exit status is 1. On a machine without CUDA it says so and exits 0
without writing anything, so it is safe to run anywhere.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeopt import PipeOpt  # noqa: E402
from pipeopt.measure.nvml import SAMPLED  # noqa: E402


def sleep_seconds(cycles: int) -> float:
    """Device time of one ``torch.cuda._sleep(cycles)``, timed by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def calibrate_sleep_cycles(target_s: float) -> int:
    """Cycles for ``torch.cuda._sleep`` to keep the GPU busy for about ``target_s`` (its first launch, which loads
    the kernel, is not timed: it made a first calibration 20x too short)."""
    sleep_seconds(1000)
    cycles = 10_000_000
    per_cycle = min(sleep_seconds(cycles) for _ in range(3)) / cycles
    return int(target_s / per_cycle)


class Instant(Dataset):
    def __init__(self, n: int = 100_000, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.zeros(8)


class KnownDeviceTime(pl.LightningModule):
    """Each step keeps the GPU busy for a calibrated time, launched asynchronously (the host returns at once)."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.cycles = cycles
        self.layer = nn.Linear(8, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class BigMLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4096, 8192), nn.GELU(), nn.Linear(8192, 8192), nn.GELU(),
                                 nn.Linear(8192, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def quiet_trainer(callbacks: list, **limits: Any) -> pl.Trainer:
    """A Trainer on the GPU that writes nothing (no logger, checkpoint, progress bar or summary)."""
    return pl.Trainer(accelerator="cuda", devices=1, callbacks=callbacks, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **limits)


def fit(model: pl.LightningModule, loader: DataLoader, steps: int, callbacks: list) -> float:
    trainer = quiet_trainer(callbacks, max_steps=steps)
    torch.cuda.synchronize()
    start = time.perf_counter()
    trainer.fit(model, loader)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def told(cb: PipeOpt) -> dict[str, Any]:
    """What a fit's report says it changed, skipped and noted."""
    report = cb.report
    if report is None:
        return {"report": None}
    return {"changes": [(c.knob, c.before, c.after, c.predicted_speedup, c.measured_speedup) for c in report.changes],
            "skipped": [[k.group, k.reason] for k in report.skipped], "notes": report.notes}


def trials(cb: PipeOpt) -> list[dict[str, Any]]:
    """The loader settings a fit tried, with what each measured."""
    return [{"settings": t.settings, "samples_per_s": t.samples_per_s, "data_wait_frac": t.data_wait_frac,
             "status": t.status} for t in (cb.report.trials if cb.report is not None else [])]


def observer(**kwargs: Any) -> PipeOpt:
    return PipeOpt(tune=(), report_dir=None, console=Console(file=io.StringIO()), **kwargs)


def check_timing() -> dict[str, Any]:
    target = 0.020
    cycles = calibrate_sleep_cycles(target)
    cb = observer(window=20, warmup=5)
    wall = fit(KnownDeviceTime(cycles), DataLoader(Instant(), batch_size=16), 60, [cb])
    w = cb.report.after or cb.report.before
    measured = statistics.median(sleep_seconds(cycles) for _ in range(5))
    return {
        "device_time_per_step_s_target": target,
        "device_time_per_step_s_events": measured,  # the step's sleep alone, timed by CUDA events outside the fit
        "pipeopt_compute_s": w.compute_s,
        "pipeopt_step_time_s": w.step_time_s,
        "pipeopt_busy_frac": w.busy_frac,
        "pipeopt_data_wait_frac": w.data_wait_frac,
        "compute_within_10pct_of_events": abs(w.compute_s - measured) / measured < 0.10,
        "wall_s": wall,
        "nvml_status": w.resources.gpu_status,
        "gpu_util_pct": w.resources.gpu_util_pct,
        "gpu_mem_used_bytes": w.resources.gpu_mem_used_bytes,
        "gpu_power_w": w.resources.gpu_power_w,
        "peak_mem_bytes": w.resources.peak_mem_bytes,
        "nvml_sampled": w.resources.gpu_status == SAMPLED and w.resources.gpu_util_pct is not None,
        "windows": [{"label": x.label, "steps": x.steps, "step_time_s": x.step_time_s, "compute_s": x.compute_s,
                     "busy_frac": x.busy_frac} for x in cb.windows],
    }


def check_input_bound() -> dict[str, Any]:
    cycles = calibrate_sleep_cycles(0.002)
    cb = observer(window=10, warmup=3)
    fit(KnownDeviceTime(cycles), DataLoader(Instant(delay_s=0.002), batch_size=8), 30, [cb])
    w = cb.report.before
    return {"data_wait_frac": w.data_wait_frac, "busy_frac": w.busy_frac, "verdict": cb.report.verdict.kind,
            "predicted_speedup": cb.report.verdict.input_free_speedup}


class StepClock(pl.Callback):
    """The time at the end of every training batch, the device synchronised."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def check_overhead(pairs: int = 4, steps: int = 200, settle: int = 40) -> dict[str, Any]:
    """Observing (``tune=()``) against not, in interleaved pairs of fits: the steady pace over each fit's steps after
    ``settle`` (whole-fit walls spread from 1.04 to 1.75 s over 80-step fits, Trainer start-up included - wider
    than the overhead), whole-fit walls beside it."""
    x = torch.randn(8192, 4096)
    y = torch.randint(0, 10, (8192,))
    data = torch.utils.data.TensorDataset(x, y)
    runs: dict[str, dict[str, list[float]]] = {arm: {"wall_s": [], "steady_step_s": []}
                                               for arm in ("plain", "observed")}
    for r in range(pairs):
        for observe in ((False, True) if r % 2 == 0 else (True, False)):
            pl.seed_everything(0, verbose=False)
            clock = StepClock()
            callbacks = [clock, *([observer(window=20, warmup=5)] if observe else [])]
            wall = fit(BigMLP(), DataLoader(data, batch_size=512, pin_memory=True), steps, callbacks)
            arm = runs["observed" if observe else "plain"]
            arm["wall_s"].append(wall)
            arm["steady_step_s"].append((clock.ends[-1] - clock.ends[settle]) / (len(clock.ends) - 1 - settle))
    ratio = statistics.median(runs["plain"]["steady_step_s"]) / statistics.median(runs["observed"]["steady_step_s"])
    return {"steps": steps, "settle": settle, **runs, "observed_over_plain_throughput": ratio,
            "overhead_pct": 100 * (1 - ratio)}


class TinyTransformer(pl.LightningModule):
    """A transformer-style classifier on random tokens (matmul-heavy: where bf16 pays on tensor cores)."""

    def __init__(self, width: int = 512, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, width)
        layer = nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, 10)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        return nn.functional.cross_entropy(self.head(self.encoder(self.embed(tokens)).mean(1)), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _tokens(n: int, seq: int = 128) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, 1000, (n, seq), generator=g),
                                          torch.randint(0, 10, (n,), generator=g))


def check_precision_and_batch() -> dict[str, Any]:
    data = _tokens(4096)
    walls: dict[str, list[float]] = {"fp32": [], "pipeopt": []}
    chosen, precision_report, steps = None, {}, 800  # room for its windows: fp32, each candidate, the one after
    for r in range(2):  # interleaved pairs: fp32 as the user left it, and under PipeOpt(tune=("precision",))
        for mode in (("fp32", "pipeopt") if r % 2 == 0 else ("pipeopt", "fp32")):
            pl.seed_everything(0, verbose=False)
            cb = PipeOpt(tune=("precision",), report_dir=None, cache=False, console=Console(file=io.StringIO()))
            walls[mode].append(fit(TinyTransformer(), DataLoader(data, batch_size=64, pin_memory=True), steps,
                                   [cb] if mode == "pipeopt" else []))
            if mode == "pipeopt" and cb.report is not None:
                chosen = next((c.after for c in cb.report.changes if c.knob == "precision"), "32-true")
                precision_report = told(cb)
    speedup = statistics.median(walls["fp32"]) / statistics.median(walls["pipeopt"])
    # A batch over the budget: memory_fraction 0.05 of the card (about 7 GB on an H200) against a batch of 512
    # sequences of 128 tokens, whose fp32 step needs roughly twice that (it still runs: the card is larger). pipeopt
    # measures its peak in a live window, tries the largest split predicted to fit and keeps it once its own window's
    # peak is within the budget (splits go down to 64).
    fraction = 0.05
    budget = fraction * torch.cuda.get_device_properties(0).total_memory
    counts: list[int] = []

    class Count(pl.Callback):
        seen = 0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            Count.seen += len(batch[0])

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            counts.append(Count.seen)
            Count.seen = 0

    cb = PipeOpt(tune=("batch",), memory_fraction=fraction, window=10, warmup=2, window_s=0, report_dir=None,
                 cache=False, console=Console(file=io.StringIO()))
    torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(0, verbose=False)
    trainer = quiet_trainer([cb, Count()], max_steps=60)
    trainer.fit(TinyTransformer(), DataLoader(data, batch_size=512))
    peaks = [(w.label, w.resources.peak_mem_bytes) for w in cb.windows if w.resources.peak_mem_bytes]
    after = [p for label, p in peaks if label == "after"]
    return {
        "precision": {"steps": steps, "chosen": chosen, "fp32_wall_s": walls["fp32"],
                      "pipeopt_wall_s": walls["pipeopt"], "whole_fit_speedup_over_fp32": speedup,
                      **precision_report},
        "batch": {"user_batch": 512, "memory_fraction": fraction, "budget_bytes": int(budget),
                  "accumulate_grad_batches": trainer.accumulate_grad_batches,
                  "samples_per_optimizer_step": counts,
                  "window_peak_bytes": peaks, "after_peak_within_budget": bool(after) and max(after) <= budget,
                  **told(cb)},
    }


def check_fit_and_cost(steps: int = 60) -> dict[str, Any]:
    """The memory breakdown pipeopt counts for a transformer trained with AdamW, against CUDA's own peak over the
    same fit (target: within 10 %), and the NVML health figures of its windows."""
    cb = PipeOpt(tune=(), window=10, warmup=3, window_s=0, report_dir=None, cache=False, cost_per_hour=1.0,
                 console=Console(file=io.StringIO()))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(0, verbose=False)
    fit(TinyTransformer(), DataLoader(_tokens(4096), batch_size=128, pin_memory=True), steps, [cb])
    peak = torch.cuda.max_memory_allocated()  # pipeopt leaves it alone where the batch is not tuned
    section = cb.report.fit if cb.report is not None else None
    memory = section.memory if section is not None else None
    counted = memory.counted_bytes if memory is not None else None
    health = [{k: v for k, v in vars(w.resources).items() if k.startswith("gpu_") or k.startswith("peak_")}
              for w in cb.windows]
    return {"model": "TinyTransformer(width=512, layers=4), AdamW, batch 128 x 128 tokens, fp32",
            "breakdown": memory.to_dict() if memory is not None else None, "counted_bytes": counted,
            "cuda_max_memory_allocated": peak, "counted_over_cuda_peak": counted / peak if counted else None,
            "within_10_percent": bool(counted) and abs(counted / peak - 1) <= 0.10,
            "limit": section.limit if section else None,
            "fits_on": [[r.memory_gib, [f.text() for f in r.fits]] for r in section.fits_on] if section else None,
            "time": vars(section.time) if section else None, "window_health": health,
            # pipeopt did not reset CUDA's peak statistics (no batch tuning): the fit's peak is still there, and
            # no window's running peak is above it
            "peak_statistics_left_alone": peak > 0 and all((h.get("peak_mem_bytes") or 0) <= peak for h in health),
            **told(cb)}


def check_loader(steps: int = 1000) -> dict[str, Any]:
    """The loader search on CUDA, the only device where it may also try ``pin_memory=True``: resident images in
    batches of 64 x 3 x 224 x 224 float32 (38 MB) into a small CNN, so the copy to the device is a large share of the
    step, from ``num_workers=0`` under ``PipeOpt(tune=("loader",))``. Records every trial and what was kept."""
    from benchmarks.scenarios.workloads import Classifier, small_cnn

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 3, 224, 224, generator=g),
                                          torch.randint(0, 10, (1024,), generator=g))
    cb = PipeOpt(tune=("loader",), report_dir=None, cache=False, console=Console(file=io.StringIO()))
    pl.seed_everything(0, verbose=False)
    wall = fit(Classifier(small_cnn()), DataLoader(data, batch_size=64, shuffle=True), steps, [cb])
    tried = trials(cb)
    before, after = (cb.report.before, cb.report.after) if cb.report is not None else (None, None)
    return {"workload": "1,024 resident 3x224x224 float32 images, batch 64, small CNN, from num_workers=0",
            "steps": steps, "wall_s": wall, "trials": tried,
            "pin_memory_tried": any(t["settings"].get("pin_memory") for t in tried),
            "before_transfer_frac": before.transfer_frac if before else None,
            "after_transfer_frac": after.transfer_frac if after else None, **told(cb)}


def check_cache(epochs: int = 8) -> dict[str, Any]:
    """The sample cache and the loader search on CUDA: a dataset behind 1 ms of storage latency per sample, trained
    for ``epochs`` epochs from ``num_workers=0`` with and without ``PipeOpt(tune=("loader", "cache"))``. The knobs it
    may turn change no value, so the final weights must be bit-identical; the cache's report and each epoch's
    samples/s are recorded beside the plain run's."""
    from benchmarks.scenarios.workloads import Classifier, SlowStorage, mlp

    class EpochClock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    data, batch = SlowStorage(n=2048, dim=64, delay_s=0.001), 32
    arms: dict[str, Any] = {}
    for name in ("plain", "pipeopt"):
        pl.seed_everything(0, verbose=False)
        model, clock = Classifier(mlp(64, 2048, 2)), EpochClock()
        cb = PipeOpt(tune=("loader", "cache"), report_dir=None, cache=False, console=Console(file=io.StringIO()))
        trainer = quiet_trainer([clock, *([cb] if name == "pipeopt" else [])], max_epochs=epochs)
        start = time.perf_counter()
        trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=True, drop_last=True))
        ends = [start, *clock.ends]
        arm: dict[str, Any] = {"epoch_samples_per_s": [len(data) // batch * batch / (b - a)
                                                       for a, b in zip(ends, ends[1:])],
                               "weights": [p.detach().cpu() for p in model.parameters()]}
        if name == "pipeopt" and cb.report is not None:
            arm.update(told(cb), trials=trials(cb), sample_cache=asdict(cb.report.sample_cache)
                       if cb.report.sample_cache else None)
        arms[name] = arm
    plain, tuned = arms["plain"].pop("weights"), arms["pipeopt"].pop("weights")
    return {"workload": "2,048 samples behind 1 ms of storage latency each, batch 32, 2x2048 MLP, "
            f"{epochs} epochs from num_workers=0", **arms,
            "weights_bit_identical": all(torch.equal(a, b) for a, b in zip(plain, tuned))}


def check_dali(repeats: int = 2, steps: int = 40) -> dict[str, Any]:
    """DALI ``mixed`` decoding (nvJPEG) against DataLoader workers on the CPU-decode ImageFolder, images/s."""
    from pipeopt.dali import loader_from, missing

    reason = missing()
    if reason is not None:
        return {"skipped": reason}
    try:
        from benchmarks.dali_decode import SCENARIO, dataset

        data = dataset()
    except ImportError as err:  # torchvision or Pillow missing
        return {"skipped": f"{type(err).__name__}: {err}"}
    arms: list[dict[str, Any]] = [{"num_workers": n, **({"persistent_workers": True} if n else {})}
                                  for n in (0, 4, 8, 16)] + [{"dali": "mixed"}]
    runs: dict[str, list[float]] = {json.dumps(a): [] for a in arms}
    for r in range(repeats):
        for arm in arms[r:] + arms[:r]:
            loader = SCENARIO.loader(data, **{k: v for k, v in arm.items() if k != "dali"})
            if "dali" in arm:
                loader = loader_from(loader, device="mixed")
            wall = fit(SCENARIO.make_model(), loader, steps, [])
            runs[json.dumps(arm)].append(steps * SCENARIO.batch_size / wall)
    rows = [{"settings": a, "images_per_s": statistics.median(runs[json.dumps(a)]), "runs": runs[json.dumps(a)]}
            for a in arms]
    best = max(rows[:-1], key=lambda row: row["images_per_s"])
    return {"scenario": SCENARIO.description, "steps_per_run": steps, "note": "images/s over whole fits (start-up "
            "included), medians of interleaved runs", "grid": rows, "best_dataloader": best["settings"],
            "dali_mixed_over_best_dataloader": rows[-1]["images_per_s"] / best["images_per_s"]}


def check_validation_chain(copies: int = 16, epochs: int = 8, grid: tuple[int, ...] = (8, 12)) -> dict[str, Any]:
    """The sample cache's validation chain on the GPU: ``benchmarks.sample_cache``'s arms (the resident ceiling, the
    items held in memory, DataLoader workers, pipeopt from ``num_workers=0`` with ``tune=("loader", "cache")``), each
    beside the ceiling measured just before and after it, one round. ``copies`` x 512 entries of 384 px JPEGs,
    Resize(128) + CenterCrop(112) + ToTensor + Normalize, a small CNN, 32 a step; the grid sized for this host's
    CPUs rather than a 2-CPU one."""
    try:
        import torchvision  # noqa: F401
    except ImportError as err:
        return {"skipped": f"{type(err).__name__}: {err}"}
    from benchmarks.sample_cache import CacheScenario, _workers, scenario_figures, validation_chain
    from benchmarks.scenarios.workloads import Classifier, small_cnn

    scenario = CacheScenario(
        "validation_chain_gpu", f"ImageFolder of {copies * 512:,} 384 px JPEG entries (512 files), Resize(128) + "
        f"CenterCrop(112) + ToTensor + Normalize, small CNN on the GPU, 32/step, {epochs} epochs",
        lambda: validation_chain(copies), lambda: Classifier(small_cnn(10)), 32, epochs, _workers(*grid),
        ("loader", "cache"), vision=True, whole=True)
    return {**scenario_figures(scenario, repeats=1), "cpus": os.cpu_count()}


def check_store_read(rounds: int = 4, items: int = 4096) -> dict[str, Any]:
    """``benchmarks.store_read``'s arms with the step on the GPU, ``rounds`` rounds: the kept cache's read in the
    training thread, and read ahead on a thread (at the usual and at idle priority), each against resident batches.
    On 2 CPUs no thread can take the copy off the step (the thirty-seventh pass); here the training thread waits for
    the GPU at each step's end, outside the GIL, and the host has CPUs to spare."""
    from benchmarks.store_read import measure

    return {**measure(rounds, items, "cuda"), "cpus": os.cpu_count()}


SECTIONS = {
    "gpu-foundation.json": lambda: {"timing": check_timing(), "input_bound": check_input_bound(),
                                    "overhead": check_overhead()},
    "gpu-precision-batch.json": check_precision_and_batch,
    "gpu-fit-and-cost.json": check_fit_and_cost,
    "gpu-loader.json": check_loader,
    "gpu-cache.json": check_cache,
    "gpu-dali.json": check_dali,
    "gpu-validation-chain.json": check_validation_chain,
    "gpu-store-read.json": check_store_read,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS), help="these sections alone (default: all)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it where a GPU is available).")
        return 0
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    args.out.mkdir(parents=True, exist_ok=True)
    environment = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "pytorch_lightning": pl.__version__, "python": sys.version.split()[0]}
    failed = 0
    for name in args.only or SECTIONS:  # each section on its own: one that breaks leaves the others' figures
        started = time.perf_counter()
        try:
            figures = SECTIONS[name]()
        except Exception:  # recorded in its file, not hidden: the exit status says one failed
            figures, failed = {"error": traceback.format_exc()}, failed + 1
        figures["elapsed_s"] = time.perf_counter() - started
        figures["environment"] = environment
        path = args.out / name
        path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
        print(json.dumps(figures, indent=2, default=str))
        print(f"wrote {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
