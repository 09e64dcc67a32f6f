"""The recipes of examples/*/README.md, run end to end, and the tools they use.

Every ```bash block of a recipe README is run, in order, in one bash process
(as a user pastes them into one shell), in a fresh folder holding the raw
data in its real format (tests/data_prep_fixtures.py) and a link to the
plugin, with tests/recipe_shims.py standing in for fairseq-preprocess,
fairseq-train, fairseq-generate, fairseq-eval-lm, torchrun and this
package's console scripts: they run the real tools on the command as written, made tiny for
CPU (a few updates, tiny model sizes, two CPU workers for a multi-GPU
launch, no --fp16; see that module). Before a block that trains, the
--save-dir it names is emptied, since the README's single- and multi-GPU
forms are alternatives that a user runs one of. The only edits of the
README's text are each recipe's `substitutions` below, each of which must
match: the raw data comes from the fixture folder instead of the internet.
So a README edit that breaks a command fails here.

The commands' training options are also checked against the paper's
Tables 8 and 9 (and the batch size per update against the recipe's), by
parsing what each README's fairseq-train calls were given.

The recipes run concurrently in the background, started when the first
test of this file runs; the tool tests run meanwhile. Their commands are
forked by a server that imported torch and fairseq once (recipe_shims.serve),
which saves about 3 s of CPU per command.
"""

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import torch

import data_prep_fixtures as fx
import recipe_shims
from cli import error_lines
from conftest import PLUGIN
from data_prep.toy_tasks import METRICS

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
RECIPE_TIMEOUT = 600


# ------------------------------------------------------------ the recipes

TRANSLATION_TINY = ["--encoder-layers", 1, "--decoder-layers", 1, "--encoder-embed-dim", 16, "--decoder-embed-dim", 16,
                    "--encoder-ffn-embed-dim", 32, "--decoder-ffn-embed-dim", 32, "--encoder-attention-heads", 2,
                    "--decoder-attention-heads", 2]
LM_TINY = ["--decoder-layers", 2, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
           "--decoder-attention-heads", 2, "--adaptive-input-cutoff", "20,40", "--adaptive-softmax-cutoff", "20,40"]
# the Debian LM recipe's three models, all given these sizes (fairseq's transformer_lm needs its input
# and output dims too); no adaptive softmax: it has none
SAME_SIZE_LM_TINY = ["--decoder-layers", 2, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
                     "--decoder-attention-heads", 2, "--decoder-input-dim", 16, "--decoder-output-dim", 16]
TOY_TINY = ["--decoder-layers", 2, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
            "--decoder-attention-heads", 2, "--memory-span", 16]
# the README's --log-format stays (the curves read json logs); without one, fairseq logs simple lines off a terminal
CPU_TRAIN = ["--cpu", "--num-workers", 0, "--required-batch-size-multiple", 1, "--log-interval", 1, "--seed", 1]


def overrides(tiny_model, **train_set):
    return {
        "fairseq-train": {"drop": ["--fp16"], "add": CPU_TRAIN + tiny_model,
                          "set": {"--max-update": 10, "--update-freq": 1, **train_set}},
        "fairseq-generate": {"add": ["--cpu"]},
        "fairseq-eval-lm": {"add": ["--cpu"], "set": {"--tokens-per-sample": 64, "--max-tokens": 128,
                                                      "--context-window": 32}},
    }


@dataclass
class Recipe:
    name: str
    write_raw: Callable[[Path], dict]
    substitutions: List[tuple]  # (text of the README, what the test runs instead); {raw}: the fixture folder
    overrides: dict
    paper: Dict[str, dict] = field(default_factory=dict)  # arch -> options fairseq-train must end up with
    tokens_per_update: int = 0  # translation: GPUs x --max-tokens x --update-freq, the same in every form
    streams_per_update: int = 0  # language models: GPUs x --batch-size x --update-freq
    # a training block starts from an empty --save-dir (the README's launch forms are alternatives),
    # unless the recipe's runs continue from their checkpoints by design
    fresh_save_dirs: bool = True


def _prepare(script):
    return (f"python -m data_prep.{script}", f"python -m data_prep.{script} --raw {{raw}} --workers 1")


