"""The recipes of examples/*/README.md, run end to end.

Every ```bash block of a recipe README is run, in order, in one bash process
(as a user pastes them into one shell), in a fresh folder holding the raw
data in its real format (tests/data_prep_fixtures.py) and a link to the
plugin, with tests/recipe_shims.py standing in for fairseq-preprocess,
fairseq-train, fairseq-generate, fairseq-eval-lm, torchrun and this
package's console scripts: they run the real tools on the command as written, made tiny for
CPU (a few updates, tiny model sizes, two CPU workers for a multi-GPU
launch, no --fp16; see that module). Before a block that trains, the
--save-dir it names is emptied, since the README's single- and multi-GPU
forms are alternatives that a user runs one of; not before a block that
finetunes (the recipe's `finetunes`), which continues the checkpoints that
the trainings before it left. The only edits of the README's text are each
recipe's `substitutions` (tests/recipes.py), each of which must match: the raw data comes
from the fixture folder instead of the internet.
So a README edit that breaks a command fails here.

The commands' training options are also checked against the paper's
Tables 8 and 9 (and the batch size per update against the recipe's), by
parsing what each README's fairseq-train calls were given.

The recipes run concurrently in the background, started when the first
test of this file runs, their commands by one server that imported torch
and fairseq once (tests/recipe_shims.py). Each recipe's test is marked slow,
as its shell starts the tools as processes; the checks of the READMEs' text
and of the architectures' own options (Table 9's dropout, Figure 9's
parameter counts) run in this process, in `make test`.
"""

import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import data_prep_fixtures as fx
from helpers import PLUGIN
from recipes import ENWIK8_SIZES, RECIPES, TABLE9, TABLE9_CHARACTERS, TABLE9_TOY, Recipe, bash_blocks, table9_dropout

import recipe_shims
from fairseq_feedback_cli.toy.scoring import METRICS

REPO = Path(__file__).resolve().parents[1]
RECIPE_TIMEOUT = 1200  # stops a hung recipe; the toy recipe passed 600 s on 2 cores shared with another run


def script_of(recipe: Recipe, raw: Path) -> str:
    """The README's bash blocks as one script, with the substitutions and the save dirs emptied before training."""
    blocks = bash_blocks(REPO / "examples" / recipe.name / "README.md")
    assert blocks, f"examples/{recipe.name}/README.md has no ```bash blocks"
    text = "\n\n".join(blocks)
    for old, new in recipe.substitutions:
        assert old in text, f"examples/{recipe.name}/README.md no longer has {old!r}: update SUBSTITUTIONS"
    assert recipe.finetunes in text, f"examples/{recipe.name}/README.md no longer has {recipe.finetunes!r}"
    lines = ["set -euo pipefail"]
    for block in blocks:
        for old, new in recipe.substitutions:
            block = block.replace(old, new.format(raw=raw))
        if recipe.fresh_save_dirs and "fairseq-train" in block and not (recipe.finetunes and recipe.finetunes in block):
            save_dirs = re.findall(r"--save-dir[ =](\S+)", block)
            assert save_dirs and not any("$" in d for d in save_dirs), \
                f"a training block of examples/{recipe.name}/README.md needs a literal --save-dir"
            lines.append("rm -rf " + " ".join(map(shlex.quote, save_dirs)))
        lines.append(block)
    return "\n".join(lines) + "\n"


