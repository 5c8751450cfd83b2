"""Benchmark runner: one scenario, in one run, over an oracle grid of loader settings and under PipeOpt.

    python -m benchmarks.run SCENARIO|all [--repeats 3] [--overhead-repeats 6]

Writes ``benchmarks/results/<scenario>.json`` and regenerates ``benchmarks/results/README.md``. All ratios
are of runs made side by side in the same invocation (interleaved, repeated, medians), never of figures
from different runs: a shared machine's speed drifts between runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import re
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
from pipeopt._lightning import lightning_versions

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


HISTORY = RESULTS / "history"


def _mmm(values: list[float], fmt: str = "{:.0f}") -> str:
    """``median [min - max]`` of repeated measurements (just the value when there is one)."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(median(values))} [{fmt.format(min(values))} - {fmt.format(max(values))}]"


def pair_ratios(p: dict[str, Any]) -> list[float]:
    """pipeopt / oracle of each interleaved pair (tuned run i beside oracle run i)."""
    return [t["samples_per_s"] / o["samples_per_s"] for t, o in zip(p["tuned_runs"], p["oracle_runs"])]


def keep_in_history(result: dict[str, Any]) -> Path:
    """Every published result is kept: a copy in results/history/, never overwritten by a later run."""
    HISTORY.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    path = HISTORY / f"{result['scenario']}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _history_name(path: Path) -> tuple[str, str, str]:
    """A history file's name, time stamp and commit (``-`` where none): ``<name>-<stamp>[-<commit>].json``, the
    name dashed or not (``gpu-fit-and-cost-...``)."""
    parts = path.stem.split("-")
    at = next(i for i, part in enumerate(parts) if re.fullmatch(r"\d{8}T\d{6}", part))
    return "-".join(parts[:at]), parts[at], "-".join(parts[at + 1:]) or "-"


def _history_rows() -> list[str]:
    rows = []
    for path in sorted(HISTORY.glob("*.json"), key=lambda p: _history_name(p)[1]):
        r = json.loads(path.read_text())
        name, stamp, commit = _history_name(path)
        when = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]}"
        p = r.get("pipeopt")
        if "environment" in r:  # a GPU check's file (``benchmarks/gpu_check.py``), one per check
            device = r["environment"].get("device", "a GPU")
            rows.append(f"| {when} | {commit} | {name} | `python3 benchmarks/gpu_check.py --out <dir>` | "
                        f"checks on {device}: `{name}.json` |")
            continue
        if r["scenario"] == "predict_verify":
            ratios = [x["tuned_over_oracle"] for sc in r["scenarios"] for x in sc["runs"]]
            ratio = f"pipeopt / oracle {_mmm(ratios, '{:.2f}')} (all scenarios' runs)"
        elif r["scenario"] == "dali_cpu_decode":
            dali = r["grid"][-1]["runs"]
            best = next(row for row in r["grid"] if row["settings"] == r["best_dataloader"])["runs"]
            ratio = f"DALI / best DataLoader {_mmm([d / b for d, b in zip(dali, best)], '{:.2f}')}"
        elif r["scenario"].startswith("sample_cache_") and r.get("rounds"):
            ratios = [x["pipeopt_over_best_dataloader"] for x in r["rounds"]]
            ratio = f"pipeopt / best DataLoader from epoch 2 {_mmm(ratios, '{:.2f}')}"
        elif r["scenario"] == "store_read":  # ``benchmarks.store_read``: the kept cache's read, in a plain loop
            ratio = f"store / resident batches {_mmm([x['over_resident']['store'] for x in r['rounds']], '{:.2f}')}"
        elif p and p.get("tuned_runs") and p.get("oracle_runs"):
            ratio = f"pipeopt / oracle {_mmm(pair_ratios(p), '{:.2f}')}"
        elif p:
            ratio = f"pipeopt / oracle {p['tuned_over_oracle']:.2f} (runs not kept)"
        else:
            ratio = "no pipeopt runs"
        rows.append(f"| {when} | {commit} | {r['scenario']} | `{r['command']}` | {ratio} |")
    return rows


