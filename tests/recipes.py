"""The recipes of examples/*/README.md that tests/test_recipes.py runs: each one's raw data,
the edits of its README's text, the tiny sizes its tools are made to run at, and the
paper's hyperparameters its fairseq-train calls must end up with; and the ```bash blocks
of a page (tests/test_docs.py takes a page's commands from the recipes too)."""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List

import data_prep_fixtures as fx

TRANSLATION_TINY = ["--encoder-layers", 1, "--decoder-layers", 1, "--encoder-embed-dim", 16, "--decoder-embed-dim", 16,
                    "--encoder-ffn-embed-dim", 32, "--decoder-ffn-embed-dim", 32, "--encoder-attention-heads", 2,
                    "--decoder-attention-heads", 2]
LM_TINY = ["--decoder-layers", 2, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
           "--decoder-attention-heads", 2, "--adaptive-input-cutoff", "20,40", "--adaptive-softmax-cutoff", "20,40"]
# the Debian LM recipe's three models, all given these sizes (fairseq's transformer_lm needs its input
# and output dims too); no adaptive softmax: it has none
SAME_SIZE_LM_TINY = ["--decoder-layers", 2, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
                     "--decoder-attention-heads", 2, "--decoder-input-dim", 16, "--decoder-output-dim", 16]
# the character-level architectures: no adaptive softmax; their head dimension made tiny too
CHAR_TINY = ["--decoder-layers", 2, "--decoder-embed-dim", 16, "--decoder-ffn-embed-dim", 32,
             "--decoder-attention-heads", 2, "--head-dim", 8]
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


def one_worker(tiny):
    """A multi-GPU command on one CPU worker."""
    return dict(tiny, **{"fairseq-train": dict(tiny["fairseq-train"], workers=1)})


# the char-PTB model's depth, for --memory-composition layer:5; every depth of Figure 9 trains at it. The
# char-PTB models get LM_TINY's adaptive softmax too (their tiny runs share the WikiText-103 ones' options),
# and with it the criterion that reads one
ABLATIONS_TINY = overrides([*LM_TINY, "--decoder-layers", 6, "--head-dim", 8, "--criterion", "adaptive_loss"],
                           **{"--batch-size": 4, "--tokens-per-sample": 64, "--max-tokens": 128, "--max-update": 2,
                              "--persistent-vectors": 8, "--decoder-ffn-embed-dim": 32})


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
    # text of the README's block that finetunes: it continues the checkpoints the trainings left in its --save-dirs
    finetunes: str = ""


def _prepare(script, **sizes):
    """The README's data script, run on the fixture's raw files; `sizes` replace its module's published
    sizes (a file of enwik8's 100M bytes is no fixture)."""
    command = f"python -m fairseq_feedback_cli.data_prep.{script}"
    if not sizes:
        return command, f"{command} --raw {{raw}} --workers 1"
    module = f"fairseq_feedback_cli.data_prep.{script}"
    patch = "; ".join(f"m.{name} = {value!r}" for name, value in sizes.items()).replace("{", "{{").replace("}", "}}")
    return command, f'python -c "import sys, {module} as m; {patch}; m.main()" --raw {{raw}} --workers 1'


def _char_ptb_sizes():
    lines = fx.char_ptb_lines()
    tokens = {split: sum(len(line.split()) + 1 for line in lines[split]) for split in lines}
    return {"PUBLISHED": {"lines": {split: len(lines[split]) for split in lines},
                          "tokens": {split: (n, 0) for split, n in tokens.items()}}}


ENWIK8_SIZES = {"BYTES": len(fx.enwik8_bytes()), "HELD_OUT": {"valid": 500, "test": 400}}


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


# Table 9's "Dropout rate" drops "attention and ReLU activations" (appendix 7.6; the authors' --dropout, "dropout
# rate of ReLU and attention"), nothing else; the WikiText-103 models' "Embed. dropout" the embeddings and the
# top layer's output
def table9_dropout(rate, embeddings=0.0):
    return dict(dropout=0.0, attention_dropout=rate, activation_dropout=rate, emb_dropout=embeddings,
                adaptive_softmax_dropout=0)


TABLE9_TOY = dict(arch="feedback_lm_toy", decoder_embed_dim=256, decoder_ffn_embed_dim=1024, decoder_attention_heads=4,
                  memory_span=100, **table9_dropout(0.2), tokens_per_sample=64, batch_size=512, lr=[0.0001],
                  clip_norm=0.1, warmup_updates=1000, optimizer="adam", lr_scheduler="fixed",
                  decoder_normalize_before=True, relative_positions=True, labels="labels")
