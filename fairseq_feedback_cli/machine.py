"""What this machine can take, for the numeric options of this project's tools.

A value past it crashed rather than failed: `feedback-benchmark --threads
100000` ended in a segmentation fault (OpenMP's threads), a data script's
--workers would start as many processes, and a toy task's episode longer
than memory holds filled it before anything was written. Each is refused
before the work, in the range vocabulary of the other options (`must be in
[1, 2] (the CPU cores this process may use), got 100000`), with the limit
read from the machine. Checked here, not by the plugin's option_ranges.py:
the data scripts check theirs and must not load the plugin (fairseq's
start-up, about 3 s, and the line fairseq logs as it loads, which would
come before a one-line error).
"""

import os

from .command_line import fail

CORES = "the CPU cores this process may use"
# numpy's seeds: fairseq hands --seed to np.random.seed, which refuses any other (in numpy's compiled
# code, which fairseq_feedback/fairseq_fixes/origin.py counts as fairseq's, said in one line)
SEEDS = (0, 2 ** 32 - 1, "the seeds numpy and fairseq take")


def cores() -> int:
    """The CPU cores this process may run on (its affinity, as taskset and a job scheduler set it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def memory_available() -> int:
    """The bytes of memory a new allocation can take without swapping: Linux's MemAvailable, else all
    physical memory."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def in_memory(bytes_each: int, what_fits: str):
    """(1, the most items of `bytes_each` bytes that the available memory holds, why): a range of
    check_within; `what_fits`: as 'the streams that fit'."""
    available = memory_available()
    return 1, max(1, available // bytes_each), f"{what_fits} in the {available / 1e9:.1f} GB of memory available"


def check_within(args, **ranges) -> None:
    """Each option named (as its attribute), absent, unset or in its range: (lowest, highest, why the
    highest), the highest being what this machine takes."""
    for name, (low, high, why) in ranges.items():
        value = getattr(args, name, None)
        if value is not None and not low <= value <= high:
            fail(f"--{name.replace('_', '-')} must be in [{low}, {high:,}] ({why}), got {value}")
