"""Offline key-temperature calibration: per-layer (or per-layer and KV head) temperatures
``T`` such that injected fact keys stored as ``k / T`` draw the attention the all-text
prefill gives the same facts, fitted at encode time on the user's own memory.

Why a temperature. An injected fact's keys were computed after its own window of turns,
not after the facts it is served with, so the attention a request's tokens pay to
injected memory differs from what the same prompt prefilled as text pays it: sharper or
flatter, and more or less of it on memory rather than on the attention sink and the
question's own tokens. Dividing a stored key by ``T`` divides every logit onto that key by
``T`` and changes nothing else (rotation is linear; values are untouched): APE's attention
temperature over the injected tokens. It is applied once, to the stored keys, so the
serving path is unchanged and costs nothing per request; the prefix (the sink, encoded
exactly as the prefill computes it) is never scaled.

What is fitted. Probes are composed from the user's facts the way a request is
(:func:`choose_probes`): ``[prefix | injected facts | tail facts | question]`` in the
config's layout. One plain prefill of a probe gives, for every *query row* (each token
after the injected facts: the text tail and the question, the tokens that read memory at
serving time), the target ``P_r = softmax(q_r . k_j)`` over the prefill's keys. ``Q_r(s)``
is the same row with the injected facts' stored keys, rotated to the same positions, in
place of their prefill keys and their logits times ``s = 1/T`` (the prefix and the row's
own text keys are the prefill's in both). ``s`` minimises the cross-entropy
``sum_r H(P_r, Q_r(s))`` pooled over every probe's rows and the query heads that share a KV
head (``"head"``) or the whole layer (``"layer"``).

Why this statistic. It is the maximum-likelihood temperature (temperature scaling): one
parameter, convex in ``s`` (the second derivative is the variance of the injected logits
under ``Q``), no training, no labels. At its optimum the expected injected logit is the
same under ``P`` and ``Q``, so the mass on memory and its sharpness both move toward the
prefill's, which matching an entropy alone (same entropy, mass on the wrong tokens) or a
logit scale alone (blind to the sink) would not ensure. Where injected keys equal the
prefill's, the optimum is exactly ``s = 1``. Layers decouple (the queries are the
prefill's), so each is solved alone, by safeguarded Newton on ``log s`` within
:data:`T_RANGE`.

Probes (:func:`choose_probes`). The pool is the user's first :data:`POOL_FACTS` facts in
conversation order (stable once a user has that many: later versions keep their
temperatures, so their content keys still match and unchanged facts are reused); the
questions are :data:`PROBES_PER_K` facts per k of :data:`PROBE_KS`, evenly spaced in the
pool, each asked with its own text; its memory is the k pool facts that share the most
IDF-weighted tokens with it (a training-free stand-in for retrieval, so probes hold
related facts, best first), within :data:`PROBE_MAX_TOKENS`. Temperatures are rounded to
:data:`DECIMALS` decimals, and one whose fit gains almost nothing stays exactly 1.
Everything is a function of the facts, their turns, the model and the encoder config:
what the version id hashes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from inferscale.compose import Composer, memory_layout
from inferscale.encode.identity import EncodeError, EncoderConfig
from inferscale.encode.rope import RotaryTables, rotate_keys

POOL_FACTS = 256
PROBE_KS = (5, 10, 20, 50)
PROBES_PER_K = 2
PROBE_MAX_TOKENS = 2048  # fact tokens of one probe's memory
T_RANGE = (0.5, 2.0)
DECIMALS = 3
_MAX_STEPS = 60  # Newton steps (5-8 in practice; bisection alone needs ~30 for 1e-9)

# (ids, rows_from) -> pre-RoPE queries of tokens rows_from.. [L, R, Hq, D] and keys of
# every token [L, S, H, D] of one plain causal prefill of ids
PrefillQK = Callable[[Sequence[int], int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Probe:
    """A request made of the user's facts: ``question`` (a fact id, asked with its text),
    the facts injected and the tail, in served order."""

    question: str
    injected: tuple[str, ...]
    tail: tuple[str, ...] = ()


@dataclass
class KeyCalibration:
    """Temperatures ``[L][H]`` (one row per layer, one per KV head) and how they were fit."""

    granularity: str
    temperatures: list[list[float]]
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return all(t == 1.0 for row in self.temperatures for t in row)

    def apply(self, keys: torch.Tensor) -> torch.Tensor:
        """Stored keys ``[T, L, H, D]`` (the K half of a chunk's rows) divided by their
        layer's and head's temperature (in float32, back to the keys' dtype); unchanged
        when every temperature is 1."""
        if self.exact:
            return keys
        t = torch.tensor(self.temperatures, dtype=torch.float32, device=keys.device)
        return (keys.float() / t[None, :, :, None]).to(keys.dtype)

    def digest(self) -> str:
        """What stored keys depend on besides the encoding: the temperatures (hashed)."""
        text = json.dumps(self.temperatures, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def record(self) -> dict[str, Any]:
        """The manifest's record (``kv.key_calibration``)."""
        return {"granularity": self.granularity, "temperatures": self.temperatures,
                **self.stats}


def choose_probes(fact_ids: Sequence[str], token_ids: Mapping[str, Sequence[int]],
                  source_index: Mapping[str, int], cfg: EncoderConfig) -> list[Probe]:
    """The probes of this memory (see the module docstring); none when it holds fewer
    than two facts. A probe whose layout injects nothing (all tail) is left out."""
    order = sorted(range(len(fact_ids)), key=lambda i: (source_index[fact_ids[i]], i))
    pool = [fact_ids[i] for i in order[:POOL_FACTS]]
    if len(pool) < 2:
        return []
    sets = {f: set(token_ids[f]) for f in pool}
    df = Counter(t for f in pool for t in sets[f])
    idf = {t: math.log(len(pool) / c) for t, c in df.items()}
    n = len(PROBE_KS) * PROBES_PER_K
    probes: list[Probe] = []
    for j in range(n):
        q = pool[int((j + 0.5) * len(pool) / n)]
        k = min(PROBE_KS[j % len(PROBE_KS)], len(pool) - 1)
        score = {f: sum(idf[t] for t in sets[q] & sets[f]) for f in pool if f != q}
        ranked = sorted(score, key=lambda f: -score[f])  # stable: ties keep pool order
        kept: list[str] = []
        total = 0
        for f in ranked[:k]:
            total += len(token_ids[f])
            if total > PROBE_MAX_TOKENS:
                break
            kept.append(f)
        injected, tail = memory_layout(kept, cfg.memory_order, cfg.text_tail, source_index,
                                       cfg.tail_max_k)
        probe = Probe(q, tuple(injected), tuple(tail))
        if injected and probe not in probes:
            probes.append(probe)
    return probes


def attention_scaling(model: torch.nn.Module, head_dim: int) -> float:
    """The factor the model's attention multiplies ``q . k`` by (``1/sqrt(head_dim)``
    unless its attention modules say otherwise)."""
    for m in model.modules():
        s = getattr(m, "scaling", None)
        if hasattr(m, "layer_idx") and isinstance(s, float):
            return s
    return head_dim ** -0.5


def calibrate(model: torch.nn.Module, composer: Composer, probes: Sequence[Probe],
              token_ids: Mapping[str, Sequence[int]], texts: Mapping[str, str],
              stored_keys: Mapping[str, torch.Tensor], granularity: str,
              prefill_qk: PrefillQK) -> KeyCalibration:
    """Fit the temperatures on ``probes``: ``stored_keys`` are the injected facts' unscaled
    pre-RoPE keys ``[T, L, H, D]`` (the K half of their rows), ``prefill_qk`` runs the
    model's plain prefill."""
    if granularity not in ("layer", "head"):
        raise EncodeError(f"key calibration granularity must be 'layer' or 'head', "
                          f"got {granularity!r}")
    if not probes:
        raise EncodeError("key calibration needs at least one probe")
    tables = RotaryTables.from_model(model)
    prefix = composer.prefix_ids()
    items, tokens = [], 0
    for p in probes:
        memory = [prefix] + [list(token_ids[f]) for f in p.injected]
        ids, m = composer.compose(memory, texts[p.question], [list(token_ids[f])
                                                              for f in p.tail])
        q, k = prefill_qk(ids, m)  # [L, R, Hq, D], [L, S, H, D]
        tokens += len(ids)
        pos = torch.arange(len(ids))
        inj = torch.cat([stored_keys[f].transpose(0, 1) for f in p.injected],
                        dim=1).to(k.device)  # [L, b-a, H, D]
        items.append((rotate_keys(q.float(), pos[m:], tables),
                      rotate_keys(k.float(), pos, tables),
                      rotate_keys(inj.float(), pos[len(prefix):m], tables),
                      len(prefix), m))
    head_dim = items[0][1].shape[-1]
    scales, stats = fit_scales(items, attention_scaling(model, head_dim), granularity)
    temps = [[round(1.0 / s, DECIMALS) for s in row] for row in scales.tolist()]
    stats.update(probes=len(items), query_rows=sum(q.shape[1] for q, *_ in items),
                 prefill_tokens=tokens,
                 t_min=min(map(min, temps)), t_max=max(map(max, temps)))
    return KeyCalibration(granularity, temps, stats)


def fit_scales(items: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]],
               scaling: float, granularity: str) -> tuple[torch.Tensor, dict[str, Any]]:
    """``items``: per probe (rotated queries of its rows ``[L, R, Hq, D]``, rotated prefill
    keys ``[L, S, H, D]``, rotated injected keys ``[L, b-a, H, D]``, a, b), the rows being
    the probe's last R tokens and the injected facts its tokens ``a..b-1``. Returns the
    logit scales ``s = 1/T`` ``[L, H]`` (one per layer repeated over heads for ``"layer"``)
    and the fit's diagnostics: mean attention mass on the injected span under the prefill,
    injected (s = 1) and calibrated, the mean KL of a row at s = 1 and calibrated, and how
    many scales sit on a bound of :data:`T_RANGE`. A scale whose fit lowers the mean KL by
    less than :data:`_KL_TOL` stays 1 (no evidence to move: the limiting case stays exact
    even where attention to memory is too small for the derivative's sign to mean much)."""
    L, _, H, D = items[0][1].shape
    lo0, hi0 = math.log(1 / T_RANGE[1]), math.log(1 / T_RANGE[0])
    out = torch.ones(L, H, dtype=torch.float64)
    names = ("mass_prefill", "mass_injected", "mass_calibrated", "kl_injected", "kl_calibrated")
    diag = dict.fromkeys(names, 0.0)
    for layer in range(L):
        cells = [_cell(q[layer], k[layer], k_inj[layer], a, b, scaling)
                 for q, k, k_inj, a, b in items]
        # safeguarded Newton on u = log s: the loss is convex in s, so the sign of its
        # derivative brackets the optimum; a step leaving the bracket bisects instead
        lo = torch.full((H,), lo0, dtype=torch.float64)
        hi = torch.full((H,), hi0, dtype=torch.float64)
        u = torch.zeros(H, dtype=torch.float64)
        for _ in range(_MAX_STEPS):
            g, h = _derivatives(cells, u.exp())
            if granularity == "layer":
                g, h = g.sum().expand(H), h.sum().expand(H)
            up = g > 0  # the loss rises with s: the optimum lies below
            hi, lo = torch.where(up, u, hi), torch.where(up, lo, u)
            s_new = u.exp() - g / h.clamp_min(1e-30)
            step = torch.where(s_new > 0, s_new.clamp_min(1e-30).log(), (lo + hi) / 2)
            step = torch.where((step <= lo) | (step >= hi), (lo + hi) / 2, step)
            step = torch.where(g == 0, u, step)  # exactly at the optimum
            done = (step - u).abs().max().item() < 1e-9
            u = step
            if done:
                break
        fit = u.exp()
        rows = sum(c["p_inj"].shape[1] * c["p_inj"].shape[2] for c in cells)  # per KV head
        kl_one, mass_one, mass_p = _divergence(cells, torch.ones(H, dtype=torch.float64))
        kl_fit, _, _ = _divergence(cells, fit)
        gain = kl_one - kl_fit
        if granularity == "layer":
            gain = gain.sum().expand(H) / H
        fit[gain < _KL_TOL * rows] = 1.0
        out[layer] = fit
        kl_cal, mass_cal, _ = _divergence(cells, fit)
        for name, v in zip(names, (mass_p, mass_one, mass_cal, kl_one, kl_cal)):
            diag[name] += v.sum().item() / (rows * H * L)
    bound = ((out.log() - lo0).abs() < 1e-4) | ((out.log() - hi0).abs() < 1e-4)
    diag = {k: round(v, 6 if k.startswith("kl") else 4) for k, v in diag.items()}
    diag["at_bound"] = int(bound.sum())
    return out, diag