TABLE8 = {
    "feedback_transformer_iwslt_de_en": dict(encoder_layers=6, decoder_layers=6, encoder_embed_dim=512,
                                             decoder_embed_dim=512, decoder_ffn_embed_dim=1024,
                                             decoder_attention_heads=4, dropout=0.3, lr=[0.0005]),
    "feedback_transformer_wmt_en_de_big": dict(encoder_layers=6, decoder_layers=6, encoder_embed_dim=1024,
                                               decoder_embed_dim=1024, decoder_ffn_embed_dim=4096,
                                               decoder_attention_heads=16, dropout=0.3, lr=[0.001]),
    "feedback_transformer": dict(encoder_layers=6, decoder_layers=6, encoder_embed_dim=512, decoder_embed_dim=512,
                                 decoder_ffn_embed_dim=2048, decoder_attention_heads=8, dropout=0.3, lr=[0.0005]),
}
# the Debian de-en recipe: Table 8's IWSLT sizes for both models, decoders of 1, 2 and 6 layers
IWSLT_BUT_DEPTH = {k: v for k, v in TABLE8["feedback_transformer_iwslt_de_en"].items() if k != "decoder_layers"}
TABLE9_TOY = dict(arch="feedback_lm_toy", decoder_embed_dim=256, decoder_ffn_embed_dim=1024, decoder_attention_heads=4,
                  memory_span=100, dropout=0.2, tokens_per_sample=64, batch_size=512, lr=[0.0001], clip_norm=0.1,
                  warmup_updates=1000, optimizer="adam", lr_scheduler="fixed", decoder_normalize_before=True,
                  relative_positions=True, labels="labels")
TABLE9 = {
    "feedback_lm_wiki103": dict(decoder_layers=4, decoder_embed_dim=512, decoder_ffn_embed_dim=4096,
                                decoder_attention_heads=8, head_dim=128, memory_span=512, dropout=0.1,
                                tokens_per_sample=256, lr=[0.0007], clip_norm=0.1, warmup_updates=8000),
    "feedback_lm_wiki103_large": dict(decoder_layers=8, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096,
                                      decoder_attention_heads=8, memory_span=2048, adaptive_span=True, dropout=0.3,
                                      tokens_per_sample=256, lr=[0.0007], clip_norm=0.1, warmup_updates=8000),
}

RECIPES = {
    r.name: r for r in (
        Recipe("iwslt14_de_en", fx.write_iwslt, [_prepare("prepare_iwslt14_de_en")],
               overrides(TRANSLATION_TINY, **{"--max-tokens": 4096}),
               paper={"feedback_transformer_iwslt_de_en": TABLE8["feedback_transformer_iwslt_de_en"]},
               tokens_per_update=4096),
        Recipe("wmt14_en_de", fx.write_wmt,
               [_prepare("prepare_wmt14_en_de"),
                ("data-raw/wmt14_en_de/extracted/test-full.tgz/test-full/", "{raw}/test-full/")],
               overrides(TRANSLATION_TINY, **{"--max-tokens": 4096}),
               paper={"feedback_transformer_wmt_en_de_big": TABLE8["feedback_transformer_wmt_en_de_big"]},
               tokens_per_update=8 * 3584 * 16),
        Recipe("cnn_dm", fx.write_cnn_dm, [_prepare("prepare_cnn_dm")],
               overrides(TRANSLATION_TINY, **{"--max-tokens": 20000}),
               paper={"feedback_transformer": TABLE8["feedback_transformer"]},
               tokens_per_update=8 * 4096),
        Recipe("wikitext103", fx.write_wikitext, [_prepare("prepare_wikitext103")],
               overrides(LM_TINY, **{"--batch-size": 4, "--tokens-per-sample": 64, "--max-tokens": 128}),
               paper=TABLE9, streams_per_update=512),
        Recipe("debian_de_en", fx.write_debian_de_en, [_prepare("prepare_debian_de_en")],
               overrides(TRANSLATION_TINY, **{"--max-tokens": 4096}),
               paper={"feedback_transformer_iwslt_de_en": IWSLT_BUT_DEPTH, "transformer_iwslt_de_en": IWSLT_BUT_DEPTH},
               tokens_per_update=4096),
        Recipe("debian_docs", fx.write_debian_docs, [_prepare("prepare_debian_docs")],
               overrides(SAME_SIZE_LM_TINY, **{"--batch-size": 4, "--tokens-per-sample": 64})),
        Recipe("toy", lambda raw: {},
               [("UPDATES=50000", "UPDATES=4"), ("EVERY=1000 ", "EVERY=2 "),
                ("--out data-raw/toy/$name", "--train 12 --valid 2 --test 3 --out data-raw/toy/$name")],
               {"fairseq-train": {"add": CPU_TRAIN + TOY_TINY, "set": {"--batch-size": 4, "--tokens-per-sample": 16}},
                "feedback-evaluate-toy": {"add": ["--cpu"], "set": {"--batch-size": 4}}},
               fresh_save_dirs=False),
    )
}


