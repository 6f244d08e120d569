"""The outcome of an encode, re-encode or backfill run, per user and in total.

Each user ends in one :class:`UserOutcome` (``published``: a new version; ``unchanged``:
its inputs were already published, ``LATEST`` names that version; ``up-to-date``: skipped
without encoding, see :mod:`inferscale.artifacts.staleness`; ``failed``: with the error),
with how many of its facts were reused from its previous version and how many encoded. A
:class:`RunReport` collects them with the ingest counts and renders the run summary as a
dict (what a flow and ``inferscale encode`` return), as markdown and as table rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["published", "unchanged", "up-to-date", "failed"]


@dataclass(frozen=True)
class UserOutcome:
    user: str
    status: Status
    version: str | None = None
    reason: str = ""  # why the user was (or was not) encoded: new, log-changed, ...
    facts: int | None = None
    turns: int | None = None
    reused: int | None = None  # facts whose K/V was read from the previous version
    encoded: int | None = None  # facts that went through a forward pass in this run
    kv_bytes: int | None = None
    seconds: float | None = None
    artifact_key: str | None = None
    error: str | None = None
    worker: str | None = None  # host:pid of the process that ran the user's chain

    @classmethod
    def failed(cls, user: str, reason: str, error: BaseException | str,
               artifact_key: str | None = None) -> "UserOutcome":
        """A user whose chain raised ``error`` (or ended with that message)."""
        msg = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        return cls(user, "failed", reason=reason, error=msg, artifact_key=artifact_key)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RunReport:
    title: str
    model_fingerprint: str
    outcomes: list[UserOutcome]
    ingest: dict[str, Any] = field(default_factory=dict)
    quarantine_uri: str | None = None
    seconds: float | None = None

    @property
    def failed(self) -> list[UserOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o in self.outcomes:
            out[o.status] = out.get(o.status, 0) + 1
        return out

    def fact_counts(self) -> dict[str, int]:
        """Facts reused from previous versions and facts encoded, over every user."""
        return {"reused": sum(o.reused or 0 for o in self.outcomes),
                "encoded": sum(o.encoded or 0 for o in self.outcomes)}

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title, "model_fingerprint": self.model_fingerprint,
            "counts": self.counts(), "facts": self.fact_counts(), "ingest": self.ingest,
            "quarantine_uri": self.quarantine_uri, "seconds": self.seconds,
            "users": {o.user: o.to_dict() for o in self.outcomes},
        }

    def table(self) -> list[dict[str, Any]]:
        """One row per user: status, version, counts, time, error."""
        return [{
            "user": o.user, "status": o.status, "reason": o.reason, "version": o.version or "",
            "facts": o.facts if o.facts is not None else "",
            "reused": o.reused if o.reused is not None else "",
            "encoded": o.encoded if o.encoded is not None else "",
            "kv_bytes": o.kv_bytes if o.kv_bytes is not None else "",
            "seconds": round(o.seconds, 2) if o.seconds is not None else "",
            "error": o.error or "",
        } for o in sorted(self.outcomes, key=lambda o: (o.status != "failed", o.user))]

    def markdown(self, key_link: str = "/artifacts/key/{key}") -> str:
        """The run summary; each user's lineage key is linked with ``key_link``."""
        counts = ", ".join(f"{n} {s}" for s, n in sorted(self.counts().items())) or "no users"
        facts = self.fact_counts()
        lines = [f"# {self.title}", "",
                 f"Model `{self.model_fingerprint}` · {counts} · facts: {facts['reused']} "
                 f"reused, {facts['encoded']} encoded"
                 + (f" · {self.seconds:.1f} s" if self.seconds is not None else ""), ""]
        if self.ingest:
            reasons = ", ".join(f"{k}: {v}" for k, v in self.ingest.get("reasons", {}).items())
            lines.append(f"Logs: {self.ingest.get('records_read', 0)} records read, "
                         f"{self.ingest.get('turns_kept', 0)} turns kept, "
                         f"{self.ingest.get('quarantined', 0)} quarantined"
                         + (f" ({reasons})" if reasons else "")
                         + (f" → `{self.quarantine_uri}`" if self.quarantine_uri
                            and self.ingest.get("quarantined") else "") + ".")
            lines.append("")
        lines += ["| user | status | reason | version | facts | reused | encoded | seconds | "
                  "lineage |", "|---|---|---|---|---|---|---|---|---|"]
        for o in sorted(self.outcomes, key=lambda o: o.user):
            link = (f"[{o.artifact_key}]({key_link.format(key=o.artifact_key)})"
                    if o.artifact_key else "")
            status = o.status if not o.error else f"{o.status}: {_cell(o.error)}"
            lines.append(f"| {_cell(o.user)} | {status} | {o.reason} | "
                         f"{(o.version or '')[:12]} | {_num(o.facts)} | {_num(o.reused)} | "
                         f"{_num(o.encoded)} | "
                         f"{'' if o.seconds is None else f'{o.seconds:.1f}'} | {link} |")
        return "\n".join(lines) + "\n"


def _num(n: int | None) -> str:
    return "" if n is None else str(n)


def _cell(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"
