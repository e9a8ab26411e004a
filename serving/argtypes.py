"""argparse value types, and checks of values that settings share, for the ``lengthwise`` commands."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def comma_list(kind: Callable[[str], T], example: str = "1,2") -> Callable[[str], list[T]]:
    """An argparse ``type`` for ``A,B,...``: a bad item is argparse's one-line error (exit 2), with an example."""
    def parse(text: str) -> list[T]:
        try:
            items = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            items = []
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list like {example}, got {text!r}")
        return items
    return parse


def http_url(url: str) -> str:
    """A server's base URL as settings keep it (no trailing slash); ValueError, with an example, for one that is not
    http(s)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{url!r} is not an http(s) URL, e.g. http://127.0.0.1:8001")
    return url.rstrip("/")


class OneLineParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2): an operator greps a log line, not a usage block.

    Subcommand parsers inherit the class, so every ``lengthwise`` command answers the same way.
    """

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def flag_error(exc: object, flags: dict[str, str] | None = None) -> str:
    """A pydantic ``ValidationError`` from settings built out of flags, as one line naming the flag at fault.

    ``flags`` maps a field to its flag where the two differ; otherwise ``max_tokens`` is ``--max-tokens``. An error of
    the whole model (a check across fields) names no flag: its message does.
    """
    err = exc.errors()[0]  # type: ignore[attr-defined]
    msg = " ".join(str(err["msg"]).removeprefix("Value error, ").split())
    if not err["loc"]:
        return msg
    field = str(err["loc"][0])
    return f"{(flags or {}).get(field, '--' + field.replace('_', '-'))}: {msg}"
