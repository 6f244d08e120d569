"""What the load benchmark (``benchmarks.load``) runs, decided before and during the run.

- :func:`tier_plan`: where a scenario's users start (the gpu tier as full as its budget
  allows, by popularity, then the host tier, then storage).
- :func:`next_step`: the next (mode, rate) from the steps run so far. The prompt
  baseline runs ``--rates`` rising until its first miss; its goodput G is the highest
  rate that passed. KV injection then runs (``--kv-rates adaptive``) at
  ``--kv-rate-multipliers`` x G, rising, until its first miss: the step at 1 x G gives
  KV's p99 TTFT at the baseline's goodput, the later ones KV's own goodput, in the
  fewest steps. With stock vLLM's goodput P known (``--peer-result``), KV runs at P and
  the multipliers x P instead. Stock vLLM's own run (``--peer``) rises through
  ``--rates`` until its first miss. If KV misses already at its lowest rate (G or P), or
  the baseline missed at its lowest rate (G = 0, no P), KV runs the ``--rates`` below
  that (rising) to find its goodput. ``--kv-rates
  same`` runs both modes at every rate of ``--rates``, alternating which goes first (the
  original procedure); a list of numbers gives KV its own rates. With ``--prompt-once``
  the baseline runs in the first user count only and the later counts take its G.
- :func:`estimate`: how long a run takes, from the rates and request counts.
"""

from __future__ import annotations

GIB = 1 << 30
MODES = ("prompt", "kv")
WARMUP_LENGTHS_GUESS = 40  # distinct query lengths of LoCoMo's questions, for the estimate


def tier_plan(users: list[str], placed_bytes: dict[str, int], args) -> dict[str, list[str]]:
    """Users by popularity rank: the gpu tier as full as its budget allows, then the host
    tier; the rest start in storage."""
    plan: dict[str, list[str]] = {"gpu": [], "host": [], "storage": []}
    budget = {"gpu": args.gpu_budget_gib * GIB, "host": args.host_budget_gib * GIB}
    used = dict.fromkeys(budget, 0)
    tier = "gpu"
    for user in users:
        if tier == "gpu" and used["gpu"] + placed_bytes[user] > budget["gpu"]:
            tier = "host"
        if tier == "host" and used["host"] + placed_bytes[user] > budget["host"]:
            tier = "storage"
        plan[tier].append(user)
        if tier != "storage":
            used[tier] += placed_bytes[user]
    return plan


def goodput_of(history: list[tuple[str, float, bool | None]], mode: str) -> float:
    """The highest rate ``mode`` passed below its first miss (0.0 if none passed)."""
    best = 0.0
    for _, rate, met in sorted((h for h in history if h[0] == mode), key=lambda h: h[1]):
        if not met:
            break
        best = rate
    return best


def _rising_until_miss(rates: list[float], ran: list[tuple[float, bool | None]]
                       ) -> float | None:
    """The next of ``rates`` after the ``ran`` steps (in order), or None once one missed
    (``met`` False) or was skipped (None) or every rate ran."""
    if any(met is not True for _, met in ran):
        return None
    done = {r for r, _ in ran}
    return next((r for r in rates if r not in done), None)


def kv_rates_for(args, g: float) -> list[float]:
    """KV's candidate rates given the prompt baseline's goodput ``g`` (adaptive) or as
    set. Adaptive with stock vLLM's goodput P known (``args.peer_goodput``): P (so that
    KV's p99 TTFT at the peer's goodput exists) and the multipliers x P; KV's p99 at the
    prompt baseline's goodput then exists only where that is one of them (a step more
    at a low rate costs a minute of device time)."""
    if args.kv_rates == "same":
        return list(args.rates)
    if args.kv_rates != "adaptive":
        return sorted(args.kv_rates)
    peer = getattr(args, "peer_goodput", None)
    if peer:
        return sorted({round(m * peer, 6) for m in (1, *args.kv_rate_multipliers)})
    if g <= 0:
        return list(args.rates)
    return [round(m * g, 6) for m in sorted(args.kv_rate_multipliers)]