@dataclass
class Run:
    recipe: Recipe
    work: Path
    raw: Path
    counts: dict
    proc: subprocess.Popen
    started: float
    log: Path

    def wait(self):
        try:
            self.proc.wait(timeout=max(1, RECIPE_TIMEOUT - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        output = self.log.read_text(errors="replace")
        assert self.proc.returncode == 0, (
            f"examples/{self.recipe.name}/README.md failed (exit {self.proc.returncode}); "
            f"the end of its output:\n{output[-6000:]}")
        return output

    def calls(self, tool=None):
        path = self.work / "calls.jsonl"
        calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return [c for c in calls if tool is None or c["tool"] == tool]


def environment(root: Path) -> dict:
    """What the recipes and the command server run with."""
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                RECIPE_SERVER=str(root / "server.sock"))


def start(recipe: Recipe, root: Path) -> Run:
    work = root / recipe.name
    work.mkdir(parents=True)
    raw = root / f"{recipe.name}-raw"
    counts = recipe.write_raw(raw)
    (work / "fairseq_feedback").symlink_to(PLUGIN, target_is_directory=True)
    recipe_shims.write(root / f"{recipe.name}-bin")
    script = work / "recipe.sh"
    script.write_text(script_of(recipe, raw))
    env = dict(environment(root),
               PATH=f"{root / f'{recipe.name}-bin'}{os.pathsep}{Path(sys.executable).parent}"
                    f"{os.pathsep}{os.environ.get('PATH', '')}",
               RECIPE_OVERRIDES=json.dumps(recipe.overrides, default=str), RECIPE_CALLS=str(work / "calls.jsonl"))
    log = work / "output.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(script)], cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    return Run(recipe, work, raw, counts, proc, time.monotonic(), log)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """Starts the recipes this session selected, all at once, in the background."""
    wanted = [item.callspec.params["name"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "name" in item.callspec.params]
    root = tmp_path_factory.mktemp("recipes")
    if not wanted:
        yield {}
        return
    with recipe_shims.server(root / "server.sock", environment(root), root / "server.log"):
        started = {name: start(RECIPES[name], root) for name in dict.fromkeys(wanted)}
        yield started
        for run in started.values():
            if run.proc.poll() is None:
                run.proc.kill()
                run.proc.wait()


# ------------------------------------------------- checks of what the recipes ran


def parsed_train_args(call):
    """The options fairseq-train got from the README, as fairseq parses them."""
    from fairseq import options

    argv = list(call["written"])
    for i, a in enumerate(argv):  # relative to the recipe's folder, not ours
        if a == "--user-dir":
            argv[i + 1] = PLUGIN
    return options.parse_args_and_arch(options.get_training_parser(), argv)


def check_paper_hyperparameters(run: Run):
    """Table 8's or 9's options; a finetuning (a call that continued a checkpoint) at a tenth of the learning
    rate (the appendix)."""
    trains = run.calls("fairseq-train")
    archs = set()
    for call in trains:
        args = parsed_train_args(call)
        archs.add(args.arch)
        paper = run.recipe.paper.get(args.arch, {})
        if ("continued" in call or args.finetune_from_model) and "lr" in paper:
            paper = dict(paper, lr=[pytest.approx(lr / 10) for lr in paper["lr"]])
        if args.finetune_from_model:  # a new run from the trained weights, at the finetuning's rate from the first
            paper = dict(paper, warmup_updates=0)
        for name, expected in paper.items():
            assert getattr(args, name) == expected, f"{args.arch}: --{name.replace('_', '-')} is " \
                                                    f"{getattr(args, name)}, the paper's {expected}"
        gpus = call["gpus"]
        if run.recipe.tokens_per_update and args.arch.startswith(("feedback", "transformer")):
            assert gpus * args.max_tokens * args.update_freq[0] == run.recipe.tokens_per_update, call["written"]
        if run.recipe.streams_per_update and args.task == "feedback_language_modeling":
            assert gpus * args.batch_size * args.update_freq[0] == run.recipe.streams_per_update, call["written"]
    assert set(run.recipe.paper) <= archs, f"no fairseq-train call trained {set(run.recipe.paper) - archs}"
    return trains


def check_three_launches(trains, arch, run: Run):
    """One GPU, fairseq's spawn and torchrun, each trained the model (2 CPU workers for the last two)."""
    forms = [(c["gpus"], c.get("workers"), "RANK" in c["run"] or "env://" in c["run"]) for c in trains
             if parsed_train_args(c).arch == arch]
    assert (1, None, False) in forms, f"{arch}: no one-GPU command"
    assert any(g > 1 and w == 2 for g, w, _ in forms), f"{arch}: no --distributed-world-size command"
    assert any(g > 1 and t for g, _, t in forms), f"{arch}: no torchrun command"
    assert run.calls("torchrun"), "torchrun was not called"


def check_exact_resumption(trains):
    """Every model of a translation recipe, fairseq's too, batches each epoch
    anew, so that a resumed run trains on the batches an uninterrupted one would."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    for call in trains:
        assert convert_namespace_to_omegaconf(parsed_train_args(call)).dataset.update_epoch_batch_itr, call["written"]


def hypotheses(path: Path) -> Dict[int, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line.startswith("H-"):
            sid, _, text = line[2:].split("\t", 2)
            out.setdefault(int(sid), text)
    return out


def score_lines(output: str, pattern: str) -> List[float]:
    return [float(x) for x in re.findall(pattern, output, flags=re.M)]


# ---------------------------------------------------------------- recipes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["iwslt14_de_en"])
def test_iwslt14_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    check_three_launches(trains, "feedback_transformer_iwslt_de_en", run)
    check_exact_resumption(trains)
    archs = {parsed_train_args(c).arch for c in trains}
    assert archs == {"feedback_transformer_iwslt_de_en", "transformer_iwslt_de_en"}
    printed = []
    for model in ("feedback", "transformer"):
        save = run.work / "checkpoints" / "iwslt14_de_en" / model
        ranked = (save / "lenpen.txt").read_text().splitlines()  # the tuning: one line per length penalty
        assert len(ranked) >= 2 and all(Path(line.split("\t")[1]).parent.name == "lenpen" for line in ranked)
        test_out = save / "test.out"
        assert sorted(hypotheses(test_out)) == list(range(run.counts["test"]))  # every test sentence
        printed += score_lines(test_out.read_text(), r"BLEU4 = ([\d.]+)")
    # feedback-score's tokenized BLEU is the BLEU4 fairseq-generate printed
    assert score_lines(output, r"^BLEU = ([\d.]+) ") == pytest.approx(printed, abs=0.011) and len(printed) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wmt14_en_de"])
def test_wmt14_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    check_three_launches(trains, "feedback_transformer_wmt_en_de_big", run)
    check_exact_resumption(trains)
    assert "transformer_vaswani_wmt_en_de_big" in {parsed_train_args(c).arch for c in trains}
    averages = run.calls("feedback-average-checkpoints")
    assert averages and all("--num-epoch-checkpoints" in c["written"] and
                            c["written"][c["written"].index("--num-epoch-checkpoints") + 1] == "10" for c in averages)
    # the averaged model is the mean of the last 10 epochs' (the last run trained 10 epochs)
    save = run.work / "checkpoints" / "wmt14_en_de" / "feedback"
    average = torch.load(save / "checkpoint.avg10.pt")["model"]
    epochs = [torch.load(save / f"checkpoint{e}.pt")["model"] for e in range(1, 11)]
    for name_ in ("decoder.layers.0.fc1.weight", "encoder.embed_tokens.weight"):
        torch.testing.assert_close(average[name_], torch.stack([e[name_] for e in epochs]).mean(0))
    for model in ("feedback", "transformer"):
        assert sorted(hypotheses(run.work / "checkpoints/wmt14_en_de" / model / "test.out")) == \
            list(range(run.counts["test"]))
    assert len(re.findall(r"tokenized BLEU with compound splitting of 6 sentences", output)) == 2
    assert len(re.findall(r"sacreBLEU of 6 sentences; sacrebleu .*tok:13a", output)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cnn_dm"])
def test_cnn_dm_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    check_three_launches(trains, "feedback_transformer", run)
    check_exact_resumption(trains)
    assert "transformer" in {parsed_train_args(c).arch for c in trains}
    generates = [c["written"] for c in run.calls("fairseq-generate")]
    assert generates and all(g[g.index("--no-repeat-ngram-size") + 1] == "3" and g[g.index("--beam") + 1] == "5"
                             for g in generates)
    tuned = {(g[g.index("--min-len") + 1], g[g.index("--max-len-b") + 1]) for g in generates if "valid" in g}
    assert tuned == {("40", "120"), ("55", "140"), ("70", "160")}
    rouge = re.findall(r"ROUGE-1 = ([\d.]+)  ROUGE-2 = ([\d.]+)  ROUGE-L = ([\d.]+)", output)
    assert len(rouge) == 2
    assert len(re.findall(rf"over {run.counts['test']} summaries", output)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wikitext103"])
def test_wikitext103_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    check_three_launches(trains, "feedback_lm_wiki103", run)
    archs = [(args.arch, getattr(args, "no_feedback", None)) for args in map(parsed_train_args, trains)]
    assert ("feedback_lm_wiki103_large", False) in archs and ("transformer_lm_wiki103", None) in archs
    assert ("feedback_lm_wiki103_large", True) in archs  # the paper's Transformer baseline
    check_finetuned(run, trains, output, ["feedback_small", "feedback_large", "transformer_large"])
    perplexities = score_lines(output, r"Perplexity: ([\d.]+)")
    assert len(perplexities) == len(run.calls("fairseq-eval-lm")) >= 4
    assert all(math.isfinite(p) for p in perplexities)
    test_tokens = sum(len(line.split()) + 1 for line in (run.raw / "wikitext-103" / "wiki.test.tokens")
                      .read_text().splitlines())
    assert f"Evaluated {test_tokens} tokens" in output  # the feedback LM scores every test token once
    assert "invalid sizes" not in output  # nor does fairseq's evaluation skip any


def check_finetuned(run: Run, trains, output, models):
    """Each model finetuned (the paper's appendix): its last training command continued in its --save-dir, with
    --lr and --max-update the only options changed (the recipe's `finetunes`: a tenth of the learning rate), from
    the checkpoint that training left (at its last update), for more updates, each at the finetuning's rate."""
    lr, max_update = re.fullmatch(r"--lr (\S+) --max-update (\d+)", run.recipe.finetunes).groups()
    finetunes = [c for c in trains if "continued" in c]
    saves = [Path(parsed_train_args(c).save_dir) for c in finetunes]
    assert sorted(save.name for save in saves) == sorted(models)
    trained_updates = run.recipe.overrides["fairseq-train"]["set"]["--max-update"]
    for finetune, save in zip(finetunes, saves):
        args = parsed_train_args(finetune)
        training = [c for c in trains[:trains.index(finetune)] if Path(parsed_train_args(c).save_dir) == save][-1]
        assert "continued" not in training and finetune["gpus"] == training["gpus"], finetune["written"]
        trained = vars(parsed_train_args(training))
        assert {k for k, v in vars(args).items() if v != trained[k]} == {"lr", "max_update"}, finetune["written"]
        assert (args.lr, args.max_update) == ([float(lr)], int(max_update))
        assert trained["lr"] == [pytest.approx(10 * float(lr))]
        assert finetune["continued"] == trained_updates
        loaded = output.split(f"Loaded checkpoint {save}/checkpoint_last.pt ")
        assert len(loaded) == 2, f"{save}: not continued once from its checkpoint_last.pt"
        log = loaded[1].split("done training")[0]
        assert re.match(rf"\(epoch \d+ @ {trained_updates} updates\)", log), log[:200]
        updates = [int(u) for u in re.findall(r"\bnum_updates[= ](\d+)", log)]
        assert updates and min(updates) > trained_updates and max(updates) == 2 * trained_updates, updates
        assert {float(x) for x in re.findall(r"\blr[= ]([\d.e+-]+)", log)} == {float(lr)}, log[-2000:]


def check_finetuned_from_best(run: Run, trains, output, models):
    """char-PTB's rule (appendix): training stops when the validation loss stops decreasing (fairseq's
    --patience), and each model is finetuned from its lowest validation loss (checkpoint_best.pt) in a run of its
    own, --lr, --warmup-updates, --max-update, --finetune-from-model and --save-dir the only options changed."""
    lr, warmup, max_update = re.fullmatch(r"--lr (\S+) --warmup-updates (\d+) --max-update (\d+)",
                                          run.recipe.finetunes).groups()
    finetunes = [c for c in trains if parsed_train_args(c).finetune_from_model]
    assert sorted(Path(parsed_train_args(c).save_dir).name for c in finetunes) == [f"{m}_finetuned" for m in models]
    for finetune in finetunes:
        args = parsed_train_args(finetune)
        best = Path(args.finetune_from_model)
        assert best.name == "checkpoint_best.pt" and "continued" not in finetune, finetune["written"]
        training = [c for c in trains[:trains.index(finetune)] if Path(parsed_train_args(c).save_dir) == best.parent][-1]
        trained = vars(parsed_train_args(training))
        assert trained["patience"] > 0 and not trained["finetune_from_model"]
        assert {k for k, v in vars(args).items() if v != trained[k]} == {
            "lr", "warmup_updates", "max_update", "finetune_from_model", "save_dir"}, finetune["written"]
        assert (args.lr, args.warmup_updates, args.max_update) == ([float(lr)], int(warmup), int(max_update))
        assert trained["lr"] == [pytest.approx(10 * float(lr))]
        assert f"loading pretrained model from {best}" in output


# each ablation's --save-dir: its architecture, and how its options differ from its recipe's model of that
# architecture (the paper's, Table 9)
FIXED_SPAN = dict(adaptive_span=False, memory_span=512, adaptive_span_loss=0.0)  # Table 9's "512, 2048*"
# Figure 9's FFN per depth: 1,536 x 6 / depth, less what the wider heads' relative-position table adds
FIGURE9_FFN = {1: 8912, 2: 4552, 4: 2296, 6: 1536, 8: 1152}
CHAR_PTB_ABLATIONS = {
    **{f"memory_{c.replace(':', '')}": dict(memory_composition=c)  # Figures 5 and 8
       for c in ("weighted", "top", "average", "layer:0", "layer:1", "layer:2", "layer:3", "layer:4", "layer:5",
                 "recurrent")},
    "transformer_char_ptb": dict(no_feedback=True),
    # Figure 9: the 6-layer model's head dimension times 6 / depth, its FFN such that the parameters stay
    **{f"depth{n}_{model}": dict(decoder_layers=n, head_dim=96 * 6 // n, decoder_ffn_embed_dim=FIGURE9_FFN[n],
                                 no_feedback=model == "transformer")
       for n in (1, 2, 4, 6, 8) for model in ("feedback", "transformer")},
}
WIKITEXT103_ABLATIONS = {
    "feedback_large_span2048_adaptive": ("feedback_lm_wiki103_large", {}),  # Table 6
    "feedback_large_span512": ("feedback_lm_wiki103_large", FIXED_SPAN),
    "transformer_large_span2048_adaptive": ("feedback_lm_wiki103_large", dict(no_feedback=True)),
    "transformer_large_span512": ("feedback_lm_wiki103_large", dict(FIXED_SPAN, no_feedback=True)),
    "all_attention": ("feedback_lm_wiki103", dict(persistent_vectors=2048, no_feed_forward=True)),
    "all_attention_transformer": ("feedback_lm_wiki103",
                                  dict(persistent_vectors=2048, no_feed_forward=True, no_feedback=True)),
}
ABLATIONS = {**{name: ("feedback_lm_char_ptb", d) for name, d in CHAR_PTB_ABLATIONS.items()},
             **WIKITEXT103_ABLATIONS}
# what the test trains of them (tests/recipes.py: the first and last composition and depth of the README's loops)
ABLATIONS_TRAINED = {name: ABLATIONS[name] for name in (
    "memory_weighted", "memory_recurrent", "transformer_char_ptb", "depth1_feedback", "depth1_transformer",
    "depth8_feedback", "depth8_transformer", *WIKITEXT103_ABLATIONS)}
RECIPE_OF = {"feedback_lm_char_ptb": ("char_ptb", 256, 2048, TABLE9_CHARACTERS),  # recipe, --batch-size on 8 GPUs,
             "feedback_lm_wiki103": ("wikitext103", 64, 512, TABLE9),            # streams per update, its Table 9
             "feedback_lm_wiki103_large": ("wikitext103", 64, 512, TABLE9)}


def recipe_train_args(recipe):
    """A recipe's TRAIN_ARGS=(...), as the shell splits them."""
    blocks = bash_blocks(REPO / "examples" / recipe / "README.md")
    return shlex.split(re.search(r"^TRAIN_ARGS=\((.*?)\)$", "".join(blocks), flags=re.M | re.S).group(1))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ablations"])
def test_ablations_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = run.calls("fairseq-train")
    assert sorted(Path(parsed_train_args(c).save_dir).name for c in trains) == sorted(ABLATIONS_TRAINED)
    for call in trains:
        args = parsed_train_args(call)
        arch, differences = ABLATIONS[Path(args.save_dir).name]
        recipe, batch_size, streams, table9 = RECIPE_OF[arch]
        # the recipe's 8-GPU command for the model (Table 9's options), and the ablation's flags
        model = parsed_train_args({"written": [*recipe_train_args(recipe), "--arch", arch, "--distributed-world-size",
                                               "8", "--batch-size", str(batch_size), "--save-dir", args.save_dir]})
        assert {k: getattr(model, k) for k in table9[arch]} == table9[arch]
        expected = dict(vars(model), **differences)
        assert {k: v for k, v in vars(args).items() if v != expected[k]} == {}, call["written"]
        assert call["gpus"] * args.batch_size * args.update_freq[0] == streams, call["written"]
    test_tokens = {"feedback_lm_char_ptb": sum(len(line.split()) + 1 for line in fx.char_ptb_lines()["test"]),
                   "feedback_lm_wiki103": sum(len(line.split()) + 1 for line in (
                       run.raw / "wikitext-103" / "wiki.test.tokens").read_text().splitlines())}
    for save, (arch, _) in ABLATIONS_TRAINED.items():  # each model scored every test token once, its output kept
        log = (run.work / "checkpoints" / "ablations" / save / "test.log").read_text()
        assert f"Evaluated {test_tokens[arch.replace('_large', '')]} tokens" in log and "invalid sizes" not in log, save
    # each char-PTB model's last line and the comparison's, in bits per character; each WikiText-103 model's too,
    # in perplexity
    bits = score_lines(output, r"Loss \(base 2\): ([\d.]+) bits per character")
    char_ptb = [save for save in ABLATIONS_TRAINED if save in CHAR_PTB_ABLATIONS]
    assert len(bits) == 2 * len(char_ptb) and all(math.isfinite(b) for b in bits)
    perplexities = score_lines(output, r"test\.log:Perplexity: ([\d.]+)")
    assert len(perplexities) == len(WIKITEXT103_ABLATIONS) and all(math.isfinite(p) for p in perplexities)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["enwik8"])
def test_enwik8_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    assert {(a.arch, a.no_feedback) for a in map(parsed_train_args, trains)} == {
        ("feedback_lm_enwik8", False), ("feedback_lm_enwik8", True)}  # the paper's model, and its Transformer
    check_finetuned(run, trains, output, ["feedback", "transformer"])
    # the BPTT warm-up: each training's first epoch in the stand-in's short blocks, every later one in the long,
    # each from a random offset (--random-epoch-offset)
    epochs = re.findall(r"train: (?:\d+ tokens, each scored once|\d+ of its \d+ tokens \(each stream from its token "
                        r"\d+ on\)), in 32 streams of up to \d+ blocks of (\d+) tokens", output)
    assert "each stream from its token" in output
    assert re.fullmatch(r"(S+L+){2}L*", "".join({"32": "S", "64": "L"}[n] for n in epochs)), epochs
    # every test byte but the newlines scored once (the published convention: prepare_enwik8 --no-newlines)
    test_bytes = fx.enwik8_bytes()[-ENWIK8_SIZES["HELD_OUT"]["test"]:]
    assert len(re.findall(rf"Evaluated {len(test_bytes) - test_bytes.count(10)} tokens", output)) == 2
    assert len(re.findall(r"Loss \(base 2\): [\d.]+ bits per byte \(the newlines not scored\), Perplexity", output)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["char_ptb"])
def test_char_ptb_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    assert {(a.arch, a.no_feedback) for a in map(parsed_train_args, trains)} == {
        ("feedback_lm_char_ptb", False), ("feedback_lm_char_ptb", True)}
    check_finetuned_from_best(run, trains, output, ["feedback", "transformer"])
    test_tokens = sum(len(line.split()) + 1 for line in fx.char_ptb_lines()["test"])
    assert len(re.findall(rf"Evaluated {test_tokens} tokens", output)) == 2
    assert len(re.findall(r"Loss \(base 2\): [\d.]+ bits per character, Perplexity", output)) == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["debian_de_en"])
def test_debian_de_en_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    depths = {(args.arch, args.decoder_layers) for args in map(parsed_train_args, trains)}
    assert depths == {(arch, n) for arch in ("feedback_transformer_iwslt_de_en", "transformer_iwslt_de_en")
                      for n in (1, 2, 6)}
    n_test = run.counts["pairs"]["test"]
    for model in ("feedback", "transformer"):
        for n in (1, 2, 6):
            test_out = run.work / "checkpoints" / "debian_de_en" / f"{model}_dec{n}" / "test.out"
            assert sorted(hypotheses(test_out)) == list(range(n_test))
    assert len(re.findall(rf"sacreBLEU of {n_test} sentences; sacrebleu .*tok:13a", output)) == 6
    assert len(re.findall(rf"^(feedback|transformer)_dec\d: .*Translated {n_test} sentences", output, flags=re.M)) == 6
    assert len(re.findall(r"^\| (feedback|transformer)_dec\d \| 10 \| [\d.]+ \| [\d.]+ \|$", output, flags=re.M)) == 6
    assert (run.work / "results" / "debian_de_en.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["debian_docs"])
def test_debian_docs_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = [parsed_train_args(c) for c in run.calls("fairseq-train")]
    assert {(a.arch, a.task, bool(getattr(a, "no_feedback", False))) for a in trains} == {
        ("feedback_lm", "feedback_language_modeling", False), ("feedback_lm", "feedback_language_modeling", True),
        ("transformer_lm", "language_modeling", False)}
    for a in trains:  # the same size (feedback_lm's input and output dims are its width) and tokens per update
        dims = [getattr(a, f"decoder_{side}_dim", a.decoder_embed_dim) for side in ("input", "output")]
        assert (a.decoder_layers, a.decoder_embed_dim, *dims, a.decoder_ffn_embed_dim, a.decoder_attention_heads,
                a.dropout) == (4, 256, 256, 256, 1024, 4, 0.1)
        assert a.batch_size * a.tokens_per_sample == 8192
        assert (a.lr, a.clip_norm, a.max_update) == ([0.0005], 0.1, 10000)
    perplexities = score_lines(output, r"Perplexity: ([\d.]+)")
    assert len(perplexities) == 3 and all(math.isfinite(p) for p in perplexities)
    bpe = (run.work / "data-raw" / "debian_docs" / "bpe" / "test.txt").read_text().splitlines()
    test_tokens = sum(len(line.split()) + 1 for line in bpe)
    assert len(re.findall(rf"Evaluated {test_tokens} tokens", output)) == 3  # the same tokens, each once
    assert (run.work / "results" / "debian_docs.png").stat().st_size > 0


TOY_MODELS = {"feedback": (4, False), "transformer": (4, True), "transformer8": (8, True)}
TOY_TABLE1 = {"random_walk": 2, "algorithmic3": 3, "algorithmic5": 3, "copy": 2, "reverse": 2, "counting50": 2,
              "counting1k": 2}  # how many of TOY_MODELS each task trains
# Table 1 at CPU scale: every row and the algorithmic task's difficulty curve, one size and budget for both models
TOY_CPU_TASKS = ["copy", "reverse", "counting50", "counting1k", "random_walk", "algorithmic3", "algorithmic5",
                 "algorithmic1", "algorithmic2", "algorithmic3_50", "algorithmic3_20"]
TOY_CPU_SEEDS = {task: (2,) for task in TOY_CPU_TASKS}  # task: both models' other seeds
TOY_CPU = dict(decoder_layers=2, decoder_embed_dim=128, decoder_ffn_embed_dim=512, decoder_attention_heads=4,
               memory_span=100, **table9_dropout(0.0), tokens_per_sample=64, batch_size=32, lr=[0.001],
               clip_norm=0.1, warmup_updates=100, lr_scheduler="polynomial_decay", power=0.5,
               total_num_update="1000", optimizer="adam", arch="feedback_lm_toy", labels="labels")


def toy_cpu_models(task):
    return [f"{model}{suffix}" for seed in (1, *TOY_CPU_SEEDS.get(task, ())) for model in ("feedback", "transformer")
            for suffix in ["" if seed == 1 else f"_seed{seed}"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["toy"])
def test_toy_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    steps = {}
    for call in run.calls("fairseq-train"):
        args = parsed_train_args(call)
        save = Path(args.save_dir)
        if save.parent.name.startswith("cpu_"):
            assert {k: getattr(args, k) for k in TOY_CPU} == TOY_CPU, call["written"]
            assert args.no_feedback == save.name.startswith("transformer")
            assert args.seed == int(save.name.partition("_seed")[2] or 1)
        else:
            assert {k: getattr(args, k) for k in TABLE9_TOY} == TABLE9_TOY, call["written"]
            assert (args.decoder_layers, args.no_feedback) == TOY_MODELS[save.name]
        steps.setdefault((save.parent.name, save.name), []).append(args.max_update)
    # every model of every task trained and tested at 2 updates; the command run again with 4 trained random_walk's
    # models on from their checkpoints, and nothing else
    updates = {task: [2, 4] if task == "random_walk" else [2] for task in TOY_TABLE1}
    for task in TOY_CPU_TASKS:
        updates[f"cpu_{task}"] = [2]
    assert steps == {**{(task, model): updates[task] for task, n in TOY_TABLE1.items() for model in list(TOY_MODELS)[:n]},
                     **{(f"cpu_{task}", model): [2] for task in TOY_CPU_TASKS for model in toy_cpu_models(task)}}
    for task, model in steps:
        save = run.work / "checkpoints" / "toy" / task / model
        results = [json.loads((save / f"test.{u}.json").read_text()) for u in updates[task]]
        assert [r["updates"] for r in results] == updates[task] and all(r["train_seconds"] > 0 for r in results)
        if len(results) > 1:  # the second step continued from the first one's checkpoint
            assert f"Loaded checkpoint {save.relative_to(run.work)}/checkpoint_last.pt (epoch 1 @ 2 updates)" in output
        table = (run.work / "results" / ("toy_cpu" if task.startswith("cpu_") else "toy") / "table1.md").read_text()
        token, episode = (results[-1][m] for m in METRICS[results[-1]["task"]])
        assert f"| {task} | {model} | {updates[task][-1]} | {100 * token:.1f} | {100 * episode:.1f} |" in table
    plots = sorted(p.name for p in (run.work / "results" / "toy").glob("*.png"))
    assert plots == sorted(f"{task}.png" for task in TOY_TABLE1)
    plots = sorted(p.name for p in (run.work / "results" / "toy_cpu").glob("*.png"))
    assert plots == ["algorithmic.png", "copy_reverse.png", "counting.png", "random_walk.png"]  # a figure a family
    assert "Traceback" not in output


# ----------------------------------------------------------- the README's


def test_each_recipe_readme_shows_numbers_and_data_decisions():
    for name in RECIPES:
        text = (REPO / "examples" / name / "README.md").read_text()
        for needed in ("paper", "fairseq", "data_prep"):
            assert needed in text, f"examples/{name}/README.md does not mention {needed}"


@pytest.mark.parametrize("arch", [*TABLE9_CHARACTERS, *TABLE9, TABLE9_TOY["arch"]])
def test_each_language_model_drops_out_where_table9_and_the_authors_code_do(arch):
    """The architectures' own dropout, which every recipe of them trains with: Table 9's rate on the attention
    probabilities and the feed-forward hidden layer, the WikiText-103 models' embedding dropout, nothing else."""
    paper = {**TABLE9_CHARACTERS, **TABLE9, TABLE9_TOY["arch"]: TABLE9_TOY}[arch]
    args = parsed_train_args({"written": ["data", "--user-dir", PLUGIN, "--task", "feedback_language_modeling",
                                          "--arch", arch]})
    dropout = {name: value for name, value in paper.items() if name.endswith("dropout")}
    assert {name: getattr(args, name) for name in dropout} == dropout
    assert dropout["dropout"] == 0 and dropout["attention_dropout"] == dropout["activation_dropout"] > 0


@pytest.mark.parametrize("no_feedback", [False, True], ids=["feedback", "transformer"])
def test_figure9s_depths_have_the_parameters_of_the_six_layer_model(no_feedback):
    """"We keep the total number of parameters constant" (Figure 9): every depth of the ablations' char-PTB sweep
    within 0.1% of the 6-layer model, on char-PTB's 50 symbols."""
    from fairseq.data import Dictionary

    from fairseq_feedback.models.feedback_lm import FeedbackLanguageModel
    from fairseq_feedback.tasks import FeedbackLanguageModelingTask

    dictionary = Dictionary()
    for i in range(50):
        dictionary.add_symbol(f"c{i}")

    def parameters(layers):
        args = parsed_train_args({"written": [
            "data", "--user-dir", PLUGIN, "--task", "feedback_language_modeling", "--arch", "feedback_lm_char_ptb",
            "--decoder-layers", str(layers), "--head-dim", str(96 * 6 // layers),
            "--decoder-ffn-embed-dim", str(FIGURE9_FFN[layers]), *(["--no-feedback"] if no_feedback else [])]})
        with torch.device("meta"):  # counted, not initialised
            model = FeedbackLanguageModel.build_model(args, FeedbackLanguageModelingTask(args, dictionary))
        return sum(p.numel() for p in model.parameters())

    base = parameters(6)
    assert base == pytest.approx(10.74e6, rel=1e-3)  # Table 9's 10.7M
    for layers in FIGURE9_FFN:
        assert parameters(layers) == pytest.approx(base, rel=1e-3), layers
