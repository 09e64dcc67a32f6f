"""A sequence-to-sequence model whose decoder is a Feedback Transformer.

The encoder is fairseq's TransformerEncoder, unchanged; so are embeddings,
output projection and everything TransformerModel offers around them. Only the
decoder is feedback, as in the paper's translation and summarization runs.
"""

from fairseq.dataclass.utils import gen_parser_from_dataclass
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import (
    TransformerModel,
    base_architecture,
    transformer_iwslt_de_en,
    transformer_vaswani_wmt_en_de_big,
)

from ..errors import FeedbackUsageError
from .feedback_config import FeedbackConfig, check_feedback_args, feedback_architecture
from .plugin_model import PluginModel, build_decoder, check_model_and_task


@register_model("feedback_transformer")
class FeedbackTransformerModel(PluginModel, TransformerModel):
    language_model = False
    wrong_task = ("feedback_transformer is a translation model, which a language-modelling task cannot train: "
                  "use --task translation (or feedback_translation), or the language model, --arch feedback_lm")

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        # defaults come from the architectures, as for the transformer's options
        gen_parser_from_dataclass(parser, FeedbackConfig(), delete_default=True)
        # A resumed run trains on the batches an uninterrupted one does: fairseq
        # otherwise keeps the batches of the epoch its iterator was made in, and a
        # resumed run makes it in another epoch. A value given is kept.
        parser.set_defaults(update_epoch_batch_itr=True)

    @classmethod
    def build_model(cls, args, task):
        # fairseq applied the architecture (the defaults) before this
        check_model_and_task(cls, type(task))
        check_feedback_args(args)  # for what does not come through fairseq's tools (the hub, Python)
        if getattr(args, "share_all_embeddings", False) and task.source_dictionary != task.target_dictionary:
            raise FeedbackUsageError(
                "--share-all-embeddings needs one dictionary for both sides: "
                "binarize with fairseq-preprocess --joined-dictionary, or drop the flag"
            )
        return super().build_model(args, task)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return build_decoder(cfg, tgt_dict, embed_tokens, no_encoder_attn=cfg.no_cross_attention)

    def set_beam_size(self, beam_size):
        """Called by fairseq's SequenceGenerator (as for BART): beam hypotheses
        then share their sentence's encoder keys and values."""
        self.decoder.set_beam_size(beam_size)


# Sizes of the paper's Table 8, on fairseq's transformer architectures of those
# sizes; Table 8's dropout 0.3 in all three, where fairseq's translation models
# apply --dropout (the embeddings and every sublayer's output, none on attention
# or ReLU): the paper's sequence-to-sequence models are fairseq's Transformer
# with the decoder replaced, and its "attention and ReLU" dropout is said of
# the language models (appendix 7.6). Options set before these run are kept.


@register_model_architecture("feedback_transformer", "feedback_transformer")
def feedback_transformer(args):
    feedback_architecture(args, base_architecture, dropout=0.3)


@register_model_architecture("feedback_transformer", "feedback_transformer_iwslt_de_en")
def feedback_transformer_iwslt_de_en(args):
    feedback_architecture(args, transformer_iwslt_de_en, dropout=0.3)


@register_model_architecture("feedback_transformer", "feedback_transformer_wmt_en_de_big")
def feedback_transformer_wmt_en_de_big(args):
    feedback_architecture(args, transformer_vaswani_wmt_en_de_big, dropout=0.3)
