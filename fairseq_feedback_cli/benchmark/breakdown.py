"""--breakdown: where the feedback models' operators are, per target step of a training step, by
kind, forward and backward, in the loop and per layer."""

import torch

from ..builders import make_dictionary
from ..presets import PRESETS
from .operators import counted_as_a_gpu_replays_it
from .workloads import (build_language_model, build_translation_model, consecutive_blocks, language_model_pairs,
                        random_tokens, stream_blocks, training_step, translation_training, with_the_reference_loop)


BREAKDOWN_ROWS = 8  # the count does not depend on the rows: few, to be quick


def operator_breakdown(title, build, training, layers, steps):
    """A training step's operators per target step (a position of every
    row), by phase and kind, counted as the ops/step column counts them.
    The loop's share per step comes from blocks of `steps` and 2 x steps
    (buckets apart), per layer from `layers` and layers - 1 layers.
    `build(layers)`: a model; `training(model, steps)`: its training step."""
    counts = {}
    for shape in ((layers, steps), (layers, 2 * steps), (layers - 1, steps)):
        model = build(shape[0])
        counts[shape] = counted_as_a_gpu_replays_it(model, training(model, shape[1])).kinds
    full, double, fewer = counts[layers, steps], counts[layers, 2 * steps], counts[layers - 1, steps]

    def per_step(phase, kind):
        return (double[phase][kind] - full[phase][kind]) / steps

    kinds = sorted({k for phase in ("forward", "backward") for k in double[phase]},
                   key=lambda k: -sum(per_step(ph, k) for ph in ("forward", "backward")))
    print(title)
    print(f"{'operator':44s}{'forward':>10s}{'backward':>10s}{'per layer':>11s}")
    loop = {ph: 0.0 for ph in ("forward", "backward")}
    for kind in kinds:
        step = [per_step(ph, kind) for ph in ("forward", "backward")]
        layer = sum((full[ph][kind] - fewer[ph][kind]) / steps for ph in ("forward", "backward"))
        if max(abs(v) for v in (*step, layer)) >= 0.05:
            print(f"{kind:44s}{step[0]:10.1f}{step[1]:10.1f}{layer:11.1f}")
        loop["forward"] += step[0]
        loop["backward"] += step[1]
    total = {ph: sum(full[ph].values()) / steps for ph in ("forward", "backward", "optimizer")}
    print(f"{'in the loop, per step':44s}{loop['forward']:10.1f}{loop['backward']:10.1f}")
    print(f"{'outside the loop, per target step':44s}{total['forward'] - loop['forward']:10.1f}"
          f"{total['backward'] - loop['backward']:10.1f}")
    print(f"{'optimizer (Adam), per target step':44s}{total['optimizer']:20.1f}")
    print(f"{'total per target step (ops/step)':44s}{sum(total.values()):20.1f}\n")


def breakdown(which, preset, seed, reference_loop):
    """--breakdown: where the feedback models' operators are (with
    `reference_loop`, with the reference loop)."""
    loop = with_the_reference_loop if reference_loop else (lambda model: model)
    which_loop = ", the reference loop" if reference_loop else ""
    if which in (None, "translation"):
        p = PRESETS[preset]["translation"]
        dictionary = make_dictionary(p["vocab"])

        def training(model, steps):
            g = torch.Generator().manual_seed(seed)
            return translation_training(model, dictionary, *(random_tokens(dictionary, BREAKDOWN_ROWS, steps, g)
                                                             for _ in range(2)))

        operator_breakdown(
            f"operators per target step of a training step, feedback_transformer d={p['embed_dim']} "
            f"ffn={p['ffn_dim']} heads={p['heads']} layers={p['layers']}+{p['layers']}, {p['length']} target steps"
            + which_loop,
            lambda layers: loop(build_translation_model("feedback_transformer", dict(p, layers=layers), dictionary,
                                                        seed)),
            training, p["layers"], p["length"])
    if which in (None, "lm"):
        p = PRESETS[preset]["lm"]
        dictionary = make_dictionary(p["vocab"])
        (_, arch, extra), = [pair for pair in language_model_pairs(p) if pair[1] == "feedback_lm"]

        def training(model, steps):
            blocks = stream_blocks(dictionary, BREAKDOWN_ROWS, steps, torch.Generator().manual_seed(seed), "cpu")
            return training_step(model, *consecutive_blocks(model, blocks))

        operator_breakdown(
            f"operators per target step of a training step, feedback_lm d={p['embed_dim']} ffn={p['ffn_dim']} "
            f"heads={p['heads']} layers={p['layers']}, blocks of {p['block']} (span {p['span']}, memory carried)"
            + which_loop,
            lambda layers: loop(build_language_model(arch, dict(p, layers=layers), dictionary, seed, extra)),
            training, p["layers"], p["block"])
