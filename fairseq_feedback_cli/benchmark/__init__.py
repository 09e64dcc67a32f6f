"""feedback-benchmark: the feedback models' speed as a ratio to fairseq's own models of the same
size. Its --help (cli.py's docstring) says what it measures; docs/performance.md, how to read it.

    cli.py            main: the options, the tables run, --json
      +-- tables.py       translation and language_model: each pair's table, the ratios, the
      |                   figures beside them (profile_columns), printed and returned
      +-- breakdown.py    --breakdown: operators per target step by kind, in the loop and per layer
      |
      +-- workloads.py    the models of each pair (through the builders), their batches, and their
      |                   calls: training steps as fairseq-train takes them, evaluation, search
      +-- measure.py      calls timed in turns, results checked to be finite, peak memory by model
      +-- operators.py    operators (CPU) or kernels (GPU) per target step, as a GPU replays the loop
      +-- graphs.py       the feedback models' CUDA graphs: their figures, the loop run in a mode
"""

from .cli import main

__all__ = ["main"]