def bash_blocks(readme: Path) -> List[str]:
    return re.findall(r"^```bash\n(.*?)^```", readme.read_text(encoding="utf-8"), flags=re.M | re.S)


def script_of(recipe: Recipe, raw: Path) -> str:
    """The README's bash blocks as one script, with the substitutions and the save dirs emptied before training."""
    blocks = bash_blocks(REPO / "examples" / recipe.name / "README.md")
    assert blocks, f"examples/{recipe.name}/README.md has no ```bash blocks"
    text = "\n\n".join(blocks)
    for old, new in recipe.substitutions:
        assert old in text, f"examples/{recipe.name}/README.md no longer has {old!r}: update SUBSTITUTIONS"
    lines = ["set -euo pipefail"]
    for block in blocks:
        for old, new in recipe.substitutions:
            block = block.replace(old, new.format(raw=raw))
        if recipe.fresh_save_dirs and "fairseq-train" in block:
            save_dirs = re.findall(r"--save-dir[ =](\S+)", block)
            assert save_dirs and not any("$" in d for d in save_dirs), \
                f"a training block of examples/{recipe.name}/README.md needs a literal --save-dir"
            lines.append("rm -rf " + " ".join(map(shlex.quote, save_dirs)))
        lines.append(block)
    return "\n".join(lines) + "\n"


def write_shims(folder: Path) -> None:
    """Stand-ins on PATH: fairseq's CLIs, torchrun, and setup.py's console scripts."""
    folder.mkdir()
    header = f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(TESTS)!r})\nimport recipe_shims\n"
    tools = {tool: f"recipe_shims.main({tool!r})\n"
             for tool in ("fairseq-preprocess", "fairseq-train", "fairseq-generate", "fairseq-eval-lm", "torchrun")}
    for name, module, function in console_scripts():
        tools[name] = f"recipe_shims.entry_point({name!r}, {module!r}, {function!r})\n"
    for tool, body in tools.items():
        path = folder / tool
        path.write_text(header + body)
        path.chmod(0o755)


def console_scripts():
    text = (REPO / "setup.py").read_text()
    return re.findall(r"[\"']([\w-]+)\s*=\s*([\w.]+):(\w+)[\"']", text)


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


def start(recipe: Recipe, root: Path, zygote: str) -> Run:
    work = root / recipe.name
    work.mkdir(parents=True)
    raw = root / f"{recipe.name}-raw"
    counts = recipe.write_raw(raw)
    (work / "fairseq_feedback").symlink_to(PLUGIN, target_is_directory=True)
    write_shims(root / f"{recipe.name}-bin")
    script = work / "recipe.sh"
    script.write_text(script_of(recipe, raw))
    env = dict(os.environ, PATH=f"{root / f'{recipe.name}-bin'}{os.pathsep}{Path(sys.executable).parent}"
                                f"{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               RECIPE_OVERRIDES=json.dumps(recipe.overrides, default=str), RECIPE_CALLS=str(work / "calls.jsonl"),
               RECIPE_ZYGOTE=zygote)
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
    zygote, path = recipe_shims.start_server(root / "zygote.log")
    started = {name: start(RECIPES[name], root, path) for name in dict.fromkeys(wanted)}
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
    recipe_shims.stop_server(zygote, path)


@pytest.fixture(scope="module", autouse=True)
def _start_recipes_first(runs):
    """Every test of this file starts the recipes, so the tool tests run while they do."""


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
    trains = run.calls("fairseq-train")
    archs = set()
    for call in trains:
        args = parsed_train_args(call)
        archs.add(args.arch)
        for name, expected in run.recipe.paper.get(args.arch, {}).items():
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


