"""A tool's whole command line, checked before the tool's main creates anything.

fairseq-train creates --save-dir as its main begins, and only then reads the
data, builds the model and loads a checkpoint: a mistake found there leaves
an empty save dir behind. fairseq's tools hand the parsed configuration to
distributed_utils.call_main (train, eval-lm, interactive, validate,
hydra-train), which the plugin wraps (fairseq_fixes.py) to run
check_command_line first. What it checks:

- what the models and tasks of this plugin need of it: each has
  `check_command_line(cfg, model, task)`, which checks its own options and
  the other, both given as classes (`model` is None unless the tool trains
  one, which it builds from the command line);
- the splits a training run reads exist and have lines, in fairseq's layout
  of the task (fairseq-preprocess's, monolingual or bilingual); every tool
  checks a split for lines as fairseq loads it (check_not_empty);
- a checkpoint named to resume or fine-tune from exists and is complete.

Model options alone are checked earlier, as fairseq parses them, by the
architectures (models/feedback_config.py); those of the architecture
`feedback_lm`, whose defaults fairseq applies only after, here.
"""

import os

from fairseq import utils
from fairseq.data import data_utils, indexed_dataset
from fairseq.models import ARCH_MODEL_REGISTRY
from fairseq.tasks import TASK_REGISTRY
from fairseq.tasks.language_modeling import LanguageModelingTask
from fairseq.tasks.translation import TranslationTask

from .checkpoints import check_complete
from .errors import FeedbackUsageError


def model_class(model_cfg):
    """The class an architecture's configuration builds, as fairseq's build_model finds it (None: none)."""
    if model_cfg is None:
        return None
    return ARCH_MODEL_REGISTRY.get(getattr(model_cfg, "_name", None) or getattr(model_cfg, "arch", None))


def check_command_line(cfg) -> None:
    task = TASK_REGISTRY.get(getattr(cfg.get("task"), "_name", None))
    model = model_class(cfg.get("model"))  # only training builds a model from the command line
    for part in (model, task):
        if hasattr(part, "check_command_line"):
            part.check_command_line(cfg, model, task)
    if model is not None and task is not None:
        check_training_data(cfg, task)
        check_resumed_checkpoint(cfg)


# --- the data ------------------------------------------------------------------------------------


def check_not_empty(prefix: str) -> None:
    """A binarized split of no lines is an empty .bin (every line holds at
    least its end-of-sentence token), which fairseq fails to read (numpy
    cannot map an empty file)."""
    data = indexed_dataset.data_file_path(prefix)
    if os.path.isfile(data) and os.path.getsize(data) == 0:
        raise FeedbackUsageError(f"{data} holds no lines (fairseq-preprocess was given an empty file): "
                                 "binarize the split again from a file with text")


def check_split(prefix: str, impl, missing: str) -> None:
    """A split fairseq-preprocess wrote (PREFIX.bin and .idx), with lines; `missing` says what to do without it."""
    if not indexed_dataset.dataset_exists(prefix, impl=impl):
        raise FeedbackUsageError(missing)
    check_not_empty(prefix)


def monolingual_split(data: str, split: str, impl=None) -> str:
    """DATA/SPLIT, checked: the layout of fairseq-preprocess --only-source."""
    prefix = os.path.join(data, split)
    check_split(prefix, impl, f"split '{split}' not found in {data}: expected {split}.bin and {split}.idx "
                              "from fairseq-preprocess --only-source")
    return prefix


def _bilingual_split(data: str, split: str, src: str, tgt: str, impl) -> None:
    """DATA/SPLIT.SRC-TGT.{SRC,TGT} (or TGT-SRC), as fairseq's translation task reads it."""
    pair = next((p for p in (f"{src}-{tgt}", f"{tgt}-{src}")
                 if indexed_dataset.dataset_exists(os.path.join(data, f"{split}.{p}.{src}"), impl=impl)), None)
    expected = f"{split}.{src}-{tgt}.{src}.bin/.idx and {split}.{src}-{tgt}.{tgt}.bin/.idx"
    for lang in (src, tgt):
        check_split(os.path.join(data, f"{split}.{pair or f'{src}-{tgt}'}.{lang}"), impl,
                    f"split '{split}' not found in {data}: expected {expected} from fairseq-preprocess")


def training_splits(cfg):
    """(data directory, split) of what fairseq-train reads: the training split
    of every data directory (one per epoch, in turn) and the validation
    splits of the first."""
    paths = utils.split_paths(cfg.task.data)
    valid = [] if cfg.dataset.disable_validation else cfg.dataset.valid_subset.split(",")
    return [(path, cfg.dataset.train_subset) for path in paths] + [(paths[0], split) for split in valid]


def check_training_data(cfg, task) -> None:
    reads = training_splits(cfg)
    for path in dict(reads):
        if not os.path.isdir(path):
            raise FeedbackUsageError(f"data directory {path} not found: pass the --destdir of fairseq-preprocess")
    impl = cfg.dataset.dataset_impl
    if issubclass(task, LanguageModelingTask):
        for path, split in reads:
            monolingual_split(path, split, impl)
    elif issubclass(task, TranslationTask):
        src, tgt = cfg.task.source_lang, cfg.task.target_lang
        if src is None or tgt is None:
            src, tgt = data_utils.infer_language_pair(reads[0][0])
        if src is None or tgt is None:
            raise FeedbackUsageError(f"no binarized data found in {reads[0][0]}: check the data directory, "
                                     "or pass --source-lang and --target-lang")
        for path, split in reads:
            _bilingual_split(path, split, src, tgt, impl)


# --- checkpoints ---------------------------------------------------------------------------------


def check_resumed_checkpoint(cfg) -> None:
    """A checkpoint named with --restore-file (other than the default,
    checkpoint_last.pt in --save-dir), which fairseq-train silently replaces
    by a fresh model when it does not exist, or with --finetune-from-model,
    read when --save-dir holds no checkpoint_last.pt yet."""
    checkpoint = cfg.checkpoint
    if cfg.distributed_training.use_sharded_state:
        return  # one file per rank, named by fairseq-train as it runs
    suffix = checkpoint.checkpoint_suffix or ""
    named = {}
    if checkpoint.restore_file != "checkpoint_last.pt":
        named["--restore-file"] = checkpoint.restore_file.replace(".pt", suffix + ".pt")
    elif not os.path.exists(os.path.join(checkpoint.save_dir, f"checkpoint_last{suffix}.pt")):
        named["--finetune-from-model"] = checkpoint.finetune_from_model
    for option, path in named.items():
        if path is None:
            continue
        if not os.path.isfile(path):
            raise FeedbackUsageError(f"{option} {path} not found: check the path")
        check_complete(path)
