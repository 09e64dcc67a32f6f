"""A fairseq tool's whole command line, checked before the tool creates anything: the entry, and the
order of the checks.

fairseq-train creates --save-dir as its main begins, and fairseq-generate its --results-path; only
then do they read the data, build the model and load checkpoints. What fairseq raises there is one
line by one rule (one_line.py), and a folder the run created goes with it (patches.py); so a check
runs before the tool only where fairseq would not raise in time: where it is silent (takes the
mistake without a word) or late (fails once the run is under way), each labelled so where it is
(option_values.py says how). patches.py has each tool call check_tool (train, eval-lm, interactive,
validate, hydra-train: they hand their configuration to distributed_utils.call_main) or
check_generate (fairseq-generate). In this order:

- the model with the task, both as classes (the model is None unless the tool trains one, which it
  builds from the command line): the models and tasks refuse a wrong pairing as they are built
  (models/plugin_model.py), and here it comes first, so that no later check speaks of what follows
  from it; a model with learned spans under a task that does not train them (silent);
- the streaming task's options (tasks/feedback_language_modeling.py, check_stream_options);
- fairseq's own options by their ranges, those that go together, the devices (option_values.py);
- the model's options: fairseq's (option_values.py), then the decoder's (models/feedback_config.py);
- the data the tool reads (binarized_files.py);
- the checkpoints named on the command line and the one training continues from, against what they
  were trained with (trained_options.py).
"""

from fairseq import utils
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.translation import TranslationTask

from ..errors import FeedbackUsageError
from ..models.plugin_model import check_model_and_task, model_class
from ..tasks import FeedbackLanguageModelingTask
from ..tasks.adaptive_span_loss import AdaptiveSpanLossMixin
from ..tasks.feedback_language_modeling import check_stream_options
from .binarized_files import check_data, check_labels, language_pair, scored_splits, training_splits
from .option_values import check_fairseq_options, check_model_options, check_precision, check_shards
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
        check_stream_options(cfg)
        check_labels(cfg, training=model is not None)
    check_fairseq_options(cfg)
    check_shards(cfg, tool)
    check_precision(cfg)
    if model is not None:
        check_model_options(cfg.model, model)
    if task is not None and cfg.task.get("data"):
        check_data(cfg, task, reads)
        if model is not None and issubclass(task, TranslationTask):  # the direction the checkpoints record
            cfg.task.source_lang, cfg.task.target_lang = language_pair(cfg.task)  # (trained_options.check_direction)
    check_checkpoints(cfg, model, tool)


def check_trained_by_task(model_cfg, task) -> None:
    """Silent: learned spans need their loss added and their values kept in range, which only this
    plugin's tasks do (fairseq's train them as fixed spans)."""
    if getattr(model_cfg, "adaptive_span", False) and not issubclass(task, AdaptiveSpanLossMixin):
        raise FeedbackUsageError("--adaptive-span is trained by this plugin's tasks, which add --adaptive-span-loss "
                                 "and keep the spans in range: use --task feedback_translation "
                                 "(feedback_language_modeling for a language model), or drop --adaptive-span")
