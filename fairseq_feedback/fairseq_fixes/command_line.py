"""A fairseq tool's whole command line, checked before its main runs: the entry, and the order.

What fairseq raises as a tool starts is one line (one_line.py), and a folder the run created goes
with it (patches.py); so a check is here only where fairseq is silent or late (option_values.py says
how). patches.py has each tool call check_tool (via distributed_utils.call_main) or check_generate.
In this order: the model with the task (models/plugin_model.py; first, so that no later check speaks
of what follows from a wrong pairing), the streaming task's options, fairseq's options and devices
(option_values.py), the model's options (then models/feedback_config.py's), the data
(binarized_files.py), and the checkpoints against what they were trained with (trained_options.py).
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
    """fairseq-generate: the model comes from --path (its parser's --arch is a placeholder)."""
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
