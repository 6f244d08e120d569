"""The LoCoMo benchmark's memory for a KV variant (``benchmarks.locomo``), encoded by the
real SmolLM2 and published: the variant's encoder config recorded, the model's geometry
kept (publish refuses KV whose geometry it is not told), another stored dtype converted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.locomo import encode_variant, main, parse_variant, prepare
from inferscale.artifacts.layout import StoreConfig
from inferscale.artifacts.read import read_manifest


def test_a_variant_is_encoded_and_published_with_the_models_geometry(
        tmp_path, conversations, smollm2, embedder):
    args = SimpleNamespace(fact_mode="raw", max_questions=2, ks=[3], kv_dtype="float32",
                           batch_tokens=8192)
    conv = prepare(args, conversations[0], smollm2, embedder)
    assert conv.facts.num_rows == 8 and [len(t) for t in conv.top] == [3, 3]
    root = tmp_path / "artifacts"
    for spec in ("w0:window=0", "w0-bf16:window=0,dtype=bfloat16"):
        variant = parse_variant(spec)
        user, version, cfg, stats = encode_variant(args, smollm2, conv, variant, root)
        m = read_manifest(StoreConfig(str(root)), user, smollm2.fingerprint, version)
        assert (m.kv["layers"], m.kv["kv_heads"], m.kv["head_dim"]) == (30, 3, 64)
        assert m.encoder_config == cfg.to_dict() and m.kv["dtype"] == cfg.dtype
        assert stats["facts"] == len({f for t in conv.top for f in t})
        assert ("kv_rel_rms_error" in stats) == (cfg.dtype != "float32")


@pytest.mark.parametrize("argv", [
    ["--part", "1/2", "--select-default"],  # a part cannot pick the default
    ["--part", "3/2"], ["--part", "half"], ["--part", "1/9"]])  # 2 variants: at most 2 parts
def test_a_part_the_sweep_cannot_have_is_refused_before_any_work(argv, capsys):
    with pytest.raises(SystemExit):
        main(["--conversation", "none.json", "--windows", "0", "20", *argv])
    assert "--part" in capsys.readouterr().err
