"""The CUDA-graph path never gives a wrong number, checked on the CPU through
its bookkeeping without capture (--cuda-graphs emulate): a graph that fails
to capture or disagrees with the eager loop gives way to it, with one
warning; a search never reads what an earlier one left in the static memory;
a forward awaiting its backward is never overwritten; and a real corpus's
batches fit the cache in a few shapes."""

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from helpers import (PLUGIN, assert_same_hypotheses, assert_same_loss_and_gradients, batch, loss_and_gradients,
                     run, run_as_a_user, run_module, search, tiny_translation_model)

from fairseq_feedback.models.graphed_loop import GraphedFeedbackLoop
from fairseq_feedback.modules.cuda_graphs import GraphCache, GraphedFunction

BATCHES = Path(__file__).parent / "data" / "debian_de_en_batches.json"
STATISTICS = re.compile(r"graph cache \| keys (\d+) \| calls (\d+) \| hits (\d+) \| hit rate ([\d.]+)%")


def training_results(model, batches):
    """Loss and gradients of each (src, lengths, prev, target) batch."""
    model.train()
    results = []
    for src, lengths, prev, target in batches:
        model.zero_grad()
        results.append(loss_and_gradients(model, lambda: model(src, lengths, prev)[0], target))
    return results


def translation_batches(d, shapes=((3, 5, 7), (3, 5, 7), (5, 9, 3))):
    batches = []
    for rows, src_len, tgt_len in shapes:
        src, lengths, prev = batch(d, rows=rows, src_len=src_len, tgt_len=tgt_len)
        batches.append((src, lengths, prev, torch.randint(d.nspecial, len(d), prev.shape)))
    return batches


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def perturb_replayed_outputs(monkeypatch):
    """Every replay's outputs off by one: a graph that computes something else."""
    run_forward = GraphedFunction._run_forward

    def wrong(self, inputs):
        run_forward(self, inputs)
        self.outputs = tuple(o + 1 for o in self.outputs)

    monkeypatch.setattr(GraphedFunction, "_run_forward", wrong)


