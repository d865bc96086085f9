"""mokv_graphs: model graphs built on mokv's caches (installed from the repository's graphs/).

The one model here is a small Llama-style decoder:

    config = DecoderConfig()                       # sizes; defaults run in seconds on a CPU
    weights = init_weights(config, seed=0)         # or load_safetensors("model.safetensors")
    model = DecoderModel(config, manager, session, weights)   # paged or continuous manager
    logits = model.step(contexts)                  # one ragged batch through the cache

`reference_logits` is the same decoder in numpy without a cache (the tests' ground
truth), and `Scheduler` serves a stream of requests with continuous batching
(`Scheduler(manager, greedy(model.step))`).
"""

from .config import DecoderConfig, rope_table
from .decoder import build_decoder_graph
from .model import DecoderModel, ragged_inputs
from .reference import first_mismatch, reference_generate, reference_logits
from .scheduler import Request, Scheduler, SchedulerStats, greedy
from .weights import (
    check_weights,
    checkpoint_shapes,
    graph_weights,
    init_weights,
    load_safetensors,
    save_safetensors,
)

__all__ = [
    "DecoderConfig",
    "DecoderModel",
    "Request",
    "Scheduler",
    "SchedulerStats",
    "build_decoder_graph",
    "check_weights",
    "checkpoint_shapes",
    "first_mismatch",
    "greedy",
    "graph_weights",
    "init_weights",
    "load_safetensors",
    "ragged_inputs",
    "reference_generate",
    "reference_logits",
    "rope_table",
    "save_safetensors",
]
