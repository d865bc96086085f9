"""Several small test graphs compiled as one MAX model, to pay MAX's per-model compile once.

A cold compile of one small mokv graph costs ~23 s on a 2-core host, of which only ~7 s
grow with the graph: the rest is paid per model (measured 2026-11-27, Zen 5: one config
31 s, another 32 s, both in one graph 38 s). The op tests need a graph per static
configuration (dtype, heads, head size, page size, CPU path), so they build one model per
CPU path that holds every configuration side by side, each part with inputs of its own.

Running one part feeds the others inputs on which they do nothing (an empty batch) and
returns that part's outputs only, so a test sees the same `execute` as a model of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from max.driver import Buffer, Device
from max.engine import InferenceSession
from max.graph import Graph, SymbolicDim, Type, Value


@dataclasses.dataclass(frozen=True)
class Part:
    """One configuration's graph: its input types, the ops it adds on those inputs
    (returning its outputs), and inputs on which it runs and does nothing."""

    input_types: Sequence[Type]
    body: Callable[[Sequence[Value]], Sequence[Value]]
    idle_inputs: Callable[[], Sequence[Buffer]]


def _own_dims(t: Type, suffix: str) -> Type:
    """`t` with every symbolic dim renamed: parts must not tie each other's dims."""
    shape = [
        SymbolicDim(f"{d.name}_{suffix}") if isinstance(d, SymbolicDim) else d for d in t.shape
    ]
    return dataclasses.replace(t, shape=shape)


class PartRunner:
    """One part of a bundle, with the `execute` of a model of its own."""

    def __init__(self, bundle: Bundle, index: int) -> None:
        self._bundle, self._index = bundle, index

    def execute(self, *inputs: Buffer) -> list[Buffer]:
        return self._bundle.execute_part(self._index, inputs)


def bundle_graph(
    name: str, parts: Sequence[Part], custom_extensions: list[Any]
) -> tuple[Graph, list[slice]]:
    """The graph of `parts` side by side, and where each part's outputs are among its outputs."""
    types = [_own_dims(t, str(i)) for i, p in enumerate(parts) for t in p.input_types]
    slices: list[slice] = []
    with Graph(name, input_types=types, custom_extensions=custom_extensions) as graph:
        inputs, outputs = list(graph.inputs), []  # type: list[Any], list[Any]
        for part in parts:
            n = len(part.input_types)
            part_outputs = part.body(inputs[:n])
            inputs = inputs[n:]
            slices.append(slice(len(outputs), len(outputs) + len(part_outputs)))
            outputs.extend(part_outputs)
        graph.output(*outputs)
    return graph, slices


class Bundle:
    """The parts compiled as one model (in the order given)."""

    def __init__(
        self,
        session: InferenceSession,
        name: str,
        parts: Sequence[Part],
        custom_extensions: list[Any],
    ) -> None:
        self._parts = list(parts)
        graph, self._outputs = bundle_graph(name, self._parts, custom_extensions)
        self._model = session.load(graph)
        ends = list(itertools.accumulate(len(p.input_types) for p in self._parts))
        self._inputs = [slice(e - len(p.input_types), e) for p, e in zip(self._parts, ends)]

    def input_devices(self, index: int) -> list[Device]:
        """Where the model takes part `index`'s inputs."""
        return list(self._model.input_devices[self._inputs[index]])

    def _idle_inputs(self, index: int) -> list[Buffer]:
        """Part `index`'s idle inputs, on the devices the model takes them on."""
        moved = [
            b if d.is_host else b.to(d)
            for b, d in zip(self._parts[index].idle_inputs(), self.input_devices(index))
        ]
        for d in self.input_devices(index):
            if not d.is_host:
                d.synchronize()  # copies are enqueued, not done
        return moved

    def execute_part(self, index: int, inputs: Sequence[Buffer]) -> list[Buffer]:
        args: list[Buffer] = []
        for i in range(len(self._parts)):
            args.extend(inputs if i == index else self._idle_inputs(i))
        return list(self._model.execute(*args)[self._outputs[index]])

    def runner(self, index: int) -> PartRunner:
        return PartRunner(self, index)
