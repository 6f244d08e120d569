"""The retrieval benchmark (``benchmarks.retrieval``) end to end as its CLI runs, tiny:
the result file's keys and figures that were measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_cli_writes_its_result(tmp_path):
    out = tmp_path / "bench.json"
    help_text = subprocess.run([sys.executable, "-m", "benchmarks.retrieval", "--help"],
                               cwd=REPO, check=True, capture_output=True, text=True).stdout
    assert "--device" in help_text and "--embedder-path" in help_text
    subprocess.run([sys.executable, "-m", "benchmarks.retrieval", "--device", "cpu",
                    "--num-facts", "300", "--iters", "20", "--warmup", "3", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True)
    result = json.loads(out.read_text())
    assert set(result) == {"command", "device", "rows", "summary"}
    assert result["command"].startswith("python -m benchmarks.retrieval --device cpu")
    assert result["summary"]["embed_p50_ms"] > 0 and result["summary"]["topk_p50_ms"] > 0
    assert result["summary"]["num_facts"] == 300
