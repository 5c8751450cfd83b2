"""Run a CPU subset of Lightning's own tests plainly and with PipeOpt attached to every Trainer; print the tests
that fail only with PipeOpt (``make test-lightning``).

    python tests/lightning/run_suite.py LIGHTNING_TESTS_DIR [--out results.json]

LIGHTNING_TESTS_DIR is the ``tests/`` folder of a Lightning-AI/pytorch-lightning checkout (``tests_pytorch`` inside),
at the tag of the installed ``lightning`` or close to it. Three runs: plain, ``PIPEOPT_TUNE=none`` (observe only) and
``PIPEOPT_TUNE=default``; a test counts against pipeopt when it passes plainly and fails or errors with PipeOpt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

#: The subset: data loading, the loops, the Trainer's flags, early stopping, checkpointing, the batch-size tuner and
#: the throughput monitor - the parts of Lightning a loader, precision and batch tuner touches.
SUBSET = [
    "tests_pytorch/trainer/test_dataloaders.py",
    "tests_pytorch/loops",
    "tests_pytorch/trainer/flags",
    "tests_pytorch/callbacks/test_early_stopping.py",
    "tests_pytorch/checkpointing/test_model_checkpoint.py",
    "tests_pytorch/tuner/test_scale_batch_size.py",
    "tests_pytorch/callbacks/test_throughput_monitor.py",
]
HERE = Path(__file__).resolve().parent


def run(tests_dir: Path, tune: str | None, junit: Path) -> tuple[dict[str, str], float]:
    """One pytest run of the subset; each test's outcome (passed, failed, error, skipped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    plugin: list[str] = []
    if tune is not None:
        env["PIPEOPT_TUNE"] = tune
        env["PIPEOPT_TRIED_LOG"] = str(junit.with_suffix(".tried.json"))
        plugin = ["-p", "pipeopt_everywhere"]
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", *plugin,
                    f"--junit-xml={junit}", "--timeout=300", *SUBSET], cwd=tests_dir, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        outcomes[name] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                          else "skipped" if "skipped" in kinds else "passed")
    return outcomes, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    tests_dir = args.tests_dir.resolve()
    if not (tests_dir / "tests_pytorch").is_dir():
        parser.error(f"{tests_dir} has no tests_pytorch/: pass the tests/ folder of a Lightning checkout")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "pipeopt-lightning-suite"
    work.mkdir(parents=True, exist_ok=True)
    plain, plain_s = run(tests_dir, None, work / "plain.xml")
    summary: dict[str, object] = {"subset": SUBSET, "plain": _counts(plain, plain_s)}
    worst = 0
    for tune in ("none", "default"):
        with_pipeopt, seconds = run(tests_dir, tune, work / f"pipeopt-{tune}.xml")
        only = sorted(n for n, o in with_pipeopt.items() if o in ("failed", "error") and plain.get(n) == "passed")
        exercised = _exercised(work / f"pipeopt-{tune}.tried.json")
        summary[f"tune={tune}"] = {**_counts(with_pipeopt, seconds), "fail_only_with_pipeopt": only, **exercised}
        print(f"PIPEOPT_TUNE={tune}: {len(only)} test(s) fail only with PipeOpt "
              f"({_counts(with_pipeopt, seconds)}; {exercised})")
        for name in only:
            print(f"    {name}")
        worst = max(worst, len(only))
    print(f"plain: {summary['plain']}")
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if worst else 0


def _exercised(path: Path) -> dict[str, object]:
    """How many tests built a Trainer, how many of those tried a setting (by trial kind), and how many had a fit
    too short to tune."""
    if not path.exists():
        return {}
    tests = json.loads(path.read_text())
    with_fits = [t for t in tests.values() if t["fits"]]
    kinds: dict[str, int] = {}
    for t in with_fits:
        for kind in t["tried"]:
            kinds[kind] = kinds.get(kind, 0) + 1
    return {"tests_with_a_trainer": len(with_fits),
            "tests_that_tried_a_setting": sum(1 for t in with_fits if t["tried"]),
            "tests_by_trial_kind": kinds,
            "tests_with_a_fit_too_short_to_tune": sum(1 for t in with_fits if t["too_short"])}


def _counts(outcomes: dict[str, str], seconds: float) -> dict[str, object]:
    counts = {kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("passed", "failed", "error", "skipped")}
    return {**counts, "seconds": round(seconds)}


if __name__ == "__main__":
    sys.exit(main())
