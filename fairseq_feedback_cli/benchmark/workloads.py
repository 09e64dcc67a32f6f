"""What the benchmark runs: the models of each pair, built through the builders as fairseq-train
builds them, their batches, and their calls (a training step as fairseq-train takes it in the
model's dtype, an evaluation, a search), each returning the tokens it processed and a result to
check."""

import contextlib
import logging
from typing import List, Optional

import torch
import torch.nn.functional as F
from fairseq.optim import FP16Optimizer
from fairseq.sequence_generator import SequenceGenerator
from torch import Tensor

from fairseq_feedback.loop.passes import Passes

from .. import builders
from ..builders import size_flags
from .graphs import feedback_loop_in_mode, graphs_run
from .measure import PeakMemory

logger = logging.getLogger(__name__)


BEAM = 5
LEARNING_RATE = 1e-4


def random_tokens(dictionary, rows, length, generator):
    """Drawn on the generator's device (the CPU): the same tokens whatever device they are moved to."""
    return torch.randint(dictionary.nspecial, len(dictionary), (rows, length), generator=generator,
                         device=generator.device)


def shifted(dictionary, tokens):
    return torch.cat([tokens.new_full((len(tokens), 1), dictionary.eos()), tokens[:, :-1]], dim=1)


def build_translation_model(arch, p, dictionary, seed, extra=()):
    sizes = size_flags("encoder", p["embed_dim"], p["ffn_dim"], p["heads"], p["layers"]) + \
        size_flags("decoder", p["embed_dim"], p["ffn_dim"], p["heads"], p["layers"])
    return builders.translation_model(arch, [*sizes, "--dropout", "0.1", *extra], dictionary, seed=seed)


LM_TASKS = {"transformer_lm": "language_modeling", "feedback_lm": "feedback_language_modeling"}


def build_language_model(arch, p, dictionary, seed, extra=()):
    flags = ["--tokens-per-sample", p["block"], "--decoder-input-dim", p["embed_dim"],
             "--decoder-output-dim", p["embed_dim"], "--dropout", "0.1",
             *size_flags("decoder", p["embed_dim"], p["ffn_dim"], p["heads"], p["layers"]), *extra]
    return builders.language_model(arch, LM_TASKS[arch], flags, dictionary, seed=seed)[0]


def language_model_pairs(p):
    """(name, architecture, options) of the two language models compared."""
    head_dim = ["--head-dim", str(p["head_dim"])] if "head_dim" in p else []
    return [("transformer_lm", "transformer_lm", ["--decoder-normalize-before"]),
            ("feedback_lm", "feedback_lm",
             ["--memory-span", str(p["span"]), *head_dim, *p.get("feedback_options", [])])]


def models(pairs, build, device, dtype, cuda_graphs: str, reference_loop: bool = False,
           memory: Optional[PeakMemory] = None, eager_too: bool = True, passes: Optional[Passes] = None):
    """Each (name, architecture, options) built on `device` in `dtype`, the
    feedback models with `--cuda-graphs cuda_graphs`; where their graphs
    run and `eager_too`, each feedback model also as it runs without them; with
    `passes`, each feedback model also trained in passes (--train-passes,
    --pass-group; in_passes names it); with `reference_loop`, each feedback
    model also with the reference loop. `memory`: where each model's weights
    are counted."""
    pairs = [(name, arch, [*extra, "--cuda-graphs", cuda_graphs] if arch.startswith("feedback") else extra)
             for name, arch, extra in pairs]
    feedback = [(name, arch, extra) for name, arch, extra in pairs if arch.startswith("feedback")]
    if eager_too and graphs_run(device, cuda_graphs):
        pairs += [(f"{name} (eager)", arch, [*extra, "--no-cuda-graphs"]) for name, arch, extra in feedback]
    if passes is not None:
        pairs += [(in_passes(name, passes), arch, [*extra, "--train-passes", passes.passes, "--pass-group",
                                                   passes.group]) for name, arch, extra in feedback]

    def on_the_device(name, arch, extra):
        with (memory or PeakMemory()).charged(name):
            return build(arch, extra).to(device=device, dtype=dtype)

    built = {name: on_the_device(name, arch, extra) for name, arch, extra in pairs}
    if reference_loop:
        for name, arch, extra in feedback:
            name = f"{name} (reference loop)"
            built[name] = with_the_reference_loop(on_the_device(name, arch, extra))
    return built


def in_passes(name: str, passes: Passes) -> str:
    """The row of the feedback model `name` trained in `passes`, group by passes: "feedback_lm (passes 16x4)"."""
    return f"{name} (passes {passes.group}x{passes.passes})"


def trained_in_passes(model) -> bool:
    """Whether a training step of `model` computes its blocks in passes (FeedbackDecoder.train_in_passes)."""
    return getattr(model.decoder, "passes", None) is not None


def with_the_reference_loop(model):
    """`model` with its feedback loop step by step through autograd, as
    before the fused block (--reference-loop): what the fused block saves."""
    model.decoder.use_fused_block(False)
    return model


class TorchAdam:
    """fp32: torch's Adam steps the parameters."""

    def __init__(self, params: List[Tensor]):
        self.adam = torch.optim.Adam(params, lr=LEARNING_RATE)

    def zero_grad(self):
        self.adam.zero_grad()

    def backward(self, loss: Tensor):
        loss.backward()

    def step(self):
        self.adam.step()


