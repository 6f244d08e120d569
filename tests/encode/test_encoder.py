"""The context-window encoder: relocation, the limiting case, batching, edge cases."""

from dataclasses import replace

import pytest
import torch

from inferscale.encode.batches import Segment, build_batch, plan_batches
from inferscale.compose import ComposeError, Composer
from inferscale.encode.capture import encode_segments
from inferscale.encode.encoder import (
    FactSpec, TurnText, encode_facts, encode_limiting, window_segments,
)
from inferscale.encode.identity import EncodeError, EncoderConfig, EncodingIdentity
from inferscale.encode.rope import RotaryTables, rotate_keys
from inferscale.types import PREFIX_ID, ChunkKV
from tiny_models import ROPE_TYPES, tiny_llama, tiny_qwen3


def joint_prefill_kv(model, ids: list[int]):
    """Post-RoPE K and V of one plain prefill of ``ids`` as rows ``[T, 2, L, H, D]``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values  # per layer [1, H, T, D]
    return torch.stack([torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers],
                                    dim=1),
                        torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers],
                                    dim=1)], dim=1)


def rotated(rows: torch.Tensor, positions: torch.Tensor, model) -> torch.Tensor:
    """The stored pre-RoPE keys of ``rows [T, 2, L, H, D]`` rotated to ``positions``."""
    return rotate_keys(rows[:, 0], positions, RotaryTables.from_model(model), token_dim=0)


def encode_one(model, context: list[int], chunk: list[int]):
    seg = Segment(tuple(context), (("c", tuple(chunk)),))
    (enc,) = encode_segments(model, [seg], out_dtype=torch.float32, batch_tokens=4096)
    return enc


def _models():
    return {
        "llama3-scaling": lambda: tiny_llama(ROPE_TYPES["llama3"]),
        "yarn": lambda: tiny_llama(ROPE_TYPES["yarn"]),
        "qwen3-knorm": tiny_qwen3,
    }


def _check_relocation(model, context: list[int], chunk: list[int]):
    """Encode ``chunk`` after ``context``: its stored keys rotated to ``p..p+c-1`` and its
    values equal the joint prefill's (1e-5). Returns the encoding and the prefill's keys
    of the chunk (``[c, L, H, D]``)."""
    ref = joint_prefill_kv(model, context + chunk)
    enc = encode_one(model, context, chunk)
    p = len(context)
    assert enc.kv.shape == ref[p:].shape  # [c, 2, L, H, D]: what kv.arrow stores
    assert (rotated(enc.kv, torch.arange(p, p + len(chunk)), model)
            - ref[p:, 0]).abs().max().item() <= 1e-5
    assert (enc.kv[:, 1] - ref[p:, 1]).abs().max().item() <= 1e-5
    return enc, ref[p:, 0]


@pytest.mark.parametrize("name", sorted(_models()))
def test_relocation_tiny_models(name):
    """Keys prefilled at p..p+c-1 == stored pre-RoPE keys rotated to p..p+c-1."""
    model = _models()[name]()
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, 256, (37,), generator=g).tolist()
    chunk = torch.randint(0, 256, (9,), generator=g).tolist()
    enc, keys = _check_relocation(model, context, chunk)
    # and the stored keys really are pre-RoPE: unrotated they differ from the cache
    assert (enc.kv[:, 0] - keys).abs().max().item() > 1e-2


@pytest.mark.slow
def test_relocation_smollm2_real_weights(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    context = tok.encode("Caroline: I adopted a dog named Rex last spring.\n"
                         "Melanie: That's lovely, how is he doing?\n", add_special_tokens=False)
    chunk = tok.encode("- He loves long walks by the river.\n", add_special_tokens=False)
    _check_relocation(model, context, chunk)


def _limiting_case(model, prefix: list[int], facts: list[list[int]], tol: float):
    """Each fact encoded with the whole memory before it (``encode_limiting``, several
    segments per batch: padding and the block mask) == one joint prefill."""
    mem = encode_limiting(model, prefix, [(f"f{i}", f) for i, f in enumerate(facts)], "fp")
    assert [c.chunk_id for c in mem.chunks] == [PREFIX_ID] + [f"f{i}" for i in range(len(facts))]
    rows = torch.cat([c.kv for c in mem.chunks])  # [T, 2, L, H, D]: the slab these chunks make
    ref = joint_prefill_kv(model, prefix + [t for f in facts for t in f])
    assert (rotated(rows, torch.arange(rows.shape[0]), model) - ref[:, 0]).abs().max().item() \
        <= tol
    assert (rows[:, 1] - ref[:, 1]).abs().max().item() <= tol


@pytest.mark.parametrize("name", sorted(_models()))
def test_limiting_case_tiny_models(name):
    model = _models()[name]()
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 256, (11,), generator=g).tolist()
    facts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 3, 14)]
    _limiting_case(model, prefix, facts, 1e-4)


@pytest.mark.slow
def test_limiting_case_smollm2(smollm2):
    composer = Composer(smollm2.tokenizer)
    facts = ["Caroline adopted a dog named Rex.", "Rex is a golden retriever.",
             "Caroline works as a nurse in Boston.", "She ran a marathon in May 2023."]
    _limiting_case(smollm2.model, composer.prefix_ids(), [composer.fact_ids(f) for f in facts],
                   1e-4)


def test_block_mask_isolates_facts_of_one_turn():
    """Two facts sharing one pass get exactly what each would get alone."""
    model = tiny_llama(ROPE_TYPES["llama3"])
    window, f1, f2 = list(range(10, 30)), list(range(40, 47)), list(range(60, 65))
    shared = Segment(tuple(window), (("a", tuple(f1)), ("b", tuple(f2))))
    got = {c.chunk_id: c for c in encode_segments(model, [shared], out_dtype=torch.float32,
                                                  batch_tokens=4096)}
    alone_b = encode_one(model, window, f2)
    torch.testing.assert_close(got["b"].kv, alone_b.kv, rtol=0, atol=1e-5)


def test_build_batch_positions_and_mask():
    segs = [Segment((1, 2, 3), (("a", (4, 5)), ("b", (6,)))), Segment((), (("c", (7, 8)),))]
    batch = build_batch(segs, pad_id=0, device=torch.device("cpu"), mask_dtype=torch.float32)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 3]
    assert batch["position_ids"][1].tolist()[:2] == [0, 1]
    allowed = batch["attention_mask"][0, 0] == 0
    assert allowed[5].tolist() == [True, True, True, False, False, True]  # b sees window+self
    assert allowed[4].tolist() == [True, True, True, True, True, False]
    pad_row = batch["attention_mask"][1, 0, 4] == 0
    assert pad_row.tolist() == [False, False, False, False, True, False]
    assert batch["spans"] == [("a", 0, 2), ("b", 2, 1), ("c", 3, 2)]
    # single-chunk segments only: no block mask, plain causal attention
    single = build_batch(segs[1:], pad_id=0, device=torch.device("cpu"), mask_dtype=torch.float32)
    assert single["attention_mask"] is None


def test_plan_batches_respects_token_budget():
    segs = [Segment(tuple(range(n)), (("x%d" % n, (1,)),)) for n in (3, 50, 7, 20, 90)]
    batches = plan_batches(segs, batch_tokens=100)
    assert sorted(i for b in batches for i in b) == list(range(5))
    for b in batches:
        longest = max(segs[i].length for i in b)
        assert len(b) == 1 or longest * len(b) <= 100
    mixed = segs + [Segment((1,), (("m", (2,)), ("n", (3,))))]
    for b in plan_batches(mixed, batch_tokens=1000):
        assert len({len(mixed[i].chunks) > 1 for i in b}) == 1  # never mixed



def test_segments_alone_do_not_depend_on_their_neighbours():
    """batch_tokens=None: every segment is its own unpadded pass, so a chunk's bits are
    the same whatever else is encoded in the run (batched, they need not be)."""
    model = tiny_llama(ROPE_TYPES["llama3"])
    g = torch.Generator().manual_seed(4)
    segs = [Segment(tuple(torch.randint(0, 256, (n,), generator=g).tolist()),
                    ((f"c{n}", tuple(torch.randint(0, 256, (5,), generator=g).tolist())),))
            for n in (3, 40, 17, 0)]
    together = {c.chunk_id: c for c in encode_segments(
        model, segs, out_dtype=torch.float32, batch_tokens=None)}
    assert list(together) == [s.chunks[0][0] for s in segs]  # input order
    for seg in segs:
        (alone,) = encode_segments(model, [seg], out_dtype=torch.float32, batch_tokens=None)
        assert torch.equal(alone.kv, together[alone.chunk_id].kv)


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2):
    return smollm2.tokenizer


TURNS = [TurnText("A", "I got a dog."), TurnText("B", "What is his name?"),
         TurnText("A", "He is called Rex."), TurnText("B", "Nice!")]


@pytest.mark.slow
def test_window_edges(smol_tokenizer):
    composer = Composer(smol_tokenizer)
    cfg = EncoderConfig(window=2, context="transcript", batch_invariant=False)
    facts = [FactSpec("f0", "A has a dog.", 0), FactSpec("f2", "The dog is Rex.", 2),
             FactSpec("f2b", "A named the dog Rex.", 2)]
    segs = window_segments(TURNS, facts, composer, cfg)
    assert segs[0].context == ()  # turn 0: window stops at the conversation start
    expected = "".join(f"{t.speaker}: {t.text}\n" for t in TURNS[0:2])
    assert smol_tokenizer.decode(list(segs[1].context)) == expected
    assert [cid for cid, _ in segs[1].chunks] == ["f2", "f2b"]  # one pass for one turn
    # batch-invariant (the default): one segment per fact, in the order given
    alone = window_segments(TURNS, facts[::-1], composer,
                            EncoderConfig(window=2, context="transcript"))
    assert [s.chunks for s in alone] == [(c,) for c in segs[1].chunks[::-1] + segs[0].chunks]
    assert [s.context for s in alone] == [segs[1].context, segs[1].context, ()]
    w0 = window_segments(TURNS, facts, composer, EncoderConfig(window=0, context="transcript"))
    assert all(s.context == () for s in w0)
    long_window = window_segments(TURNS, facts, composer,
                                  EncoderConfig(window=50, context="transcript"))
    assert len(long_window[1].context) == len(segs[1].context)
    truncated = window_segments(TURNS, facts, composer,
                                EncoderConfig(window=2, context="transcript",
                                              max_window_tokens=4))
    assert truncated[1].context == segs[1].context[-4:]  # keeps the most recent tokens


@pytest.mark.slow
def test_fact_edge_cases(smol_tokenizer):
    composer = Composer(smol_tokenizer)
    with pytest.raises(ComposeError, match="empty"):
        window_segments(TURNS, [FactSpec("e", "   ", 0)], composer, EncoderConfig())
    with pytest.raises(EncodeError, match="outside the conversation"):
        window_segments(TURNS, [FactSpec("x", "fact", 9)], composer, EncoderConfig())
    with pytest.raises(EncodeError, match="duplicate"):
        window_segments(TURNS, [FactSpec("x", "a", 0), FactSpec("x", "b", 1)], composer,
                        EncoderConfig())
    long_fact = " ".join(["word"] * 2000)
    (seg,) = window_segments(TURNS, [FactSpec("l", long_fact, 1)], composer,
                             EncoderConfig(max_fact_tokens=32))
    ids = seg.chunks[0][1]
    assert len(ids) == 32 and smol_tokenizer.decode(list(ids)).endswith("\n")


def test_config_validation():
    with pytest.raises(EncodeError):
        EncoderConfig(window=-1)
    with pytest.raises(EncodeError):
        EncoderConfig(dtype="int8")


@pytest.mark.slow
def test_encode_facts_end_to_end(smollm2):
    cfg = EncoderConfig(window=2, dtype="bfloat16")
    facts = [FactSpec("f1", "A has a dog named Rex.", 2), FactSpec("f0", "A got a dog.", 0)]
    identity = EncodingIdentity.of_model(cfg, smollm2.fingerprint, smollm2.model)
    mem = encode_facts(smollm2.model, smollm2.tokenizer, TURNS, facts, identity, progress=False)
    assert [c.chunk_id for c in mem.chunks] == [PREFIX_ID, "f1", "f0"]
    for c in mem.chunks:
        assert c.kv.shape == (len(c.token_ids), 2, 30, 3, 64)  # [T, 2, L, H, D]
        assert c.kv.dtype == torch.bfloat16
    assert mem.encoder_config["window"] == 2 and mem.model_fingerprint == smollm2.fingerprint
    assert mem.encoder_config == identity.record() == {  # what version ids hash
        **cfg.to_dict(), "compute_dtype": "float32", "compute_device": "cpu"}
    assert mem.stats["facts"] == 2 and (mem.stats["encoded"], mem.stats["reused"]) == (2, 0)
    assert len({c.content_key for c in mem.chunks}) == 3 and None not in {
        c.content_key for c in mem.chunks}
    batched = encode_facts(smollm2.model, smollm2.tokenizer, TURNS, facts,
                           replace(identity, encoder=replace(cfg, batch_invariant=False)),
                           progress=False)
    assert [c.content_key for c in batched.chunks] == [None] * 3  # never reused
    # a model that does not compute as the identity says is refused before any pass
    for other in (replace(identity, compute_dtype="bfloat16"),
                  replace(identity, compute_device="cuda")):
        with pytest.raises(EncodeError, match="as planned"):
            encode_facts(smollm2.model, smollm2.tokenizer, TURNS, facts, other, progress=False)


def test_encode_facts_fp8_quantizes_the_captured_kv_and_reuses_it_exactly(smollm2):
    """An fp8 stored dtype: each chunk is the compute dtype's capture quantized per chunk
    (bit for bit what quantizing a float32 encoding gives), with its scales; a later
    encoding takes a chunk with its key from the previous K/V and scales unchanged."""
    from inferscale.kv_quant import quantize

    facts = [FactSpec("f1", "A has a dog named Rex.", 2), FactSpec("f0", "A got a dog.", 0)]
    run = {}
    for dtype in ("float32", "bfloat16", "float8_e4m3fn"):
        identity = EncodingIdentity.of_model(EncoderConfig(window=2, dtype=dtype),
                                             smollm2.fingerprint, smollm2.model)
        run[dtype] = (identity, encode_facts(smollm2.model, smollm2.tokenizer, TURNS, facts,
                                             identity, progress=False))
    (ident, fp8), (_, f32) = run["float8_e4m3fn"], run["float32"]
    for q, f in zip(fp8.chunks, f32.chunks):
        rows, sc = quantize(f.kv)
        assert q.kv.dtype == torch.float8_e4m3fn and q.scales.shape == (2, 30, 3)
        assert torch.equal(q.kv.view(torch.uint8), rows.view(torch.uint8))
        assert torch.equal(q.scales, sc) and q.content_key != f.content_key
    assert fp8.encoder_config["dtype"] == "float8_e4m3fn"
    # the float32 encoding stored as bf16 or fp8 afterwards: the encoder's own bits
    for dtype in ("bfloat16", "float8_e4m3fn"):
        stored = f32.stored_as(dtype)
        assert stored.encoder_config == {**f32.encoder_config, "dtype": dtype}
        for a, b in zip(stored.chunks, run[dtype][1].chunks):
            assert a.content_key is None and a.kv.dtype == b.kv.dtype
            assert torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
            assert (a.scales is None) == (b.scales is None)
            assert a.scales is None or torch.equal(a.scales, b.scales)
    with pytest.raises(ValueError, match="float encodings only"):
        fp8.stored_as("bfloat16")
    reuse = {c.content_key: ChunkKV(c.kv, c.scales) for c in fp8.chunks[:2]}
    again = encode_facts(smollm2.model, smollm2.tokenizer, TURNS, facts, ident,
                         progress=False, reuse=reuse)
    assert (again.stats["reused"], again.stats["encoded"]) == (1, 1) and again.stats["prefix_reused"]
    for a, b in zip(again.chunks, fp8.chunks):
        assert torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8))
        assert torch.equal(a.scales, b.scales)
    # K/V without scales under an fp8 key (a damaged previous version): encoded instead
    bad = {k: ChunkKV(v.kv) for k, v in reuse.items()}
    assert encode_facts(smollm2.model, smollm2.tokenizer, TURNS, facts, ident, progress=False,
                        reuse=bad).stats["encoded"] == 2


def test_version_ids_cover_the_compute_dtype_and_device():
    """The Ray path encodes with CUDA/bf16, the CPU path with float32: other bytes for
    the same inputs, so other version ids (never one id for two contents)."""
    from pathlib import Path

    from inferscale.facts.extractor import FactsConfig
    from inferscale.pipeline.config import PipelineConfig
    from inferscale.pipeline.steps import expected_version

    cpu = PipelineConfig(home=Path("/h"), model="embedded", device="cpu", model_dtype="float32",
                         encoder=EncoderConfig(), artifact_root="/a", storage_options={})
    gpu = replace(cpu, device="cuda", model_dtype="bfloat16")
    raw = FactsConfig(mode="raw")
    configs = {"cpu": cpu, "gpu": gpu, "gpu1": replace(gpu, device="cuda:1"),
               "gpu-fp32": replace(gpu, model_dtype="float32")}
    ids = {name: expected_version(c.run_identity(raw, "fp1"), "maya", "log-h", "facts-h")
           for name, c in configs.items()}
    assert ids["cpu"] != ids["gpu"] and ids["gpu"] != ids["gpu-fp32"] != ids["cpu"]
    assert ids["gpu"] == ids["gpu1"]  # the device kind counts, not which one
    assert EncodingIdentity(EncoderConfig(), "fp1", torch.bfloat16, "cuda:0").record() == {
        **EncoderConfig().to_dict(), "compute_dtype": "bfloat16", "compute_device": "cuda"}


def test_capture_ignores_other_models_in_other_threads():
    """A model running in another thread during a capture (a fact embedder, say) is not
    intercepted: its output is unchanged and the capture stays exact."""
    import threading

    model = tiny_llama(ROPE_TYPES["llama3"])
    other = tiny_qwen3(seed=3)
    g = torch.Generator().manual_seed(2)
    context = torch.randint(0, 256, (20,), generator=g).tolist()
    chunk = torch.randint(0, 256, (7,), generator=g).tolist()
    other_ids = torch.tensor([torch.randint(0, 256, (12,), generator=g).tolist()])
    with torch.no_grad():
        expected_other = other(other_ids).logits
    seen = {}

    def run_other():
        with torch.no_grad():
            seen["logits"] = other(other_ids).logits

    def during_capture(module, args):  # runs inside the captured forward pass
        t = threading.Thread(target=run_other)
        t.start()
        t.join()

    handle = model.model.layers[0].register_forward_pre_hook(during_capture)
    try:
        enc = encode_one(model, context, chunk)
    finally:
        handle.remove()
    assert torch.equal(seen["logits"], expected_other)
    ref = joint_prefill_kv(model, context + chunk)
    p = len(context)
    assert (rotated(enc.kv, torch.arange(p, p + len(chunk)), model)
            - ref[p:, 0]).abs().max().item() <= 1e-5
    assert (enc.kv[:, 1] - ref[p:, 1]).abs().max().item() <= 1e-5


def test_layout_config_validation():
    with pytest.raises(EncodeError, match="context"):
        EncoderConfig(context="chat")
    with pytest.raises(EncodeError, match="key_temperature"):
        EncoderConfig(key_temperature=0)
    with pytest.raises(EncodeError, match="memory_order"):
        EncoderConfig(memory_order="random")
    with pytest.raises(EncodeError, match="text_tail"):
        EncoderConfig(text_tail=-1)
    with pytest.raises(EncodeError, match="tail_max_k"):
        EncoderConfig(tail_max_k=-1)
    with pytest.raises(EncodeError, match="key_calibration must be one of"):
        EncoderConfig(key_calibration="global")
    with pytest.raises(EncodeError, match="key_temperature must stay 1.0"):
        EncoderConfig(key_calibration="head", key_temperature=0.9)


def test_later_fields_are_recorded_only_off_their_neutral_value():
    """key_calibration and tail_max_k: absent from the record (so versions published
    before them keep their ids and stay current) unless set, and then a change both ways.
    The default sets tail_max_k (issue 27's pick), so it is recorded."""
    plain = EncodingIdentity(EncoderConfig(tail_max_k=0), "fp", "float32", "cpu")
    calibrated = EncodingIdentity(EncoderConfig(key_calibration="head", tail_max_k=0), "fp",
                                  "float32", "cpu")
    per_k = EncodingIdentity(EncoderConfig(tail_max_k=5), "fp", "float32", "cpu")
    assert "key_calibration" not in plain.record() and "tail_max_k" not in plain.record()
    assert calibrated.record()["key_calibration"] == "head"
    assert per_k.record()["tail_max_k"] == 5
    assert plain.changed_settings(plain.record()) == []
    assert calibrated.changed_settings(plain.record()) == ["key_calibration"]
    assert plain.changed_settings(calibrated.record()) == ["key_calibration"]
    assert per_k.changed_settings(plain.record()) == ["tail_max_k"]
    assert plain.to_dict() != calibrated.to_dict()  # the KV step's cache key
    assert EncodingIdentity(EncoderConfig(), "fp", "float32", "cpu").record()["tail_max_k"] == 5


DATED = [TurnText("A", "I got a dog.", "2023-05-08T10:00:00"),
         TurnText("B", "What is his name?", "2023-05-08T10:01:00"),
         TurnText("A", "He is called Rex.", None)]


@pytest.mark.slow
def test_window_contexts(smol_tokenizer):
    """transcript: raw turns; prefix: serving prefix + raw turns; memory: serving prefix +
    the window's turns written exactly as the served memory list writes facts."""
    from inferscale.compose import memory_text

    composer = Composer(smol_tokenizer)
    fact = [FactSpec("f", "A named the dog Rex.", 2)]
    raw = "A: I got a dog.\nB: What is his name?\n"
    (t,) = window_segments(DATED, fact, composer, EncoderConfig(window=2, context="transcript"))
    assert smol_tokenizer.decode(list(t.context)) == raw
    (p,) = window_segments(DATED, fact, composer, EncoderConfig(window=2, context="prefix"))
    assert list(p.context) == composer.prefix_ids() + list(t.context)
    (m,) = window_segments(DATED, fact, composer, EncoderConfig(window=2, context="memory"))
    lines = [composer.fact_ids(memory_text(x.speaker, x.text, x.timestamp)) for x in DATED[:2]]
    assert list(m.context) == composer.prefix_ids() + lines[0] + lines[1]
    assert smol_tokenizer.decode(lines[0]) == "- [2023-05-08] A: I got a dog.\n"
    (m0,) = window_segments(DATED, fact, composer, EncoderConfig(window=0, context="memory"))
    assert list(m0.context) == composer.prefix_ids()  # w=0: the shared sink only
    (cut,) = window_segments(DATED, fact, composer,
                             EncoderConfig(window=2, context="memory", max_window_tokens=5))
    assert list(cut.context) == composer.prefix_ids() + (lines[0] + lines[1])[-5:]


@pytest.mark.slow
def test_memory_context_with_a_full_window_is_the_joint_prefill(smollm2):
    """Raw-turn facts encoded after the prefix and every earlier turn as memory lines
    have exactly the K/V of one prefill of the whole memory list (the limiting case)."""
    from inferscale.compose import memory_text

    model, tok = smollm2.model, smollm2.tokenizer
    composer = Composer(tok)
    texts = [memory_text(t.speaker, t.text, t.timestamp) for t in DATED]
    facts = [FactSpec(f"f{i}", x, i) for i, x in enumerate(texts)]
    mem = encode_facts(model, tok, DATED, facts, EncodingIdentity.of_model(
        EncoderConfig(window=10, context="memory", dtype="float32"), smollm2.fingerprint, model),
        progress=False)
    ids = composer.prefix_ids() + [t for x in texts for t in composer.fact_ids(x)]
    ref = joint_prefill_kv(model, ids)
    pos = 0
    for chunk in mem.chunks:
        n = len(chunk.token_ids)
        assert list(chunk.token_ids) == ids[pos:pos + n]
        assert (rotated(chunk.kv, torch.arange(pos, pos + n), model)
                - ref[pos:pos + n, 0]).abs().max().item() <= 1e-4
        assert (chunk.kv[:, 1] - ref[pos:pos + n, 1]).abs().max().item() <= 1e-4
        pos += n
    assert pos == len(ids)


@pytest.mark.slow
def test_key_temperature_scales_fact_keys_only(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    facts = [FactSpec("f1", "A has a dog named Rex.", 2)]
    def identity(**kw) -> EncodingIdentity:
        return EncodingIdentity.of_model(EncoderConfig(window=1, dtype="float32", **kw),
                                         smollm2.fingerprint, model)

    base = encode_facts(model, tok, TURNS, facts, identity(), progress=False)
    hot = encode_facts(model, tok, TURNS, facts, identity(key_temperature=0.5), progress=False)
    torch.testing.assert_close(hot.chunks[0].kv, base.chunks[0].kv)  # the prefix: never
    torch.testing.assert_close(hot.chunks[1].kv[:, 0], base.chunks[1].kv[:, 0] * 2)
    torch.testing.assert_close(hot.chunks[1].kv[:, 1], base.chunks[1].kv[:, 1])
    assert hot.encoder_config["key_temperature"] == 0.5
