"""How vLLM finds and configures the InferScale plugin: module paths and settings.

vLLM loads the connector class :data:`CONNECTOR_CLASS` from :data:`CONNECTOR_MODULE`
(``kv_transfer_config``) and mixes :data:`WORKER_EXTENSION` into its worker class
(``worker_extension_cls``); :func:`kv_transfer_config` builds the former from a
:class:`ConnectorConfig`, whose fields travel as ``kv_connector_extra_config`` (the
connector's only settings). :data:`PARAMS_KEY` names the connector's entry in a
request's ``kv_transfer_params`` (the memory it asks for, and what was injected).

Imports nothing of vLLM: the serving engine (:mod:`inferscale.serve.engine`) builds its
engine arguments from here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from inferscale.artifacts.layout import StoreConfig
from inferscale.types import GPU_BUDGET_BYTES, HOST_BUDGET_BYTES, TIERS

CONNECTOR_MODULE = "inferscale.vllm_plugin.connector"
CONNECTOR_CLASS = "InferScaleConnector"
WORKER_EXTENSION = "inferscale.vllm_plugin.worker_ext.InferScaleWorkerExtension"
PARAMS_KEY = "inferscale"


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from ``kv_connector_extra_config``."""

    model_fingerprint: str
    artifact_root: str = ""
    storage_options: dict = field(default_factory=dict)
    gpu_budget_bytes: int = GPU_BUDGET_BYTES
    host_budget_bytes: int = HOST_BUDGET_BYTES
    reload_tier: str = "host"  # where background reloads of a user not resident land
    auto_reload: bool = True
    reload_workers: int = 2  # background reloads running at once (a pool, not a thread each)
    reload_backoff_s: float = 30.0  # first wait after a failed reload; doubles per failure
    reload_backoff_max_s: float = 600.0
    # background reloads share this read bandwidth (0: no bound), a fraction of a disk's
    # (1.1-2.1 GB/s on the H100/H200 machines) so requests' own reads keep the rest
    reload_bytes_per_s: int = 512 << 20
    # and read in parts of this size, one at a time each, so a request's read of facts
    # queues behind at most reload_workers x reload_part_bytes of their I/O on the disk
    reload_part_bytes: int = 8 << 20
    # a miss promotes its user (a whole-user reload) only when the user's requests, each
    # weighing half per promote_half_life_s of age, are >= promote_min_requests and exceed
    # the least-asked resident's by promote_margin, once the tiers are full (promotion.py)
    promote_half_life_s: float = 300.0
    promote_min_requests: float = 1.5  # 1.5: a second request within a half-life
    promote_margin: float = 1.0  # one request more than the least-asked resident
    # a request of a user in neither tier: its facts are read from storage for it, at most
    # this many tokens at a time over all requests (0: such requests prefill instead)
    fetch_tokens: int = 65536
    fetch_workers: int = 8  # parallel range reads
    # versions whose chunk index a worker keeps (least recently used dropped; ~1 MB each
    # for 400 fp8 facts of an 8B model, mostly their scales)
    index_cache: int = 256
    fetch_timeout_s: float = 10.0  # a read that cannot start or finish by then is recomputed
    # a read the server started ahead of its request (a prefetch) and no request adopted
    # is dropped this long after its deadline, its staging memory given back
    prefetch_keep_s: float = 1.0
    # bytes of pinned host memory that reads from storage land in (whole users and facts),
    # and of device memory that read facts wait in until injected; taken once at start-up
    staging_bytes: int = 4 << 30
    device_staging_bytes: int = 1 << 30
    # a local store's reads (whole users, single facts) bypass the page cache
    # (StoreConfig.direct_io, INFERSCALE_STORAGE_DIRECT_IO)
    direct_io: bool = False

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("kv_connector_extra_config needs 'model_fingerprint'")
        if self.reload_tier not in TIERS:
            raise ValueError(f"reload_tier must be 'gpu' or 'host', got {self.reload_tier!r}")
        if self.gpu_budget_bytes < 0 or self.host_budget_bytes < 0:
            raise ValueError("byte budgets must be >= 0")
        if self.reload_workers < 1:
            raise ValueError(f"reload_workers must be >= 1, got {self.reload_workers}")
        if self.reload_part_bytes < 1:
            raise ValueError(f"reload_part_bytes must be > 0, got {self.reload_part_bytes}")
        if not 0 <= self.reload_backoff_s <= self.reload_backoff_max_s:
            raise ValueError("need 0 <= reload_backoff_s <= reload_backoff_max_s")
        for name in ("reload_bytes_per_s", "fetch_tokens", "staging_bytes",
                     "device_staging_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.promote_half_life_s > 0 or not self.promote_min_requests >= 0 \
                or not self.promote_margin >= 0:
            raise ValueError("need promote_half_life_s > 0, promote_min_requests >= 0 and "
                             "promote_margin >= 0")
        if self.fetch_workers < 1 or self.index_cache < 1 or self.fetch_timeout_s <= 0 \
                or self.prefetch_keep_s < 0:
            raise ValueError("fetch_workers and index_cache must be >= 1, fetch_timeout_s "
                             "> 0 and prefetch_keep_s >= 0")
        if not isinstance(self.direct_io, bool):
            raise ValueError(f"direct_io must be true or false, got {self.direct_io!r}")

    @classmethod
    def from_store(cls, store: StoreConfig, **fields) -> "ConnectorConfig":
        """The connector reading ``store`` (its root, options and direct I/O), with the
        other ``fields`` given."""
        return cls(artifact_root=store.root, storage_options=dict(store.storage_options),
                   direct_io=store.direct_io, **fields)

    def store(self) -> StoreConfig:
        """The artifact store the worker reads (every StoreConfig it builds is this one)."""
        return StoreConfig(self.artifact_root, dict(self.storage_options),
                           direct_io=self.direct_io)

    def backoff_s(self, failures: int) -> float:
        """Seconds to wait before reloading again after ``failures`` failures in a row."""
        return min(self.reload_backoff_max_s, self.reload_backoff_s * 2 ** max(0, failures - 1))

    @classmethod
    def from_extra_config(cls, extra: dict) -> "ConnectorConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        return cls(**extra)

    def extra_config(self) -> dict:
        """The ``kv_connector_extra_config`` that :meth:`from_extra_config` reads back."""
        return asdict(self)


def kv_transfer_config(config: ConnectorConfig) -> dict:
    """vLLM's ``kv_transfer_config`` that loads the connector with ``config``: a consumer
    only, whose failed loads vLLM recomputes."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": config.extra_config(),
    }
