"""Python extension module `mokv_manager_ext`: the Mojo continuous-batching manager for Python.

Built by python/mokv/managers/native.py (`mojo build --emit shared-lib`, against the
precompiled mokv package, cached by content hash); nobody builds it by hand. The
Python-facing class is python/mokv/managers/mojo_continuous.py.

`ContinuousBatchingKVCacheManager` here is the Mojo manager's state for a CPU device:
the same `ContinuousBatchingSlotTable` (slot assignment, lengths, spin lock) that
mokv.manager.ContinuousBatchingKVCacheManager uses, plus a zeroed blocks buffer in the
continuous layout allocated through a CPU `DeviceContext`. The element type and head
shape are runtime values here (bytes per element, heads, head size), since a Python
caller picks them at run time; Python views the buffer as numpy / a MAX `Buffer`
without a copy, and mokv's graphs read and write it through the continuous inputs.

Every call that touches the shared state releases the GIL while it works (never
touching a PythonObject meanwhile), so Python threads run it concurrently; the spin
lock inside the table serialises them. Errors arrive as Python exceptions whose text
starts with the mokv error name (slots.mojo); the Python class maps them to types.
"""

from std.os import abort
from std.python import Python, PythonObject
from std.python.bindings import PythonModuleBuilder

from max.gpu.host import DeviceBuffer, DeviceContext

from mokv.slots import ContinuousBatchingSlotTable
from mokv.types import U32Ptr


def _ints(seq: PythonObject) raises -> List[Int]:
    """A Python sequence of ints as a List[Int] (TypeError for anything else)."""
    var out = List[Int](capacity=Int(py=seq.__len__()))
    for x in seq:
        out.append(Int(py=x))
    return out^


