"""The KV variants of ``benchmarks.locomo``: specs (``NAME:field=value,...``), variants
files with ``[section]`` headers (``benchmarks/locomo_variants.txt``), and which variants
share one encoding."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Variant:
    """A KV mode: a name and the encoder-config fields it sets (the rest: defaults)."""

    name: str
    fields: tuple[tuple[str, object], ...]

    def encoder_config(self, **base):
        from inferscale.encode.identity import EncoderConfig

        return EncoderConfig(**{**base, **dict(self.fields)})


def parse_variant(spec: str) -> Variant:
    """``NAME:field=value,field=value`` -> :class:`Variant` (values: int, float or text)."""
    from inferscale.encode.identity import EncoderConfig

    name, _, body = spec.partition(":")
    known = {f.name: f.type for f in fields(EncoderConfig)}
    out = []
    for item in filter(None, body.split(",")):
        key, _, raw = item.partition("=")
        if key not in known:
            raise ValueError(f"variant {name!r}: unknown encoder field {key!r}")
        value: object = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                pass
        out.append((key, value))
    if not name or name in ("prompt", "nomem"):
        raise ValueError(f"bad variant name in {spec!r}")
    return Variant(name, tuple(out))


def read_specs(text: str, section: str | None = None) -> list[str]:
    """The variant specs of a variants file: one per line, ``#`` comments; ``[name]``
    lines open a section, and ``section`` keeps only the specs under its header."""
    specs, current = [], None
    for line in text.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
        elif line and (section is None or current == section):
            specs.append(line)
    if section is not None and section not in {line.split("#")[0].strip()[1:-1].strip()
                                               for line in text.splitlines()}:
        raise ValueError(f"no [{section}] section in the variants file")
    return specs


def part_of(variants: list, part: str) -> list:
    """``part`` ``"I/N"``: the I-th of N contiguous slices of ``variants`` (sizes differ by
    at most one), for a sweep longer than one device call (``benchmarks.locomo --part``)."""
    try:
        i, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise ValueError(f"--part must be I/N, got {part!r}") from None
    if not 1 <= i <= n or n > len(variants):
        raise ValueError(f"--part {part}: need 1 <= I <= N <= {len(variants)} (the variants)")
    return variants[len(variants) * (i - 1) // n:len(variants) * i // n]


# Fields that change the layout of a request only: variants differing in these alone
# share one encoding (each still gets its own artifact version), unless calibrated (the
# calibration's probes are laid out as served).
LAYOUT_FIELDS = ("memory_order", "text_tail", "tail_max_k")
# The stored format: never part of the encoding (a stored dtype other than the engine's is
# the shared encoding converted, or quantized for fp8, as the encoder itself would:
# inferscale.encode.encoder.EncodedMemory.stored_as).
STORED_FIELDS = ("dtype",)


def encoding_key(cfg) -> str:
    """What decides a variant's encoding (variants with equal keys share one)."""
    d = cfg.to_dict()
    skip = STORED_FIELDS + (LAYOUT_FIELDS if d.get("key_calibration", "none") == "none"
                            else ())
    return json.dumps({k: v for k, v in d.items() if k not in skip}, sort_keys=True)
