"""Functions of fixed-shape tensors replayed as CUDA graphs, forward and
backward, each checked against the eager computation, the eager path taken
if anything fails.

- backends.py: the CUDA calls themselves, and the stand-in that runs the
  same path on any device (--cuda-graphs emulate, and the CPU tests);
- graphed_function.py: one function's graphs, their checks and fallbacks;
- graph_cache.py: graphs by shape, bounded in number and bytes;
- buckets.py: the shapes they are captured at;
- statistics.py: the hit rate, and the line the log shows.
"""

from .backends import CudaGraphBackend, RecordedGraphBackend
from .buckets import bucket, bucket_wide
from .graph_cache import GraphCache
from .graphed_function import GraphedFunction, GraphFailure, autocast_dtype

__all__ = ["CudaGraphBackend", "GraphCache", "GraphFailure", "GraphedFunction", "RecordedGraphBackend",
           "autocast_dtype", "bucket", "bucket_wide"]
