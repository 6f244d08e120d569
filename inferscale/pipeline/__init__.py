"""The offline chain: logs -> facts -> pre-RoPE KV -> published version -> lineage record.

- :mod:`inferscale.pipeline.config`: :class:`~inferscale.pipeline.config.PipelineConfig`,
  everything a run needs, derived once from the settings;
- :mod:`inferscale.pipeline.steps`: each step as a plain function (the serving model and
  the fact extractors are opened once per process);
- :mod:`inferscale.pipeline.chain`: the one orchestration of a user's chain (LATEST
  check, per-user failure isolation); ``inferscale encode`` runs it as is, the flows in
  ``flows/`` run it with each step wrapped as a Prefect task (``tasks/``);
- :mod:`inferscale.pipeline.plan`: the one skip decision of the nightly and backfill
  flows (which users a run encodes, skips as up to date, or reports as failed);
- :mod:`inferscale.pipeline.report`: a run's outcome per user and in total.
"""
