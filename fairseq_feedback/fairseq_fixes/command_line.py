"""A fairseq tool's whole command line, checked before the tool creates anything: the entry and the order.

fairseq-train creates --save-dir as its main begins, and fairseq-generate
its --results-path; only then do they read the data, build the model and
load checkpoints, so a mistake found there leaves a folder behind and a
traceback. patches.py has each tool check its command line first:
check_tool for those that hand their configuration to
distributed_utils.call_main (train, eval-lm, interactive, validate,
hydra-train), check_generate for fairseq-generate. In this order:

- the model with the task, both as classes (the model is None unless the
  tool trains one, which it builds from the command line);
- the streaming task's options: blocks, batches of streams, labels
  (option_values.py, binarized_files.py);
- fairseq's own options at values that mean nothing (sizes of zero or
  less, probabilities outside [0, 1), rates of zero): the model's, the
  batches', the training loop's, the optimizer's, the scheduler's, the
  criterion's, generation's; those that go together (--nbest and --beam);
  those given as Python literals (--adam-betas, --model-overrides); ranks
  that fairseq would spawn on no GPU; and half precision, which fairseq
  computes on a GPU (or a TPU) only (option_values.py);
- the decoder's options (models/feedback_config.py, beside their
  definitions);
- the data: the directories, a translation task's language pair, the
  dictionaries (read by fairseq, whose checks of their format so come
  first), the splits the tool reads (present, not empty, not cut short, of
  no token beyond their dictionary) (binarized_files.py);
- the checkpoints named on the command line (present, and complete) and
  the one training continues from, against what they were trained with
  (read from the checkpoint): training continues a model with the options
  it was trained with, and the objective (--labels); a model trained to
  predict labels is not scored or sampled as a language model; and what
  --model-overrides changes of it (trained_options.py).

Every tool also checks a split as fairseq loads it (check_binarized), and
the models and tasks check their pairing as they are built
(models/plugin_model.py, check_model_and_task).
"""

from fairseq import utils
from fairseq.tasks import TASK_REGISTRY

from ..errors import FeedbackUsageError
from ..models import FeedbackLanguageModel
from ..models.plugin_model import check_model_and_task, model_class
from ..tasks import FeedbackLanguageModelingTask
from ..tasks.adaptive_span_loss import AdaptiveSpanLossMixin
from ..tasks.feedback_language_modeling import check_block
from .binarized_files import check_data, check_labels, scored_splits, training_splits
from .option_values import check_fairseq_options, check_model_options, check_precision, check_streams
from .trained_options import check_checkpoints


def check_tool(cfg, tool: str) -> None:
    """`tool`: the name of its module in fairseq_cli (train, eval_lm, ...)."""
    model = model_class(cfg.get("model"))  # only training builds a model from the command line
    _check(cfg, model, training_splits(cfg) if model is not None else scored_splits(cfg, tool), tool)


def check_generate(cfg) -> None:
    """fairseq-generate: the model comes from --path (its parser's --arch is a
    placeholder), and it reads --gen-subset."""
    _check(cfg, None, [(utils.split_paths(cfg.task.data)[0], cfg.dataset.gen_subset)], "generate")


def _check(cfg, model, reads, tool) -> None:
    task = TASK_REGISTRY.get(getattr(cfg.get("task"), "_name", None))
    if model is not None and task is not None:
        check_model_and_task(model, task)
        check_trained_by_task(cfg.model, task)
    if task is not None and issubclass(task, FeedbackLanguageModelingTask):
        check_streams(cfg)
        check_labels(cfg, training=model is not None)
    check_fairseq_options(cfg)
    check_precision(cfg, training=model is not None)
    if model is not None:
        check_model_options(cfg.model, model)
        check_positions(cfg, model)
    if task is not None and cfg.task.get("data"):
        check_data(cfg, task, reads, training=model is not None)
    check_checkpoints(cfg, model, tool)


# --- the model and the task ----------------------------------------------------------------------


def check_trained_by_task(model_cfg, task) -> None:
    """Learned spans need their loss added and their values kept in range,
    which only this plugin's tasks do."""
    if getattr(model_cfg, "adaptive_span", False) and not issubclass(task, AdaptiveSpanLossMixin):
        raise FeedbackUsageError("--adaptive-span is trained by this plugin's tasks, which add --adaptive-span-loss "
                                 "and keep the spans in range: use --task feedback_translation "
                                 "(feedback_language_modeling for a language model), or drop --adaptive-span")


def check_positions(cfg, model) -> None:
    """A feedback language model with absolute positions has as many as it has: blocks fit in them."""
    if issubclass(model, FeedbackLanguageModel) and not cfg.model.no_token_positional_embeddings:
        check_block(cfg.task.tokens_per_sample, cfg.model.max_target_positions)

