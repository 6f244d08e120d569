"""The load benchmark's client (``benchmarks.load``): open-loop steps of Poisson
arrivals, each request streamed through the official ``openai`` client so that TTFT is
what a client sees.

- InferScale's server (modes ``kv`` and ``prompt``): a chat completion naming the user
  (``user``) and the mode and ``top_k`` (``extra_body.inferscale``); the server retrieves,
  composes and answers, and its last chunk's ``inferscale`` info says from which memory
  (user, version), with which timings and from which tiers.
- Stock vLLM (mode ``peer``, ``vllm serve``): a completion of the token ids our prompt
  mode composes for that user and question (:attr:`Load.prompts`: ``(user, question) ->
  (ids, info)``, composed before the step by the library's own code,
  :mod:`benchmarks.lib.load.peer`), so the peer prefills exactly what our prompt mode does.

Every request asks for exactly ``--max-tokens`` tokens (``ignore_eos``), greedy.
"""

from __future__ import annotations

import asyncio
import random
import time

from benchmarks.datasets.users import QuestionDeck


class Load:
    """The open-loop client: steps of Poisson arrivals through the ``openai`` client."""

    def __init__(self, args, url: str, questions: dict, shares: dict):
        import openai

        self.args, self.questions, self.shares = args, questions, shares
        self.users: list[str] = []
        self.weights: list[float] = []
        self.prompts: dict[tuple[str, str], tuple[list[int], dict]] = {}  # mode peer
        self.peer_model: str | None = None  # the name vllm serve serves the model under
        self.compose = None  # mode peer: fills ``prompts`` for a schedule
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                         timeout=args.request_timeout_s)

    def schedule(self, rate: float, seed: int, n: int | None = None
                 ) -> list[tuple[float, str, str]]:
        """``n`` (default ``--requests``) arrivals ``(time, user, question)``: exponential
        gaps, users by popularity, each user's questions from a deck seeded by ``seed``,
        so the same seed gives both modes the same requests."""
        rng = random.Random(seed)
        decks: dict[str, QuestionDeck] = {}
        t, out = 0.0, []
        for _ in range(n or self.args.requests):
            t += rng.expovariate(rate)
            user = rng.choices(self.users, self.weights)[0]
            if user not in decks:
                decks[user] = QuestionDeck(self.questions, self.shares[user],
                                           seed=seed * 10_007 + int(user[5:]))
            out.append((t, user, decks[user].next()))
        return out

    def every_length(self, lengths: dict[str, int], rate: float) -> list[tuple[float, str, str]]:
        """One request per distinct query length (``lengths``: question -> the embedder's
        token count), each from the most active user whose conversations ask it, ``1 /
        rate`` apart: the server's query embedder captures a CUDA graph per length."""
        seen: dict[int, tuple[str, str]] = {}
        for c, qs in self.questions.items():
            user = next((u for u in self.users if c in self.shares[u]), None)
            for q in qs:
                if user is not None and q in lengths:
                    seen.setdefault(lengths[q], (user, q))
        return [((i + 1) / rate, u, q) for i, (_, (u, q)) in enumerate(sorted(seen.items()))]

    async def one(self, user: str, question: str, mode: str, scheduled: float,
                  t0: float) -> dict:
        sent = time.perf_counter()
        rec: dict = {"user": user, "scheduled": scheduled, "sent": sent,
                     "lag_ms": (sent - t0 - scheduled) * 1e3}
        first = info = None
        tokens = 0
        try:
            if mode == "peer":
                ids, info = self.prompts[(user, question)]
                stream = await self.client.completions.create(
                    model=self.peer_model, prompt=ids, max_tokens=self.args.max_tokens,
                    temperature=0.0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
            else:
                stream = await self.client.chat.completions.create(
                    model="load", user=user, messages=[{"role": "user", "content": question}],
                    max_tokens=self.args.max_tokens, temperature=0.0, stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"inferscale": {"mode": mode, "top_k": self.args.top_k},
                                "ignore_eos": True})
            async for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter()
                if mode != "peer":
                    info = (chunk.model_extra or {}).get("inferscale") or info
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            rec.update(ttft_ms=(first - sent) * 1e3, e2e_ms=(end - sent) * 1e3, end=end,
                       tokens=tokens, memory_user=info.get("user"),
                       memory_version=info.get("version"), memory_mode=info.get("mode"),
                       memory_tokens=info.get("memory_tokens", 0))
            if mode != "peer":
                timings = info["timings_ms"]
                rec.update(q2ft_ms=timings["query_to_first_token"],
                           engine_ttft_ms=timings["engine_ttft"],
                           # of it, the engine core's queue and prefill (when vLLM timed them)
                           engine_queued_ms=timings.get("engine_queued"),
                           engine_prefill_ms=timings.get("engine_prefill"),
                           memory_ms=timings.get("memory"),  # lookup, retrieval, composition
                           lookup_ms=timings.get("lookup"),  # the lookup alone
                           injected=info.get("injected_tokens", 0),
                           fallback_reason=info.get("fallback_reason"),
                           facts_by_tier=info.get("facts_by_tier"),
                           storage_bytes=info.get("storage_bytes"),
                           cold=info.get("cold"))  # a user in no tier: its split
        except asyncio.CancelledError:
            rec["error"] = "not finished within the drain time"
        except Exception as exc:  # noqa: BLE001 - a failed request counts against the mode
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return rec

    async def step(self, mode: str, schedule: list[tuple[float, str, str]]) -> list[dict]:
        if mode == "peer" and self.compose is not None:  # composed before the clock starts
            await asyncio.to_thread(self.compose, schedule)
        t0 = time.perf_counter()
        tasks = []
        for at, user, question in schedule:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.one(user, question, mode, at, t0)))
        _, pending = await asyncio.wait(tasks, timeout=self.args.drain_s)
        for t in pending:
            t.cancel()
        return [await t for t in tasks]

