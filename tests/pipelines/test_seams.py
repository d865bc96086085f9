"""The four places where mokv reaches into MAX 26.7 without a public seam
(`mokv.pipelines.seams`): if a MAX release moves one, this fails naming it."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from max.pipelines.context import TokenBuffer
from mokv.pipelines import MaxSeamError, MokvOptions, check_seams, seams
from mokv.pipelines.serve import MokvLoader, MokvPipelineFactory, split_mokv_args


def test_every_seam_is_where_mokv_expects_it():
    check_seams()


def test_the_loader_mokv_installs_is_the_one_max_s_pipelines_call(monkeypatch):
    loader = MokvLoader(MokvOptions())
    for name in seams.PIPELINE_MODULES:
        monkeypatch.setattr(importlib.import_module(name), seams.LOADER_NAME, object())
    with pytest.raises(MaxSeamError, match="neither MAX's nor mokv's"):
        seams.install_kv_manager_loader(loader)
    monkeypatch.undo()
    seams.install_kv_manager_loader(loader)
    try:
        for name in seams.PIPELINE_MODULES:
            assert getattr(importlib.import_module(name), seams.LOADER_NAME) is loader
        check_seams()  # a loader mokv installed passes too
    finally:
        from max.pipelines.kv_cache import load_kv_manager

        for name in seams.PIPELINE_MODULES:
            setattr(importlib.import_module(name), seams.LOADER_NAME, load_kv_manager)


def test_a_factory_whose_pipeline_holds_max_s_own_cache_fails_at_startup():
    class Pipeline:
        kv_manager = object()  # what a MAX that stopped calling the global would build

    try:
        with pytest.raises(MaxSeamError, match="not mokv's cache"):
            MokvPipelineFactory(Pipeline, MokvOptions())()
    finally:
        from max.pipelines.kv_cache import load_kv_manager

        for name in seams.PIPELINE_MODULES:
            setattr(importlib.import_module(name), seams.LOADER_NAME, load_kv_manager)


def test_unchunk_gives_a_chunked_window_back_its_end():
    tokens = TokenBuffer(np.arange(10, dtype=np.int64))
    tokens.chunk(4)
    seams.unchunk(tokens)
    assert (tokens.processed_length, tokens.current_position, tokens.actively_chunked) == (
        0,
        10,
        False,
    )


def test_mokv_config_is_taken_out_of_max_serve_s_arguments(tmp_path):
    config = tmp_path / "mokv.yaml"
    config.write_text("sessions:\n  ttl_s: 60\n")
    for argv in (
        ["--model", "m", "--mokv-config", str(config), "--port", "1"],
        ["--model", "m", f"--mokv-config={config}", "--port", "1"],
    ):
        options, rest = split_mokv_args(argv)
        assert rest == ["--model", "m", "--port", "1"]
        assert options.sessions is not None and options.sessions.ttl_s == 60


def test_prompts_outside_the_vocabulary_are_refused_before_the_model_worker():
    import asyncio

    from max.pipelines.context import TextContext
    from max.pipelines.context.exceptions import InputError
    from mokv.pipelines.serve import PromptCheckingTokenizer

    class WordTokenizer:  # what MAX's TextTokenizer does with a token-id prompt
        eos = 2

        async def new_context(self, prompt):
            tokens = TokenBuffer(np.array(prompt, np.int64))
            return TextContext(max_length=64, tokens=tokens, vocab_size=256)

    checked = PromptCheckingTokenizer(WordTokenizer())
    assert checked.eos == 2
    assert asyncio.run(checked.new_context([1, 255])).vocab_size == 256
    for bad in ([1, 256], [300, 1]):
        with pytest.raises(InputError, match=f"token id {max(bad)}, outside"):
            asyncio.run(checked.new_context(bad))


def test_the_responses_mokv_installs_are_the_ones_max_s_routes_build(monkeypatch):
    from mokv.pipelines.cache_control import with_cache_usage

    routes = importlib.import_module(seams.ROUTES_MODULE)
    originals = {name: getattr(routes, name) for name in seams.RESPONSE_NAMES}
    monkeypatch.setattr(routes, seams.RESPONSE_NAMES[0], dict)
    with pytest.raises(MaxSeamError, match=seams.RESPONSE_NAMES[0]):
        check_seams()
    monkeypatch.undo()
    try:
        seams.install_usage(with_cache_usage)
        installed = {name: getattr(routes, name) for name in seams.RESPONSE_NAMES}
        for name, model in installed.items():
            assert issubclass(model, originals[name]) and model is not originals[name]
        seams.install_usage(with_cache_usage)  # once only
        assert {name: getattr(routes, name) for name in seams.RESPONSE_NAMES} == installed
        check_seams()
    finally:
        for name, model in originals.items():
            setattr(routes, name, model)


def test_the_chat_parser_mokv_wraps_moves_a_marked_message_into_the_hint(monkeypatch):
    import asyncio

    from mokv.pipelines.cache_control import hint_with_marked

    routes = importlib.import_module(seams.ROUTES_MODULE)
    original = getattr(routes, seams.CHAT_PARSER)
    monkeypatch.setattr(routes, seams.CHAT_PARSER, lambda request: request)
    with pytest.raises(MaxSeamError, match=seams.CHAT_PARSER):
        check_seams()
    monkeypatch.undo()
    seen = []

    async def parse(completion_request, *args, **kwargs):
        seen.append(completion_request.dkv_cache_hint)
        return "parsed"

    monkeypatch.setattr(routes, seams.CHAT_PARSER, parse)
    seams.install_chat_hint(hint_with_marked)
    wrapped = getattr(routes, seams.CHAT_PARSER)
    seams.install_chat_hint(hint_with_marked)  # once only
    assert getattr(routes, seams.CHAT_PARSER) is wrapped and wrapped is not parse
    mark = {"type": "ephemeral", "ttl": "1h"}
    request = routes.CreateChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": [{"type": "text", "text": "t", "cache_control": mark}]}],
        dkv_cache_hint={"session_id": "s"},
    )
    assert asyncio.run(wrapped(request, False, None)) == "parsed"
    assert seen == [{"session_id": "s", "cache_control": mark}]
    unmarked = routes.CreateChatCompletionRequest(model="m", messages=[{"role": "user", "content": "t"}])
    asyncio.run(wrapped(unmarked, False, None))
    assert seen[-1] is None
    monkeypatch.setattr(routes, seams.CHAT_PARSER, original)
    check_seams()


def test_the_checking_tokenizer_is_a_pipeline_tokenizer_to_python_3_12():
    """MAX's routes refuse a tokenizer that is not a `PipelineTokenizer`; Python 3.12
    checks a runtime protocol's members on the class (`inspect.getattr_static`), not
    through `__getattr__` (an H200 run on Python 3.12 refused every request before)."""
    import inspect

    from max.pipelines.modeling.types.tokenizer import PipelineTokenizer
    from mokv.pipelines.serve import PromptCheckingTokenizer

    members = [name for name in vars(PipelineTokenizer) if not name.startswith("_")]
    assert {"eos_token_ids", "expects_content_wrapping", "new_context", "encode"} <= set(members)

    class Inner:
        eos_token_ids = {2}
        expects_content_wrapping = False

    checked = PromptCheckingTokenizer(Inner())
    for name in members:
        inspect.getattr_static(checked, name)  # AttributeError names a missing member
    assert checked.eos_token_ids == {2} and checked.expects_content_wrapping is False
    assert isinstance(checked, PipelineTokenizer)