class FairseqMixedPrecision:
    """fp16 and bf16 as `fairseq-train --fp16` / `--bf16` train: fairseq's
    FP16Optimizer keeps fp32 master weights for fairseq's Adam (a plain Adam
    over fp16 weights turns them NaN at once: eps 1e-8 is 0 in fp16) and,
    for fp16, scales the loss dynamically. Each step first takes the
    gradients' norm as fairseq-train does (--clip-norm 0: no clipping), and
    a step whose fp16 gradients overflowed is skipped, the scale lowered."""

    def __init__(self, params: List[Tensor], dtype: torch.dtype):
        flags = ["--optimizer", "adam", "--lr", LEARNING_RATE, "--fp16" if dtype == torch.float16 else "--bf16"]
        if params[0].device.type != "cuda":
            flags.append("--fp16-no-flatten-grads")  # fairseq flattens the fp32 copy onto the current CUDA device
        self.optimizer = FP16Optimizer.build_optimizer(builders.training_config(flags), params)

    def zero_grad(self):
        self.optimizer.zero_grad()

    def backward(self, loss: Tensor):
        self.optimizer.backward(loss)

    def step(self):
        try:
            self.optimizer.clip_grad_norm(0.0)
        except OverflowError as overflow:
            logger.info(f"gradient overflow, step skipped: {overflow}")
            return
        self.optimizer.step()


def optimizer_for(model):
    params = [p for p in model.parameters() if p.requires_grad]
    return TorchAdam(params) if params[0].dtype == torch.float32 else FairseqMixedPrecision(params, params[0].dtype)


def training_step(model, forward, target, optimizer=None):
    """One optimizer step on `forward()`'s logits, as fairseq-train takes it
    in the model's dtype (with `optimizer`, or one of its own); returns the
    target tokens and the loss. `ops`: an operators.CountOps that counts its phases apart."""
    optimizer = optimizer or optimizer_for(model)

    def work(ops=None):
        phase = (lambda name: contextlib.nullcontext()) if ops is None else ops.phase
        model.train()
        optimizer.zero_grad()
        with phase("forward"):
            logits = forward()
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target().reshape(-1))
        with phase("backward"):
            optimizer.backward(loss)
        with phase("optimizer"):
            optimizer.step()
        return target().numel(), loss.detach()

    return work


def translation_training(model, dictionary, src, target, optimizer=None):
    """A training step on the pairs (src, target), [rows, tokens] each."""
    return translation_training_on(model, dictionary, [(src, target)], optimizer)


def translation_training_on(model, dictionary, batches, optimizer=None):
    """A training step on each of `batches` in turn, (src, target) pairs of [rows, tokens] each."""
    turns, batch = iter(range(10**9)), {}

    def forward():
        batch["src"], batch["target"] = batches[next(turns) % len(batches)]
        lengths = torch.full((len(batch["src"]),), batch["src"].size(1), device=batch["src"].device)
        return model(batch["src"], lengths, shifted(dictionary, batch["target"]))[0]

    return training_step(model, forward, lambda: batch["target"], optimizer)


def max_tokens_batches(dictionary, p, count, generator, device):
    """`count` pairs of (src, target) batches as fairseq's --max-tokens makes
    them: about p["batch"] x p["length"] tokens each, the length of each
    drawn between half and one and a half times p["length"] (fairseq
    batches sentences of about one length), the rows filling the tokens."""
    tokens, batches = p["batch"] * p["length"], []
    for _ in range(count):
        length = int(torch.randint(p["length"] // 2, p["length"] * 3 // 2 + 1, (1,), generator=generator))
        batches.append(tuple(random_tokens(dictionary, max(1, tokens // length), length, generator).to(device)
                             for _ in range(2)))
    return batches


def consecutive_blocks(model, blocks):
    """forward() and target() of consecutive blocks of the same streams, each
    call the next block, the memory carried where the model carries one."""
    counter, state = iter(range(10**9)), {"k": 0}

    def forward():
        state["k"] = next(counter) % (len(blocks) - 1)
        stream = {"stream": "benchmark", "block_index": state["k"]} if hasattr(model, "streams") else {}
        return model(blocks[state["k"]], **stream)[0]

    def target():
        return blocks[state["k"] + 1]

    return forward, target


def stream_blocks(dictionary, streams, block, generator, device):
    return random_tokens(dictionary, streams, block * 64, generator).to(device).split(block, dim=1)


def generation(model, dictionary, sample, length, **kwargs):
    """Beam search or sampling of `length` tokens per sequence (min = max, so
    that every hypothesis runs the full length whatever the weights)."""
    generator = SequenceGenerator([model], dictionary, max_len_a=0, max_len_b=length, min_len=length, **kwargs)

    @torch.no_grad()
    def work():
        model.eval()
        hypos = generator.generate([model], sample, prefix_tokens=sample.get("prefix_tokens"))
        return sum(len(nbest[0]["tokens"]) for nbest in hypos), torch.stack([nbest[0]["score"] for nbest in hypos])

    return work


def tensor_bytes(state) -> int:
    storages = {}
    for entries in state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    return sum(storages.values())


@torch.no_grad()
def state_bytes_per_token(model, encoder_out, prev):
    """Bytes of the incremental state per decoded token and hypothesis after
    decoding `prev` and one beam reorder (which every beam-search step does),
    on the model's device and in its dtype. Decoded eagerly: with CUDA
    graphs, the memory's keys and values are kept in a ring of fixed shape
    outside the incremental state instead (static_memory.py)."""
    model.eval()
    if hasattr(model, "set_beam_size"):  # as SequenceGenerator does
        model.set_beam_size(BEAM)
    state = {}
    with feedback_loop_in_mode(model, "off"):
        for t in range(prev.size(1)):
            model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
        model.decoder.reorder_incremental_state_scripting(state, torch.arange(len(prev), device=prev.device))
    return tensor_bytes(state) / prev.numel()
