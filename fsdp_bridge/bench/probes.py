"""What the bench measures inside one step: the heap in use (glibc's `mallinfo2`) and the
collectives every configuration issues (a TorchDispatchMode over the step); see the package's
docstring for why these two and what they miss."""

from __future__ import annotations

import ctypes
import functools


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def collective_bytes(namespace: str, name: str, args) -> int:
    """Bytes of the full tensor a collective moves (see the package docstring)."""
    if namespace == "c10d" and name.startswith("alltoall"):
        # An all-to-all has no full tensor: what the rank sends plus what it receives (for the
        # engine's swap of halves between a pair, exactly the full tensor).
        return _tensor_bytes(args[0]) + _tensor_bytes(args[1])
    if namespace == "c10d":
        # In-place c10d ops take (outputs, inputs, ...): the full side is the larger one.
        return max(_tensor_bytes(args[0]), _tensor_bytes(args[1]) if len(args) > 1 else 0)
    if name.startswith("all_gather"):  # functional: (input, group_size, group_name)
        return _tensor_bytes(args[0]) * int(args[1])
    return _tensor_bytes(args[0])


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2():
    """glibc's mallinfo2, or None where it does not exist (not glibc, or glibc < 2.33)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def heap_in_use() -> int:
    """Bytes the process has allocated with malloc and not freed, over all threads (torch's CPU
    tensors are malloc'd), or 0 where glibc's mallinfo2 is unavailable."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return 0
    info = mallinfo2()
    return info.uordblks + info.hblkhd  # heap chunks in use + mmap'd chunks (large tensors)


def step_probe():
    """A TorchDispatchMode over one step: counts c10d and functional collectives, and samples
    the heap in use before and after every op (built lazily: it needs torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class StepProbe(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict[str, int] = {}
            self.bytes: dict[str, int] = {}
            self.peak_heap = heap_in_use()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace = func.namespace
            name = func._schema.name.split("::")[-1]
            if namespace == "c10d" or (namespace.endswith("c10d_functional") and name != "wait_tensor"):
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + collective_bytes(namespace, name, args)
            self.peak_heap = max(self.peak_heap, heap_in_use())
            out = func(*args, **(kwargs or {}))
            self.peak_heap = max(self.peak_heap, heap_in_use())
            return out

    return StepProbe()


def wrap_peak(wrap):
    """(the highest heap in use while `wrap()` runs, above the heap in use before it; what it
    returned): a wrap's peak growth, sampled around every op as a step's."""
    import gc

    gc.collect()
    before = heap_in_use()
    probe = step_probe()
    with probe:
        result = wrap()
    return probe.peak_heap - before, result
