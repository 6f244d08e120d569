"""The worker-resident store: tiers, byte budgets, LRU, events, gathering."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_resident
from inferscale.hydrate.arena import ALIGN
from inferscale.hydrate.resident import ResidencyError, Resident
from inferscale.hydrate.store import ResidentStore


def nbytes(r: Resident) -> int:
    return r.slab.numel() * 4


def test_gpu_overflow_demotes_lru_to_host_and_host_overflow_evicts():
    size = nbytes(make_resident("x"))
    store = ResidentStore("cpu", gpu_budget_bytes=2 * size, host_budget_bytes=2 * size)
    for u in "abc":
        store.put(make_resident(u), "gpu")
    tiers = {r["user"]: r["tier"] for r in store.residents()}
    assert tiers == {"a": "host", "b": "gpu", "c": "gpu"}  # a was least recently used
    assert store.get("b", "v1") is not None  # touch b: now c is the LRU gpu user
    store.put(make_resident("d"), "gpu")
    tiers = {r["user"]: r["tier"] for r in store.residents()}
    assert tiers == {"a": "host", "c": "host", "b": "gpu", "d": "gpu"}
    store.put(make_resident("e"), "gpu")  # demotes b; host now holds a, c, b > budget
    assert store.get("a", "v1") is None  # a, the LRU host user, was dropped
    events = store.take_events()
    ops = [(e.op, e.user) for e in events]
    assert ("remove", "a") in ops and ops[0] == ("add", "a")
    # dropped to make room: what turns the scheduler's promotion rule on
    assert [(e.user, e.for_room) for e in events if e.op == "remove"] == [("a", True)]
    assert store.take_events() == []
    assert store.used("gpu") <= 2 * size and store.used("host") <= 2 * size


def test_an_add_says_when_the_host_tier_has_no_room_for_another_user_of_its_size():
    """What turns the scheduler's promotion rule on before any drop: the serving task
    fills the budgets at start."""
    size = nbytes(make_resident("x"))
    store = ResidentStore("cpu", gpu_budget_bytes=4 * size, host_budget_bytes=2 * size)
    store.put(make_resident("a"), "gpu")
    store.put(make_resident("b"), "host")
    store.put(make_resident("c"), "host")
    assert [(e.user, e.full) for e in store.take_events()] == [
        ("a", False), ("b", False), ("c", True)]


def test_new_version_replaces_old_and_is_reported_in_order():
    store = ResidentStore("cpu", 1 << 20, 1 << 20)
    store.put(make_resident("u", "v1"))
    store.put(make_resident("u", "v2"))
    assert store.get("u", "v1") is None and store.get("u", "v2") is not None
    assert [(e.op, e.version, e.for_room) for e in store.take_events()] == [
        ("add", "v1", False), ("remove", "v1", False), ("add", "v2", False)]
    assert store.evict("u") and not store.evict("u")
    assert [(e.op, e.version, e.for_room) for e in store.take_events()] == [
        ("remove", "v2", False)]  # an admin's eviction is not for room


def test_too_large_for_every_budget_is_refused():
    r = make_resident("big")
    store = ResidentStore("cpu", gpu_budget_bytes=10, host_budget_bytes=10)
    with pytest.raises(ResidencyError, match="exceed"):
        store.put(r, "gpu")
    with pytest.raises(ResidencyError, match="tier"):
        store.put(r, "disk")
    # fits host only: lands on host
    store = ResidentStore("cpu", gpu_budget_bytes=10, host_budget_bytes=1 << 20)
    assert store.put(r, "gpu").tier == "host"


def test_fit_tier_decides_from_a_size_alone():
    """What hydration asks with the manifest's size before reading anything."""
    store = ResidentStore("cpu", gpu_budget_bytes=100, host_budget_bytes=1000)
    assert store.fit_tier("u", 100, "gpu") == "gpu"
    assert store.fit_tier("u", 101, "gpu") == "host"  # gpu falls back to host
    assert store.fit_tier("u", 1000, "host") == "host"
    with pytest.raises(ResidencyError, match="1001 bytes exceed the host budget"):
        store.fit_tier("u", 1001, "host")
    with pytest.raises(ResidencyError, match="exceed the gpu budget"):
        store.fit_tier("u", 1001, "gpu")
    with pytest.raises(ResidencyError, match="tier"):
        store.fit_tier("u", 1, "disk")


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_gather_any_range_of_the_chunk_concatenation(tier):
    store = ResidentStore("cpu", 1 << 20, 1 << 20)
    r = store.put(make_resident("u"), tier)
    # request order differs from slab order: b then prefix then a
    chunks = ["b", "prefix", "a"]
    full = torch.cat([r.slab[o:o + n] for o, n in r.rows(chunks)])
    for start, end in [(0, 9), (2, 7), (5, 9), (0, 1)]:
        out = torch.empty((end - start, *r.slab.shape[1:]))
        store.gather(r, chunks, start, end, out)
        assert torch.equal(out, full[start:end])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tier_is_pinned_and_gathers_to_device():
    store = ResidentStore("cuda", 1 << 20, 1 << 20)
    r = store.put(make_resident("u"), "host")
    assert r.slab.is_pinned()
    out = torch.empty((9, *r.slab.shape[1:]), device="cuda")
    store.gather(r, ["a", "prefix", "b"], 0, 9, out)
    ref = torch.cat([r.slab[o:o + n] for o, n in r.rows(["a", "prefix", "b"])])
    assert torch.equal(out.cpu(), ref)



