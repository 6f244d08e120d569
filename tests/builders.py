"""Tiny random inputs for artifact tests: encoder-shaped KV, facts tables, lineage; and
worker residents (:func:`make_resident`).

Importable by tests and by the subprocesses they start (publishers killed mid-way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import torch

from inferscale.artifacts.publish import Lineage
from inferscale.hydrate.resident import Resident
from inferscale.types import KVGeometry
from storage_schemas import facts as facts_schema

EMB_DIM = 4


@dataclass
class Chunk:
    chunk_id: str
    token_ids: list[int]
    kv: torch.Tensor  # [T, 2, L, H, D]: K then V (KVFormat.TOKEN_MAJOR)
    content_key: str | None = None
    scales: torch.Tensor | None = None  # [2, L, H] float32 (fp8 K/V)


@dataclass
class Memory:
    chunks: list[Chunk]
    model_fingerprint: str
    encoder_config: dict = field(default_factory=dict)
    geometry: KVGeometry | None = None  # of the (made-up) model: the chunks' own


def make_inputs(user: str = "alice", n_facts: int = 5, *, layers: int = 2, heads: int = 2,
                head_dim: int = 8, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                fp: str = "fp-test", max_tokens: int = 7, prefix_tokens: int = 4,
                window: int = 2, kv_noise: int | None = None) -> tuple[Memory, pa.Table, Lineage]:
    """Random encoder output (prefix + one chunk per fact), its facts table, lineage.

    ``kv_noise``: perturb K/V with noise of this seed: other bytes for the same inputs
    (the same version id), as another device or compute dtype would produce. An fp8
    ``dtype`` quantizes each chunk (``inferscale.kv_quant``) and keys get a few large
    channels per head, as real keys have."""
    from inferscale.kv_quant import is_quantized, quantize

    fp8 = is_quantized(dtype)
    work = torch.float32 if fp8 else dtype
    g = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(kv_noise) if kv_noise is not None else None
    fact_ids = [f"f{seed}-{i:04d}" for i in range(n_facts)]
    chunks = []
    for cid in ["prefix", *fact_ids]:
        t = prefix_tokens if cid == "prefix" else int(torch.randint(1, max_tokens + 1, (1,), generator=g))
        kv = torch.randn(t, 2, layers, heads, head_dim, generator=g).to(work)
        if noise is not None:
            kv = kv + (0.01 * torch.randn(kv.shape, generator=noise)).to(work)
        tokens = torch.randint(0, 50000, (t,), generator=g).tolist()
        scales = None
        if fp8:
            kv[:, 0, ..., :2] *= 20  # outlier channels of the keys
            kv, scales = quantize(kv)
        chunks.append(Chunk(cid, tokens, kv, scales=scales))
    memory = Memory(chunks, fp, {"window": window, "dtype": str(dtype).removeprefix("torch."),
                                 "instruction": "remember"}, KVGeometry(layers, heads, head_dim))
    facts = facts_table(user, fact_ids, [c.token_ids for c in chunks[1:]], seed)
    return memory, facts, Lineage(log_hash=f"log-{seed}", facts_hash=f"facts-{seed}")


def regrouped(memory, claim: bool = False):
    """``memory`` with every chunk's rows ``[T, 2, L, H, D]`` regrouped as
    ``[T, 2, L, 2H, D/2]``: the same bytes per token in another geometry (the audit's
    forged artifact). ``claim``: its ``geometry`` says so too, as a forger who lies to
    ``publish`` would."""
    for c in memory.chunks:
        T, _, L, H, D = c.kv.shape
        c.kv = c.kv.reshape(T, 2, L, 2 * H, D // 2)
        if c.scales is not None:  # [2, L, H]: each head's scale for both of its halves
            c.scales = c.scales.repeat_interleave(2, dim=2)
    if claim and getattr(memory, "geometry", None) is not None:
        L, H, D = memory.geometry
        memory.geometry = KVGeometry(L, 2 * H, D // 2)
    return memory


def facts_table(user: str, fact_ids: list[str], token_ids: list[list[int]], seed: int = 0) -> pa.Table:
    g = torch.Generator().manual_seed(seed + 1)
    emb = torch.randn(len(fact_ids), EMB_DIM, generator=g).tolist()
    return pa.table({
        "fact_id": fact_ids,
        "user": [user] * len(fact_ids),
        "source_turn_id": [f"D1:{i}" for i in range(len(fact_ids))],
        "source_index": list(range(len(fact_ids))),
        "text": [f"fact {i} of {user}" for i in range(len(fact_ids))],
        "token_ids": token_ids,
        "embedding": emb,
    }, schema=facts_schema.schema(EMB_DIM))


def expected_slab(memory: Memory) -> torch.Tensor:
    """The [T, 2, L, H, D] slab the store must hand back for ``memory`` (as stored)."""
    return torch.cat([c.kv for c in memory.chunks])


def expected_float(memory: Memory) -> torch.Tensor:
    """:func:`expected_slab` as float32, fp8 rows dequantized with their chunk's scales."""
    rows = []
    for c in memory.chunks:
        kv = c.kv.float()  # [t, 2, L, H, D]
        if c.scales is not None:
            kv = kv * c.scales[None, :, :, :, None]
        rows.append(kv)
    return torch.cat(rows)


