#!/usr/bin/env bash
# The CPU tier of examples/results/README.md: the paper's three comparisons at
# the scale of one 2-core machine, every model on one thread, two at a time.
#
#     bash examples/results/cpu_tier.sh          # from the repository's root
#
# Reads data-bin/debian_de_en, data-bin/debian_docs and data-bin/debian_docs_bytes (made by
# fairseq_feedback_cli.data_prep.prepare_debian_de_en / prepare_debian_docs [--bytes]), generates the
# toy tasks, trains, evaluates, and writes into $OUT (default
# runs/cpu_tier): one folder per model (train.log, checkpoints, test output),
# the learning curves (plots/*.png) and summary.md (the rows of the page).
# Run it again after an interruption: a model whose training finished is not
# trained again, one cut short continues from its last checkpoint (saved every
# $SAVE_EVERY updates), an evaluation that finished is not redone.
#
# Every size and count below can be set from the environment (the tests run
# this script at tiny sizes on tiny data).
set -euo pipefail

OUT=${OUT:-runs/cpu_tier}
DE_EN=${DE_EN:-data-bin/debian_de_en}
DOCS=${DOCS:-data-bin/debian_docs}
DOCS_BYTES=${DOCS_BYTES:-data-bin/debian_docs_bytes}
JOBS=${JOBS:-2}                  # models trained at once, one thread each
PLUGIN=${PLUGIN:-fairseq_feedback}
SAVE_EVERY=${SAVE_EVERY:-100}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

