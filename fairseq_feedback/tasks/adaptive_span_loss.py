"""The adaptive-span loss, for any criterion.

fairseq's criteria know nothing of a model's auxiliary losses, so the task
adds it: the criterion's loss is a sum over `sample_size` tokens that the
trainer divides by `sample_size`, hence the span loss enters multiplied by it.
"""

from fairseq import metrics

from ..models.plugin_model import check_model_and_task, model_class


class _WithSpanLoss:
    def __init__(self, criterion):
        self.criterion = criterion

    def __call__(self, model, sample):
        loss, sample_size, logging_output = self.criterion(model, sample)
        span_loss = model.decoder.span_loss()
        if span_loss is not None:
            loss = loss + span_loss * sample_size
            logging_output["span_loss"] = span_loss.item()
            logging_output["span"] = model.decoder.current_span()
        return loss, sample_size, logging_output


class AdaptiveSpanLossMixin:
    """For tasks of models with a FeedbackDecoder (this plugin's): refuses other
    models, adds the span loss to the training loss, logs it and the memory
    kept, and clamps the spans to [0, --memory-span] after each update."""

    def build_model(self, cfg, from_checkpoint=False):
        # before fairseq's language-modelling task fails on another kind of model
        check_model_and_task(model_class(cfg), type(self))
        return super().build_model(cfg, from_checkpoint)

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        return super().train_step(sample, model, _WithSpanLoss(criterion), optimizer, update_num, ignore_grad)

    def optimizer_step(self, optimizer, model, update_num):
        super().optimizer_step(optimizer, model, update_num)
        model.decoder.clamp_spans()

    def reduce_metrics(self, logging_outputs, criterion):
        super().reduce_metrics(logging_outputs, criterion)
        logged = [log for log in logging_outputs if "span_loss" in log]
        if logged:
            metrics.log_scalar("span_loss", sum(log["span_loss"] for log in logged) / len(logged), round=4)
            metrics.log_scalar("span", sum(log["span"] for log in logged) / len(logged), round=1)
