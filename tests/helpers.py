"""What the tests share: tiny models built through fairseq's options, batches and searches of
them, and fairseq's tools and this project's run in this process on the command lines a user
types (fairseq's own tests/utils.py runs train.main so), or, where a test needs separate
processes, two workers over gloo."""

import contextlib
import importlib
import io
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from fairseq.sequence_generator import SequenceGenerator

import recipe_shims

from fairseq_feedback_cli.data_prep import toy_tasks
from fairseq_feedback.fairseq_fixes import patches
from fairseq_feedback.fairseq_fixes.one_line import one_line
from fairseq_feedback.loop import feedback_loop
from fairseq_feedback.loop.fused_block import FusedFeedbackLoop
from fairseq_feedback.loop.reference import ReferenceLoop
from fairseq_feedback_cli import builders
from fairseq_feedback_cli.builders import size_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(REPO, "fairseq_feedback")
# for the processes a test starts: one thread each, as the machine's cores are shared
ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

# --- tiny models ---------------------------------------------------------------------------------

TINY = dict(embed_dim=16, ffn_dim=32, heads=2)
# a bug that showed only from 11 layers on got through tests at one depth
DEPTHS = {"1 layer": 1, "3 layers": 3, "12 layers": 12}
TARGET_LENGTH = 7


def make_dictionary(size=24):
    return builders.make_dictionary(size)


def tiny_translation_model(*flags, arch="feedback_transformer", dictionary=None, seed=0, layers=3):
    """A small model (a 2-layer encoder, a `layers`-layer decoder) built through
    fairseq's option parsing, as the CLIs build it."""
    dictionary = dictionary or make_dictionary()
    sizes = size_flags("encoder", layers=2, **TINY) + size_flags("decoder", layers=layers, **TINY)
    return builders.translation_model(arch, [*sizes, *flags], dictionary, seed=seed), dictionary


def tiny_lm(*flags, dictionary=None, labels=None, seed=0, layers=3):
    """A small feedback_lm of `layers` layers and its task, built through fairseq's config system."""
    flags = [*size_flags("decoder", layers=layers, **TINY), "--dropout", "0", *flags]
    return builders.language_model("feedback_lm", "feedback_language_modeling", flags,
                                   dictionary or make_dictionary(), output_dictionary=labels, seed=seed)


def with_trained_spans(model):
    """Spans that differ per head and reach less than --memory-span."""
    for layer in model.decoder.layers:
        if layer.self_attn.span_mask is not None:
            heads = layer.self_attn.span_mask.span_fraction
            heads.data = torch.linspace(0.1, 0.4, len(heads))
    return model


class Split:
    """An in-memory split: a list of lines, as fairseq's indexed datasets give them."""

    def __init__(self, lines):
        self.lines = lines
        self.sizes = torch.tensor([len(line) for line in lines]).numpy()

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, i):
        return self.lines[i]


def random_split(dictionary, lines=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(lines):
        n = int(torch.randint(1, 12, (1,), generator=g))
        tokens = torch.randint(dictionary.nspecial, len(dictionary), (n,), generator=g)
        out.append(torch.cat([tokens, torch.tensor([dictionary.eos()])]))
    return Split(out)


def batch(dictionary, rows=3, src_len=5, tgt_len=TARGET_LENGTH):
    src = torch.randint(dictionary.nspecial, len(dictionary), (rows, src_len))
    src[0, :2] = dictionary.pad()  # left padding, as fairseq batches sources
    src_lengths = src.ne(dictionary.pad()).sum(1)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (rows, tgt_len))
    prev[:, 0] = dictionary.eos()
    return src, src_lengths, prev


def loss_and_gradients(model, forward, target):
    logits = forward()
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum")
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_loss_and_gradients(got, expected):
    """Two (loss, gradients) pairs of loss_and_gradients, equal to tolerance."""
    (got_loss, got_grads), (loss, grads) = got, expected
    torch.testing.assert_close(got_loss, loss, atol=1e-5, rtol=1e-5)
    assert got_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(got_grads[name], grads[name], atol=1e-5, rtol=1e-4, msg=name)


def search(model, d, generator_args, sample, seed=0, reorders=None):
    """fairseq's search; `reorders` collects the rows of each reorder."""
    torch.manual_seed(seed)
    generator = SequenceGenerator([model], d, **generator_args)
    if reorders is not None:
        def reorder(state, order, reorder=model.decoder.reorder_incremental_state):
            reorders.append(len(order))
            reorder(state, order)

        model.decoder.reorder_incremental_state = reorder
    try:
        return generator.generate([model], sample, prefix_tokens=sample.get("prefix_tokens"))
    finally:
        model.decoder.__dict__.pop("reorder_incremental_state", None)


