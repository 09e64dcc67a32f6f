"""The per-token loop replayed as graphs gives the eager loop's numbers, on
each device: training (loss and every gradient, in fp32, half precision and
under autocast, with dropout), streaming, beam search, sampling, graphs
replayed in any order from a cache smaller than the shapes, gradient
accumulation; and no graph had to give way to the eager loop. On the CPU the
graphs are the stand-in's (--cuda-graphs emulate: the same path, the CUDA
calls stood in for), so CI runs every scenario; on a GPU they are captured
(`python3 -m pytest -q -m gpu tests` runs the GPU's alone)."""

import re

import pytest
import torch
from fairseq import search as search_module
from helpers import (assert_same_hypotheses, batch, loop_graph_cache, loss_and_gradients, make_dictionary, run,
                     run_module, search, tiny_lm, tiny_translation_model)

from fairseq_feedback.loop.graphed_loop import GraphedFeedbackLoop
from fairseq_feedback.cuda_graphs import CudaGraphBackend, GraphCache

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=GPU)]
OPTIONS = {
    "shared kv": [],
    "per-layer kv, adaptive span, relative positions": ["--per-layer-kv", "--adaptive-span", "--adaptive-span-ramp",
                                                        "2", "--relative-positions"],
    "persistent vectors, pre-norm": ["--persistent-vectors", "2", "--decoder-normalize-before"],
}
# (device, parameters' dtype, autocast dtype): half precision on a GPU;
# autocast to bfloat16 on the CPU
PRECISIONS = [
    pytest.param("cpu", torch.float32, None, id="cpu-fp32"),
    pytest.param("cpu", torch.float32, torch.bfloat16, id="cpu-autocast-bf16", marks=pytest.mark.half_precision),
    pytest.param("cuda", torch.float32, None, id="cuda-fp32", marks=GPU),
    pytest.param("cuda", torch.float16, None, id="cuda-fp16", marks=GPU),
    pytest.param("cuda", torch.float32, torch.float16, id="cuda-amp", marks=GPU),
]
# gelu, not relu, where half precision is compared: a relu input within
# rounding of 0 takes either branch, and that token's whole share of fc1's
# gradient goes with it, a difference no multiple of the precision bounds
# (the graphs' padded shapes round differently from eager's: issue 32)
SMOOTH = ["--activation-fn", "gelu"]
# half precision: within this many of the dtype's eps, relative to the loss
# and to the largest gradient (measured under the CPU's three kernel sets,
# ATEN_CPU_CAPABILITY default, avx2 and avx512, in bf16 and fp16: at most 2)
EPS_TOLERATED = 8


def eager(model):
    model.decoder.use_cuda_graphs("off")


def graphs(model, device, mode=None, **bounds):
    """Captured CUDA graphs on a GPU, the stand-in's elsewhere (or `mode`'s)."""
    model.decoder.graphed = GraphedFeedbackLoop(mode or ("auto" if device == "cuda" else "emulate"), **bounds)


def assert_no_fallback(*models):
    for model in models:
        assert model.graph_statistics().failed is None, model.graph_statistics().failed


def assert_graphs_equal_eager(model, device, results, precision, seed=None):
    """`results()` (losses and gradients) with the loop replayed as graphs,
    against eager, computed in `precision`; `seed`: both passes draw dropout
    from it."""
    eager(model)
    if seed is not None:
        torch.manual_seed(seed)
    expected = results()
    graphs(model, device)
    if seed is not None:
        torch.manual_seed(seed)
    for got, want in zip(results(), expected):
        if precision == torch.float32:
            assert_close(got, want, 1e-5)
        else:
            assert_close_to_rounding(got, want, precision)
    assert_no_fallback(model)


