"""Functions of fixed-shape tensors replayed as CUDA graphs, forward and
backward, each checked against the eager computation, the eager path taken
if anything fails. General code: it imports nothing of this project, and a
caller hands it a function, its inputs, its parameters and a shape key (as
torch.cuda.make_graphed_callables takes a callable and sample arguments).

    GraphCache(key, fn, inputs, params)          graph_cache.py: graphs by shape key, bounded in number
        |                                        and bytes; a key's first sighting runs eagerly, its
        |                                        second captures; gives up at the first failure
        +-- CacheStatistics                      statistics.py: the hit rate, and the line the log shows;
        |                                        GraphStatistics, the cache's figures (GraphCache.summary)
        +-- PoolLedger                           pool_ledger.py: the pool's replays, and the forward that
        |     |                                  awaits its backward (then every call runs eagerly)
        |     +-- StaticBuffers                  static_buffers.py: the static inputs and output gradients,
        |                                        one set that every graph of the cache shares
        |
        +-- GraphedFunction(fn, ...)             graphed_function.py: one function's graphs, captured at
              |  then graphed(fn, *inputs)       construction (collector paused), replayed at each call,
              |                                  the eager result at any failure
              +-- run_pass, Pass                 autograd_pass.py: one run of the function as autograd knows
              |                                  it (captured, or again eagerly): under the caller's autocast
              |                                  (autocast_dtype), through its inputs' aliases; its gradients
              +-- backend.capture / replay       backends.py: CUDA's calls (CudaGraphBackend), or the
              |                                  stand-in that keeps a GPU's rules on any device and
              |                                  counts the pool's bytes as CUDA's allocator keeps them
              |                                  (PoolAccount)
              +-- PoolAccount                    pool_account.py: what a capture leaves in the pool
              +-- EagerChecks.due / judge        checks.py: which checks a call is due, and the verdict
              +-- Replay.apply                   replay.py: a training call as one autograd node, whose
              |     backward -> GraphedFunction.replay_backward    backward replays the backward graph
              +-- stage, GraphFailure            failure.py: any error, named by the stage it came from

    bucket, bucket_wide                          buckets.py: the shapes a caller pads its inputs to

Ownership runs one way: a cache owns its graphs, a graph its function and
static tensors; nothing of a graph points back at its cache or at whoever
owns the cache, so a dropped cache's graphs are freed at once, never by the
cyclic collector in the middle of a later capture.

Memory: graphs of every shape share one pool, and nothing of a graph stays
in it after its capture (its outputs and gradients are views owning no
memory, read before another replay), so the pool holds what one capture
needs, the largest; their static inputs and output gradients are one set,
the largest graph's.
"""

from .autograd_pass import autocast_dtype
from .backends import CudaGraphBackend, RecordedGraphBackend
from .buckets import bucket, bucket_wide
from .failure import GraphFailure
from .graph_cache import GraphCache
from .graphed_function import GraphedFunction
from .statistics import GraphStatistics

__all__ = ["CudaGraphBackend", "GraphCache", "GraphFailure", "GraphStatistics", "GraphedFunction",
           "RecordedGraphBackend", "autocast_dtype", "bucket", "bucket_wide"]
