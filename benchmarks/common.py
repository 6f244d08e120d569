"""What every benchmark does the same way: record its command line and write its result."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path


def command_line(argv: list[str] | None) -> str:
    """The command that produced a result, as one could type it again."""
    args = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    return "python " + " ".join(shlex.quote(a) for a in args)


def write_result(result: dict, out: str | None) -> dict:
    """Write ``{"command", "device", "rows", "summary", ...}`` to ``out`` (if given) and
    print the summary."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))
    return result
