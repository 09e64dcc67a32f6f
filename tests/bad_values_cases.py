"""The cases of tests/test_bad_values.py's sweep: each a command line and a fragment of the one
error line it must stop with, before any output path is created. {LM}, {TR}, ... name the files
of that module's fixture; {OUT} a path that must not appear. Most run the tool's own function on
the command line in the test's process; those marked cold start `python -m` like a user's shell
does, in a new process: one for each kind of tool (fairseq-train, -generate and -eval-lm, and this
project's own), as a cold start costs 5-8 s of CPU where a case in the process costs about one.

What is accepted at 0 and below, on purpose (not cases here):
- --dropout and the other probabilities at 0, --persistent-vectors,
  --adaptive-span-loss and --encoder-layers at 0 (an encoder of embeddings
  only, which fairseq allows), --adaptive-span-init at 0: they work;
- --min-params-to-wrap (fully sharded training only) and --base-sublayers,
  --base-shuffle (BASE layers only, which the feedback decoder refuses):
  options these models never read.
"""

from dataclasses import dataclass

from fairseq_feedback_cli import machine


@dataclass
class Case:
    tool: str  # a fairseq tool (train, generate, eval_lm, interactive) or a module of this project's tools
    argv: list  # {LM}, {TR}, ... name the fixture's files; {OUT} a path that must not appear
    message: str  # a fragment of the one error line
    stdin: str = ""
    cold: bool = False  # run by `python -m` in a new process, not in this one


TINY = ["--decoder-layers", "2", "--decoder-embed-dim", "16", "--decoder-ffn-embed-dim", "32",
        "--decoder-attention-heads", "2", "--memory-span", "8", "--optimizer", "adam", "--lr", "1e-3", "--cpu",
        "--max-update", "1", "--no-epoch-checkpoints", "--save-dir", "{OUT}"]
LM_TRAIN = ["{LM}", "--task", "feedback_language_modeling", "--arch", "feedback_lm", *TINY, "--tokens-per-sample", "8",
            "--batch-size", "2"]
TR_TRAIN = ["{TR}", "--arch", "feedback_transformer", *TINY, "--encoder-layers", "1", "--encoder-embed-dim", "16",
            "--encoder-ffn-embed-dim", "32", "--encoder-attention-heads", "2", "--max-tokens", "200"]
EVAL_LM = ["{LM}", "--task", "feedback_language_modeling", "--path", "{LM_CKPT}", "--cpu"]
GENERATE = ["{TR}", "--path", "{TR_CKPT}", "--cpu"]
LABELS_MODEL = ["{LM}", "--task", "feedback_language_modeling", "--path", "{LABELS_CKPT}", "--cpu"]


def lm(*flags, data="{LM}", cold=False, message):
    return Case("train", [data, *LM_TRAIN[1:], *flags], message, cold=cold)


def tr(*flags, data="{TR}", cold=False, message):
    return Case("train", [data, *TR_TRAIN[1:], *flags], message, cold=cold)


def at_least(low, *names):
    """Each option one below its lowest value: the check reads the range, so the value at its edge stands for
    every value beyond it."""
    return [(name, low - 1, f"--{name} must be at least {low}, got {low - 1}") for name in names]


def literally(text):
    """A value whose braces are not the sweep's placeholders (a Python dict given on the command line)."""
    return text.replace("{", "{{").replace("}", "}}")


def bounded(bound, values, *names):
    return [(name, value, f"--{name} must be {bound}, got {value}") for name in names for value in values]


MODEL_OPTIONS = [
    "memory-span", "head-dim", "decoder-layers", "decoder-embed-dim", "decoder-ffn-embed-dim",
    "decoder-attention-heads", "max-target-positions",
]
LM_NUMBERS = (
    at_least(1, *MODEL_OPTIONS, "adaptive-span-ramp", "character-embedding-dim", "quant-noise-pq-block-size")
    + at_least(0, "persistent-vectors", "adaptive-span-loss", "char-embedder-highway-layers")
    + bounded("greater than 0", [0], "adaptive-input-factor", "adaptive-softmax-factor")
    + bounded("in [0, 1)", [-1], "dropout", "attention-dropout", "activation-dropout", "relu-dropout",
              "adaptive-softmax-dropout", "decoder-layerdrop", "quant-noise-pq", "quant-noise-scalar")
    + bounded("in [0, 1)", [1], "dropout")
    + bounded("in [0, 1]", [-1], "adaptive-span-init")
    + at_least(1, "tokens-per-sample", "batch-size", "batch-size-valid")
)
# fairseq's own options of generation and batching, as fairseq-generate and fairseq-interactive take them
GENERATE_NUMBERS = (
    at_least(1, "nbest", "batch-size", "max-tokens", "required-batch-size-multiple")
    + at_least(0, "max-len-a", "min-len", "no-repeat-ngram-size", "prefix-size")
)
# fairseq's options of training, by the part of fairseq that reads them: the loop, the optimizer, the criterion
TRAINING_NUMBERS = (
    at_least(1, "update-freq", "validate-interval", "save-interval", "log-interval")
    + bounded("at least 0", [-1], "max-update", "clip-norm", "save-interval-updates", "weight-decay")
    + bounded("greater than 0", [0], "lr", "adam-eps")
)
TR_NUMBERS = (
    at_least(1, *MODEL_OPTIONS, "encoder-embed-dim", "encoder-ffn-embed-dim", "encoder-attention-heads")
    + at_least(0, "encoder-layers", "persistent-vectors", "adaptive-span-loss")
    + bounded("in [0, 1)", [-1], "dropout", "attention-dropout", "activation-dropout", "encoder-layerdrop",
              "decoder-layerdrop")
)