def assert_close(got, expected, tolerance):
    """The loss, and every gradient relative to its largest value."""
    (got_loss, got_grads), (loss, grads) = got, expected
    torch.testing.assert_close(got_loss.float(), loss.float(), atol=tolerance, rtol=tolerance)
    assert got_grads.keys() == grads.keys()
    largest = max(g.float().abs().max() for g in grads.values())
    for name in grads:
        # a gradient that is zero but for rounding (a key projection's bias,
        # which softmax ignores) has no scale of its own: at least a
        # thousandth of the largest
        scale = grads[name].float().abs().max().clamp_min(1e-3 * largest)
        torch.testing.assert_close(got_grads[name].float() / scale, grads[name].float() / scale,
                                   atol=tolerance * 10, rtol=0, msg=name)


def assert_close_to_rounding(got, expected, dtype):
    """The loss and every gradient, to EPS_TOLERATED of `dtype`'s eps: a
    gradient's rounding scales with the terms it sums, not with its own
    value, so relative to the largest gradient."""
    tolerance = EPS_TOLERATED * torch.finfo(dtype).eps
    (got_loss, got_grads), (loss, grads) = got, expected
    torch.testing.assert_close(got_loss.float(), loss.float(), atol=0, rtol=tolerance)
    assert got_grads.keys() == grads.keys()
    largest = max(g.float().abs().max() for g in grads.values())
    for name in grads:
        torch.testing.assert_close(got_grads[name].float(), grads[name].float(), atol=tolerance * largest, rtol=0,
                                   msg=name)


def translation_batches(d, device, shapes):
    batches = [tuple(t.to(device) for t in batch(d, rows=rows, src_len=src, tgt_len=tgt)) for rows, src, tgt in shapes]
    return batches, [torch.randint(d.nspecial, len(d), prev.shape, device=device) for _, _, prev in batches]


@pytest.mark.parametrize("device, dtype, autocast", PRECISIONS)
@pytest.mark.parametrize("flags", OPTIONS.values(), ids=OPTIONS.keys())
def test_graphed_translation_training_equals_eager(flags, device, dtype, autocast):
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", *flags, *SMOOTH, layers=6)
    model = model.to(device, dtype).train()
    batches, targets = translation_batches(d, device, ((3, 5, 7), (3, 5, 7), (11, 9, 13), (11, 9, 13)))

    def results():
        out = []
        for (src, lengths, prev), target in zip(batches, targets):
            model.zero_grad()
            with torch.autocast(device, autocast or torch.bfloat16, enabled=autocast is not None):
                logits = model(src, lengths, prev)[0].float()
            out.append(loss_and_gradients(model, lambda: logits, target))
        return out

    assert_graphs_equal_eager(model, device, results, autocast or dtype)
    assert model.graph_statistics().captured == 2


@pytest.mark.parametrize("device, mode", [pytest.param("cpu", "emulate", id="cpu"),
                                          pytest.param("cuda", "auto", id="cuda", marks=GPU),
                                          pytest.param("cuda", "emulate", id="cuda-emulate", marks=GPU)])
