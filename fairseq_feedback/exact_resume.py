"""A resumed translation run trains on the batches an uninterrupted one does.

fairseq groups an epoch's sentences into batches with the seed of the epoch
its batch iterator was made in, and by default keeps those batches for the
epochs that follow (only their order changes). A run resumed in epoch E makes
its iterator anew, so from then on it trains on other batches than a run that
never stopped: after a few hundred updates their parameters differ by
hundredths. With --update-epoch-batch-itr True every epoch makes its own
batches from its own seed, in both runs, so they stay equal.

That is the default for this plugin's translation architectures
(feedback_transformer*), with --task translation or feedback_translation. A
value given on the command line is kept. The streaming feedback_language_modeling
task has a fixed block order and needs none of this.
"""

import functools

from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_NAME_REGISTRY


def _new_batches_each_epoch(architecture):
    @functools.wraps(architecture)
    def with_new_batches_each_epoch(args):
        # fairseq declares --update-epoch-batch-itr without a type (its default is
        # the interpolation ${dataset.grouped_shuffling}): a value given on the
        # command line is still a string here, fairseq's default a bool
        if isinstance(getattr(args, "update_epoch_batch_itr", None), bool):
            args.update_epoch_batch_itr = True
        architecture(args)

    with_new_batches_each_epoch.new_batches_each_epoch = True
    return with_new_batches_each_epoch


def exact_resume_by_default() -> None:
    for arch, model in ARCH_MODEL_NAME_REGISTRY.items():
        function = ARCH_CONFIG_REGISTRY[arch]
        if model == "feedback_transformer" and not getattr(function, "new_batches_each_epoch", False):
            ARCH_CONFIG_REGISTRY[arch] = _new_batches_each_epoch(function)