def next_step(history: list[tuple[str, float, bool | None]], args,
              prompt_goodput: float | None = None) -> tuple[str, float] | None:
    """The next step ``(mode, rate)`` given ``history`` (``(mode, rate, met)`` in run
    order; ``met`` None: skipped, which ends that mode), or None when the run is over.
    ``prompt_goodput`` is G when the baseline is not run here (``--modes kv``)."""
    if "peer" in args.modes:  # stock vLLM's own run: rising until its first miss
        rate = _rising_until_miss(args.rates, [(r, met) for _, r, met in history])
        return None if rate is None else ("peer", rate)
    modes = [m for m in MODES if m in args.modes]
    ran = {m: [(r, met) for mode, r, met in history if mode == m] for m in MODES}
    if args.kv_rates == "same":  # both modes at every rate, alternating which goes first
        for i, rate in enumerate(args.rates):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                if any(met is not True for _, met in ran[mode]):
                    continue
                if rate not in {r for r, _ in ran[mode]}:
                    return mode, rate
        return None
    if "prompt" in modes:
        rate = _rising_until_miss(args.rates, ran["prompt"])
        if rate is not None:
            return "prompt", rate
    if "kv" not in modes:
        return None
    g = goodput_of(history, "prompt") if "prompt" in modes else (prompt_goodput or 0.0)
    candidates = kv_rates_for(args, g)
    based = g > 0 or getattr(args, "peer_goodput", None)
    if args.kv_rates == "adaptive" and based and ran["kv"] and ran["kv"][0] == (
            candidates[0], False):  # missed at its lowest (G or P): look below it
        rate = _rising_until_miss([r for r in args.rates if r < candidates[0]], ran["kv"][1:])
        return ("kv", rate) if rate is not None else None
    rate = _rising_until_miss(candidates, ran["kv"])
    return ("kv", rate) if rate is not None else None


def step_seconds(args, rate: float, requests: int | None = None) -> float:
    """The expected wall time of one step: its arrivals, then a few seconds of drain,
    scrapes and settling (an estimate; a step that misses drains longer)."""
    return (requests or args.requests) / rate + 3.0 + args.settle_s


def estimate(args, counts: list[int], resident: dict[int, int] | None = None,
             setup_s: float = 0.0) -> dict:
    """Seconds a run takes, for every outcome of the prompt baseline (its goodput G is
    one of ``--rates``; KV assumed to pass every rate it runs: the longest case):
    ``setup_s`` + per user count (hydrating its resident users at
    ``args.estimate_hydrate_s`` each; every user when ``resident`` is not known yet,
    an upper bound) the warm-up in each mode and the steps (``--prompt-once``: the
    baseline in the first count only)."""
    given = getattr(args, "prompt_goodput", None)
    peer = "peer" in args.modes  # stock vLLM: its warm-up and rates, on the first count
    outcomes = ([given[0]] if given and "prompt" not in args.modes else [0.0, *args.rates])
    cases = []
    for g in outcomes:
        total = setup_s + getattr(args, "estimate_start_s", 0.0)
        for i, count in enumerate(counts[:1] if peer else counts):
            modes = ["peer"] if peer else [
                m for m in MODES if m in args.modes
                and not (m == "prompt" and i and getattr(args, "prompt_once", False))]
            if not peer:
                total += (resident or {}).get(count, count) * args.estimate_hydrate_s
            total += len(modes) * step_seconds(args, args.warmup_rate, args.warmup_requests)
            if getattr(args, "warmup_lengths", False) and not peer:  # a few dozen
                total += len(modes) * step_seconds(args, args.warmup_rate, WARMUP_LENGTHS_GUESS)
            if peer:  # passes up to g, misses at the next rate
                ran = [r for r in args.rates if r <= g] + [r for r in args.rates if r > g][:1]
                total += sum(step_seconds(args, r) for r in ran)
                continue
            if args.kv_rates == "same":
                total += sum(step_seconds(args, r) for r in args.rates for _ in modes)
                continue
            if "prompt" in modes:  # passes up to g, misses at the next rate
                ran = [r for r in args.rates if r <= g] + [r for r in args.rates if r > g][:1]
                total += sum(step_seconds(args, r) for r in ran)
            if "kv" in modes:
                total += sum(step_seconds(args, r) for r in kv_rates_for(args, g))
        cases.append({"prompt_goodput": g, "seconds": round(total)})
    return {"setup_s": setup_s, "start_s": getattr(args, "estimate_start_s", 0.0),
            "hydrate_s_per_user": args.estimate_hydrate_s,
            "peer_goodput": getattr(args, "peer_goodput", None),
            "baseline": "peer" if peer else "prompt", "by_prompt_goodput": cases,
            "min_s": min(c["seconds"] for c in cases),
            "max_s": max(c["seconds"] for c in cases)}


def estimate_line(est: dict, counts: list[int]) -> str:
    parts = ", ".join(f"G={c['prompt_goodput']:g}: {c['seconds'] / 60:.1f}"
                      for c in est["by_prompt_goodput"])
    what = ("stock vLLM (the peer) on the first user count" if est["baseline"] == "peer"
            else f"user counts {counts}")
    peer = (f", KV at multiples of the peer's {est['peer_goodput']:g} rps"
            if est.get("peer_goodput") and est["baseline"] != "peer" else "")
    rest = ("" if est["baseline"] == "peer" else f", hydration {est['hydrate_s_per_user']:g} "
            f"s/user{peer}, KV passing every rate it runs")
    return (f"estimate for {what}: {est['min_s'] / 60:.1f}-{est['max_s'] / 60:.1f} min (by "
            f"the {est['baseline']} baseline's goodput G, min: {parts}; setup "
            f"{est['setup_s']:.0f} s, server start {est['start_s']:.0f} s{rest})")
