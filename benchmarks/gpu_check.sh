#!/usr/bin/env bash
# GPU acceptance: the product's own scripts, with Ray, on the full-size SD 1.x architecture with
# random weights (no download), end to end, with a killed worker and a resumed run on the way.
#
#   benchmarks/gpu_check.sh                      GPU machine: --model sd15 (needs torch, Ray, diffusers)
#   benchmarks/gpu_check.sh --model tiny         CPU dry run of the same sequence (the test suite runs it)
#   benchmarks/gpu_check.sh --part pipeline      only Steps 1-6 below; --part bench: only Step 7
#   benchmarks/gpu_check.sh --part lora          Steps L1-L3 below (not part of 'all')
#
# On a GPU machine that has torch and transformers but no network: bring the wheels of what it lacks
# (Ray and diffusers at requirements.txt's versions, with their own requirements), made on a machine
# with the same Python that reaches PyPI:
#   pip download -d wheels "ray[data,train]==2.60.0" diffusers==0.42.1 tomli-w==1.2.0 --python-version 3.12 --only-binary=:all:
#   pip install --no-index --find-links wheels "ray[data,train]" diffusers tomli-w && bash benchmarks/gpu_check.sh  # there
#
# Steps: 1 build the random model (cache_model.py) -> 2 subject photos -> 3 eight class images on the
# Ray Data actor pool (generate.py) -> 4 train 30 steps (60 on tiny), checkpoint every 10 (UNet + text encoder,
# prior loss, default precision: bf16 on GPU), SIGKILL the train worker after the first checkpoint
# (Ray restarts it from there), Ctrl-C the driver after the second -> 5 resume from 'latest' to the
# end and save -> 6 four images from the tuned model -> 7 benchmarks/bench.py (Ray Train vs plain
# loop, online VAE and cached latents, generation at batch 8) and the plain loop's peak memory with
# gradient checkpointing. Prints one Markdown table; exits non-zero if any step misbehaves.
# LoRA part: L1 train LoRA adapters (UNet + text encoder) 20 steps with a checkpoint, validation
# images and TensorBoard events every 10 -> L2 four images from the base model + adapters
# (generate.py --lora_weights_dir, as Ray's example writes it) -> L3 bench.py plain loop, full vs
# LoRA: images/s and peak memory (LoRA also with gradient checkpointing). Builds the model and class images first if --work has none.
set -euo pipefail

MODEL=sd15
PART=all
WORK=${TMPDIR:-/tmp}/dreambooth-gpu-check
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --part) PART=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ "$MODEL" = tiny ]; then
  # Tiny steps take ~0.3 s: with only 10 after checkpoint 20 the run could end before Ctrl-C lands (60: 40 left).
  # The dry run benches the full variant only (each variant is a Ray Train run and two plain ones).
  INFERENCE_STEPS=2; TRAIN_STEPS=60; VARIANTS=full; LORA_STEPS=20
  BENCH=(--steps 5 --warmup 5 --logging_steps 5 --plain_warmup 1 --inference_steps 2)
else
  INFERENCE_STEPS=50; TRAIN_STEPS=30; VARIANTS=full,frozen,cached; LORA_STEPS=20; BENCH=()
fi
TABLE=()

# Run a command, add its wall time to the table.
timed() {
  local name=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  "$@"
  t1=$(date +%s.%N)
  TABLE+=("| wall time: $name | $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") | s | |")
}

fail() { echo "gpu_check: FAILED: $*" >&2; exit 1; }

# Until Ray Train has registered a checkpoint of at least STEP (a restart resumes from it), while PID lives: one
# Python process that looks every half second (a process started per look cost half a CPU-second each, a minute of
# them per run on the tiny model). Prints the step of the checkpoint it found.
wait_for_checkpoint() {  # STEP PID
  "$PY" - "$WORK/ray_results" "$1" "$2" <<'EOF' || fail "train.py ended before writing checkpoint $1 (see $WORK/train-1.log)"
import os, sys, time
from dreambooth.planning import checkpoints
folder, step, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def registered():  # (the newest checkpoint Ray Train's controller registered: what a restart resumes from)
    runs = [os.path.join(folder, run) for run in (os.listdir(folder) if os.path.isdir(folder) else [])
            if checkpoints.is_run_of(run, "tuned")]
    return max([0, *(s or 0 for run in runs for s in checkpoints.registered_steps(run))])
def alive():
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # (an ended process its shell has not reaped yet: a zombie)
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except OSError:
        return True  # (no /proc: os.kill said it lives)
while True:
    found = registered()
    if found >= step:
        print(found)
        sys.exit(0)
    if not alive():
        sys.exit(1)
    time.sleep(0.5)
EOF
}

