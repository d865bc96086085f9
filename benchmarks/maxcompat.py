"""Import MAX 26.7's `max.pipelines` KV-cache code without the serving stack.

`max.pipelines/__init__.py` pulls in the weight loaders (huggingface_hub, transformers)
and `max.pipelines.context` imports PyAV for video contexts; none of them is used by
the KV cache manager or TextContext. We register `max.pipelines` as a bare package (so
its `__init__` does not run) and stand in empty modules for the two imports that are
missing. `pydantic` and `pyyaml` are still needed (the `bench` extra installs them).
"""

from __future__ import annotations

import sys
import types
from unittest import mock


def load_max_pipelines():
    """Returns (PagedKVCacheManager, MHAKVCacheParams, TextContext, TokenBuffer, RequestID,
    InsufficientBlocksError) from MAX, or raises ImportError with the missing package."""
    import max

    if "max.pipelines" not in sys.modules:
        pkg = types.ModuleType("max.pipelines")
        pkg.__path__ = [f"{list(max.__path__)[0]}/pipelines"]
        sys.modules["max.pipelines"] = pkg
    for name in ("av", "huggingface_hub"):
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = mock.MagicMock(name=name)
    from max.nn.kv_cache import MHAKVCacheParams
    from max.pipelines.context import TextContext, TokenBuffer
    from max.pipelines.kv_cache import InsufficientBlocksError, PagedKVCacheManager
    from max.pipelines.request import RequestID

    return PagedKVCacheManager, MHAKVCacheParams, TextContext, TokenBuffer, RequestID, InsufficientBlocksError
