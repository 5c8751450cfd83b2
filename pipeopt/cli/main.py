"""``pipeopt tune`` and ``pipeopt report``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from pipeopt._version import __version__
from pipeopt.config import TUNE_GROUPS, PipeOptConfig, unknown_groups

if TYPE_CHECKING:  # imported at run time only when there is a run to tune (it imports torch and Lightning)
    from pipeopt.callbacks import PipeOpt

USAGE = """\
pipeopt tune SCRIPT [--budget SECONDS] [--only GROUPS] [--report-dir DIR] [--full] [--no-cache | --cache FILE]
             [--cost-per-hour PRICE] [--sample-cache-dir DIR] [--keep-sample-cache] [-- SCRIPT ARGS...]
pipeopt report FILE.json [--html OUT.html]"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeopt", usage=USAGE, description=(
        "Measure and tune a PyTorch Lightning training run. `tune` runs an unmodified script with PipeOpt "
        "attached to every Trainer it creates; `report` re-renders a saved report."))
    parser.add_argument("--version", action="version", version=f"pipeopt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{tune,report}")

    tune = sub.add_parser("tune", usage=USAGE.splitlines()[0], help="tune a training script's run")
    tune.add_argument("script", type=Path, help="the training script (run as __main__)")
    tune.add_argument("--budget", type=float, default=60.0, metavar="SECONDS",
                      help="wall-clock budget for all tuning trials (default 60)")
    tune.add_argument("--only", default=",".join(TUNE_GROUPS), metavar="GROUPS",
                      help=f"comma-separated knob groups to tune, from {','.join(TUNE_GROUPS)} (default: all); "
                           "'none' observes only")
    tune.add_argument("--report-dir", type=Path, default=Path("pipeopt_reports"), metavar="DIR",
                      help="where the JSON and HTML reports go (default pipeopt_reports)")
    tune.add_argument("--full", action="store_true",
                      help="train to the end (default: stop the fit cleanly once tuning is done and verified)")
    tune.add_argument("--cost-per-hour", type=float, metavar="PRICE",
                      help="what an hour of the run's machines costs (any currency): the report then gives the cost "
                           "of an epoch and of the whole fit before and after tuning")
    tune.add_argument("--sample-cache-dir", type=Path, metavar="DIR",
                      help="a local disk directory for the sample cache (default: shared memory when it has room, "
                           "else under the report directory, sized by free memory)")
    tune.add_argument("--keep-sample-cache", action="store_true",
                      help="keep the sample cache after the fit: a rerun on the same data starts with it filled")
    cache = tune.add_mutually_exclusive_group()
    cache.add_argument("--no-cache", action="store_true", help="neither use nor store tuned configurations")
    cache.add_argument("--cache", type=Path, metavar="FILE", help="the tuning cache file (default: see docs)")

    report = sub.add_parser("report", usage=USAGE.splitlines()[-1], help="re-render a saved JSON report")
    report.add_argument("file", type=Path, help="a report written by PipeOpt (report_dir/*.json)")
    report.add_argument("--html", type=Path, metavar="OUT.html", help="also write it as an HTML page")
    return parser


def parse_only(text: str) -> tuple[str, ...]:
    """``--only loader,precision`` -> groups; names the unknown ones and what is allowed."""
    if text.strip().lower() == "none":
        return ()
    groups = tuple(g.strip() for g in text.split(",") if g.strip())
    unknown = unknown_groups(groups)
    if unknown or not groups:
        raise ValueError(f"--only {text!r}: unknown group(s) {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(TUNE_GROUPS)}, or 'none' to observe only")
    return groups


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "report":
        return _report(args, parser)
    return _tune(args, script_args, parser)


def _tune(args: argparse.Namespace, script_args: list[str], parser: argparse.ArgumentParser) -> int:
    from pipeopt.callbacks import (
        PipeOpt,  # imports torch and Lightning: only when there is a run to tune
    )
    from pipeopt.cli.attach import attached
    from pipeopt.cli.script import run_script

    script: Path = args.script
    if not script.is_file():
        parser.error(f"{script}: no such file (pass the path of your training script)")
    try:
        script.read_bytes()
    except OSError as err:
        parser.error(f"{script}: cannot be read ({err.strerror})")
    try:
        groups = parse_only(args.only)
        options = dict(tune=groups, budget_s=args.budget, report_dir=args.report_dir,
                       cache=False if args.no_cache else (args.cache or True), stop_when_tuned=not args.full,
                       cost_per_hour=args.cost_per_hour, sample_cache_dir=args.sample_cache_dir,
                       keep_sample_cache=args.keep_sample_cache)
        PipeOptConfig(**options)  # every value checked before the script runs
    except ValueError as err:
        parser.error(str(err).replace("PipeOpt(budget_s=", "--budget (")
                     .replace("PipeOpt(cost_per_hour=", "--cost-per-hour (").replace("PipeOpt(", "("))

    console = Console()
    made: list[PipeOpt] = []

    def make() -> PipeOpt:
        made.append(PipeOpt(console=console, **options))
        return made[-1]

    with attached(make, PipeOpt) as in_use:
        status = run_script(script, script_args)
    if any(cb not in made for cb in in_use):
        console.print(f"pipeopt: {script} creates its own PipeOpt, used as the script configured it (the options "
                      "given to `pipeopt tune` apply only to Trainers without one).", highlight=False)
    if status != 0:
        console.print(f"[bold red]pipeopt:[/bold red] {script} exited with status {status}; see its output above.")
        return status
    fitted = [cb for cb in in_use if cb.report is not None]
    if not fitted:
        what = "never created a Trainer" if not in_use else "never called Trainer.fit"
        console.print(f"[bold red]pipeopt:[/bold red] {script} {what}, so there was no training run to measure. "
                      "pipeopt tune runs scripts that train with a Lightning Trainer's fit().")
        return 3
    for callback in fitted:
        _summarise(callback, console)
    return 0


def _summarise(callback: PipeOpt, console: Console) -> None:
    report = callback.report
    for code in report.suggestions if report is not None else []:
        console.print(f"[bold]Keep it without pipeopt:[/bold] {code}", highlight=False)
    for path in (callback.report_path, callback.html_path):
        if path is not None:
            console.print(f"Report: {path}", highlight=False)
    if callback.cache_path is not None:
        console.print(f"Tuning cache: {callback.cache_path}", highlight=False)


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pipeopt.report.console import print_report
    from pipeopt.report.html import write_html
    from pipeopt.report.json_io import read_report

    try:
        report = read_report(args.file)
    except FileNotFoundError:
        parser.error(f"{args.file}: no such file")
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as err:
        parser.error(f"{args.file} is not a pipeopt report ({type(err).__name__}: {err})")
    print_report(report, Console())
    if args.html is not None:
        try:
            write_html(report, args.html)
        except OSError as err:
            parser.error(f"--html {args.html}: cannot write ({err.strerror})")
        Console().print(f"HTML report: {args.html}", highlight=False)
    return 0
