"""The project's tools, apart from the plugin (as fairseq keeps fairseq_cli apart from fairseq):
feedback-benchmark, feedback-score, feedback-average-checkpoints, feedback-evaluate-toy,
feedback-gpu-check, the learning curves and the demo; and the data preparation (data_prep/, one
script per dataset).

The tools and the data scripts share only modules that import nothing else of this project
(command_line, outputs, sgm, presets, toy/scoring): a tool imports no other tool and no data script
(feedback-gpu-check runs them as commands), and a data script no tool. Importing this package
imports nothing, so that the data scripts start without fairseq's start-up time."""
