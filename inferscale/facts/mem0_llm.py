"""Mem0's LLM for fact extraction: guided JSON, at most N facts, the session's date.

Mem0 2.2.1 asks the LLM for ``response_format={"type": "json_object"}`` and silently
drops output it cannot parse; its vllm/openai LLM classes pass no schema. :class:`GuidedLLM`
(an ``OpenAILLM`` subclass, registered with Mem0's ``LlmFactory`` as ``inferscale_guided``)
changes only Mem0's extraction calls:

- **schema**: it requests JSON-schema guided decoding of ``{"memory": [{"text"}]}`` with
  ``maxItems = max_facts`` — vLLM's ``structured_outputs`` (``guided="vllm"``) or OpenAI's
  ``response_format: json_schema`` (``guided="openai"``) — so the model can only emit
  parseable, bounded output (with vLLM, optionally a ``repetition_penalty``: tiny models
  otherwise repeat a sentence until ``maxLength``);
- **bound**: whatever came back (a reply cut at ``max_tokens``, an endpoint that ignores
  schemas) is parsed, or salvaged item by item, then cut to ``max_facts`` facts of at
  most ``max_fact_chars`` characters and re-serialized: Mem0 always gets valid JSON;
- **date**: Mem0 fills its prompt's "Observation Date" with today's date, so relative
  dates would resolve against the processing day. Inside ``with observation_date(d):``
  the prompt carries ``d`` (the session's date) instead;
- **prompt**: ``prompt="compact"`` replaces Mem0's ~8.5k-token extraction prompt (longer
  than small models' context: SmolLM2 has 8k) with a short one built from the same
  inputs (observation date, the last few messages, the new message); ``"mem0"`` keeps it.

Calls that are not fact extraction go to ``OpenAILLM`` unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import tempfile
from collections import Counter
from typing import Any, Iterator, Literal

os.environ.setdefault("MEM0_TELEMETRY", "False")  # both read by mem0 at import time
os.environ.setdefault("MEM0_DIR", os.path.join(tempfile.gettempdir(), "inferscale-mem0"))

from mem0.configs.llms.openai import OpenAIConfig  # noqa: E402
from mem0.llms.openai import OpenAILLM  # noqa: E402

log = logging.getLogger(__name__)

PROVIDER = "inferscale_guided"
Guided = Literal["vllm", "openai", "none"]
PromptStyle = Literal["mem0", "compact"]

_OBSERVATION_DATE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "inferscale_observation_date", default=None)

COMPACT_SYSTEM_PROMPT = """\
You extract facts worth remembering about the people in a conversation.
Read the new message and reply with JSON: {"memory": [{"text": "..."}]}.
Rules:
- At most %(max_facts)d facts. Each fact is one short sentence that names the person it is about.
- Keep names, places, numbers and dates exactly as written.
- Turn relative dates ("yesterday", "last week") into calendar dates using the Observation Date.
- Greetings, questions and small talk hold no facts: reply {"memory": []}."""

_SECTION_RE = re.compile(
    r"^## (Summary|Last k Messages|Recently Extracted Memories|Existing Memories|"
    r"New Messages|Observation Date|Current Date|Custom Instructions)\n", re.M)
_TEXT_ITEM_RE = re.compile(r'"text"\s*:\s*"((?:[^"\\]|\\.)*)"')


def facts_schema(max_facts: int, max_fact_chars: int) -> dict:
    """JSON schema of an extraction reply: ``{"memory": [{"text": str}, ...]}``."""
    item = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1,
                                                      "maxLength": max_fact_chars}},
            "required": ["text"], "additionalProperties": False}
    return {"type": "object",
            "properties": {"memory": {"type": "array", "items": item, "maxItems": max_facts}},
            "required": ["memory"], "additionalProperties": False}


@contextlib.contextmanager
def observation_date(value: str | None) -> Iterator[None]:
    """Within the block, extraction prompts carry ``value`` (ISO date) as the date the
    conversation took place. ``None`` leaves Mem0's (today's date)."""
    token = _OBSERVATION_DATE.set(value)
    try:
        yield
    finally:
        _OBSERVATION_DATE.reset(token)


class GuidedLLMConfig(OpenAIConfig):
    """``OpenAIConfig`` plus the extraction controls (see the module docstring)."""

    def __init__(self, *, guided: Guided = "vllm", prompt_style: PromptStyle = "mem0",
                 max_facts: int = 5, max_fact_chars: int = 300, context_messages: int = 2,
                 repetition_penalty: float | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if guided not in ("vllm", "openai", "none"):
            raise ValueError(f"guided must be vllm, openai or none, not {guided!r}")
        if prompt_style not in ("mem0", "compact"):
            raise ValueError(f"prompt_style must be mem0 or compact, not {prompt_style!r}")
        if max_facts < 1 or max_fact_chars < 8 or context_messages < 0:
            raise ValueError("max_facts >= 1, max_fact_chars >= 8, context_messages >= 0")
        self.guided = guided
        self.prompt_style = prompt_style
        self.max_facts = max_facts
        self.max_fact_chars = max_fact_chars
        self.context_messages = context_messages
        self.repetition_penalty = repetition_penalty  # vLLM only: small models loop without it


class GuidedLLM(OpenAILLM):
    """Mem0 LLM that guides, bounds and dates fact extraction (module docstring).

    ``stats`` counts calls: ``extract``, ``salvaged`` (reply repaired), ``cut`` (facts
    dropped above ``max_facts``), ``passthrough``.
    """

    def __init__(self, config: GuidedLLMConfig | dict | None = None):
        if isinstance(config, dict):
            config = GuidedLLMConfig(**config)
        super().__init__(config or GuidedLLMConfig())
        self.stats: Counter = Counter()
        self.last_request: list[dict] | None = None  # messages of the last extraction call
        self.last_reply: str | None = None

    def generate_response(self, messages, response_format=None, tools=None,
                          tool_choice="auto", **kwargs):
        if tools or not _is_extraction(messages, response_format):
            self.stats["passthrough"] += 1
            return super().generate_response(messages, response_format, tools, tool_choice,
                                             **kwargs)
        cfg = self.config
        self.stats["extract"] += 1
        messages = self._rewrite(messages)
        self.last_request = messages
        schema = facts_schema(cfg.max_facts, cfg.max_fact_chars)
        if cfg.guided == "vllm":  # replaces response_format: vLLM takes one constraint
            response_format = None
            extra = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
            if cfg.repetition_penalty is not None:
                extra["repetition_penalty"] = cfg.repetition_penalty
            kwargs["extra_body"] = {**kwargs.get("extra_body", {}), **extra}
        elif cfg.guided == "openai":
            response_format = {"type": "json_schema", "json_schema": {
                "name": "facts", "schema": schema, "strict": False}}
        reply = super().generate_response(messages, response_format, None, tool_choice,
                                          **kwargs)
        self.last_reply = reply
        return self._bound(reply or "")

    # -- prompt

    def _rewrite(self, messages: list[dict]) -> list[dict]:
        date = _OBSERVATION_DATE.get()
        system = messages[0]["content"] if messages[0].get("role") == "system" else None
        user = messages[-1]["content"]
        if date:
            user, n = re.subn(r"(^## Observation Date\n)[^\n]*", lambda m: m.group(1) + date,
                              user, count=1, flags=re.M)
            if n != 1:
                raise RuntimeError("Mem0's extraction prompt has no '## Observation Date' "
                                   "section: this mem0ai version is not supported")
        if self.config.prompt_style == "compact":
            system = COMPACT_SYSTEM_PROMPT % {"max_facts": self.config.max_facts}
            user = self._compact_user(_sections(user))
        out = [{"role": "user", "content": user}]
        return ([{"role": "system", "content": system}] if system else []) + out

    def _compact_user(self, sec: dict[str, str]) -> str:
        if "New Messages" not in sec:
            raise RuntimeError("Mem0's extraction prompt has no '## New Messages' section")
        parts = [f"Observation Date: {sec.get('Observation Date', '').strip()}"]
        k = self.config.context_messages
        earlier = [ln for ln in sec.get("Last k Messages", "").splitlines() if ln.strip()]
        if k and earlier:
            parts.append("Earlier messages:\n" + "\n".join(earlier[-k:]))
        parts.append("New message:\n" + sec["New Messages"].strip())
        if sec.get("Custom Instructions", "").strip():
            parts.append("Instructions: " + sec["Custom Instructions"].strip())
        return "\n".join(parts) + "\nOutput:"

    # -- reply

    def _bound(self, reply: str) -> str:
        items, salvaged = parse_facts_reply(reply)
        if salvaged:
            self.stats["salvaged"] += 1
            log.warning("extraction reply was not valid JSON; salvaged %d complete facts",
                        len(items))
        out: list[dict] = []
        for item in items:
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str) or not " ".join(text.split()):
                continue
            entry = {"id": str(len(out)),
                     "text": " ".join(text.split())[: self.config.max_fact_chars]}
            if isinstance(item, dict) and item.get("attributed_to") in ("user", "assistant"):
                entry["attributed_to"] = item["attributed_to"]
            if len(out) == self.config.max_facts:
                self.stats["cut"] += 1
                break
            out.append(entry)
        return json.dumps({"memory": out}, ensure_ascii=False)


def parse_facts_reply(reply: str) -> tuple[list, bool]:
    """An extraction reply -> (items, salvaged). Valid JSON gives its ``memory`` list;
    anything else gives the complete ``"text": "..."`` items found in it."""
    body = reply.strip()
    if body.startswith("```"):
        body = re.sub(r"^```[a-zA-Z]*\n?|```$", "", body).strip()
    try:
        doc = json.loads(body, strict=False)
        if isinstance(doc, dict) and isinstance(doc.get("memory"), list):
            return doc["memory"], False
        if isinstance(doc, list):
            return doc, False
    except json.JSONDecodeError:
        pass
    items = []
    for m in _TEXT_ITEM_RE.finditer(body):
        try:
            items.append({"text": json.loads(f'"{m.group(1)}"', strict=False)})
        except json.JSONDecodeError:
            continue
    return items, True


def _is_extraction(messages: list[dict], response_format: Any) -> bool:
    wants_json = isinstance(response_format, dict) and response_format.get("type") == "json_object"
    return bool(wants_json and messages and "## New Messages" in str(messages[-1].get("content")))


def _sections(prompt: str) -> dict[str, str]:
    """Mem0's extraction user prompt -> {section title: body}."""
    marks = list(_SECTION_RE.finditer(prompt))
    out = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(prompt)
        body = prompt[m.end():end]
        out[m.group(1)] = body.split("\n# Output:")[0].strip("\n")
    return out


def llm_config(**config: Any):
    """Mem0 ``LlmConfig`` for :class:`GuidedLLM`. Mem0's ``LlmConfig`` validates the
    provider against a fixed list, so it is built without validation; the factory then
    creates the registered class."""
    from mem0.llms.configs import LlmConfig

    register()
    GuidedLLMConfig(**config)  # validate now, not at Memory construction
    return LlmConfig.model_construct(provider=PROVIDER, config=dict(config))


def register() -> None:
    """Register :class:`GuidedLLM` with Mem0's ``LlmFactory`` (idempotent)."""
    from mem0.utils.factory import LlmFactory

    LlmFactory.register_provider(PROVIDER, f"{__name__}.GuidedLLM", GuidedLLMConfig)


register()
