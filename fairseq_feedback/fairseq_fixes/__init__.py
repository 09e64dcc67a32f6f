"""This plugin's fixes of fairseq, apart from the model: what fairseq's tools get with
--user-dir fairseq_feedback (each fix names the fairseq issue it answers: patches.py). It
imports the core (the models and tasks, their options and checks); the core imports nothing
of it.

    patches.py        apply: every fix, in fairseq's tools; apply_on_import: the one that any
                      program importing the plugin gets (what numpy 2 removed)
    command_line.py   a tool's whole command line, checked before the tool creates anything
                      where fairseq is silent or fails late: the entry, and the order
    option_values.py  option values from the command line: ranges, options that go together,
                      layers to keep, devices and half precision
    binarized_files.py  the data a tool reads: directories, language pair, dictionaries,
                      labels, splits down to fairseq's index header (also as fairseq loads them)
    trained_options.py  a checkpoint against the command line: read and continued as trained
    model_overrides.py  --model-overrides at inference: a model the parameters fit is read and
                      said, any other refused (the model built on torch's meta device)
    checkpoints.py    checkpoints written whole or not at all, resumed from by what they record,
                      a file that is no checkpoint named in one line (checkpoint_files.py)
    one_line.py       the one line that ends a tool on a mistake, instead of a traceback
    origin.py         whose exception it is: fairseq's (one line) or this plugin's (a defect:
                      its traceback), read where it was raised
    runs.py           what a run writes kept whole: its folder held, generate's results moved
                      into place when complete
"""

from .patches import apply, apply_on_import

__all__ = ["apply", "apply_on_import"]
