"""mokv_graphs: model graphs built on mokv's caches (installed from the repository's graphs/).

The one model here is a small Llama-style decoder:

    config = DecoderConfig()                       # sizes; defaults run in seconds on a CPU
    weights = init_weights(config, seed=0)         # or load_safetensors("model.safetensors")
    # or both from a Hugging Face checkpoint directory:
    #   config, weights = load_checkpoint("Llama-3.2-1B/")
    model = DecoderModel(config, manager, session, weights)   # paged or continuous manager
    logits = model.step(contexts)                  # one ragged batch through the cache

`reference_logits` is the same decoder in numpy without a cache (the tests' ground
truth), and `Scheduler` serves a stream of requests with continuous batching
(`Scheduler(manager, greedy(model.step))`).
"""

from .checkpoint import (
    config_from_hf,
    hf_config,
    load_checkpoint,
    save_checkpoint,
    save_word_tokenizer,
    tiny_llama_checkpoint,
)
from .config import TINY_LLAMA, DecoderConfig, rope_table
from .decoder import build_decoder_graph
from .model import DecoderModel, ragged_inputs
from .reference import first_mismatch, reference_generate, reference_logits
from .rope import Llama3RopeScaling
from .scheduler import Request, Scheduler, SchedulerStats, greedy
from .weights import (
    check_weights,
    checkpoint_shapes,
    graph_weights,
    init_weights,
    load_safetensors,
    read_safetensors,
    save_safetensors,
)

__all__ = [
    "TINY_LLAMA",
    "DecoderConfig",
    "DecoderModel",
    "Llama3RopeScaling",
    "Request",
    "Scheduler",
    "SchedulerStats",
    "build_decoder_graph",
    "check_weights",
    "checkpoint_shapes",
    "config_from_hf",
    "first_mismatch",
    "greedy",
    "hf_config",
    "graph_weights",
    "init_weights",
    "load_checkpoint",
    "load_safetensors",
    "ragged_inputs",
    "reference_generate",
    "read_safetensors",
    "reference_logits",
    "rope_table",
    "save_checkpoint",
    "save_word_tokenizer",
    "save_safetensors",
    "tiny_llama_checkpoint",
]
