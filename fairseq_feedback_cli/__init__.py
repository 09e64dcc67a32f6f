"""The project's tools, apart from the plugin (as fairseq keeps fairseq_cli apart from fairseq):
feedback-benchmark, feedback-score, feedback-average-checkpoints, feedback-evaluate-toy, the
learning curves and the demo. Importing this package imports nothing else, so that the data
scripts (data_prep) share its helpers without fairseq's start-up time."""
