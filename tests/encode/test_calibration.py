"""Key-temperature calibration: the fit recovers known temperatures, the probes, and the
encoder storing, recording and reusing calibrated keys."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from inferscale.compose import Composer
from inferscale.encode.calibration import (
    PROBE_MAX_TOKENS, POOL_FACTS, KeyCalibration, Probe, calibrate, choose_probes, fit_scales)
from inferscale.encode.capture import prefill_qk
from inferscale.encode.encoder import FactSpec, TurnText, encode_facts
from inferscale.encode.identity import EncodeError, EncoderConfig, EncodingIdentity
from inferscale.encode.rope import RotaryTables, rotate_keys
from inferscale.types import ChunkKV


def _items(scale: torch.Tensor, seed: int = 0, probes: int = 3):
    """Random rotated queries and keys where the injected span's keys are the prefill's
    times ``scale`` ``[L, H]``: the fit must find T = scale."""
    g = torch.Generator().manual_seed(seed)
    L, H = scale.shape
    items = []
    for p in range(probes):
        S, R, a, b = 40 + 7 * p, 9, 4, 30 + 7 * p
        q = torch.randn(L, R, 2 * H, 16, generator=g)  # two query heads per KV head
        k = torch.randn(L, S, H, 16, generator=g) * 1.5
        items.append((q, k, k[:, a:b] * scale[:, None, :, None], a, b))
    return items


def test_fit_recovers_per_head_temperatures():
    truth = torch.tensor([[0.7, 1.0, 1.6], [1.3, 0.9, 1.0]])
    scales, diag = fit_scales(_items(truth), 0.25, "head")
    torch.testing.assert_close(1 / scales.float(), truth, atol=2e-4, rtol=0)
    assert diag["kl_calibrated"] < 1e-6 < diag["kl_injected"]
    assert diag["mass_calibrated"] == pytest.approx(diag["mass_prefill"], abs=1e-4)
    assert diag["at_bound"] == 0


def test_fit_per_layer_pools_heads_and_is_one_where_keys_agree():
    truth = torch.tensor([[1.25, 1.25], [1.0, 1.0]])
    scales, diag = fit_scales(_items(truth, seed=3), 0.25, "layer")
    torch.testing.assert_close(1 / scales.float(), truth, atol=2e-4, rtol=0)
    assert round(1 / scales[1, 0].item(), 3) == 1.0  # agreeing keys: exactly 1 once rounded


def test_fit_stops_at_the_range():
    scales, diag = fit_scales(_items(torch.tensor([[9.0]])), 0.25, "head")
    assert 1 / scales.item() == pytest.approx(2.0, abs=1e-4) and diag["at_bound"] == 1


def test_key_calibration_apply_record_digest():
    cal = KeyCalibration("head", [[1.0, 2.0], [0.5, 1.0]], {"probes": 3})
    keys = torch.ones(3, 2, 2, 4, dtype=torch.bfloat16)  # [T, L, H, D]: rows' K half
    out = cal.apply(keys)
    assert out.dtype == torch.bfloat16
    assert out[:, 0, 1].eq(0.5).all() and out[:, 1, 0].eq(2.0).all() and out[:, 0, 0].eq(1).all()
    assert cal.record() == {"granularity": "head", "temperatures": [[1.0, 2.0], [0.5, 1.0]],
                            "probes": 3}
    exact = KeyCalibration("layer", [[1.0, 1.0]])
    assert exact.exact and exact.apply(keys) is keys
    assert cal.digest() != exact.digest() and len(cal.digest()) == 32


def _facts(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = [f"f{i}" for i in range(n)]
    tokens = {f: torch.randint(0, 40, (int(torch.randint(3, 30, (1,), generator=g)),),
                               generator=g).tolist() for f in ids}
    return ids, tokens, {f: n - i for i, f in enumerate(ids)}  # source order: reversed


def test_probes_come_from_the_first_facts_laid_out_as_served():
    ids, tokens, source = _facts(300)
    cfg = EncoderConfig(text_tail=2, memory_order="relevance_last", tail_max_k=0)
    probes = choose_probes(ids, tokens, source, cfg)
    pool = set(sorted(ids, key=source.get)[:POOL_FACTS])
    assert len(probes) == 8
    assert probes == choose_probes(ids, tokens, source, cfg)  # deterministic
    for p in probes:
        assert {p.question, *p.injected, *p.tail} <= pool and p.question not in p.injected
        assert len(p.tail) == 2
    # the k = 5 probes: 3 injected, best last (relevance_last)
    assert sorted(len(p.injected) for p in probes)[:2] == [3, 3]
    # a tail only at k <= 5: the larger probes inject everything
    short = choose_probes(ids, tokens, source, EncoderConfig(text_tail=5, tail_max_k=5))
    assert all(not p.tail for p in short) and len(short) == 6  # the k = 5 probes: all tail
    assert choose_probes(ids[:1], tokens, source, EncoderConfig()) == []


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), tail=st.integers(0, 6), max_k=st.integers(0, 60),
       order=st.sampled_from(["relevance", "relevance_last", "chronological"]),
       seed=st.integers(0, 1000))
def test_probe_invariants(n, tail, max_k, order, seed):
    ids, tokens, source = _facts(n, seed)
    for p in choose_probes(ids, tokens, source, EncoderConfig(
            text_tail=tail, tail_max_k=max_k, memory_order=order)):
        memory = [*p.injected, *p.tail]
        assert p.injected and p.question not in memory and len(set(memory)) == len(memory)
        assert len(memory) <= min(50, n - 1)
        assert sum(len(tokens[f]) for f in memory) <= PROBE_MAX_TOKENS


def test_calibrate_needs_a_probe_and_a_granularity():
    with pytest.raises(EncodeError, match="granularity"):
        calibrate(None, None, [], {}, {}, {}, "none", None)
    with pytest.raises(EncodeError, match="probe"):
        calibrate(_tiny(), None, [], {}, {}, {}, "head", None)


def _tiny():
    from tiny_models import tiny_llama
    return tiny_llama()


@pytest.mark.slow
def test_calibrate_real_model_finds_one_for_prefill_keys_and_a_known_scale(smollm2):
    """Stored keys that are the probe's own prefill keys get T = 1 exactly; the same
    keys doubled in one KV head get T = 2 there (the rotation, GQA heads and the model's
    attention scaling all on the real model)."""
    model, tok = smollm2.model, smollm2.tokenizer
    composer = Composer(tok)
    texts = {"a": "Caroline adopted a dog named Rex.", "b": "Rex likes long walks.",
             "c": "Melanie paints sunsets.", "q": "What is the dog called?"}
    ids = {f: composer.fact_ids(t) for f, t in texts.items()}
    probe = Probe("q", ("a", "b", "c"))
    prompt, m = composer.compose([composer.prefix_ids()] + [ids[f] for f in "abc"], texts["q"])
    _, k = prefill_qk(model, prompt, m)  # [L, S, H, D] pre-RoPE
    start = len(composer.prefix_ids())
    stored, pos = {}, start
    for f in "abc":
        stored[f] = k[:, pos:pos + len(ids[f])].transpose(0, 1)  # [T, L, H, D], as stored
        pos += len(ids[f])

    def run(keys, granularity):
        return calibrate(model, composer, [probe], ids, texts, keys, granularity,
                         lambda x, r: prefill_qk(model, x, r))

    same = run(stored, "head")
    assert same.exact and same.stats["probes"] == 1 and same.stats["query_rows"] > 5
    assert same.stats["kl_injected"] < 1e-6
    doubled = {f: v.clone() for f, v in stored.items()}
    for v in doubled.values():
        v[:, :, 1] *= 2  # KV head 1
    hot = run(doubled, "head")
    assert all(row[1] == pytest.approx(2.0, abs=2e-3) and row[0] == row[2] == 1.0
               for row in hot.temperatures)
    pooled = run(doubled, "layer")  # one temperature per layer, between 1 and 2
    assert all(len(set(row)) == 1 and 1.0 < row[0] < 2.0 for row in pooled.temperatures)
    # and stored pre-RoPE keys rotated by the model's tables are what the fit compares
    tables = RotaryTables.from_model(model)
    assert rotate_keys(stored["a"], torch.arange(start, start + len(ids["a"])), tables,
                       token_dim=0).shape == stored["a"].shape


TURNS = [TurnText("Caroline" if i % 2 else "Melanie", text) for i, text in enumerate([
    "I adopted a dog last week.", "What is his name?", "He is called Rex.",
    "Does Rex like walks?", "He loves the river path.", "I painted the lake yesterday.",
    "Which lake?", "Lake Tahoe, at sunset.", "My kids love camping.", "Where do you camp?",
    "In the mountains near Denver.", "Rex came camping too."])]


@pytest.mark.slow
def test_encoder_stores_records_and_reuses_calibrated_keys(smollm2, monkeypatch):
    from inferscale.encode import calibration

    # small probes, so that some of the 12 facts are not probed (reuse is visible)
    monkeypatch.setattr(calibration, "PROBE_KS", (2, 3))
    monkeypatch.setattr(calibration, "PROBES_PER_K", 1)
    model, tok = smollm2.model, smollm2.tokenizer
    facts = [FactSpec(f"f{i}", f"{t.speaker}: {t.text}", i) for i, t in enumerate(TURNS)]

    def encode(reuse=None, **kw):
        cfg = EncoderConfig(window=3, dtype="float32", text_tail=0, **kw)
        identity = EncodingIdentity.of_model(cfg, smollm2.fingerprint, model)
        return encode_facts(model, tok, TURNS, facts, identity, progress=False, reuse=reuse)

    base = encode()
    cal = encode(key_calibration="head")
    rec = cal.calibration
    assert base.calibration == {} and rec["granularity"] == "head"
    assert rec["probes"] == 2 and len(rec["temperatures"]) == model.config.num_hidden_layers
    assert not KeyCalibration("head", rec["temperatures"]).exact
    assert cal.encoder_config["key_calibration"] == "head"
    assert "key_calibration" not in base.encoder_config  # the neutral value is not recorded
    assert cal.stats["calibration_facts"] > 0 and "calibration_kl_calibrated" in cal.stats
    assert cal.stats["calibration_kl_calibrated"] <= cal.stats["calibration_kl_injected"]
    torch.testing.assert_close(cal.chunks[0].kv, base.chunks[0].kv, rtol=0, atol=0)
    applied = KeyCalibration("head", rec["temperatures"])
    for b, c in zip(base.chunks[1:], cal.chunks[1:]):  # facts: the model's keys / T
        torch.testing.assert_close(c.kv[:, 0], applied.apply(b.kv[:, 0]), rtol=0, atol=0)
        torch.testing.assert_close(c.kv[:, 1], b.kv[:, 1], rtol=0, atol=0)
        assert c.content_key != b.content_key
    # a second version reuses every fact the probes did not encode, byte for byte
    rows = {c.content_key: ChunkKV(c.kv) for c in cal.chunks}
    again = encode(reuse=rows, key_calibration="head")
    assert again.calibration == rec
    assert again.stats["reused"] == len(facts) - again.stats["calibration_facts"] > 0
    for a, c in zip(again.chunks, cal.chunks):
        assert torch.equal(a.kv, c.kv) and a.content_key == c.content_key
    # other temperatures (per layer): no row is reused
    layer = encode(reuse=rows, key_calibration="layer")
    assert layer.stats["reused"] == 0 and layer.calibration["temperatures"] != rec["temperatures"]