@pytest.mark.parametrize("name", ["wikitext103"])
def test_wikitext103_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    trains = check_paper_hyperparameters(run)
    check_three_launches(trains, "feedback_lm_wiki103", run)
    archs = [(args.arch, getattr(args, "no_feedback", None)) for args in map(parsed_train_args, trains)]
    assert ("feedback_lm_wiki103_large", False) in archs and ("transformer_lm_wiki103", None) in archs
    assert ("feedback_lm_wiki103_large", True) in archs  # the paper's Transformer baseline
    perplexities = score_lines(output, r"Perplexity: ([\d.]+)")
    assert len(perplexities) == len(run.calls("fairseq-eval-lm")) >= 4
    assert all(math.isfinite(p) for p in perplexities)
    test_tokens = sum(len(line.split()) + 1 for line in (run.raw / "wikitext-103" / "wiki.test.tokens")
                      .read_text().splitlines())
    assert f"Evaluated {test_tokens} tokens" in output  # the feedback LM scores every test token once
    assert "invalid sizes" not in output  # nor does fairseq's evaluation skip any


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


@pytest.mark.parametrize("name", ["toy"])
def test_toy_recipe(runs, name):
    run = runs[name]
    output = run.wait()
    steps = {}
    for call in run.calls("fairseq-train"):
        args = parsed_train_args(call)
        assert {k: getattr(args, k) for k in TABLE9_TOY} == TABLE9_TOY, call["written"]
        save = Path(args.save_dir)
        assert (args.decoder_layers, args.no_feedback) == TOY_MODELS[save.name]
        steps.setdefault((save.parent.name, save.name), []).append(args.max_update)
    # every model of every task, trained in two steps of 2 updates, and the command run again trained nothing
    assert steps == {(task, model): [2, 4] for task, n in TOY_TABLE1.items() for model in list(TOY_MODELS)[:n]}
    for task, model in steps:
        save = run.work / "checkpoints" / "toy" / task / model
        results = [json.loads((save / f"test.{u}.json").read_text()) for u in (2, 4)]
        assert [r["updates"] for r in results] == [2, 4] and all(r["train_seconds"] > 0 for r in results)
        # step 2 continued from step 1's checkpoint
        assert f"Loaded checkpoint checkpoints/toy/{task}/{model}/checkpoint_last.pt (epoch 1 @ 2 updates)" in output
        table = (run.work / "results" / "toy" / "table1.md").read_text()
        token, episode = (results[1][m] for m in METRICS[results[1]["task"]])
        assert f"| {task} | {model} | 4 | {100 * token:.1f} | {100 * episode:.1f} |" in table
    plots = sorted(p.name for p in (run.work / "results" / "toy").glob("*.png"))
    assert plots == sorted(f"{task}.png" for task in TOY_TABLE1)
    assert "Traceback" not in output


# ----------------------------------------------------------- the README's


def test_each_recipe_readme_shows_numbers_and_data_decisions():
    for name in RECIPES:
        text = (REPO / "examples" / name / "README.md").read_text()
        for needed in ("paper", "fairseq", "data_prep"):
            assert needed in text, f"examples/{name}/README.md does not mention {needed}"


def test_the_script_is_the_readmes_blocks_and_stops_at_the_first_failure(tmp_path):
    recipe = RECIPES["wmt14_en_de"]
    script = script_of(recipe, tmp_path / "raw")
    assert script.startswith("set -euo pipefail\n")
    for block in bash_blocks(REPO / "examples" / recipe.name / "README.md"):
        for line in block.splitlines():
            if "data_prep" not in line and "extracted/test-full.tgz" not in line:
                assert line in script
    assert f"--raw {tmp_path / 'raw'}" in script and "rm -rf checkpoints/wmt14_en_de/feedback" in script
    moved = Recipe("wmt14_en_de", fx.write_wmt, [("a line the README does not have", "x")], {})
    with pytest.raises(AssertionError, match="no longer has"):
        script_of(moved, tmp_path)


# ---------------------------------------------------- feedback-average-checkpoints


def _checkpoint(path: Path, seed: int, dtype=torch.float32, extra=None, **model):
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 4, generator=g).to(dtype), "b": torch.randn(4, generator=g).to(dtype),
              "steps": torch.tensor([seed * 3 + 1]), **model}
    state = {"args": argparse.Namespace(arch="feedback_transformer", seed=seed), "model": params,
             "optimizer_history": [{"num_updates": seed}], "extra_state": {"epoch": seed}}
    if extra is not None:
        state["extra"] = extra
    torch.save(state, path)
    return params


def average(*argv):
    from fairseq_feedback_cli import average_checkpoints

    average_checkpoints.main([str(a) for a in argv])