@pytest.mark.parametrize("failure", ["capture", "outputs", "gradients"])
def test_a_graph_that_fails_gives_way_to_the_eager_loop_with_one_warning(failure, monkeypatch, caplog):
    """The first batch's graph fails (capture raises, or its replay's outputs
    or gradients differ): every batch's loss and gradients are the eager
    loop's, one warning names the shape, and later batches run eagerly."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    batches = translation_batches(d)
    model.decoder.use_cuda_graphs("off")
    eager = training_results(model, batches)

    if failure == "capture":
        def refuse(self):
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(GraphedFunction, "_capture", refuse)
    elif failure == "outputs":
        perturb_replayed_outputs(monkeypatch)
    else:
        backward = GraphedFunction._backward

        def doubled(self, retain_graph=False, outputs=None):  # the replay's gradients, not the eager check's
            grads = backward(self, retain_graph, outputs)
            return grads if outputs is not None else tuple(None if g is None else 2 * g for g in grads)

        monkeypatch.setattr(GraphedFunction, "_backward", doubled)
    model.decoder.use_cuda_graphs("emulate")
    with caplog.at_level(logging.WARNING):
        graphed = training_results(model, batches)
    for got, expected in zip(graphed, eager):
        assert_same_loss_and_gradients(got, expected)
    (warning,) = warnings_of(caplog)
    assert "8 rows x 8 steps x 8 source positions" in warning and "running eagerly from now on" in warning
    assert re.search({"capture": r"capture failed \(RuntimeError: operation not permitted",
                      "outputs": r"its outputs differ from eager by [\d.]+ \(at most 0.0001\)",
                      "gradients": r"its gradients differ from eager by 1 \(at most 0.0001\)"}[failure], warning)
    assert model.decoder.graphed.cache.calls == 1  # the later batches never reached the cache


def test_a_search_whose_graph_disagrees_continues_eagerly_with_the_eager_hypotheses(monkeypatch, caplog):
    model, d = tiny_translation_model("--memory-span", "6", layers=3)
    model.eval()
    src, lengths, _ = batch(d, rows=9, src_len=6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    args = dict(beam_size=5, max_len_b=12)
    model.decoder.use_cuda_graphs("off")
    eager = search(model, d, args, sample)
    perturb_replayed_outputs(monkeypatch)
    model.decoder.use_cuda_graphs("emulate")
    with caplog.at_level(logging.WARNING):
        assert_same_hypotheses(search(model, d, args, sample), eager)
        assert_same_hypotheses(search(model, d, args, sample), eager)  # the next search: the eager loop's cache
    (warning,) = warnings_of(caplog)
    assert "decoding 80 rows, 7 memory slots, 8 source positions" in warning


@pytest.mark.parametrize("span", [3, 40], ids=["the ring wraps", "the memory grows"])
def test_a_search_reads_nothing_an_earlier_search_left_in_the_static_memory(span):
    """Masked slots get weight 0, and 0 times NaN is NaN: a ring poisoned
    with NaN (an earlier search's fp16 overflow, say) must change nothing."""
    model, d = tiny_translation_model("--memory-span", str(span), layers=3)
    model.eval()
    src, lengths, _ = batch(d, rows=9, src_len=6)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    args = dict(beam_size=5, max_len_b=24)
    model.decoder.use_cuda_graphs("off")
    eager = search(model, d, args, sample)
    model.decoder.use_cuda_graphs("emulate")
    search(model, d, args, sample)
    for memory in model.decoder.graphed.decoding.memories.values():
        memory.slots.fill_(float("nan"))
    assert_same_hypotheses(search(model, d, args, sample), eager)


def test_a_second_forward_before_the_first_backward_runs_eagerly():
    """A criterion that runs the model twice before one backward (as R-Drop
    does): the second call must not overwrite what the first call's
    backward reads, so it runs eagerly; the gradients are the eager loop's."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    src, lengths, prev, target = translation_batches(d)[0]
    other = torch.randint(d.nspecial, len(d), target.shape)

    def twice():
        model.train()
        model.zero_grad()
        first, second = model(src, lengths, prev)[0], model(src, lengths, prev)[0]
        return loss_and_gradients(model, lambda: torch.cat([first, second]), torch.cat([target, other]))

    model.decoder.use_cuda_graphs("off")
    eager = twice()
    model.decoder.use_cuda_graphs("emulate")
    # first a forward whose backward never comes (its loss dropped, as fairseq
    # does after running out of memory): it holds nothing back
    model.train()
    model(src, lengths, prev)
    assert_same_loss_and_gradients(twice(), eager)
    cache = model.decoder.graphed.cache
    assert cache.calls == 2 and cache.failed is None


def test_an_epoch_of_a_real_corpus_fits_the_cache_and_the_next_epoch_finds_its_graphs():
    """Debian de-en's batches as fairseq makes them with --max-tokens 4096
    (rows, source and target lengths, recorded in tests/data): one epoch and
    its validation need at most the cache's graphs, and the second epoch
    finds at least 95% of its blocks' graphs cached."""
    recorded = json.loads(BATCHES.read_text())
    cache = GraphCache(capture=False, name="test")

    def epoch(train):
        for mode, batches in (("train", train), ("valid", recorded["valid"])):
            for rows, source, target in batches:
                key = (GraphedFeedbackLoop.block_shape(rows, target, source), mode)
                cache(key, lambda x: (x,), [torch.zeros(1)])
        return [int(n) for n in STATISTICS.fullmatch(cache.statistics()).groups()[:3]]

    keys, calls, _ = epoch(recorded["train"][0])
    assert calls == 304 + 12 and keys <= cache.max_graphs
    keys, calls, hits = epoch(recorded["train"][1])
    assert keys <= cache.max_graphs and hits >= 0.95 * calls and cache.failed is None


def test_fairseq_train_through_the_graphs_bookkeeping_follows_the_eager_loss_curve(tmp_path):
    """--cuda-graphs emulate (padded shapes, the cache, the self-checks)
    against --no-cuda-graphs, dropout 0: the same losses, and the cache's
    statistics after every epoch and validation."""
    run_module("fairseq_feedback_cli.data_prep.synthetic_translation", "--out", tmp_path / "corpus", "--train", 300,
               "--vocab", 12, "--max-len", 8)
    run("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", tmp_path / "corpus" / "train",
        "--validpref", tmp_path / "corpus" / "valid", "--destdir", tmp_path / "data", "--joined-dictionary",
        "--workers", "1")
    options = [tmp_path / "data", "--arch", "feedback_transformer", "--cpu", "--num-workers", 0,
               "--encoder-layers", 1, "--decoder-layers", 2, "--encoder-embed-dim", 16, "--decoder-embed-dim", 16,
               "--encoder-ffn-embed-dim", 32, "--decoder-ffn-embed-dim", 32, "--encoder-attention-heads", 2,
               "--decoder-attention-heads", 2, "--dropout", 0, "--optimizer", "adam", "--lr", "1e-3",
               "--max-tokens", 500, "--max-epoch", 2, "--log-format", "simple", "--log-interval", 1, "--seed", 1,
               "--no-save"]
    # a process of its own: the last validation's statistics are logged as fairseq-train exits
    emulated = run_as_a_user("fairseq_cli.train", *options, "--user-dir", PLUGIN, "--cuda-graphs", "emulate")
    assert emulated.returncode == 0, emulated.stderr
    logs = [emulated.stdout, run("train", *options, "--no-cuda-graphs").stdout]
    losses = [[float(x) for x in re.findall(r"train_inner \| .*? loss=([\d.]+)", log)] for log in logs]
    assert len(losses[0]) >= 10 and losses[0] == pytest.approx(losses[1], abs=2e-3)
    statistics = STATISTICS.findall(logs[0])
    assert len(statistics) == 4  # after each epoch's training and each validation
    keys = [int(k) for k, *_ in statistics]
    assert keys == sorted(keys) and keys[-1] <= 64
    assert not STATISTICS.search(logs[1])
