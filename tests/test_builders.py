"""fairseq_feedback_cli.builders, as the tests' tiny models and feedback-benchmark use them."""

import torch

from conftest import make_dictionary, tiny_lm, tiny_translation_model
from fairseq_feedback_cli import benchmark
from fairseq_feedback.models.feedback_lm import FeedbackLanguageModel
from fairseq_feedback.models.feedback_transformer import FeedbackTransformerModel
from fairseq_feedback.tasks import FeedbackLanguageModelingTask


def test_the_tiny_models_take_a_decoder_depth():
    for layers in (1, 3, 12):
        model, _ = tiny_translation_model(layers=layers)
        assert (len(model.encoder.layers), len(model.decoder.layers)) == (2, layers)
        lm, _ = tiny_lm(layers=layers)
        assert len(lm.decoder.layers) == layers
    assert len(tiny_translation_model()[0].decoder.layers) == len(tiny_lm()[0].decoder.layers) == 3


def test_the_tiny_models_are_the_registered_classes_seeded():
    d, labels = make_dictionary(), make_dictionary(30)
    model, _ = tiny_translation_model(seed=4)
    lm, task = tiny_lm("--labels", "labels", dictionary=d, labels=labels, seed=4)
    assert type(model) is FeedbackTransformerModel and type(lm) is FeedbackLanguageModel
    assert type(task) is FeedbackLanguageModelingTask and task.output_dictionary is labels
    again, _ = tiny_translation_model(seed=4)
    other, _ = tiny_translation_model(seed=5)
    weight = "decoder.layers.0.fc1.weight"
    assert torch.equal(model.state_dict()[weight], again.state_dict()[weight])
    assert not torch.equal(model.state_dict()[weight], other.state_dict()[weight])


def test_the_benchmark_runs_on_the_same_builders(capsys):
    benchmark.main(["--preset", "tiny", "--threads", "1"])
    out = capsys.readouterr().out
    for row in ("transformer ", "feedback_transformer", "transformer_lm", "feedback_lm", "feedback / fairseq"):
        assert row in out


def test_the_benchmark_counts_the_feedback_loop_as_a_gpu_replays_it():
    """On the CPU, ops/step of a feedback model is the graph path's: with its
    weight gradients once per block, fewer operators than the eager loop
    (measured: 321 against 350 per step here; 381 without them)."""
    d = make_dictionary()
    model, _ = tiny_translation_model("--dropout", "0", layers=3)
    src, tgt = torch.randint(d.nspecial, len(d), (2, 8, 8))
    lengths = torch.full((8,), 8)
    work = benchmark.training_step(model, lambda: model(src, lengths, benchmark.shifted(d, tgt))[0], lambda: tgt)
    replayed, _ = benchmark.kernels_and_busy_share(model, work, 8, torch.device("cpu"))
    assert model.decoder.graphed is None  # the model runs eagerly again
    with benchmark._CountOps() as eager:
        work()
    assert replayed < eager.count / 8  # without them the graph path's padding and bookkeeping would add operators
