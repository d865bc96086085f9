"""Compile the mokv decoder for an NVIDIA H100 on a machine without a GPU.

MAX's virtual-device mode makes `Accelerator()` stand for a GPU that is not attached:
graphs compile for it (real PTX for sm_90a) but nothing can run. `mokv.load_kv_manager`
notices the mode and returns a `NullKVCacheManager`, which allocates nothing but has the
layout and graph input types of the manager it stands for, so the model code is unchanged.

    python examples/compile_only.py [--strategy paged|continuous] [--arch sm_90]
                                    [--out decoder.mef] [--num-layers 4]
"""

import argparse
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import mokv
import numpy as np
from max import driver
from max.engine import CompileOnlyExecutionError, InferenceSession
from mokv_graphs import DecoderConfig, DecoderModel

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--strategy", choices=["paged", "continuous"], default="paged")
parser.add_argument("--arch", default="sm_90", help="virtual GPU architecture")
parser.add_argument("--out", help="where to write the compiled model (.mef)")
parser.add_argument("--num-layers", type=int, default=DecoderConfig.num_layers)
args = parser.parse_args()

# Order matters (as in MAX's own CLI): API, then architecture, then count.
driver.set_virtual_device_api("cuda")
driver.set_virtual_device_target_arch(args.arch)
driver.set_virtual_device_count(1)
gpu = driver.Accelerator()
print(f"virtual device: {gpu} (api={gpu.api}, arch={gpu.architecture_name}), "
      f"virtual mode: {driver.is_virtual_device_mode()}")

config = DecoderConfig(num_layers=args.num_layers)
params = config.kv_params(args.strategy, page_size=128)
session = InferenceSession(devices=[driver.CPU(), gpu])
manager = mokv.load_kv_manager(
    params,
    max_batch_size=32,
    max_seq_len=config.max_seq_len,
    num_layers=config.num_layers,
    devices=[gpu],
    session=session,
    available_cache_memory=1 << 30,
    page_size=128,
)
# On a virtual device load_kv_manager builds the compile-only manager: no memory, the
# strategy's layout.
assert isinstance(manager, mokv.NullKVCacheManager)
estimated = manager.estimated_memory_size(
    params, 32, config.max_seq_len, config.num_layers, 1 << 30, [gpu]
)
print(
    f"cache manager: {type(manager).__name__}, {manager.layout.name} layout (estimated memory "
    f"{estimated} bytes)"
)

# The same model code as on the CPU. On a virtual device `session.load` compiles and
# returns a stand-in (`CompileOnlyModel`) that carries the compiled artifact.
start = time.perf_counter()
model = DecoderModel(config, manager, session)
print(f"compiled for {args.arch} in {time.perf_counter() - start:.1f} s: {model.model!r}")
mokv_ops = Counter(re.findall(r'"(mokv\.[\w.]+)"', str(model.graph)))
print(f"graph {model.graph.name!r}: {len(model.graph.inputs)} inputs, mokv ops: {dict(mokv_ops)}")

out = Path(args.out or Path(tempfile.mkdtemp()) / "mokv_decoder.mef")
model.model.compiled.export_mef(out)
blob = out.read_bytes()
code_objects = blob.count(b"\x7fELF")
print(f"wrote {out} ({len(blob) / 1e6:.1f} MB): {code_objects} embedded ELF code objects, "
      f"{blob.count(args.arch.encode())} mentions of {args.arch}")

# There is no device to run on: executing raises.
ctx = mokv.TextContext(np.arange(8))
manager.external_claim(ctx.request_id)
try:
    model.step([ctx])
except CompileOnlyExecutionError as exc:
    print(f"execute raised CompileOnlyExecutionError, as expected: {str(exc)[:90]}...")
else:
    raise SystemExit("execute did not raise CompileOnlyExecutionError")

# MAX 26.7 can abort while tearing down virtual devices at interpreter exit
# ("terminate called without an active exception", rc 134): leave before that.
sys.stdout.flush()
os._exit(0)