def error_of(fn, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        fn(*argv)
    message = str(e.value.code)
    assert message.startswith("error: ") and "\n" not in message, message
    return message


def test_average_of_the_last_epochs_is_the_mean_of_their_parameters(tmp_path):
    params = {e: _checkpoint(tmp_path / f"checkpoint{e}.pt", seed=e) for e in (1, 2, 3, 10)}
    _checkpoint(tmp_path / "checkpoint_last.pt", seed=99)
    _checkpoint(tmp_path / "checkpoint_3_300.pt", seed=98)
    average("--inputs", tmp_path, "--num-epoch-checkpoints", 3, "--output", tmp_path / "avg.pt")
    state = torch.load(tmp_path / "avg.pt")
    last = [params[e] for e in (10, 3, 2)]  # by epoch number, not by name: 10 after 3
    torch.testing.assert_close(state["model"]["w"], torch.stack([p["w"] for p in last]).mean(0))
    torch.testing.assert_close(state["model"]["b"], torch.stack([p["b"] for p in last]).mean(0))
    assert state["model"]["steps"].item() == (31 + 10 + 7) // 3  # integers: floor division
    assert state["extra_state"] == {"epoch": 10} and state["args"].seed == 10  # the rest: the newest's
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []

    average("--inputs", tmp_path, "--num-epoch-checkpoints", 2, "--checkpoint-upper-bound", 2,
            "--output", tmp_path / "upto2.pt")
    torch.testing.assert_close(torch.load(tmp_path / "upto2.pt")["model"]["w"], (params[1]["w"] + params[2]["w"]) / 2)


def test_average_by_updates_and_of_named_files_and_half_precision(tmp_path):
    a = _checkpoint(tmp_path / "checkpoint_1_100.pt", seed=1)
    b = _checkpoint(tmp_path / "checkpoint_2_1000.pt", seed=2)
    _checkpoint(tmp_path / "checkpoint_1_200.pt", seed=3)
    average("--inputs", tmp_path, "--num-update-checkpoints", 2, "--output", tmp_path / "avg.pt")
    c = torch.load(tmp_path / "checkpoint_1_200.pt")["model"]
    torch.testing.assert_close(torch.load(tmp_path / "avg.pt")["model"]["w"], (b["w"] + c["w"]) / 2)

    h1 = _checkpoint(tmp_path / "h1.pt", seed=1, dtype=torch.float16)
    h2 = _checkpoint(tmp_path / "h2.pt", seed=2, dtype=torch.float16)
    average("--inputs", tmp_path / "h1.pt", tmp_path / "h2.pt", "--output", tmp_path / "out" / "h.pt")
    w = torch.load(tmp_path / "out" / "h.pt")["model"]["w"]
    assert w.dtype == torch.float32  # as fairseq: half precision averaged into float32
    torch.testing.assert_close(w, (h1["w"].float() + h2["w"].float()) / 2)
    del a


def test_average_errors_are_one_line_and_write_nothing(tmp_path):
    out = tmp_path / "avg.pt"
    (tmp_path / "empty").mkdir()
    assert "found 0 checkpoint<epoch>.pt files" in error_of(
        average, "--inputs", tmp_path / "empty", "--num-epoch-checkpoints", 10, "--output", out)
    _checkpoint(tmp_path / "checkpoint1.pt", seed=1)
    assert "found 1 checkpoint<epoch>.pt files in" in error_of(
        average, "--inputs", tmp_path, "--num-epoch-checkpoints", 2, "--output", out)
    assert "not a folder" in error_of(
        average, "--inputs", tmp_path / "nothing-here", "--num-epoch-checkpoints", 2, "--output", out)
    assert "is a folder" in error_of(average, "--inputs", tmp_path, "--output", out)
    assert "not found" in error_of(average, "--inputs", tmp_path / "missing.pt", "--output", out)
    assert "at least 1" in error_of(average, "--inputs", tmp_path, "--num-epoch-checkpoints", 0, "--output", out)
    assert "--output" in error_of(average, "--inputs", tmp_path / "checkpoint1.pt")

    _checkpoint(tmp_path / "other.pt", seed=2, extra_param=torch.zeros(2))
    assert "other parameters" in error_of(
        average, "--inputs", tmp_path / "checkpoint1.pt", tmp_path / "other.pt", "--output", out)
    torch.save({"model": {"w": torch.zeros(5, 4), "b": torch.zeros(4), "steps": torch.tensor([1])}},
               tmp_path / "shape.pt")
    assert "has shape (5, 4)" in error_of(
        average, "--inputs", tmp_path / "checkpoint1.pt", tmp_path / "shape.pt", "--output", out)
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    assert "cannot read" in error_of(average, "--inputs", tmp_path / "broken.pt", "--output", out)
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    assert "not a fairseq checkpoint" in error_of(average, "--inputs", tmp_path / "plain.pt", "--output", out)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_the_average_gets_the_umasks_permissions(tmp_path):
    _checkpoint(tmp_path / "a.pt", seed=1)
    previous = os.umask(0o022)
    try:
        average("--inputs", tmp_path / "a.pt", "--output", tmp_path / "avg.pt")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "avg.pt").st_mode & 0o777 == 0o644  # as torch.save would have made it


