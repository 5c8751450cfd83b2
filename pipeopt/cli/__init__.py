"""The command line: ``pipeopt tune SCRIPT [options] [-- script args]`` and ``pipeopt report FILE.json``."""

from pipeopt.cli.main import main

__all__ = ["main"]
