"""python -m fairseq_feedback_cli.gpu_check: feedback-gpu-check."""

from .cli import main

if __name__ == "__main__":
    main()
