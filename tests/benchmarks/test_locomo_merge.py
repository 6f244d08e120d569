"""Joining a LoCoMo sweep run in parts (``benchmarks.locomo_merge``): each variant stays
paired with the baseline of the part that answered it, unfinished variants come from the
part that finished them, parts of different sweeps are refused. (The rule reading the
paired differences: tests/benchmarks/test_locomo_select.py.)"""

from __future__ import annotations

import json

import pytest

from benchmarks.locomo_merge import complete_variants, main, merge

KS = [5, 10, 20, 50]


def _part(f1: dict[str, float], modes: list[str], planned: list[str],
          skip: tuple = ()) -> dict:
    """A ``benchmarks.locomo`` result of one conversation: mode ``m`` scores ``f1[m]`` at
    every k (prompt included), with rows, summaries and records as the benchmark writes
    them; ``skip``: (mode, k) cells never answered (a run cut short)."""
    cells = [(m, k) for m in ["prompt", *modes] for k in KS if (m, k) not in skip]
    rows = [{"scope": "pooled", "mode": m, "k": k, "f1": f1[m]} for m, k in cells]
    rows.append({"scope": "pooled", "mode": "nomem", "k": 0, "f1": 0.05})
    s = {"questions": 4, "f1_nomem": 0.05, "continues_nomem": 0.0,
         "continues_prompt": 0.08, **{f"evidence_recall_k{k}": 0.5 for k in KS}}
    for m, k in cells:
        s[f"f1_{m}_k{k}"] = f1[m]
        s[f"injected_share_{m}_k{k}"] = 0.0 if m == "prompt" else 1.0
        if m != "prompt":
            s[f"ci_{m}_minus_prompt_k{k}"] = [f1[m] - f1["prompt"] - 0.1,
                                              f1[m] - f1["prompt"] + 0.1]
    s |= {f"continues_{m}": 0.05 for m in modes}
    records = [{"conversation": "conv-x", "mode": m, "k": k, "q": q, "f1": f1[m]}
               for m, k in cells for q in range(4)]
    return {"command": f"python -m benchmarks.locomo {' '.join(modes)}", "model": "m",
            "fact_mode": "raw", "query_template": "t", "max_tokens": 8, "greedy": True,
            "kv_dtype": "bfloat16", "compiled": True, "ks": KS, "encoder_defaults": {},
            "variants": {v: {"window": 20} for v in planned}, "wall_seconds": 10.0,
            "phases": [{"mode": m} for m in ["prompt", *modes]], "complete": not skip,
            "conversations": {"conv-x": {"facts": 9, "questions": 4,
                                         "rows": [{**r, "scope": "conv-x"} for r in rows],
                                         "summary": dict(s)}},
            "rows": rows, "summary": s, "records": records,
            "questions_list": {"conv-x": [{"id": f"q{i}"} for i in range(4)]}}


def test_each_variant_keeps_its_own_parts_baseline():
    # part 0: a and b done, c cut short at k = 50; part 1 (a prompt answering one more
    # question right) redoes b and c
    p0 = _part({"prompt": 0.5, "a": 0.25, "b": 0.5, "c": 1.0}, ["a", "b", "c"],
               ["a", "b", "c"], skip=(("c", 50),))
    p1 = _part({"prompt": 0.75, "b": 1.0, "c": 1.0}, ["b", "c"], ["b", "c"])
    assert complete_variants(p0) == ["a", "b"]
    m = merge([p0, p1], "python -m benchmarks.locomo_merge p0 p1 --out m")
    s = m["summary"]
    assert m["complete"] and list(m["variants"]) == ["a", "b", "c"]
    assert [p["variants"] for p in m["parts"]] == [["a", "b"], ["c"]]
    assert s["f1_prompt_k5"] == p0["summary"]["f1_prompt_k5"]  # part 0 stands
    assert s["f1_b_k5"] == p0["summary"]["f1_b_k5"]  # b from the first part that finished it
    assert s["f1_b_minus_prompt_k5"] == 0.0
    # c: 1.0 against its own part's 0.75, not part 0's 0.5
    assert s["f1_c_minus_prompt_k5"] == 0.25 and s["f1_c_k5"] - s["f1_prompt_k5"] == 0.5
    assert s["ci_c_minus_prompt_k5"] == p1["summary"]["ci_c_minus_prompt_k5"]
    assert s["prompt_f1_spread"] > 0
    assert sorted({(r["mode"], r["part"]) for r in m["records"]}) == [
        ("a", 0), ("b", 0), ("c", 1), ("prompt", 0), ("prompt", 1)]  # not part 1's b
    assert {r["mode"] for r in m["rows"]} == {"prompt", "nomem", "a", "b", "c"}
    assert len([r for r in m["rows"] if r["mode"] == "prompt"]) == len(KS)
    assert m["conversations"]["conv-x"]["summary"]["f1_c_minus_prompt_k5"] == \
        s["f1_c_minus_prompt_k5"]
    assert m["command"].startswith("python -m benchmarks.locomo_merge")
    assert m["parts"][1]["command"] == p1["command"]


def test_a_variant_no_part_finished_leaves_it_incomplete():
    p0 = _part({"prompt": 0.5, "a": 0.25, "c": 1.0}, ["a", "c"], ["a", "c"],
               skip=(("c", 50),))
    p1 = _part({"prompt": 0.5, "b": 0.25}, ["b"], ["b"])
    m = merge([p0, p1])
    assert not m["complete"] and "c" not in m["variants"]
    assert not any(k.startswith("f1_c_") for k in m["summary"])


@pytest.mark.parametrize("change", [{"ks": [5, 10]}, {"kv_dtype": "float32"},
                                    {"questions_list": {}}])
def test_parts_of_different_sweeps_are_refused(change):
    p0 = _part({"prompt": 0.5, "a": 0.25}, ["a"], ["a"])
    p1 = {**_part({"prompt": 0.5, "b": 0.25}, ["b"], ["b"]), **change}
    with pytest.raises(SystemExit):
        merge([p0, p1])
    with pytest.raises(SystemExit):
        merge([p0])


def test_cli(tmp_path, capsys):
    paths = []
    for i, part in enumerate([_part({"prompt": 0.5, "a": 0.25}, ["a"], ["a", "b"]),
                              _part({"prompt": 0.5, "b": 0.25}, ["b"], ["b"])]):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(part))
    out = tmp_path / "merged.json"
    main([*map(str, paths), "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert printed["complete"] and printed["parts"] == [1, 1]
    assert json.loads(out.read_text())["variants"] == {"a": {"window": 20}, "b": {"window": 20}}
