"""What the CUDA backend needs of torch beyond its public API, looked up by
name, never by version number: any torch from 2.6 on is accepted, and these
private calls have been renamed between releases. Where one is missing,
CUDA graphs stay off in the process (said once in the log) and the loop
runs eagerly, with the same numbers.

Everything else the graphs use (torch.cuda.CUDAGraph, graph_pool_handle,
torch.utils._python_dispatch's modes and stack) has the same names in every
torch the core tests ran under (docs/install.md: 2.6, 2.13, 2.15).
"""

from typing import Callable, Optional

import torch

# torch._C's call that stops routing a device's allocations to a graph pool, by its names from
# the newest torch back (renamed in torch 2.8: 2.6 has only the second, 2.13 and 2.15 the first)
END_ALLOCATING_TO_POOL = ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool")


def end_allocating_to_pool() -> Optional[Callable[[int, tuple], None]]:
    """fn(device index, pool handle), or None if this torch has none of its names."""
    for name in END_ALLOCATING_TO_POOL:
        fn = getattr(torch._C, name, None)
        if fn is not None:
            return fn
    return None


def cuda_graphs_unsupported(generator: torch.Generator) -> Optional[str]:
    """Why CUDA graphs cannot run safely with this torch, in one line, or None.
    Each call missing would leave a device unusable after a failed capture:
    the generator that dropout draws from stuck in capture mode, the pool
    still taking the device's allocations, or the pool never released."""
    missing = [name for name, present in (
        ("Generator.graphsafe_set_state", hasattr(generator, "graphsafe_set_state")),
        (f"torch._C.{END_ALLOCATING_TO_POOL[0]}", end_allocating_to_pool() is not None),
        ("torch._C._cuda_releasePool", hasattr(torch._C, "_cuda_releasePool")),
    ) if not present]
    if not missing:
        return None
    return (f"torch {torch.__version__} lacks {', '.join(missing)}, which recovering from a failed capture needs; "
            "CUDA graphs stay off in this process")
