"""Speed of the feedback models as a ratio to fairseq's transformer of the same size.

    feedback-benchmark                      # base widths, 6+6 layers, ~4k-token batches
    feedback-benchmark --preset tiny        # seconds, to check that it runs

Both models are built through fairseq's own registry from the same options and
timed in the same process on the same random batches, so the ratios compare
the architectures, not the machines. Reports training target tokens/s,
beam-search output tokens/s and the incremental state's bytes per decoded token.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from fairseq import options
from fairseq.data import Dictionary
from fairseq.sequence_generator import SequenceGenerator
from fairseq.tasks.translation import TranslationTask

import fairseq_feedback  # noqa: F401  (registers the models)

PRESETS = {
    # the target setting: base widths, 6-layer decoder, batches of ~4k tokens
    "base": dict(embed_dim=512, ffn_dim=2048, heads=8, layers=6, batch=128, length=32, vocab=10000,
                 beam_batch=128, train_steps=3),
    "tiny": dict(embed_dim=32, ffn_dim=64, heads=2, layers=2, batch=8, length=8, vocab=100,
                 beam_batch=2, train_steps=2),
}


def build_translation_model(arch, preset, dictionary, extra=()):
    p = preset
    sizes = []
    for side in ("encoder", "decoder"):
        sizes += [f"--{side}-embed-dim", str(p["embed_dim"]), f"--{side}-ffn-embed-dim", str(p["ffn_dim"]),
                  f"--{side}-attention-heads", str(p["heads"]), f"--{side}-layers", str(p["layers"])]
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(
        parser, ["unused", "--task", "translation", "--arch", arch, "--dropout", "0.1", *sizes, *extra]
    )
    return TranslationTask(args, dictionary, dictionary).build_model(args)


def random_batch(dictionary, batch, length, generator):
    tokens = torch.randint(dictionary.nspecial, len(dictionary), (batch, length), generator=generator)
    prev = torch.cat([torch.full((batch, 1), dictionary.eos()), tokens[:, :-1]], dim=1)
    return tokens, prev


def training_tokens_per_second(model, dictionary, preset, generator):
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    src, _ = random_batch(dictionary, preset["batch"], preset["length"], generator)
    target, prev = random_batch(dictionary, preset["batch"], preset["length"], generator)
    src_lengths = torch.full((preset["batch"],), preset["length"])

    def step():
        optimizer.zero_grad()
        logits, _ = model(src, src_lengths, prev)
        F.cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1)).backward()
        optimizer.step()

    step()  # warm-up: allocator and lazily built buffers
    start = time.perf_counter()
    for _ in range(preset["train_steps"]):
        step()
    return target.numel() * preset["train_steps"] / (time.perf_counter() - start)


@torch.no_grad()
def beam_tokens_per_second(model, dictionary, preset, generator, beam=5):
    model.eval()
    length = preset["length"]
    # min_len = max_len: every hypothesis runs the full length, random weights or not
    search = SequenceGenerator([model], dictionary, beam_size=beam, max_len_a=0, max_len_b=length, min_len=length)
    src, _ = random_batch(dictionary, preset["beam_batch"], length, generator)
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.full((len(src),), length)}}
    search.generate([model], sample)  # warm-up
    start = time.perf_counter()
    hypos = search.generate([model], sample)
    elapsed = time.perf_counter() - start
    return sum(len(h[0]["tokens"]) for h in hypos) / elapsed


def tensor_bytes(state) -> int:
    storages = {}
    for entries in state.values():
        for value in entries.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@torch.no_grad()
def state_bytes_per_token(model, dictionary, preset, generator, beam=5):
    """Bytes of the incremental state per decoded token and hypothesis, after
    `length` steps and a beam reorder (which every beam-search step does),
    laid out as beam search lays out hypotheses."""
    model.eval()
    sentences, length = preset["beam_batch"], preset["length"]
    rows = sentences * beam
    src, _ = random_batch(dictionary, sentences, length, generator)
    _, prev = random_batch(dictionary, rows, length, generator)
    encoder_out = model.encoder(src.repeat_interleave(beam, 0), torch.full((rows,), length))
    if hasattr(model, "set_beam_size"):
        model.set_beam_size(beam)
    state = {}
    for t in range(length):
        model.decoder(prev[:, : t + 1], encoder_out=encoder_out, incremental_state=state)
    model.decoder.reorder_incremental_state_scripting(state, torch.arange(rows))
    return tensor_bytes(state) / (rows * length)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    dictionary = Dictionary()
    for i in range(preset["vocab"] - dictionary.nspecial):
        dictionary.add_symbol(f"w{i}")

    rows = []
    for name, arch in [("transformer", "transformer"), ("feedback_transformer", "feedback_transformer")]:
        torch.manual_seed(args.seed)
        model = build_translation_model(arch, preset, dictionary)
        generator = torch.Generator().manual_seed(args.seed)
        rows.append((
            name,
            training_tokens_per_second(model, dictionary, preset, generator),
            beam_tokens_per_second(model, dictionary, preset, generator),
            state_bytes_per_token(model, dictionary, preset, generator),
        ))

    p = preset
    print(f"translation, {args.preset}: d={p['embed_dim']} ffn={p['ffn_dim']} heads={p['heads']} "
          f"layers={p['layers']}+{p['layers']}, train batch {p['batch']}x{p['length']} tokens, "
          f"beam 5 over {p['beam_batch']} sentences of {p['length']} tokens, {torch.get_num_threads()} threads")
    print(f"{'model':24s}{'train tok/s':>14s}{'beam-5 tok/s':>14s}{'state B/token':>15s}")
    for name, train, beam, state in rows:
        print(f"{name:24s}{train:14.1f}{beam:14.1f}{state:15.0f}")
    (_, t_train, t_beam, t_state), (_, f_train, f_beam, f_state) = rows
    print(f"{'feedback / transformer':24s}{f_train / t_train:14.2f}{f_beam / t_beam:14.2f}{f_state / t_state:15.2f}")


if __name__ == "__main__":
    main()
