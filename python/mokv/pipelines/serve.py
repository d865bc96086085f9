"""`mokv serve`: MAX 26.7's own OpenAI-compatible server, with a mokv KV cache.

    mokv serve --model DIR [any `max serve` option ...] [--mokv-config FILE]

Every option but `--mokv-config` is `max serve`'s, parsed and served by MAX's own code:
the API server, the scheduler, the pipeline, the model. The one thing that changes is
the KV cache in MAX's model worker: its pipeline builds a mokv cache (`load_kv_manager`)
where it would build MAX's own, sized from MAX's memory plan, so MAX's own pool is never
allocated. `--mokv-config FILE` adds mokv's host and shared tiers, KV-cache events, sessions
and pins (`MokvOptions`).

How: `max serve` builds its pipeline in a model-worker process it spawns, from a
picklable factory that `PIPELINE_REGISTRY.retrieve_factory` returns. `mokv serve` wraps
that factory (`seams.wrap_retrieved_pipelines`); in the worker the wrapper makes MAX's
pipelines build their manager with mokv's loader (`seams.install_kv_manager_loader`),
builds the pipeline, and checks that the pipeline holds a mokv cache.

Two more differences from `max serve`, both in the API server's tokenizer
(`PromptCheckingTokenizer`): a prompt of token ids outside the model's vocabulary is
refused with HTTP 400, where MAX 26.7 hands it to the model worker, whose embedding
gather fails and takes the worker, and the server, down with it; and a request's cache
control (a pin, a write policy: `cache_control.py`) is checked and carried to the worker,
its usage reporting Anthropic's cache counters (`seams.install_usage`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import cache_control
from .loader import load_kv_manager
from .manager import KVCacheManager
from .options import MokvOptions
from .seams import (
    MaxSeamError,
    install_chat_hint,
    install_kv_manager_loader,
    install_usage,
    wrap_retrieved_pipelines,
)

logger = logging.getLogger("max.pipelines")  # MAX's worker shows its own loggers

USAGE = """usage: mokv serve [--mokv-config FILE] [max serve options ...]

MAX's OpenAI-compatible server (`max serve`) with a mokv KV cache. Every option but
--mokv-config is `max serve`'s (`mokv serve --help` lists them); --mokv-config FILE
(YAML) adds mokv's tiers, KV-cache events, sessions and pins (docs/serve.md)."""


@dataclass(frozen=True)
class MokvLoader:
    """MAX's `load_kv_manager`, building a mokv cache with `options` (picklable)."""

    options: MokvOptions
    mokv_loader = True  # seams.check_seams: a loader mokv installed

    def __call__(self, *args: Any, **kwargs: Any) -> KVCacheManager:
        return load_kv_manager(*args, options=self.options, **kwargs)


@dataclass(frozen=True)
class MokvPipelineFactory:
    """A `max serve` pipeline factory whose pipeline holds a mokv cache. Called in
    MAX's model worker: it installs mokv's loader there before building."""

    factory: Callable[[], Any]
    options: MokvOptions

    def __call__(self) -> Any:
        install_kv_manager_loader(MokvLoader(self.options))
        pipeline = self.factory()
        manager = getattr(pipeline, "kv_manager", None)
        if not isinstance(manager, KVCacheManager):
            raise MaxSeamError(
                f"MAX built its pipeline with {type(manager).__name__}, not mokv's cache: "
                "its pipeline no longer calls the loader mokv installs (mokv.pipelines.seams)"
            )
        params = manager.manager.params
        _, total = manager.manager.page_counts(0)
        logger.info(
            "mokv KV cache: %d pages of %d tokens per replica (%d bytes each, %d replica(s)); "
            "tiers %s, events %s, sessions %s, pins %s; MAX's own pool is not allocated",
            total,
            params.page_size,
            params.bytes_per_page(manager.manager.num_layers),
            params.data_parallel_degree,
            [tier.name for tier in params.tiers] or "none",
            params.kv_events.endpoint if params.kv_events else "off",
            "on" if params.sessions else "off",
            f"up to {params.pins.max_share:.0%} of the pages" if params.pins else "off",
        )
        return pipeline