_KL_TOL = 1e-6  # mean KL per row a fit must gain to move off s = 1


def _derivatives(cells: Sequence[dict], s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and second derivative in ``s`` ``[H]`` of ``sum_r H(P_r, Q_r(s))``, per KV
    head: ``sum (Q - P) . c`` and ``sum Var_Q(c)`` over the injected span's logits ``c``."""
    g = torch.zeros(len(s), dtype=torch.float64)
    h = torch.zeros_like(g)
    for c in cells:
        z = c["inj"] * s.to(c["inj"])[:, None, None, None]
        lse = torch.logaddexp(c["lse_rest"], z.logsumexp(-1))
        qd = (z - lse[..., None]).exp()  # [H, G, R, b-a]
        qc = qd * c["inj"]
        mean = qc.sum(-1)  # E_Q[c] (0 off the span)
        g += (qc - c["p_inj"] * c["inj"]).sum(dim=(1, 2, 3)).double().cpu()
        h += ((qc * c["inj"]).sum(-1) - mean * mean).sum(dim=(1, 2)).double().cpu()
    return g, h


def _cell(q: torch.Tensor, k: torch.Tensor, k_inj: torch.Tensor, a: int, b: int,
          scaling: float) -> dict[str, torch.Tensor]:
    """One probe's layer, reduced to what the fit needs: the injected logits ``inj`` and
    the prefill's attention on the span ``p_inj`` ``[H, G, R, b-a]``, and per row the
    log-sum-exp of the other logits ``lse_rest``, the prefill's ``sum p log p`` and
    ``sum p . logit`` over the other keys ``[H, G, R]`` (those never change with s)."""
    R, S = q.shape[0], k.shape[0]
    H, D = k.shape[1], k.shape[2]
    ql = q.reshape(R, H, -1, D)  # [R, H, G, D]
    logits = torch.einsum("rhgd,shd->hgrs", ql, k) * scaling  # [H, G, R, S]
    future = (torch.arange(S, device=q.device)[None, :]
              > torch.arange(S - R, S, device=q.device)[:, None])  # [R, S]
    logits = logits.masked_fill(future, float("-inf"))
    p = logits.softmax(-1)
    rest = logits.clone()
    rest[..., a:b] = float("-inf")
    return {"inj": torch.einsum("rhgd,mhd->hgrm", ql, k_inj) * scaling,  # [H, G, R, b-a]
            "p_inj": p[..., a:b], "lse_rest": rest.logsumexp(-1),
            "p_log_p": torch.xlogy(p, p).sum(-1),
            "p_rest": torch.where(rest > float("-inf"), p * rest, 0.0).sum(-1)}


def _divergence(cells: Sequence[dict], s: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per KV head ``[H]``, summed over the cells' rows (in float64): KL(prefill ||
    injected at ``s``), the injected attention mass on the injected span, and the
    prefill's mass there."""
    kl = torch.zeros(len(s), dtype=torch.float64)
    mass, mass_p = torch.zeros_like(kl), torch.zeros_like(kl)
    for c in cells:
        z = c["inj"].double() * s.to(c["inj"].device)[:, None, None, None]
        lse_inj = z.logsumexp(-1)
        lse = torch.logaddexp(c["lse_rest"].double(), lse_inj)  # [H, G, R]
        p_inj = c["p_inj"].double()
        # KL = sum p log p - sum_rest p.logit - sum_span p.z + lse (sum p = 1)
        row = c["p_log_p"].double() - c["p_rest"].double() - (p_inj * z).sum(-1) + lse
        kl += row.sum(dim=(1, 2)).cpu()
        mass += (lse_inj - lse).exp().sum(dim=(1, 2)).cpu()
        mass_p += p_inj.sum(dim=(1, 2, 3)).cpu()
    return kl, mass, mass_p