def test_slabs_are_converted_once_to_the_store_dtype():
    """A bfloat16 artifact on a float32 engine: converted when placed (layer-major, one
    copy), budgets count the converted bytes, demotion keeps it as is."""
    r = make_resident("u")
    r.slab = r.slab.to(torch.bfloat16)
    want = r.slab.float()
    fp32 = r.slab.numel() * 4
    store = ResidentStore("cpu", gpu_budget_bytes=fp32, host_budget_bytes=fp32,
                          dtype=torch.float32)
    placed = store.put(r, "gpu")
    assert placed.slab.dtype == torch.float32 and torch.equal(placed.slab, want)
    assert placed.slab.permute(1, 2, 0, 3, 4).is_contiguous()  # layer-major memory
    assert store.residents()[0]["dtype"] == "float32" and store.used("gpu") == fp32
    # the bf16 slab (half the bytes) fits a budget its float32 copy does not
    small = ResidentStore("cpu", gpu_budget_bytes=fp32 // 2, host_budget_bytes=fp32 // 2,
                          dtype=torch.float32)
    bf16 = make_resident("v")
    bf16.slab = bf16.slab.to(torch.bfloat16)
    with pytest.raises(ResidencyError, match=f"{fp32} bytes exceed"):
        small.put(bf16, "gpu")
    store.put(make_resident("w", seed=1), "gpu")  # demotes u to host, unchanged
    assert store.held("u").tier == "host" and torch.equal(store.held("u").slab, want)
    # no dtype: slabs keep the artifact's
    assert ResidentStore("cpu", 1 << 20, 1 << 20).put(bf16, "gpu").slab.dtype == torch.bfloat16


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_a_tensor_parallel_rank_keeps_only_its_heads(tier):
    """Rank 1 of 2 (heads 2-3 of 4): the slab is cut in the copy that places it; the
    budgets count its share; the store owns those bytes only (nothing of the other heads
    stays referenced); a demotion keeps it as is; a slab of another head count is refused."""
    from inferscale.hydrate.resident import HeadShard

    r = make_resident("u", H=4)
    full = r.slab.clone()
    share = full.numel() * 4 // 2
    store = ResidentStore("cpu", share, 4 * share, heads=HeadShard(2, 2, 4))
    assert store.placed_bytes(r.slab) == share
    placed = store.put(r, tier)
    assert torch.equal(placed.slab, full[:, :, :, 2:4]) and placed.nbytes == share
    # its memory: the share, rounded up to the arenas' alignment
    assert placed.slab.untyped_storage().nbytes() == placed.region.nbytes == \
        -(-share // ALIGN) * ALIGN
    assert store.used(tier) == share and store.residents()[0]["bytes"] == share
    store.put(make_resident("v", H=4, seed=1), "gpu")  # demotes u to host, unchanged
    assert store.held("u").tier == "host" and torch.equal(store.held("u").slab,
                                                         full[:, :, :, 2:4])
    out = torch.empty((9, 2, 2, 2, 4))
    store.gather(store.held("u"), ["b", "prefix", "a"], 0, 9, out)
    assert torch.equal(out, torch.cat([full[7:9], full[0:7]])[:, :, :, 2:4])
    with pytest.raises(ResidencyError, match="not the model's 4 KV heads"):
        store.put(make_resident("w", H=2), "gpu")
    with pytest.raises(ValueError, match="not inside"):
        HeadShard(2, 3, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiers_use_memory_taken_once():
    """On CUDA both tiers and the staging reserves are arenas taken at start-up: placing,
    adopting a staged read, demoting and evicting allocate no device or pinned memory."""
    from inferscale.hydrate.resident import Resident

    one = make_resident("x").slab.numel() * 2  # bf16 bytes of one user
    store = ResidentStore("cuda", gpu_budget_bytes=2 * one, host_budget_bytes=2 * one,
                          dtype=torch.bfloat16, staging_bytes=4 * one,
                          device_staging_bytes=one)
    store.allocate()
    gpu, host = store._arenas["gpu"].buffer, store._arenas["host"].buffer
    assert gpu.is_cuda and host.is_pinned()
    host_stats = getattr(torch.cuda, "host_memory_stats", None)
    before = (torch.cuda.memory_allocated(), host_stats()["allocations.current"]
              if host_stats else None)

    def inside(t, buf):
        return buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()

    want = {}
    for u in "abc":  # c demotes a (LRU) to host
        r = make_resident(u, seed=ord(u))
        want[u] = r.slab.to(torch.bfloat16)
        store.put(r, "gpu")
    assert {r["user"]: r["tier"] for r in store.residents()} == {"a": "host", "b": "gpu",
                                                                 "c": "gpu"}
    assert inside(store.held("a").slab, host) and inside(store.held("b").slab, gpu)
    for u in "abc":
        assert torch.equal(store.held(u).slab.cpu(), want[u])
    # a read staged in pinned memory is adopted by the host tier, not copied
    region = store.staging(one)
    slab = region.view(tuple(want["a"].shape), torch.bfloat16)
    slab.copy_(want["a"])
    staged = Resident("d", "v1", "fp", slab, dict(make_resident("d").index),
                      dict(make_resident("d").token_ids), region=region)
    placed = store.put(staged, "host")
    assert placed.slab.data_ptr() == slab.data_ptr() and store._staging_used["host"] == 0
    out = torch.empty((9, *slab.shape[1:]), dtype=torch.bfloat16, device="cuda")
    store.gather(placed, ["a", "prefix", "b"], 0, 9, out)
    ref = torch.cat([placed.slab[o:o + n] for o, n in placed.rows(["a", "prefix", "b"])])
    assert torch.equal(out.cpu(), ref)
    del out
    for u in "abcd":
        store.evict(u)
    torch.cuda.synchronize()
    after = (torch.cuda.memory_allocated(), host_stats()["allocations.current"]
             if host_stats else None)
    assert after == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_freed_after_a_read_waits_for_its_fence():
    """A host region read by enqueued device work is rewritten only after that work: the
    next writer waits for the fence it was freed with."""
    from inferscale.hydrate.arena import Arena, Fence

    arena = Arena(1 << 20, "cpu", pin=True)
    region = arena.alloc(1 << 20)
    src = region.view((1 << 18,), torch.float32)
    src.fill_(1.0)
    dst = torch.empty(1 << 18, device="cuda")
    torch.cuda._sleep(200_000_000)  # keep the stream busy so the copy below is pending
    dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    arena.free(region, Fence(1, event))
    again = arena.alloc(1 << 20)
    assert again.offset == region.offset and again.fence.event is event
    again.wait_host()  # returns only once the copy has read the old bytes
    assert event.query()
    again.view((1 << 18,), torch.float32).fill_(2.0)
    torch.cuda.synchronize()
    assert torch.all(dst == 1.0)


def fp8_resident(user: str = "q", seed: int = 3, L=2, H=2, D=4) -> Resident:
    """``make_resident``'s slab quantized per chunk (scales ``[C, 2, L, H]``)."""
    from inferscale.kv_quant import quantize

    r = make_resident(user, seed=seed, L=L, H=H, D=D)
    rows, scales = [], []
    for c, (o, n) in r.index.items():
        q, sc = quantize(r.slab[o:o + n])
        rows.append(q)
        scales.append(sc)
    r.slab, r.scales = torch.cat(rows), torch.stack(scales)
    return r


def dequantized(r: Resident) -> torch.Tensor:
    return r.slab.float() * r.row_scales()[..., None]


def test_the_kept_dtype_rule():
    """fp8 stays fp8 on CUDA only; everything else becomes the store's dtype (the
    engine's), float32 for fp8 on the CPU when the store has none."""
    from inferscale.hydrate.store import kept_dtype

    fp8, bf16, f32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32
    assert kept_dtype(fp8, bf16, cuda=True) == fp8
    assert kept_dtype(fp8, bf16, cuda=False) == bf16 and kept_dtype(fp8, None, False) == f32
    assert kept_dtype(bf16, f32, cuda=False) == f32 and kept_dtype(bf16, None, True) == bf16
    assert ResidentStore("cpu", 1, 1, dtype=None).kept_dtype(fp8) == f32


def test_fp8_slabs_are_dequantized_once_on_the_cpu():
    """A CPU store converts an fp8 slab to float32 with each row's chunk scales when it
    places it (the scales are then dropped); budgets count the float32 bytes; under
    tensor parallelism the rank's heads of both."""
    from inferscale.hydrate.resident import HeadShard

    r = fp8_resident()
    want = dequantized(r)
    store = ResidentStore("cpu", 1 << 20, 1 << 20, dtype=torch.float32)
    assert store.kept_dtype(torch.float8_e4m3fn) == torch.float32
    assert store.placed_bytes(r.slab, r.scales) == r.slab.numel() * 4
    placed = store.put(r, "gpu")
    assert placed.scales is None and placed.slab.dtype == torch.float32
    assert torch.equal(placed.slab, want)
    assert placed.slab.permute(1, 2, 0, 3, 4).is_contiguous()  # layer-major, as any CPU slab
    out = torch.empty(9, 2, 2, 2, 4)
    store.gather(placed, ["a", "prefix", "b"], 0, 9, out)
    assert torch.equal(out[:4], want[3:7]) and torch.equal(out[4:7], want[:3])
    shard = ResidentStore("cpu", 1 << 20, 1 << 20, dtype=torch.float32, heads=HeadShard(1, 1, 2))
    mine = shard.put(fp8_resident(), "gpu")
    assert torch.equal(mine.slab, want[:, :, :, 1:2])


def test_fp8_rows_gathered_into_a_float_buffer_are_dequantized():
    """The generic path's staging (a float buffer): fp8 rows dequantized with their
    chunks' scales, in request order, across chunk boundaries."""
    r = fp8_resident()
    want = dequantized(r)
    out = torch.empty(6, 2, 2, 2, 4, dtype=torch.float32)
    r.gather(["b", "a", "prefix"], 1, 7, out)  # b[1:], a, prefix[:1]
    assert torch.equal(out, torch.cat([want[8:9], want[3:7], want[0:1]]))
    assert r.scale_rows(["b", "a", "prefix"], 1, 7).tolist() == [2, 1, 1, 1, 1, 0]
    assert torch.equal(r.rows_float(torch.tensor([8, 0, 4])), want[[8, 0, 4]])
    assert r.nbytes == r.slab.numel() + r.scales.numel() * 4


def rows_reference(r: Resident, chunks: list[str], start: int, end: int):
    """Slab rows and scale rows of tokens ``[start, end)``, a chunk at a time."""
    rows, scale_rows, pos = [], [], 0
    for c in chunks:
        off, n = r.index[c]
        lo, hi = max(start, pos), min(end, pos + n)
        if lo < hi:
            rows += range(off + lo - pos, off + hi - pos)
            scale_rows += [r.scale_pos(c)] * (hi - lo)
        pos += n
    return rows, scale_rows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8),
       st.lists(st.integers(0, 7), max_size=12), st.integers(-5, 45), st.integers(-5, 45))
