"""A/B of CPU decode attention between two checkouts of mokv (kernel variants).

    python benchmarks/ab_decode.py TREE_A TREE_B [--rounds 3] [--kinds paged,continuous]
                                   [--shapes 4:bf16:1:16384,8:f32:4:8192]

Two builds of the kernels cannot share a process (their ops have the same names), and
this VM's memory bandwidth drifts by tens of percent within minutes, so the trees take
turns in fresh processes, round after round, and the medians over rounds are compared.
A tree is any checkout (`git worktree add /tmp/a <rev>`); its kernels are built from its
own `mojo/` (cached by content). A shape is `n_kv_heads:dtype:batch:context` (dtype f32
or bf16) with 32 query heads of 128. Each cell is timed as in `bench_attention.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(shapes: list[str], kinds: list[str]) -> None:
    """Child process: prints one JSON line per (kind, shape) with the decode time."""
    from bench_attention import DTYPE, MokvSide, ReadProbe, _decode_cells
    from max.driver import CPU
    from max.dtype import DType
    from max.engine import InferenceSession

    session = InferenceSession(devices=[CPU()])
    probe = ReadProbe(1 << 28)
    for spec in shapes:
        hkv_text, dt, b_text, c_text = spec.split(":")
        hkv, b, c = int(hkv_text), int(b_text), int(c_text)
        dtype = DType.bfloat16 if dt == "bf16" else DTYPE
        kv_bytes = b * (c + 1) * 2 * hkv * 128 * dtype.size_in_bytes
        for kind in kinds:
            side = MokvSide(session, kind, hkv, dtype, slots=b, max_ctx=c)
            cell = _decode_cells([side], probe, b, c, kv_bytes, 0.6)[side.name]
            print(json.dumps({"shape": spec, "kind": kind, **cell}), flush=True)
            del side  # frees the cache before the next side


def run_tree(tree: Path, shapes: list[str], kinds: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree / "python")}
    cmd = [sys.executable, str(HERE / "ab_decode.py"), "--child",
           "--shapes", ",".join(shapes), "--kinds", ",".join(kinds)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="*", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", default="paged")
    ap.add_argument("--shapes",
                    default="4:bf16:1:16384,4:f32:1:16384,8:bf16:1:16384,32:bf16:1:16384")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    shapes, kinds = args.shapes.split(","), args.kinds.split(",")
    if args.child:
        measure(shapes, kinds)
        return
    if len(args.trees) != 2:
        ap.error("give two trees")
    ms: dict[tuple[str, str, int], list[float]] = {}
    for r in range(args.rounds):
        for i, tree in enumerate(args.trees):
            for cell in run_tree(tree.resolve(), shapes, kinds):
                ms.setdefault((cell["shape"], cell["kind"], i), []).append(cell["ms"])
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    print("shape kind: median ms A | B (B / A)")
    for shape in shapes:
        for kind in kinds:
            a, b = statistics.median(ms[shape, kind, 0]), statistics.median(ms[shape, kind, 1])
            print(f"{shape} {kind}: {a:.2f} | {b:.2f} (x{b / a:.2f})")


if __name__ == "__main__":
    main()
