"""The report: one dataclass (model), rendered to the console, to JSON and to the Trainer's loggers."""

from pipeopt.report.model import Change, Environment, Report, Skipped, Trial

__all__ = ["Change", "Environment", "Report", "Skipped", "Trial"]
