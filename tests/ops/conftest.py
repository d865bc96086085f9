"""Shared fixtures for the op tests: hand-built caches, numpy references, compiled graphs.

Caches are built with numpy in the layouts of python/mokv/layouts/. On the CPU,
`Buffer.from_numpy` aliases the array, so after a run the test reads the in-place
writes straight from numpy. bfloat16 travels as uint16 bit patterns viewed as bf16.

A cold compile costs ~23 s per model on a 2-core host, most of it paid once per model, so
the configurations the test modules plan (`plan_graphs`) are compiled as one model per
CPU path and graph kind (tests/ops/graph_bundle.py), with symbolic batch/token dims.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, TensorType, Value, ops
from mokv.config.params import KVCacheParams, KVCacheStrategy
from mokv.layouts import (
    CONTINUOUS,
    PAGED,
    FetchContinuousBatchingKVCacheCollection,
    FetchPagedKVCacheCollection,
)
from mokv.layouts.max_paged import lookup_table_width
from mokv.ops import flash_attention, fused_qkv_matmul, kernels_path, portable_cpu_paths, store_kv
from mokv.ops.cpu_paths import host_takes_portable_paths

from ..mojo_defines import MAX_KERNELS_DEFINE
from .graph_bundle import Bundle, Part, PartRunner

NUM_LAYERS = 2
LAYER = 1  # tests write/read layer 1 and check that layer 0 stays untouched
MAX_SEQ_LEN = 96  # continuous slots; also the rope table length


# ---------------------------------------------------------------- bf16 helpers


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    return (b.astype(np.uint32) << 16).view(np.float32)


def storage(x: np.ndarray, dtype: DType) -> np.ndarray:
    """The numpy array that holds `x` (float) in `dtype`: float32, or uint16 bf16 bits."""
    return to_bf16_bits(x) if dtype == DType.bfloat16 else np.ascontiguousarray(x, np.float32)


def values(a: np.ndarray, dtype: DType) -> np.ndarray:
    """float32 view of a storage array."""
    return from_bf16_bits(a) if dtype == DType.bfloat16 else a.astype(np.float32)


def buffer(a: np.ndarray, dtype: DType | None = None) -> Buffer:
    """A CPU Buffer aliasing `a`; uint16 storage is viewed as bfloat16 when asked."""
    buf = Buffer.from_numpy(a)
    return buf.view(DType.bfloat16) if dtype == DType.bfloat16 else buf


# ---------------------------------------------------------------- caches


@dataclasses.dataclass
class Cache:
    """A hand-built cache in the layouts of python/mokv/layouts/, with per-sequence K/V readers."""

    params: KVCacheParams
    blocks: np.ndarray  # storage dtype, layout of params.cache_strategy
    cache_lengths: np.ndarray  # uint32 [batch]
    lookup_table: np.ndarray  # uint32 [batch] or [batch, lookup_table_width(max_num_pages)]
    new_tokens: list[int]  # the step's new tokens per sequence

    @property
    def paged(self) -> bool:
        return self.params.cache_strategy == KVCacheStrategy.PAGED

    def buffers(self) -> list[Buffer]:
        """The 4 runtime inputs, in the layout's Inputs order."""
        if self.paged:  # MAX's max lengths: (most new tokens, longest cache + new tokens)
            ends = [int(c) + n for c, n in zip(self.cache_lengths, self.new_tokens)]
            extra = np.array([[max(self.new_tokens, default=0), max(ends, default=0)]], np.uint32)
        else:
            extra = np.array([not self.cache_lengths.any()], np.bool_)
        return [
            buffer(self.blocks, self.params.dtype),
            buffer(self.cache_lengths),
            buffer(self.lookup_table),
            buffer(extra),
        ]

    def rows(self, b: int, layer: int, kv: int, start: int, stop: int) -> np.ndarray:
        """float32 [stop - start, H, D]: positions [start, stop) of sequence b."""
        out = []
        for t in range(start, stop):
            if self.paged:
                p = self.params.page_size
                page = self.lookup_table[b, t // p]
                out.append(self.blocks[page, kv, layer, t % p])
            else:
                out.append(self.blocks[self.lookup_table[b], kv, layer, t])
        return values(np.stack(out), self.params.dtype) if out else np.zeros((0,))

    def write(self, b: int, layer: int, kv: int, start: int, rows: np.ndarray) -> None:
        """Puts float rows [n, H, D] at positions start.. of sequence b (test setup)."""
        st = storage(rows, self.params.dtype)
        for i in range(rows.shape[0]):
            t = start + i
            if self.paged:
                p = self.params.page_size
                self.blocks[self.lookup_table[b, t // p], kv, layer, t % p] = st[i]
            else:
                self.blocks[self.lookup_table[b], kv, layer, t] = st[i]


def make_cache(
    params: KVCacheParams,
    cache_lengths: list[int],
    new_tokens: list[int],
    rng: np.random.Generator,
    share_prefix_pages: int = 0,
) -> Cache:
    """A cache whose prefixes hold random K/V; room for `new_tokens` more per sequence.

    Paged: page ids are shuffled (so neighbours in a sequence are not neighbours in
    memory), page 0 is left unused like a null page, and with `share_prefix_pages=n`
    sequence 1 reuses sequence 0's first n pages (its prefix must then equal seq 0's).
    """
    h, d = params.n_kv_heads_per_device, params.head_dim
    batch = len(cache_lengths)
    storage_dtype = np.uint16 if params.dtype == DType.bfloat16 else np.float32
    if params.cache_strategy == KVCacheStrategy.PAGED:
        p = params.page_size
        need = [-(-(c + n) // p) for c, n in zip(cache_lengths, new_tokens)]
        max_pages = max(need)
        total = sum(need) - min(share_prefix_pages, need[1] if batch > 1 else 0) + 1
        ids = rng.permutation(np.arange(1, total))
        table = np.zeros((batch, lookup_table_width(max_pages)), np.uint32)
        k = 0
        for b in range(batch):
            for i in range(need[b]):
                if b == 1 and i < share_prefix_pages:
                    table[b, i] = table[0, i]
                else:
                    table[b, i] = ids[k]
                    k += 1
        blocks = np.zeros((total, 2, NUM_LAYERS, p, h, d), storage_dtype)
    else:
        slots = rng.permutation(batch + 1)[:batch]
        table = slots.astype(np.uint32)
        blocks = np.zeros((batch + 1, 2, NUM_LAYERS, MAX_SEQ_LEN, h, d), storage_dtype)
    cache = Cache(params, blocks, np.array(cache_lengths, np.uint32), table, list(new_tokens))
    for b, c in enumerate(cache_lengths):
        # Sequence 1's shared pages already hold sequence 0's prefix.
        start = share_prefix_pages * params.page_size if b == 1 and cache.paged else 0
        for layer in range(NUM_LAYERS):
            for kv in range(2):
                rows = rng.standard_normal((max(c - start, 0), h, d)).astype(np.float32)
                cache.write(b, layer, kv, start, rows)
    return cache


def row_offsets(new_tokens: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32)


# ---------------------------------------------------------------- references


def ref_attention(
    q: np.ndarray, cache: Cache, offsets: np.ndarray, layer: int, scale: float,
    window: int | None = None, sinks: np.ndarray | None = None,
) -> np.ndarray:
    """float64 causal GQA attention: [T, n_q, D] queries over the cache (after the store);
    with `window`, the query at position p reads keys [p - window + 1, p] only; with
    `sinks` [n_q], head h's softmax denominator gets e^sinks[h] added."""
    out = np.zeros(q.shape, np.float64)
    n_q = q.shape[1]
    group = n_q // cache.params.n_kv_heads_per_device
    for b in range(len(offsets) - 1):
        c = int(cache.cache_lengths[b])
        for i, t in enumerate(range(offsets[b], offsets[b + 1])):
            lo = max(0, c + i + 1 - window) if window else 0
            k = cache.rows(b, layer, 0, lo, c + i + 1).astype(np.float64)
            v = cache.rows(b, layer, 1, lo, c + i + 1).astype(np.float64)
            for qh in range(n_q):
                s = k[:, qh // group] @ q[t, qh].astype(np.float64) * scale
                top = s.max() if sinks is None else max(s.max(), float(sinks[qh]))
                p = np.exp(s - top)
                sink = 0.0 if sinks is None else np.exp(float(sinks[qh]) - top)
                out[t, qh] = (p / (p.sum() + sink)) @ v[:, qh // group]
    return out


def ref_rope(x: np.ndarray, pos: int, freqs: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [..., D] at position `pos`."""
    half = x.shape[-1] // 2
    cos, sin = freqs[pos, :half], freqs[pos, half:]
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)


# ---------------------------------------------------------------- graphs


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled graph's static configuration."""

    strategy: str  # "paged" | "continuous"
    dtype: DType
    n_kv_heads: int
    head_dim: int
    group: int  # n_q // n_kv_heads
    page_size: int = 16
    hidden: int = 64
    rope: bool = False
    checked: bool = False  # the fetcher's checked mode (mokv.check_tables before each kernel)
    window: int | None = None  # flash_attention's window_size (a sliding window)
    sinks: bool = False  # flash_attention's sinks: `sink_logits`

    @property
    def sink_logits(self) -> np.ndarray | None:
        """Each query head's sink logit, or None: from -2 up in steps of 0.75 (exact in
        bfloat16), so that some heads' sinks take most of the attention, some little."""
        return -2 + 0.75 * np.arange(self.n_q, dtype=np.float32) if self.sinks else None

    @property
    def params(self) -> KVCacheParams:
        return KVCacheParams(
            dtype=self.dtype,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            page_size=self.page_size,
            cache_strategy=self.strategy,  # type: ignore[arg-type]  # "paged" is accepted
        )

    @property
    def n_q(self) -> int:
        return self.n_kv_heads * self.group


def cache_symbols(cfg: Config, device: DeviceRef) -> tuple[Any, ...]:
    if cfg.strategy == "paged":
        return tuple(PAGED.input_symbols(cfg.params, NUM_LAYERS, MAX_SEQ_LEN, device))
    return tuple(CONTINUOUS.input_symbols(cfg.params, NUM_LAYERS, MAX_SEQ_LEN, device))


def fetch(cfg: Config) -> Callable[..., Any]:
    if cfg.strategy == "paged":
        return FetchPagedKVCacheCollection(cfg.params, num_layers=NUM_LAYERS, checked=cfg.checked)
    return FetchContinuousBatchingKVCacheCollection(
        cfg.params, num_layers=NUM_LAYERS, checked=cfg.checked
    )


def _rows(cfg: Config, heads: int, device: DeviceRef) -> TensorType:
    return TensorType(cfg.dtype, ["total_tokens", heads, cfg.head_dim], device=device)


def _offsets(device: DeviceRef) -> TensorType:
    return TensorType(DType.uint32, ["num_offsets"], device=device)


def _idle_cache(cfg: Config) -> list[Buffer]:
    """Cache inputs of an empty batch (the kernels do nothing on them)."""
    layout = PAGED if cfg.strategy == "paged" else CONTINUOUS
    return list(layout.empty_inputs(cfg.params, NUM_LAYERS, MAX_SEQ_LEN, 0, 1))


def _no_offsets() -> Buffer:
    return Buffer.from_numpy(np.zeros(1, np.uint32))


def store_attention(cfg: Config, device: DeviceRef) -> Part:
    """Inputs: cache(4), k, v [T, H, D], q [T, n_q, D], offsets. Output: attention [T, n_q, D]."""

    def body(inputs: Sequence[Value]) -> list[Value]:
        *cache_in, k, v, q, offsets = inputs
        kv = fetch(cfg)(*cache_in)
        store_kv(kv, k, v, offsets, LAYER)
        scale = 1.0 / np.sqrt(cfg.head_dim)
        # float32 sinks, also for bfloat16: a constant cast in the graph is folded at
        # compile time, and MAX 26.7's constant folder fails on a graph with mokv's ops
        # ("Functions that raise and return a custom type are not yet supported").
        sinks = None if cfg.sink_logits is None else ops.constant(cfg.sink_logits, DType.float32, device)
        return [flash_attention(kv, q, offsets, LAYER, scale, window_size=cfg.window, sinks=sinks)]

    def idle() -> list[Buffer]:
        k, q = (Buffer(cfg.dtype, (0, h, cfg.head_dim)) for h in (cfg.n_kv_heads, cfg.n_q))
        return [*_idle_cache(cfg), k, k, q, _no_offsets()]

    kt = _rows(cfg, cfg.n_kv_heads, device)
    types = [*cache_symbols(cfg, device), kt, kt, _rows(cfg, cfg.n_q, device), _offsets(device)]
    return Part(types, body, idle)


def qkv_attention(cfg: Config, device: DeviceRef) -> Part:
    """Inputs: cache(4), hidden [T, hidden], wqkv, offsets[, freqs]. Outputs: Q, attention."""
    d = cfg.head_dim
    weights_shape, freqs_shape = ((cfg.n_q + 2 * cfg.n_kv_heads) * d, cfg.hidden), (MAX_SEQ_LEN, d)
    wt = TensorType(cfg.dtype, weights_shape, device=device)
    ft = TensorType(DType.float32, freqs_shape, device=device)

    def body(inputs: Sequence[Value]) -> list[Value]:
        cache_in, (hidden, wqkv, offsets, *freqs) = inputs[:4], inputs[4:]
        kv = fetch(cfg)(*cache_in)
        q = fused_qkv_matmul(kv, hidden, wqkv, offsets, LAYER, cfg.n_q, freqs[0] if freqs else None)
        q3 = ops.reshape(q, [q.shape[0], cfg.n_q, d])
        return [q, flash_attention(kv, q3, offsets, LAYER, 1.0 / np.sqrt(d))]

    def idle() -> list[Buffer]:
        freqs = [Buffer(DType.float32, freqs_shape)] if cfg.rope else []
        hidden, weights = Buffer(cfg.dtype, (0, cfg.hidden)), Buffer(cfg.dtype, weights_shape)
        return [*_idle_cache(cfg), hidden, weights, _no_offsets(), *freqs]

    ht = TensorType(cfg.dtype, ["total_tokens", cfg.hidden], device=device)
    types = [*cache_symbols(cfg, device), ht, wt, _offsets(device), *([ft] if cfg.rope else [])]
    return Part(types, body, idle)


PARTS = {"store_attention": store_attention, "qkv_attention": qkv_attention}

PLANNED: dict[tuple[str, str], list[Config]] = {}
"""Per (CPU path, graph kind), the configurations the collected test modules use: the
first build of a kind compiles them all as one model (tests/ops/graph_bundle.py)."""


def plan_graphs(kind: str, configs: Sequence[Config], paths: Sequence[str] = ("native",)) -> None:
    """Called by a test module at import (collection), before any graph is built."""
    for path in paths:
        planned = PLANNED.setdefault((path, kind), [])
        planned.extend(c for c in configs if c not in planned)


@pytest.fixture(scope="session")
def session() -> InferenceSession:
    return InferenceSession(devices=[CPU()])


CPU_PATHS = {"native": (False, False), "portable": (True, False), "max-kernels": (False, True)}
"""Per kind of CPU path: (portable paths, MAX's attention kernel through mokv's views)."""


def _memoized_builds(session: InferenceSession, path: str) -> Callable[[str, Config], Any]:
    """`get(kind, cfg)` -> runner of the graph `kind` for `cfg` on CPU path `path`, with
    the `execute` of a loaded model. The first build of a kind compiles every planned
    configuration of that kind (and `cfg`) as one model; a configuration not planned
    is compiled on its own when asked for.

    MAX 26.7 keeps Mojo defines for the whole process and reads them at compile time,
    so each compile sets the path's defines first and puts the host's own back after:
    no build (here or in another test module) inherits another path's."""
    portable, max_kernels = CPU_PATHS[path]
    runners: dict[tuple[str, Config], PartRunner] = {}

    def get(kind: str, cfg: Config) -> PartRunner:
        if (kind, cfg) not in runners:
            configs = [c for c in PLANNED.get((path, kind), []) if (kind, c) not in runners]
            if cfg not in configs:
                configs.append(cfg)
            parts = [PARTS[kind](c, DeviceRef.CPU()) for c in configs]
            session._set_mojo_define(MAX_KERNELS_DEFINE, "true" if max_kernels else "false")
            try:
                with portable_cpu_paths(session, portable):
                    bundle = Bundle(session, kind, parts, custom_extensions=[kernels_path()])
            finally:
                session._set_mojo_define(MAX_KERNELS_DEFINE, "false")
            runners.update(((kind, c), bundle.runner(i)) for i, c in enumerate(configs))
        return runners[(kind, cfg)]

    return get


@pytest.fixture(scope="session")
def compiled(session: InferenceSession) -> Callable[[str, Config], Any]:
    """`compiled(kind, cfg)` -> loaded model on this host's native CPU paths."""
    return _memoized_builds(session, "native")


@pytest.fixture(scope="session")
def compiled_portable(session: InferenceSession) -> Callable[[str, Config], Any]:
    """`compiled_portable(kind, cfg)` -> loaded model on the portable CPU paths."""
    return _memoized_builds(session, "portable")


@pytest.fixture(scope="session")
def compiled_max_kernels(session: InferenceSession) -> Callable[[str, Config], Any]:
    """`compiled_max_kernels(kind, cfg)` -> loaded model whose attention op runs MAX's
    kernel on a MAX view of the cache, as on a GPU (the define `MOKV_MAX_KERNELS`,
    kernels/max_kernels.mojo): the CPU checks that view against numpy."""
    return _memoized_builds(session, "max-kernels")


@pytest.fixture(params=["native", "portable"])
def compiled_each_path(request: pytest.FixtureRequest) -> Callable[[str, Config], Any]:
    """`compiled` and `compiled_portable` in turn: a test that takes this fixture runs on
    both kinds of CPU path, so an AVX-512 host also proves the paths of an AVX2 host.
    On a host without AVX-512F the native paths are the portable ones: run once."""
    if request.param == "portable" and host_takes_portable_paths():
        pytest.skip("this host's native CPU paths are the portable ones")
    return request.getfixturevalue("compiled" if request.param == "native" else "compiled_portable")
