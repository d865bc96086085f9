"""Runs a CPU kernel's work units in parallel on the op's own device context."""

from std.atomic import Atomic
from std.sys.info import CompilationTarget

from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.device_context import DeviceContextBase
from max.runtime.asyncrt import parallelism_level


@always_inline
def parallel_units[FuncType: def(Int) raises -> None](body: FuncType, count: Int, ctx: DeviceContext):
    """Runs body(0) ... body(count - 1) over the CPU cores and returns when all are done.

    Two choices, both measured inside MAX graphs on the 2-core VM:
      * The tasks go to `ctx`, the CPU device context MAX hands the op, whose worker
        threads run the graph. Without it `sync_parallelize` makes a CPU context of its
        own per call, and the graph's workers and that context's tasks share the cores:
        GQA 8 bf16 decode at 2k context took ~0.26 ms per step instead of ~0.20.
      * One task per worker, each taking the next unit from a shared counter until none
        are left. `sync_parallelize` over the units deals them out in a fixed order, so
        when one core is slower (another process, a noisy neighbour) its units finish
        last: at 16k context one worker's four units ended ~0.3 ms after the other's.
        Units taken on demand: median decode times 9-25 % lower on six of seven
        shapes (GQA 1/4/8, f32 and bf16, 1 x 16k), 7 % higher on the seventh (4 x 8k,
        bf16 GQA 8), three runs alternating the two orders.
    The calling thread takes no units inline beside the tasks: in graphs the task it
    enqueued waited until it synchronized, so the kernel ran on one core (tried twice,
    docs/log.md, 2026-11-23 to 2026-11-25).
    """
    var cpu_ctx = rebind[DeviceContextBase[CompilationTarget()]](ctx)
    var next_unit = List[Int64](length=1, fill=0)
    var counter = next_unit.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()

    def worker(w: Int) raises {imm body, imm counter, imm count}:
        while True:
            var i = Int(Atomic[Int64].fetch_add(counter, 1))
            if i >= count:
                return
            body(i)

    # At least one worker, so that no count of units is ever silently skipped.
    sync_parallelize(worker, min(count, max(1, parallelism_level(cpu_ctx))), cpu_ctx)
    _ = next_unit^  # the counter outlives every worker
