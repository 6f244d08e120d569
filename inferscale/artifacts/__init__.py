"""Stage 4, artifacts: versioned, content-addressed memory artifacts per (user, model) on
a local directory or an object store.

- :mod:`inferscale.artifacts.layout`: where files live (the store root, user-id folder
  names, file names), :class:`~inferscale.artifacts.layout.StoreConfig` and every error;
- :mod:`inferscale.artifacts.blobs`: file operations (atomic writes, exclusive creates,
  compare-and-swap, reads fused with checksums) on local disk and
  :class:`~inferscale.artifacts.blobs.Location`; the same on object stores in
  :mod:`~inferscale.artifacts.object_store`, over the interface in
  :mod:`~inferscale.artifacts.blob_base`;
- :mod:`inferscale.artifacts.kv_file`: the kv.arrow file, laid out from the encoder's
  output and parsed in place once verified; :mod:`~inferscale.artifacts.mapped_file`: a
  local file memory-mapped, its checksum fused into the read;
  :mod:`~inferscale.artifacts.direct_io`: local files read around the page cache
  (``O_DIRECT``), for an honest storage tier;
- :mod:`inferscale.artifacts.fact_table`: the LanceDB table of fact embeddings;
- :mod:`inferscale.artifacts.publish`, :mod:`~inferscale.artifacts.latest`,
  :mod:`~inferscale.artifacts.read`, :mod:`~inferscale.artifacts.gc`: publishing, moving
  LATEST (newest inputs win), reading and removing versions;
- :mod:`inferscale.artifacts.staleness`: which users need re-encoding for a model (their
  log hash and the run's identity against their ``LATEST``);
- :mod:`inferscale.artifacts.lineage_view`: how a version's lineage is shown to people;
- :mod:`inferscale.artifacts.result_codec`: the cached task results (facts, encoded KV)
  as Arrow IPC, never pickles.
"""
