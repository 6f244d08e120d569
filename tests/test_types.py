"""The contracts of inferscale.types: the one user-id rule (whole-string checks, no
whitespace, control or invisible characters), which every backend accepts."""

from __future__ import annotations

import pytest

from inferscale.types import InvalidUserIdError, check_user_id, user_id_problem


@pytest.mark.parametrize("user", ["ann", "Zoë", "conv-26", "bob.smith", "名前", "a.b_c-d",
                                  "x" * 128, "o'brien", "user@example.com",
                                  "*", "%", "_", "?", "a*"])  # never patterns (facts store)
def test_valid_user_ids(user):
    assert check_user_id(user) == user and user_id_problem(user) is None


@pytest.mark.parametrize("user", [
    "bob\n",  # a regex with `$` accepts this one
    "bob\r\n", "\nbob", "bo\x00b", "bo\tb", "\x1b[31mbob",
    "\u202ebob",  # right-to-left override (bidi)
    "bob\u2066", "bo\u200bb",  # bidi isolate, zero-width space
    "bob\ufeff", "bo\u00adb",  # BOM, soft hyphen (category Cf)
    "bob\u2028", "bob\u2029",  # line / paragraph separators
    "bo\ue000b", "bo\U000e0001b",  # private use, tag character
    "\ud800", "",
    " bob", "bob ", " ", ".", "..", "a/b", "a\\b", "../x",
    "ann smith", "ann\u00a0smith", "ann\u3000smith", "ann\u2003smith",  # inner whitespace
    "x" * 129, None, 7, b"bob",
])
def test_invalid_user_ids(user):
    assert user_id_problem(user) is not None
    with pytest.raises(InvalidUserIdError):
        check_user_id(user)


def test_settings_refuse_a_bad_user_in_api_keys(monkeypatch):
    from pydantic import ValidationError

    from inferscale.settings import Settings

    monkeypatch.setenv("INFERSCALE_API_KEYS", '{"key-ann": "ann"}')
    assert Settings().api_keys == {"key-ann": "ann"}
    monkeypatch.setenv("INFERSCALE_API_KEYS", '{"key-bob": "bob\\n"}')
    with pytest.raises(ValidationError, match="user id"):
        Settings()


def test_every_backend_accepts_every_valid_user_id():
    """Every code point, alone and inside an id: whatever the rule accepts, Mem0 takes
    unchanged (it refuses whitespace anywhere) and names one store folder and one Prefect
    artifact key; so one user's id can never fail another user's extraction."""
    from mem0.memory.main import _validate_and_trim_entity_id

    from inferscale.artifacts.layout import user_dirname
    from inferscale.artifacts.lineage_view import artifact_key

    accepted = 0
    for cp in range(0x110000):
        ch = chr(cp)
        for user in (ch, f"a{ch}b"):
            if user_id_problem(user) is not None:
                continue
            accepted += 1
            assert _validate_and_trim_entity_id(user, "user_id") == user, hex(cp)
            assert user_dirname(user)
            key = artifact_key(user, "fp")
            assert key.startswith("mem-") and key == key.lower(), hex(cp)
    assert accepted > 250_000  # letters, digits, symbols and punctuation of every script


def test_kv_geometry_of_a_config():
    """A model's KV geometry from its config (object or ``config.json`` mapping): explicit
    ``head_dim`` and KV heads, or their defaults; a multimodal config's text part."""
    from types import SimpleNamespace

    from inferscale.types import KVGeometry

    assert KVGeometry.of_config({"num_hidden_layers": 30, "num_attention_heads": 9,
                                 "num_key_value_heads": 3, "hidden_size": 576}) == (30, 3, 64)
    assert KVGeometry.of_config(SimpleNamespace(num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=None, hidden_size=64,
                                                head_dim=None)) == (2, 4, 16)
    assert KVGeometry.of_config({"text_config": {"num_hidden_layers": 4,
                                                 "num_attention_heads": 8, "head_dim": 128,
                                                 "num_key_value_heads": 2}}) == (4, 2, 128)
    assert KVGeometry(30, 3, 64).describe() == "[L=30, H=3, D=64]"


def test_a_checkpoint_s_geometry_is_the_loaded_model_s(smollm2):
    """What the pipeline's publish checks the KV against (the checkpoint's config, read
    without loading it) is what the encoder records from the loaded model."""
    from inferscale.encode.capture import kv_shape
    from inferscale.models import checkpoint_geometry

    assert checkpoint_geometry(smollm2.checkpoint) == kv_shape(smollm2.model) == (30, 3, 64)


def test_kv_formats_name_memory_orders_of_one_logical_layout():
    """Every KV tensor is indexed [T, 2, L, H, D]; a format is only where the bytes lie:
    token-major is dense as indexed, layer-major is [2, L, T, H, D] in memory."""
    import torch

    from inferscale.types import KVFormat

    kv = torch.randn(5, 2, 3, 2, 4)  # [T, 2, L, H, D]
    token = KVFormat.TOKEN_MAJOR.copy(kv)
    layer = KVFormat.LAYER_MAJOR.copy(kv, torch.float64)
    assert token.is_contiguous() and torch.equal(token, kv)
    assert layer.dtype == torch.float64 and torch.equal(layer, kv.double())
    assert layer.permute(KVFormat.LAYER_MAJOR.order).is_contiguous()  # [2, L, T, H, D]
    assert not layer.is_contiguous()
    assert layer.shape == KVFormat.LAYER_MAJOR.empty(5, (3, 2, 4), torch.float32).shape