def assert_same_hypotheses(got, expected):
    for got_nbest, nbest in zip(got, expected):
        assert len(got_nbest) == len(nbest)
        for g, e in zip(got_nbest, nbest):
            assert torch.equal(g["tokens"], e["tokens"])
            torch.testing.assert_close(g["positional_scores"], e["positional_scores"], atol=1e-5, rtol=1e-5)


# --- what the feedback loop runs ------------------------------------------------------------------


def on_loop_runs(monkeypatch, call):
    """call(runner) after each block and each step of the feedback loop, for the rest
    of the test: the block's FusedFeedbackLoop (its records, dropout masks and
    pieces) or ReferenceLoop, or the step's function, fused_step or reference_step."""
    for loop in (FusedFeedbackLoop, ReferenceLoop):
        def block(self, *args, run=loop.__call__):
            outputs = run(self, *args)
            call(self)
            return outputs

        monkeypatch.setattr(loop, "__call__", block)
    for name in ("fused_step", "reference_step"):
        def step(*args, run=getattr(feedback_loop, name)):
            outputs = run(*args)
            call(run)
            return outputs

        monkeypatch.setattr(feedback_loop, name, step)


def loop_runs(monkeypatch) -> list:
    """What runs each block and each step of the feedback loop from now on (on_loop_runs)."""
    ran = []
    on_loop_runs(monkeypatch, ran.append)
    return ran


def loop_graph_cache(model):
    """The feedback loop's cache of graphs itself, for the tests of what its graphs hold and
    who owns them; any other test reads its figures, model.graph_statistics()."""
    return model.decoder.graphed.cache


# --- the tools, in this process ------------------------------------------------------------------

FAIRSEQ_TOOLS = ("preprocess", "train", "generate", "interactive", "eval_lm")
for _tool in FAIRSEQ_TOOLS:
    importlib.import_module(f"fairseq_cli.{_tool}")
patches.apply()  # as fairseq's tools apply them when they load the plugin (fairseq-generate's main included)


def run(tool, *args, stdin="", check=True):
    """fairseq_cli.<tool> with the plugin, on this command line: what it
    printed and logged (.stdout), its errors (.stderr: a mistake the plugin
    names is one line, as its exception hook prints it) and its exit status.
    The data is loaded in this process (--num-workers 0 unless the command
    line says otherwise): a loader's worker processes would outlive the call,
    to be waited for whenever the loader is collected."""
    argv = [f"fairseq-{tool.replace('_', '-')}", *map(str, args)]
    if tool != "preprocess":
        argv += ["--user-dir", PLUGIN] + ([] if "--num-workers" in argv else ["--num-workers", "0"])
    return _in_process(argv, importlib.import_module(f"fairseq_cli.{tool}").cli_main, stdin, check)


def run_module(module, *args, stdin="", check=True):
    """This project's tool or data script `module` (its main(argv)), on this command line."""
    main = importlib.import_module(module).main
    return _in_process([module, *map(str, args)], lambda: main(sys.argv[1:]), stdin, check)


def _in_process(argv, main, stdin, check):
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(out)  # fairseq's tools log to stdout
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(name)s | %(message)s"))
    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()
    root.handlers, code = [handler], 0
    root.setLevel(logging.INFO)
    torch.set_num_threads(1)
    try:
        with mock.patch.object(sys, "argv", argv), mock.patch.object(sys, "stdin", io.StringIO(stdin)), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except Exception as e:
                line = one_line(e)
                if line is None:
                    raise
                print(f"error: {line}", file=sys.stderr)
                code = 1
    finally:
        root.handlers = handlers
        root.setLevel(level)
        torch.set_num_threads(threads)
    proc = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    if check and code:
        raise AssertionError(f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def error_of(function, *args) -> str:
    """The one-line message `function(*args)` stops with (a command's error)."""
    with pytest.raises(SystemExit) as e:
        function(*args)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def run_script(module, *args):
    """A data script's main (or a tool's), on this command line; its output is left to pytest's capture."""
    return module.main([str(a) for a in args])


def script_error(module, *args) -> str:
    return error_of(run_script, module, *args)


def run_as_a_user(module, *args, stdin="", cwd=None):
    """`python -m module ARGS` in a new process, as a shell runs it: for what
    only a new process shows (the exit status, stderr as printed)."""
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=ENV, cwd=cwd)


