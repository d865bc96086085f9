"""What mokv's GPU kernels compile to, on a machine without a GPU.

A virtual-device build (`python tests/ops/_virtual_gpu_build.py cuda sm_90`) leaves
the compiled model in MAX's cache (`~/.cache/modular/.max_cache/mof/mef/<version>/`);
for an NVIDIA target it holds one cubin (an ELF) per kernel. This script cuts the
newest cached model that contains mokv's kernels into its cubins and prints, for each
mokv kernel, the registers and local memory (spills) `cuobjdump` reports and a count of
the instructions that decide speed in `nvdisasm`'s SASS: global loads by width,
tensor-core `HMMA`, warp shuffles, byte permutes.

    pip download --no-deps nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump -d /tmp/nv
    (cd /tmp/nv && for w in *.whl; do unzip -qo $w -d x; done)
    python benchmarks/gpu_sass.py --tools /tmp/nv/x/nvidia/cu13/bin [--mef FILE] [--sass DIR]

This is how the bf16 slice loads were found to be eight 2-byte loads each (before
`_slice_align` in `kernels/attention/gpu.mojo`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

CACHE = Path.home() / ".cache/modular/.max_cache/mof/mef"
COUNTED = {
    "LDG.E.U16": r"LDG\.E\.U16\b",
    "LDG.E (32-bit)": r"LDG\.E\s",
    "LDG.E.64": r"LDG\.E\.64\b",
    "LDG.E.128": r"LDG\.E\.128\b",
    "STG": r"\bSTG\b",
    "HMMA": r"\bHMMA\b",
    "SHFL": r"\bSHFL\b",
    "PRMT": r"\bPRMT\b",
}


EM_CUDA = 190  # ELF e_machine of a cubin (an AMD code object is another machine)


def cubins(model: bytes) -> list[bytes]:
    """The NVIDIA ELF images inside a cached model, in order."""
    starts = [m.start() for m in re.finditer(rb"\x7fELF", model)]
    images = [model[s:e] for s, e in zip(starts, starts[1:] + [len(model)])]
    return [im for im in images if int.from_bytes(im[18:20], "little") == EM_CUDA]


def newest_model_with(marker: bytes) -> Path:
    """The most recently written cached model that has cubins and contains `marker`."""
    for path in sorted(CACHE.glob("*/*"), key=lambda p: p.stat().st_mtime, reverse=True):
        data = path.read_bytes()
        if marker in data and cubins(data):
            return path
    raise SystemExit(f"no cached model under {CACHE} has cubins with {marker!r}: run a virtual sm_90 build first")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tools", type=Path, required=True, help="folder holding nvdisasm and cuobjdump")
    ap.add_argument("--mef", type=Path, help="a cached model (default: the newest with mokv's kernels)")
    ap.add_argument("--sass", type=Path, help="also write each mokv kernel's SASS into this folder")
    args = ap.parse_args()
    model = args.mef or newest_model_with(b"mokv_kernels_")
    print(f"model: {model}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, image in enumerate(cubins(model.read_bytes())):
            path = Path(tmp) / f"k{i}.cubin"
            path.write_bytes(image)
            usage = subprocess.run([args.tools / "cuobjdump", "--dump-resource-usage", path],
                                   capture_output=True, text=True).stdout
            name = re.search(r"Function (\S+):", usage)
            if not name or not name.group(1).startswith("mokv_"):
                continue
            sass = subprocess.run([args.tools / "nvdisasm", "-c", path], capture_output=True, text=True).stdout
            if args.sass:
                args.sass.mkdir(parents=True, exist_ok=True)
                (args.sass / f"{name.group(1)}.sass").write_text(sass)
            regs = " ".join(re.findall(r"(?:REG|LOCAL|SHARED):\d+", usage))
            counts = Counter({k: len(re.findall(rx, sass)) for k, rx in COUNTED.items()})
            shown = ", ".join(f"{k} {n}" for k, n in counts.items() if n)
            print(f"{name.group(1)[:60]:60s} {regs}\n    {shown}")


if __name__ == "__main__":
    main()
