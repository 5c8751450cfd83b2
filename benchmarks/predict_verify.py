"""Predict, then verify: how many live trials the tuner needs, how soon the after-window starts, how close a short
run gets to the best setting, and how far the kept change's prediction is from what the run then did.

    python -m benchmarks.predict_verify [--repeats 3] [--steps 1500] [--scenarios storage_latency cpu_decode ...]
    .venv-vision/bin/python -m benchmarks.predict_verify --scenarios dali    (torchvision and DALI: .venv-vision)
    python -m benchmarks.predict_verify --sweep --repeats 2 --scenarios cpu_decode    (the plan's oracle, measured)

For each plan (``PLANS``), in one invocation: a run from the user's setting under ``PipeOpt(tune=...)`` beside a
run of the same length with the best setting - for a loader plan the oracle grid's (``benchmarks/results/
<scenario>.json``), for precision the run in ``bf16-mixed``, for a batch plan the effective batch as one
micro-batch, for the DALI plan DALI's CPU pipeline made from the same loader (``dali_decode``'s best arm); where
a plan has a sweep of worker counts, the best of them run at the plan's length (``--sweep``, written to
``results/predict_verify_sweep.json``: the grid's short runs cannot show what many workers do over a long one) -
interleaved in pairs whose order alternates. Per tuned run: live trials until the kept setting, wall
time from the fit's start to the start of its after-window, steady throughput over the run's last quarter over its
paired oracle run's, and ``|predicted - measured| / measured`` of the kept change's speedup. Every repeat is kept.
Writes ``benchmarks/results/predict_verify.json`` (merged per plan, so the two venvs' runs sit side by side; a
copy of this invocation's in ``results/history/``) and regenerates the results tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness import median, quiet_pipeopt, run_fit
from benchmarks.run import RESULTS, keep_in_history, machine, write_markdown
from benchmarks.scenarios import SCENARIOS

STEADY_FROM = 0.75


@dataclass(frozen=True)
class Plan:
    """A tuned run and the best setting it is measured against: the scenario, the groups pipeopt may tune, the
    tuned run's micro-batch and Trainer options, the oracle's (``oracle_loader`` None: the oracle grid's best)."""

    scenario: str
    tune: tuple[str, ...]
    steps: int | None = None  # optimizer steps per run (None: --steps)
    batch_size: int | None = None  # the tuned run's micro-batch (None: the scenario's)
    trainer: dict[str, Any] = field(default_factory=dict)
    oracle_loader: dict[str, Any] | None = None
    oracle_trainer: dict[str, Any] = field(default_factory=dict)
    sweep: tuple[int, ...] = ()  # worker counts ``--sweep`` runs at this plan's length (its best: the oracle)


PLANS = {
    "storage_latency": Plan("storage_latency", ("loader",)),
    # the oracle grid's short runs stop at 4 workers; at 1,500 steps more workers read faster (``--sweep``)
    "cpu_decode": Plan("cpu_decode", ("loader",), sweep=(3, 4, 6, 8, 12, 16, 24)),
    # the compute-bound MLP in fp32, against the same run in bf16 (on a CPU with bf16 units)
    "precision": Plan("compute_bound", ("precision",), steps=400, oracle_loader={"num_workers": 0},
                      oracle_trainer={"precision": "bf16-mixed"}),
    # the same MLP in micro-batches of 64 accumulated 4 times, against its 256-sample effective batch in one
    "batch_fold": Plan("compute_bound", ("batch",), steps=400, batch_size=64,
                       trainer={"accumulate_grad_batches": 4}, oracle_loader={"num_workers": 0}),
    # dali_decode's ImageFolder from the naive loader with DALI allowed, against DALI's CPU pipeline (its best arm)
    "dali": Plan("dali_cpu_decode", ("loader", "dali"), oracle_loader={"dali": "cpu"}),
}


def scenario_of(plan: Plan) -> Any:
    if plan.scenario == "dali_cpu_decode":
        from benchmarks import dali_decode

        return dali_decode.SCENARIO
    return SCENARIOS[plan.scenario]


def oracle_loader(s: Any, dataset: Any, settings: dict[str, Any]) -> Any:
    """The oracle's loader: None for a DataLoader setting (``run_fit`` makes it), DALI's made from the scenario's."""
    if not settings.get("dali"):
        return None
    from pipeopt.dali import loader_from

    return loader_from(s.loader(dataset), device=settings["dali"])


#: Labels of the windows that try a setting of a group other than the loader (whose trials are the report's rows).
TRIAL_LABELS = ("precision trial:", "batch trial:")


def after_window(report: Any) -> Any:
    """The after-window of the kept change: the loader's, else the first window labelled "after" that follows the
    last trial window; None when nothing was kept."""
    if not report.changes:
        return None
    if any(c.knob in ("num_workers", "prefetch_factor", "persistent_workers", "pin_memory", "dali", "cache")
           for c in report.changes):
        return report.after
    windows = report.timeline
    last_trial = max((i for i, w in enumerate(windows) if w.label.startswith(TRIAL_LABELS)), default=-1)
    return next((w for w in windows[last_trial + 1:] if w.label.startswith("after")), None)


def tuned_figures(report: Any, batch_ends: list[float], tuned: dict[str, float], oracle: dict[str, float],
                  batch_size: int) -> dict[str, Any]:
    after = after_window(report)
    after_start = batch_ends[after.first_step - 1] if after is not None and after.first_step > 0 else None
    others = {w.label for w in report.timeline if w.label.startswith(TRIAL_LABELS)}
    errors = [abs(c.predicted_speedup - c.measured_speedup) / c.measured_speedup for c in report.changes
              if c.predicted_speedup is not None and c.measured_speedup]
    return {
        "trials_until_kept": max(0, len(report.trials) - 1) + len(others),
        "kept": {c.knob: c.after for c in report.changes},
        "after_window_starts_at_s": after_start,
        "tuned_samples_per_s": tuned["samples_per_s"],
        "oracle_samples_per_s": oracle["samples_per_s"],
        "tuned_over_oracle": tuned["samples_per_s"] / oracle["samples_per_s"],
        "predicted_speedup": next((c.predicted_speedup for c in report.changes if c.predicted_speedup), None),
        "measured_speedup": next((c.measured_speedup for c in report.changes if c.measured_speedup), None),
        "prediction_error": errors[0] if errors else None,
        "trials": [{"settings": t.settings, "predicted_samples_per_s": t.predicted_samples_per_s,
                    "samples_per_s": t.samples_per_s, "status": t.status} for t in report.trials],
        "windows": [{"label": w.label, "first_step": w.first_step, "steps": w.steps,
                     "samples_per_s": w.sustained_per_s, "data_wait_frac": w.data_wait_frac} for w in report.timeline
                    if not w.label.startswith("after") or w is after],
        "notes": [n for n in report.notes if n.startswith(("loader model", "loader search", "the fit", "precision",
                                                           "batch"))],
    }


#: The worker counts ``--sweep`` measured at each plan's run length, and their best (the oracle where present).
SWEEPS = RESULTS / "predict_verify_sweep.json"


def swept_best(name: str, steps: int) -> dict[str, Any] | None:
    """The best setting of the plan's sweep at this run length (None: not swept)."""
    sweeps = json.loads(SWEEPS.read_text()) if SWEEPS.exists() else {}
    sweep = sweeps.get(name)
    return sweep["best"] if sweep and sweep["steps_per_run"] == steps else None


def sweep_figures(name: str, repeats: int, steps: int) -> dict[str, Any]:
    """Every count of the plan's sweep run for ``steps`` (interleaved, the order alternating), steady throughput
    over the last quarter as in the paired runs; the best median is the plan's oracle from then on."""
    plan = PLANS[name]
    s = scenario_of(plan)
    dataset = s.make_dataset()
    settings = [{"num_workers": n, "persistent_workers": True, "prefetch_factor": 2} for n in plan.sweep]
    runs: dict[int, list[float]] = {n: [] for n in plan.sweep}
    for r in range(repeats):
        for one in (settings if r % 2 == 0 else settings[::-1]):
            runs[one["num_workers"]].append(run_fit(s, dataset, one, steps=steps, steady_from=STEADY_FROM)
                                            ["samples_per_s"])
    best = max(settings, key=lambda one: median(runs[one["num_workers"]]))
    return {"steps_per_run": steps, "runs": {str(n): rates for n, rates in runs.items()}, "best": best,
            "command": f"python -m benchmarks.predict_verify --sweep --repeats {repeats} --steps {steps} "
                       f"--scenarios {name}", "machine": machine()}


def scenario_figures(name: str, repeats: int, steps: int) -> dict[str, Any]:
    plan = PLANS[name]
    s = scenario_of(plan)
    steps = plan.steps or steps
    best = (plan.oracle_loader if plan.oracle_loader is not None else swept_best(name, steps)
            or json.loads((RESULTS / f"{plan.scenario}.json").read_text())["oracle_best"]["settings"])
    dataset = s.make_dataset()
    effective = s.batch_size  # every plan keeps the scenario's samples per optimizer step
    tuned_loader = s.loader(dataset, **s.naive)
    if plan.batch_size is not None:
        tuned_loader = type(tuned_loader)(dataset, batch_size=plan.batch_size, shuffle=True, drop_last=True)
    runs = []
    for r in range(repeats):
        pair: dict[str, Any] = {}
        for with_pipeopt in ((True, False) if r % 2 == 0 else (False, True)):
            if with_pipeopt:
                callback, ends = quiet_pipeopt(tune=plan.tune), []
                pair["tuned"] = run_fit(s, dataset, s.naive, [callback], steps=steps, steady_from=STEADY_FROM,
                                        batch_ends=ends, loader=tuned_loader, trainer_kwargs=plan.trainer,
                                        samples_per_step=effective)
                pair["report"], pair["ends"] = callback.report, ends
            else:
                pair["oracle"] = run_fit(s, dataset, best, steps=steps, steady_from=STEADY_FROM,
                                         loader=oracle_loader(s, dataset, best), trainer_kwargs=plan.oracle_trainer)
        runs.append(tuned_figures(pair["report"], pair["ends"], pair["tuned"], pair["oracle"], s.batch_size))

    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return median(values) if values else None

    oracle = {**best, **plan.oracle_trainer}
    return {"scenario": name, "description": s.description, "tune": list(plan.tune), "steps_per_run": steps,
            "oracle_settings": oracle,
            "median_trials_until_kept": med("trials_until_kept"),
            "median_after_window_starts_at_s": med("after_window_starts_at_s"),
            "median_tuned_over_oracle": med("tuned_over_oracle"), "median_prediction_error": med("prediction_error"),
            "runs": runs}


def merged(path: Any, result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with the plans an earlier invocation measured and this one did not (each keeps its command)."""
    if not path.exists():
        return result
    earlier = json.loads(path.read_text())
    ran = {sc["scenario"] for sc in result["scenarios"]}
    kept = [{**sc, "command": sc.get("command", earlier.get("command"))} for sc in earlier.get("scenarios", [])
            if sc["scenario"] not in ran]
    now = [{**sc, "command": result["command"]} for sc in result["scenarios"]]
    return {**result, "scenarios": kept + now}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--scenarios", nargs="+", default=["storage_latency", "cpu_decode"], choices=list(PLANS))
    parser.add_argument("--sweep", action="store_true",
                        help="measure each plan's sweep of worker counts at the run length (its oracle from then on)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    if args.sweep:
        sweeps = json.loads(SWEEPS.read_text()) if SWEEPS.exists() else {}
        for name in (n for n in args.scenarios if PLANS[n].sweep):
            sweeps[name] = sweep_figures(name, args.repeats, PLANS[name].steps or args.steps)
            print(json.dumps({name: sweeps[name]["runs"], "best": sweeps[name]["best"]}))
        SWEEPS.write_text(json.dumps(sweeps, indent=2) + "\n")
        print(f"wrote {SWEEPS}")
        return 0
    result = {"scenario": "predict_verify", "command": (f"python -m benchmarks.predict_verify --repeats "
                                                        f"{args.repeats} --steps {args.steps} --scenarios "
                                                        f"{' '.join(args.scenarios)}"),
              "machine": machine(), "scenarios": [scenario_figures(n, args.repeats, args.steps)
                                                  for n in args.scenarios]}
    path = RESULTS / "predict_verify.json"
    keep_in_history(result)
    path.write_text(json.dumps(merged(path, result), indent=2, default=str) + "\n")
    write_markdown()
    for sc in result["scenarios"]:
        print(json.dumps({k: v for k, v in sc.items() if k != "runs"}, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