# Translation: both models get this encoder and width; only the decoder differs.
MT_UPDATES=${MT_UPDATES:-1400}
MT_VALID_EVERY=${MT_VALID_EVERY:-200}
MT_SIZES=${MT_SIZES:-"--encoder-layers 3 --encoder-embed-dim 256 --encoder-ffn-embed-dim 1024 --encoder-attention-heads 4
    --decoder-embed-dim 256 --decoder-ffn-embed-dim 1024 --decoder-attention-heads 4"}
MT_TRAIN=${MT_TRAIN:-"--share-decoder-input-output-embed --dropout 0.1 --max-tokens 2048
    --optimizer adam --adam-betas (0.9,0.98) --clip-norm 0.0 --lr 0.001 --lr-scheduler inverse_sqrt
    --warmup-updates 300 --warmup-init-lr 1e-07 --weight-decay 0.0001
    --criterion label_smoothed_cross_entropy --label-smoothing 0.1 --update-epoch-batch-itr True"}
MT_BEAM_BATCH=${MT_BEAM_BATCH:-64}

# Language models: the same sizes and tokens per update for all three.
LM_UPDATES=${LM_UPDATES:-800}
LM_VALID_EVERY=${LM_VALID_EVERY:-200}
LM_WIDTH=${LM_WIDTH:-256}
LM_SIZES=${LM_SIZES:-"--decoder-layers 4 --decoder-embed-dim $LM_WIDTH --decoder-ffn-embed-dim 1024 --decoder-attention-heads 4"}
LM_TRAIN=${LM_TRAIN:-"--dropout 0.1 --optimizer adam --adam-betas (0.9,0.98) --weight-decay 0.01 --clip-norm 0.1
    --lr 0.001 --lr-scheduler inverse_sqrt --warmup-updates 200 --warmup-init-lr 1e-07"}
LM_STREAMS=${LM_STREAMS:-32}     # feedback models: streams x blocks of 64 tokens
LM_BLOCKS=${LM_BLOCKS:-8}        # transformer_lm: blocks of 256 tokens (the same 2,048 tokens per update)

# Figure 9: depth at constant parameters, on the manuals as bytes. DEPTH_BASE layers have the sizes
# below; L layers have the same width and heads, and head dimension and FFN times DEPTH_BASE / L (the
# relative-position table, span x head dimension, grows with the heads: the summary prints each count).
# Each model with each of DEPTH_SEEDS (seed 1's folder without a suffix, another's with _seedN).
DEPTH_UPDATES=${DEPTH_UPDATES:-800}
DEPTH_VALID_EVERY=${DEPTH_VALID_EVERY:-100}  # a validation and a checkpoint kept: the points of equal wall time
DEPTH_BASE=${DEPTH_BASE:-6}
DEPTH_SIZES=${DEPTH_SIZES:-"--decoder-embed-dim 128 --decoder-attention-heads 4"}
DEPTH_HEAD_DIM=${DEPTH_HEAD_DIM:-32}
DEPTH_FFN=${DEPTH_FFN:-512}
DEPTH_TRAIN=${DEPTH_TRAIN:-"--memory-span 256 --dropout 0 --optimizer adam --lr 0.0015 --lr-scheduler fixed
    --warmup-updates 100 --clip-norm 1.0 --tokens-per-sample 128 --batch-size 16"}
DEPTH_VALID=${DEPTH_VALID:-"--batch-size-valid 64 --max-valid-steps 5"}  # the first 6 blocks of 64 streams
DEPTH_EVAL_STREAMS=${DEPTH_EVAL_STREAMS:-16}
DEPTH_SEEDS=${DEPTH_SEEDS:-"1 2"}

# Table 1: the algorithmic task with 3 variables (TOY_*), and the random walk at the demo's size (WALK_*).
TOY_UPDATES=${TOY_UPDATES:-2000}
TOY_EVAL_EVERY=${TOY_EVAL_EVERY:-500}
TOY_EPISODES=${TOY_EPISODES:-"--train 10000 --valid 1000 --test 1000"}
TOY_SIZES=${TOY_SIZES:-"--decoder-layers 4 --decoder-embed-dim 128 --decoder-ffn-embed-dim 512
    --decoder-attention-heads 4 --memory-span 100"}
TOY_TRAIN=${TOY_TRAIN:-"--dropout 0.0 --attention-dropout 0 --activation-dropout 0 --tokens-per-sample 64
    --batch-size 32 --optimizer adam --lr 0.001 --lr-scheduler fixed --warmup-updates 100 --clip-norm 0.1"}
WALK_UPDATES=${WALK_UPDATES:-1200}
WALK_EVAL_EVERY=${WALK_EVAL_EVERY:-300}
WALK_EPISODES=${WALK_EPISODES:-"--grid-size 4 --episode-length 30 --train 10000 --valid 100 --test 500"}
WALK_SIZES=${WALK_SIZES:-"--decoder-layers 2 --decoder-embed-dim 128 --decoder-ffn-embed-dim 512
    --decoder-attention-heads 4 --memory-span 32"}
WALK_TRAIN=${WALK_TRAIN:-"--dropout 0.0 --attention-dropout 0 --activation-dropout 0 --tokens-per-sample 64
    --batch-size 32 --optimizer adam --lr 0.001 --lr-scheduler fixed --warmup-updates 50 --clip-norm 0.1"}

COMMON=(--user-dir "$PLUGIN" --cpu --num-workers 0 --log-format json --log-interval 25)

log() { echo "[cpu_tier $(date +%H:%M:%S)] $*"; }

# train NAME DATA UPDATES ARGS...: fairseq-train into $OUT/NAME; continues from
# its last checkpoint; a finished run (the marker `trained`) is left alone,
# since fairseq would train one update more. Each process adds a line to
# cpu_seconds: its CPU seconds (user and system; a clock that other work on the
# machine does not stop, where fairseq's wall clock counts the time others
# took) and the updates it trained. A killed process writes none (bash's `time`
# reports only a process that ends), so a run's CPU time is its recorded
# processes' seconds per update times its updates: an estimate where one was killed.
train() {
    local name=$1 data=$2 updates=$3 save=$OUT/$1 TIMEFORMAT="%U %S" resumed
    [ -f "$save/trained" ] && return 0
    mkdir -p "$save"
    log "training $name ($updates updates)"
    # shellcheck disable=SC2068  # the size and option strings split into words on purpose
    { time fairseq-train "$data" "${COMMON[@]}" ${@:4} --max-update "$updates" --save-dir "$save" \
        --log-file "$save/train.log" > "$save/train.out" 2>&1; } 2> "$save/cpu_seconds.tmp"
    resumed=$(grep -o "Loaded checkpoint .* @ [0-9]* updates" "$save/train.out" | grep -o "[0-9]* updates$" | cut -d' ' -f1 || true)
    echo "$(cat "$save/cpu_seconds.tmp") $((updates - ${resumed:-0}))" >> "$save/cpu_seconds"
    rm "$save/cpu_seconds.tmp"
    date -u +%FT%TZ > "$save/trained"
}

# --- translation -------------------------------------------------------------------------------

translation() {  # translation NAME ARCH DECODER_LAYERS SEED
    local name=$1 save=$OUT/$1
    train "$name" "$DE_EN" "$MT_UPDATES" --arch "$2" --decoder-layers "$3" --seed "$4" $MT_SIZES $MT_TRAIN \
        --validate-interval-updates "$MT_VALID_EVERY" --save-interval-updates "$SAVE_EVERY" \
        --keep-interval-updates 1 --no-epoch-checkpoints
    if [ ! -f "$save/test.bleu" ]; then
        log "translating the test set with $name"
        fairseq-generate "$DE_EN" --user-dir "$PLUGIN" --cpu --path "$save/checkpoint_best.pt" --gen-subset test \
            --beam 5 --batch-size "$MT_BEAM_BATCH" --remove-bpe --required-batch-size-multiple 1 > "$save/test.out" 2>&1
        feedback-score --metric sacrebleu --gen "$save/test.out" --detokenize en --ref "$DE_EN/test.raw.en" \
            > "$save/test.bleu.tmp"
        mv "$save/test.bleu.tmp" "$save/test.bleu"
    fi
}

# --- language models ---------------------------------------------------------------------------

language_model() {  # language_model NAME OPTIONS...: a feedback_lm, or with --no-feedback its Transformer
    local name=$1 save=$OUT/$1
    train "$name" "$DOCS" "$LM_UPDATES" --task feedback_language_modeling --arch feedback_lm $LM_SIZES $LM_TRAIN \
        --batch-size "$LM_STREAMS" --tokens-per-sample 64 --validate-interval-updates "$LM_VALID_EVERY" \
        --save-interval-updates "$SAVE_EVERY" --keep-interval-updates 1 --no-epoch-checkpoints "${@:2}"
    if [ ! -f "$save/test.ppl" ]; then
        log "test perplexity of $name"
        # one stream: every test token scored once, with up to a span of carried memory
        fairseq-eval-lm "$DOCS" --user-dir "$PLUGIN" --cpu --task feedback_language_modeling \
            --path "$save/checkpoint_best.pt" --gen-subset test --tokens-per-sample 64 --batch-size 1 \
            > "$save/test.out" 2>&1
        grep -h "Perplexity" "$save/test.out" | tail -n 1 > "$save/test.ppl.tmp"
        mv "$save/test.ppl.tmp" "$save/test.ppl"
    fi
}

transformer_lm() {
    local name=transformer_lm save=$OUT/transformer_lm
    # its input and output dims default to 512 whatever the width: set to the width
    train "$name" "$DOCS" "$LM_UPDATES" --task language_modeling --arch transformer_lm $LM_SIZES $LM_TRAIN \
        --decoder-input-dim "$LM_WIDTH" --decoder-output-dim "$LM_WIDTH" --batch-size "$LM_BLOCKS" --tokens-per-sample 256 \
        --sample-break-mode none --validate-interval-updates "$LM_VALID_EVERY" \
        --save-interval-updates "$SAVE_EVERY" --keep-interval-updates 1 --no-epoch-checkpoints --seed 1
    if [ ! -f "$save/test.ppl" ]; then
        log "test perplexity of $name"
        # every test token scored once, with at least 192 tokens of context
        fairseq-eval-lm "$DOCS" --user-dir "$PLUGIN" --cpu --path "$save/checkpoint_best.pt" --gen-subset test --tokens-per-sample 256 \
            --context-window 192 --max-tokens 4096 --sample-break-mode none > "$save/test.out" 2>&1
        grep -h "Perplexity" "$save/test.out" | tail -n 1 > "$save/test.ppl.tmp"
        mv "$save/test.ppl.tmp" "$save/test.ppl"
    fi
}

# --- Figure 9: depth at constant parameters ----------------------------------------------------

# checkpoint_stamp CHECKPOINT: its size and time, the first line of what was computed from it, so that a result
# of an earlier checkpoint_last.pt (a run evaluated before it finished) is not taken for the last one's
checkpoint_stamp() { echo "checkpoint $(stat -c '%s bytes, modified %Y' "$1")"; }

# computed_from CHECKPOINT FILE: whether FILE holds what was computed from CHECKPOINT as it is now
computed_from() { [ -f "$2" ] && [ "$(head -n 1 "$2")" = "$(checkpoint_stamp "$1")" ]; }

bits_per_byte() {  # bits_per_byte CHECKPOINT SPLIT: fairseq-eval-lm's last line, beside the checkpoint
    local out=${1%.pt}.$2
    computed_from "$1" "$out.bpb" && return 0
    fairseq-eval-lm "$DOCS_BYTES" --user-dir "$PLUGIN" --cpu --task feedback_language_modeling --path "$1" \
        --gen-subset "$2" --tokens-per-sample 128 --batch-size "$DEPTH_EVAL_STREAMS" > "$out.out" 2>&1
    { checkpoint_stamp "$1"; grep -h "Loss (base 2)" "$out.out" | tail -n 1; } > "$out.bpb.tmp"
    mv "$out.bpb.tmp" "$out.bpb"
}

# bytes_lm FOLDER LAYERS SEED OPTIONS...: a feedback_lm of LAYERS layers with DEPTH_BASE layers' parameters
bytes_lm() {
    local name=$1 layers=$2 split
    if (( DEPTH_BASE * DEPTH_HEAD_DIM % layers || DEPTH_BASE * DEPTH_FFN % layers )); then
        log "depth $layers: $DEPTH_BASE layers' head dimension $DEPTH_HEAD_DIM and FFN $DEPTH_FFN do not divide by it"
        return 1
    fi
    train "$name" "$DOCS_BYTES" "$DEPTH_UPDATES" --task feedback_language_modeling --arch feedback_lm \
        --decoder-layers "$layers" $DEPTH_SIZES --head-dim $((DEPTH_BASE * DEPTH_HEAD_DIM / layers)) \
        --decoder-ffn-embed-dim $((DEPTH_BASE * DEPTH_FFN / layers)) $DEPTH_TRAIN $DEPTH_VALID \
        --validate-interval-updates "$DEPTH_VALID_EVERY" --save-interval-updates "$DEPTH_VALID_EVERY" \
        --no-epoch-checkpoints --seed "$3" "${@:4}"
    for split in valid test; do bits_per_byte "$OUT/$name/checkpoint_last.pt" "$split"; done
}

depth() { bytes_lm "depth/$1" "${@:2}"; }  # depth NAME LAYERS SEED OPTIONS...

# --- Training in passes (docs/passes.md) ------------------------------------------------------

# passes NAME GxK SEED OPTIONS...: Figure 9's 2-layer feedback model (depth feedback_2) trained in passes,
# G positions at a time, K passes each, evaluated exactly
passes() { bytes_lm "passes/$1" 2 "$3" --per-layer-kv --pass-group "${2%x*}" --train-passes "${2#*x}" "${@:4}"; }

# passes_benchmark GxK: feedback-benchmark's language-model table with the model trained in passes GxK beside
# exact feedback and fairseq's transformer_lm, at PASSES_BENCHMARK's sizes (the runs' own): operators per position
passes_benchmark() {
    local out=$OUT/benchmarks/passes.$1.json
    [ -f "$out" ] && return 0
    mkdir -p "$OUT/benchmarks"
    # shellcheck disable=SC2086  # the options split into words on purpose
    feedback-benchmark $PASSES_BENCHMARK --only lm --threads 1 --train-passes "${1#*x}" --pass-group "${1%x*}" \
        --json "$out" > "$OUT/logs/benchmark.passes.$1.log" 2>&1
}

# passes_gap RUN: its last checkpoint's bits per byte on the first blocks of the valid split (the curves'
# validation) computed in each setting of PASSES_GAP beside exactly: how far the same weights' two modes part
passes_gap() {
    local out=$1/checkpoint_last.passes_gap
    if ! computed_from "$1/checkpoint_last.pt" "$out"; then
        # shellcheck disable=SC2086  # the options split into words on purpose
        { checkpoint_stamp "$1/checkpoint_last.pt"
          python -m fairseq_feedback_cli.passes_gap --data "$DOCS_BYTES" --path "$1/checkpoint_last.pt" \
              --passes "$PASSES_GAP" $PASSES_GAP_READ; } > "$out.tmp"
        mv "$out.tmp" "$out"
    fi
    tail -n +2 "$out"
}

bpb_of() {  # bpb_of CHECKPOINT SPLIT: the number of its bits_per_byte line, computed from it as it is now
    bits_per_byte "$1" "$2"
    grep -o "Loss (base 2): [0-9.]*" "${1%.pt}.$2.bpb" | awk '{print $4}'
}

cpu_of() {  # cpu_of RUN: its CPU seconds for its updates (train's rule: its recorded processes' per update)
    awk -v n="$DEPTH_UPDATES" '{s += $1 + $2; u += $3} END {print s / u * n}' "$1/cpu_seconds"
}

depth_rows() {  # depth_rows RUN...: each run at its last update, then the mean and range across seeds
    local run
    echo "| model | parameters | updates | CPU hours | valid bpb | test bpb |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: |"
    for run in "$@"; do
        echo "| $(basename "$run") | $(grep -o "model params: [0-9,]*" "$run/train.out" | head -n 1 | cut -d' ' -f3) |" \
            "$DEPTH_UPDATES | $(awk -v s="$(cpu_of "$run")" 'BEGIN {printf "%.2f", s / 3600}') |" \
            "$(bpb_of "$run/checkpoint_last.pt" valid) | $(bpb_of "$run/checkpoint_last.pt" test) |"
    done
    echo
    echo "Across seeds, at $DEPTH_UPDATES updates: the mean, and the range from the lowest to the highest"
    echo
    echo "| model | seeds | valid bpb | test bpb |"
    echo "| --- | ---: | ---: | ---: |"
    for run in "$@"; do
        echo "$(basename "$run" | sed -E 's/_seed[0-9]+$//') $(bpb_of "$run/checkpoint_last.pt" valid)" \
            "$(bpb_of "$run/checkpoint_last.pt" test)"
    done | awk '{n[$1]++; v[$1] += $2; t[$1] += $3
                 if (!($1 in vlo) || $2 < vlo[$1]) vlo[$1] = $2; if ($2 > vhi[$1]) vhi[$1] = $2
                 if (!($1 in tlo) || $3 < tlo[$1]) tlo[$1] = $3; if ($3 > thi[$1]) thi[$1] = $3}
                END {for (m in n) printf "| %s | %d | %.4f (%.4f-%.4f) | %.4f (%.4f-%.4f) |\n", m, n[m],
                     v[m] / n[m], vlo[m], vhi[m], t[m] / n[m], tlo[m], thi[m]}' | sort
}

# equal_cpu_rows RUN...: each run's last checkpoint within the CPU time the quickest run took (Figure 9's
# question: depth at equal compute; a run in passes saves its steps on a GPU, not on one CPU thread)
equal_cpu_rows() {
    local run fastest updates checkpoint
    local -A cpu
    for run in "$@"; do cpu[$run]=$(cpu_of "$run"); done
    fastest=$(printf '%s\n' "${cpu[@]}" | sort -g | head -n 1)
    echo
    echo "At the CPU time of the quickest: the last checkpoint of each within $fastest s (CPU time spread evenly over updates)"
    echo
    echo "| model | updates | valid bpb | test bpb |"
    echo "| --- | ---: | ---: | ---: |"
    for run in "$@"; do
        updates=$(awk -v t="$fastest" -v c="${cpu[$run]}" -v n="$DEPTH_UPDATES" -v e="$DEPTH_VALID_EVERY" \
            'BEGIN {print int(t / c * n / e + 1e-9) * e}')
        checkpoint=$run/checkpoint_last.pt  # the same as checkpoint_1_$DEPTH_UPDATES.pt, evaluated already
        [ "$updates" -lt "$DEPTH_UPDATES" ] && checkpoint=$(compgen -G "$run/checkpoint_*_$updates.pt" | head -n 1 || true)
        if [ -z "$checkpoint" ]; then
            echo "| $(basename "$run") | $updates | no checkpoint | |"
            continue
        fi
        echo "| $(basename "$run") | $updates | $(bpb_of "$checkpoint" valid) | $(bpb_of "$checkpoint" test) |"
    done
}

# --- Table 1: toy tasks ---------------------------------------------------------------------------

toy_data() {  # toy_data NAME KIND OPTIONS...: the episodes and their binarized inputs and labels, built aside then moved in place
    local raw=$OUT/data/$1 bin=$OUT/data/$1-bin kind=$2
    if [ ! -d "$raw" ]; then
        python -m fairseq_feedback_cli.data_prep.toy_tasks "$kind" --seed 1 ${@:3} --out "$raw"
    fi
    if [ ! -d "$bin" ]; then
        rm -rf "$bin.tmp"
        local part
        for part in input labels; do
            fairseq-preprocess --only-source --trainpref "$raw/$kind/train.$part" \
                --validpref "$raw/$kind/valid.$part" --testpref "$raw/$kind/test.$part" \
                --destdir "$bin.tmp/${part/input/.}" > "$OUT/logs/preprocess.$1.$part.log" 2>&1
        done
        mv "$bin.tmp" "$bin"
    fi
}

toy() {  # toy TASK NAME OPTIONS...: a task's EVAL_EVERY updates at a time, each checkpoint tested
    local task=$1 name=$2 save=$OUT/toy/$1/$2 data=$OUT/data/$1-bin kind updates every sizes options u
    case $task in
        algorithmic3) kind=algorithmic updates=$TOY_UPDATES every=$TOY_EVAL_EVERY sizes=$TOY_SIZES options=$TOY_TRAIN ;;
        random_walk) kind=random_walk updates=$WALK_UPDATES every=$WALK_EVAL_EVERY sizes=$WALK_SIZES options=$WALK_TRAIN ;;
    esac
    for ((u = every; u <= updates; u += every)); do
        [ -f "$save/test.$u.json" ] && continue
        rm -f "$save/trained"  # the next stretch of the same run
        train "toy/$task/$name" "$data" "$u" --task feedback_language_modeling --labels labels \
            --arch feedback_lm_toy $sizes $options --disable-validation --save-interval 1000000 --seed 1 \
            "${@:3}"
        log "testing $task $name at $u updates"
        feedback-evaluate-toy --task "$kind" --data "$data" --path "$save/checkpoint_last.pt" \
            --raw "$OUT/data/$task/$kind/test.labels" --output "$save/test.$u.predictions" \
            --batch-size 128 --json > "$save/test.$u.json.tmp"
        mv "$save/test.$u.json.tmp" "$save/test.$u.json"
    done
}

# --- the runs, two at a time, most needed first -------------------------------------------------

RUNS=(
    "translation feedback_dec1 feedback_transformer 1 1"
    "translation transformer_dec1 transformer 1 1"
    "language_model feedback_lm --seed 1"
    "language_model feedback_lm_no_feedback --no-feedback --seed 1"
    "transformer_lm"
    "toy algorithmic3 feedback"
    "toy algorithmic3 transformer --no-feedback"
    "toy random_walk feedback"
    "toy random_walk transformer --no-feedback"
    "translation feedback_dec2 feedback_transformer 2 1"
    "translation transformer_dec2 transformer 2 1"
    "translation feedback_dec1_seed2 feedback_transformer 1 2"
    "translation transformer_dec1_seed2 transformer 1 2"
)
for seed in $DEPTH_SEEDS; do
    suffix=$([ "$seed" = 1 ] || echo "_seed$seed")
    RUNS+=("depth transformer_2$suffix 2 $seed --no-feedback" "depth transformer_6$suffix 6 $seed --no-feedback"
           "depth feedback_2$suffix 2 $seed --per-layer-kv")
done

# Training in passes: each setting (GxK) on the bytes and on the random walk, beside exact training and the
# Transformer of the same size (the runs above); PASSES_SEED2, those also trained with seed 2 on the bytes (the
# cheapest within 1% of exact there); PASSES_BYTES_MORE and PASSES_WALK_MORE, runs of other options, one per
# line (passes' and toy's arguments; empty: none), the walk's best setting with seed 2 among them
PASSES=${PASSES:-"16x2 16x4 64x4"}
PASSES_BENCHMARK=${PASSES_BENCHMARK:-"--preset bytes"}
PASSES_GAP=${PASSES_GAP:-"16x2,16x4,16x8,64x4,64x16"}  # the settings each seed-1 model is evaluated in
PASSES_GAP_READ=${PASSES_GAP_READ:-"--batch-size 64 --tokens-per-sample 128 --max-blocks 6"}
PASSES_SEED2=${PASSES_SEED2:-"64x4"}
PASSES_BYTES_MORE=${PASSES_BYTES_MORE-"feedback_2_16x4_last 16x4 1 --pass-gradients last
feedback_2_16x4_none 16x4 1 --pass-initial-memory none"}
PASSES_WALK_MORE=${PASSES_WALK_MORE-"feedback_16x2_none --train-passes 2 --pass-group 16 --pass-initial-memory none
feedback_16x4_none --train-passes 4 --pass-group 16 --pass-initial-memory none
feedback_16x4_last --train-passes 4 --pass-group 16 --pass-gradients last
feedback_8x2 --train-passes 2 --pass-group 8
feedback_16x8 --train-passes 8 --pass-group 16
feedback_4x4 --train-passes 4 --pass-group 4
feedback_16x4_seed2 --train-passes 4 --pass-group 16 --seed 2
feedback_seed2 --seed 2"}
for setting in $PASSES; do
    RUNS+=("passes feedback_2_$setting $setting 1"
           "toy random_walk feedback_$setting --pass-group ${setting%x*} --train-passes ${setting#*x}")
done
for setting in $PASSES_SEED2; do RUNS+=("passes feedback_2_${setting}_seed2 $setting 2"); done
[ -z "$PASSES_BYTES_MORE" ] || while read -r more; do RUNS+=("passes $more"); done <<< "$PASSES_BYTES_MORE"
[ -z "$PASSES_WALK_MORE" ] || while read -r more; do RUNS+=("toy random_walk $more"); done <<< "$PASSES_WALK_MORE"

# RUNS_ONLY: some of these runs, one per line (the summary then reports those)
[ -z "${RUNS_ONLY:-}" ] || mapfile -t RUNS <<< "$RUNS_ONLY"

mkdir -p "$OUT/logs"
toy_data algorithmic3 algorithmic --variables 3 $TOY_EPISODES
toy_data random_walk random_walk $WALK_EPISODES
declare -A running=()
failed=0
wait_one() {
    local pid
    wait -n -p pid || true
    wait "$pid" || { log "FAILED: ${running[$pid]} (its log: $OUT/logs/)"; failed=1; }
    unset "running[$pid]"
}
for run in "${RUNS[@]}"; do
    while [ "${#running[@]}" -ge "$JOBS" ]; do wait_one; done
    # shellcheck disable=SC2086  # a run is a function and its arguments
    ( $run ) > "$OUT/logs/${run// /_}.log" 2>&1 &
    running[$!]=$run
done
while [ "${#running[@]}" -gt 0 ]; do wait_one; done
[ "$failed" = 0 ] || { log "some runs failed: nothing summarised"; exit 1; }

# --- curves and rows ---------------------------------------------------------------------------

mkdir -p "$OUT/plots"
runs_of() { compgen -G "$OUT/$1" || true; }  # the folders of the runs made (RUNS_ONLY may leave some out)
# the runs of runs_of whose training finished (another run of this script may be training the others)
trained_runs_of() { local run; for run in $(runs_of "$1"); do [ ! -f "$run/trained" ] || echo "$run"; done; }
logs_of() { local run; for run in "$@"; do echo "$run/train.log"; done; }
# shellcheck disable=SC2046,SC2086  # the lists split into folders on purpose
{
    mt=$(runs_of "*_dec*")
    if [ -n "$mt" ]; then
        echo "## translation (test sacreBLEU; decoding speed from fairseq-generate)"
        for run in $mt; do
            echo "$(basename "$run"): $(head -n 1 "$run/test.bleu") |" \
                "$(grep -ho 'in [0-9.]*s ([0-9.]* sentences/s, [0-9.]* tokens/s)' "$run/test.out")"
        done
        python -m fairseq_feedback_cli.curves log --out "$OUT/plots/debian_de_en.png" --metric valid_ppl \
            --title "Debian de-en: validation perplexity" $(logs_of $mt)
    fi
    lm=$(runs_of "*lm*")
    if [ -n "$lm" ]; then
        echo "## language models (test perplexity, fairseq-eval-lm)"
        for run in $lm; do echo "$(basename "$run"): $(cat "$run/test.ppl")"; done
        python -m fairseq_feedback_cli.curves log --out "$OUT/plots/debian_docs.png" --metric valid_ppl \
            --title "Debian manuals: validation perplexity" $(logs_of $lm)
    fi
    depth=$(trained_runs_of "depth/*")
    if [ -n "$depth" ]; then
        echo "## Figure 9 at CPU scale: depth at constant parameters (the Debian manuals as bytes)"
        depth_rows $depth
        equal_cpu_rows $depth
        python -m fairseq_feedback_cli.curves log --out "$OUT/plots/depth.png" --metric valid_loss \
            --label "valid bits per byte" --clock cpu --title "Debian manuals as bytes: depth at constant parameters" \
            $(logs_of $depth) > /dev/null
    fi
    passes=$(trained_runs_of "passes/*")
    if [ -n "$passes" ]; then
        echo "## Training in passes: Figure 9's 2-layer feedback model on the bytes (exact: depth/feedback_2)"
        # shellcheck disable=SC2046
        depth_rows $(trained_runs_of "depth/feedback_2*") $(trained_runs_of "depth/transformer_2*") $passes
        python -m fairseq_feedback_cli.curves log --out "$OUT/plots/passes.png" --metric valid_loss \
            --label "valid bits per byte" --clock cpu --title "Debian manuals as bytes: training in passes" \
            $(logs_of $(trained_runs_of "depth/feedback_2*") $(trained_runs_of "depth/transformer_2*") $passes) \
            > /dev/null
        for setting in $PASSES; do passes_benchmark "$setting"; done
        echo
        echo "What a training step cost: CPU seconds per update (each run's), operators per position" \
             "(feedback-benchmark $PASSES_BENCHMARK, one thread; the Transformer's: fairseq's transformer_lm)"
        echo
        python -m fairseq_feedback_cli.curves price --out "$OUT/plots/passes_price.png" --metric valid_loss \
            --label "valid bits per byte" --title "Debian manuals as bytes: quality against the cost of a step" \
            --benchmark "$OUT"/benchmarks/passes.*.json \
            -- $(logs_of $(trained_runs_of "depth/feedback_2*") $(trained_runs_of "depth/transformer_2*") $passes)
        echo
        echo "The same weights in passes and exactly: bits per byte of the valid split's first blocks"
        for run in $(trained_runs_of "depth/feedback_2") \
                   $(for setting in $PASSES; do trained_runs_of "passes/feedback_2_$setting"; done); do
            echo
            passes_gap "$run"
        done
        walks=$(runs_of "toy/random_walk/feedback_*x[0-9]*")  # PASSES' and PASSES_WALK_MORE's
        if [ -n "$walks" ]; then
            echo "## Training in passes: the random walk (test set; exact: feedback, Transformer: transformer)"
            python -m fairseq_feedback_cli.curves toy --out "$OUT/plots/passes" $(runs_of "toy/random_walk/feedback") \
                $(runs_of "toy/random_walk/feedback_seed*") $(runs_of "toy/random_walk/transformer") $walks
        fi
    fi
    toys=$(runs_of "toy/*/*")
    if [ -n "$toys" ]; then
        echo "## Table 1: the algorithmic task with 3 variables, the random walk (test set)"
        python -m fairseq_feedback_cli.curves toy --out "$OUT/plots" $toys
    fi
} > "$OUT/summary.md.tmp"
mv "$OUT/summary.md.tmp" "$OUT/summary.md"
log "done: $OUT/summary.md, $OUT/plots/"