CASES = {
    **{f"lm --{name} {value}": lm(f"--{name}", str(value), message=message) for name, value, message in LM_NUMBERS},
    **{f"translation --{name} {value}": tr(f"--{name}", str(value), message=message)
       for name, value, message in TR_NUMBERS},
    **{f"generate --{name} {value}": Case("generate", [*GENERATE, f"--{name}", str(value)], message)
       for name, value, message in GENERATE_NUMBERS},
    "generate --max-len-b below --min-len": Case(
        "generate", [*GENERATE, "--max-len-b", "0"], "AssertionError: min_len cannot be larger than max_len, please "
                                                     "adjust these! (in fairseq.sequence_generator"),
    "generate --beam 0": Case("generate", [*GENERATE, "--beam", "0"], "--nbest 1 is more than --beam 0"),
    "interactive --beam 0": Case("interactive", [*GENERATE, "--beam", "0"], "--nbest 1 is more than --beam 0",
                                 stdin="s1 s2\n"),
    "translation --batch-size 0": tr("--batch-size", "0", message="--batch-size must be at least 1, got 0"),
    "translation --num-batch-buckets without --max-tokens": Case(
        "train", [*[a for a in TR_TRAIN if a not in ("--max-tokens", "200")], "--batch-size", "2",
                  "--num-batch-buckets", "2"], "--num-batch-buckets batches by tokens: add --max-tokens"),
    "lm --memory-span 0 (cold)": lm("--memory-span", "0", cold=True, message="--memory-span must be at least 1, got 0"),
    "lm --base-layers -1": lm("--base-layers", "-1", message="--base-layers is not supported by the feedback decoder"),
    # the streams' batches
    "lm --max-tokens 0": lm("--max-tokens", "0", message="--max-tokens 0 holds no block of --tokens-per-sample 8"),
    "lm --max-tokens -1": lm("--max-tokens", "-1", message="--max-tokens -1 holds no block"),
    "lm --max-tokens below a block": lm("--max-tokens", "4", message="--max-tokens 4 holds no block"),
    "lm blocks longer than the positions": lm(
        "--relative-positions", "False", "--no-token-positional-embeddings", "False", "--max-target-positions", "4",
        message="--tokens-per-sample 8 is longer than the model allows (4): use shorter blocks"),
    "lm --max-tokens-valid 0": lm("--max-tokens-valid", "0", message="--max-tokens-valid 0 holds no block"),
    "eval-lm --batch-size 0": Case("eval_lm", [*EVAL_LM, "--batch-size", "0"], "--batch-size must be at least 1"),
    "eval-lm --batch-size -1": Case("eval_lm", [*EVAL_LM, "--batch-size", "-1"], "--batch-size must be at least 1"),
    "eval-lm --tokens-per-sample 0": Case("eval_lm", [*EVAL_LM, "--tokens-per-sample", "0"],
                                          "--tokens-per-sample must be at least 1, got 0"),
    "eval-lm --tokens-per-sample -1": Case("eval_lm", [*EVAL_LM, "--tokens-per-sample", "-1"],
                                           "--tokens-per-sample must be at least 1, got -1"),
    "eval-lm --max-tokens 0": Case("eval_lm", [*EVAL_LM, "--max-tokens", "0"], "--max-tokens 0 holds no block"),
    # labels
    "lm --labels missing": lm("--labels", "nolabels", message="labels dictionary {LM}/nolabels/dict.txt not found"),
    "lm --ignore-label without --labels": lm("--ignore-label", "x", message="--ignore-label is a label of --labels"),
    "lm --ignore-label not a label": lm("--labels", "labels", "--ignore-label", "zzz",
                                        message="--ignore-label 'zzz' is not a label of labels"),
    "lm --labels with no valid labels": lm("--labels", "labels", data="{LM_NO_VALID_LABELS}",
                                           message="split 'valid' not found in {LM_NO_VALID_LABELS}/labels"),
    # options the chosen task ignores
    **{f"lm {' '.join(flags)}": lm(*flags, message=f"--task feedback_language_modeling does not use {flags[0]}")
       for flags in (["--sample-break-mode", "eos"], ["--shorten-method", "truncate"], ["--add-bos-token"],
                     ["--self-target"], ["--pad-to-fixed-length"])},
    "translation --adaptive-span under --task translation": tr(
        "--adaptive-span", "--adaptive-span-loss", "1e-4", message="use --task feedback_translation"),
    "translation --adaptive-span-loss without --adaptive-span": tr(
        "--task", "feedback_translation", "--adaptive-span-loss", "1e-4",
        message="--adaptive-span-loss is the loss of learned spans: add --adaptive-span"),
    "lm --adaptive-span under --task language_modeling": lm(
        "--task", "language_modeling", "--adaptive-span", message="--adaptive-span is trained by this plugin's tasks"),
    # a model given to the other task
    "feedback_lm under --task translation": Case(
        "train", ["{TR}", "--arch", "feedback_lm", "--max-tokens", "200", "--cpu", "--save-dir", "{OUT}"],
        "feedback_lm is a language model: use --task feedback_language_modeling"),
    "feedback_lm_wiki103 under --task translation": Case(
        "train", ["{TR}", "--arch", "feedback_lm_wiki103", "--max-tokens", "200", "--cpu", "--save-dir", "{OUT}"],
        "feedback_lm is a language model"),
    "feedback_transformer under --task feedback_language_modeling": tr(
        "--task", "feedback_language_modeling", data="{LM}", message="feedback_transformer is a translation model"),
    "feedback_transformer under --task language_modeling": tr(
        "--task", "language_modeling", data="{LM}", message="feedback_transformer is a translation model"),
    "transformer_lm under --task feedback_language_modeling": Case(
        "train", ["{LM}", "--task", "feedback_language_modeling", "--arch", "transformer_lm", "--tokens-per-sample",
                  "8", "--batch-size", "2", "--cpu", "--save-dir", "{OUT}"], "only --arch feedback_lm"),
    "transformer under --task feedback_translation": Case(
        "train", ["{TR}", "--task", "feedback_translation", "--arch", "transformer", "--max-tokens", "200", "--cpu",
                  "--save-dir", "{OUT}"], "--task feedback_translation adds the span loss of a feedback decoder"),
    "generate -s/-t swapped": Case("generate", [*GENERATE, "-s", "tgt", "-t", "src"],
                                   "translates src to tgt, and this command line asks for tgt to src: pass -s src -t tgt"),
    "interactive -s/-t swapped": Case("interactive", [*GENERATE, "-s", "tgt", "-t", "src"],
                                      "translates src to tgt, and this command line asks for tgt to src", stdin="t1\n"),
    "generate: a language model's checkpoint": Case(
        "generate", ["{TR}", "--path", "{LM_CKPT}", "--cpu"], "feedback_lm is a language model"),
    "eval-lm: a translation model's checkpoint": Case(
        "eval_lm", ["{LM}", "--task", "feedback_language_modeling", "--path", "{TR_CKPT}", "--cpu"],
        "which only --arch feedback_lm (and feedback_lm_*) does"),
    # attention heads
    "lm heads do not divide the dimension": lm("--decoder-attention-heads", "3",
                                               message="change one, or set --head-dim"),
    "translation heads do not divide, --head-dim set": tr(
        "--decoder-attention-heads", "3", "--head-dim", "8",
        message="--decoder-embed-dim 16 is not divisible by --decoder-attention-heads 3: change one (the decoder's "
                "attention over the encoder"),
    "translation encoder heads do not divide": tr(
        "--encoder-attention-heads", "3", message="--encoder-embed-dim 16 is not divisible by "
                                                  "--encoder-attention-heads 3: change one"),
    # splits: missing, or of no lines
    "lm: no valid split": lm(data="{LM_NO_VALID}", message="split 'valid' not found in {LM_NO_VALID}"),
    "lm: no such --train-subset": lm("--train-subset", "nosuch", message="split 'nosuch' not found in {LM}"),
    "lm: empty train split": lm(data="{LM_EMPTY}", message="{LM_EMPTY}/train.bin holds no lines"),
    "lm: data directory missing": lm(data="{OUT}-data", message="dictionary {OUT}-data/dict.txt not found: point the "
                                                                "data directory at the --destdir of fairseq-preprocess"),
    "eval-lm: no test split": Case("eval_lm", [*EVAL_LM, "--gen-subset", "nosuch"], "split 'nosuch' not found in {LM}"),
    "eval-lm: empty test split": Case("eval_lm", ["{LM_EMPTY}", *EVAL_LM[1:], "--gen-subset", "test"],
                                      "{LM_EMPTY}/test.bin holds no lines"),
    "translation: no valid split": tr(data="{TR_NO_VALID}", message="split 'valid' not found in {TR_NO_VALID}"),
    "translation: empty train split": tr(data="{TR_EMPTY}",
                                          message="{TR_EMPTY}/train.src-tgt.src.bin holds no lines"),
    "translation: no language pair": tr(data="{LM}", message="no binarized data found in {LM}"),
    "generate: no test split": Case("generate", [*GENERATE, "--gen-subset", "nosuch"],
                                    "split 'nosuch' not found in {TR}"),
    "generate: empty test split": Case("generate", ["{TR_EMPTY}", *GENERATE[1:], "--gen-subset", "test"],
                                       "{TR_EMPTY}/test.src-tgt.src.bin holds no lines"),
    # checkpoints given explicitly: missing, cut short, empty, not a checkpoint
    "lm --restore-file missing": lm("--restore-file", "{OUT}.pt", message="--restore-file {OUT}.pt not found"),
    "lm --restore-file truncated": lm("--restore-file", "{TRUNCATED}", message="{TRUNCATED} is truncated"),
    "lm --finetune-from-model missing": lm("--finetune-from-model", "{OUT}.pt",
                                           message="--finetune-from-model {OUT}.pt not found"),
    "lm --finetune-from-model truncated": lm("--finetune-from-model", "{TRUNCATED}",
                                             message="{TRUNCATED} is truncated"),
    "translation --restore-file empty": tr("--restore-file", "{EMPTY_FILE}", message="{EMPTY_FILE} is truncated"),
    "translation --restore-file not a checkpoint": tr(
        "--restore-file", "{TEXT_FILE}", message="{TEXT_FILE} is a text file (it begins 'not a checkpoint'), not a "
                                                 "checkpoint"),
    "generate --path truncated": Case("generate", ["{TR}", "--path", "{TRUNCATED}", "--cpu"],
                                      "{TRUNCATED} is truncated"),
    "generate --path truncated --results-path": Case(
        "generate", ["{TR}", "--path", "{TRUNCATED}", "--cpu", "--results-path", "{OUT}"], "{TRUNCATED} is truncated"),
    "generate --path missing": Case("generate", ["{TR}", "--path", "{OUT}.pt", "--cpu"],
                                    "{OUT}.pt not found: check the path"),
    "eval-lm --path truncated": Case("eval_lm", ["{LM}", "--path", "{TRUNCATED}", "--cpu"],
                                     "{TRUNCATED} is truncated"),
    "eval-lm --path not a checkpoint": Case("eval_lm", ["{LM}", "--path", "{TEXT_FILE}", "--cpu"],
                                            "{TEXT_FILE} is a text file (it begins 'not a checkpoint'), not a "
                                            "checkpoint"),
    "interactive --path truncated": Case("interactive", ["{TR}", "--path", "{TRUNCATED}", "--cpu"],
                                         "{TRUNCATED} is truncated", stdin="s1 s2\n"),
    "interactive --path empty": Case("interactive", ["{TR}", "--path", "{EMPTY_FILE}", "--cpu"],
                                     "{EMPTY_FILE} is truncated", stdin="s1 s2\n"),
    # half precision where fairseq cannot compute it as asked
    **{f"{name} --amp --cpu": Case(tool, argv, "--amp autocasts to half precision on a GPU, and --cpu asks for none "
                                               "(fairseq would compute in float32): drop --amp, or use --fp16",
                                   stdin=stdin)
       for name, tool, argv, stdin in (("lm", "train", [*LM_TRAIN, "--amp"], ""),
                                       ("eval-lm", "eval_lm", [*EVAL_LM, "--amp"], ""),
                                       ("generate", "generate", [*GENERATE, "--amp"], ""),
                                       ("interactive", "interactive", [*GENERATE, "--amp"], "s1 s2\n"))},
    **{f"{name} --bf16": Case(tool, argv, "--bf16 computes on a TPU in fairseq (--bf16 implies --tpu), through "
                                          "torch_xla, which is not installed: drop --bf16 (on a GPU: --fp16 or --amp)")
       for name, tool, argv in (("lm", "train", [*LM_TRAIN, "--bf16"]), ("eval-lm", "eval_lm", [*EVAL_LM, "--bf16"]))},
    # binarized files cut short
    "eval-lm: test.bin cut short": Case(
        "eval_lm", ["{LM_CUT}", *EVAL_LM[1:]],
        "{LM_CUT}/test.bin holds {CUT_BYTES} bytes where test.idx counts {TEST_BYTES}: it was cut short (or is of "
        "another binarization); binarize the split again with fairseq-preprocess"),
    "lm: train.idx cut short": lm(data="{LM_CUT}", message="{LM_CUT}/train.idx is cut short: binarize the split "
                                                           "again with fairseq-preprocess"),
    "generate: the test split's source .bin cut short": Case("generate", ["{TR_CUT}", *GENERATE[1:]],
                                                             "{TR_CUT}/test.src-tgt.src.bin holds"),
    # a checkpoint whose pickle would run code
    **{f"{tool.replace('_', '-')} --path: a checkpoint that would run code": Case(
        tool, [*argv, "--path", "{EVIL}", "--cpu"], "{EVIL} holds objects a fairseq checkpoint does not "
        "(posix.system), so it was not loaded: loading it could run code it carries", stdin="s1\n")
       for tool, argv in (("eval_lm", ["{LM}", "--task", "feedback_language_modeling"]), ("generate", ["{TR}"]),
                          ("interactive", ["{TR}"]))},
    **{f"lm {option}: a checkpoint that would run code": lm(option, "{EVIL}", message="{EVIL} holds objects")
       for option in ("--restore-file", "--finetune-from-model")},
    # a model continued with other options, or to another objective
    "lm --restore-file with another --memory-span": lm(
        "--restore-file", "{LM_CKPT}", "--memory-span", "16",
        message="{LM_CKPT} was trained with --memory-span 8, and this command line asks for --memory-span 16: "
                "continue it with --memory-span 8, or drop --restore-file"),
    "lm --finetune-from-model with --no-feedback and another depth": lm(
        "--finetune-from-model", "{LM_CKPT}", "--no-feedback", "--decoder-layers", "3",
        message="{LM_CKPT} was trained with --decoder-layers 2 --no-feedback False, and this command line asks for "
                "--decoder-layers 3 --no-feedback True: continue it with --decoder-layers 2 --no-feedback False, or "
                "drop --finetune-from-model"),
    # no parameter depends on the span of a decoder without relative positions: fairseq trained on, silently
    "translation --restore-file with another --memory-span": tr(
        "--restore-file", "{TR_CKPT}", "--memory-span", "4",
        message="{TR_CKPT} was trained with --memory-span 8, and this command line asks for --memory-span 4"),
    "translation --restore-file with another --encoder-layers": tr(
        "--restore-file", "{TR_CKPT}", "--encoder-layers", "2",
        message="{TR_CKPT} was trained with --encoder-layers 1, and this command line asks for --encoder-layers 2"),
    "lm --restore-file of another model": Case(
        "train", ["{LM}", "--task", "language_modeling", "--arch", "transformer_lm", "--tokens-per-sample", "8",
                  "--batch-size", "2", "--cpu", "--save-dir", "{OUT}", "--restore-file", "{LM_CKPT}"],
        "the parameters of {LM_CKPT} do not fit this model (Missing key(s) in state_dict: "),
    "lm --restore-file: a labels model without --labels": lm(
        "--restore-file", "{LABELS_CKPT}",
        message="{LABELS_CKPT} was trained with --labels labels, to predict labels: continue it with --task "
                "feedback_language_modeling --labels labels, or drop --restore-file"),
    "lm --labels --restore-file: a language model": lm(
        "--labels", "labels", "--restore-file", "{LM_CKPT}",
        message="{LM_CKPT} was trained without --labels, to predict the next token: drop --labels labels, or drop "
                "--restore-file"),
    **{f"eval-lm{flags}: a labels model": Case(
        "eval_lm", [*LABELS_MODEL, *flags.split()],
        "{LABELS_CKPT} was trained with --labels labels: it predicts labels, not the next token that fairseq-eval-lm "
        "scores; score it with feedback-evaluate-toy, or fairseq-validate") for flags in ("", " --labels labels")},
    "eval-lm: a labels model (cold)": Case("eval_lm", LABELS_MODEL, "not the next token that fairseq-eval-lm scores",
                                           cold=True),
    "interactive: a labels model": Case("interactive", LABELS_MODEL, "not the next token that fairseq-interactive "
                                                                     "generates", stdin="s1 s2\n"),
    "validate --labels: a language model": Case(
        "validate", [*EVAL_LM, "--labels", "labels", "--batch-size", "2"],
        "{LM_CKPT} was trained without --labels, to predict the next token: drop --labels labels"),
    # a data error found once fairseq-train has made --save-dir: the folder goes again
    "lm --labels that do not align": lm("--labels", "labels", data="{LM_MISALIGNED}",
                                        message="labels {LM_MISALIGNED}/labels/valid do not align"),
    # destinations that cannot be written
    **{f"{option} under a file": Case(tool, [*argv, option, "{TEXT_FILE}/x"],
                                      "{TEXT_FILE}/x: Not a directory: a part of it is a file, not a folder")
       for tool, argv, option in (("train", LM_TRAIN, "--save-dir"), ("train", LM_TRAIN, "--log-file"),
                                  ("generate", GENERATE, "--results-path"))},
    **{f"{name} {option} under a file": Case(
        tool, [*argv, option, "{TEXT_FILE}/x"], f"{option} {{TEXT_FILE}}/x: {{TEXT_FILE}} is a file, not a folder")
       for name, tool, argv, option in (
           ("average_checkpoints", "fairseq_feedback_cli.average_checkpoints", ["--inputs", "{LM_CKPT}"], "--output"),
           ("evaluate_toy", "fairseq_feedback_cli.toy.evaluate",
            ["--task", "copy", "--data", "{LM}", "--path", "{LABELS_CKPT}"], "--output"),
           ("demo", "fairseq_feedback_cli.demo", ["--tiny"], "--out"),
           ("toy_tasks", "fairseq_feedback_cli.data_prep.toy_tasks", ["copy"], "--out"))},
    "average-checkpoints --output in /proc": Case(
        "fairseq_feedback_cli.average_checkpoints", ["--inputs", "{LM_CKPT}", "--output", "/proc/nope/avg.pt"],
        "--output /proc/nope/avg.pt: nothing can be written in /proc (No such file or directory): pass a path you "
        "can write to"),
    # this package's tools
    **{f"average-checkpoints {option} {value}": Case(
        "fairseq_feedback_cli.average_checkpoints", ["--inputs", "{LM}", "--num-epoch-checkpoints", "1", option,
                                                 str(value), "--output", "{OUT}"],
        f"{option} must be at least 1, got {value}")
       for option in ("--num-epoch-checkpoints", "--checkpoint-upper-bound") for value in (0, -1)},
    "average-checkpoints --num-update-checkpoints 0 (cold)": Case(
        "fairseq_feedback_cli.average_checkpoints", ["--inputs", "{LM}", "--num-update-checkpoints", "0", "--output",
                                                 "{OUT}"], "--num-update-checkpoints must be at least 1, got 0",
        cold=True),
    **{f"evaluate_toy {option} {value}": Case(
        "fairseq_feedback_cli.toy.evaluate", ["--task", "random_walk", "--data", "{LM}", "--path", "{LM_CKPT}", option,
                                          str(value), "--output", "{OUT}"], f"{option} must be at least 1, got {value}")
       for option in ("--batch-size", "--tokens-per-sample") for value in (0, -1)},
    **{f"demo --{option} {value}": Case("fairseq_feedback_cli.demo", ["--tiny", "--out", "{OUT}", f"--{option}",
                                                                       str(value)],
                                        f"--{option} must be in [{low}, " if option in ("threads", "seed") else
                                        f"--{option} must be at least {low}, got {value}")
       for option, low, values in (("updates", 1, (0, -1)), ("eval-every", 1, (0, -1)), ("threads", 1, (0, -1)),
                                   ("seed", 0, (-1,))) for value in values},
    **{f"feedback-benchmark --threads {value}": Case("fairseq_feedback_cli.benchmark",
                                                     ["--preset", "tiny", "--threads", str(value)],
                                                     "--threads must be in [1, ") for value in (0, -1)},
    "feedback-benchmark --preset nope": Case("fairseq_feedback_cli.benchmark", ["--preset", "nope"],
                                             "invalid choice: 'nope'"),
    # issue 45, the four kinds of mistake that fairseq's own code meets, whatever the option, file or moment
    # 1. a value that means nothing to fairseq: refused by its range, before the run
    **{f"lm --{name} {value}": lm(f"--{name}", str(value), message=message)
       for name, value, message in TRAINING_NUMBERS},
    "lm --update-freq 1,0": lm("--update-freq", "1,0", message="--update-freq must be at least 1, got 0"),
    "lm --seed -1": lm("--seed", "-1", message="ValueError: Seed must be between 0 and 2**32 - 1 (in fairseq_cli.train; "
                                               "check --seed -1"),  # raised in numpy's compiled code
    "lm --optimizer sgd --momentum 1": lm("--optimizer", "sgd", "--momentum", "1",
                                          message="--momentum must be in [0, 1), got 1"),
    "translation --label-smoothing 1.5": tr("--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "1.5",
                                            message="--label-smoothing must be in [0, 1), got 1.5"),
    "translation --lr-scheduler inverse_sqrt --warmup-updates 0": tr(
        "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "0",
        message="ZeroDivisionError: float division by zero (in fairseq.optim.lr_scheduler.inverse_square_root_schedule; "
                "check --warmup-updates 0"),
    "lm --lr-scheduler reduce_lr_on_plateau --lr-shrink 0": lm(
        "--lr-scheduler", "reduce_lr_on_plateau", "--lr-shrink", "0", message="--lr-shrink must be in (0, 1], got 0"),
    "generate --sampling-topp 1.5": Case("generate", [*GENERATE, "--sampling", "--sampling-topp", "1.5"],
                                         "--sampling-topp must be in (0, 1] (or -1: off), got 1.5"),
    "generate --sampling-topk 0": Case("generate", [*GENERATE, "--sampling", "--sampling-topk", "0"],
                                       "--sampling-topk must be at least 1 (or -1: off), got 0"),
    "generate --nbest above --beam": Case("generate", [*GENERATE, "--nbest", "3", "--beam", "2"],
                                          "--nbest 3 is more than --beam 2"),
    "eval-lm --softmax-batch 0": Case("eval_lm", [*EVAL_LM, "--softmax-batch", "0"],
                                      "--softmax-batch must be at least 1, got 0"),
    "eval-lm --shard-id 1": Case("eval_lm", [*EVAL_LM, "--shard-id", "1"], "--shard-id 1 is not below --num-shards 1"),
    "eval-lm --model-overrides with --dropout 1.5": Case(
        "eval_lm", [*EVAL_LM, "--model-overrides", literally("{'dropout': 1.5}")], "--dropout must be in [0, 1), got 1.5"),
    # 2. a structured option of the wrong shape or type
    "lm --adam-betas x": lm("--adam-betas", "x", message="NameError: name 'x' is not defined (in fairseq.optim.adam; "
                                                         "check --adam-betas x"),
    **{f"{tool.replace('_', '-')} --model-overrides {given}": Case(
        tool, [*argv, "--model-overrides", literally(given)],
        "--model-overrides must be a Python dict of option names and values")
       for tool, argv, given in (("eval_lm", EVAL_LM, "not a dict"), ("eval_lm", EVAL_LM, "[1, 2]"),
                                 ("generate", GENERATE, "{'beam': 5"))},
    "eval-lm --model-overrides of an option the checkpoint lacks": Case(
        "eval_lm", [*EVAL_LM, "--model-overrides", literally("{'nosuch': 1}")],
        "--model-overrides names nosuch, which {LM_CKPT} does not record (fairseq would ignore it)"),
    **{f"{tool.replace('_', '-')} --model-overrides {given}": Case(
        tool, [*argv, "--model-overrides", literally(given)], f"--model-overrides changes the model {{{checkpoint}}} holds "
                                                   f"(trained with {was}; asked for {now})")
       for tool, argv, checkpoint, given, was, now in (
           ("eval_lm", EVAL_LM, "LM_CKPT", "{'decoder_layers': 3}", "decoder_layers 2", "decoder_layers 3"),
           ("generate", GENERATE, "TR_CKPT", "{'encoder_embed_dim': 32}", "encoder_embed_dim 16",
            "encoder_embed_dim 32"))},
    # a plugin's option of the wrong type, refused as the command line refuses it (omegaconf refused it as
    # fairseq merged the overrides, in its words: the options of fairseq's models reached the model)
    "eval-lm --model-overrides with --adaptive-span-loss 'x'": Case(
        "eval_lm", [*EVAL_LM, "--model-overrides", literally("{'adaptive_span_loss': 'x'}")],
        "--adaptive-span-loss must be a number, got 'x'"),
    **{f"lm --decoder-layers-to-keep {keep}": lm(
        "--decoder-layers-to-keep", keep, message=f"--decoder-layers-to-keep must be numbers of layers below "
                                                  f"--decoder-layers 2, each once, as '0,2', got '{keep}'")
       for keep in ("x", "0,5", "1,1")},
    "translation --lr-scheduler tri_stage --phase-ratio of two": tr(
        "--lr-scheduler", "tri_stage", "--phase-ratio", "(0.5, 0.5)",
        message="omegaconf.errors.ConfigIndexError: list index out of range; full_key: phase_ratio[2]; "
                "reference_type=Optional[Tuple[float, float, float]]; object_type=list (in omegaconf.listconfig, "
                "from fairseq.optim.lr_scheduler.tri_stage_lr_scheduler; check --phase-ratio '(0.5, 0.5)'; "
                "for the whole traceback, rerun with FAIRSEQ_FEEDBACK_TRACEBACK=1)"),
    # 3. a malformed file that fairseq reads: its dictionaries read before the run, as fairseq reads them
    **{f"{name}: {file} with a word twice": Case(
        tool, [f"{{{data}}}", *argv[1:]], f"RuntimeError: Duplicate word found when loading Dictionary: '{word}'. "
                                          "Duplicate words can overwrite earlier ones by adding the #fairseq:overwrite "
                                          f"flag at the end of the corresponding row in the dictionary file. If using "
                                          f"the Camembert model, please download an updated copy of the model file. "
                                          f"(in fairseq.data.dictionary; reading {{{data}}}/{file}; for the whole "
                                          "traceback, rerun with FAIRSEQ_FEEDBACK_TRACEBACK=1)")
       for name, tool, argv, data, file, word in (
           ("lm", "train", LM_TRAIN, "LM_WORD_TWICE", "dict.txt", "s1"),
           ("eval-lm", "eval_lm", EVAL_LM, "LM_WORD_TWICE", "dict.txt", "s1"),
           ("generate", "generate", GENERATE, "TR_WORD_TWICE", "dict.tgt.txt", "s1"),
           ("lm --labels", "train", [*LM_TRAIN, "--labels", "labels"], "LM_LABELS_WORD_TWICE", "labels/dict.txt",
            "x"))},
    "lm: dict.txt with a line without its count": lm(
        data="{LM_NO_COUNT}", message="ValueError: Incorrect dictionary format, expected '<token> <cnt> [flags]'"),
    "lm: dict.txt cut short": lm(data="{LM_SHORT_DICT}", message="{LM_SHORT_DICT}/train.bin holds token 15, and "
                                                                 "{LM_SHORT_DICT}/dict.txt has 6 symbols"),
    "eval-lm: test.idx not an index": Case(
        "eval_lm", ["{LM_NOT_AN_INDEX}", *EVAL_LM[1:]],
        "AssertionError: Index file doesn't match expected format. Make sure that --dataset-impl is configured "
        "properly. (in fairseq.data.indexed_dataset; reading {LM_NOT_AN_INDEX}/test.idx"),
    "eval-lm --path: a file of torch.save without a model": Case(
        "eval_lm", [*EVAL_LM[:-3], "--path", "{NO_MODEL}", "--cpu"],
        "{NO_MODEL} holds no model's parameters, so it is not a checkpoint that fairseq-train wrote"),
    "interactive --input: not UTF-8 (as it reads)": Case(
        "interactive", [*GENERATE, "--input", "{NOT_UTF8}"],
        "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte (in "
        "fairseq_cli.interactive; check --input {NOT_UTF8}; reading {NOT_UTF8}"),
    # 4. a check of fairseq's that fires inside the run, at each moment of it
    "generate --beam 2 --sampling (as it starts)": Case(
        "generate", [*GENERATE, "--beam", "2", "--sampling"],
        "AssertionError: --sampling requires --nbest to be equal to --beam (in fairseq_cli.generate; check --beam 2, "
        "--sampling; for the whole traceback, rerun with FAIRSEQ_FEEDBACK_TRACEBACK=1)"),
    "generate --beam 2 --sampling (cold)": Case("generate", [*GENERATE, "--beam", "2", "--sampling"],
                                                "AssertionError: --sampling requires --nbest", cold=True),
    "interactive --batch-size above --buffer-size (as it starts)": Case(
        "interactive", [*GENERATE, "--batch-size", "4", "--buffer-size", "2"],
        "AssertionError: --batch-size cannot be larger than --buffer-size (in fairseq_cli.interactive; check "
        "--batch-size 4, --buffer-size 2", stdin="s1 s2\n"),
    "generate --sampling-topk without --sampling (building the search)": Case(
        "generate", [*GENERATE, "--sampling-topk", "3"],
        "AssertionError: --sampling-topk requires --sampling (in fairseq.tasks.fairseq_task; check --sampling-topk 3"),
    "translation --lr of two with inverse_sqrt (building the trainer)": tr(
        "--lr", "1e-3,1e-4", "--lr-scheduler", "inverse_sqrt",
        message="ValueError: Cannot use a fixed learning rate schedule with inverse_sqrt. Consider "
                "--lr-scheduler=fixed instead. (in fairseq.optim.lr_scheduler.inverse_square_root_schedule; check "
                "--lr-scheduler inverse_sqrt; for the whole traceback"),
    "lm --criterion adaptive_loss (building the criterion)": lm(
        "--criterion", "adaptive_loss", message="Exception: AdaptiveLoss is not compatible with the PyTorch version "
                                                "of DistributedDataParallel. Please use `--ddp-backend=legacy_ddp` "
                                                "instead. (in fairseq.criterions.adaptive_loss; for the whole traceback"),
    # fairseq's trainer saves crash.pt in --save-dir as the update fails: the folder goes all the same
    "lm --criterion legacy_masked_lm_loss (the first batch)": lm(
        "--criterion", "legacy_masked_lm_loss", message="KeyError: 'lm_target' (in fairseq.criterions.legacy_masked_lm"),
    "generate --score-reference --print-alignment": Case(
        "generate", [*GENERATE, "--score-reference", "--print-alignment"], "returns its alignments as it decodes"),
    "generate --constraints without constraints in the input (the first batch)": Case(
        "generate", [*GENERATE, "--constraints"], "(in fairseq.search; "),
    "lm --best-checkpoint-metric nosuch (validation mid-epoch)": lm(
        "--max-update", "3", "--validate-interval-updates", "1", "--best-checkpoint-metric", "nosuch",
        message="KeyError: 'nosuch' (in fairseq_cli.train; check --best-checkpoint-metric nosuch"),
    "translation --best-checkpoint-metric bleu (validation at the end)": tr(
        "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
        message="KeyError: 'bleu' (in fairseq_cli.train; check --best-checkpoint-metric bleu"),
}