def test_token_rows_are_the_chunk_by_chunk_rows(lengths, picks, start, end):
    """Any request order, chunks repeated or empty, any range (past either end, empty,
    reversed): per token its slab row and its chunk's scales row, as chunk by chunk."""
    r = make_resident("u", chunks=[(f"c{i}", n) for i, n in enumerate(lengths)])
    chunks = [f"c{i % len(lengths)}" for i in picks]
    rows, scale_rows = r.token_rows(chunks, start, end, scales=True)
    want_rows, want_scales = rows_reference(r, chunks, start, end)
    assert rows.tolist() == want_rows and scale_rows.tolist() == want_scales
    assert rows.dtype == scale_rows.dtype == np.int64
    assert r.token_rows(chunks, start, end)[1] is None
    assert r.scale_rows(chunks, start, end).tolist() == want_scales
    with pytest.raises(KeyError):
        r.token_rows(chunks + ["unknown"], start, end)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_keeps_fp8_in_both_tiers_with_its_scales():
    """On CUDA an fp8 slab stays fp8 in the gpu and the host tier (half the bytes of
    bf16, no conversion of the whole resident), its scales beside it; a demotion moves
    the fp8 bytes; the generic path's gather dequantizes on the device."""
    r = fp8_resident(L=2, H=2, D=64)
    want = dequantized(r)
    raw = r.slab.clone()
    size = r.slab.numel() + r.scales.numel() * 4
    store = ResidentStore("cuda", gpu_budget_bytes=size, host_budget_bytes=4 * size,
                          dtype=torch.bfloat16)
    assert store.kept_dtype(torch.float8_e4m3fn) == torch.float8_e4m3fn
    placed = store.put(r, "gpu")
    assert placed.slab.is_cuda and placed.slab.dtype == torch.float8_e4m3fn
    assert torch.equal(placed.slab.cpu().view(torch.uint8), raw.view(torch.uint8))
    assert placed.scales is not None and store.used("gpu") == size
    out = torch.empty(9, 2, 2, 2, 64, dtype=torch.bfloat16, device="cuda")
    store.gather(placed, ["prefix", "a", "b"], 0, 9, out)
    assert torch.equal(out.cpu(), want.to(torch.bfloat16))
    store.put(fp8_resident("other", seed=5, D=64), "gpu")  # demotes q to the host tier
    moved = store.held("q")
    assert moved.tier == "host" and moved.slab.dtype == torch.float8_e4m3fn
    assert torch.equal(moved.slab.view(torch.uint8), raw.view(torch.uint8))


