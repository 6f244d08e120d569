"""The LoCoMo default's selection rules (``benchmarks.locomo_select``): the exact rule, the
injection rule and its fallbacks, the pick written into a result, the layout as flags."""

from __future__ import annotations

import json

import pytest

from benchmarks.locomo_select import apply, main, select, select_injection

KS = [5, 50]


def test_select_rule_and_apply():
    result = {"ks": KS, "encoder_defaults": {"text_tail": 0, "key_temperature": 1.0,
                                             "window": 5},
              "variants": {"tail9": {"text_tail": 9}, "hot": {"key_temperature": 0.9},
                           "w20": {"window": 20}, "w5": {"window": 5}},
              "summary": {"f1_prompt_k5": 0.10, "f1_prompt_k50": 0.10,
                          "f1_tail9_k5": 0.30, "f1_tail9_k50": 0.30,  # too long a tail
                          "f1_hot_k5": 0.20, "f1_hot_k50": 0.20,  # not exact
                          "f1_w20_k5": 0.11, "f1_w20_k50": 0.095,
                          "f1_w5_k5": 0.11, "f1_w5_k50": 0.095,
                          "continues_w5": 0.1, "continues_prompt": 0.05}}
    name, fields, score = select(result)
    assert name == "w5" and score == {"min_diff": -0.005, "mean_diff": 0.0025}  # tie: window
    assert select(result, exact=False)[0] == "hot"
    assert select(result, max_tail=9)[0] == "tail9"
    result["default_variant"] = "hot"
    apply(result, name, "rule")
    assert result["default_variant"] == "w5"
    assert result["earlier_defaults"][0]["default_variant"] == "hot"
    assert result["summary"]["f1_default_minus_prompt_min"] == -0.005
    assert result["summary"]["continues_default_minus_prompt"] == 0.05


RULE_KS = [5, 10, 20, 50]


def _rule_result(rows: dict) -> dict:
    """A result whose variants have (F1 per k, injected share per k >= 10, continues)."""
    s = {f"f1_prompt_k{k}": 0.10 for k in RULE_KS} | {"continues_prompt": 0.08}
    variants = {}
    for name, (f1, share, cont, fields) in rows.items():
        variants[name] = fields
        s |= {f"f1_{name}_k{k}": x for k, x in zip(RULE_KS, f1)}
        s |= {f"injected_share_{name}_k{k}": x for k, x in zip(RULE_KS, share)}
        s[f"continues_{name}"] = cont
    return {"ks": RULE_KS, "summary": s, "variants": variants,
            "encoder_defaults": {"text_tail": 5, "window": 20, "key_temperature": 1.0}}


def test_injection_rule():
    result = _rule_result({
        # the most accurate, but prefills half the memory at k = 10
        "tail5": ([0.12] * 4, [0, 0.5, 0.75, 0.9], 0.06, {}),
        # qualifies: worst k -0.008
        "per_k": ([0.11, 0.092, 0.095, 0.12], [0, 1.0, 1.0, 1.0], 0.05,
                  {"text_tail": 5, "tail_max_k": 5}),
        # qualifies better: worst k -0.004 (calibrated keys are allowed)
        "cal": ([0.105, 0.096, 0.10, 0.12], [0, 1.0, 1.0, 1.0], 0.07,
                {"text_tail": 0, "key_calibration": "head"}),
        # one k below prompt - 0.01
        "pure": ([0.089, 0.11, 0.11, 0.12], [1.0] * 4, 0.03, {"text_tail": 0}),
        # continues the transcript too often
        "chatty": ([0.13] * 4, [1.0] * 4, 0.11, {"text_tail": 0}),
        # 0.89 at k = 10: just short
        "tail1": ([0.12] * 4, [0.8, 0.89, 0.95, 0.98], 0.05, {"text_tail": 1}),
        # boundaries: share exactly 0.9, F1 exactly -0.01, continues exactly +0.02
        "edge": ([0.09, 0.09, 0.09, 0.09], [0.8, 0.9, 0.9, 0.9], 0.10, {"text_tail": 1}),
    })
    name, _, score = select_injection(result)
    assert name == "cal" and score["rule_met"] and score["min_diff"] == -0.004
    assert score["meets"] == {"share": True, "f1": True, "continues": True}
    del result["variants"]["cal"]
    assert select_injection(result)[0] == "per_k"
    del result["variants"]["per_k"]
    assert select_injection(result)[0] == "edge"  # the bounds are inclusive
    del result["variants"]["edge"]
    # none qualifies: the most injected of the accurate ones (item 5), flagged
    name, _, score = select_injection(result)
    assert name == "tail1" and score["rule_met"] is False
    assert score["fallback"] == "most injected accurate"
    for gone in ("tail1", "tail5"):
        del result["variants"][gone]
    name, _, score = select_injection(result)
    assert name == "chatty" and score["fallback"] == "no variant is accurate"
    result["variants"]["per_k"] = {"text_tail": 5, "tail_max_k": 5}
    apply(result, "per_k", "rule")
    s = result["summary"]
    assert s["f1_default_minus_prompt_min"] == -0.008 and s["injected_share_min_k10"] == 1.0
    assert s["continues_default_minus_prompt"] == -0.03 and result["default_variant"] == "per_k"
    with pytest.raises(SystemExit, match="needs k"):
        select_injection({**result, "ks": [5, 50]})


def test_select_layout_flags(tmp_path, capsys):
    result = _rule_result({"per_k": ([0.11] * 4, [0, 1.0, 1.0, 1.0], 0.05,
                                     {"memory_order": "relevance_last", "text_tail": 5,
                                      "tail_max_k": 5})})
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    main([str(path), "--rule", "injection", "--layout"])
    assert capsys.readouterr().out.split() == [
        "--memory-order", "relevance_last", "--text-tail", "5", "--tail-max-k", "5"]
    main([str(path), "--rule", "injection", "--apply"])
    stored = json.loads(path.read_text())
    assert stored["default_variant"] == "per_k" and stored["default_score"]["rule_met"]
    assert stored["summary"]["injected_share_min_k10"] == 1.0


def test_a_merged_results_paired_differences_decide():
    """A result joined from parts (benchmarks.locomo_merge) gives each variant's F1
    difference against its own part's baseline: the rule uses that, not the subtraction
    from the first part's baseline (which would make ``late`` look best)."""
    result = _rule_result({"early": ([0.11] * 4, [0, 1.0, 1.0, 1.0], 0.05, {}),
                           "late": ([0.13] * 4, [0, 1.0, 1.0, 1.0], 0.05, {})})
    result["summary"] |= {f"f1_early_minus_prompt_k{k}": 0.01 for k in RULE_KS}
    result["summary"] |= {f"f1_late_minus_prompt_k{k}": -0.002 for k in RULE_KS}
    name, _, score = select_injection(result)
    assert name == "early" and score["min_diff"] == 0.01
    apply(result, "late", "rule")
    assert result["summary"]["f1_default_minus_prompt_min"] == -0.002
