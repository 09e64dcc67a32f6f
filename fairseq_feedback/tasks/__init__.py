from .feedback_language_modeling import FeedbackLanguageModelingTask
from .feedback_translation import FeedbackTranslationTask

__all__ = ["FeedbackLanguageModelingTask", "FeedbackTranslationTask"]
