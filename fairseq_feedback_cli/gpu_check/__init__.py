"""feedback-gpu-check: the CUDA-graph path checked and measured on a GPU in one command, within
--minutes: the GPU tests, fairseq-train with graphs and without, the benchmark and fairseq-eval-lm,
two ranks against one, in that order (the most important answers first), into one report. Its
--help (cli.py's docstring) says what each step runs and what the exit status means;
docs/gpu-check.md, how to read the report.

    cli.py            main: the options; STEPS, each with its estimate; each step run, or skipped
      |               for time; the report's folder, which appears whole; the exit status
      +-- check.py        Check: one run's options, folder, deadline and records; Step; what a
      |                   step finds (Outcome) or why it failed (StepFailed, OutOfTime); Command,
      |                   a module run as a child process and stopped at the deadline
      +-- report.py       report.md and report.json as the run stands, rewritten at each step
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
