"""The toy tasks of Table 1 (Fan et al. 2020), scored: feedback-evaluate-toy (evaluate.py), a
checkpoint's predictions streamed through its task (predictions.py), Table 1's metrics
(scoring.py). The data script that writes the tasks is data_prep/toy_tasks.py; it shares
scoring.py, and so this package imports nothing."""
