"""Predict, then verify: how many live trials the loader search needs, how soon the after-window starts, how close
a short run gets to the best setting, and how far the kept change's prediction is from what the run then did.

    python -m benchmarks.predict_verify [--repeats 3] [--steps 1500] [--scenarios storage_latency cpu_decode]

For each scenario, in one invocation: a run from the naive setting under ``PipeOpt(tune=("loader",))`` beside a
run of the same length with the oracle grid's best setting (``benchmarks/results/<scenario>.json``), interleaved in
pairs whose order alternates. Per tuned run: live trials until the kept setting, wall time from the fit's start to
the start of its after-window, steady throughput over the run's last quarter over its paired oracle run's, and
``|predicted - measured| / measured`` of the kept change's speedup. Every repeat is kept. Writes
``benchmarks/results/predict_verify.json`` (and a copy in ``results/history/``) and regenerates the results tables.
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from typing import Any

from benchmarks.harness import median, quiet_pipeopt, run_fit
from benchmarks.run import RESULTS, keep_in_history, machine, write_markdown
from benchmarks.scenarios import SCENARIOS

STEADY_FROM = 0.75


def tuned_figures(report: Any, batch_ends: list[float], tuned: dict[str, float], oracle: dict[str, float],
                  batch_size: int) -> dict[str, Any]:
    after = report.after
    after_start = (batch_ends[after.first_step - 1]  # the after-window of a kept change (else: the run's last)
                   if after is not None and after.first_step > 0 and report.changes else None)
    return {
        "trials_until_kept": len(report.trials) - 1,
        "kept": {c.knob: c.after for c in report.changes},
        "after_window_starts_at_s": after_start,
        "tuned_samples_per_s": tuned["samples_per_s"],
        "oracle_samples_per_s": oracle["samples_per_s"],
        "tuned_over_oracle": tuned["samples_per_s"] / oracle["samples_per_s"],
        "predicted_speedup": report.predicted_speedup,
        "measured_speedup": report.measured_speedup,
        "prediction_error": report.prediction_error,
        "trials": [{"settings": t.settings, "predicted_samples_per_s": t.predicted_samples_per_s,
                    "samples_per_s": t.samples_per_s, "status": t.status} for t in report.trials],
        "notes": [n for n in report.notes if n.startswith(("loader model", "loader search", "the fit"))],
    }


def scenario_figures(name: str, repeats: int, steps: int) -> dict[str, Any]:
    s = SCENARIOS[name]
    best = json.loads((RESULTS / f"{name}.json").read_text())["oracle_best"]["settings"]
    dataset = s.make_dataset()
    runs = []
    for r in range(repeats):
        pair: dict[str, Any] = {}
        for with_pipeopt in ((True, False) if r % 2 == 0 else (False, True)):
            if with_pipeopt:
                callback, ends = quiet_pipeopt(tune=("loader",)), []
                pair["tuned"] = run_fit(s, dataset, s.naive, [callback], steps=steps, steady_from=STEADY_FROM,
                                        batch_ends=ends)
                pair["report"], pair["ends"] = callback.report, ends
            else:
                pair["oracle"] = run_fit(s, dataset, best, steps=steps, steady_from=STEADY_FROM)
        runs.append(tuned_figures(pair["report"], pair["ends"], pair["tuned"], pair["oracle"], s.batch_size))

    def med(key: str) -> float | None:
        values = [r[key] for r in runs if r[key] is not None]
        return median(values) if values else None

    return {"scenario": name, "description": s.description, "steps_per_run": steps, "oracle_settings": best,
            "median_trials_until_kept": med("trials_until_kept"),
            "median_after_window_starts_at_s": med("after_window_starts_at_s"),
            "median_tuned_over_oracle": med("tuned_over_oracle"), "median_prediction_error": med("prediction_error"),
            "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--scenarios", nargs="+", default=["storage_latency", "cpu_decode"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    result = {"scenario": "predict_verify", "command": (f"python -m benchmarks.predict_verify --repeats "
                                                        f"{args.repeats} --steps {args.steps} --scenarios "
                                                        f"{' '.join(args.scenarios)}"),
              "machine": machine(), "scenarios": [scenario_figures(n, args.repeats, args.steps)
                                                  for n in args.scenarios]}
    path = RESULTS / "predict_verify.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    keep_in_history(result)
    write_markdown()
    for sc in result["scenarios"]:
        print(json.dumps({k: v for k, v in sc.items() if k != "runs"}, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
