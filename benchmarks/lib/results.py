"""What every benchmark does the same way: record the command that made a result, and
write the result file ``{"command", "device", "rows", "summary", ...}``."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from pathlib import Path


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that produced a result, as one could type it again: ``python -m
    module ARGS`` (``argv``: the arguments ``main`` was given; None: this process's)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def cpu_device(*extra: str) -> str:
    """A CPU benchmark's ``device``: the processor and Python, then ``extra`` notes."""
    return f"{platform.processor() or 'cpu'} (python {', '.join((sys.version.split()[0], *extra))})"


def write_result(result: dict, out: str | None) -> dict:
    """Write ``result`` to ``out`` (if given) and print its summary."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"]))
    return result
