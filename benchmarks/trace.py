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

The "model" emits `model_token(seed, position)`, a deterministic function of the
conversation and the position, so the answer a later turn resends is known up front
and matches whatever the replay generated (even after a preemption recomputes it).

`infinite_cache_bound` is the hit rate an unlimited prefix cache could reach on the
trace: every full page of every earlier request (prompt + answer) stays findable.
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


def _zipf_choice(rng: np.random.Generator, n: int, s: float) -> int:
    p = 1.0 / np.arange(1, n + 1) ** s
    return int(rng.choice(n, p=p / p.sum()))


def make_trace(cfg: TraceConfig = TraceConfig()) -> list[Request]:
    """A reproducible trace for `cfg` (same seed, same trace)."""
    rng = np.random.default_rng(cfg.seed)
    rand = lambda n: rng.integers(0, VOCAB, n, dtype=np.int64)  # noqa: E731
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
    return reqs


def _page_keys(tokens: np.ndarray, page_size: int) -> list[int]:
    """Chained keys of the full pages of `tokens` (equal keys = equal prefixes)."""
    keys, parent = [], 0
    data = tokens.astype("<i8").tobytes()
    stride = page_size * 8
    for start in range(0, len(data) - stride + 1, stride):
        parent = hash((parent, data[start : start + stride]))
        keys.append(parent)
    return keys


def infinite_cache_bound(trace: list[Request], page_size: int) -> float:
    """Hit rate over prompt tokens with unlimited pages, requests taken in trace order.

    A request can reuse the leading full pages of its prompt that some earlier request
    computed (its prompt and its answer, except the last answer token, which is never
    fed back), and never its last prompt token (the model must run on it).
    """
    seen: set[int] = set()
    hit = total = 0
    for r in trace:
        keys = _page_keys(r.prompt, page_size)
        n = 0
        limit = (len(r.prompt) - 1) // page_size
        while n < limit and keys[n] in seen:
            n += 1
        hit += n * page_size
        total += len(r.prompt)
        full = np.concatenate([r.prompt, model_tokens(r.seed, len(r.prompt), r.output_len - 1)])
        seen.update(_page_keys(full, page_size))
    return hit / total if total else 0.0


def summarize(trace: list[Request]) -> dict:
    kinds = [r.kind for r in trace]
    return {
        "requests": len(trace),
        "fraction": {k: round(kinds.count(k) / len(trace), 3) for k in ("shared", "chat", "agent")},
        "multi_turn_fraction": round(sum(r.parent is not None for r in trace) / len(trace), 3),
        "prompt_tokens": int(sum(len(r.prompt) for r in trace)),
        "output_tokens": int(sum(r.output_len for r in trace)),
        "max_prompt": int(max(len(r.prompt) for r in trace)),
    }
