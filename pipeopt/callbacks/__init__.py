from pipeopt.callbacks.pipeopt import PipeOpt

__all__ = ["PipeOpt"]
