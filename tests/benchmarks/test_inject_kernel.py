"""``benchmarks.inject_kernel``: refuses bad sizes and a machine without CUDA; on CUDA
(the GPU machine's ``tests`` phase) times both memory dtypes at tiny sizes."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import inject_kernel


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        inject_kernel.main(["--ks", "401"])
    with pytest.raises(SystemExit):
        inject_kernel.main(["--ks", "50", "--blocks", "4"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_so(capsys):
    with pytest.raises(SystemExit):
        inject_kernel.main(["--ks", "2", "--facts", "4"])
    assert "needs CUDA" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_both_dtypes_are_timed(tmp_path):
    out = tmp_path / "kernel.json"
    result = inject_kernel.main(["--facts", "12", "--tokens", "10", "--prefix", "3",
                                 "--ks", "2", "5", "--shape", "2", "2", "16",
                                 "--blocks", "16", "--queries", "3", "--repeats", "3",
                                 "--warmup", "1", "--out", str(out)])
    rows = {(r["memory"], r["k"]): r for r in result["rows"]}
    assert set(rows) == {(m, k) for m in ("fp8", "bf16") for k in (2, 5)}
    assert all(r["gpu_us"] > 0 and r["host_us"] > 0 for r in rows.values())
    assert "fp8_minus_bf16_gpu_us_k5" in result["summary"]
    assert json.loads(out.read_text())["command"].startswith(
        "python -m benchmarks.inject_kernel")
