"""Seeded synthetic serving traces, and the prefix-cache bound they allow.

A trace is a list of `Request`s in three families, mixed the way a chat/agent service
sees them:

- **shared**: one of a few long system prompts (1-4k tokens, Zipf popularity) plus a
  short user message; the prefix cache can skip the system prompt;
- **chat**: multi-turn conversations; each turn resends the previous turn's prompt
  and its answer, plus a new user message (a turn arrives a few steps after the
  previous one finished, as a user would reply);
- **agent**: long-context agentic loops: a 6-12k token document (a few shared ones)
  followed by rounds of tool output and short model actions.

With `agent_sessions`, a fourth family runs beside them (`add_agent_sessions`):

- **session**: agent sessions that pause. A session's context (one of two shared agent
  instructions plus its own task) grows by each turn's action and the output of a tool
  call, and the tool runs for a while before the next turn arrives: a few steps, a few
  hundred, or most of a thousand, while the rest of the trace keeps arriving. Each of its
  requests names the session (`Request.session`), and the last one ends it.

The "model" emits `model_token(seed, position)`, a deterministic function of the
conversation and the position, so the answer a later turn resends is known up front
and matches whatever the replay generated (even after a preemption recomputes it).

`infinite_cache_bound` is the hit rate an unlimited prefix cache could reach on the
trace: every full page of every earlier request (prompt + answer) stays findable;
`infinite_cache_hits` gives it per request (the bound of any subset, such as the session
turns).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VOCAB = 50_000


def model_token(seed: int, position: int) -> int:
    """The token the fake model emits at `position` of conversation `seed`."""
    return (seed * 2_654_435_761 + position * 40_503 + 12_345) % VOCAB


def model_tokens(seed: int, start: int, count: int) -> np.ndarray:
    pos = np.arange(start, start + count, dtype=np.int64)
    return (seed * 2_654_435_761 + pos * 40_503 + 12_345) % VOCAB


@dataclass
class Request:
    """One request of the trace.

    `arrival` is an absolute step for first turns; for a turn with a `parent` it is the
    think time in steps after the parent finished.
    """

    rid: int
    kind: str
    prompt: np.ndarray
    output_len: int
    seed: int
    arrival: int
    parent: int | None = None
    session: str | None = None
    """The session the request belongs to (the "session" family)."""


@dataclass(frozen=True)
class TraceConfig:
    num_sessions: int = 400
    num_system_prompts: int = 6
    num_documents: int = 3
    zipf_s: float = 1.2
    mean_gap_steps: float = 0.6  # mean steps between new sessions (Poisson arrivals)
    session_weights: tuple[float, float, float] = (0.80, 0.14, 0.06)  # shared, chat, agent
    max_output: int = 192
    max_context: int = 16_000  # turns stop before a conversation outgrows this
    seed: int = 0
    agent_sessions: int = 0  # sessions that pause for tool calls (add_agent_sessions)


def _zipf_choice(rng: np.random.Generator, n: int, s: float) -> int:
    p = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=p / p.sum()))


def make_trace(cfg: TraceConfig = TraceConfig()) -> list[Request]:
    """A reproducible trace for `cfg` (same seed, same trace)."""
    rng = np.random.default_rng(cfg.seed)

    def rand(n: int) -> np.ndarray:
        return rng.integers(0, VOCAB, n, dtype=np.int64)

    systems = [rand(int(rng.integers(1024, 4097))) for _ in range(cfg.num_system_prompts)]
    documents = [rand(int(rng.integers(6144, 12289))) for _ in range(cfg.num_documents)]
    reqs: list[Request] = []
    t = 0.0

    def add(kind, prompt, out, seed, arrival, parent):
        reqs.append(Request(len(reqs), kind, prompt, int(out), seed, int(arrival), parent))
        return reqs[-1]

    for s in range(cfg.num_sessions):
        t += rng.exponential(cfg.mean_gap_steps)
        kind = ("shared", "chat", "agent")[int(rng.choice(3, p=cfg.session_weights))]
        seed = s + 1
        if kind == "shared":
            sys_p = systems[_zipf_choice(rng, cfg.num_system_prompts, cfg.zipf_s)]
            prompt = np.concatenate([sys_p, rand(int(rng.integers(32, 513)))])
            add(kind, prompt, rng.integers(16, cfg.max_output + 1), seed, t, None)
            continue
        if kind == "chat":
            turns, user, out = int(rng.integers(2, 7)), (32, 513), (32, cfg.max_output + 1)
            prompt = rand(int(rng.integers(64, 1025)))
        else:
            turns, user, out = int(rng.integers(3, 7)), (128, 1025), (16, 129)
            doc = documents[_zipf_choice(rng, cfg.num_documents, cfg.zipf_s)]
            prompt = np.concatenate([doc, rand(int(rng.integers(64, 257)))])
        parent = None
        for turn in range(turns):
            if len(prompt) + out[1] > cfg.max_context:
                break
            r = add(kind, prompt, rng.integers(*out), seed, t if turn == 0 else rng.integers(0, 20),
                    parent)
            parent = r.rid
            answer = model_tokens(seed, len(prompt), r.output_len)
            prompt = np.concatenate([prompt, answer, rand(int(rng.integers(*user)))])
    if cfg.agent_sessions:
        add_agent_sessions(reqs, cfg, t)
    return reqs


TOOL_PAUSES = ((0.5, (2, 40)), (0.35, (40, 250)), (0.15, (250, 900)))
"""(probability, steps range) of a tool call's duration: most are quick, some take a few
hundred steps, a few most of a thousand (the other traffic keeps arriving meanwhile)."""


def add_agent_sessions(reqs: list[Request], cfg: TraceConfig, span: float) -> None:
    """Appends `cfg.agent_sessions` sessions that pause, arriving over the first `span`
    steps (the rest of the trace's arrivals), drawn from their own seeded generator so
    that the rest of the trace stays as it was."""
    rng = np.random.default_rng(cfg.seed + 7919)
    rand = lambda n: rng.integers(0, VOCAB, n, dtype=np.int64)  # noqa: E731
    instructions = [rand(int(rng.integers(2048, 3073))) for _ in range(2)]
    p = [weight for weight, _ in TOOL_PAUSES]
    for a in range(cfg.agent_sessions):
        seed, session = 1_000_000 + a, f"agent-{a}"
        arrival = float(rng.uniform(0, span))
        prompt = np.concatenate([instructions[a % 2], rand(int(rng.integers(1024, 4097)))])
        parent = None
        for turn in range(int(rng.integers(5, 13))):
            if len(prompt) + 160 > cfg.max_context:
                break
            lo, hi = TOOL_PAUSES[int(rng.choice(len(TOOL_PAUSES), p=p))][1]
            wait = arrival if turn == 0 else int(rng.integers(lo, hi))
            r = Request(len(reqs), "session", prompt, int(rng.integers(32, 161)), seed,
                        int(wait), parent, session)
            reqs.append(r)
            parent = r.rid
            answer = model_tokens(seed, len(prompt), r.output_len)
            prompt = np.concatenate([prompt, answer, rand(int(rng.integers(128, 1025)))])


def _page_keys(tokens: np.ndarray, page_size: int) -> list[int]:
    """Chained keys of the full pages of `tokens` (equal keys = equal prefixes)."""
    keys, parent = [], 0
    data = tokens.astype("<i8").tobytes()
    stride = page_size * 8
    for start in range(0, len(data) - stride + 1, stride):
        parent = hash((parent, data[start : start + stride]))
        keys.append(parent)
    return keys


def infinite_cache_hits(trace: list[Request], page_size: int) -> list[int]:
    """Per request (in trace order), the prompt tokens an unlimited prefix cache supplies.

    A request can reuse the leading full pages of its prompt that some earlier request
    computed (its prompt and its answer, except the last answer token, which is never
    fed back), and never its last prompt token (the model must run on it).
    """
    seen: set[int] = set()
    hits = []
    for r in trace:
        keys = _page_keys(r.prompt, page_size)
        n = 0
        limit = (len(r.prompt) - 1) // page_size
        while n < limit and keys[n] in seen:
            n += 1
        hits.append(n * page_size)
        full = np.concatenate([r.prompt, model_tokens(r.seed, len(r.prompt), r.output_len - 1)])
        seen.update(_page_keys(full, page_size))
    return hits


def infinite_cache_bound(trace: list[Request], page_size: int) -> float:
    """Hit rate over prompt tokens with unlimited pages, requests taken in trace order
    (`infinite_cache_hits`)."""
    total = sum(len(r.prompt) for r in trace)
    return sum(infinite_cache_hits(trace, page_size)) / total if total else 0.0


def summarize(trace: list[Request]) -> dict:
    kinds = [r.kind for r in trace]
    return {
        "requests": len(trace),
        "fraction": {k: round(kinds.count(k) / len(trace), 3)
                     for k in ("shared", "chat", "agent", "session") if k in kinds},
        "multi_turn_fraction": round(sum(r.parent is not None for r in trace) / len(trace), 3),
        "prompt_tokens": int(sum(len(r.prompt) for r in trace)),
        "output_tokens": int(sum(r.output_len for r in trace)),
        "max_prompt": int(max(len(r.prompt) for r in trace)),
    }
