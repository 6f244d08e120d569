"""Chunked RoPE: tables from the model, rotation on any positions and dtypes."""

import pytest
import torch

from inferscale.encode.rope import RopeError, RotaryTables, apply_rotary, rotate_keys
from tiny_models import ROPE_TYPES, random_kv, tiny_llama


@pytest.mark.parametrize("rope", sorted(ROPE_TYPES))
def test_tables_match_the_models_own_rotary_module(rope):
    model = tiny_llama(ROPE_TYPES[rope])
    tables = RotaryTables.from_model(model)
    pos = torch.tensor([0, 3, 17, 90, 200])
    cos, sin = tables.cos_sin(pos)
    ref_cos, ref_sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos[None])
    torch.testing.assert_close(cos, ref_cos[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin[0], rtol=0, atol=0)
    # from_config builds the same module without the weights
    cos2, sin2 = RotaryTables.from_config(model.config).cos_sin(pos)
    torch.testing.assert_close(cos2, cos, rtol=0, atol=0)
    torch.testing.assert_close(sin2, sin, rtol=0, atol=0)


def test_yarn_carries_attention_scaling():
    tables = RotaryTables.from_model(tiny_llama(ROPE_TYPES["yarn"]))
    cos, sin = tables.cos_sin(torch.tensor([0]))
    assert cos[0, 0].item() == pytest.approx(tables.module.attention_scaling)
    assert tables.module.attention_scaling > 1.0


def test_rotation_matches_hf_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = tiny_llama(ROPE_TYPES["llama3"])
    tables = RotaryTables.from_model(model)
    k, _ = random_kv(tokens=7)  # [L, T, H, D]
    pos = torch.arange(40, 47)
    cos, sin = model.model.rotary_emb(k, pos[None])
    # HF layout [B, H, T, D]; treat layers as batch
    _, ref = apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)
    got = rotate_keys(k, pos, tables)
    torch.testing.assert_close(got, ref.transpose(1, 2), rtol=0, atol=1e-6)
    # token-major layout gives the same numbers
    got_t = rotate_keys(k.transpose(0, 1).contiguous(), pos, tables, token_dim=0)
    torch.testing.assert_close(got_t.transpose(0, 1), got, rtol=0, atol=0)


def test_rotation_composes_and_inverts():
    """R_a then R_b equals R_{a+b}; rotating by -p undoes p (relocation algebra)."""
    tables = RotaryTables.from_model(tiny_llama())
    k, _ = random_kv(tokens=4)
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([11, 11, 11, 11])
    twice = rotate_keys(rotate_keys(k, a, tables), b, tables)
    torch.testing.assert_close(twice, rotate_keys(k, a + b, tables), rtol=0, atol=1e-5)
    back = rotate_keys(rotate_keys(k, a, tables), -a, tables)
    torch.testing.assert_close(back, k, rtol=0, atol=1e-5)


def test_partial_rotary_passes_the_rest_through():
    k = torch.randn(2, 3, 2, 16)
    cos = torch.rand(3, 8)[None, :, None, :]
    sin = torch.rand(3, 8)[None, :, None, :]
    out = apply_rotary(k, cos, sin)
    assert torch.equal(out[..., 8:], k[..., 8:])
    assert not torch.allclose(out[..., :8], k[..., :8])
    # interleaved layout rotates pairs (x0, x1), (x2, x3), ...
    c = torch.full((1, 1, 1, 2), 0.0)
    s = torch.full((1, 1, 1, 2), 1.0)  # 90 degrees
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    y = apply_rotary(x, c, s, interleaved=True)
    torch.testing.assert_close(y, torch.tensor([-2.0, 1.0, 3.0, 4.0]).reshape(1, 1, 1, 4))


def test_bf16_input_computes_in_fp32():
    tables = RotaryTables.from_model(tiny_llama())
    k, _ = random_kv(tokens=6)
    pos = torch.arange(1000, 1006)
    ref = rotate_keys(k.bfloat16().float(), pos, tables)
    got = rotate_keys(k.bfloat16(), pos, tables)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=0, atol=2e-2)  # one bf16 rounding


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    tables = RotaryTables.from_model(tiny_llama(ROPE_TYPES["llama3"]))
    k, _ = random_kv(tokens=6)
    pos = torch.arange(10, 16)
    cpu = rotate_keys(k, pos, tables)
    tables.module.cuda()
    gpu = rotate_keys(k.cuda(), pos.cuda(), tables)
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-5)


def test_shape_errors_are_clear():
    tables = RotaryTables.from_model(tiny_llama())
    k, _ = random_kv(tokens=3)
    with pytest.raises(RopeError, match="positions"):
        rotate_keys(k, torch.arange(4), tables)
    with pytest.raises(RopeError, match="4-D"):
        rotate_keys(k[0], torch.arange(3), tables)
