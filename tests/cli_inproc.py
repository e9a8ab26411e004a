"""A command's ``main`` run in the test's own process, answered as ``subprocess.run`` answers.

Why: a command that fails on bad input exits 2 within a second of its imports, but a fresh interpreter pays those
imports again (torch, Lightning, vLLM's config: 2-7 CPU-seconds each time on the 2-core machine the suite is measured
on), dozens of times across the suite. The exit status, stdout and stderr are the same as the console script's, since
the script is ``sys.exit(main())``; each command keeps one test through a real process (its ``--help`` or a real
run) for the script's wiring. What a fresh process would also print lands in the captured stderr too: log handlers
set up earlier in this process write there for the run, and warnings show there under Python's default filters (not
pytest's, which would record them instead). The environment, the logging configuration and the SIGINT and SIGTERM handlers a
run changes are put back after it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence


def run_main(main: Callable[[list[str]], int | None], args: Sequence[str],
             env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``main(args)`` with ``env`` as the whole environment (default: this one), its exit status (a ``SystemExit``'s
    code, as the interpreter would exit with it) and what it wrote to stdout and stderr."""
    saved_env = dict(os.environ)
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    loggers = [logging.root, *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    saved_logging = [(lg, lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers]
    out, err = io.StringIO(), io.StringIO()
    to_stderr = [(h, h.stream) for lg in loggers for h in lg.handlers if type(h) is logging.StreamHandler
                 and not _is_stdout(h.stream)]
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            _python_default_warnings(err)
            for h, _ in to_stderr:
                h.setStream(err)
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code
    finally:
        for sig, handler in saved_signals.items():
            signal.signal(sig, handler)
        for h, stream in to_stderr:
            h.setStream(stream)
        os.environ.clear()
        os.environ.update(saved_env)
        for lg, level, handlers, propagate, disabled in saved_logging:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): the message on stderr, status 1
        err.write(f"{code}\n")
        code = 1
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def _is_stdout(stream: object) -> bool:
    return stream is sys.__stdout__ or getattr(stream, "name", None) == "<stdout>"


def _python_default_warnings(err: io.StringIO) -> None:
    """The filters a fresh interpreter starts with, showing on ``err`` (inside ``warnings.catch_warnings``)."""
    warnings.resetwarnings()
    for action, category in (("ignore", ResourceWarning), ("ignore", ImportWarning),
                             ("ignore", PendingDeprecationWarning), ("ignore", DeprecationWarning)):
        warnings.simplefilter(action, category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: err.write(
        warnings.formatwarning(message, category, filename, lineno, line))