class PromptCheckingTokenizer:
    """MAX's tokenizer (every member is the wrapped one's), whose `new_context` refuses a
    prompt with a token id outside `[0, vocab_size)` with MAX's `InputError` (the API
    server's HTTP 400), naming the id, and carries the request's cache control to the
    worker (`cache_control.carry`: a bad one is an `InputError` too). `page_size`: the
    cache's; `pins`: whether the server pins (`MokvOptions.pins`)."""

    def __init__(self, tokenizer: Any, page_size: int = 1, pins: bool = False) -> None:
        self._tokenizer = tokenizer
        self._page_size = page_size
        self._pins = pins

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    # MAX's routes check `isinstance(tokenizer, PipelineTokenizer)`, a runtime protocol,
    # which Python 3.12 answers from the class (`inspect.getattr_static`), never calling
    # `__getattr__`: the protocol's members are spelled out (its `new_context` below).
    @property
    def eos_token_ids(self) -> Any:
        return self._tokenizer.eos_token_ids

    @property
    def expects_content_wrapping(self) -> Any:
        return self._tokenizer.expects_content_wrapping

    async def encode(self, *args: Any, **kwargs: Any) -> Any:
        return await self._tokenizer.encode(*args, **kwargs)

    async def decode(self, *args: Any, **kwargs: Any) -> Any:
        return await self._tokenizer.decode(*args, **kwargs)

    async def new_context(self, request: Any) -> Any:
        from max.pipelines.context.exceptions import InputError

        context = await self._tokenizer.new_context(request)
        vocab_size = getattr(context, "vocab_size", None)
        prompt = np.asarray(context.tokens.prompt)
        if vocab_size and prompt.size:
            outside = prompt[(prompt < 0) | (prompt >= vocab_size)]
            if outside.size:
                raise InputError(
                    f"the prompt holds token id {int(outside[0])}, outside the model's "
                    f"vocabulary [0, {vocab_size})"
                )
        try:
            cache_control.carry(request, context, self._page_size, self._pins)
        except ValueError as e:
            raise InputError(str(e)) from None
        return context


def mokv_pipeline(retrieved: Any, options: MokvOptions, page_size: int = 1) -> Any:
    """MAX's `RetrievedPipeline` with mokv's cache in its pipeline and its prompts checked
    (`page_size`: the cache's)."""
    return dataclasses.replace(
        retrieved,
        tokenizer=PromptCheckingTokenizer(retrieved.tokenizer, page_size, options.pins is not None),
        factory=MokvPipelineFactory(retrieved.factory, options),
    )


def split_mokv_args(argv: Sequence[str]) -> tuple[MokvOptions, list[str]]:
    """(mokv's options from `--mokv-config FILE`, the rest for `max serve`)."""
    rest: list[str] = []
    options = MokvOptions()
    args = iter(argv)
    for arg in args:
        if arg == "--mokv-config" or arg.startswith("--mokv-config="):
            path = arg.partition("=")[2] if "=" in arg else next(args, None)
            if not path:
                raise SystemExit("mokv serve: --mokv-config needs a FILE")
            options = MokvOptions.from_file(path)
        else:
            rest.append(arg)
    return options, rest


def main(argv: Sequence[str] | None = None) -> None:
    """The `mokv` console script: `mokv serve ...` (MAX's `max serve` on a mokv cache)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    options, rest = split_mokv_args(argv[1:])
    wrap_retrieved_pipelines(
        lambda retrieved, config: mokv_pipeline(
            retrieved, options, config.model.kv_cache.kv_cache_page_size
        )
    )
    install_usage(cache_control.with_cache_usage)
    install_chat_hint(cache_control.hint_with_marked)
    from max._entrypoints.pipelines import main as max_main

    # MAX's native code sets PYTHONEXECUTABLE to the first `python3` on PATH when it
    # loads. A model worker spawned with it runs that interpreter's site, not this
    # one's: a venv that is not activated loses its `.pth` files there, and with them an
    # editable install of mokv, which the worker must import to unpickle its factory.
    os.environ["PYTHONEXECUTABLE"] = sys.executable

    max_main.main(args=["serve", *rest], prog_name="mokv")


if __name__ == "__main__":
    main()