class Payload:
    def __reduce__(self):
        return (os.system, ("echo this checkpoint ran code",))


def test_a_checkpoint_holding_code_is_refused_not_run(tmp_path, capfd):
    _checkpoint(tmp_path / "evil.pt", seed=1, extra=Payload())
    message = error_of(average, "--inputs", tmp_path / "evil.pt", "--output", tmp_path / "avg.pt")
    assert "holds objects a fairseq checkpoint does not" in message
    assert "ran code" not in capfd.readouterr().out
    assert not (tmp_path / "avg.pt").exists()


def test_a_failed_write_leaves_no_output(tmp_path, monkeypatch):
    from fairseq_feedback_cli import average_checkpoints

    _checkpoint(tmp_path / "a.pt", seed=1)
    (tmp_path / "avg.pt").write_bytes(b"the previous average")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    assert "No space left" in error_of(average, "--inputs", tmp_path / "a.pt", "--output", tmp_path / "avg.pt")
    assert (tmp_path / "avg.pt").read_bytes() == b"the previous average"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "avg.pt"]
    del average_checkpoints


# ----------------------------------------------------------------- feedback-score


def score(*argv):
    from fairseq_feedback_cli import score as score_module

    score_module.main([str(a) for a in argv])


def test_compound_splitting_matches_fairseqs_perl_one_liner():
    from fairseq_feedback_cli.score import compound_split

    # expected: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g', as scripts/compound_split_bleu.sh
    cases = {
        "a-b": "a ##AT##-##AT## b",
        "a-b-c": "a ##AT##-##AT## b-c",
        "well-known x - y --z a--b 3-4-5-6": "well ##AT##-##AT## known x - y - ##AT##-##AT## z "
                                             "a ##AT##-##AT## -b 3 ##AT##-##AT## 4-5 ##AT##-##AT## 6",
        "gut @-@ bekanntes": "gut @ ##AT##-##AT## @ bekanntes",
        "no hyphen -": "no hyphen -",
    }
    for line, expected in cases.items():
        assert compound_split(line) == expected


def generate_output(path: Path, pairs, order=None):
    lines = []
    for i in order or range(len(pairs)):
        hyp, ref = pairs[i]
        lines += [f"S-{i}\tsource {i}", f"T-{i}\t{ref}", f"H-{i}\t-0.5\t{hyp}", f"D-{i}\t-0.5\t{hyp}",
                  f"P-{i}\t-0.1 -0.2"]
    path.write_text("\n".join(lines + ["Generate test with beam=5: BLEU4 = 0.00"]) + "\n")
    return path


def test_bleu_tokenized_and_compound_split(tmp_path, capsys):
    import sacrebleu

    pairs = [("the well-known cat sat on the mat .", "the well-known cat sat on a mat ."),
             ("a state-of-the-art model works", "a state-of-the-art model works well")]
    gen = generate_output(tmp_path / "gen.out", pairs, order=[1, 0])
    score("--metric", "bleu", "--gen", gen, "--quiet")
    tokenized = float(capsys.readouterr().out)
    expected = sacrebleu.corpus_bleu([h for h, _ in pairs], [[r for _, r in pairs]], tokenize="none",
                                     smooth_method="none").score
    assert tokenized == pytest.approx(expected, abs=0.006)
    score("--metric", "bleu-compound-split", "--gen", gen)
    out = capsys.readouterr().out
    split = [(h.replace("well-known", "well ##AT##-##AT## known").replace(
        "state-of-the-art", "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art"), r) for h, r in pairs]
    split = [(h, r.replace("well-known", "well ##AT##-##AT## known").replace(
        "state-of-the-art", "state ##AT##-##AT## of ##AT##-##AT## the ##AT##-##AT## art")) for h, r in split]
    expected = sacrebleu.corpus_bleu([h for h, _ in split], [[r for _, r in split]], tokenize="none",
                                     smooth_method="none").score
    assert float(re.search(r"BLEU = ([\d.]+)", out).group(1)) == pytest.approx(expected, abs=0.006)
    assert "compound splitting of 2 sentences" in out and "tok:none" in out


