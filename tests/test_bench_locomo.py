"""benchmarks/locomo.py's variants, report and the default's selection rule (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import locomo_report
from benchmarks.locomo import parse_variant
from benchmarks.locomo_select import apply, select

KS = [5, 50]


def _conv(name, n):
    qs = [{"id": i, "question": f"q{i}", "answer": "Rex", "category": 4,
           "evidence": ["D1:1"], "top_sources": ["D1:1", "D1:2"]} for i in range(n)]
    return SimpleNamespace(name=name, questions=qs, speakers=["Ann"],
                           facts=SimpleNamespace(num_rows=10))


def _answers(convs, mode, text, ks=KS):
    return {(c.name, mode, i, k): {"text": text, "memory_tokens": 100, "tail_tokens": 0,
                                   "injected": 0 if mode in ("prompt", "nomem") else 90,
                                   "fallback": None}
            for c in convs for i in range(len(c.questions)) for k in ks}


def test_parse_variant():
    v = parse_variant("m20:context=memory,window=20,text_tail=5,key_temperature=0.9")
    assert v.name == "m20"
    cfg = v.encoder_config()
    assert (cfg.context, cfg.window, cfg.text_tail, cfg.key_temperature) == ("memory", 20, 5, 0.9)
    with pytest.raises(ValueError, match="unknown encoder field"):
        parse_variant("x:colour=red")
    with pytest.raises(ValueError, match="bad variant name"):
        parse_variant("prompt:window=1")


def test_report_rows_summary_and_the_default():
    convs = [_conv("a", 3), _conv("b", 2)]
    answers = {**_answers(convs, "prompt", "Rex"), **_answers(convs, "nomem", "No idea", [0]),
               **_answers(convs, "good", "Rex"), **_answers(convs, "chatty", "Ann: Rex")}
    del answers[("b", "chatty", 1, 50)]  # an interrupted mode: no row where incomplete
    res = locomo_report.report({"ks": KS}, convs, answers, ["good", "chatty"], KS, "good")
    s = res["summary"]
    assert s["questions"] == 5 and s["f1_prompt_k5"] == 1.0 and s["f1_nomem"] == 0.0
    assert s["f1_good_k50"] == 1.0 and s["ci_good_minus_prompt_k50"] == [0.0, 0.0]
    assert s["continues_chatty"] == 1.0 and s["continues_good"] == 0.0
    assert "f1_chatty_k5" in s and "f1_chatty_k50" not in s  # pooled needs every answer
    assert res["conversations"]["a"]["summary"]["f1_chatty_k50"] == 0.6667  # "ann rex" ~ "rex"
    assert s["f1_default_minus_prompt_min"] == 0.0 and s["evidence_recall_k5"] == 1.0
    row = next(r for r in res["rows"] if r["mode"] == "good" and r["k"] == 5)
    assert row["vs_prompt"]["n"] == 5 and row["fallbacks"] == 0
    assert len(res["records"]) == len(answers)
    text = locomo_report.dumps(res)
    assert text.count("\n") > len(res["records"])  # one line per record


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


def test_compare_two_modes_paired():
    """--compare fp8 bf16: per k the paired difference, its interval, identical shares,
    and the worst k; nothing while a k lacks answers of either mode."""
    convs = [_conv("a", 3), _conv("b", 2)]
    answers = {**_answers(convs, "prompt", "Rex"), **_answers(convs, "bf16", "Rex"),
               **_answers(convs, "fp8", "Rex")}
    answers[("a", "fp8", 0, 50)] = {**answers[("a", "fp8", 0, 50)], "text": "Max"}
    res = locomo_report.report({"ks": KS, "compare": ["fp8", "bf16"]}, convs, answers,
                               ["bf16", "fp8"], KS, None)
    s = res["summary"]
    assert s["f1_fp8_minus_bf16_k5"] == 0.0 and s["ci_fp8_minus_bf16_k5"] == [0.0, 0.0]
    assert s["f1_fp8_minus_bf16_k50"] == -0.2 and s["f1_fp8_minus_bf16_min"] == -0.2
    assert s["same_prediction_fp8_bf16_k50"] == 0.8 and s["same_prediction_fp8_bf16_k5"] == 1.0
    lo, hi = s["ci_fp8_minus_bf16_k50"]
    assert lo <= -0.2 <= hi and lo < 0
    assert res["conversations"]["b"]["summary"]["f1_fp8_minus_bf16_min"] == 0.0
    del answers[("b", "fp8", 1, 5)]
    assert locomo_report.compare(locomo_report.score_answers(convs, answers),
                                 "fp8", "bf16", KS) == {}
