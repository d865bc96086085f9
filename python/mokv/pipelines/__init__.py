"""mokv behind MAX 26.7's own serving stack: MAX's names (`max.pipelines`), a mokv cache.

    from mokv.pipelines import load_kv_manager      # MAX's signature and params
    manager = load_kv_manager(params, max_batch_size, max_seq_len, session,
                              available_cache_memory, is_di_enabled, model_name,
                              max_num_input_tokens)
    isinstance(manager, max.pipelines.kv_cache.PagedKVCacheManagerInterface)  # True

`KVCacheManager` is MAX's paged manager interface over a mokv `PagedKVCacheManager`
(manager.py), `load_kv_manager` MAX's loader (loader.py), `MokvOptions` what mokv adds
(tiers, events, sessions: options.py), `mokv_params` MAX's params read as mokv's
(params.py), and `mokv serve` MAX's server with this cache
inside (serve.py). Importing this package imports `max.pipelines`, which needs MAX's
serving dependencies: `pip install "mokv[serve]"`.
"""

from .context_view import MaxContextView
from .loader import load_kv_manager
from .manager import KVCacheManager
from .options import MokvConfigError, MokvOptions
from .params import UnsupportedMaxParamsError, check_supported, mokv_params
from .seams import MaxSeamError, check_seams

__all__ = [
    "KVCacheManager",
    "MaxContextView",
    "MaxSeamError",
    "MokvConfigError",
    "MokvOptions",
    "UnsupportedMaxParamsError",
    "check_seams",
    "check_supported",
    "load_kv_manager",
    "mokv_params",
]