def predict_verify_rows(r: dict[str, Any]) -> list[str]:
    """The predict-then-verify table (``benchmarks.predict_verify``): one row per plan, every repeat in it."""
    rows = ["", "| predict, then verify (`benchmarks.predict_verify`) | steps a run | live trials until kept | "
            "after-window starts at | pipeopt / oracle | kept change: predicted vs measured speedup, error | "
            "pipeopt kept |", "|---|---:|---:|---:|---:|---|---|"]
    for sc in r["scenarios"]:
        runs = sc["runs"]
        speedups = "; ".join("-" if x["predicted_speedup"] is None or x["measured_speedup"] is None else
                             f"{x['predicted_speedup']:.2f}x vs {x['measured_speedup']:.2f}x "
                             f"({x['prediction_error']:.0%})" for x in runs)
        after = [x["after_window_starts_at_s"] for x in runs if x["after_window_starts_at_s"] is not None]
        rows.append(f"| {sc['scenario']} | {sc['steps_per_run']} | {_mmm([x['trials_until_kept'] for x in runs])} | "
                    f"{_mmm(after, '{:.1f} s')} | {_mmm([x['tuned_over_oracle'] for x in runs], '{:.2f}')} | "
                    f"{speedups} | {'; '.join(label(x['kept']) or 'no change' for x in runs)} |")
    commands = dict.fromkeys(sc.get("command", r["command"]) for sc in r["scenarios"])
    rows += ["", f"Predict, then verify: {', '.join(f'`{c}`' for c in commands)}. Each repeat is a run under "
             "`PipeOpt(tune=...)` beside a run of the same length with the best setting, interleaved: for the loader "
             "scenarios `tune=(\"loader\",)` from `num_workers=0` against the oracle grid's best setting (cpu_decode: "
             "the best of the worker counts `--sweep` ran at the run's length, `predict_verify_sweep.json`); `dali`: "
             "the ImageFolder of `dali_cpu_decode` under `tune=(\"loader\", \"dali\")` from `num_workers=0` against "
             "DALI's CPU pipeline; `precision`: the compute-bound MLP in fp32 under `tune=(\"precision\",)` against "
             "the same run in `bf16-mixed`; `batch_fold`: that MLP in micro-batches of 64 accumulated 4 times under "
             "`tune=(\"batch\",)` against batches of 256. Trials exclude the before-window; the after-window's start "
             "is wall time from the fit's start; pipeopt / oracle is steady throughput over each run's last quarter; "
             "the error is |predicted - measured| / measured of the kept change's speedup (its trial over the window "
             "before, against its after-window over the same)."]
    return rows


