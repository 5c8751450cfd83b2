"""Run a user's script as ``__main__``, with its own arguments, and report how it ended."""

from __future__ import annotations

import runpy
import sys
import traceback
from pathlib import Path


def run_script(script: Path, argv: list[str]) -> int:
    """Run ``script`` as ``python script argv...`` would; return its exit status. A script that raises has its
    traceback printed (from its own first frame on, without pipeopt's) and exits 1."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.resolve().parent))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException as err:  # the user's error: show it as Python would, then fail
        _print_user_traceback(err, script)
        return 130 if isinstance(err, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _print_user_traceback(err: BaseException, script: Path) -> None:
    tb = traceback.TracebackException.from_exception(err)
    target = str(script.resolve())
    frames = list(tb.stack)
    first = next((i for i, f in enumerate(frames) if str(Path(f.filename).resolve()) == target), 0)
    tb.stack = traceback.StackSummary.from_list(frames[first:])
    sys.stderr.write("".join(tb.format()))