def test_a_slab_of_another_geometry_never_reaches_a_tier():
    """The store of a model ``[L=2, H=2, D=4]`` refuses a slab of the same bytes per
    token in another geometry (``[2, 4, 2]``: heads 2..3 would land in the next block of
    the paged cache) and one of another layer count, before placing anything; its
    staging memory is given back. Its own geometry is placed."""
    from inferscale.types import KVGeometry

    store = ResidentStore("cpu", 1 << 20, 1 << 20, geometry=KVGeometry(2, 2, 4))
    good = make_resident("ann")
    forged = make_resident("eve")
    forged.slab = forged.slab.reshape(9, 2, 2, 4, 2)
    fewer = make_resident("bob", L=1)
    for r in (forged, fewer):
        with pytest.raises(ResidencyError, match=r"model's geometry \[L=2, H=2, D=4\]"):
            store.put(r, "gpu")
    assert store.residents() == [] and store.used("gpu") == store.used("host") == 0
    assert store.put(good, "gpu").slab.shape == (9, 2, 2, 2, 4)


@pytest.mark.parametrize("dtype, scale, ok", [
    (torch.float16, 147.0, False), (torch.float16, 100.0, True),
    (torch.float32, 147.0, True), (torch.float32, 7.6e35, False),
    (torch.bfloat16, 1e30, True), (torch.float32, 1e-40, False)])
def test_fp8_scales_must_stay_finite_in_the_engine_dtype(dtype, scale, ok):
    """The worker's own bound, for its engine's dtype: a scale that passes the readers'
    dtype-independent check (147) still overflows a float16 engine (448 * 147 > 65504)
    and is refused there, once per slab, when it arrives."""
    r = fp8_resident()
    r.scales[1, 0, 0, 1] = scale
    store = ResidentStore("cpu", 1 << 20, 1 << 20, dtype=dtype)
    if ok:
        store.check(r)
    else:
        with pytest.raises(ResidencyError, match="stay finite"):
            store.put(r, "gpu")
        assert store.residents() == []
