"""The feedback models' CUDA graphs, as the benchmark sees them: their figures (the model's
graph_statistics), and the loop run as --cuda-graphs says for a while (eagerly, or as a GPU
replays it through the stand-in)."""

import contextlib
from typing import Optional

import torch

from fairseq_feedback.models.feedback_decoder import FeedbackDecoder


def graph_statistics(model):
    """The figures of the feedback loop's CUDA graphs (or of the stand-in's), or None: graphs off, or not
    started, or a model without them (fairseq's)."""
    statistics = getattr(model, "graph_statistics", None)
    return None if statistics is None else statistics()


def graphs_captured(model) -> int:
    statistics = graph_statistics(model)
    return 0 if statistics is None else statistics.captured


def awaiting_capture(model) -> bool:
    """Whether the model's graphs run but have captured nothing yet: a shape is captured at its second sighting."""
    statistics = graph_statistics(model)
    return statistics is not None and statistics.captured == 0 and statistics.failed is None


def graphs_run(device: torch.device, cuda_graphs: str) -> bool:
    """Whether the feedback models replay their loop as graphs: on a GPU, or through the stand-in."""
    return cuda_graphs == "emulate" or (cuda_graphs == "auto" and device.type == "cuda")


def feedback_loop_in_mode(model, mode: str):
    """Within, a feedback decoder's loop runs as --cuda-graphs `mode` says
    ("off", "emulate"; a cache of its own), then as before. Other models
    run as they are."""
    if not isinstance(model.decoder, FeedbackDecoder):
        return contextlib.nullcontext()
    return model.decoder.cuda_graphs_in_mode(mode)


def loop_as_a_gpu_replays_it(model):
    """A feedback decoder that would replay its loop as CUDA graphs on a GPU
    (--cuda-graphs auto) runs it through the graphs' path with the stand-in
    for capture (bucketed shapes, weight gradients once per block): on the
    CPU, the operators a GPU would replay rather than those of the eager
    loop. A model with graphs off, or already through the stand-in, runs as
    it is."""
    if not isinstance(model.decoder, FeedbackDecoder) or model.decoder.cuda_graphs_mode != "auto":
        return contextlib.nullcontext()
    return model.decoder.cuda_graphs_in_mode("emulate")


def graphs_state(model) -> Optional[tuple]:
    """The model's graphs captured and the eager passes they made (None: no graphs)."""
    statistics = graph_statistics(model)
    return None if statistics is None else (statistics.captured, statistics.eager_passes)