def test_graphed_training_with_dropout_equals_eager_at_the_padded_shapes(device, mode):
    """How far dropout advances the generator depends on the tensor's shape:
    the reference is the eager loop at the graphs' padded shapes, from the
    same seed (every cache call run eagerly). The stand-in on a GPU draws
    from, and rewinds, the GPU's generator."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0.2", "--attention-dropout", "0.1", layers=3)
    model = model.to(device).train()
    batches, targets = translation_batches(d, device, ((3, 5, 7), (3, 5, 7), (11, 9, 13)))

    def results():
        torch.manual_seed(3)
        out = []
        for (src, lengths, prev), target in zip(batches, targets):
            model.zero_grad()
            out.append(loss_and_gradients(model, lambda: model(src, lengths, prev)[0], target))
        return out

    graphs(model, device, mode)
    replayed = results()
    assert_no_fallback(model)
    assert model.graph_statistics().captured == 1
    graphs(model, device, mode, max_graphs=0)  # every block eagerly, at the graphs' shapes
    padded = results()
    assert model.graph_statistics().captured == 0 and model.graph_statistics().calls == 0
    for got, want in zip(replayed, padded):
        assert_close(got, want, 1e-5)


HALF = [pytest.param("cpu", torch.float16, "emulate", 0.0, id="cpu-fp16", marks=pytest.mark.half_precision),
        pytest.param("cpu", torch.bfloat16, "emulate", 0.0, id="cpu-bf16", marks=pytest.mark.half_precision),
        pytest.param("cuda", torch.float16, "auto", 1e-3, id="cuda-fp16", marks=GPU)]


@pytest.mark.parametrize("device, dtype, mode, tolerance", HALF)
def test_half_precision_graphs_compute_what_their_eager_run_at_the_same_shapes_does(device, dtype, mode, tolerance):
    """Telling a defect from half precision's rounding: against the same
    computation at the same padded shapes, run eagerly (the stand-in on a
    GPU: the same kernels, not replayed), a graph's results differ by no
    rounding at all on the CPU (the same kernels on the same numbers), and
    on a GPU by what nondeterministic kernels give. Each update is compared
    from the same parameters, so differences cannot grow over a run: any
    difference beyond that is a defect (a stale input, a result overwritten
    in the pool, a wrong padding), never fp16 noise."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0.1", layers=3)
    model = model.to(device, dtype).train()
    batches, targets = translation_batches(d, device, ((3, 5, 7), (3, 5, 7), (11, 9, 13), (3, 5, 7), (11, 9, 13)))
    # on the CPU, every block eagerly at the graphs' shapes; on a GPU, the stand-in
    reference = GraphedFeedbackLoop("emulate", **({"max_graphs": 0} if mode == "emulate" else {}))
    graphs(model, device, mode)
    replayed = model.decoder.graphed
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for (src, lengths, prev), target in zip(batches, targets):
        results = []
        for loop in (replayed, reference):
            model.decoder.graphed = loop
            torch.manual_seed(5)
            model.zero_grad()
            results.append(loss_and_gradients(model, lambda: model(src, lengths, prev)[0].float(), target))
        assert_close(*results, tolerance)
        optimizer.step()  # the graphs' own gradients, in place: the next update starts from new parameters
    model.decoder.graphed = replayed
    assert_no_fallback(model)
    assert replayed.cache.captured == 2