# SIGKILL this run's train worker, named by the pid Ray prefixes its lines with in the run's log (LOG): never
# another run's, on this machine or on the cluster the run joined.
kill_own_worker() {
  local pid
  pid=$(grep -o 'RayTrainWorker pid=[0-9]*' "$1" | tail -n 1 | cut -d= -f2)
  [ -n "$pid" ] || fail "no Ray Train worker named in $1 to kill"
  kill -9 "$pid" || fail "could not kill the Ray Train worker $pid named in $1"
}

# Steps 1-3: the random model, the subject photos, eight class images.
prepare() {
  rm -rf "$WORK"
  mkdir -p "$WORK/own"
  timed "1 build random $MODEL model" \
    "$PY" cache_model.py --model_dir "$WORK/model-orig" --random_model "$MODEL" > "$WORK/model-path"
  MODEL_PATH=$(tail -n 1 "$WORK/model-path")
  cp images/toy/*.jpg "$WORK/own/"
  timed "3 generate 8 class images" "$PY" generate.py --model_dir "$MODEL_PATH" --output_dir "$WORK/reg" \
    --prompts "photo of a toy" --num_samples_per_prompt 8 --batch_size 8 --num_inference_steps "$INFERENCE_STEPS"
  [ "$(ls "$WORK/reg"/*.png | wc -l)" -eq 8 ] || fail "expected 8 class images"
}

pipeline() {
  prepare

  TRAIN=("$PY" train.py --model_dir "$MODEL_PATH" --output_dir "$WORK/tuned" --storage_path "$WORK/ray_results"
         --instance_data_dir "$WORK/own" --instance_prompt "photo of unqtkn toy"
         --class_data_dir "$WORK/reg" --class_prompt "photo of a toy" --num_workers 1
         --max_train_steps "$TRAIN_STEPS" --checkpointing_steps 10 --logging_steps 5 --checkpoints_total_limit 1)
  local t0 t1 pid rc
  t0=$(date +%s.%N)
  "${TRAIN[@]}" > "$WORK/train-1.log" 2>&1 &
  pid=$!
  step=$(wait_for_checkpoint 10 "$pid")  # (a failure inside ends the script: set -e)
  kill_own_worker "$WORK/train-1.log"
  echo "gpu_check: killed the train worker after checkpoint $step" >&2
  wait_for_checkpoint 20 "$pid" > /dev/null
  kill -INT "$pid"
  rc=0
  wait "$pid" || rc=$?
  t1=$(date +%s.%N)
  TABLE+=("| wall time: 4 train to step 20, worker killed at 10, Ctrl-C at 20 | $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") | s | exit $rc |")
  [ "$rc" -eq 130 ] || { tail -n 30 "$WORK/train-1.log" >&2; fail "Ctrl-C'd train.py exited $rc, not 130"; }
  grep -q "resume_from_checkpoint latest" "$WORK/train-1.log" || fail "no resume hint after Ctrl-C"
  grep -q "step=15" "$WORK/train-1.log" || fail "training did not go on past the killed worker"

  timed "5 resume from latest to step $TRAIN_STEPS + save" "${TRAIN[@]}" --resume_from_checkpoint latest \
    > "$WORK/train-2.log" 2>&1 || { tail -n 30 "$WORK/train-2.log" >&2; fail "resumed train.py failed"; }
  grep -q "resuming from" "$WORK/train-2.log" || fail "the rerun did not resume"
  grep -q "trained $TRAIN_STEPS steps" "$WORK/train-2.log" || fail "the resumed run did not finish $TRAIN_STEPS steps"
  [ -f "$WORK/tuned/dreambooth_training.json" ] || fail "no tuned model"

  timed "6 generate 4 images from the tuned model" "$PY" generate.py --model_dir "$WORK/tuned" \
    --output_dir "$WORK/new" --prompts "photo of unqtkn toy in a bucket" --num_samples_per_prompt 4 \
    --batch_size 4 --num_inference_steps "$INFERENCE_STEPS"
  [ "$(ls "$WORK/new"/*.png "$WORK/new"/*.flagged 2>/dev/null | wc -l)" -eq 4 ] || fail "expected 4 new images"
  grep -h "worker devices" "$WORK"/train-*.log | head -n 1 | sed 's/^.*worker devices/gpu_check: worker devices/' >&2
}

bench() {
  # Ray Train vs the plain loop: VAE + text encoder each step, frozen text encoder, cached latents; generation at batch 8.
  timed "7 bench.py (Ray, ${VARIANTS//,/ + }, generation batch 8)" "$PY" benchmarks/bench.py --model "$MODEL" \
    --variants "$VARIANTS" --gen_batches 8 "${BENCH[@]}" > "$WORK/bench.md"
  # Peak memory of the same step with gradient checkpointing (plain loop, no Ray needed).
  timed "7 bench.py (plain, gradient checkpointing)" "$PY" benchmarks/bench.py --model "$MODEL" --no_ray \
    --variants full --gradient_checkpointing --skip_generation "${BENCH[@]}" > "$WORK/bench-gc.md"
  grep -q "Ray Train 1 worker, full" "$WORK/bench.md" || fail "bench.py printed no Ray row"
}

lora() {
  if [ -f "$WORK/model-path" ] && [ "$(ls "$WORK/reg"/*.png 2>/dev/null | wc -l)" -eq 8 ]; then
    MODEL_PATH=$(tail -n 1 "$WORK/model-path")
  else
    prepare
  fi
  rm -rf "$WORK/lora" "$WORK/lora_results" "$WORK/lora-new"
  timed "L1 train LoRA $LORA_STEPS steps (checkpoint + 2 validation images every 10)" \
    "$PY" train.py --model_dir "$MODEL_PATH" --output_dir "$WORK/lora" --storage_path "$WORK/lora_results" \
    --instance_data_dir "$WORK/own" --instance_prompt "photo of unqtkn toy" --class_data_dir "$WORK/reg" \
    --class_prompt "photo of a toy" --num_workers 1 --use_lora --max_train_steps "$LORA_STEPS" \
    --checkpointing_steps 10 --logging_steps 5 --validation_prompt "photo of unqtkn toy on a beach" \
    --num_validation_images 2 --validation_inference_steps "$INFERENCE_STEPS" --report_to tensorboard \
    > "$WORK/lora-train.log" 2>&1 || { tail -n 30 "$WORK/lora-train.log" >&2; fail "LoRA train.py failed"; }
  [ -f "$WORK/lora/pytorch_lora_weights.safetensors" ] || fail "no pytorch_lora_weights.safetensors"
  [ "$(ls "$WORK"/lora_results/*/validation/step-"$LORA_STEPS"/*.png | wc -l)" -eq 2 ] \
    || fail "expected 2 validation images at step $LORA_STEPS"
  ls "$WORK"/lora_results/*/tensorboard/events.* > /dev/null || fail "no TensorBoard events"
  ls "$WORK"/lora_results/*/loss.png > /dev/null || fail "no loss.png"
  timed "L2 generate 4 images, base model + LoRA" "$PY" generate.py --model_dir "$MODEL_PATH" \
    --lora_weights_dir "$WORK/lora" --output_dir "$WORK/lora-new" --prompts "photo of unqtkn toy in a bucket" \
    --num_samples_per_prompt 4 --batch_size 4 --num_inference_steps "$INFERENCE_STEPS"
  [ "$(ls "$WORK/lora-new"/*.png "$WORK/lora-new"/*.flagged 2>/dev/null | wc -l)" -eq 4 ] || fail "expected 4 LoRA images"
  timed "L3 bench.py (plain, full + lora)" "$PY" benchmarks/bench.py --model "$MODEL" --no_ray \
    --variants full,lora --skip_generation "${BENCH[@]}" > "$WORK/bench-lora.md"
  grep -q "plain loop, lora: peak memory" "$WORK/bench-lora.md" || fail "bench.py printed no LoRA row"
  timed "L3 bench.py (plain, lora, gradient checkpointing)" "$PY" benchmarks/bench.py --model "$MODEL" --no_ray \
    --variants lora --gradient_checkpointing --skip_generation "${BENCH[@]}" > "$WORK/bench-lora-gc.md"
}

mkdir -p "$WORK"
case "$PART" in
  all) pipeline; bench ;;
  pipeline) pipeline ;;
  bench) bench ;;
  lora) lora ;;
  *) fail "--part must be all, pipeline, bench or lora" ;;
esac

{
  echo
  echo "## gpu_check.sh --model $MODEL ($("$PY" -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")'), $(date -u +%Y-%m-%d))"
  echo
  echo "| measure | value | unit | note |"
  echo "| --- | ---: | --- | --- |"
  printf '%s\n' "${TABLE[@]}"
  if [ -f "$WORK/bench.md" ] && [ "$PART" != lora ]; then
    grep '^model=' "$WORK/bench.md" | sed 's/^/| bench.py: /; s/ *$/ | | | |/'
    grep '^| ' "$WORK/bench.md" | grep -v '^| measure\|^| ---'
  fi
  if [ -f "$WORK/bench-lora.md" ] && [ "$PART" = lora ]; then
    grep '^model=' "$WORK/bench-lora.md" | sed 's/^/| bench.py: /; s/ *$/ | | | |/'
    grep '^| plain loop' "$WORK/bench-lora.md"
    grep '^| plain loop, lora' "$WORK/bench-lora-gc.md" | sed 's/^| plain loop, lora/| plain loop, lora, gradient checkpointing/'
  fi
  if [ -f "$WORK/bench-gc.md" ] && [ "$PART" != lora ]; then
    grep '^| plain loop, full: peak memory' "$WORK/bench-gc.md" \
      | sed 's/^| plain loop, full: peak memory/| plain loop, full, gradient checkpointing: peak memory/'
  fi
} | tee "$WORK/table.md"
echo "gpu_check: OK ($WORK/table.md)" >&2
