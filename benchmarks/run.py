"""Benchmark runner: one scenario, in one run, over an oracle grid of loader settings and under PipeOpt.

    python -m benchmarks.run SCENARIO|all [--repeats 3] [--overhead-repeats 6]

Writes ``benchmarks/results/<scenario>.json`` and regenerates ``benchmarks/results/README.md``. All ratios
are of runs made side by side in the same invocation (interleaved, repeated, medians), never of figures
from different runs: these machines are shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress

from benchmarks.harness import median, quiet_pipeopt, run_fit, spread
from benchmarks.scenarios import SCENARIOS, Scenario
from benchmarks.scenarios.base import label
from pipeopt import __version__
from pipeopt._compat import lightning_versions

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    return {
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning_versions(),
        "pipeopt": __version__,
    }


def oracle_grid(s: Scenario, dataset: Any, repeats: int, progress: Progress) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, float]]] = {label(g): [] for g in s.grid}
    task = progress.add_task(f"{s.name}: oracle grid", total=repeats * len(s.grid))
    for r in range(repeats):
        order = s.grid[r % len(s.grid):] + s.grid[: r % len(s.grid)]  # interleave: rotate the order each round
        for settings in order:
            progress.update(task, description=f"{s.name}: {label(settings)}")
            runs[label(settings)].append(run_fit(s, dataset, settings))
            progress.advance(task)
    rows = []
    for settings in s.grid:
        rates = [run["samples_per_s"] for run in runs[label(settings)]]
        rows.append({"settings": settings, "samples_per_s": median(rates), "spread": spread(rates), "runs": rates})
    return rows


def observation_overhead(s: Scenario, dataset: Any, repeats: int, progress: Progress) -> dict[str, Any]:
    """The naive setting with and without an observing PipeOpt, alternating which goes first."""
    plain: list[float] = []
    observed: list[float] = []
    task = progress.add_task(f"{s.name}: observation overhead", total=2 * repeats)
    for r in range(repeats):
        for observe in ((False, True) if r % 2 == 0 else (True, False)):
            callbacks = [quiet_pipeopt(tune=(), window=10, warmup=s.warmup)] if observe else []
            rate = run_fit(s, dataset, s.naive, callbacks)["samples_per_s"]
            (observed if observe else plain).append(rate)
            progress.advance(task)
    ratio = median(observed) / median(plain)
    return {
        "settings": s.naive,
        "plain_samples_per_s": median(plain),
        "observed_samples_per_s": median(observed),
        "observed_over_plain": ratio,
        "overhead_pct": 100.0 * (1.0 - ratio),
        "plain_runs": plain,
        "observed_runs": observed,
    }


#: Steady throughput of a tuned run is measured over its last quarter (tuning is over by then; checked).
STEADY_FROM = 0.75


def tuned_runs(s: Scenario, dataset: Any, best: dict[str, Any], repeats: int, progress: Progress) -> dict[str, Any]:
    """The naive setting under ``PipeOpt(tune=("loader",))`` beside the oracle's best setting, same steps,
    alternating which goes first."""
    oracle: list[dict[str, float]] = []
    tuned: list[dict[str, float]] = []
    reports = []
    task = progress.add_task(f"{s.name}: pipeopt vs oracle best", total=2 * repeats)
    for r in range(repeats):
        for with_pipeopt in ((True, False) if r % 2 == 0 else (False, True)):
            if with_pipeopt:
                callback = quiet_pipeopt(tune=("loader",))
                tuned.append(run_fit(s, dataset, s.naive, [callback], steps=s.tuned_steps, steady_from=STEADY_FROM))
                reports.append(callback.report)
            else:
                oracle.append(run_fit(s, dataset, best, steps=s.tuned_steps, steady_from=STEADY_FROM))
            progress.advance(task)
    chosen = [{c.knob: c.after for c in rep.changes} for rep in reports]
    finished = all(not any("ended before loader tuning finished" in n for n in rep.notes) for rep in reports)
    t_rate, o_rate = median([t["samples_per_s"] for t in tuned]), median([o["samples_per_s"] for o in oracle])
    t_wall, o_wall = median([t["wall_s"] for t in tuned]), median([o["wall_s"] for o in oracle])
    return {
        "steps_per_run": s.tuned_steps,
        "oracle_settings": best,
        "tuned_samples_per_s": t_rate,
        "oracle_samples_per_s": o_rate,
        "tuned_over_oracle": t_rate / o_rate,
        "tuned_wall_s": t_wall,
        "oracle_wall_s": o_wall,
        "time_lost_to_tuning_s": t_wall - o_wall,
        "tuning_finished_in_every_run": finished,
        "changes_per_run": chosen,
        "trials_per_run": [len(rep.trials) - 1 for rep in reports],
        "predicted_speedup_per_run": [rep.predicted_speedup for rep in reports],
        "measured_speedup_per_run": [rep.measured_speedup for rep in reports],
        "tuned_runs": tuned,
        "oracle_runs": oracle,
    }


def run_scenario(s: Scenario, repeats: int, overhead_repeats: int, tuned_repeats: int,
                 console: Console) -> dict[str, Any]:
    dataset = s.make_dataset()
    with Progress(console=console, transient=True) as progress:
        grid = oracle_grid(s, dataset, repeats, progress)
        overhead = observation_overhead(s, dataset, overhead_repeats, progress) if overhead_repeats else None
        best = max(grid, key=lambda row: row["samples_per_s"])
        tuned = tuned_runs(s, dataset, best["settings"], tuned_repeats, progress) if tuned_repeats else None
    naive = next(row for row in grid if row["settings"] == s.naive)
    return {
        "scenario": s.name,
        "description": s.description,
        "command": (f"python -m benchmarks.run {s.name} --repeats {repeats} --overhead-repeats {overhead_repeats} "
                    f"--tuned-repeats {tuned_repeats}"),
        "machine": machine(),
        "steps_per_run": s.steps,
        "warmup_steps": s.warmup,
        "batch_size": s.batch_size,
        "grid": grid,
        "oracle_best": {"settings": best["settings"], "samples_per_s": best["samples_per_s"]},
        "naive": {"settings": naive["settings"], "samples_per_s": naive["samples_per_s"]},
        "naive_over_oracle": naive["samples_per_s"] / best["samples_per_s"],
        "observation_overhead": overhead,
        "pipeopt": tuned,
    }


def write_markdown() -> Path:
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.run`; each row's figures come from one invocation, side by side.",
        "samples/s are medians of the repeats; *spread* is (max - min) / median over those repeats.",
        "",
        "| scenario | naive (num_workers=0) samples/s | oracle best | oracle samples/s | naive / oracle | "
        "pipeopt / oracle (steady) | time lost to tuning | pipeopt chose | observation overhead |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    results = [RESULTS / f"{name}.json" for name in sorted(SCENARIOS) if (RESULTS / f"{name}.json").exists()]
    details: list[str] = []
    for path in results:
        r = json.loads(path.read_text())
        o = r.get("observation_overhead")
        overhead = f"{o['overhead_pct']:+.1f} %" if o else "-"
        p = r.get("pipeopt")
        tuned = f"{p['tuned_over_oracle']:.2f}" if p else "-"
        lost = f"{p['time_lost_to_tuning_s']:+.1f} s" if p else "-"
        chose = "; ".join(label(c) or "no change" for c in p["changes_per_run"]) if p else "-"
        lines.append(
            f"| {r['scenario']} | {r['naive']['samples_per_s']:.0f} | {label(r['oracle_best']['settings'])} | "
            f"{r['oracle_best']['samples_per_s']:.0f} | {r['naive_over_oracle']:.2f} | {tuned} | {lost} | {chose} | "
            f"{overhead} |"
        )
        details += ["", f"## {r['scenario']}: {r['description']}", "", f"`{r['command']}` on "
                    f"{r['machine']['cpus']} CPUs ({r['machine']['device']}), torch {r['machine']['torch']}", "",
                    "| loader settings | samples/s | spread |", "|---|---:|---:|"]
        for row in r["grid"]:
            details.append(f"| {label(row['settings'])} | {row['samples_per_s']:.0f} | {row['spread']:.0%} |")
    lines.append("")
    lines.append("Observation overhead: throughput lost by running `PipeOpt(tune=())` on the naive setting, "
                 "(1 - observed / plain) of medians; negative means the observed runs happened to be faster "
                 "(noise).")
    dali = RESULTS / "dali_cpu_decode.json"
    if dali.exists():
        d = json.loads(dali.read_text())
        best = next(row for row in d["grid"] if row["settings"] == d["best_dataloader"])
        ours = d["grid"][-1]
        tuned = d["pipeopt"]
        kept = "; ".join(label(run["kept"] or {}) or "no change" for run in tuned["runs"])
        lines += ["", "| DALI (`make bench-dali`) | best DataLoader | its samples/s | DALI CPU samples/s | DALI / best "
                  "DataLoader | naive loader under PipeOpt (steady) | pipeopt kept |",
                  "|---|---|---:|---:|---:|---:|---|",
                  f"| {d['scenario']} | {label(best['settings'])} | {best['samples_per_s']:.0f} | "
                  f"{ours['samples_per_s']:.0f} | {d['dali_over_best_dataloader']:.2f} | "
                  f"{tuned['samples_per_s']:.0f} | {kept} |", "",
                  "DALI: the CPU-decode images as a torchvision ImageFolder; each arm "
                  f"{d['steps_per_run'] - d['warmup_steps']} steps after {d['warmup_steps']} of warm-up, medians of "
                  "interleaved repeats; under PipeOpt: "
                  "`tune=(\"loader\", \"dali\")` from `num_workers=0`, steady over the last half of a 400-step run."]
        details += ["", f"## {d['scenario']}: {d['description']}", "", f"`{d['command']}` on "
                    f"{d['machine']['cpus']} CPUs ({d['machine']['device']}), torch {d['machine']['torch']}", "",
                    "| loader | samples/s | spread |", "|---|---:|---:|"]
        details += [f"| {label(row['settings'])} | {row['samples_per_s']:.0f} | {row['spread']:.0%} |"
                    for row in d["grid"]]
    book = RESULTS / "bookkeeping.json"
    if book.exists():
        b = json.loads(book.read_text())
        lines.append("")
        lines.append(f"Direct bookkeeping cost (`{b['command']}`): {b['bookkeeping_us_per_step']:.0f} us per step, "
                     f"{b['share_of_compute_bound_step_pct']:.2f} % of the compute-bound scenario's "
                     f"{b['compute_bound_step_ms']:.0f} ms step - the side-by-side fits above cannot resolve "
                     "below their +-2 % noise.")
    lines.append("")
    lines.append("pipeopt / oracle: steady throughput (last quarter of the run) of a run started from the naive "
                 "setting under `PipeOpt(tune=(\"loader\",))` over a run of the same length with the oracle grid's "
                 "best setting, medians of interleaved pairs. Time lost to tuning: wall time of the first minus "
                 "the second. *pipeopt chose*: the changes it kept, per run.")
    path = RESULTS / "README.md"
    path.write_text("\n".join(lines + details) + "\n")
    _update_readme(lines[5:])
    return path


def _update_readme(table: list[str]) -> None:
    """The summary table, copied between the markers of the project README."""
    readme = RESULTS.parents[1] / "README.md"
    text = readme.read_text()
    start, end = "<!-- results-table -->", "<!-- /results-table -->"
    if start not in text or end not in text:
        return
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    block = "\n".join([start, "", *table, end])
    readme.write_text(head + block + tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--repeats", type=int, default=3, help="repeats of each grid setting (default 3)")
    parser.add_argument("--overhead-repeats", type=int, default=6,
                        help="pairs of runs with/without observation (default 6; 0 skips)")
    parser.add_argument("--tuned-repeats", type=int, default=2,
                        help="pairs of runs: pipeopt from the naive setting vs the oracle's best (default 2; 0 skips)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    console = Console(stderr=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for name in names:
        result = run_scenario(SCENARIOS[name], args.repeats, args.overhead_repeats, args.tuned_repeats, console)
        out = RESULTS / f"{name}.json"
        out.write_text(json.dumps(result, indent=2) + "\n")
        console.print(f"{name}: naive/oracle {result['naive_over_oracle']:.2f} "
                      f"(best {label(result['oracle_best']['settings'])}) -> {out}")
    console.print(f"table: {write_markdown()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