@pytest.mark.parametrize("device", DEVICES)
def test_models_dropped_between_captures_never_invalidate_a_later_capture(device):
    """The sequence that failed on an H100: models that captured graphs are
    dropped (fairseq leaves a language model it builds in reference cycles,
    freed whenever the collector runs), then a model with dropout captures,
    then a random operator runs. A graph freed during a capture would
    invalidate it, and a failed capture would leave the generator unusable."""
    d = make_dictionary()
    for seed in range(3):
        lm, _ = tiny_lm("--memory-span", "6", dictionary=d, seed=seed)
        lm = lm.to(device).train()
        graphs(lm, device)
        tokens = torch.randint(d.nspecial, len(d), (2, 7), device=device)
        for _ in range(2):
            lm(tokens)[0].sum().backward()
        assert lm.graph_statistics().captured == 1
        del lm
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0.1", layers=2, dictionary=d)
    model = model.to(device).train()
    graphs(model, device)
    (src, lengths, prev), = translation_batches(d, device, ((3, 5, 7),))[0]
    for _ in range(2):
        model(src, lengths, prev)[0].sum().backward()
    assert model.graph_statistics().captured == 1
    assert_no_fallback(model)
    torch.randint(10, (3,), device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_a_capture_while_earlier_losses_hold_the_parameters_accumulate_grad_nodes(device):
    """The sequence that failed on an H100 (torch 2.11): losses kept from
    before the capture hold every parameter's AccumulateGrad node, made on
    the default stream (DDP's reducer holds them always); a captured backward
    that took gradients with respect to the parameters waited on that
    stream, which invalidated the capture ("operation would make the legacy
    stream depend on a capturing blocking stream")."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=2)
    model = model.to(device).train()
    graphs(model, device)
    ((src, lengths, prev),), _ = translation_batches(d, device, ((3, 5, 7),))
    held = []
    for _ in range(3):  # eager, then captured, then replayed
        loss = model(src, lengths, prev)[0].float().pow(2).sum()
        loss.backward(retain_graph=True)
        held.append(loss)
    assert model.graph_statistics().captured == 1
    assert_no_fallback(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_capture_that_fails_leaves_the_gpu_usable():
    """A host sync inside the captured function fails its capture: the call
    gets the eager result, and dropout and the allocator work after it."""
    cache = GraphCache(CudaGraphBackend(torch.device("cuda")), name="test")
    x = torch.ones(4, device="cuda")

    def syncing(x):
        return (x + 1 if x.sum().item() > 0 else x,)  # .item(): a host sync, which capture forbids

    for _ in range(3):
        (out,) = cache("sync", syncing, [x])
        assert torch.equal(out, x + 1)
    assert cache.failed is not None and "capture failed" in cache.failed
    torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5)
    torch.randint(10, (4,), device="cuda")
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
def test_graphs_replayed_in_any_order_from_a_small_cache_with_evaluation_and_decoding_between(device):
    """Four shapes, a cache of two graphs, the blocks in shuffled order,
    training mixed with evaluation and beam search: every result the eager
    loop's, no graph given up."""
    model, d = tiny_translation_model("--memory-span", "5", "--dropout", "0", layers=3)
    model = model.to(device)
    shapes = [(3, 5, 7), (9, 17, 7), (20, 5, 30), (3, 40, 3)]
    batches, targets = translation_batches(d, device, shapes)
    order = [0, 2, 1, 3, 2, 0, 3, 1, 1, 2]
    src, lengths, _ = batches[1]
    sample = {"net_input": {"src_tokens": src[:5], "src_lengths": lengths[:5]}}

    def results():
        out = []
        for i in order:
            (src, lengths, prev), target = batches[i], targets[i]
            model.train()
            model.zero_grad()
            out.append(loss_and_gradients(model, lambda: model(src, lengths, prev)[0], target))
            model.eval()
            with torch.no_grad():
                out.append(model(src, lengths, prev)[0])
            if i == 3:
                out.append(search(model, d, dict(beam_size=4, max_len_b=10), sample))
        return out

    eager(model)
    expected = results()
    graphs(model, device, max_graphs=2)
    for got, want in zip(results(), expected):
        if isinstance(want, tuple):
            assert_close(got, want, 1e-5)
        elif isinstance(want, list):
            assert_same_hypotheses(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert_no_fallback(model)
    assert model.graph_statistics().cached <= 2


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_accumulation_keeps_parameters_grads_apart_from_the_graphs_buffers(device):
    """--update-freq 2: the second replay must not overwrite the first
    backward's gradients, so no .grad may be a graph's own buffer."""
    model, d = tiny_translation_model("--memory-span", "4", "--dropout", "0", layers=3)
    model = model.to(device).train()
    batches, targets = translation_batches(d, device, ((3, 5, 7),) * 3)  # one shape: one graph, replayed

    def accumulated():
        model.zero_grad()
        for (src, lengths, prev), target in zip(batches, targets):
            loss = loss_and_gradients(model, lambda: model(src, lengths, prev)[0], target)[0]
        return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager(model)
    expected = accumulated()
    graphs(model, device)
    assert_close(accumulated(), expected, 1e-5)
    buffers = {g.untyped_storage().data_ptr() for graphed in loop_graph_cache(model).graphs.values()
               for g in graphed.grads if g is not None}
    assert buffers and not any(p.grad.untyped_storage().data_ptr() in buffers
                               for p in model.parameters() if p.grad is not None)
    assert_no_fallback(model)


STREAM_PRECISIONS = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
                     pytest.param("cuda", torch.float32, id="cuda-fp32", marks=GPU),
                     pytest.param("cuda", torch.float16, id="cuda-fp16", marks=GPU)]


@pytest.mark.parametrize("device, dtype", STREAM_PRECISIONS)
def test_graphed_stream_of_three_blocks_equals_eager(device, dtype):
    d = make_dictionary()
    model, _ = tiny_lm("--memory-span", "10", *SMOOTH, dictionary=d)
    model = model.to(device, dtype)
    # blocks 2 to 4 start from a full span of carried memory: one shape, captured at the second
    tokens, target = torch.randint(d.nspecial, len(d), (2, 3, 35), device=device)

    def results():
        model.train()
        out = []
        for k, (block, block_target) in enumerate(zip(tokens.split(7, 1), target.split(7, 1))):
            model.zero_grad()
            out.append(loss_and_gradients(model, lambda: model(block, stream="t", block_index=k)[0].float(), block_target))
        return out

    assert_graphs_equal_eager(model, device, results, dtype)
    assert model.graph_statistics().captured == 1


@pytest.mark.parametrize("device", DEVICES)
def test_graphed_beam_search_and_sampling_equal_eager(device):
    model, d = tiny_translation_model("--memory-span", "5", layers=6)
    model = model.to(device).eval()
    src, lengths, _ = (t.to(device) for t in batch(d, rows=9, src_len=6))
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths}}
    lm, _ = tiny_lm("--memory-span", "12", dictionary=d)
    lm = lm.to(device).eval()
    prompt = torch.randint(d.nspecial, len(d), (3, 4), device=device)
    lm_sample = {"net_input": {"src_tokens": prompt, "src_lengths": torch.full((3,), 4, device=device)},
                 "prefix_tokens": prompt}
    for m, args, s in ((model, dict(beam_size=5, max_len_b=24), sample),
                       (lm, dict(beam_size=1, search_strategy=search_module.Sampling(d), max_len_b=30, min_len=30),
                        lm_sample)):
        eager(m)
        expected = search(m, d, args, s, seed=1)
        graphs(m, device)
        assert_same_hypotheses(search(m, d, args, s, seed=1), expected)
        assert m.graph_statistics().captured > 0
        assert_no_fallback(m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fairseq_train_fp16_with_captured_graphs_gives_the_same_losses_as_the_same_path_run_eagerly(tmp_path):
    """fairseq-train --fp16, graphs captured against --cuda-graphs emulate:
    the same path at the same padded shapes, the kernels run eagerly instead
    of replayed. The same kernels on the same numbers: every update's loss
    agrees to fp16's rounding, and the loss scaler skips the same updates
    (against the eager loop at other shapes, trajectories part by chance).
    (On the CPU, tests/test_cuda_graph_safety.py runs fairseq-train through the stand-in.)"""
    run_module("fairseq_feedback_cli.data_prep.synthetic_translation", "--out", tmp_path / "corpus", "--train", 2000,
               "--vocab", 12, "--max-len", 8)
    run("preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref", tmp_path / "corpus" / "train",
        "--validpref", tmp_path / "corpus" / "valid", "--destdir", tmp_path / "data", "--joined-dictionary",
        "--workers", "1")
    logs = []
    for mode in ("auto", "emulate"):
        logs.append(run("train", tmp_path / "data", "--arch", "feedback_transformer_iwslt_de_en",
                        "--share-all-embeddings", "--dropout", "0", "--optimizer", "adam", "--lr", "5e-4",
                        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "20", "--max-tokens", "4096",
                        "--max-update", "60", "--fp16", "--log-format", "simple", "--log-interval", "1",
                        "--seed", "1", "--no-save", "--cuda-graphs", mode).stdout)
    captured, emulated = ([float(x) for x in re.findall(r"train_inner \| .*? loss=([\d.]+)", log)] for log in logs)
    assert len(captured) >= 40 and len(captured) == len(emulated)
    torch.testing.assert_close(torch.tensor(captured), torch.tensor(emulated), atol=2e-3, rtol=1e-3)
    scales = [re.findall(r"train_inner \| .*? loss_scale=([\d.]+)", log) for log in logs]
    assert len(scales[0]) == len(captured) and scales[0] == scales[1]
    assert "running eagerly from now on" not in logs[0]
