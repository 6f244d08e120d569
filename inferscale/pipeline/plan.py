"""Which users a re-encoding run encodes: the one skip decision of the nightly and
backfill flows.

:func:`plan_run` plans every user against their ``LATEST`` version
(:func:`inferscale.artifacts.staleness.plan_users`, for the run's
:class:`~inferscale.encode.identity.RunIdentity`) and splits them into a
:class:`RunPlan`: the users to encode (with why), the users skipped as up to date (with
the version ``LATEST`` names) and the users whose planning failed (reported, not
encoded). :meth:`RunPlan.outcomes` gives the report's outcome of every user the run does
not encode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pyarrow as pa

from inferscale.artifacts.lineage_view import artifact_key
from inferscale.artifacts.staleness import UserPlan, plan_users
from inferscale.facts.extractor import FactsConfig
from inferscale.pipeline.config import PipelineConfig
from inferscale.pipeline.report import UserOutcome


@dataclass(frozen=True)
class RunPlan:
    """``encode``: user -> why it is encoded (``new``, ``log-changed``, ...);
    ``up_to_date``: user -> the version ``LATEST`` names (skipped); ``failed``: user ->
    why their planning failed."""

    encode: dict[str, str]
    up_to_date: dict[str, str]
    failed: dict[str, str]

    @classmethod
    def of(cls, plans: Mapping[str, UserPlan]) -> "RunPlan":
        """The decision for each user's :class:`UserPlan`."""
        return cls({u: p.reason for u, p in sorted(plans.items()) if p.needs_encoding},
                   {u: p.latest for u, p in sorted(plans.items()) if p.reason == "up-to-date"},
                   {u: p.detail for u, p in sorted(plans.items()) if p.reason == "failed"})

    def outcomes(self, turns: Mapping[str, pa.Table], model_fp: str) -> list[UserOutcome]:
        """The outcome of every user the run does not encode: ``up-to-date`` (with its
        version and lineage key) or ``failed`` with the planning error."""
        return [UserOutcome(u, "up-to-date", v, "up-to-date", turns=turns[u].num_rows,
                            artifact_key=artifact_key(u, model_fp))
                for u, v in self.up_to_date.items()] + \
            [UserOutcome.failed(u, "planning", detail) for u, detail in self.failed.items()]


def plan_run(cfg: PipelineConfig, facts_cfg: FactsConfig, model_fp: str,
             log_hashes: Mapping[str, str]) -> RunPlan:
    """The :class:`RunPlan` of the users of ``log_hashes`` (user -> current turns hash)
    for this run's identity (``cfg`` and ``facts_cfg`` for the model ``model_fp``)."""
    return RunPlan.of(plan_users(cfg.store(), cfg.run_identity(facts_cfg, model_fp),
                                 log_hashes))
