"""How a published version is shown to people: a stable key per (user, model), a table
of the version's lineage, and URIs that name the published files.

- :func:`artifact_key`: the key of a (user, model) history in an orchestrator's artifact
  store. Only lowercase letters, digits and dashes: ``mem-<user>-<fp12>`` where ``<user>``
  is the user id when it already is such a slug (``maya``), else a slug of it plus 8 hex
  digits of its hash, so distinct ids never share a key.
- :func:`version_rows`: the lineage of one version as ``{"field", "value"}`` rows: version,
  previous version, parents (log, facts), model fingerprint, encoder config, counts, file
  sizes and checksums, and where the files are. :func:`version_of_rows` reads the version
  back (so a caller can tell whether a table already describes a version).
- :func:`version_markdown`: the same lineage as a short markdown text with links.
- :func:`location_uri`: the URI of a (user, model) folder or a version folder (a file://
  URL for local stores); :func:`asset_key` makes any URI a valid asset key (URI syntax,
  none of the characters asset keys refuse).

Used by the Prefect task that records a published version's lineage
(``tasks/lineage.py``), the flows' summaries and the run reports
(:mod:`inferscale.pipeline.plan`); nothing here imports Prefect.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

from storage_schemas.manifest import Manifest
from inferscale.artifacts.layout import StoreConfig, user_dirname

_SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_MAX_SLUG = 40
# characters an asset key may not hold (Prefect's list), and '%': keys stay unescaped
_ASSET_BAD = re.compile(r"[\s#?&%\"'<>\[\]{}|\\^`\x00]")
_PUNCT = re.compile(r"[!-/:-@\[-`{-~]")  # every ASCII punctuation character


def artifact_key(user: str, model_fp: str) -> str:
    """``mem-<user slug>-<first 12 characters of the fingerprint>``."""
    if _SLUG.fullmatch(user) and len(user) <= _MAX_SLUG:
        slug = user
    else:
        base = re.sub(r"[^a-z0-9]+", "-", user.lower()).strip("-")[:_MAX_SLUG].strip("-")
        digest = hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        slug = f"{base}-{digest}" if base else f"u-{digest}"
    return f"mem-{slug}-{fingerprint_slug(model_fp)}"


def fingerprint_slug(model_fp: str) -> str:
    """The first 12 characters of a fingerprint, as a key part (lowercase, no dashes)."""
    return re.sub(r"[^a-z0-9]+", "", model_fp.lower())[:12] or "model"


def location_uri(store: StoreConfig, user: str, model_fp: str, version: str | None = None) -> str:
    """URI of the (user, model) folder, or of one version's folder."""
    parts = ["users", user_dirname(user), model_fp] + ([version] if version else [])
    if store.is_local:
        return Path(store.root, *parts).as_uri()
    return "/".join([store.root.rstrip("/"), *parts])


def asset_key(uri: str) -> str:
    """``uri`` as a valid asset key: a lowercase scheme and no refused characters."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "file", Path(uri).resolve().as_posix()
    return f"{scheme.lower()}://{_ASSET_BAD.sub('-', rest)}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def version_rows(store: StoreConfig, manifest: Manifest, previous: str | None = None
                 ) -> list[dict[str, str]]:
    """The lineage of one version as ``{"field", "value"}`` rows (see module docstring)."""
    m = manifest
    folder = location_uri(store, m.user, m.model_fingerprint, m.version)
    rows = [
        ("version", m.version),
        ("user", m.user),
        ("previous version", previous or "(none)"),
        ("parent: log", m.parents.get("log", "")),
        ("parent: facts", m.parents.get("facts", "")),
        ("model fingerprint", m.model_fingerprint),
        ("encoder config", json.dumps(m.encoder_config, sort_keys=True)),
        ("facts / chunks / tokens", f"{m.counts.get('facts')} / {m.counts.get('chunks')} / "
                                    f"{m.counts.get('tokens')}"),
        ("kv", f"{m.kv.get('dtype')} layers={m.kv.get('layers')} kv_heads={m.kv.get('kv_heads')} "
               f"head_dim={m.kv.get('head_dim')}"),
    ]
    for name, entry in sorted(m.files.items()):
        rows.append((name, f"{entry.bytes} bytes ({_size(entry.bytes)}), "
                           f"xxh3-128 {entry.xxh3_128}"))
    rows += [
        ("manifest", f"{folder}/manifest.json (xxh3-128 {m.to_dict()['checksum']})"),
        ("files", folder),
        ("created", m.created),
        ("producer", m.producer),
    ]
    return [{"field": f, "value": str(v)} for f, v in rows]


def version_of_rows(rows: Sequence[dict[str, Any]] | str) -> str | None:
    """The version a :func:`version_rows` table describes (``rows`` as JSON text too)."""
    if isinstance(rows, str):
        try:
            rows = json.loads(rows)
        except json.JSONDecodeError:
            return None
    if not isinstance(rows, list):
        return None
    for row in rows:
        if isinstance(row, dict) and row.get("field") == "version":
            return str(row.get("value"))
    return None


def version_markdown(store: StoreConfig, manifest: Manifest, previous: str | None = None,
                     run_link: str | None = None) -> str:
    """Short markdown lineage of one version (the table's description).

    Every value from data (user id, fingerprint, version ids, parents, the folder URL) is
    escaped: it reads as its own text and never becomes markup, a link or HTML.
    ``run_link`` is the caller's own markdown, used as is."""
    m = manifest
    folder = _url(location_uri(store, m.user, m.model_fingerprint, m.version))
    lines = [
        f"**{_text(m.user)}** · model {_code(m.model_fingerprint[:12])} · version "
        f"{_code(m.version)}",
        "",
        f"- parents: log {_code(m.parents.get('log', '')[:16])}, facts "
        f"{_code(m.parents.get('facts', '')[:16])}",
        f"- previous version: {_code(previous)}" if previous else "- first version for this model",
        f"- files: [{_text(m.version)}]({folder}) ([manifest]({folder}/manifest.json))",
    ]
    if run_link:
        lines.append(f"- {run_link}")
    return "\n".join(lines)


def _one_line(value: Any) -> str:
    return " ".join(str(value).splitlines())


def _text(value: Any) -> str:
    """``value`` as literal markdown text: one line, every ASCII punctuation character
    backslash-escaped (CommonMark then makes no emphasis, link, heading or HTML of it)."""
    return _PUNCT.sub(r"\\\g<0>", _one_line(value))


def _code(value: Any) -> str:
    """``value`` as a code span: fenced by more backticks than any run inside it (inside
    a code span nothing is markup); ``(none)`` when empty."""
    text = _one_line(value)
    if not text.strip():
        return "(none)"
    fence = "`" * (max(map(len, re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _url(uri: str) -> str:
    """``uri`` with everything but its scheme, ``/``, ``-.~`` and existing ``%`` escapes
    percent-encoded: a link destination no data can break out of, with nothing that makes
    markup where a renderer refuses the scheme (``file:``) and shows it as text."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "", uri
    return f"{scheme}{sep}{quote(rest, safe='/%').replace('_', '%5F')}"
