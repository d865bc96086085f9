"""The four places where mokv reaches into MAX 26.7 where MAX offers no public seam.

Everything else mokv does with MAX goes through MAX's public names (its manager
interface, its params, its input types). These four do not, so they are kept here,
each checked by `check_seams()`, which `tests/pipelines/test_seams.py` runs: if a MAX
release moves one, that test fails naming it, and so does `mokv serve` at startup.

1. What `max serve` gets from `PIPELINE_REGISTRY.retrieve_factory`: the tokenizer its
   API server builds request contexts with, and the picklable factory its model worker
   (a process it spawns) builds the pipeline with. `wrap_retrieved_pipelines` wraps
   every `RetrievedPipeline` that call returns from then on (in this process): mokv's
   factory runs in the worker before the pipeline is built.

2. The KV manager a pipeline builds. MAX's text-generation pipelines call the
   module-level `load_kv_manager` they import from `max.pipelines.kv_cache`
   (`TextGenerationPipeline.__init__`, `OverlapTextGenerationPipeline.__init__` and its
   speculative-decoding state); there is no argument or registry to substitute a
   manager. `install_kv_manager_loader` rebinds that name in those modules, in the
   process that builds the pipeline (`mokv serve` does it in MAX's model worker, before
   the pipeline exists), so that MAX's own pool is never allocated.

3. Un-chunking a token window. MAX cuts a prompt into chunks after the manager has
   reserved it, so a prefix hit never reaches past a chunk in MAX's own flow; a caller
   that chunks first and reserves after would have its hit refused by
   `TokenBuffer.skip_processing`. `unchunk` restores the whole remaining window
   (`TokenBuffer` has no public call that does so without marking the chunk processed).

4. The `usage` of MAX's OpenAI routes. They build each response (completion and chat
   completion, whole or the last chunk of a stream) from the model names their module
   holds, with the request's id and its usage, and nothing a request or the pipeline
   returns can add fields to that usage. `install_usage` rebinds those four names, in
   the API server's process, to subclasses that add Anthropic's cache counters
   (`mokv.pipelines.cache_control.with_cache_usage`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..errors import MokvError

PIPELINE_MODULES = (
    "max.pipelines.lib.pipeline_variants.text_generation",
    "max.pipelines.lib.pipeline_variants.overlap_text_generation",
)
"""MAX's modules that build a KV manager by calling their global `load_kv_manager`."""

LOADER_NAME = "load_kv_manager"

ROUTES_MODULE = "max.serve.router.openai_routes"
"""MAX's OpenAI routes, which build every completion's and chat completion's usage."""
RESPONSE_NAMES = (
    "CreateCompletionResponse",
    "CompletionStreamResponse",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
)
"""The response models MAX's OpenAI routes build with an `id` and a `usage`."""


class MaxSeamError(MokvError, RuntimeError):
    """A MAX internal that mokv relies on (module docstring) is not where it was."""


def wrap_retrieved_pipelines(wrap: Callable[[Any, Any], Any]) -> None:
    """Makes `PIPELINE_REGISTRY.retrieve_factory` (the call `max serve` gets its tokenizer
    and its model worker's pipeline factory from) return `wrap(retrieved)` in place of
    each `RetrievedPipeline` it returns (and the `PipelineConfig` it was asked for), in
    this process."""
    check_seams()
    from max.pipelines import PIPELINE_REGISTRY

    retrieve = type(PIPELINE_REGISTRY).retrieve_factory

    def retrieve_factory(pipeline_config: Any, *args: Any, **kwargs: Any) -> Any:
        retrieved = retrieve(PIPELINE_REGISTRY, pipeline_config, *args, **kwargs)
        return wrap(retrieved, pipeline_config)

    PIPELINE_REGISTRY.retrieve_factory = retrieve_factory


def install_kv_manager_loader(loader: Callable[..., Any]) -> None:
    """Makes MAX's text-generation pipelines build their KV manager with `loader`
    (MAX's `load_kv_manager` signature) in this process. The caller checks the manager
    a pipeline then holds (MAX may stop calling the global and keep importing it)."""
    check_seams()
    for name in PIPELINE_MODULES:
        setattr(importlib.import_module(name), LOADER_NAME, loader)


def install_usage(with_usage: Callable[[type], type]) -> None:
    """Makes MAX's OpenAI routes build every response with `with_usage(model)` (a
    subclass of each of `RESPONSE_NAMES`), in this process; once."""
    check_seams()
    routes = importlib.import_module(ROUTES_MODULE)
    for name in RESPONSE_NAMES:
        base = getattr(routes, name)
        if not getattr(base, "mokv_usage", False):
            model = with_usage(base)
            model.mokv_usage = True  # type: ignore[attr-defined]
            setattr(routes, name, model)


def unchunk(tokens: Any) -> None:
    """Extends a chunked MAX `TokenBuffer`'s active window to the end of its tokens."""
    tokens._processing_range.end = len(tokens)
    tokens._actively_chunked = False


def check_seams() -> None:
    """MaxSeamError naming what moved, unless the four seams are where mokv expects
    them: the registry's `retrieve_factory` returns a dataclass with a `factory`, each
    pipeline module holds MAX's `load_kv_manager` (or a loader mokv installed) as a
    global, MAX's `TokenBuffer` keeps its window in the fields `unchunk` sets, and MAX's
    OpenAI routes hold the response models of `RESPONSE_NAMES` as globals, each with an
    `id` and a `usage` field."""
    from max.pipelines import PIPELINE_REGISTRY
    from max.pipelines.context import TokenBuffer
    from max.pipelines.kv_cache import load_kv_manager
    from max.pipelines.lib.registry import RetrievedPipeline

    if not callable(getattr(PIPELINE_REGISTRY, "retrieve_factory", None)):
        raise MaxSeamError("MAX's PIPELINE_REGISTRY has no retrieve_factory any more")
    if "factory" not in getattr(RetrievedPipeline, "__dataclass_fields__", {}):
        raise MaxSeamError("MAX's RetrievedPipeline is no longer a dataclass with a factory")

    for name in PIPELINE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise MaxSeamError(f"MAX no longer has the module {name} ({e})") from e
        loader = getattr(module, LOADER_NAME, None)
        if loader is None:
            raise MaxSeamError(f"{name} no longer holds a global {LOADER_NAME}")
        if loader is not load_kv_manager and not getattr(loader, "mokv_loader", False):
            raise MaxSeamError(f"{name}.{LOADER_NAME} is neither MAX's nor mokv's: {loader!r}")
    fields = getattr(TokenBuffer, "__dataclass_fields__", {})
    for field in ("_processing_range", "_actively_chunked"):
        if field not in fields:
            raise MaxSeamError(f"MAX's TokenBuffer has no field {field} any more")
    _check_usage()


def _check_usage() -> None:
    try:
        routes = importlib.import_module(ROUTES_MODULE)
    except ImportError as e:
        raise MaxSeamError(f"MAX no longer has the module {ROUTES_MODULE} ({e})") from e
    for name in RESPONSE_NAMES:
        fields = getattr(getattr(routes, name, None), "model_fields", {})
        if "id" not in fields or "usage" not in fields:
            raise MaxSeamError(
                f"{ROUTES_MODULE}.{name} is no longer a response model with an id and a usage"
            )
