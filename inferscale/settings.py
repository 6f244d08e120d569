"""The one settings class of InferScale.

Every knob a deployment sets lives here and is read from the environment with the
``INFERSCALE_`` prefix (``INFERSCALE_ARTIFACT_ROOT=s3://bucket/prefix``), or from a
``.env`` file. Components never read the environment themselves: callers build a
:class:`Settings` once (CLI start-up, a Prefect task, a test) and derive the frozen
component configs from it (``EncoderConfig``, ``StoreConfig``, ...).

``offline_environment()`` sets the variables that keep Hugging Face, Mem0 and Prefect
off the network (:data:`OFFLINE_ENV`); the CLI, flows and engine start-up call it before
importing them, and the flows pass the same list to their Ray workers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from inferscale.types import (
    DEFAULT_CONTEXT, DEFAULT_KEY_CALIBRATION, DEFAULT_MEMORY_ORDER, DEFAULT_TAIL_MAX_K,
    DEFAULT_TEXT_TAIL, DEFAULT_WINDOW, ENCODER_CONTEXTS, GPU_BUDGET_BYTES, HOST_BUDGET_BYTES,
    KEY_CALIBRATIONS, KV_DTYPES, MEMORY_ORDERS, check_user_id, default_kv_dtype)

# The settings a Ray worker of the encode flows may receive in its environment
# (``runtime_env``): an explicit allow-list of non-secret knobs. Keys, the admin key, the
# gateway secret and credentials never go there (the tasks get their store options in
# their parameters).
WORKER_ENV_SETTINGS = (
    "home", "artifact_root", "s3_endpoint_url", "s3_region", "log_uris", "model", "device",
    "kv_dtype", "window", "encoder_context", "memory_order", "text_tail", "tail_max_k",
    "key_calibration", "max_fact_tokens",
    "max_window_tokens", "encode_batch_tokens", "fact_mode", "embedder", "llm_base_url",
    "llm_model", "openai_embedding_model",
)


def default_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "inferscale"


class Settings(BaseSettings):
    """Deployment settings; environment prefix ``INFERSCALE_``."""

    model_config = SettingsConfigDict(env_prefix="INFERSCALE_", env_file=".env", extra="ignore")

    # -- where things live
    home: Path = Field(default_factory=default_home, description="cache and local data root")
    artifact_root: str = Field(
        default="", description="artifact store root URI; local dir or s3://bucket/prefix "
        "(default: {home}/artifacts)"
    )
    s3_endpoint_url: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None
    s3_region: str | None = None
    storage_direct_io: bool = Field(
        default=False, description="read a local artifact store around the page cache "
        "(O_DIRECT): what reads cost on a machine with far more users than RAM, and what an "
        "honest storage benchmark needs; off, users read again come from RAM (right for a "
        "small deployment). S3 is read by ranged GETs either way")

    # -- conversation logs read by the offline pipeline (encode, nightly, backfill)
    log_uris: list[str] = Field(
        default_factory=list, description="fsspec URIs or globs of conversation logs (JSON "
        "list in the environment); empty = the project's sample conversation")

    # -- the serving model and the encoder
    model: str = Field(default="embedded", description="HF path or hub id; 'embedded' = SmolLM2")
    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    kv_dtype: Literal[("auto", *KV_DTYPES)] = Field(  # type: ignore[valid-type]
        default="auto", description="stored K/V dtype: 'auto' (default) = float8_e4m3fn "
        "when encoding on CUDA (fp8 memory: half of bf16's bytes, scales per chunk, K/V, "
        "layer and KV head; answers within 0.005 F1 of bf16 memory), bfloat16 on the CPU "
        "(a CPU store dequantizes fp8 once: no saving); or bfloat16, float16, float32, "
        "float8_e4m3fn")
    window: int = Field(default=DEFAULT_WINDOW, ge=0,
                        description="turns of context before each fact")
    encoder_context: Literal[ENCODER_CONTEXTS] = Field(  # type: ignore[valid-type]
        default=DEFAULT_CONTEXT, description="what each fact is encoded after: 'memory' = "
        "the serving prefix and the window as memory lines; 'transcript' = the window as raw "
        "transcript (the original encoder); 'prefix' = the prefix and the raw window")
    memory_order: Literal[MEMORY_ORDERS] = Field(  # type: ignore[valid-type]
        default=DEFAULT_MEMORY_ORDER, description="order of a request's injected facts")
    text_tail: int = Field(default=DEFAULT_TEXT_TAIL, ge=0, description="the best facts "
                           "prefilled as text right before the question instead of injected")
    tail_max_k: int = Field(default=DEFAULT_TAIL_MAX_K, ge=0, description="the text tail "
                            "only when at most this many facts are retrieved (0: always)")
    key_calibration: Literal[KEY_CALIBRATIONS] = Field(  # type: ignore[valid-type]
        default=DEFAULT_KEY_CALIBRATION, description="stored fact keys tempered by "
        "temperatures fitted offline to the user's own memory: 'none', 'layer' or 'head'")
    max_fact_tokens: int = Field(default=256, ge=1)
    max_window_tokens: int = Field(default=4096, ge=0)
    encode_batch_tokens: int = Field(default=16384, ge=64)
    encode_batch_invariant: bool = Field(
        default=True, description="one forward pass per fact, so a new version reuses the "
        "K/V of unchanged facts (false: padded batches, faster on GPUs, no reuse)")

    # -- facts, embeddings
    fact_mode: Literal["mem0", "raw"] = "mem0"
    embedder: str = Field(default="embedded", description="'embedded' = packaged MiniLM, "
                          "a local sentence-transformers path, or 'openai'")
    llm_base_url: str | None = Field(default=None, description="OpenAI-compatible endpoint; "
                                     "unset = start a local vLLM server with the model")
    llm_model: str | None = None
    openai_api_key: SecretStr | None = None
    openai_embedding_model: str = "text-embedding-3-small"

    # -- orchestration: where flow runs may send things
    server_urls: list[str] = Field(
        default_factory=list, description="servers the hydrate flow and CLI may send "
        "INFERSCALE_ADMIN_KEY to (JSON list of http(s)://host:port); empty = this host's "
        "configured server (http://127.0.0.1:{port}, http://localhost:{port}, "
        "http://{host}:{port})")
    ray_addresses: list[str] = Field(
        default_factory=list, description="Ray clusters the encode flows may run tasks on "
        "(JSON list; the tasks' parameters carry the store credentials); a local Ray "
        "instance is always allowed")

    # -- serving
    host: str = "127.0.0.1"
    port: int = 8000
    top_k: int = Field(default=10, ge=1)
    api_keys: dict[str, str] = Field(default_factory=dict, description="API key -> user id")
    admin_key: SecretStr | None = None
    trusted_user_header: str | None = Field(
        default=None, description="header a trusted gateway sets to the user id")
    gateway_secret: SecretStr | None = Field(
        default=None, description="shared secret the gateway sends in "
        "X-InferScale-Gateway-Secret; needed for the trusted user header beyond loopback")
    serve_refresh_s: float = Field(
        default=60.0, ge=0, description="how often the server re-reads a user's LATEST "
        "(on that user's next request, in the background)")
    serve_memory_budget_bytes: int = Field(
        default=2 << 30, ge=0, description="facts and retrieval indexes the server keeps; "
        "least recently used users are dropped beyond it")
    serve_max_negative_entries: int = Field(
        default=10_000, ge=1, description="users the server remembers as having no usable "
        "memory (least recently used forgotten first)")
    serve_storage_misses_per_s: float = Field(
        default=20.0, ge=0, description="storage lookups per second of unauthenticated "
        "users (no API key) the server holds nothing for; API-key users are never limited")
    serve_storage_miss_burst: int = Field(
        default=100, ge=1, description="such lookups allowed at once")
    serve_storage_miss_wait_s: float = Field(
        default=2.0, ge=0, description="longest such a lookup waits for its turn; beyond "
        "it the request is answered without memory (fallback: shed)")
    replica_max_ongoing_requests: int = Field(
        default=32, ge=1, description="requests one memory replica (serve --replicas) takes "
        "at once; a user's home replica at this many spills to the user's second choice")
    replica_timeout_s: float = Field(
        default=600.0, gt=0, description="longest the gateway waits for a replica's answer "
        "or its next streamed token")
    replica_retries: int = Field(
        default=2, ge=0, description="times a request is sent again when its replica "
        "died before it produced output")
    max_request_bytes: int = Field(default=1 << 20, ge=1024, description="chat body limit")
    max_question_chars: int = Field(default=8192, ge=1)
    max_output_tokens: int = Field(default=4096, ge=1, description="largest max_tokens")
    max_top_k: int = Field(default=100, ge=1)
    gpu_budget_bytes: int = Field(default=GPU_BUDGET_BYTES, ge=0)
    host_budget_bytes: int = Field(default=HOST_BUDGET_BYTES, ge=0)
    gpu_memory_utilization: float = Field(default=0.5, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(
        default=None, gt=0, description="vLLM KV cache size; set = gpu_memory_utilization is "
        "not used to size it (and on CPU, two engines can share one host)")
    max_model_len: int = 8192
    enforce_eager: bool | None = Field(default=None, description="default: eager on CPU")
    # vLLM replays CUDA graphs only for steps of at most this many tokens (its own default:
    # min(2 x max_num_seqs, 512)). An injected request computes its query and text tail (~300
    # tokens at k = 50): above the limit its step runs eagerly, ~35 ms of kernel launches
    # on an 8B model, stalling every request in the step.
    cudagraph_max_tokens: int = Field(default=1024, ge=1)
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, description="vLLM's token budget per engine step (default: "
        "2048, EngineConfig's; `vllm serve` picks 8192 on an H100/H200): smaller steps "
        "bound how long a long prefill holds the requests batched with it")
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="vLLM tensor parallelism of the serving engine; must "
        "divide the model's KV heads (each worker holds and injects its share)")
    # a request of a user in neither tier: facts read from storage vs prefilled
    # (inferscale.serve.cold_split; docs/serving.md, "Compute or load")
    cold_split: Literal["off", "auto", "pinned"] = Field(
        default="auto", description="auto: split by the measured storage bandwidth and "
        "engine load; pinned: read INFERSCALE_COLD_SPLIT_CHUNKS leading chunks; off: read "
        "every chunk once the engine schedules the request (no prefetch)")
    cold_split_chunks: int = Field(default=0, ge=0, description="leading memory chunks "
                                   "(the instruction prefix first) read when pinned")
    cold_bandwidth_prior: float = Field(
        default=1e9, gt=0, description="storage bytes/s assumed before any read is measured")
    cold_compute_prior_s: float = Field(
        default=25e-6, gt=0, description="engine seconds per computed prompt token assumed "
        "before any request finished")
    cold_step_prior_s: float = Field(
        default=0.02, ge=0, description="busy engine step assumed before any is measured")
    cold_overhead_steps: float = Field(
        default=1.5, ge=0, description="engine steps an asynchronous load adds")
    cold_deadline_factor: float = Field(
        default=2.0, ge=1, description="a read may take this times its share of the "
        "engine's time (wait + compute it replaces) before it is recomputed")

    @field_validator("api_keys")
    @classmethod
    def _valid_key_users(cls, keys: dict[str, str]) -> dict[str, str]:
        for key, user in keys.items():
            if not key:
                raise ValueError("an API key must not be empty")
            check_user_id(user)
        return keys

    def server_url(self) -> str:
        """The root URL of this host's configured server (``host``, ``port``): what the
        admin CLI talks to by default. A wildcard address (``0.0.0.0``, ``::``) is reached
        on loopback; an IPv6 address is bracketed."""
        host = self.host.strip()
        if host in ("", "0.0.0.0"):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def admin_urls(self) -> list[str]:
        """The servers INFERSCALE_ADMIN_KEY may be sent to (``server_urls``, or this host's
        configured server)."""
        if self.server_urls:
            return list(self.server_urls)
        return list(dict.fromkeys([f"http://127.0.0.1:{self.port}",
                                   f"http://localhost:{self.port}", self.server_url()]))

    def resolved_device(self) -> str:
        """``device``, with ``"auto"`` decided: CUDA when there is one, else the CPU."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_kv_dtype(self, device: str | None = None) -> str:
        """``kv_dtype``, with ``"auto"`` decided for encoding on ``device`` (default: the
        resolved device): fp8 on CUDA, bfloat16 on the CPU."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return default_kv_dtype(device or self.resolved_device())

    def resolved_artifact_root(self) -> str:
        return self.artifact_root or str(self.home / "artifacts")

    def storage_options(self) -> dict:
        """fsspec options for the artifact root (s3fs keys when set)."""
        opts: dict = {}
        if self.s3_endpoint_url:
            opts["client_kwargs"] = {"endpoint_url": self.s3_endpoint_url}
            if self.s3_region:
                opts["client_kwargs"]["region_name"] = self.s3_region
        if self.s3_access_key_id:
            opts["key"] = self.s3_access_key_id
        if self.s3_secret_access_key:
            opts["secret"] = self.s3_secret_access_key.get_secret_value()
        return opts


def settings_problem(exc: ValueError) -> str:
    """One line saying what is wrong with the settings (``Settings()`` raised ``exc``:
    pydantic's ValidationError, or pydantic-settings' SettingsError for a value it could
    not parse), naming each variable; never the values, which may be secrets."""
    errors = getattr(exc, "errors", None)
    if callable(errors):  # the field only: a deeper location may be a key of a secret map
        return "; ".join(f"INFERSCALE_{str(e['loc'][0]).upper()}: "
                         f"{str(e['msg']).removeprefix('Value error, ')}" for e in errors())
    field = re.search(r'field "(\w+)"', str(exc))
    name = f"INFERSCALE_{field.group(1).upper()}" if field else "a setting"
    cause = exc.__cause__ or exc.__context__
    return f"{name} cannot be parsed" + (f" ({type(cause).__name__}: {cause}; lists and "
                                          "maps are JSON)" if cause else f": {exc}")


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ``INFERSCALE_*`` variables of ``environ`` (default ``os.environ``) that a Ray
    worker may receive: :data:`WORKER_ENV_SETTINGS` only, nothing secret."""
    environ = os.environ if environ is None else environ
    allowed = {f"INFERSCALE_{name.upper()}" for name in WORKER_ENV_SETTINGS}
    return {k: v for k, v in environ.items() if k.upper() in allowed}


# What keeps Hugging Face, Mem0, Prefect, vLLM and Ray off the network (and quiet).
OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "MEM0_TELEMETRY": "False",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
}


def offline_environment() -> None:
    """Set :data:`OFFLINE_ENV` in this process (values the caller already set win).

    Called by entry points before importing transformers, mem0 or prefect.
    """
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