def write_markdown() -> Path:
    lines = [
        "# Benchmark results",
        "",
        "Generated by `python -m benchmarks.run all --tuned-repeats 4` (and `make bench-dali` for the DALI row); each "
        "row's figures come from one invocation, side by side. Every figure with repeats reads *median [min - max]* "
        "over them; every repeat is in the scenario's JSON file, and every result ever published is kept in "
        "[history/](history/) (table at the end).",
        "",
        "| scenario | naive (num_workers=0) samples/s | grid best (short runs) | pipeopt samples/s (steady) | "
        "oracle samples/s (same-length runs) | pipeopt / oracle (pairs) | time lost to tuning | pipeopt chose | "
        "observation overhead |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    results = [RESULTS / f"{name}.json" for name in sorted(SCENARIOS) if (RESULTS / f"{name}.json").exists()]
    details: list[str] = []
    for path in results:
        r = json.loads(path.read_text())
        o = r.get("observation_overhead")
        overhead = f"{o['overhead_pct']:+.1f} %" if o else "-"
        p = r.get("pipeopt")
        naive = next(row for row in r["grid"] if row["settings"] == r["naive"]["settings"])
        if p:
            tuned = _mmm([t["samples_per_s"] for t in p["tuned_runs"]])
            oracle = _mmm([t["samples_per_s"] for t in p["oracle_runs"]])
            ratio = _mmm(pair_ratios(p), "{:.2f}")
            lost = _mmm([t["wall_s"] - o["wall_s"] for t, o in zip(p["tuned_runs"], p["oracle_runs"])], "{:+.1f} s")
            chose = "; ".join(label(c) or "no change" for c in p["changes_per_run"])
        else:
            tuned = oracle = ratio = lost = chose = "-"
        lines.append(
            f"| {r['scenario']} | {_mmm(naive['runs'])} | {label(r['oracle_best']['settings'])} | {tuned} | {oracle} | "
            f"{ratio} | {lost} | {chose} | {overhead} |"
        )
        details += ["", f"## {r['scenario']}: {r['description']}", "", f"`{r['command']}` on "
                    f"{r['machine']['cpus']} CPUs ({r['machine']['device']}), torch {r['machine']['torch']}", "",
                    "| loader settings | samples/s, median [min - max] of the repeats |", "|---|---:|"]
        for row in r["grid"]:
            details.append(f"| {label(row['settings'])} | {_mmm(row['runs'])} |")
    lines.append("")
    lines.append("pipeopt / oracle: a run started from the naive setting under `PipeOpt(tune=(\"loader\",))` beside a "
                 "run of the same length with the grid's best setting, interleaved in pairs; steady throughput over "
                 "the last quarter of each run. The oracle column is these same-length runs (the ratio's "
                 "denominators), not the short grid runs that chose the setting. Time lost to tuning: wall time of "
                 "each pair's first minus its second. *pipeopt chose*: the changes it kept, per run. Observation "
                 "overhead: throughput lost by running `PipeOpt(tune=())` on the naive setting, (1 - observed / "
                 "plain) of medians; negative means the observed runs happened to be faster (noise).")
    dali = RESULTS / "dali_cpu_decode.json"
    if dali.exists():
        d = json.loads(dali.read_text())
        best = next(row for row in d["grid"] if row["settings"] == d["best_dataloader"])
        ours = d["grid"][-1]
        tuned = d["pipeopt"]
        kept = "; ".join(label(run["kept"] or {}) or "no change" for run in tuned["runs"])
        ratios = [a / b for a, b in zip(ours["runs"], best["runs"])]
        lines += ["", "| DALI (`make bench-dali`) | best DataLoader | its samples/s | DALI CPU samples/s | DALI / best "
                  "DataLoader (rounds) | naive loader under PipeOpt (steady) | pipeopt kept |",
                  "|---|---|---:|---:|---:|---:|---|",
                  f"| {d['scenario']} | {label(best['settings'])} | {_mmm(best['runs'])} | {_mmm(ours['runs'])} | "
                  f"{_mmm(ratios, '{:.2f}')} | {_mmm([run['samples_per_s'] for run in tuned['runs']])} | {kept} |", "",
                  "DALI: the CPU-decode images as a torchvision ImageFolder; every arm runs the same "
                  f"{d['steps_per_run']} steps ({d['warmup_steps']} of warm-up, then measured), in rounds whose order "
                  "rotates; the ratio is DALI over the best DataLoader setting within each round. Under PipeOpt: "
                  "`tune=(\"loader\", \"dali\")` from `num_workers=0`, steady over the last half of a 400-step run "
                  "(not interleaved with an arm: an absolute figure)."]
        details += ["", f"## {d['scenario']}: {d['description']}", "", f"`{d['command']}` on "
                    f"{d['machine']['cpus']} CPUs ({d['machine']['device']}), torch {d['machine']['torch']}", "",
                    "| loader | samples/s, median [min - max] of the repeats |", "|---|---:|"]
        details += [f"| {label(row['settings'])} | {_mmm(row['runs'])} |" for row in d["grid"]]
    predict = RESULTS / "predict_verify.json"
    if predict.exists():
        lines += predict_verify_rows(json.loads(predict.read_text()))
    cached = RESULTS / "sample_cache.json"
    if cached.exists():
        from benchmarks.sample_cache import sample_cache_rows  # imports pipeopt's callback: only when there is data

        lines += sample_cache_rows(json.loads(cached.read_text()))
    book = RESULTS / "bookkeeping.json"
    if book.exists():
        b = json.loads(book.read_text())
        lines.append("")
        lines.append(f"Direct bookkeeping cost (`{b['command']}`): {b['bookkeeping_us_per_step']:.0f} us per step, "
                     f"{b['share_of_compute_bound_step_pct']:.2f} % of the compute-bound scenario's "
                     f"{b['compute_bound_step_ms']:.0f} ms step - the side-by-side fits above cannot resolve "
                     "below their +-2 % noise.")
    details += ["", "## Every published result", "",
                "Each file in [history/](history/), oldest first: the code changed between them, so they are not "
                "repeats of one measurement; they are kept so that no worse run is hidden by a later one.", "",
                "| when (UTC) | commit | scenario | command | ratio, median [min - max] over its pairs |",
                "|---|---|---|---|---|", *_history_rows()]
    path = RESULTS / "README.md"
    extra = _extra_sections(path)
    path.write_text("\n".join(lines + details) + "\n" + extra)
    _update_readme(lines[4:])
    return path


#: Sections of results/README.md written by hand (test-suite flake rates, ...), kept when the tables are redone.
EXTRA_MARKER = "<!-- sections below are not generated -->"


def _extra_sections(path: Path) -> str:
    text = path.read_text() if path.exists() else ""
    return "\n" + text[text.index(EXTRA_MARKER):] if EXTRA_MARKER in text else ""


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
        keep_in_history(result)
        console.print(f"{name}: naive/oracle {result['naive_over_oracle']:.2f} "
                      f"(best {label(result['oracle_best']['settings'])}) -> {out}")
    console.print(f"table: {write_markdown()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
