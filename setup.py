from setuptools import find_packages, setup

setup(
    name="fairseq-feedback",
    version="0.1.0",
    description="Feedback Transformer (Fan et al. 2020) for fairseq: translation, summarization and language models",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    # tested on 3.11 and 3.12
    python_requires=">=3.11",
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
    ],
    packages=find_packages(include=["fairseq_feedback", "fairseq_feedback.*", "fairseq_feedback_cli",
                                    "fairseq_feedback_cli.*"]),
    install_requires=[
        # the official fairseq 0.12.2 does not import on Python >= 3.11; fairseq-fixed
        # is fairseq main with that fix, and imports as `fairseq`
        "fairseq-fixed==0.12.3.1",
        # from 2.6 on (docs/install.md: the tested range, and how to install beside a torch); "a0": a
        # build of 2.6 from source or a vendor's container calls itself 2.6.0a0+<commit>, which pip
        # puts below 2.6. What an older torch lacks is looked up by name, not by version
        # (fairseq_feedback/cuda_graphs/capabilities.py): CUDA graphs stay off, said in one line
        "torch>=2.6.0a0",
        # numpy 2 too: what it removed and fairseq's data classes call, the plugin gives back (patches.py)
        "numpy",
        "sacrebleu>=2.0",
        "sacremoses",
        "sentencepiece",
        "subword-nmt",
        "matplotlib",
        # ROUGE for the CNN-DailyMail recipe (feedback-score --metric rouge)
        "rouge-score",
    ],
    # pytest-xdist: `make test` runs the tests on every core
    extras_require={"test": ["pytest", "pytest-xdist"]},
    entry_points={
        "console_scripts": [
            "feedback-benchmark = fairseq_feedback_cli.benchmark:main",
            "feedback-average-checkpoints = fairseq_feedback_cli.average_checkpoints:main",
            "feedback-score = fairseq_feedback_cli.score:main",
            "feedback-evaluate-toy = fairseq_feedback_cli.toy.evaluate:cli",
            "feedback-gpu-check = fairseq_feedback_cli.gpu_check.cli:main",
        ],
    },
)