# ---------------------------------------------------------------------- issue 54
CASES |= {
    # --model-overrides at inference: what changes the parameters' shapes is refused, naming them (the rest is
    # read: test_an_override_that_keeps_the_parameters_shapes_is_read_and_said)
    "eval-lm --model-overrides {'memory_span': 4}: learned relative positions over the span": Case(
        "eval_lm", [*EVAL_LM, "--model-overrides", literally("{'memory_span': 4}")],
        "--model-overrides changes the model {LM_CKPT} holds (trained with memory_span 8; asked for memory_span 4), "
        "and its parameters do not fit the model asked for (decoder.key_positions: 8x8 in the checkpoint, 4x8 "
        "asked): drop those; what may change is what keeps the parameters' shapes"),
    # --num-shards: fairseq-generate shards by it (test_generate_translates_the_shard_it_is_given); the tools
    # that do not shard took it without a word
    **{f"{name} --num-shards 2": Case(tool, [*argv, "--num-shards", "2"], f"fairseq-{name} reads its data whole, "
                                      "not by --num-shards", stdin="s1\n")
       for name, tool, argv in (("train", "train", LM_TRAIN), ("validate", "validate", [*EVAL_LM, "--batch-size", "2"]),
                                ("interactive", "interactive", GENERATE))},
    # 1. a file that is no checkpoint, whatever it is, named with what it holds, wherever a checkpoint is read
    "lm --restore-file: a zip archive of something else": lm(
        "--restore-file", "{ZIP}", message="{ZIP} is a zip archive of something else than a checkpoint (it holds "
                                           "notes.txt, weights.npy): check the path, or pass a checkpoint that "
                                           "fairseq-train wrote"),
    "eval-lm --path: model.tar.gz": Case("eval_lm", [*EVAL_LM[:-3], "--path", "{TAR_GZ}", "--cpu"],
                                         "{TAR_GZ} is a gzip archive (fairseq's pretrained models come as "
                                         "model.tar.gz: unpack it, and pass its model.pt), not a checkpoint"),
    "generate --path: a pickle of a list": Case("generate", ["{TR}", "--path", "{PICKLE}", "--cpu"],
                                                "{PICKLE} is a Python pickle, not a file torch.save wrote"),
    "interactive --path: a folder": Case("interactive", ["{TR}", "--path", "{TR_CKPT_DIR}", "--cpu"],
                                         "{TR_CKPT_DIR} is a folder, not a checkpoint file: name the .pt file in it, "
                                         "as {TR_CKPT_DIR}/checkpoint_best.pt", stdin="s1\n"),
    "average-checkpoints --inputs: a tensor": Case(
        "fairseq_feedback_cli.average_checkpoints", ["--inputs", "{LM_CKPT}", "{TENSOR}", "--output", "{OUT}"],
        "{TENSOR} holds a Tensor, not a checkpoint (a dict of the model's parameters and its options)"),
    "evaluate_toy --path: a zip archive of something else": Case(
        "fairseq_feedback_cli.toy.evaluate", ["--task", "copy", "--data", "{LM}", "--path", "{ZIP}", "--output",
                                              "{OUT}"], "{ZIP} is a zip archive of something else than a checkpoint"),
    "lm --save-dir holding a checkpoint_best.pt that is a text file": lm(
        "--save-dir", "{TEXT_SAVE_DIR}", message="{TEXT_SAVE_DIR}/checkpoint_best.pt is a text file (it begins 'not "
                                                 "a checkpoint'), not a checkpoint"),
    # 2. an output of one of this project's tools that cannot be written as asked, refused before the work
    "feedback-benchmark --json a folder": Case("fairseq_feedback_cli.benchmark", ["--preset", "tiny", "--json", "{LM}"],
                                               "--json {LM} is a folder, and a file is written there: name a file"),
    "feedback-benchmark --json in /proc": Case("fairseq_feedback_cli.benchmark",
                                               ["--preset", "tiny", "--json", "/proc/nope/bench.json"],
                                               "--json /proc/nope/bench.json: nothing can be written in /proc"),
    **{f"{name} {option} a folder": Case(
        tool, [*argv, option, "{TR}"], f"{option} {{TR}} is a folder, and a file is written there")
       for name, tool, argv, option in (
           ("average_checkpoints", "fairseq_feedback_cli.average_checkpoints", ["--inputs", "{LM_CKPT}"], "--output"),
           ("evaluate_toy", "fairseq_feedback_cli.toy.evaluate",
            ["--task", "copy", "--data", "{LM}", "--path", "{LABELS_CKPT}"], "--output"),
           ("curves", "fairseq_feedback_cli.curves", ["log", "{TEXT_FILE}"], "--out"))},
    # a file where a folder is wanted: the data scripts replaced it by their folder, the corpus kept it as one
    **{f"{tool.split('.')[-2 if tool.endswith('.cli') else -1]} {option} a file": Case(
        tool, [*argv, option, "{TEXT_FILE}"], f"{option} {{TEXT_FILE}} is a file, not a folder")
       for tool, argv, option in (
           ("fairseq_feedback_cli.data_prep.prepare_iwslt14_de_en", ["--raw", "{LM}"], "--dest"),
           ("fairseq_feedback_cli.data_prep.prepare_iwslt14_de_en", ["--raw", "{LM}", "--dest", "{OUT}"], "--work"),
           ("fairseq_feedback_cli.data_prep.synthetic_translation", [], "--out"),
           ("fairseq_feedback_cli.gpu_check.cli", ["--device", "cpu"], "--out"))},
    # 3. raw data that a data script would hand to subword-nmt or fairseq-preprocess, which fail on it in tracebacks
    "prepare_iwslt14_de_en: empty train halves": Case(
        "fairseq_feedback_cli.data_prep.prepare_iwslt14_de_en",
        ["--raw", "{IWSLT_EMPTY_TRAIN}", "--dest", "{OUT}", "--work", "{WORK}/iwslt", "--workers", "1"],
        "{WORK}/iwslt/text/train.de holds no text, and fairseq-preprocess would make a split of nothing of it: check "
        "the raw files it is made from (iwslt14_de_en)"),
    **{f"prepare_wikitext103: {what}": Case(
        "fairseq_feedback_cli.data_prep.prepare_wikitext103",
        ["--raw", f"{{{raw}}}", "--dest", "{OUT}", "--work", f"{{WORK}}/{raw.lower()}", "--workers", "1"],
        f"{{{raw}}}/wikitext-103/{message}")
       for what, raw, message in (
           ("a train file not UTF-8", "WIKI_NOT_UTF8", "wiki.train.tokens, line 4: not UTF-8 (byte 0xe9 at byte 1 "
                                                  "of the line)"),
           ("an empty valid file", "WIKI_EMPTY_VALID", "wiki.valid.tokens holds no text"),
           ("a test file of blank lines", "WIKI_BLANK_TEST", "wiki.test.tokens holds no text"))},
    # 4. a value past what this machine takes: threads, processes, the integers of a seed, sizes past its memory
    "feedback-benchmark --threads 100000": Case(
        "fairseq_feedback_cli.benchmark", ["--preset", "tiny", "--threads", "100000"],
        f"--threads must be in [1, {machine.cores():,}] (the CPU cores this process may use), got 100000"),
    "prepare_wikitext103 --workers 100000": Case(
        "fairseq_feedback_cli.data_prep.prepare_wikitext103",
        ["--raw", "{WIKI_EMPTY_VALID}", "--dest", "{OUT}", "--workers", "100000"],
        f"--workers must be in [1, {machine.cores():,}] (the CPU cores this process may use), got 100000"),
    "feedback-benchmark --seed 2**64": Case(  # torch: ValueError: Overflow when unpacking long long
        "fairseq_feedback_cli.benchmark", ["--preset", "tiny", "--seed", str(2 ** 64)],
        f"--seed must be in [0, 4,294,967,295] (the seeds numpy and fairseq take), got {2 ** 64}"),
    "toy_tasks copy --test-length 10**12": Case(
        "fairseq_feedback_cli.data_prep.toy_tasks", ["copy", "--out", "{OUT}", "--test-length", str(10 ** 12)],
        "--test-length must be in [1, "),
    "evaluate_toy --batch-size 10**15": Case(
        "fairseq_feedback_cli.toy.evaluate", ["--task", "copy", "--data", "{LM}", "--path", "{LABELS_CKPT}",
                                              "--batch-size", str(10 ** 15), "--output", "{OUT}"],
        "--batch-size must be in [1, "),
    "eval-lm --model-overrides {'memory_span': 0}": Case(
        "eval_lm", [*EVAL_LM, "--model-overrides", literally("{'memory_span': 0}")],
        "--memory-span must be at least 1, got 0"),
}