def test_tokenized_bleu_is_fairseqs_bleu4(tmp_path, capsys):
    """The number fairseq-generate and fairseq-score print for tokenized text."""
    import random

    from fairseq.data import Dictionary
    from fairseq.scoring.bleu import BleuConfig, Scorer

    rng = random.Random(0)
    words = "the a cat dog sat on mat house is small big red green".split()
    pairs = []
    for _ in range(50):
        ref = [rng.choice(words) for _ in range(rng.randint(5, 15))]
        hyp = [w if rng.random() < 0.7 else rng.choice(words) for w in ref][: len(ref) - rng.randint(0, 2)]
        pairs.append((" ".join(hyp), " ".join(ref)))
    d = Dictionary()
    fairseq_bleu = Scorer(BleuConfig(pad=d.pad(), eos=d.eos(), unk=d.unk()))
    for hyp, ref in pairs:
        fairseq_bleu.add(d.encode_line(ref, add_if_not_exist=True), d.encode_line(hyp, add_if_not_exist=True))
    score("--metric", "bleu", "--gen", generate_output(tmp_path / "gen.out", pairs), "--quiet")
    assert float(capsys.readouterr().out) == pytest.approx(fairseq_bleu.score(), abs=0.006)


def test_sacrebleu_detokenizes_and_reads_sgm_references(tmp_path, capsys):
    gen = generate_output(tmp_path / "gen.out", [("Ein gut @-@ bekanntes Buch &quot; hier &quot; .", "x"),
                                                 ("Es ist 3.5 % .", "y")])
    sgm = tmp_path / "ref.sgm"
    sgm.write_text('<refset setid="t" srclang="any" trglang="de">\n<doc sysid="ref" docid="1">\n'
                   '<seg id="1">Ein gut-bekanntes Buch "hier".</seg>\n<seg id="2">  Es ist 3.5%. </seg>\n'
                   "</doc>\n</refset>\n")
    score("--metric", "sacrebleu", "--gen", gen, "--detokenize", "de", "--ref", sgm)
    out = capsys.readouterr().out
    assert out.startswith("BLEU = 100.00") and "tok:13a" in out
    # without --ref, the T- lines are detokenized as the hypotheses are
    tokenized = [("Ein gut @-@ bekanntes Buch &quot; hier &quot; .",) * 2, ("Es ist 3.5 % .",) * 2]
    score("--metric", "sacrebleu", "--gen", generate_output(tmp_path / "t.out", tokenized), "--detokenize", "de")
    assert capsys.readouterr().out.startswith("BLEU = 100.00")


def test_rouge_of_a_known_pair(tmp_path, capsys):
    hyp, ref = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp.write_text("the cat sat on the mat.\n")
    ref.write_text("the cat is on the mat.\n")
    score("--metric", "rouge", "--hyp", hyp, "--ref", ref)
    out = capsys.readouterr().out
    # unigrams: 5 of 6 either way; bigrams: the cat, on the, the mat = 3 of 5; LCS: the cat on the mat
    assert "ROUGE-1 = 83.33  ROUGE-2 = 60.00  ROUGE-L = 83.33" in out
    # two sentences against one: summary-level ROUGE-L takes the union of the LCS of each
    hyp.write_text("the cat sat. on the mat.\n")
    score("--metric", "rouge", "--hyp", hyp, "--ref", ref, "--quiet")
    assert float(capsys.readouterr().out) == pytest.approx(83.33, abs=0.01)


def test_several_outputs_are_ranked_best_first(tmp_path, capsys):
    good = generate_output(tmp_path / "1.0", [("a b c d e", "a b c d e"), ("f g h i", "f g h i")])
    bad = generate_output(tmp_path / "0.6", [("a b c x e", "a b c d e"), ("f g h i", "f g h i")])
    score("--metric", "bleu", "--gen", bad, good)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("\t")[1] for line in lines] == [str(good), str(bad)]
    assert float(lines[0].split("\t")[0]) == 100.0 > float(lines[1].split("\t")[0])


def cut(path: Path, lines: int) -> Path:
    """What a fairseq-generate run killed after writing `lines` lines leaves."""
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:lines]))
    return path


