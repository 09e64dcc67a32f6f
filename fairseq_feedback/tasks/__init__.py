from .feedback_language_modeling import FeedbackLanguageModelingTask

__all__ = ["FeedbackLanguageModelingTask"]
