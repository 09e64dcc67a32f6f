"""fairseq_feedback_cli.builders, as the tests' tiny models and feedback-benchmark use them."""

import torch
from helpers import make_dictionary, tiny_lm, tiny_translation_model

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