def test_an_output_cut_short_is_refused_unless_a_subset_is_asked_for(tmp_path, capsys):
    pairs = [("a b c d", "a b c d"), ("e f g h", "e f x h"), ("i j k l", "i j k l")]
    gen = cut(generate_output(tmp_path / "gen.out", pairs, order=[1, 2, 0]), 10)  # sentences 1 and 2 only
    message = error_of(score, "--metric", "bleu", "--gen", gen)
    assert "closing line" in message and "--allow-subset" in message
    score("--metric", "bleu", "--gen", gen, "--allow-subset")
    captured = capsys.readouterr()
    assert "of 2 sentences" in captured.out and "scoring the 2 sentences it has, of 3 or more" in captured.err
    # and in a tuning run: the half-written output is not ranked first, the run stops naming it
    complete = generate_output(tmp_path / "complete.out", [("a b c d", "a b c d"), ("e f g h", "e f x h"),
                                                           ("i j k l", "i j k x")])
    assert str(gen) in error_of(score, "--metric", "bleu", "--gen", complete, gen)
    assert capsys.readouterr().out == ""


def test_sentences_fairseq_left_out_are_named(tmp_path, capsys):
    pairs = [("a b c d", "a b c d")] * 4
    gen = generate_output(tmp_path / "gen.out", pairs, order=[0, 1, 3])  # a batch dropped: sentence 2
    assert "none for sentences 2" in error_of(score, "--metric", "bleu", "--gen", gen)
    # the split's size, as fairseq logs it when loading the split (in its format, or Python's when fairseq's
    # logging set-up came too late), reveals a missing last sentence too
    for log_line in ("2024-01-01 00:00:00 | INFO | fairseq.tasks.translation | data-bin/x test de-en 5 examples",
                     "INFO:fairseq.tasks.translation:data-bin/x test de-en 5 examples"):
        logged = tmp_path / "logged.out"
        logged.write_text(log_line + "\n" + generate_output(tmp_path / "all4.out", pairs).read_text())
        message = error_of(score, "--metric", "bleu", "--gen", logged)
        assert "the split has 5 sentences (none for sentences 4)" in message and "--required-batch-size" in message
        score("--metric", "bleu", "--gen", logged, "--allow-subset", "--quiet")
        assert capsys.readouterr().out.strip() == "100.00"


def test_score_errors_are_one_line(tmp_path):
    gen = generate_output(tmp_path / "gen.out", [("a b", "a b"), ("c d", "c d")])
    three = tmp_path / "three.txt"
    three.write_text("a b\nc d\ne f\n")
    assert "not found" in error_of(score, "--metric", "bleu", "--gen", tmp_path / "missing.out")
    assert "has 2 hypotheses but" in error_of(score, "--metric", "bleu", "--gen", gen, "--ref", three)
    assert "--required-batch-size-multiple 1" in error_of(score, "--metric", "bleu", "--gen", gen, "--ref", three)
    one = tmp_path / "one.txt"
    one.write_text("a b\n")
    assert "has 3 lines but" in error_of(score, "--metric", "rouge", "--hyp", three, "--ref", one)
    assert "needs --ref" in error_of(score, "--metric", "bleu", "--hyp", three)
    assert "no hypotheses" in error_of(score, "--metric", "bleu", "--gen", three)
    assert "invalid choice" in error_of(score, "--metric", "meteor", "--gen", gen)
    assert "only 1 lines" in error_of(score, "--metric", "bleu", "--gen", gen, "--ref", one)
    no_targets = tmp_path / "no-targets.out"
    no_targets.write_text("H-0\t-1\ta b\n")
    assert "no references" in error_of(score, "--metric", "bleu", "--gen", no_targets)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    assert "not UTF-8" in error_of(score, "--metric", "bleu", "--hyp", tmp_path / "latin1.txt", "--ref", one)


@pytest.mark.parametrize("module,argv", [
    ("fairseq_feedback_cli.score", ["--metric", "bleu", "--gen", "missing.out"]),
    ("fairseq_feedback_cli.average_checkpoints", ["--inputs", ".", "--num-epoch-checkpoints", "3", "--output", "a.pt"]),
])
def test_command_line_errors_are_one_line_without_traceback(tmp_path, module, argv):
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(error_lines(proc)) == 1 and error_lines(proc)[0].startswith("error: "), proc.stderr
    assert not (tmp_path / "a.pt").exists()
