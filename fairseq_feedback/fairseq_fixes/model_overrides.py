"""--model-overrides at inference: a model its parameters fit is read, and said; any other is refused.

fairseq-generate, -eval-lm, -interactive and -validate build the model a
checkpoint records, with --model-overrides, and load the parameters into
it. An option that changes the parameters' shapes (a depth, a width, the
span of learned relative positions) makes a model they do not fit: fairseq
fails deep in load_state_dict, or, for one that adds no parameter, loads
them into another model without a word. One that keeps their shapes (the
span of a decoder without relative positions, an activation) is a
legitimate experiment: decoding or scoring the trained parameters in
another model. Which is which is found by building the model as asked, on
torch's meta device (no memory, no computation), and comparing its
parameters with the checkpoint's, whatever the option and the model.
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
    """`changed`: (name, trained value, asked value) of the options of the
    model that --model-overrides changes, beyond what training may change
    when it continues; `recorded`: what the checkpoint records
    (checkpoints.recorded_configuration); `data`: the tool's data directory."""
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
    """The checkpoint's parameters (and the model's) that do not fit the model
    that `overrides` make of the one it records, as 'NAME: SHAPE in the
    checkpoint, SHAPE asked', at most three."""
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