def crash_inputs(user: str):
    """(A, B) for the fault-injection test: A small and published first, B larger, so a
    publisher killed at a random moment is often in the middle of writing B."""
    a = make_inputs(user, 4, seed=1)
    b = make_inputs(user, 300, seed=2, layers=4, heads=4, head_dim=32, max_tokens=16)
    return a, b


def forge_scale(store, user: str, fp: str, version: str, value: float) -> None:
    """Set the first fp8 scale of a published version's kv file to ``value`` and re-sign
    its manifest (index digest, file size and checksum), as anyone who can write the store
    could: what is left to refuse it are the readers' own checks of the scales."""
    import xxhash

    from inferscale.artifacts.blobs import Location
    from inferscale.artifacts.read import data_path, read_manifest
    from storage_schemas import kv as kv_schema
    from storage_schemas.manifest import FileEntry, Manifest

    loc = Location(store, user, fp)
    m = read_manifest(store, user, fp, version)
    path = data_path(loc, m, "kv.arrow")
    fs = store.filesystem()
    data = bytearray(fs.cat_file(path))
    batch = pa.ipc.open_file(pa.py_buffer(bytes(data))).get_batch(0)
    first = pa.array([batch.column("scales")[0].as_py()[0]], pa.float32())
    at = bytes(data).index(first.buffers()[1].to_pybytes())
    data[at:at + 4] = pa.array([value], pa.float32()).buffers()[1].to_pybytes()
    fs.pipe_file(path, bytes(data))
    forged = pa.ipc.open_file(pa.py_buffer(bytes(data))).get_batch(0)
    layout = kv_schema.KVLayout.from_schema(forged.schema)
    digest = kv_schema.index_digest(*(forged.column(c).to_pylist()
                                      for c in kv_schema.index_columns(layout)))
    entry = m.files["kv.arrow"]
    files = {**m.files, "kv.arrow": FileEntry(len(data), xxhash.xxh3_128_hexdigest(bytes(data)),
                                              entry.stored_as)}
    store.filesystem().pipe_file(loc.file(version, "manifest.json"), Manifest(**{
        **m.__dict__, "files": files, "kv": {**m.kv, "index_xxh3": digest}}).to_json())


def make_resident(user: str, version: str = "v1", chunks=(("prefix", 3), ("a", 4), ("b", 2)),
                  L=2, H=2, D=4, seed=0) -> Resident:
    """A float32 :class:`~inferscale.hydrate.resident.Resident` of random rows: chunk
    ``(id, tokens)`` after chunk, token ids counting from 100."""
    g = torch.Generator().manual_seed(seed)
    total = sum(n for _, n in chunks)
    slab = torch.randn((total, 2, L, H, D), generator=g)  # [T, 2, L, H, D]
    index, tokens, off = {}, {}, 0
    for cid, n in chunks:
        index[cid] = (off, n)
        tokens[cid] = tuple(range(100 + off, 100 + off + n))
        off += n
    return Resident(user, version, "fp", slab, index, tokens)
