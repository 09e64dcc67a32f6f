"""A graph that cannot be trusted, and the stage of its life where it failed.

Capture, a replay, or a check's eager computation may fail as a device
fails (out of memory, a host sync inside the function, an operator that
capture refuses); the stage turns any such error into a GraphFailure that
names it, which the graph records and its cache gives up on
(graph_cache.py).
"""

import contextlib


class GraphFailure(Exception):
    """A graph that cannot be trusted: the message says why."""


@contextlib.contextmanager
def stage(name: str):
    """Any error in this stage is a GraphFailure naming it."""
    try:
        yield
    except Exception as e:  # out of memory, a host sync in the loop, an operator capture refuses, ...
        message = str(e).splitlines()[0] if str(e) else ""
        raise GraphFailure(f"{name} failed ({type(e).__name__}: {message})") from e