# ---------------------------------------------------------------------- issue 61: the sweep's last cases
CASES |= {
    # fairseq checks --temperature as it builds the search, after --sampling's --nbest against --beam
    **{f"generate {' '.join(flags)}": Case("generate", [*GENERATE, *flags],
                                           "--temperature must be greater than 0, got 0.0")
       for flags in (["--sampling", "--temperature", "0"], ["--sampling", "--beam", "1", "--temperature", "0"])},
    # the --arch first: it set the options that differ (a feedback_lm_toy differed from a feedback_lm in
    # --base-shuffle alone, which BASE layers read, and was named by it)
    "lm --restore-file with another --arch": lm(
        "--restore-file", "{LM_CKPT}", "--arch", "feedback_lm_char_ptb",
        message="{LM_CKPT} was trained with --arch feedback_lm --per-layer-kv False, and this command line asks for "
                "--arch feedback_lm_char_ptb --per-layer-kv True: continue it with --arch feedback_lm --per-layer-kv "
                "False, or drop --restore-file"),
    # the streams' layout was as large as the streams asked for: 8 GB before anything refused it
    "lm --batch-size 10**9": lm("--batch-size", str(10 ** 9), message="train holds 180 tokens, too few for the "
                                "1,000,000,000 streams asked for (--batch-size x workers), and its 30 lines fill 30 "
                                "at most (a stream starts at a line): pass a --batch-size (--batch-size-valid for "
                                "validation) of 30 or less"),
    # an override read as the command line reads its option: it reached the model's arithmetic, a TypeError
    **{f"{tool.replace('_', '-')} --model-overrides {given}": Case(
        tool, [*argv, "--model-overrides", literally(given)], message)
       for tool, argv, given, message in (
           ("generate", GENERATE, "{'memory_span': 'x'}", "--memory-span must be an integer, got 'x'"),
           ("eval_lm", EVAL_LM, "{'memory_span': '4'}", "--memory-span must be an integer, got '4'"),
           ("generate", GENERATE, "{'activation_fn': 'nope'}", "--activation-fn must be one of relu, gelu"))},
}
