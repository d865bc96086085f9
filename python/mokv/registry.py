"""One registry: every object that a config describes is built from it here.

The configs (`mokv.config`) sit on the ground floor and name no implementation; each
implementation registers the function that builds it from its config type, in its own
module (`mokv.tiers.host`: the host tier; `mokv.tiers.remote`: the shared tier;
`mokv.events.publisher`: an event stream; `mokv.managers.paged.sessions`: a session
table), and whoever needs the object asks `BUILDERS.build(config, ...)`. The package
that builds objects imports the modules that register them (`mokv.tiers` imports its
tiers; the paged replica imports the publisher and the session table), so a process
that imports only what it uses still finds every builder (tests/test_structure.py
checks it in a fresh interpreter). A new tier is a config class and a module that
registers its builder, imported by `mokv.tiers`; nothing else names it.

mini-sglang's `utils/registry.py` is the model (a name that is not registered is refused
with the ones that are); here the key is the config's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry:
    """Config type -> the function that builds the config's object from it."""

    def __init__(self) -> None:
        self._builders: dict[type, Callable[..., Any]] = {}

    def register(self, config_type: type, builder: Callable[..., Any]) -> None:
        """Builds objects of `config_type` with `builder(config, *args)`; ValueError if
        another builder has it."""
        known = self._builders.get(config_type)
        if known is not None and known is not builder:
            raise ValueError(f"{config_type.__name__} is registered already (to {known!r})")
        self._builders[config_type] = builder

    def knows(self, config_type: type) -> bool:
        """Whether a builder is registered for `config_type`."""
        return config_type in self._builders

    def build(self, config: object, *args: Any) -> Any:
        """`config`'s object, built by the builder registered for its type; TypeError
        naming the registered types when there is none."""
        builder = self._builders.get(type(config))
        if builder is None:
            known = sorted(t.__name__ for t in self._builders)
            raise TypeError(
                f"nothing builds a {type(config).__name__} ({config!r}): its module must "
                f"register a builder (mokv.registry.BUILDERS.register); registered: {known}"
            )
        return builder(config, *args)


BUILDERS = Registry()
"""The registry every mokv object is built through."""
