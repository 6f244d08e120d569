"""benchmarks/gpu/h200.sh stays in step with the package: the script parses (``bash -n``),
every Python block it embeds (heredocs fed to ``python -`` and ``python -c`` strings)
imports only modules and names that exist, and every ``python -m benchmarks.X`` it runs
exists and accepts the flags it is given (each module's own argparse parser reads them,
shell variables replaced by their defaults or placeholders). The GPU machine is the
first to run this script, with no way to fix it there: a moved module or a renamed flag
must fail here. The modules are imported by the names the script gives them (none
statically: what this tests is the script)."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "benchmarks" / "gpu" / "h200.sh"
TEXT = SCRIPT.read_text()
LOGICAL = re.sub(r"\\\n\s*", " ", TEXT)  # continuation lines joined
PYTHON = r'(?:python3?|"\$py")'
PLACEHOLDER = "1"  # a shell value the test cannot know: a number, and a path


def embedded_python() -> list[tuple[str, str]]:
    """(where, code) of every Python block the script runs."""
    blocks = []
    for m in re.finditer(rf"^[^\n]*{PYTHON} -[^\n]*<<\s*'?(\w+)'?\n(.*?)\n\1\n", TEXT,
                         re.S | re.M):
        blocks.append((f"heredoc at line {TEXT[:m.start()].count(chr(10)) + 2}", m.group(2)))
    for m in re.finditer(rf"{PYTHON} -c (?:'([^']*)'|\"([^\"]*)\")", TEXT):
        code = m.group(1) if m.group(1) is not None else m.group(2)
        var = re.fullmatch(r"\$(\w+)", code)
        if var:  # "$ver": the code is in a variable
            code = re.search(rf"\b{var.group(1)}=\"([^\"]*)\"", TEXT).group(1)
        blocks.append((f"-c at line {TEXT[:m.start()].count(chr(10)) + 1}", code))
    return blocks


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_embedded_import_exists():
    blocks = embedded_python()
    assert len(blocks) >= 4, "the extraction found too few embedded Python blocks"
    problems = []
    for where, code in blocks:
        tree = ast.parse(code, where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wanted = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                wanted = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in wanted:
                try:
                    mod = importlib.import_module(module)
                except ImportError as exc:
                    problems.append(f"{where}: import {module}: {exc}")
                    continue
                if name and not hasattr(mod, name) and \
                        importlib.util.find_spec(f"{module}.{name}") is None:
                    problems.append(f"{where}: {module} has no {name}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ the commands it runs


def _functions() -> dict[str, str]:
    """Shell function -> what it echoes (the flag-building functions: ``load_args``)."""
    out = {}
    for m in re.finditer(r"^(\w+)\(\) \{[^\n]*\n(.*?)\n\}", LOGICAL, re.S | re.M):
        echo = re.search(r"^\s*echo (.*)$", m.group(2), re.M)
        if echo:
            out[m.group(1)] = echo.group(1)
    return out


def _assignment(name: str) -> str | None:
    """The first value the script assigns to ``name`` (``name=...`` or ``local name=...``):
    a double-quoted string, a ``${...}`` or ``$(...)`` expansion, or a bare word."""
    m = re.search(rf"(?:^|[\s;]){name}=", LOGICAL, re.M)
    if m is None:
        return None
    i = m.end()
    if LOGICAL.startswith('"', i):
        return LOGICAL[i + 1:LOGICAL.index('"', i + 1)]
    if LOGICAL.startswith(("${", "$("), i):
        return LOGICAL[i:_closing(LOGICAL, i + 2, LOGICAL[i + 1], "}" if LOGICAL[i + 1] == "{"
                                  else ")")]
    return re.match(r"[^\s;]*", LOGICAL[i:]).group(0)


def _closing(text: str, i: int, open_: str, close: str) -> int:
    """The index after the ``close`` that matches an ``open_`` just before ``i`` (quotes
    skipped)."""
    depth, quote = 1, None
    while depth:
        c = text[i]
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        else:
            depth += {open_: 1, close: -1}.get(c, 0)
        i += 1
    return i


def expand(text: str, quoted: bool = False, depth: int = 0, bound: dict | None = None) -> str:
    """``text`` with the shell's expansions replaced: ``$(function)`` by what the function
    echoes, ``${VAR:-default}`` by the default, ``${VAR:+alt}`` by the alternative,
    ``$VAR`` by the script's own assignment or a placeholder, other command substitutions
    by nothing (unquoted: no word) or a placeholder (in double quotes). ``bound``: values
    of variables known to be set (inside ``${VAR:+alt}``, VAR is)."""
    bound = bound or {}
    assert depth < 10, f"expansion loops on {text!r}"
    functions = _functions()
    out, i, in_dq = [], 0, quoted
    while i < len(text):
        c = text[i]
        if c == "'" and not in_dq:
            j = text.index("'", i + 1)
            out.append(text[i:j + 1])
            i = j + 1
            continue
        if c == "#" and not in_dq and (i == 0 or text[i - 1].isspace()):
            break  # a comment to the end of the line
        if c == '"':
            in_dq = not in_dq
            out.append(c)
            i += 1
            continue
        if c != "$":
            out.append(c)
            i += 1
            continue
        if text.startswith("$((", i):  # arithmetic
            j = text.index("))", i)
            out.append(PLACEHOLDER)
            i = j + 2
            continue
        if text.startswith("$(", i):
            j = _closing(text, i + 2, "(", ")")
            inner = text[i + 2:j - 1].strip()
            out.append(expand(functions[inner], in_dq, depth + 1, bound) if inner in functions
                       else PLACEHOLDER if in_dq else "")
            i = j
            continue
        if text.startswith("${", i):
            j = _closing(text, i + 2, "{", "}")
            m = re.match(r"(\w+)(?::[-+](.*))?$", text[i + 2:j - 1], re.S)
            name, alt, end = m.group(1), m.group(2), j
        else:
            m = re.match(r"\$(\w+|[@*#?])", text[i:])
            name, alt, end = m.group(1), None, i + m.end()
        if alt and text[i + 3 + len(name)] == "+":  # ${VAR:+alt}: as if VAR were set
            value = expand(alt, in_dq, depth + 1, {**bound, name: PLACEHOLDER})
        elif alt:  # ${VAR:-default}: as if unset
            value = expand(alt, in_dq, depth + 1, bound)
        elif name in bound:
            value = bound[name]
        else:
            assigned = _assignment(name)
            value = PLACEHOLDER if assigned is None else expand(assigned, in_dq, depth + 1, bound)
            if assigned is not None and not value and in_dq:
                value = PLACEHOLDER
        out.append(value)
        i = end
    return "".join(out)


def invocations() -> list[tuple[str, list[str]]]:
    """(benchmarks module, its arguments) for every benchmark the script runs (``python
    -m benchmarks.X``; ``python benchmarks/X.py`` too, which the tests below refuse)."""
    found = []
    pattern = re.compile(rf"{PYTHON}\s+(?:benchmarks/([\w/]+)\.py|-m\s+benchmarks\.([\w.]+))(.*)")
    for line in LOGICAL.splitlines():
        if line.lstrip().startswith("#"):
            continue
        m = pattern.search(line)
        if m is None:
            continue
        words = []
        lexer = shlex.shlex(expand(m.group(3)), posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        for word in lexer:
            if word and set(word) <= set(";&|<>()"):
                break  # the command ends (a redirection, a pipe, a list)
            words.append(word)
        found.append((m.group(2) or m.group(1).replace("/", "."), words))
    return found


class _Parsed(Exception):
    pass


def test_every_benchmark_it_runs_exists_and_takes_its_flags(monkeypatch):
    runs = invocations()
    assert {"load", "ttft", "locomo"} <= {name for name, _ in runs}
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    problems = []
    for name, argv in runs:
        if not (REPO / "benchmarks" / f"{name.replace('.', '/')}.py").is_file():
            problems.append(f"benchmarks.{name} does not exist")
            continue
        module = importlib.import_module(f"benchmarks.{name}")
        if not hasattr(module, "main"):  # reads sys.argv itself (goodput: result paths)
            continue
        try:
            module.main(argv)
        except _Parsed:
            continue
        except SystemExit as exc:  # argparse refused the flags
            problems.append(f"benchmarks.{name} refuses {shlex.join(argv)} ({exc})")
            continue
        problems.append(f"benchmarks.{name} ran without parsing its arguments")
    assert not problems, "\n".join(problems)


def test_every_benchmark_runs_as_a_module():
    """``python -m benchmarks.X`` from the repository root, as the GPU machine runs them
    (a script path would miss the package on ``sys.path``)."""
    scripts = [line for line in LOGICAL.splitlines() if not line.lstrip().startswith("#")
               and re.search(rf"{PYTHON}\s+benchmarks/[\w/]+\.py", line)]
    assert not scripts, scripts


def test_every_load_run_resolves_its_flags(monkeypatch, capsys):
    """benchmarks.load's checks across flags (``resolve``), through its estimate: what the
    GPU machine's runs would be refused for before they start."""
    load = importlib.import_module("benchmarks.load")
    runs = [argv for name, argv in invocations() if name == "load"]
    assert any("--peer" in argv for argv in runs)
    for argv in runs:
        try:
            load.main([*argv, "--estimate-only"])
        except SystemExit as exc:
            pytest.fail(f"benchmarks.load refuses {shlex.join(argv)}: {capsys.readouterr().err}"
                        f" ({exc})")
        assert "estimate for" in capsys.readouterr().out