def assert_one_error_line(proc):
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(error_lines(proc)) == 1 and error_lines(proc)[0].startswith("error: "), proc.stderr


def last_number(pattern, text):
    matches = re.findall(pattern, text)
    assert matches, f"{pattern!r} not in output:\n{text[-2000:]}"
    return float(matches[-1])


def error_lines(proc):
    """stderr without the warnings fairseq's dependencies print."""
    return [line for line in proc.stderr.splitlines()
            if line.strip() and "Warning" not in line and not line.startswith((" ", "DEBUG", "INFO", "WARNING", "\t"))]


def train_on_two_workers(*args):
    """fairseq-train on two CPU workers (gloo, one process per rank, as fairseq
    skips its own launcher under --cpu; they meet through a file), both ranks
    forked by the command server of tests/recipe_shims.py, which imported
    torch and fairseq once for both; returns their log."""
    with tempfile.TemporaryDirectory() as folder:
        recipe_shims.write(os.path.join(folder, "bin"))
        env = dict(ENV, RECIPE_SERVER=os.path.join(folder, "server.sock"))
        with recipe_shims.server(env["RECIPE_SERVER"], env, os.path.join(folder, "server.log")):
            proc = subprocess.run([os.path.join(folder, "bin", "fairseq-train"), *map(str, args), "--user-dir", PLUGIN,
                                   "--distributed-world-size", "2"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


# --- tiny corpora and the tiny models fairseq's tools train on them ----------------------------

LM_MODEL = [
    "--task", "feedback_language_modeling", "--arch", "feedback_lm", "--decoder-layers", "2",
    "--decoder-embed-dim", "32", "--decoder-ffn-embed-dim", "64", "--decoder-attention-heads", "2",
    "--memory-span", "40", "--dropout", "0", "--no-epoch-checkpoints", "--log-format", "simple", "--cpu",
]
TRANSLATION_MODEL = [
    "--arch", "feedback_transformer", "--share-all-embeddings",
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4", "--dropout", "0",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--no-epoch-checkpoints", "--validate-interval", "100",
    "--log-format", "simple", "--log-interval", "50", "--cpu", "--seed", "1",
]

def write_lm_corpus(folder, lines):
    folder.mkdir()
    rng = random.Random(0)
    for split, count in (("train", lines), ("valid", 20), ("test", 20)):
        with open(folder / f"{split}.txt", "w") as f:
            for _ in range(count):
                # a counting pattern, so that context helps
                start, length = rng.randrange(20), rng.randint(3, 9)
                f.write(" ".join(f"w{(start + i) % 20}" for i in range(length)) + "\n")


def preprocess_lm(corpus, dest, *extra):
    run("preprocess", "--only-source", "--trainpref", corpus / "train.txt", "--validpref", corpus / "valid.txt",
        "--testpref", corpus / "test.txt", "--destdir", dest, "--workers", "1", *extra)


def preprocess_translation(corpus, dest):
    run("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", corpus / "train",
        "--validpref", corpus / "valid", "--testpref", corpus / "test", "--destdir", dest,
        "--joined-dictionary", "--workers", "1")


# --- a toy task, and a tiny feedback model trained on it -----------------------------------------

TOY_SIZES = {"train": 24, "valid": 4, "test": 7}
TOY_MODEL = ["--arch", "feedback_lm_toy", "--decoder-layers", "2", "--decoder-embed-dim", "16",
             "--decoder-ffn-embed-dim", "32", "--decoder-attention-heads", "2", "--memory-span", "16", "--dropout",
             "0", "--attention-dropout", "0", "--activation-dropout", "0"]


def train_toy_model(root):
    """A random walk, binarized, and a tiny feedback model trained for 3 updates:
    (the raw task folder, the data directory, the checkpoint)."""
    raw = toy_tasks.write_task(str(root / "raw"), "random_walk", 1, TOY_SIZES, grid_size=3, episode_length=12)
    data = root / "bin"
    for kind, dest in (("input", data), ("labels", data / "labels")):
        run("preprocess", "--only-source",
            *[a for s in toy_tasks.SPLITS for a in (f"--{s}pref", f"{raw}/{s}.{kind}")], "--destdir", dest)
    run("train", data, "--task", "feedback_language_modeling", "--labels", "labels", *TOY_MODEL,
        "--tokens-per-sample", 16, "--batch-size", 3, "--optimizer", "adam", "--lr", "1e-3", "--max-update", 3,
        "--save-dir", root / "ckpt", "--disable-validation", "--num-workers", 0, "--no-epoch-checkpoints")
    return raw, data, root / "ckpt" / "checkpoint_last.pt"
