"""--model-overrides at inference: a model the checkpoint's parameters fit is read, and said; any other
is refused.

An override that changes the parameters' shapes (a depth, a width, the span of learned relative
positions) made fairseq fail deep in load_state_dict, or, adding no parameter, load them into another
model without a word; one that keeps them (the span of a decoder without relative positions) is a
legitimate experiment. Which is which: the model asked for is built on torch's meta device (no memory)
and its parameters' shapes compared with the checkpoint's.
"""

import argparse
import copy
import logging

import torch
from fairseq import tasks
from omegaconf import OmegaConf, open_dict

from .. import checkpoint_files
from ..errors import FeedbackUsageError

logger = logging.getLogger(__name__)


def check_overridden_model(checkpoint: str, recorded, data, changed) -> None:
    """`changed`: (name, trained value, asked value) of what --model-overrides changes beyond MAY_CHANGE;
    `recorded`: checkpoints.recorded_configuration's; `data`: the tool's data directory."""
    was = ", ".join(f"{name} {value}" for name, value, _ in changed)
    now = ", ".join(f"{name} {value}" for name, _, value in changed)
    misfits = parameters_that_do_not_fit(checkpoint, recorded, data, {name: value for name, _, value in changed})
    if misfits:
        raise FeedbackUsageError(f"--model-overrides changes the model {checkpoint} holds (trained with {was}; asked "
                                 f"for {now}), and its parameters do not fit the model asked for ({'; '.join(misfits)})"
                                 ": drop those; what may change is what keeps the parameters' shapes")
    logger.warning(f"{checkpoint} was trained with {was} and is read with {now} (--model-overrides): its parameters "
                   "fit, and this model computes with them as it was never trained to; what it measures is that "
                   "experiment, not the trained model")


def parameters_that_do_not_fit(checkpoint: str, recorded, data, overrides: dict) -> list:
    """'NAME: SHAPE in the checkpoint, SHAPE asked' for the parameters that differ (three, then a count)."""
    trained = {name: tuple(value.shape) for name, value in checkpoint_files.read(checkpoint)["model"].items()}
    task = tasks.setup_task(_with(recorded.task, data=data))
    with torch.device("meta"):  # the shapes, without the memory
        model = task.build_model(_with(recorded.model, **overrides))
    asked = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    misfits = [name for name in sorted(trained.keys() | asked.keys()) if trained.get(name) != asked.get(name)]
    return [f"{name}: {_shape(trained.get(name))} in the checkpoint, {_shape(asked.get(name))} asked"
            for name in misfits[:3]] + ([f"{len(misfits) - 3} more"] if len(misfits) > 3 else [])


def _shape(shape) -> str:
    return "none" if shape is None else "x".join(map(str, shape)) or "a scalar"


def _with(options, **values):
    """A copy of a section of a checkpoint's configuration (a dict, or an argparse Namespace) with `values`."""
    if isinstance(options, argparse.Namespace):
        options = copy.copy(options)
        for name, value in values.items():
            setattr(options, name, value)
        return options
    options = OmegaConf.create(dict(options))
    with open_dict(options):
        for name, value in values.items():
            options[name] = value
    return options