def test_expansion_follows_the_shell():
    assert expand('--out "$OUT/x.json"') == '--out "/tmp/out/x.json"'
    assert expand('--model "$UNSET_HERE"') == f'--model "{PLACEHOLDER}"'
    assert expand("--rates ${RATES:-8 12}") == "--rates 8 12"
    assert expand("${TAIL:+--text-tail $TAIL}") == f"--text-tail {PLACEHOLDER}"
    assert expand("a $(cat f) b") == "a  b" and expand('a "$(cat f)"') == f'a "{PLACEHOLDER}"'
    assert "--groups 8" in expand("$(load_args)")


def test_test_files_it_runs_exist():
    named = set(re.findall(r"\btests/[\w/]+\.py\b", LOGICAL))
    assert named, "the script runs no test file (the extraction broke?)"
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, missing


@pytest.mark.parametrize("phase", ["prepare", "install", "load", "load-poll", "peer"])
def test_usage_names_each_phase(phase):
    assert re.search(rf"^\s+{phase}\)", TEXT, re.M), f"h200.sh has no {phase} phase"


def test_a_staged_part_and_the_tracked_tree_fit_one_device_call():
    """Each staging call carries one part and the repository's tracked files, 64 MiB at
    most: results committed after a run grow the tree, and the GPU machine refuses the
    call (costing device time) once the two pass the limit."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if files.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = sum((REPO / p).stat().st_size for p in files.stdout.decode().split("\0")
                  if p and (REPO / p).is_file())
    part_mib = int(re.search(r"^PART_MIB=\$\{PART_MIB:-(\d+)\}", TEXT, re.M).group(1))
    margin = 1 << 20  # untracked files git does not ignore, in a working checkout
    assert tracked + (part_mib << 20) + margin <= 64 << 20, (
        f"tracked tree {tracked / 2**20:.1f} MiB + {part_mib} MiB parts: lower PART_MIB")
