"""Stage 1, ingest: conversation logs (native JSONL, LoCoMo JSON; any fsspec URI) ->
validated per-user turn tables, bad records quarantined with a reason.

- :mod:`inferscale.ingest.logs`: :func:`~inferscale.ingest.logs.read_logs`, the turns'
  content hash, the quarantine file, the project's sample conversation;
- :mod:`inferscale.ingest.formats`: the two readers;
- :mod:`inferscale.ingest.records`: validation of one record, quarantined records.
"""
