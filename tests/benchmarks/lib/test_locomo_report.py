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


def test_report_injected_share_per_k():
    convs = [_conv("a", 2)]

    def answers(mode, injected):  # 40 fact tokens per answer, ``injected`` of them injected
        return {("a", mode, i, k): {"text": "Rex", "memory_tokens": 10 + injected,
                                    "tail_tokens": 40 - injected, "injected": 10 + injected,
                                    "fallback": None, "fact_tokens": 40,
                                    "injected_fact_tokens": injected if k > 5 else 0}
                for i in range(2) for k in [5, 10, 50]}
    got = {**answers("prompt", 0), **answers("tail", 20), **answers("pure", 40)}
    res = locomo_report.report({"ks": [5, 10, 50]}, convs, got, ["tail", "pure"], [5, 10, 50],
                               "pure")
    s = res["summary"]
    assert s["injected_share_pure_k10"] == 1.0 and s["injected_share_pure_k5"] == 0.0
    assert s["injected_share_tail_k50"] == 0.5 and s["injected_share_prompt_k10"] == 0.0
    assert s["injected_share_min_k10"] == 1.0  # the default's, over k >= 10
    row = next(r for r in res["rows"] if r["mode"] == "tail" and r["k"] == 10)
    assert row["injected_share"] == 0.5


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
    from benchmarks.locomo_select import apply, select_injection

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
    import json

    from benchmarks.locomo_select import main

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


def test_variants_file_sections_and_shared_encodings():
    from benchmarks.locomo_specs import encoding_key, read_specs

    text = "a:window=1\n[one]\nb:window=2  # note\n\n[two]\nc:window=3\n"
    assert read_specs(text) == ["a:window=1", "b:window=2", "c:window=3"]
    assert read_specs(text, "one") == ["b:window=2"]
    with pytest.raises(ValueError, match="no \\[three\\] section"):
        read_specs(text, "three")
    plain = [parse_variant(f"x:text_tail={t}").encoder_config() for t in (0, 5)]
    assert encoding_key(plain[0]) == encoding_key(plain[1])  # layout only: one encoding
    cal = [parse_variant(f"x:text_tail={t},key_calibration=head").encoder_config()
           for t in (0, 5)]
    assert encoding_key(cal[0]) != encoding_key(cal[1])  # the probes follow the layout


def test_the_issue_27_section_parses():
    from pathlib import Path

    from benchmarks.locomo_specs import read_specs

    text = (Path(__file__).resolve().parents[1] / "benchmarks/locomo_variants.txt").read_text()
    specs = [parse_variant(s) for s in read_specs(text, "issue-27")]
    cfgs = [v.encoder_config() for v in specs]
    assert len(specs) == len({v.name for v in specs}) <= 18  # one device call (README)
    assert any(c.key_calibration == "head" for c in cfgs) and any(c.tail_max_k for c in cfgs)
    assert all({"context", "window", "memory_order", "text_tail", "tail_max_k",
                "key_calibration"} <= dict(v.fields).keys() for v in specs)
    assert len(read_specs(text, "issue-18")) == 21
