"""pipeopt: keep the accelerator busy.

``Trainer(callbacks=[PipeOpt()])`` measures the live run (data wait, transfer, compute, utilisation),
judges whether it is input- or compute-bound and reports before/after figures.
"""

from pipeopt._version import __version__
from pipeopt.callbacks import PipeOpt
from pipeopt.config import TUNE_GROUPS, PipeOptConfig

__all__ = ["PipeOpt", "PipeOptConfig", "TUNE_GROUPS", "__version__"]
