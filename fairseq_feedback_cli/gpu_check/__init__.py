"""feedback-gpu-check: the CUDA-graph path checked and measured on a GPU within --minutes, its
steps in the order that gets a short lease the most important answers first, each step's
figures into one report. What it runs and how it ends: cli.py's docstring (its --help); how
to read the report: docs/gpu-check.md.

    cli.py            main: the options; STEPS, each with its estimate; each step run, or skipped
      |               for time; the report's folder, which appears whole; the exit status
      +-- check.py        Check: one run's options, folder, deadline and records, and its
      |                   report (report.md, report.json); Step; what a step finds (Outcome) or
      |                   why it failed (StepFailed, OutOfTime); Command, a module run as a
      |                   child process and stopped at the deadline
      +-- machine.py      describe_machine: the card(s) (nvidia-smi), driver, torch, CUDA, commit
      +-- sizes.py        the sizes each step runs at (--size full or tiny); the losses' tolerance
      |
      |  the steps, each a function of the Check that returns an Outcome or raises StepFailed:
      +-- gpu_tests.py    1   pytest -m gpu, from the checkout
      +-- training.py     2   fairseq-train with graphs and without, fp32 and fp16: the losses
      +-- speed.py        3a, 3b feedback-benchmark's tables; 3c fairseq-eval-lm's tokens/s
      +-- two_ranks.py    4   two ranks with graphs against one rank with twice the batch
      +-- corpora.py      the synthetic corpora they train on, binarized by fairseq-preprocess

The steps run fairseq's tools and feedback-benchmark as commands (python -m, under the
Python that runs the check): a command that fails fails its step with its log's error line,
and the later steps still run.
"""
