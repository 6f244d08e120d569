"""Content keys: every input of a fact's K/V changes its key; the numerics are named."""

import json

import torch

from inferscale.encode.content_keys import content_key, key_identity
from inferscale.encode.identity import EncoderConfig, EncodingIdentity
from tiny_models import tiny_llama


def of(model, fp: str = "fp", **encoder) -> EncodingIdentity:
    return EncodingIdentity.of_model(EncoderConfig(**encoder), fp, model)


def identity(**encoder) -> str:
    model = tiny_llama()
    return key_identity(of(model, **{"window": 2, **encoder}), model)


def test_content_key_covers_every_input():
    ident = identity()
    base = content_key(ident, [1, 2, 3], [4, 5])
    assert base == content_key(ident, (1, 2, 3), (4, 5)) and len(base) == 64
    others = [
        content_key(ident, [1, 2, 9], [4, 5]),  # a context token
        content_key(ident, [1, 2, 3, 3], [4, 5]),  # the context gained a token
        content_key(ident, [1, 2, 3], [4, 6]),  # a fact token
        content_key(ident, [1, 2], [3, 4, 5]),  # same ids, other boundary
        content_key(identity(window=3), [1, 2, 3], [4, 5]),
        content_key(identity(instruction="x"), [1, 2, 3], [4, 5]),
        content_key(identity(context="transcript"), [1, 2, 3], [4, 5]),
        content_key(identity(key_temperature=2.0), [1, 2, 3], [4, 5]),
        content_key(key_identity(of(tiny_llama(), "fp2", window=2), tiny_llama()),
                    [1, 2, 3], [4, 5]),  # another model
    ]
    assert len({base, *others}) == len(others) + 1


def test_key_identity_names_the_numerics():
    """CPU thread count changes how kernels split sums (measured: different bits), so it
    is part of the identity, as are the compute dtype and the attention kernel."""
    model = tiny_llama()
    ident = json.loads(key_identity(of(model), model))
    assert ident["numerics"]["dtype"] == "float32" and ident["numerics"]["device"] == "cpu"
    assert ident["numerics"]["attention"] == "sdpa"
    assert ident["encoder"] == EncoderConfig().to_dict() and ident["model"] == "fp"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        other = key_identity(of(model), model)
    finally:
        torch.set_num_threads(threads)
    assert other != key_identity(of(model), model)
    bf16 = model.to(torch.bfloat16)
    assert key_identity(of(bf16), bf16) != other