struct ContinuousBatchingKVCacheManager(Movable, Writable):
    """Slots, lengths and the blocks buffer of one continuous-batching cache on the CPU."""

    var table: ContinuousBatchingSlotTable
    var device: DeviceContext
    var blocks: DeviceBuffer[DType.uint8]
    """[max_batch_size, 2, num_layers, max_seq_len, num_heads, head_size] x itemsize bytes."""
    var num_layers: Int
    var num_heads: Int
    var head_size: Int
    var itemsize: Int

    def __init__(
        out self, max_batch_size: Int, max_seq_len: Int, num_layers: Int, num_heads: Int, head_size: Int, itemsize: Int
    ) raises:
        if num_layers < 1 or num_heads < 1 or head_size < 1 or itemsize < 1:
            raise Error(
                t"ValueError: num_layers={num_layers}, num_heads={num_heads}, head_size={head_size},"
                t" itemsize={itemsize} must all be positive"
            )
        self.table = ContinuousBatchingSlotTable(max_batch_size, max_seq_len)
        self.device = DeviceContext(api="cpu")
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_size = head_size
        self.itemsize = itemsize
        var nbytes = max_batch_size * 2 * num_layers * max_seq_len * num_heads * head_size * itemsize
        self.blocks = self.device.enqueue_create_buffer[DType.uint8](nbytes)
        self.device.enqueue_memset(self.blocks, 0)
        self.device.synchronize()

    def write_to(self, mut writer: Some[Writer]):
        writer.write(
            "mokv_manager_ext.ContinuousBatchingKVCacheManager(max_batch_size=",
            self.table.max_batch_size,
            ", max_seq_len=",
            self.table.max_seq_len,
            ", num_layers=",
            self.num_layers,
            ")",
        )

    def write_repr_to(self, mut writer: Some[Writer]):
        self.write_to(writer)

    # --- Python entry points (static: the first argument is the Python object) -------

    @staticmethod
    def py_init(out self: ContinuousBatchingKVCacheManager, args: PythonObject, kwargs: PythonObject) raises:
        """(max_batch_size, max_seq_len, num_layers, num_heads, head_size, itemsize)."""
        if Int(py=args.__len__()) != 6:
            raise Error("TypeError: expected (max_batch_size, max_seq_len, num_layers, num_heads, head_size, itemsize)")
        self = ContinuousBatchingKVCacheManager(
            Int(py=args[0]), Int(py=args[1]), Int(py=args[2]), Int(py=args[3]), Int(py=args[4]), Int(py=args[5])
        )

    @staticmethod
    def claim(py_self: PythonObject, batch_size: PythonObject) raises -> PythonObject:
        """Returns `batch_size` new sequence ids (= slots) as a list: `claim(n)`."""
        var m = py_self.downcast_value_ptr[Self]()
        var n = Int(py=batch_size)
        var ids = List[Int]()
        var err = String()
        ref cpy = Python().cpython()
        var gil = cpy.PyEval_SaveThread()
        try:
            ids = m[].table.claim(n)
        except e:
            err = String(e)
        cpy.PyEval_RestoreThread(gil)
        if err:
            raise Error(err)
        var out = Python.list()
        for sid in ids:
            out.append(PythonObject(sid))
        return out

    @staticmethod
    def release(py_self: PythonObject, seq_id: PythonObject) raises -> PythonObject:
        """Returns the slot of `seq_id` to the free stack: `release(seq_id)`."""
        var m = py_self.downcast_value_ptr[Self]()
        var sid = Int(py=seq_id)
        var err = String()
        ref cpy = Python().cpython()
        var gil = cpy.PyEval_SaveThread()
        try:
            m[].table.release(sid)
        except e:
            err = String(e)
        cpy.PyEval_RestoreThread(gil)
        if err:
            raise Error(err)
        return PythonObject(None)

    @staticmethod
    def step(py_self: PythonObject, seq_ids: PythonObject, valid_lengths: PythonObject) raises -> PythonObject:
        """Commits new tokens, all or nothing: `step(seq_ids, valid_lengths)`."""
        var m = py_self.downcast_value_ptr[Self]()
        var ids = _ints(seq_ids)
        var lengths = _ints(valid_lengths)
        var err = String()
        ref cpy = Python().cpython()
        var gil = cpy.PyEval_SaveThread()
        try:
            m[].table.step(ids, lengths)
        except e:
            err = String(e)
        cpy.PyEval_RestoreThread(gil)
        if err:
            raise Error(err)
        return PythonObject(None)

    @staticmethod
    def lookup(py_self: PythonObject, seq_ids: PythonObject, address: PythonObject) raises -> PythonObject:
        """Writes fetch's arrays, returns is_cache_empty: `lookup(seq_ids, address)`.

        Writes uint32 [2, n] at `address`: row 0 the cache lengths, row 1 the slots
        (the caller owns that memory and keeps it alive during the call)."""
        var m = py_self.downcast_value_ptr[Self]()
        var ids = _ints(seq_ids)
        var p = U32Ptr(unsafe_from_address=Int(py=address))
        var is_empty = False
        var err = String()
        ref cpy = Python().cpython()
        var gil = cpy.PyEval_SaveThread()
        try:
            is_empty = m[].table.lookup(ids, p, p.unsafe_offset(len(ids)))
        except e:
            err = String(e)
        cpy.PyEval_RestoreThread(gil)
        if err:
            raise Error(err)
        return PythonObject(is_empty)

    @staticmethod
    def contains(py_self: PythonObject, seq_id: PythonObject) raises -> PythonObject:
        var m = py_self.downcast_value_ptr[Self]()
        return PythonObject(m[].table.contains(Int(py=seq_id)))

    @staticmethod
    def cache_length(py_self: PythonObject, seq_id: PythonObject) raises -> PythonObject:
        var m = py_self.downcast_value_ptr[Self]()
        return PythonObject(m[].table.cache_length(Int(py=seq_id)))

    @staticmethod
    def slot_lengths(py_self: PythonObject) raises -> PythonObject:
        """Every slot's committed length (free slots keep their last one)."""
        var m = py_self.downcast_value_ptr[Self]()
        var lengths = m[].table.slot_lengths()
        var out = Python.list()
        for n in lengths:
            out.append(PythonObject(n))
        return out

    @staticmethod
    def num_free_slots(py_self: PythonObject) raises -> PythonObject:
        var m = py_self.downcast_value_ptr[Self]()
        return PythonObject(m[].table.num_free_slots())

    @staticmethod
    def seq_id_counter(py_self: PythonObject) raises -> PythonObject:
        """Sequences claimed since construction."""
        var m = py_self.downcast_value_ptr[Self]()
        return PythonObject(Int(m[].table.seq_id_counter.load()))

    @staticmethod
    def blocks_address(py_self: PythonObject) raises -> PythonObject:
        """Address of the blocks buffer (host memory: the device is the CPU)."""
        var m = py_self.downcast_value_ptr[Self]()
        return PythonObject(Int(m[].blocks.unsafe_ptr()))

    @staticmethod
    def blocks_nbytes(py_self: PythonObject) raises -> PythonObject:
        var m = py_self.downcast_value_ptr[Self]()
        return PythonObject(len(m[].blocks))


@export
def PyInit_mokv_manager_ext() abi("C") -> PythonObject:
    try:
        comptime M = ContinuousBatchingKVCacheManager
        var b = PythonModuleBuilder("mokv_manager_ext")
        _ = (
            b.add_type[M]("ContinuousBatchingKVCacheManager")
            .def_py_init[M.py_init]()
            .def_method[M.claim]("claim", docstring="claim(n) -> list of n sequence ids")
            .def_method[M.release]("release", docstring="release(seq_id)")
            .def_method[M.step]("step", docstring="step(seq_ids, valid_lengths)")
            .def_method[M.lookup]("lookup", docstring="lookup(seq_ids, address) -> is_cache_empty")
            .def_method[M.contains]("contains")
            .def_method[M.cache_length]("cache_length")
            .def_method[M.slot_lengths]("slot_lengths")
            .def_method[M.num_free_slots]("num_free_slots")
            .def_method[M.seq_id_counter]("seq_id_counter")
            .def_method[M.blocks_address]("blocks_address")
            .def_method[M.blocks_nbytes]("blocks_nbytes")
        )
        return b.finalize()
    except e:
        abort(t"failed to build mokv_manager_ext: {e}")