TABLE9_CHARACTERS = {
    "feedback_lm_enwik8": dict(decoder_layers=12, decoder_embed_dim=512, decoder_ffn_embed_dim=4096,
                               decoder_attention_heads=8, head_dim=128, memory_span=8192, adaptive_span=True,
                               adaptive_span_loss=5e-7, **table9_dropout(0.5), per_layer_kv=True, tokens_per_sample=128,
                               bptt_warmup_tokens_per_sample=64, bptt_warmup_updates=50000, lr=[0.0015],
                               clip_norm=0.1, warmup_updates=8000),
    "feedback_lm_char_ptb": dict(decoder_layers=6, decoder_embed_dim=384, decoder_ffn_embed_dim=1536,
                                 decoder_attention_heads=4, memory_span=512, **table9_dropout(0.5), per_layer_kv=True,
                                 tokens_per_sample=128, lr=[0.0015], clip_norm=1.0, warmup_updates=1000),
}
TABLE9 = {
    "feedback_lm_wiki103": dict(decoder_layers=4, decoder_embed_dim=512, decoder_ffn_embed_dim=4096,
                                decoder_attention_heads=8, head_dim=128, memory_span=512,
                                **table9_dropout(0.1, embeddings=0.1),
                                tokens_per_sample=256, lr=[0.0007], clip_norm=0.1, warmup_updates=8000),
    "feedback_lm_wiki103_large": dict(decoder_layers=8, decoder_embed_dim=1024, decoder_ffn_embed_dim=4096,
                                      decoder_attention_heads=8, memory_span=2048, adaptive_span=True,
                                      **table9_dropout(0.3, embeddings=0.2),
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
        # warm-up over within the tiny training, as at 200,000 updates: the finetuning's rate is its --lr
        Recipe("wikitext103", fx.write_wikitext, [_prepare("prepare_wikitext103")],
               overrides(LM_TINY, **{"--batch-size": 4, "--tokens-per-sample": 64, "--max-tokens": 128,
                                     "--warmup-updates": 2}),
               paper=TABLE9, streams_per_update=512, finetunes="--lr 0.00007 --max-update 210000"),
        # the recipes' 8-GPU commands with one thing changed: 26 models, so each trains 2 updates in one CPU
        # worker (the WikiText-103 recipe's test runs that command on two); of the loops over Figures 5 and 8's
        # compositions and Figure 9's depths, the first and the last of each (ABLATIONS_TRAINED)
        Recipe("ablations", lambda raw: {"wikitext103": fx.write_wikitext(raw), "char_ptb": fx.write_char_ptb(raw)},
               [_prepare("prepare_wikitext103"), _prepare("prepare_char_ptb", **_char_ptb_sizes()),
                ("for COMPOSITION in weighted top average layer:0 layer:1 layer:2 layer:3 layer:4 layer:5 recurrent; do",
                 "for COMPOSITION in weighted recurrent; do"),
                ("for LAYERS in 1 2 4 6 8; do", "for LAYERS in 1 8; do")],
               one_worker(ABLATIONS_TINY),
               fresh_save_dirs=False),
        # one CPU worker for each 8-GPU command (the WikiText-103 recipe's test runs that form on two), of 32
        # streams: an epoch of 3 blocks of 32 bytes, so the warm-up ends with the first epoch
        Recipe("enwik8", fx.write_enwik8, [_prepare("prepare_enwik8", **ENWIK8_SIZES)],
               one_worker(overrides(CHAR_TINY, **{"--batch-size": 32, "--tokens-per-sample": 64,
                                                  "--bptt-warmup-tokens-per-sample": 32, "--bptt-warmup-updates": 2,
                                                  "--warmup-updates": 2})),
               paper={"feedback_lm_enwik8": TABLE9_CHARACTERS["feedback_lm_enwik8"]}, streams_per_update=1024,
               finetunes="--lr 0.00015 --max-update 110000"),
        Recipe("char_ptb", fx.write_char_ptb, [_prepare("prepare_char_ptb", **_char_ptb_sizes())],
               one_worker(overrides(CHAR_TINY, **{"--batch-size": 4, "--tokens-per-sample": 32, "--warmup-updates": 2,
                                                  "--validate-interval-updates": 5, "--save-interval-updates": 5})),
               paper={"feedback_lm_char_ptb": TABLE9_CHARACTERS["feedback_lm_char_ptb"]}, streams_per_update=2048,
               finetunes="--lr 0.00015 --warmup-updates 0 --max-update 1000"),
        Recipe("debian_de_en", fx.write_debian_de_en, [_prepare("prepare_debian_de_en")],
               overrides(TRANSLATION_TINY, **{"--max-tokens": 4096}),
               paper={"feedback_transformer_iwslt_de_en": IWSLT_BUT_DEPTH, "transformer_iwslt_de_en": IWSLT_BUT_DEPTH},
               tokens_per_update=4096),
        Recipe("debian_docs", fx.write_debian_docs, [_prepare("prepare_debian_docs")],
               overrides(SAME_SIZE_LM_TINY, **{"--batch-size": 4, "--tokens-per-sample": 64})),
        Recipe("toy", lambda raw: {},
               # each model trained and tested once; the command run again, with one step more, tests only that
               # step of random_walk's models, continuing their checkpoints
               [("UPDATES=50000", "UPDATES=2"), ("EVERY=1000 ", "EVERY=2 "),
                ("table1 random_walk random_walk  # nothing", "UPDATES=4 table1 random_walk random_walk  # nothing"),
                ("--out data-raw/toy/$name", "--train 12 --valid 2 --test 3 --out data-raw/toy/$name"),
                # Table 1 at CPU scale: the same, with the tiny episodes above
                ("UPDATES=1000", "UPDATES=2"), ("EVERY=250", "EVERY=2"),
                ("EPISODES=(--train 10000 --valid 10 --test 500)", "EPISODES=()"),
                ("LONG=(--train 10000 --valid 10 --test 200)", "LONG=()"),
                ("LONG1K=(--train 2000 --valid 10 --test 200)", "LONG1K=()")],
               {"fairseq-train": {"add": CPU_TRAIN + TOY_TINY, "set": {"--batch-size": 4, "--tokens-per-sample": 16}},
                "feedback-evaluate-toy": {"add": ["--cpu"], "set": {"--batch-size": 4}}},
               fresh_save_dirs=False),
    )
}


def bash_blocks(readme: Path) -> List[str]:
    return re.findall(r"^```bash\n(.*?)^```", readme.read_text(encoding="utf-8"), flags=re.M | re.S)
