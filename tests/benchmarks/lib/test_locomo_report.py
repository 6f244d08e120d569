"""The LoCoMo benchmark's scores and tables (``benchmarks.lib.locomo_report``): F1 per
mode and k, pooled only over complete modes, paired intervals, transcript
continuations, two modes compared, the injected share per k (no engine)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.lib import locomo_report

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
