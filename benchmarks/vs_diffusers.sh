#!/usr/bin/env bash
# train.py against diffusers' examples/dreambooth/train_dreambooth.py, side by side on this machine:
# the same random SD 1.x model (cache_model.py --random_model small), the same 256 px photos and class
# images, 1 instance + 1 class image per step, text encoder trained, fp32, learning rate 5e-6.
# Each tool trains 10 and then 40 steps, ROUNDS times, alternating; per-step cost is the slope of
# wall time between the two lengths, fixed cost what remains. Prints one row per run and a summary.
#
#   benchmarks/vs_diffusers.sh /path/to/train_dreambooth.py [ROUNDS]
#
# The reference needs accelerate and torchvision (not in requirements.txt): set REF_PYTHON to a
# Python that has them besides diffusers and transformers (default: python3).
set -euo pipefail
REF_SCRIPT=${1:?usage: vs_diffusers.sh /path/to/train_dreambooth.py [ROUNDS]}
ROUNDS=${2:-3}
REF_SCRIPT=$(realpath "$REF_SCRIPT")
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
REF_PY=${REF_PYTHON:-python3}
WORK=${TMPDIR:-/tmp}/dreambooth-vs-diffusers
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
rm -rf "$WORK" && mkdir -p "$WORK/own"

MODEL=$("$PY" cache_model.py --model_dir "$WORK/cache" --random_model small | tail -1)
cp images/toy/*.jpg "$WORK/own/"
"$PY" generate.py --model_dir "$MODEL" --output_dir "$WORK/class" --prompts "photo of a toy" \
  --num_samples_per_prompt 5 --num_inference_steps 2 --resolution 256 >/dev/null 2>&1
rm -rf "$WORK/class/grid"

ours() {
  "$PY" train.py --model_dir "$MODEL" --output_dir "$WORK/out-ours" --overwrite \
    --instance_data_dir "$WORK/own" --instance_prompt "photo of unqtkn toy" \
    --class_data_dir "$WORK/class" --class_prompt "photo of a toy" --resolution 256 \
    --train_batch_size 1 --num_workers 1 --learning_rate 5e-6 --max_train_steps "$1" \
    --checkpointing_steps 100000 --logging_steps 10 --seed 0 >"$WORK/log-ours-$1" 2>&1
}

reference() {
  "$REF_PY" "$REF_SCRIPT" --pretrained_model_name_or_path "$MODEL" --output_dir "$WORK/out-ref" \
    --instance_data_dir "$WORK/own" --instance_prompt "photo of unqtkn toy" \
    --with_prior_preservation --class_data_dir "$WORK/class" --class_prompt "photo of a toy" \
    --num_class_images 5 --resolution 256 --train_batch_size 1 --train_text_encoder \
    --learning_rate 5e-6 --lr_scheduler constant --lr_warmup_steps 0 --max_train_steps "$1" \
    --checkpointing_steps 100000 --seed 0 >"$WORK/log-ref-$1" 2>&1
}

wall() {  # seconds of "$@"
  local t0 t1
  t0=$(date +%s.%N)
  "$@" || { echo "vs_diffusers: '$*' failed; log in $WORK" >&2; exit 1; }
  t1=$(date +%s.%N)
  awk "BEGIN { printf \"%.2f\", $t1 - $t0 }"
}

echo "| round | tool | 10 steps s | 40 steps s | s/step | fixed s |"
echo "| --- | --- | --- | --- | --- | --- |"
RESULTS=()
for round in $(seq "$ROUNDS"); do
  for tool in reference ours; do
    short=$(wall "$tool" 10)
    long=$(wall "$tool" 40)
    row=$(awk "BEGIN { s = ($long - $short) / 30; printf \"%.3f %.1f\", s, $short - 10 * s }")
    RESULTS+=("$tool $row")
    echo "| $round | $tool | $short | $long | ${row% *} | ${row#* } |"
  done
done
printf '%s\n' "${RESULTS[@]}" | awk '
  { step[$1] += $2; fixed[$1] += $3; n[$1]++ }
  END {
    printf "per step: ours %.3f s, reference %.3f s, ratio %.3f; fixed: ours %.1f s, reference %.1f s\n",
      step["ours"] / n["ours"], step["reference"] / n["reference"], (step["ours"] / n["ours"]) / (step["reference"] / n["reference"]),
      fixed["ours"] / n["ours"], fixed["reference"] / n["reference"]
  }'
